//! The distributions a generated workload draws from: when requests arrive ([`Arrivals`]) and
//! how long their prompts and outputs are ([`Lengths`]), each parsed from its command-line form
//! and drawn from the workload's [`Rng`].

use super::rng::Rng;

/// How requests arrive.
#[derive(Debug, Clone, PartialEq)]
pub enum Arrivals {
    /// A Poisson process of `rate` requests per second.
    Poisson {
        /// Requests per second.
        rate: f64,
    },
    /// Gamma-distributed gaps of mean `1 / rate` and coefficient of variation `cv` (bursty
    /// above 1, regular below; 1 is Poisson).
    Gamma {
        /// Requests per second.
        rate: f64,
        /// Coefficient of variation of the gaps.
        cv: f64,
    },
    /// Every request at time zero (an offline batch, as `trtllm-bench` and vLLM's
    /// `--request-rate inf` run).
    AllAtOnce,
}

impl Arrivals {
    /// Parses `poisson:RATE`, `gamma:RATE:CV` or `inf`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let num = |p: &str, what: &str| -> Result<f64, String> {
            p.parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("{what} in {s:?} must be a number > 0"))
        };
        match parts.as_slice() {
            ["inf"] => Ok(Self::AllAtOnce),
            ["poisson", rate] => Ok(Self::Poisson { rate: num(rate, "the rate")? }),
            ["gamma", rate, cv] => {
                Ok(Self::Gamma { rate: num(rate, "the rate")?, cv: num(cv, "the cv")? })
            }
            _ => Err(format!("arrivals {s:?}: expected poisson:RATE, gamma:RATE:CV or inf")),
        }
    }

    /// The gap before the next arrival, seconds.
    pub(super) fn gap(&self, rng: &mut Rng) -> f64 {
        match *self {
            Self::Poisson { rate } => rng.exponential(1.0 / rate),
            Self::Gamma { rate, cv } => {
                let k = 1.0 / (cv * cv);
                rng.gamma(k, 1.0 / (rate * k))
            }
            Self::AllAtOnce => 0.0,
        }
    }
}

/// A distribution of lengths (tokens).
#[derive(Debug, Clone, PartialEq)]
pub enum Lengths {
    /// Always `n`.
    Fixed(u32),
    /// Uniform in `lo..=hi`.
    Uniform(u32, u32),
    /// Log-normal with this median and `sigma` (of the logarithm), clamped to `1..=max`.
    LogNormal {
        /// The median.
        median: f64,
        /// Standard deviation of the logarithm.
        sigma: f64,
        /// Largest length drawn.
        max: u32,
    },
    /// Drawn from a histogram: `(length, weight)` pairs.
    Histogram(Vec<(u32, f64)>),
}

