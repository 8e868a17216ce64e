//! How the next token is chosen: greedy, or temperature and nucleus (top-p)
//! sampling with a seeded counter-based generator, so a sharded run and its
//! single-rank reference draw the same token from the same logits. The device picks
//! it (`Device::pick`, on `kernels::cpu::sample_parts`'s integer weights).

use meshplan_kernels::cpu::Nucleus;

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

    /// The draw of generation step `step`; `None` for greedy decoding.
    pub fn nucleus(&self, step: u64) -> Option<Nucleus> {
        (!self.is_greedy()).then_some(Nucleus {
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            step,
        })
    }
}
