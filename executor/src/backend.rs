//! The compute backend the interpreter runs its ops on: one method per kernel, so
//! the same interpreter drives the CPU reference kernels and, with the CUDA issue,
//! GPU kernels. Buffers are host `f32` slices for now; a device backend keeps its own
//! copies keyed by the interpreter's tensors.
//!
//! (Generated from the signatures of `meshplan_kernels::cpu`; keep them in step.)

use meshplan_kernels::cpu::{self, AttnDims, Dropout, KernelError, Rope, Transpose};

/// The kernels an interpreter needs, forward and backward.
#[allow(clippy::too_many_arguments)] // the kernels' own argument lists
pub trait Backend: Send + Sync {
    /// Short name for reports (`cpu`).
    fn name(&self) -> &'static str;
    /// A zeroed buffer of `n` values.
    fn alloc(&self, n: usize) -> Vec<f32> {
        vec![0.0; n]
    }

    /// GELU forward, tanh approximation (GPT-2 / Megatron `gelu`):
    fn gelu_fwd(&self, x: &[f32], y: &mut [f32]) -> Result<(), KernelError>;

    /// GELU backward: `dx += dy * gelu'(x)` (recomputed from `x`).
    fn gelu_bwd(&self, x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError>;

    /// SwiGLU forward: `x [rows, 2f]` laid out `[gate | up]` per row,
    fn swiglu_fwd(
        &self,
        x: &[f32],
        rows: usize,
        f: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError>;

    /// SwiGLU backward: accumulates `dx [rows, 2f]` (`[d_gate | d_up]`) from
    fn swiglu_bwd(
        &self,
        x: &[f32],
        dy: &[f32],
        rows: usize,
        f: usize,
        dx: &mut [f32],
    ) -> Result<(), KernelError>;

    /// Residual add: `out = a + b`.
    fn add(&self, a: &[f32], b: &[f32], out: &mut [f32]) -> Result<(), KernelError>;

    /// Backward of [`add`](Backend::add): `da += d_out`, `db += d_out`.
    fn add_bwd(&self, d_out: &[f32], da: &mut [f32], db: &mut [f32]) -> Result<(), KernelError>;

    /// `acc += x`, elementwise (gradient accumulation); equal lengths.
    fn accumulate(&self, acc: &mut [f32], x: &[f32]);

    /// One AdamW step in place, elementwise over `param`, `grad`, `m`, `v`
    fn adamw_step(
        &self,
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        step: u64,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    ) -> Result<(), KernelError>;

    /// Attention forward over one KV block. Writes `out` and `lse` (see the
    fn attention_fwd(
        &self,
        dims: &AttnDims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        q_pos0: usize,
        k_pos0: usize,
        causal: bool,
        scale: f32,
        out: &mut [f32],
        lse: &mut [f32],
        dropout: Option<&Dropout<'_>>,
    ) -> Result<(), KernelError>;

    /// Folds a partial result `(o_blk, lse_blk)` over another set of keys into
    fn attention_merge(
        &self,
        dims: &AttnDims,
        o_acc: &mut [f32],
        lse_acc: &mut [f32],
        o_blk: &[f32],
        lse_blk: &[f32],
    ) -> Result<(), KernelError>;

    /// Attention backward over one KV block, accumulating into `d_q`, `d_k`,
    fn attention_bwd(
        &self,
        dims: &AttnDims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &[f32],
        lse: &[f32],
        d_o: &[f32],
        q_pos0: usize,
        k_pos0: usize,
        causal: bool,
        scale: f32,
        d_q: &mut [f32],
        d_k: &mut [f32],
        d_v: &mut [f32],
        dropout: Option<&Dropout<'_>>,
    ) -> Result<(), KernelError>;

    /// `out[t, :] = table[ids[t] - vocab_start, :]` for ids owned by this shard,
    fn embedding_fwd(
        &self,
        ids: &[u32],
        table: &[f32],
        vocab_start: usize,
        dim: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError>;

    /// `d_table[ids[t] - vocab_start, :] += d_out[t, :]` for ids owned by this
    fn embedding_bwd(
        &self,
        ids: &[u32],
        d_out: &[f32],
        vocab_start: usize,
        dim: usize,
        d_table: &mut [f32],
    ) -> Result<(), KernelError>;

    /// Local maximum of each row of `logits [rows, v_local]` into `max [rows]`
    fn ce_row_max(
        &self,
        logits: &[f32],
        rows: usize,
        v_local: usize,
        max: &mut [f32],
    ) -> Result<(), KernelError>;

    /// `sumexp[r] = sum_j exp(logits[r, j] - global_max[r])` over this shard.
    fn ce_row_sumexp(
        &self,
        logits: &[f32],
        rows: usize,
        v_local: usize,
        global_max: &[f32],
        sumexp: &mut [f32],
    ) -> Result<(), KernelError>;

    /// `target[r] = logits[r, labels[r] - vocab_start]` when this shard owns the
    fn ce_target_logit(
        &self,
        logits: &[f32],
        labels: &[u32],
        rows: usize,
        v_local: usize,
        vocab_start: usize,
        target: &mut [f32],
    ) -> Result<(), KernelError>;

    /// Per-row loss from the reduced pieces:
    fn ce_loss(
        &self,
        global_max: &[f32],
        global_sumexp: &[f32],
        global_target: &[f32],
        loss: &mut [f32],
    ) -> Result<(), KernelError>;

    /// Gradient of `scale * sum_r loss[r]` w.r.t. this shard's logits,
    fn ce_bwd(
        &self,
        logits: &[f32],
        rows: usize,
        v_local: usize,
        global_max: &[f32],
        global_sumexp: &[f32],
        labels: &[u32],
        vocab_start: usize,
        scale: f32,
        dlogits: &mut [f32],
    ) -> Result<(), KernelError>;

    /// `matmul`.
    fn matmul(
        &self,
        trans_a: Transpose,
        trans_b: Transpose,
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        b: &[f32],
        beta: f32,
        c: &mut [f32],
    ) -> Result<(), KernelError>;

    /// `matmul_batched`.
    fn matmul_batched(
        &self,
        batch: usize,
        trans_a: Transpose,
        trans_b: Transpose,
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        b: &[f32],
        beta: f32,
        c: &mut [f32],
    ) -> Result<(), KernelError>;

    /// Router forward for `logits [tokens, experts]`. Writes
    fn moe_route_fwd(
        &self,
        logits: &[f32],
        tokens: usize,
        experts: usize,
        k: usize,
        renormalize: bool,
        probs: &mut [f32],
        expert_idx: &mut [u32],
        weights: &mut [f32],
    ) -> Result<(), KernelError>;

    /// Router backward: accumulates into `d_logits [tokens, experts]` the
    fn moe_route_bwd(
        &self,
        probs: &[f32],
        expert_idx: &[u32],
        weights: &[f32],
        d_weights: &[f32],
        tokens: usize,
        experts: usize,
        k: usize,
        renormalize: bool,
        d_logits: &mut [f32],
    ) -> Result<(), KernelError>;

    /// Dispatch forward: groups the rows of `x [tokens, dim]` by expert.
    fn moe_dispatch_fwd(
        &self,
        x: &[f32],
        expert_idx: &[u32],
        tokens: usize,
        k: usize,
        experts: usize,
        dim: usize,
        out: &mut [f32],
        counts: &mut [usize],
        perm: &mut [u32],
    ) -> Result<(), KernelError>;

    /// Dispatch backward: `dx[perm[s] / k] += d_out[s]` for every slot, in slot
    fn moe_dispatch_bwd(
        &self,
        d_out: &[f32],
        perm: &[u32],
        tokens: usize,
        k: usize,
        dim: usize,
        dx: &mut [f32],
    ) -> Result<(), KernelError>;

    /// Combine forward: `out[t]` is the sum, over the slots `s` with `perm[s] / k == t`,
    /// of `weights[s] * y[s]`.
    fn moe_combine_fwd(
        &self,
        y: &[f32],
        perm: &[u32],
        weights: &[f32],
        tokens: usize,
        k: usize,
        dim: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError>;

    /// Combine backward: accumulates `d_y [tokens * k, dim]`
    fn moe_combine_bwd(
        &self,
        d_out: &[f32],
        y: &[f32],
        perm: &[u32],
        weights: &[f32],
        tokens: usize,
        k: usize,
        dim: usize,
        d_y: &mut [f32],
        d_weights: &mut [f32],
    ) -> Result<(), KernelError>;

    /// LayerNorm forward: `y = (x - mean) * rstd * weight + bias` per row of
    fn layernorm_fwd(
        &self,
        x: &[f32],
        weight: &[f32],
        bias: &[f32],
        rows: usize,
        dim: usize,
        eps: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) -> Result<(), KernelError>;

    /// LayerNorm backward. Accumulates `dx [rows, dim]`, `dweight [dim]`,
    fn layernorm_bwd(
        &self,
        x: &[f32],
        weight: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dy: &[f32],
        rows: usize,
        dim: usize,
        dx: &mut [f32],
        dweight: &mut [f32],
        dbias: &mut [f32],
    ) -> Result<(), KernelError>;

    /// RMSNorm forward: `y = x * rstd * weight` with
    fn rmsnorm_fwd(
        &self,
        x: &[f32],
        weight: &[f32],
        rows: usize,
        dim: usize,
        eps: f32,
        y: &mut [f32],
        rstd: &mut [f32],
    ) -> Result<(), KernelError>;

    /// RMSNorm backward. Accumulates `dx [rows, dim]` and `dweight [dim]` using
    fn rmsnorm_bwd(
        &self,
        x: &[f32],
        weight: &[f32],
        rstd: &[f32],
        dy: &[f32],
        rows: usize,
        dim: usize,
        dx: &mut [f32],
        dweight: &mut [f32],
    ) -> Result<(), KernelError>;

    /// RoPE forward on `x [tokens, heads, head_dim]` with `positions [tokens]`,
    fn rope_fwd(
        &self,
        x: &[f32],
        positions: &[u32],
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rope: Rope,
        out: &mut [f32],
    ) -> Result<(), KernelError>;

    /// RoPE backward: the rotation is orthogonal, so `dx += R(-angle) d_out`.
    fn rope_bwd(
        &self,
        d_out: &[f32],
        positions: &[u32],
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rope: Rope,
        dx: &mut [f32],
    ) -> Result<(), KernelError>;
}

/// The CPU reference kernels, single-threaded per rank.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

#[allow(clippy::too_many_arguments)]
impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn gelu_fwd(&self, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
        cpu::gelu_fwd(x, y)
    }

    fn gelu_bwd(&self, x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
        cpu::gelu_bwd(x, dy, dx)
    }

    fn swiglu_fwd(
        &self,
        x: &[f32],
        rows: usize,
        f: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::swiglu_fwd(x, rows, f, y)
    }

    fn swiglu_bwd(
        &self,
        x: &[f32],
        dy: &[f32],
        rows: usize,
        f: usize,
        dx: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::swiglu_bwd(x, dy, rows, f, dx)
    }

    fn add(&self, a: &[f32], b: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
        cpu::add(a, b, out)
    }

    fn add_bwd(&self, d_out: &[f32], da: &mut [f32], db: &mut [f32]) -> Result<(), KernelError> {
        cpu::add_bwd(d_out, da, db)
    }

    fn accumulate(&self, acc: &mut [f32], x: &[f32]) {
        cpu::accumulate(acc, x)
    }

    fn adamw_step(
        &self,
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        step: u64,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    ) -> Result<(), KernelError> {
        cpu::adamw_step(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay)
    }

    fn attention_fwd(
        &self,
        dims: &AttnDims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        q_pos0: usize,
        k_pos0: usize,
        causal: bool,
        scale: f32,
        out: &mut [f32],
        lse: &mut [f32],
        dropout: Option<&Dropout<'_>>,
    ) -> Result<(), KernelError> {
        cpu::attention_fwd(
            dims, q, k, v, q_pos0, k_pos0, causal, scale, out, lse, dropout,
        )
    }

    fn attention_merge(
        &self,
        dims: &AttnDims,
        o_acc: &mut [f32],
        lse_acc: &mut [f32],
        o_blk: &[f32],
        lse_blk: &[f32],
    ) -> Result<(), KernelError> {
        cpu::attention_merge(dims, o_acc, lse_acc, o_blk, lse_blk)
    }

    fn attention_bwd(
        &self,
        dims: &AttnDims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &[f32],
        lse: &[f32],
        d_o: &[f32],
        q_pos0: usize,
        k_pos0: usize,
        causal: bool,
        scale: f32,
        d_q: &mut [f32],
        d_k: &mut [f32],
        d_v: &mut [f32],
        dropout: Option<&Dropout<'_>>,
    ) -> Result<(), KernelError> {
        cpu::attention_bwd(
            dims, q, k, v, o, lse, d_o, q_pos0, k_pos0, causal, scale, d_q, d_k, d_v, dropout,
        )
    }

    fn embedding_fwd(
        &self,
        ids: &[u32],
        table: &[f32],
        vocab_start: usize,
        dim: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::embedding_fwd(ids, table, vocab_start, dim, out)
    }

    fn embedding_bwd(
        &self,
        ids: &[u32],
        d_out: &[f32],
        vocab_start: usize,
        dim: usize,
        d_table: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::embedding_bwd(ids, d_out, vocab_start, dim, d_table)
    }

    fn ce_row_max(
        &self,
        logits: &[f32],
        rows: usize,
        v_local: usize,
        max: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::ce_row_max(logits, rows, v_local, max)
    }

    fn ce_row_sumexp(
        &self,
        logits: &[f32],
        rows: usize,
        v_local: usize,
        global_max: &[f32],
        sumexp: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::ce_row_sumexp(logits, rows, v_local, global_max, sumexp)
    }

    fn ce_target_logit(
        &self,
        logits: &[f32],
        labels: &[u32],
        rows: usize,
        v_local: usize,
        vocab_start: usize,
        target: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::ce_target_logit(logits, labels, rows, v_local, vocab_start, target)
    }

    fn ce_loss(
        &self,
        global_max: &[f32],
        global_sumexp: &[f32],
        global_target: &[f32],
        loss: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::ce_loss(global_max, global_sumexp, global_target, loss)
    }

    fn ce_bwd(
        &self,
        logits: &[f32],
        rows: usize,
        v_local: usize,
        global_max: &[f32],
        global_sumexp: &[f32],
        labels: &[u32],
        vocab_start: usize,
        scale: f32,
        dlogits: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::ce_bwd(
            logits,
            rows,
            v_local,
            global_max,
            global_sumexp,
            labels,
            vocab_start,
            scale,
            dlogits,
        )
    }

    fn matmul(
        &self,
        trans_a: Transpose,
        trans_b: Transpose,
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        b: &[f32],
        beta: f32,
        c: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::matmul(trans_a, trans_b, m, k, n, a, b, beta, c)
    }

    fn matmul_batched(
        &self,
        batch: usize,
        trans_a: Transpose,
        trans_b: Transpose,
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        b: &[f32],
        beta: f32,
        c: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::matmul_batched(batch, trans_a, trans_b, m, k, n, a, b, beta, c)
    }

    fn moe_route_fwd(
        &self,
        logits: &[f32],
        tokens: usize,
        experts: usize,
        k: usize,
        renormalize: bool,
        probs: &mut [f32],
        expert_idx: &mut [u32],
        weights: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::moe_route_fwd(
            logits,
            tokens,
            experts,
            k,
            renormalize,
            probs,
            expert_idx,
            weights,
        )
    }

    fn moe_route_bwd(
        &self,
        probs: &[f32],
        expert_idx: &[u32],
        weights: &[f32],
        d_weights: &[f32],
        tokens: usize,
        experts: usize,
        k: usize,
        renormalize: bool,
        d_logits: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::moe_route_bwd(
            probs,
            expert_idx,
            weights,
            d_weights,
            tokens,
            experts,
            k,
            renormalize,
            d_logits,
        )
    }

    fn moe_dispatch_fwd(
        &self,
        x: &[f32],
        expert_idx: &[u32],
        tokens: usize,
        k: usize,
        experts: usize,
        dim: usize,
        out: &mut [f32],
        counts: &mut [usize],
        perm: &mut [u32],
    ) -> Result<(), KernelError> {
        cpu::moe_dispatch_fwd(x, expert_idx, tokens, k, experts, dim, out, counts, perm)
    }

    fn moe_dispatch_bwd(
        &self,
        d_out: &[f32],
        perm: &[u32],
        tokens: usize,
        k: usize,
        dim: usize,
        dx: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::moe_dispatch_bwd(d_out, perm, tokens, k, dim, dx)
    }

    fn moe_combine_fwd(
        &self,
        y: &[f32],
        perm: &[u32],
        weights: &[f32],
        tokens: usize,
        k: usize,
        dim: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::moe_combine_fwd(y, perm, weights, tokens, k, dim, out)
    }

    fn moe_combine_bwd(
        &self,
        d_out: &[f32],
        y: &[f32],
        perm: &[u32],
        weights: &[f32],
        tokens: usize,
        k: usize,
        dim: usize,
        d_y: &mut [f32],
        d_weights: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::moe_combine_bwd(d_out, y, perm, weights, tokens, k, dim, d_y, d_weights)
    }

    fn layernorm_fwd(
        &self,
        x: &[f32],
        weight: &[f32],
        bias: &[f32],
        rows: usize,
        dim: usize,
        eps: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::layernorm_fwd(x, weight, bias, rows, dim, eps, y, mean, rstd)
    }

    fn layernorm_bwd(
        &self,
        x: &[f32],
        weight: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dy: &[f32],
        rows: usize,
        dim: usize,
        dx: &mut [f32],
        dweight: &mut [f32],
        dbias: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::layernorm_bwd(x, weight, mean, rstd, dy, rows, dim, dx, dweight, dbias)
    }

    fn rmsnorm_fwd(
        &self,
        x: &[f32],
        weight: &[f32],
        rows: usize,
        dim: usize,
        eps: f32,
        y: &mut [f32],
        rstd: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::rmsnorm_fwd(x, weight, rows, dim, eps, y, rstd)
    }

    fn rmsnorm_bwd(
        &self,
        x: &[f32],
        weight: &[f32],
        rstd: &[f32],
        dy: &[f32],
        rows: usize,
        dim: usize,
        dx: &mut [f32],
        dweight: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::rmsnorm_bwd(x, weight, rstd, dy, rows, dim, dx, dweight)
    }

    fn rope_fwd(
        &self,
        x: &[f32],
        positions: &[u32],
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rope: Rope,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::rope_fwd(x, positions, tokens, heads, head_dim, rope, out)
    }

    fn rope_bwd(
        &self,
        d_out: &[f32],
        positions: &[u32],
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rope: Rope,
        dx: &mut [f32],
    ) -> Result<(), KernelError> {
        cpu::rope_bwd(d_out, positions, tokens, heads, head_dim, rope, dx)
    }
}
