//! Latency distributions in constant memory: a histogram with buckets 1 % apart, from a
//! microsecond to a day, so a run of a hundred million inter-token gaps keeps ~2,500 counters
//! and any percentile is within 1 % of the true value.

/// Smallest value kept apart (seconds); smaller ones count in the first bucket.
const MIN: f64 = 1e-6;
/// Growth from one bucket to the next.
const GROWTH: f64 = 1.01;
/// Buckets: up to about 86,400 s.
const BUCKETS: usize = 2_540;

/// A histogram of durations in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    counts: Vec<u64>,
    n: u64,
    sum: f64,
    max: f64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self { counts: vec![0; BUCKETS], n: 0, sum: 0.0, max: 0.0 }
    }
}

impl Histogram {
    /// Counts one value (negative and NaN values count as zero).
    pub fn record(&mut self, secs: f64) {
        let v = if secs.is_nan() { 0.0 } else { secs.max(0.0) };
        let bucket = if v <= MIN { 0 } else { ((v / MIN).ln() / GROWTH.ln()).ceil() as usize };
        self.counts[bucket.min(BUCKETS - 1)] += 1;
        self.n += 1;
        self.sum += v;
        self.max = self.max.max(v);
    }

    /// Values counted.
    pub fn count(&self) -> u64 {
        self.n
    }

    /// Their mean (0 if none).
    pub fn mean(&self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.sum / self.n as f64
        }
    }

    /// The largest.
    pub fn max(&self) -> f64 {
        self.max
    }

    /// The `q` quantile (`q` in [0, 1]): the upper edge of the bucket holding it, so at most
    /// 1 % above the true value; 0 if empty.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.n == 0 {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                if i == BUCKETS - 1 {
                    return self.max; // the overflow bucket
                }
                return (MIN * GROWTH.powi(i as i32)).min(self.max);
            }
        }
        self.max
    }

    /// The distribution as `(value, fraction of values at most it)` points, one per bucket
    /// holding any (each bucket's upper edge; the overflow bucket at the largest value).
    pub fn cdf(&self) -> Vec<(f64, f64)> {
        let mut seen = 0;
        let n = self.n.max(1) as f64;
        let mut points = Vec::new();
        for (i, &c) in self.counts.iter().enumerate().filter(|(_, c)| **c > 0) {
            seen += c;
            let edge = if i == BUCKETS - 1 { self.max } else { MIN * GROWTH.powi(i as i32) };
            points.push((edge.min(self.max), seen as f64 / n));
        }
        points
    }

    /// Adds `other`'s counts.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.n += other.n;
        self.sum += other.sum;
        self.max = self.max.max(other.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_a_percent() {
        let mut h = Histogram::default();
        let values: Vec<f64> = (1..=10_000).map(|i| f64::from(i) * 1e-4).collect();
        for v in &values {
            h.record(*v);
        }
        for q in [0.01, 0.5, 0.9, 0.99, 1.0] {
            let exact = values[((q * 10_000.0) as usize).max(1) - 1];
            let got = h.quantile(q);
            assert!(got >= exact * 0.999 && got <= exact * 1.0101, "q{q}: {got} vs {exact}");
        }
        assert!((h.mean() - 0.50005).abs() < 1e-9);
        assert_eq!(h.count(), 10_000);
        let mut other = Histogram::default();
        other.record(5.0);
        h.merge(&other);
        assert_eq!(h.quantile(1.0), 5.0);
        assert_eq!(Histogram::default().quantile(0.5), 0.0);
        let cdf = h.cdf();
        assert!(cdf.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1), "increasing");
        assert_eq!(cdf.last().unwrap(), &(5.0, 1.0));
        assert!(Histogram::default().cdf().is_empty());
        h.record(f64::NAN);
        h.record(1e9);
        assert_eq!(h.quantile(1.0), 1e9);
    }
}
