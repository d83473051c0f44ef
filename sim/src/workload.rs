//! Workloads: when requests arrive, how long their prompts and outputs are, which of them share
//! a prefix; generated from a seed (the same seed, the same requests) or read from a trace.
//!
//! Requests are produced one at a time, in arrival order, so a run of a million requests never
//! holds more than the ones in flight.

use std::io::BufRead;
use std::sync::Arc;

/// A small, fast, seedable generator (`SplitMix64`): reproducible across platforms and
/// versions, which the simulator's "same seed, same report" needs.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in (0, 1]: safe to take the logarithm of.
    fn open_unit(&mut self) -> f64 {
        1.0 - self.unit()
    }

    /// A standard normal draw (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.open_unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    /// An exponential draw of mean `mean`.
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * self.open_unit().ln()
    }

    /// A gamma draw of shape `k` and scale `theta` (Marsaglia–Tsang; shape < 1 boosted).
    pub fn gamma(&mut self, k: f64, theta: f64) -> f64 {
        if k < 1.0 {
            let boost = self.open_unit().powf(1.0 / k);
            return self.gamma(k + 1.0, theta) * boost;
        }
        let d = k - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = (1.0 + c * x).powi(3);
            if v <= 0.0 {
                continue;
            }
            let u = self.open_unit();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v * theta;
            }
        }
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// `SplitMix64`'s finaliser: a bijective mix of 64 bits.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

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
    fn gap(&self, rng: &mut Rng) -> f64 {
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

/// Groups of requests that share a prefix: `groups` system prompts of `prefix_len` tokens,
/// each request in one of them (uniformly), its own tokens after the prefix.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixGroups {
    /// Distinct shared prefixes.
    pub groups: u32,
    /// Tokens of each.
    pub prefix_len: u32,
}

/// Multi-turn conversations: each arrival opens one, whose turns each send the whole
/// conversation so far (earlier prompts and answers) plus a new user message, after the user
/// read the previous answer and thought for a while.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversations {
    /// Turns per conversation (at least 1).
    pub turns: Lengths,
    /// Mean seconds between an answer and the next turn (exponential).
    pub think_time: f64,
    /// Tokens of each later turn's new user message.
    pub user_len: Lengths,
}

/// A later turn of a conversation, sent `think` seconds after the previous answer ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Turn {
    /// Seconds after the previous answer.
    pub think: f64,
    /// Tokens of its new user message.
    pub user_len: u32,
    /// Tokens of its answer.
    pub output_len: u32,
}

/// Group ids of conversations start here (above any `--prefix-groups`).
pub const CONVERSATION_GROUPS: u32 = 1 << 31;

/// A request of the workload.
#[derive(Debug, Clone)]
pub struct SimRequest {
    /// Its number, from 0 in arrival order.
    pub index: u64,
    /// Arrival, seconds from the start.
    pub arrival: f64,
    /// Prompt tokens.
    pub prompt: Arc<[u32]>,
    /// Output tokens it generates (it ignores EOS).
    pub output_len: u32,
    /// Its prefix group, if any.
    pub group: Option<u32>,
    /// The conversation it is a turn of, if any: its whole prompt, and its answer, are that
    /// conversation's tokens ([`shared_token`]), so a later turn's prompt starts with them.
    pub conversation: Option<u32>,
    /// The conversation's turns after this one.
    pub follow_ups: Vec<Turn>,
}

impl SimRequest {
    /// The next turn of this request's conversation, `index` its number: the conversation so
    /// far (this prompt and its `output_len` answer tokens) and a new user message; `None` if
    /// it was the last.
    pub fn next_turn(&self, index: u64, arrival: f64, vocab: u32) -> Option<SimRequest> {
        let conversation = self.conversation?;
        let (turn, rest) = self.follow_ups.split_first()?;
        let len = self.prompt.len() as u32 + self.output_len + turn.user_len;
        Some(SimRequest {
            index,
            arrival,
            prompt: prompt_tokens(index, len, Some(conversation), len, vocab),
            output_len: turn.output_len,
            group: Some(conversation),
            conversation: Some(conversation),
            follow_ups: rest.to_vec(),
        })
    }
}

