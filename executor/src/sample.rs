//! Choosing the next token from a row of logits: greedy, or temperature and nucleus
//! (top-p) sampling with a seeded counter-based generator, so a sharded run and its
//! single-rank reference draw the same token from the same logits.

use crate::init::splitmix;
use meshplan_kernels::cpu::{argmax_parts, Picks};

/// How tokens are chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus mass in (0, 1]: sample among the most likely tokens whose
    /// probabilities first reach it.
    pub top_p: f32,
    /// Seed of the draws.
    pub seed: u64,
}

impl Sampling {
    /// Argmax, no randomness.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
    };

    /// Whether this is greedy decoding.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// The options as given, or a message naming the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "--temperature {}: expected a finite number >= 0 (0 is greedy)",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!(
                "--top-p {}: expected a number in (0, 1]",
                self.top_p
            ));
        }
        Ok(())
    }
}

/// The index of the largest logit (the first of equal ones): the device's greedy
/// pick of one row.
pub fn argmax(logits: &[f32]) -> u32 {
    let n = logits.len();
    let row = Picks {
        parts: 1,
        rows: 1,
        cols: n,
        limit: n,
    };
    argmax_parts(logits, row).map_or(0, |t| t[0])
}

/// A uniform in [0, 1) keyed by the seed, the request and the step.
fn uniform(seed: u64, request: u64, step: u64) -> f64 {
    let k = splitmix(seed ^ splitmix(request.wrapping_mul(0x9e37_79b9).wrapping_add(step)));
    (k >> 11) as f64 / (1u64 << 53) as f64
}

/// The token for `request` at generation `step`.
pub fn sample(logits: &[f32], s: &Sampling, request: u64, step: u64) -> u32 {
    if s.is_greedy() || logits.is_empty() {
        return argmax(logits);
    }
    let t = s.temperature as f64;
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let mut probs: Vec<(f64, u32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &x)| (((x as f64 - max) / t).exp(), i as u32))
        .collect();
    let z: f64 = probs.iter().map(|p| p.0).sum();
    // Most likely first; equal probabilities by index, so the order is total.
    probs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut kept = 0;
    let mut mass = 0.0;
    for p in &probs {
        mass += p.0 / z;
        kept += 1;
        if mass >= s.top_p as f64 {
            break;
        }
    }
    let u = uniform(s.seed, request, step) * mass;
    let mut acc = 0.0;
    for p in &probs[..kept] {
        acc += p.0 / z;
        if u < acc {
            return p.1;
        }
    }
    probs[kept - 1].1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax() {
        assert_eq!(sample(&[0.1, 3.0, -1.0, 3.0], &Sampling::GREEDY, 0, 0), 1);
    }

    #[test]
    fn a_small_nucleus_keeps_only_the_most_likely() {
        let s = Sampling {
            temperature: 1.0,
            top_p: 0.01,
            seed: 9,
        };
        for step in 0..50 {
            assert_eq!(sample(&[0.0, 2.0, 1.0], &s, 3, step), 1);
        }
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        // p = softmax([0, ln 2, ln 3] / 1) = [1/6, 2/6, 3/6].
        let logits = [0.0, 2f32.ln(), 3f32.ln()];
        let s = Sampling {
            temperature: 1.0,
            top_p: 1.0,
            seed: 5,
        };
        let n = 30_000;
        let mut counts = [0usize; 3];
        for step in 0..n {
            counts[sample(&logits, &s, 0, step) as usize] += 1;
        }
        for (i, want) in [1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0].iter().enumerate() {
            let got = counts[i] as f64 / n as f64;
            // Five standard deviations of a binomial proportion.
            let sd = (want * (1.0 - want) / n as f64).sqrt();
            assert!((got - want).abs() < 5.0 * sd, "token {i}: {got} vs {want}");
        }
        // The same seed draws the same tokens; another seed does not.
        let a: Vec<u32> = (0..64).map(|t| sample(&logits, &s, 1, t)).collect();
        let b: Vec<u32> = (0..64).map(|t| sample(&logits, &s, 1, t)).collect();
        let c: Vec<u32> = (0..64)
            .map(|t| sample(&logits, &Sampling { seed: 6, ..s }, 1, t))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn top_p_renormalises_over_the_nucleus() {
        // p = [0.5, 0.3, 0.2]; top_p 0.75 keeps the first two: 5/8 and 3/8.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let s = Sampling {
            temperature: 1.0,
            top_p: 0.75,
            seed: 11,
        };
        let n = 20_000;
        let mut counts = [0usize; 3];
        for step in 0..n {
            counts[sample(&logits, &s, 2, step) as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        let got = counts[0] as f64 / n as f64;
        let sd = (0.625f64 * 0.375 / n as f64).sqrt();
        assert!((got - 0.625).abs() < 5.0 * sd, "{got}");
    }
}
