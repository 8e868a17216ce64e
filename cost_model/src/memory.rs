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
/// Bytes per parameter of an fp32 master weight.
const MASTER_BYTES: f64 = 4.0;

/// How a framework holds the model states of AdamW training: the precision of the
/// compute copy and of the gradients. ZeRO 1-2 partition the fp32 masters with the
/// moments in every framework modelled (the ZeRO paper, Megatron-LM's distributed
/// optimizer, DeepSpeed, FSDP, meshplan's executor).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Holding {
    /// Bytes per element of the compute copy (the model's dtype). An fp32 model
    /// computes on its masters and keeps no second copy.
    pub compute_bytes: f64,
    /// Bytes per element of the gradients held (never below the compute copy's).
    pub grad_bytes: f64,
}

/// The ZeRO paper's mixed-precision accounting: fp16 parameters and gradients,
/// `K = 12` bytes of optimizer state, all partitioned by stage.
pub const ZERO_PAPER: Holding = Holding {
    compute_bytes: PARAM_BYTES,
    grad_bytes: GRAD_BYTES,
};

/// Model-state bytes on one GPU holding `params` parameters replicated over a
/// data-parallel group of `dp` under ZeRO `stage` (ZeRO paper, Sec. 3.1):
/// stage 0 `16 P`, stage 1 `4 P + 12 P / dp`, stage 2 `2 P + 14 P / dp`, stage 3 `16 P / dp`.
///
/// Returns (params, grads, optimizer) bytes.
pub fn model_state_bytes(params: f64, dp: u64, stage: u8) -> (f64, f64, f64) {
    model_states(params, dp, stage, ZERO_PAPER)
}

/// [`model_state_bytes`] as framework `h` holds them: the compute copy, the gradients
/// (Megatron-LM's fp32 main gradients make stage 0 `18 P` and its distributed
/// optimizer `6 P + 12 P / dp`), fp32 masters unless the compute copy is fp32
/// itself, and AdamW's two fp32 moments (8 bytes), each divided by `dp` from the
/// stage that partitions it.
pub fn model_states(params: f64, dp: u64, stage: u8, h: Holding) -> (f64, f64, f64) {
    let d = dp.max(1) as f64;
    let over = |from: bool| if from { d } else { 1.0 };
    let p = h.compute_bytes * params / over(stage >= 3);
    let g = h.grad_bytes.max(h.compute_bytes) * params / over(stage >= 2);
    let master = if h.compute_bytes < MASTER_BYTES {
        MASTER_BYTES
    } else {
        0.0
    };
    let optimizer = (master + OPTIMIZER_BYTES - MASTER_BYTES) * params / over(stage >= 1);
    (p, g, optimizer)
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
    fn holdings_by_hand() {
        let h = |compute_bytes, grad_bytes| Holding {
            compute_bytes,
            grad_bytes,
        };
        let per_param = |stage, hold| {
            let (p, g, o) = model_states(1.0, 4, stage, hold);
            [p, g, o]
        };
        // bf16 with fp32 gradients (Megatron-LM, meshplan): 2 + 4 + (4 + 8) = 18
        // per parameter; its distributed optimizer 6 + 12 / 4 = 9; ZeRO-2 and 3
        // divide the gradients, then the compute copy.
        assert_eq!(per_param(0, h(2.0, 4.0)), [2.0, 4.0, 12.0]);
        assert_eq!(per_param(1, h(2.0, 4.0)), [2.0, 4.0, 3.0]);
        assert_eq!(per_param(2, h(2.0, 4.0)), [2.0, 1.0, 3.0]);
        assert_eq!(per_param(3, h(2.0, 4.0)), [0.5, 1.0, 3.0]);
        // fp32 computes on its masters: 4 + 4 + 8 = 16, and gradients never
        // narrower than the weights.
        assert_eq!(per_param(0, h(4.0, 2.0)), [4.0, 4.0, 8.0]);
        assert_eq!(per_param(1, h(4.0, 4.0)), [4.0, 4.0, 2.0]);
        // The paper's accounting is the 2-byte holding.
        assert_eq!(
            model_state_bytes(7.0, 4, 1),
            model_states(7.0, 4, 1, h(2.0, 2.0))
        );
    }

    #[test]
    fn llama3_70b_kv_cache_at_8k() {
        // 80 layers x 8192 tokens x 2 x 8 kv heads x 128 x 2 bytes = 2,684,354,560 B (2.5 GiB).
        let per = 2.0 * 8.0 * 128.0 * 2.0;
        assert_eq!(kv_cache_bytes(80, 8192.0, per), 2_684_354_560.0);
    }
}