impl Lengths {
    /// Parses `N`, `LO:HI`, `lognormal:MEDIAN:SIGMA[:MAX]` or `hist:FILE` (lines of `length
    /// weight`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let int = |p: &str| -> Result<u32, String> {
            p.parse::<u32>()
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| format!("lengths {s:?}: {p:?} is not a length > 0"))
        };
        let parts: Vec<&str> = s.split(':').collect();
        match parts.as_slice() {
            [n] => Ok(Self::Fixed(int(n)?)),
            ["hist", path] => Self::histogram_file(path),
            ["lognormal", median, sigma, rest @ ..] => {
                let f = |p: &str| p.parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0);
                let (Some(median), Some(sigma)) = (f(median), f(sigma)) else {
                    return Err(format!("lengths {s:?}: median and sigma must be numbers > 0"));
                };
                let max = match rest {
                    [] => 32_768,
                    [m] => int(m)?,
                    _ => return Err(format!("lengths {s:?}: lognormal:MEDIAN:SIGMA[:MAX]")),
                };
                Ok(Self::LogNormal { median, sigma, max })
            }
            [lo, hi] => {
                let (lo, hi) = (int(lo)?, int(hi)?);
                if lo > hi {
                    return Err(format!("lengths {s:?}: {lo} > {hi}"));
                }
                Ok(Self::Uniform(lo, hi))
            }
            _ => Err(format!(
                "lengths {s:?}: expected N, LO:HI, lognormal:MEDIAN:SIGMA[:MAX] or hist:FILE"
            )),
        }
    }

    fn histogram_file(path: &str) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("histogram {path}: {e}"))?;
        let mut bins = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut f = line.split_whitespace();
            let (Some(len), Some(w), None) = (f.next(), f.next(), f.next()) else {
                return Err(format!("histogram {path}:{}: expected `length weight`", n + 1));
            };
            let len = len.parse::<u32>().ok().filter(|l| *l > 0);
            let w = w.parse::<f64>().ok().filter(|w| w.is_finite() && *w >= 0.0);
            let (Some(len), Some(w)) = (len, w) else {
                return Err(format!("histogram {path}:{}: bad length or weight", n + 1));
            };
            bins.push((len, w));
        }
        if bins.iter().map(|b| b.1).sum::<f64>() <= 0.0 {
            return Err(format!("histogram {path}: no weight"));
        }
        Ok(Self::Histogram(bins))
    }

    /// One draw.
    pub fn draw(&self, rng: &mut Rng) -> u32 {
        match self {
            Self::Fixed(n) => *n,
            Self::Uniform(lo, hi) => rng.range(u64::from(*lo), u64::from(*hi)) as u32,
            Self::LogNormal { median, sigma, max } => {
                let v = median * (sigma * rng.normal()).exp();
                (v.round() as u32).clamp(1, *max)
            }
            Self::Histogram(bins) => {
                let total: f64 = bins.iter().map(|b| b.1).sum();
                let mut x = rng.unit() * total;
                for &(len, w) in bins {
                    if x < w {
                        return len;
                    }
                    x -= w;
                }
                bins.last().map_or(1, |b| b.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean_and_cv(v: &[f64]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn arrival_gaps_have_the_asked_mean_and_spread() {
        let mut rng = Rng::new(7);
        for (arrivals, cv) in [
            (Arrivals::Poisson { rate: 4.0 }, 1.0),
            (Arrivals::Gamma { rate: 4.0, cv: 3.0 }, 3.0),
            (Arrivals::Gamma { rate: 4.0, cv: 0.5 }, 0.5),
        ] {
            let gaps: Vec<f64> = (0..200_000).map(|_| arrivals.gap(&mut rng)).collect();
            let (m, c) = mean_and_cv(&gaps);
            assert!((m - 0.25).abs() < 0.01, "{arrivals:?}: mean {m}");
            assert!((c - cv).abs() < 0.06 * cv, "{arrivals:?}: cv {c}");
        }
        assert_eq!(Arrivals::parse("gamma:2:1.5"), Ok(Arrivals::Gamma { rate: 2.0, cv: 1.5 }));
        assert!(Arrivals::parse("poisson:-1").is_err());
        assert_eq!(Arrivals::parse("inf"), Ok(Arrivals::AllAtOnce));
    }

    #[test]
    fn lengths_follow_their_distribution() {
        let mut rng = Rng::new(1);
        let l = Lengths::parse("lognormal:500:0.8").unwrap();
        let mut v: Vec<u32> = (0..100_001).map(|_| l.draw(&mut rng)).collect();
        v.sort_unstable();
        let median = f64::from(v[50_000]);
        assert!((median - 500.0).abs() < 15.0, "median {median}");
        let u = Lengths::parse("10:20").unwrap();
        assert!((0..1000).map(|_| u.draw(&mut rng)).all(|x| (10..=20).contains(&x)));
        assert!(Lengths::parse("20:10").is_err());
        assert!(Lengths::parse("0").is_err());
        let dir = std::env::temp_dir().join(format!("ferry-sim-hist-{}", std::process::id()));
        std::fs::write(&dir, "# len weight\n100 3\n1000 1\n").unwrap();
        let h = Lengths::parse(&format!("hist:{}", dir.display())).unwrap();
        let long = (0..40_000).filter(|_| h.draw(&mut rng) == 1000).count();
        assert!((9_000..11_000).contains(&long), "{long}");
        let _ = std::fs::remove_file(dir);
    }
}