/// A generated workload.
#[derive(Debug, Clone)]
pub struct Generated {
    /// When requests arrive.
    pub arrivals: Arrivals,
    /// Prompt lengths (the whole prompt, prefix included).
    pub prompt: Lengths,
    /// Output lengths.
    pub output: Lengths,
    /// Shared prefixes, if any.
    pub prefixes: Option<PrefixGroups>,
    /// Multi-turn conversations, if any (then each request opens one).
    pub conversations: Option<Conversations>,
    /// Requests in all (conversations, with `conversations`).
    pub requests: u64,
    /// Token ids are drawn below this.
    pub vocab_size: u32,
}

/// Where requests come from.
#[derive(Debug)]
pub enum Source {
    /// Generated from a seed.
    Generated {
        /// What to generate.
        spec: Generated,
        /// Its generator.
        rng: Rng,
        /// Requests made so far.
        made: u64,
        /// The last arrival, seconds.
        clock: f64,
    },
    /// Read from a JSONL trace: one object per line with `arrival` (seconds),
    /// `prompt_len`, `output_len` and optionally `prefix_group` and `prefix_len`.
    Trace {
        /// Its lines.
        lines: std::io::Lines<std::io::BufReader<std::fs::File>>,
        /// Its name, for errors.
        path: String,
        /// Requests read so far.
        made: u64,
        /// Lines read so far.
        line: u64,
        /// Token ids are drawn below this.
        vocab_size: u32,
        /// The last arrival (a trace must be in arrival order).
        clock: f64,
    },
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceLine {
    arrival: f64,
    prompt_len: u32,
    output_len: u32,
    #[serde(default)]
    prefix_group: Option<u32>,
    #[serde(default)]
    prefix_len: u32,
}

/// The tokens of a prompt of `len` tokens whose first `prefix_len` are group `group`'s shared
/// prefix and the rest request `index`'s own.
pub fn prompt_tokens(
    index: u64,
    len: u32,
    group: Option<u32>,
    prefix_len: u32,
    vocab: u32,
) -> Arc<[u32]> {
    let shared = if group.is_some() { prefix_len.min(len) } else { 0 };
    let g = group.unwrap_or(0);
    (0..len)
        .map(|i| {
            if i < shared {
                shared_token(g, u64::from(i), vocab)
            } else {
                let key = mix((index << 24) ^ u64::from(i) ^ 0xB0B0_0000_0000_0000);
                (key % u64::from(vocab.max(2))) as u32
            }
        })
        .collect()
}

/// Token `position` of group `group`'s shared sequence: a prefix group's system prompt, or a
/// conversation's prompts and answers.
pub fn shared_token(group: u32, position: u64, vocab: u32) -> u32 {
    let key = mix(0xA11CE ^ (u64::from(group) << 32) ^ (position & 0xFFFF_FFFF));
    (key % u64::from(vocab.max(2))) as u32
}

impl Source {
    /// Requests generated from `spec` with `seed`.
    pub fn generated(spec: Generated, seed: u64) -> Self {
        Self::Generated { spec, rng: Rng::new(seed), made: 0, clock: 0.0 }
    }

