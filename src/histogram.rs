//! A cumulative Prometheus histogram with fixed bucket bounds: a leaf that
//! the scheduler, the remote tier and the metrics module all use.

use std::fmt::Write;

/// Counts of observations per upper bound, their sum and count.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// A histogram with these upper bounds (ascending); `+Inf` is implicit.
    pub fn new(bounds: &[f64]) -> Self {
        Self {
            bounds: bounds.to_vec(),
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one value.
    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Observations recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of the observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// Appends the text exposition of this histogram as `name`.
    pub fn render(&self, o: &mut String, name: &str, help: &str) {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(o, "{name}_bucket{{le=\"{b:e}\"}} {cum}");
        }
        let _ = writeln!(o, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(o, "{name}_sum {}", self.sum);
        let _ = writeln!(o, "{name}_count {}", self.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative() {
        let mut h = Histogram::new(&[1.0, 10.0]);
        for v in [0.5, 5.0, 50.0] {
            h.observe(v);
        }
        let mut o = String::new();
        h.render(&mut o, "x", "help");
        assert!(o.contains("x_bucket{le=\"1e0\"} 1\n"));
        assert!(o.contains("x_bucket{le=\"1e1\"} 2\n"));
        assert!(o.contains("x_bucket{le=\"+Inf\"} 3\n"));
        assert!(o.contains("x_count 3\n"));
    }
}
