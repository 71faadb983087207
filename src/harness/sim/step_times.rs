//! Scheduler time per step, kept in a fixed-size log-linear histogram so that a
//! run of any length uses the same memory (a soak of millions of steps must not
//! grow). Percentiles are exact to within one bucket: 32 buckets per power of
//! two, so at most about 3 % above the true value; the maximum is exact.

/// Sub-buckets per power of two.
const SUB: u32 = 32;
/// Values below this many nanoseconds have one bucket each.
const LINEAR: u64 = SUB as u64 * 2;
/// Powers of two covered above `LINEAR` (up to about 2^63 ns).
const OCTAVES: u32 = 58;

/// A histogram of step times in nanoseconds.
#[derive(Debug, Clone)]
pub struct StepTimeHistogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

impl Default for StepTimeHistogram {
    fn default() -> Self {
        Self {
            counts: vec![0; (LINEAR + u64::from(OCTAVES * SUB)) as usize],
            total: 0,
            max: 0,
        }
    }
}

fn bucket(v: u64) -> usize {
    if v < LINEAR {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros(); // >= log2(LINEAR) = 6
    let octave = exp - (LINEAR.trailing_zeros());
    let sub = (v >> (exp - SUB.trailing_zeros())) & u64::from(SUB - 1);
    (LINEAR + u64::from(octave * SUB) + sub) as usize
}

/// The largest value that falls in bucket `b`.
fn upper(b: usize) -> u64 {
    let b = b as u64;
    if b < LINEAR {
        return b;
    }
    let octave = (b - LINEAR) / u64::from(SUB);
    let sub = (b - LINEAR) % u64::from(SUB);
    let exp = octave + u64::from(LINEAR.trailing_zeros());
    let width = 1u64 << (exp - u64::from(SUB.trailing_zeros()));
    (1u64 << exp) + (sub + 1) * width - 1
}

impl StepTimeHistogram {
    /// Records one step's time.
    pub fn record(&mut self, ns: u64) {
        let b = bucket(ns).min(self.counts.len() - 1);
        self.counts[b] += 1;
        self.total += 1;
        self.max = self.max.max(ns);
    }

    /// Steps recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// Largest time recorded (exact).
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The `p`-th percentile (nearest rank), as the upper bound of its bucket
    /// (never above the maximum); 0 when empty.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((p / 100.0) * self.total as f64)
            .ceil()
            .clamp(1.0, self.total as f64) as u64;
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return upper(b).min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_within_one_bucket_of_the_exact_ones() {
        let mut h = StepTimeHistogram::default();
        let mut exact: Vec<u64> = Vec::new();
        let mut x: u64 = 99;
        for _ in 0..50_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = (x % 5_000_000) >> (x % 13); // spread over many octaves
            h.record(v);
            exact.push(v);
        }
        exact.sort_unstable();
        for p in [50.0, 90.0, 99.0, 99.9] {
            let want = crate::harness::sim::summary::percentile(&exact, p);
            let got = h.percentile(p);
            assert!(got >= want, "p{p}: {got} < exact {want}");
            assert!(
                got as f64 <= want as f64 * 1.032 + 1.0,
                "p{p}: {got} vs exact {want}"
            );
        }
        assert_eq!(h.max(), *exact.last().unwrap());
        assert_eq!(h.count(), 50_000);
    }

    #[test]
    fn small_values_are_exact_and_buckets_are_contiguous() {
        let mut h = StepTimeHistogram::default();
        for v in [0, 1, 5, 63] {
            h.record(v);
        }
        assert_eq!(h.percentile(50.0), 1);
        assert_eq!(h.percentile(100.0), 63);
        for v in [64u64, 65, 127, 128, 1000, 1 << 20, u64::MAX >> 2] {
            let b = bucket(v);
            assert!(upper(b) >= v && (b == 0 || upper(b - 1) < v), "value {v}");
        }
        assert_eq!(StepTimeHistogram::default().percentile(99.0), 0);
    }
}