    /// Requests read from the JSONL trace at `path`.
    pub fn trace(path: &str, vocab_size: u32) -> Result<Self, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("trace {path}: {e}"))?;
        let lines = std::io::BufReader::new(file).lines();
        Ok(Self::Trace { lines, path: path.into(), made: 0, line: 0, vocab_size, clock: 0.0 })
    }

    /// The next request, `None` after the last; an error for a bad trace line.
    pub fn next_request(&mut self) -> Result<Option<SimRequest>, String> {
        match self {
            Self::Generated { spec, rng, made, clock } => {
                if *made >= spec.requests {
                    return Ok(None);
                }
                let index = *made;
                *made += 1;
                *clock += spec.arrivals.gap(rng);
                let len = spec.prompt.draw(rng);
                let output_len = spec.output.draw(rng);
                let (group, prefix_len) = match spec.prefixes {
                    Some(p) if p.groups > 0 => {
                        (Some(rng.range(0, u64::from(p.groups) - 1) as u32), p.prefix_len)
                    }
                    _ => (None, 0),
                };
                if let Some(c) = &spec.conversations {
                    // The whole prompt is the conversation's; later turns extend it.
                    let conversation = CONVERSATION_GROUPS | (index as u32 & !CONVERSATION_GROUPS);
                    let turns = c.turns.draw(rng).max(1);
                    let follow_ups = (1..turns)
                        .map(|_| Turn {
                            think: rng.exponential(c.think_time),
                            user_len: c.user_len.draw(rng),
                            output_len: spec.output.draw(rng),
                        })
                        .collect();
                    let prompt =
                        prompt_tokens(index, len, Some(conversation), len, spec.vocab_size);
                    return Ok(Some(SimRequest {
                        index,
                        arrival: *clock,
                        prompt,
                        output_len,
                        group: Some(conversation),
                        conversation: Some(conversation),
                        follow_ups,
                    }));
                }
                let prompt = prompt_tokens(index, len, group, prefix_len, spec.vocab_size);
                Ok(Some(SimRequest {
                    index,
                    arrival: *clock,
                    prompt,
                    output_len,
                    group,
                    conversation: None,
                    follow_ups: Vec::new(),
                }))
            }
            Self::Trace { lines, path, made, line, vocab_size, clock } => loop {
                let Some(text) = lines.next() else { return Ok(None) };
                *line += 1;
                let text = text.map_err(|e| format!("trace {path}: {e}"))?;
                if text.trim().is_empty() {
                    continue;
                }
                let t: TraceLine =
                    serde_json::from_str(&text).map_err(|e| format!("trace {path}:{line}: {e}"))?;
                if !t.arrival.is_finite() || t.arrival < *clock {
                    return Err(format!(
                        "trace {path}:{line}: arrival {} is before the previous line's {}",
                        t.arrival, clock
                    ));
                }
                if t.prompt_len == 0 || t.output_len == 0 {
                    return Err(format!("trace {path}:{line}: lengths must be at least 1"));
                }
                *clock = t.arrival;
                let index = *made;
                *made += 1;
                let prompt =
                    prompt_tokens(index, t.prompt_len, t.prefix_group, t.prefix_len, *vocab_size);
                return Ok(Some(SimRequest {
                    index,
                    arrival: t.arrival,
                    prompt,
                    output_len: t.output_len,
                    group: t.prefix_group,
                    conversation: None,
                    follow_ups: Vec::new(),
                }));
            },
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

    #[test]
    fn the_same_seed_makes_the_same_requests_and_groups_share_prefixes() {
        let spec = Generated {
            arrivals: Arrivals::Poisson { rate: 10.0 },
            prompt: Lengths::Uniform(100, 200),
            output: Lengths::Fixed(8),
            prefixes: Some(PrefixGroups { groups: 3, prefix_len: 64 }),
            conversations: None,
            requests: 50,
            vocab_size: 1000,
        };
        let all = |seed| {
            let mut s = Source::generated(spec.clone(), seed);
            std::iter::from_fn(|| s.next_request().unwrap()).collect::<Vec<_>>()
        };
        let (a, b, c) = (all(1), all(1), all(2));
        assert_eq!(a.len(), 50);
        let key = |v: &[SimRequest]| {
            v.iter().map(|r| (r.arrival.to_bits(), r.prompt.clone(), r.group)).collect::<Vec<_>>()
        };
        assert_eq!(key(&a), key(&b));
        assert_ne!(key(&a), key(&c));
        assert!(a.windows(2).all(|w| w[0].arrival <= w[1].arrival));
        for x in &a {
            for y in &a {
                let same = x.prompt[..64] == y.prompt[..64];
                assert_eq!(same, x.group == y.group, "{} {}", x.index, y.index);
                if x.index != y.index {
                    assert_ne!(x.prompt[64..], y.prompt[64..]);
                }
            }
        }
    }

    #[test]
    fn a_trace_gives_its_requests_in_order_and_a_bad_line_is_refused_by_number() {
        let path =
            std::env::temp_dir().join(format!("ferry-sim-trace-{}.jsonl", std::process::id()));
        let lines = [
            r#"{"arrival": 0.5, "prompt_len": 40, "output_len": 3, "prefix_group": 7, "prefix_len": 32}"#,
            "",
            r#"{"arrival": 0.5, "prompt_len": 50, "output_len": 4, "prefix_group": 7, "prefix_len": 32}"#,
            r#"{"arrival": 2.0, "prompt_len": 10, "output_len": 1}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let mut source = Source::trace(path.to_str().unwrap(), 1000).unwrap();
        let all: Vec<SimRequest> = std::iter::from_fn(|| source.next_request().unwrap()).collect();
        assert_eq!(all.len(), 3);
        assert_eq!(all.iter().map(|r| r.arrival).collect::<Vec<_>>(), [0.5, 0.5, 2.0]);
        assert_eq!(all.iter().map(|r| r.prompt.len()).collect::<Vec<_>>(), [40, 50, 10]);
        assert_eq!(all[1].output_len, 4);
        assert_eq!(all[0].prompt[..32], all[1].prompt[..32], "one prefix group");
        assert_ne!(all[0].prompt[32..40], all[1].prompt[32..40]);
        for (bad, want) in [
            (r#"{"arrival": 0.1, "prompt_len": 5, "output_len": 1}"#, ":2: arrival 0.1 is before"),
            (r#"{"arrival": 3.0, "prompt_len": 0, "output_len": 1}"#, ":2: lengths must be"),
            (r#"{"arrival": 3.0, "prompt": 5}"#, "trace"),
        ] {
            std::fs::write(&path, format!("{}\n{bad}\n", lines[0])).unwrap();
            let mut source = Source::trace(path.to_str().unwrap(), 1000).unwrap();
            source.next_request().unwrap();
            let err = source.next_request().unwrap_err();
            assert!(err.contains(want), "{err}");
        }
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn a_later_turn_repeats_the_conversation_so_far() {
        let spec = Generated {
            arrivals: Arrivals::Poisson { rate: 1.0 },
            prompt: Lengths::Fixed(100),
            output: Lengths::Fixed(30),
            prefixes: None,
            conversations: Some(Conversations {
                turns: Lengths::Fixed(3),
                think_time: 2.0,
                user_len: Lengths::Fixed(10),
            }),
            requests: 2,
            vocab_size: 5000,
        };
        let mut source = Source::generated(spec, 9);
        let first = source.next_request().unwrap().unwrap();
        let other = source.next_request().unwrap().unwrap();
        assert_eq!(first.follow_ups.len(), 2);
        assert_ne!(first.conversation, other.conversation);
        let c = first.conversation.unwrap();
        let second = first.next_turn(77, 5.0, 5000).unwrap();
        assert_eq!(second.prompt.len(), 100 + 30 + 10);
        assert_eq!(second.prompt[..100], first.prompt[..], "the first prompt");
        // The answer as the simulator samples it: the conversation's tokens after the prompt.
        for p in 100..130 {
            assert_eq!(second.prompt[p], shared_token(c, p as u64, 5000));
        }
        let third = second.next_turn(78, 9.0, 5000).unwrap();
        assert_eq!(third.prompt[..140], second.prompt[..]);
        assert!(third.next_turn(79, 12.0, 5000).is_none(), "three turns");
    }
}
