//! The memory ledger: model states under mixed-precision AdamW and ZeRO, the KV cache,
//! and the per-GPU total. Activation bytes come from the graph
//! ([`crate::graph_cost`]); this module holds the state arithmetic.

use serde::{Deserialize, Serialize};

/// Bytes per parameter of the compute copy (bf16/fp16).
pub const PARAM_BYTES: f64 = 2.0;
/// Bytes per parameter of the gradient.
pub const GRAD_BYTES: f64 = 2.0;
/// Bytes per parameter of AdamW's fp32 master weights, momentum and variance (`K = 12`).
pub const OPTIMIZER_BYTES: f64 = 12.0;

/// Model-state bytes on one GPU holding `params` parameters replicated over a
/// data-parallel group of `dp` under ZeRO `stage` (ZeRO paper, Sec. 3.1):
/// stage 0 `16 P`, stage 1 `4 P + 12 P / dp`, stage 2 `2 P + 14 P / dp`, stage 3 `16 P / dp`.
///
/// Returns (params, grads, optimizer) bytes.
pub fn model_state_bytes(params: f64, dp: u64, stage: u8) -> (f64, f64, f64) {
    model_state_bytes_with(params, dp, stage, GRAD_BYTES)
}

/// [`model_state_bytes`] with gradients held in `grad_bytes` per element: Megatron-LM's
/// fp32 main gradients (4) make stage 0 `18 P`.
pub fn model_state_bytes_with(params: f64, dp: u64, stage: u8, grad_bytes: f64) -> (f64, f64, f64) {
    let d = dp.max(1) as f64;
    let p = PARAM_BYTES * params / if stage >= 3 { d } else { 1.0 };
    let g = grad_bytes * params / if stage >= 2 { d } else { 1.0 };
    let o = OPTIMIZER_BYTES * params / if stage >= 1 { d } else { 1.0 };
    (p, g, o)
}

/// KV cache bytes: `layers x tokens x 2 x kv_heads x head_dim x bytes`, given the
/// per-token-per-layer figure `2 x kv_heads x head_dim x bytes`.
pub fn kv_cache_bytes(layers: u64, tokens: f64, bytes_per_token_layer: f64) -> f64 {
    layers as f64 * tokens * bytes_per_token_layer
}

/// Per-GPU memory, the contract's `memory_per_gpu_bytes`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryLedger {
    /// Compute copy of the parameters.
    pub params: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer states (fp32 master, momentum, variance).
    pub optimizer: f64,
    /// Activations kept for backward (training) or live during a step (inference).
    pub activations: f64,
    /// KV cache (inference).
    pub kv_cache: f64,
    /// Runtime, library workspaces and communication buffers.
    pub workspace: f64,
    /// Sum of the above.
    pub total: f64,
}

impl MemoryLedger {
    /// Fills `total`.
    pub fn summed(mut self) -> MemoryLedger {
        self.total = self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.kv_cache
            + self.workspace;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixteen_bytes_per_parameter() {
        // A 7B model's states: 16 x 7e9 = 112 GB.
        let (p, g, o) = model_state_bytes(7e9, 1, 0);
        assert_eq!(p + g + o, 112e9);
    }

    #[test]
    fn zero_stages_match_the_zero_paper() {
        // Psi = 7.5e9, Nd = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
        let total = |stage| {
            let (p, g, o) = model_state_bytes(7.5e9, 64, stage);
            (p + g + o) / 1e9
        };
        assert!((total(0) - 120.0).abs() < 1e-9);
        assert!((total(1) - 31.40625).abs() < 1e-9);
        assert!((total(2) - 16.640625).abs() < 1e-9);
        assert!((total(3) - 1.875).abs() < 1e-9);
    }

    #[test]
    fn llama3_70b_kv_cache_at_8k() {
        // 80 layers x 8192 tokens x 2 x 8 kv heads x 128 x 2 bytes = 2,684,354,560 B (2.5 GiB).
        let per = 2.0 * 8.0 * 128.0 * 2.0;
        assert_eq!(kv_cache_bytes(80, 8192.0, per), 2_684_354_560.0);
    }
}
