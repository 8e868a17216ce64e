//! [`CudaBackend`] (feature `cuda`): the [`Backend`] on one GPU.
//!
//! This is the general interpreter ([`crate::train`], [`crate::infer`]) on a GPU
//! through host staging, for what the device interpreter ([`crate::device`]) does
//! not take (see [`crate::device::train::supported`]: a separate router op)
//! and for inference plans. Every
//! call uploads its operands from the caller's `f32` slices, casts them to bf16 on
//! the device where the GPU kernel computes in bf16, runs the kernel of
//! [`meshplan_kernels::cuda`] that is the twin of the CPU one, casts the results
//! back to fp32, downloads them into the caller's slices and waits for the stream:
//! two PCIe copies per kernel (operands in, results out) and a synchronisation. It
//! is correct, not fast; a plan the device interpreter takes belongs there, where
//! nothing leaves the GPU during a step.
//!
//! Precision is the device's: bf16 operands with fp32 accumulation, bf16 results
//! for activations and activation gradients (so the `f32` slices receive
//! bf16-rounded values), fp32 statistics (`mean`, `rstd`, `lse`), router
//! probabilities and weights, GEMM outputs (cuBLASLt with an fp32 `C`) and AdamW
//! (whose bf16 weight copy is discarded: the caller's `param` is the weight).
//!
//! Overwrite and accumulate follow the CPU kernels: forward kernels overwrite,
//! backward kernels add. How each gradient is added depends on its GPU type:
//!
//! - fp32 gradients (norm weights and biases, the embedding table, router logits,
//!   combine weights): the caller's values are uploaded and the kernel adds into
//!   them, exactly as on the device;
//! - bf16 gradients (activation gradients): the kernel adds into a zeroed buffer, so
//!   its contribution is rounded to bf16 once, and that is added to the caller's
//!   slice on the host. Uploading the caller's accumulator instead would round its
//!   running sum (residual branches, ring blocks, micro-batches) to bf16 on every
//!   call.
//!
//! Calls that run the CPU reference ([`meshplan_kernels::cpu`], fp32) instead:
//!
//! - [`Backend::accumulate`]: the trait's is infallible and fp32 (the interpreter
//!   sums gradients with it), the GPU's is bf16: staging would round the sum and
//!   could not report a driver failure.
//! - [`Backend::attention_merge`]: no GPU twin (the ring merge).
//! - [`Backend::attention_fwd`] and [`Backend::attention_bwd`] with `Some(dropout)`
//!   (a keep function this path cannot hand to the GPU kernels, which draw
//!   `AttnDropout`'s mask themselves), or with a head dimension over 256 (the most
//!   the GPU kernels hold in registers).
//! - The cross-entropy pieces ([`Backend::ce_row_max`], [`Backend::ce_row_sumexp`],
//!   [`Backend::ce_target_logit`], [`Backend::ce_loss`], [`Backend::ce_bwd`]): the GPU
//!   has only the fused, unsharded cross-entropy, which computes its own row max and
//!   sum where these take the caller's (reduced over a vocabulary-parallel group),
//!   and writes the logits' gradient where `ce_bwd` adds to it.
//! - [`Backend::moe_route_fwd`] and [`Backend::moe_route_bwd`] with more than 1024
//!   experts (one warp per token on the GPU).
//! - Inputs the CPU kernels refuse and the GPU ones would not: NaN router logits (the
//!   GPU top-k would pick no expert), expert ids out of range, and a `perm` that is
//!   not a permutation of `0..tokens * k` (the GPU skips entries out of range, and
//!   inverts `perm`, so a repeated entry would count once). The CPU kernel returns
//!   its error, or, for a repeated entry, the sum it defines.
//! - Any call with an empty buffer: there is nothing to compute (at most `c = beta c`
//!   for a matmul with `k = 0`, zero counts, or the rows of an attention block with
//!   no key), and a zero-byte device allocation is not to be relied on
//!   (`cuMemAlloc` refuses it).
//!
//! Arguments the GPU launch wrappers refuse give their [`KernelError`], as the CPU
//! kernels' checks do; a driver, cuBLASLt or compiler failure becomes a
//! [`KernelError::Invalid`] named `cuda`. The interpreter's ranks are threads sharing one backend: their
//! calls share the [`Gpu`]'s one stream, and each call reads back only its own
//! buffers after waiting for the stream.

use crate::backend::Backend;
use meshplan_kernels::cpu::{self, AttnDims, Dropout, KernelError, Rope, Transpose};
use meshplan_kernels::cuda::cudarc::driver::{CudaSlice, DeviceRepr};
use meshplan_kernels::cuda::{bf16, Gpu, GpuError};

/// The largest head dimension the GPU attention kernels take (`ATT_HEAD_DIM_MAX`
/// of the kernels' launch wrappers, which refuse larger ones).
const ATTENTION_HEAD_DIM_MAX: usize = 256;
/// The most experts the GPU router takes (one warp per token, 32 experts per
/// lane; the launch wrapper refuses more).
const ROUTE_EXPERTS_MAX: usize = 1024;

/// The [`Backend`] on one GPU, staging every call through the host (see the
/// module docs).
#[derive(Debug)]
pub struct CudaBackend {
    gpu: Gpu,
}

impl CudaBackend {
    /// Opens GPU 0 and compiles (or reads from the PTX cache) every kernel module
    /// now, so that a missing driver or a compile error is reported here rather than
    /// at the first kernel of a step.
    pub fn new() -> Result<CudaBackend, GpuError> {
        let gpu = Gpu::new()?;
        gpu.load_all()?;
        Ok(CudaBackend { gpu })
    }

    /// The GPU the backend launches on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// A device copy of `x` rounded to bf16 (on the device, to nearest even).
    fn up_bf16(&self, x: &[f32]) -> Result<CudaSlice<bf16>, GpuError> {
        let f = self.gpu.upload(x)?;
        let mut b = self.gpu.zeros(x.len())?;
        self.gpu.cast_f32_to_bf16(&f, &mut b)?;
        Ok(b)
    }

    /// `host = dev`, after everything launched before (`dev` was allocated with
    /// `host`'s length).
    fn down<T: DeviceRepr>(&self, dev: &CudaSlice<T>, host: &mut [T]) -> Result<(), GpuError> {
        self.gpu.stream().memcpy_dtoh(dev, host)?;
        // A copy to pageable memory may return before it lands.
        self.gpu.synchronize()
    }

    /// `dev` (bf16) widened on the device to fp32.
    fn widen(&self, dev: &CudaSlice<bf16>) -> Result<CudaSlice<f32>, GpuError> {
        let mut f = self.gpu.zeros(dev.len())?;
        self.gpu.cast_bf16_to_f32(dev, &mut f)?;
        Ok(f)
    }

    /// `host = dev` for a bf16 result.
    fn down_bf16(&self, dev: &CudaSlice<bf16>, host: &mut [f32]) -> Result<(), GpuError> {
        self.down(&self.widen(dev)?, host)
    }

    /// `host += dev` for a bf16 gradient contribution, added in fp32 on the host.
    fn add_bf16(&self, dev: &CudaSlice<bf16>, host: &mut [f32]) -> Result<(), GpuError> {
        let mut got = vec![0.0; host.len()];
        self.down(&self.widen(dev)?, &mut got)?;
        for (h, g) in host.iter_mut().zip(got) {
            *h += g;
        }
        Ok(())
    }
}

/// A GPU failure as the trait's error: argument errors are the kernels' own.
fn kernel_error(e: GpuError) -> KernelError {
    match e {
        GpuError::Args(e) => e,
        other => KernelError::Invalid {
            name: "cuda",
            reason: other.to_string(),
        },
    }
}

/// Runs the staged body of a call.
fn on_gpu(body: impl FnOnce() -> Result<(), GpuError>) -> Result<(), KernelError> {
    body().map_err(kernel_error)
}

/// Whether a call has an empty buffer (and so runs on the CPU).
fn any_empty(lens: &[usize]) -> bool {
    lens.contains(&0)
}

/// Whether the GPU attention kernels take the call.
fn gpu_attention(dims: &AttnDims, dropout: Option<&Dropout<'_>>) -> bool {
    dropout.is_none() && dims.d.max(dims.dv) <= ATTENTION_HEAD_DIM_MAX
}

/// Whether every expert id is below `experts`.
fn experts_in_range(expert_idx: &[u32], experts: usize) -> bool {
    expert_idx.iter().all(|&e| (e as usize) < experts)
}

/// Whether `perm` holds each of `0..perm.len()` once, as dispatch writes it.
fn is_permutation(perm: &[u32]) -> bool {
    let mut seen = vec![false; perm.len()];
    perm.iter().all(|&a| {
        seen.get_mut(a as usize)
            .is_some_and(|s| !std::mem::replace(s, true))
    })
}

#[allow(clippy::too_many_arguments)] // the trait's
impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn gelu_fwd(&self, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
        if any_empty(&[x.len(), y.len()]) {
            return cpu::gelu_fwd(x, y);
        }
        on_gpu(|| {
            let mut yd = self.gpu.zeros(y.len())?;
            self.gpu.gelu_fwd(&self.up_bf16(x)?, &mut yd)?;
            self.down_bf16(&yd, y)
        })
    }

    fn gelu_bwd(&self, x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
        if any_empty(&[x.len(), dy.len(), dx.len()]) {
            return cpu::gelu_bwd(x, dy, dx);
        }
        on_gpu(|| {
            let mut dxd = self.gpu.zeros(dx.len())?;
            self.gpu
                .gelu_bwd(&self.up_bf16(x)?, &self.up_bf16(dy)?, &mut dxd)?;
            self.add_bf16(&dxd, dx)
        })
    }

    fn swiglu_fwd(
        &self,
        x: &[f32],
        rows: usize,
        f: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        if any_empty(&[x.len(), y.len()]) {
            return cpu::swiglu_fwd(x, rows, f, y);
        }
        on_gpu(|| {
            let mut yd = self.gpu.zeros(y.len())?;
            self.gpu.swiglu_fwd(&self.up_bf16(x)?, rows, f, &mut yd)?;
            self.down_bf16(&yd, y)
        })
    }

    fn swiglu_bwd(
        &self,
        x: &[f32],
        dy: &[f32],
        rows: usize,
        f: usize,
        dx: &mut [f32],
    ) -> Result<(), KernelError> {
        if any_empty(&[x.len(), dy.len(), dx.len()]) {
            return cpu::swiglu_bwd(x, dy, rows, f, dx);
        }
        on_gpu(|| {
            let mut dxd = self.gpu.zeros(dx.len())?;
            self.gpu
                .swiglu_bwd(&self.up_bf16(x)?, &self.up_bf16(dy)?, rows, f, &mut dxd)?;
            self.add_bf16(&dxd, dx)
        })
    }

    fn add(&self, a: &[f32], b: &[f32], out: &mut [f32]) -> Result<(), KernelError> {
        if any_empty(&[a.len(), b.len(), out.len()]) {
            return cpu::add(a, b, out);
        }
        on_gpu(|| {
            let mut od = self.gpu.zeros(out.len())?;
            self.gpu
                .add(&self.up_bf16(a)?, &self.up_bf16(b)?, &mut od)?;
            self.down_bf16(&od, out)
        })
    }

    fn add_bwd(&self, d_out: &[f32], da: &mut [f32], db: &mut [f32]) -> Result<(), KernelError> {
        if any_empty(&[d_out.len(), da.len(), db.len()]) {
            return cpu::add_bwd(d_out, da, db);
        }
        on_gpu(|| {
            let (mut dad, mut dbd) = (self.gpu.zeros(da.len())?, self.gpu.zeros(db.len())?);
            self.gpu
                .add_bwd(&self.up_bf16(d_out)?, &mut dad, &mut dbd)?;
            self.add_bf16(&dad, da)?;
            self.add_bf16(&dbd, db)
        })
    }

    fn accumulate(&self, acc: &mut [f32], x: &[f32]) {
        // CPU: see the module docs.
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
        if any_empty(&[param.len(), grad.len(), m.len(), v.len()]) {
            return cpu::adamw_step(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay);
        }
        on_gpu(|| {
            let (mut pd, mut md, mut vd) = (
                self.gpu.upload(param)?,
                self.gpu.upload(m)?,
                self.gpu.upload(v)?,
            );
            // The bf16 compute copy the device interpreter keeps; nothing here reads it.
            let mut copy = self.gpu.zeros(param.len())?;
            self.gpu.adamw_step(
                &mut pd,
                &self.gpu.upload(grad)?,
                &mut md,
                &mut vd,
                &mut copy,
                step,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            )?;
            self.down(&pd, param)?;
            self.down(&md, m)?;
            self.down(&vd, v)
        })
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
        if !gpu_attention(dims, dropout)
            || any_empty(&[q.len(), k.len(), v.len(), out.len(), lse.len()])
        {
            return cpu::attention_fwd(
                dims, q, k, v, q_pos0, k_pos0, causal, scale, out, lse, dropout,
            );
        }
        on_gpu(|| {
            let (mut od, mut ld) = (self.gpu.zeros(out.len())?, self.gpu.zeros(lse.len())?);
            self.gpu.attention_fwd(
                dims,
                &self.up_bf16(q)?,
                &self.up_bf16(k)?,
                &self.up_bf16(v)?,
                q_pos0,
                k_pos0,
                causal,
                scale,
                None,
                &mut od,
                &mut ld,
            )?;
            self.down_bf16(&od, out)?;
            self.down(&ld, lse)
        })
    }

    fn attention_merge(
        &self,
        dims: &AttnDims,
        o_acc: &mut [f32],
        lse_acc: &mut [f32],
        o_blk: &[f32],
        lse_blk: &[f32],
    ) -> Result<(), KernelError> {
        // CPU: no GPU twin.
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
        if !gpu_attention(dims, dropout)
            || any_empty(&[
                q.len(),
                k.len(),
                v.len(),
                o.len(),
                lse.len(),
                d_o.len(),
                d_q.len(),
                d_k.len(),
                d_v.len(),
            ])
        {
            return cpu::attention_bwd(
                dims, q, k, v, o, lse, d_o, q_pos0, k_pos0, causal, scale, d_q, d_k, d_v, dropout,
            );
        }
        on_gpu(|| {
            let (mut dqd, mut dkd, mut dvd) = (
                self.gpu.zeros(d_q.len())?,
                self.gpu.zeros(d_k.len())?,
                self.gpu.zeros(d_v.len())?,
            );
            self.gpu.attention_bwd(
                dims,
                &self.up_bf16(q)?,
                &self.up_bf16(k)?,
                &self.up_bf16(v)?,
                &self.up_bf16(o)?,
                &self.gpu.upload(lse)?,
                &self.up_bf16(d_o)?,
                q_pos0,
                k_pos0,
                causal,
                scale,
                None,
                &mut dqd,
                &mut dkd,
                &mut dvd,
            )?;
            self.add_bf16(&dqd, d_q)?;
            self.add_bf16(&dkd, d_k)?;
            self.add_bf16(&dvd, d_v)
        })
    }

    fn embedding_fwd(
        &self,
        ids: &[u32],
        table: &[f32],
        vocab_start: usize,
        dim: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        if any_empty(&[ids.len(), table.len(), out.len()]) {
            return cpu::embedding_fwd(ids, table, vocab_start, dim, out);
        }
        on_gpu(|| {
            let mut od = self.gpu.zeros(out.len())?;
            self.gpu.embedding_fwd(
                &self.gpu.upload(ids)?,
                &self.up_bf16(table)?,
                vocab_start,
                dim,
                &mut od,
            )?;
            self.down_bf16(&od, out)
        })
    }

    fn embedding_bwd(
        &self,
        ids: &[u32],
        d_out: &[f32],
        vocab_start: usize,
        dim: usize,
        d_table: &mut [f32],
    ) -> Result<(), KernelError> {
        if any_empty(&[ids.len(), d_out.len(), d_table.len()]) {
            return cpu::embedding_bwd(ids, d_out, vocab_start, dim, d_table);
        }
        on_gpu(|| {
            let mut td = self.gpu.upload(d_table)?;
            self.gpu.embedding_bwd(
                &self.gpu.upload(ids)?,
                &self.up_bf16(d_out)?,
                vocab_start,
                dim,
                &mut td,
            )?;
            self.down(&td, d_table)
        })
    }

    fn ce_row_max(
        &self,
        logits: &[f32],
        rows: usize,
        v_local: usize,
        max: &mut [f32],
    ) -> Result<(), KernelError> {
        // CPU: the GPU has only the fused cross-entropy (module docs).
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
        self.matmul_batched(1, trans_a, trans_b, m, k, n, a, b, beta, c)
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
        if any_empty(&[a.len(), b.len(), c.len()]) {
            return cpu::matmul_batched(batch, trans_a, trans_b, m, k, n, a, b, beta, c);
        }
        on_gpu(|| {
            // With beta = 0 cuBLASLt does not read C, and neither does the CPU.
            let mut cd = if beta == 0.0 {
                self.gpu.zeros(c.len())?
            } else {
                self.gpu.upload(c)?
            };
            self.gpu.gemm_batched::<f32>(
                batch,
                trans_a,
                trans_b,
                m,
                k,
                n,
                &self.up_bf16(a)?,
                &self.up_bf16(b)?,
                beta,
                &mut cd,
            )?;
            self.down(&cd, c)
        })
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
        if experts > ROUTE_EXPERTS_MAX
            || logits.iter().any(|x| x.is_nan())
            || any_empty(&[logits.len(), probs.len(), expert_idx.len(), weights.len()])
        {
            return cpu::moe_route_fwd(
                logits,
                tokens,
                experts,
                k,
                renormalize,
                probs,
                expert_idx,
                weights,
            );
        }
        on_gpu(|| {
            let (mut pd, mut id, mut wd) = (
                self.gpu.zeros(probs.len())?,
                self.gpu.zeros(expert_idx.len())?,
                self.gpu.zeros(weights.len())?,
            );
            self.gpu.moe_route_fwd(
                &self.gpu.upload(logits)?,
                tokens,
                experts,
                k,
                renormalize,
                &mut pd,
                &mut id,
                &mut wd,
            )?;
            self.down(&pd, probs)?;
            self.down(&id, expert_idx)?;
            self.down(&wd, weights)
        })
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
        if experts > ROUTE_EXPERTS_MAX
            || !experts_in_range(expert_idx, experts)
            || any_empty(&[
                probs.len(),
                expert_idx.len(),
                weights.len(),
                d_weights.len(),
                d_logits.len(),
            ])
        {
            return cpu::moe_route_bwd(
                probs,
                expert_idx,
                weights,
                d_weights,
                tokens,
                experts,
                k,
                renormalize,
                d_logits,
            );
        }
        on_gpu(|| {
            let mut dd = self.gpu.upload(d_logits)?;
            self.gpu.moe_route_bwd(
                &self.gpu.upload(probs)?,
                &self.gpu.upload(expert_idx)?,
                &self.gpu.upload(weights)?,
                &self.gpu.upload(d_weights)?,
                tokens,
                experts,
                k,
                renormalize,
                &mut dd,
            )?;
            self.down(&dd, d_logits)
        })
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
        if !experts_in_range(expert_idx, experts)
            || any_empty(&[
                x.len(),
                expert_idx.len(),
                out.len(),
                counts.len(),
                perm.len(),
            ])
        {
            return cpu::moe_dispatch_fwd(
                x, expert_idx, tokens, k, experts, dim, out, counts, perm,
            );
        }
        on_gpu(|| {
            let (mut od, mut cd, mut pd) = (
                self.gpu.zeros(out.len())?,
                self.gpu.zeros::<u32>(counts.len())?,
                self.gpu.zeros(perm.len())?,
            );
            self.gpu.moe_dispatch_fwd(
                &self.up_bf16(x)?,
                &self.gpu.upload(expert_idx)?,
                tokens,
                k,
                experts,
                dim,
                &mut od,
                &mut cd,
                &mut pd,
            )?;
            self.down_bf16(&od, out)?;
            self.down(&pd, perm)?;
            // The GPU counts in u32; `tokens * k` fits (the kernel's int check).
            let mut got = vec![0u32; counts.len()];
            self.down(&cd, &mut got)?;
            for (c, g) in counts.iter_mut().zip(got) {
                *c = g as usize;
            }
            Ok(())
        })
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
        if !is_permutation(perm) || any_empty(&[d_out.len(), perm.len(), dx.len()]) {
            return cpu::moe_dispatch_bwd(d_out, perm, tokens, k, dim, dx);
        }
        on_gpu(|| {
            let mut dxd = self.gpu.zeros(dx.len())?;
            self.gpu.moe_dispatch_bwd(
                &self.up_bf16(d_out)?,
                &self.gpu.upload(perm)?,
                tokens,
                k,
                dim,
                &mut dxd,
            )?;
            self.add_bf16(&dxd, dx)
        })
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
        if !is_permutation(perm) || any_empty(&[y.len(), perm.len(), weights.len(), out.len()]) {
            return cpu::moe_combine_fwd(y, perm, weights, tokens, k, dim, out);
        }
        on_gpu(|| {
            let mut od = self.gpu.zeros(out.len())?;
            self.gpu.moe_combine_fwd(
                &self.up_bf16(y)?,
                &self.gpu.upload(perm)?,
                &self.gpu.upload(weights)?,
                tokens,
                k,
                dim,
                &mut od,
            )?;
            self.down_bf16(&od, out)
        })
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
        if !is_permutation(perm)
            || any_empty(&[
                d_out.len(),
                y.len(),
                perm.len(),
                weights.len(),
                d_y.len(),
                d_weights.len(),
            ])
        {
            return cpu::moe_combine_bwd(d_out, y, perm, weights, tokens, k, dim, d_y, d_weights);
        }
        on_gpu(|| {
            let (mut dyd, mut dwd) = (self.gpu.zeros(d_y.len())?, self.gpu.upload(d_weights)?);
            self.gpu.moe_combine_bwd(
                &self.up_bf16(d_out)?,
                &self.up_bf16(y)?,
                &self.gpu.upload(perm)?,
                &self.gpu.upload(weights)?,
                tokens,
                k,
                dim,
                &mut dyd,
                &mut dwd,
            )?;
            self.add_bf16(&dyd, d_y)?;
            self.down(&dwd, d_weights)
        })
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
        if any_empty(&[
            x.len(),
            weight.len(),
            bias.len(),
            y.len(),
            mean.len(),
            rstd.len(),
        ]) {
            return cpu::layernorm_fwd(x, weight, bias, rows, dim, eps, y, mean, rstd);
        }
        on_gpu(|| {
            let (mut yd, mut md, mut rd) = (
                self.gpu.zeros(y.len())?,
                self.gpu.zeros(mean.len())?,
                self.gpu.zeros(rstd.len())?,
            );
            self.gpu.layernorm_fwd(
                &self.up_bf16(x)?,
                &self.up_bf16(weight)?,
                &self.up_bf16(bias)?,
                rows,
                dim,
                eps,
                &mut yd,
                &mut md,
                &mut rd,
            )?;
            self.down_bf16(&yd, y)?;
            self.down(&md, mean)?;
            self.down(&rd, rstd)
        })
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
        if any_empty(&[
            x.len(),
            weight.len(),
            mean.len(),
            rstd.len(),
            dy.len(),
            dx.len(),
            dweight.len(),
            dbias.len(),
        ]) {
            return cpu::layernorm_bwd(x, weight, mean, rstd, dy, rows, dim, dx, dweight, dbias);
        }
        on_gpu(|| {
            let (mut dxd, mut dwd, mut dbd) = (
                self.gpu.zeros(dx.len())?,
                self.gpu.upload(dweight)?,
                self.gpu.upload(dbias)?,
            );
            self.gpu.layernorm_bwd(
                &self.up_bf16(x)?,
                &self.up_bf16(weight)?,
                &self.gpu.upload(mean)?,
                &self.gpu.upload(rstd)?,
                &self.up_bf16(dy)?,
                rows,
                dim,
                &mut dxd,
                &mut dwd,
                &mut dbd,
            )?;
            self.add_bf16(&dxd, dx)?;
            self.down(&dwd, dweight)?;
            self.down(&dbd, dbias)
        })
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
        if any_empty(&[x.len(), weight.len(), y.len(), rstd.len()]) {
            return cpu::rmsnorm_fwd(x, weight, rows, dim, eps, y, rstd);
        }
        on_gpu(|| {
            let (mut yd, mut rd) = (self.gpu.zeros(y.len())?, self.gpu.zeros(rstd.len())?);
            self.gpu.rmsnorm_fwd(
                &self.up_bf16(x)?,
                &self.up_bf16(weight)?,
                rows,
                dim,
                eps,
                &mut yd,
                &mut rd,
            )?;
            self.down_bf16(&yd, y)?;
            self.down(&rd, rstd)
        })
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
        if any_empty(&[
            x.len(),
            weight.len(),
            rstd.len(),
            dy.len(),
            dx.len(),
            dweight.len(),
        ]) {
            return cpu::rmsnorm_bwd(x, weight, rstd, dy, rows, dim, dx, dweight);
        }
        on_gpu(|| {
            let (mut dxd, mut dwd) = (self.gpu.zeros(dx.len())?, self.gpu.upload(dweight)?);
            self.gpu.rmsnorm_bwd(
                &self.up_bf16(x)?,
                &self.up_bf16(weight)?,
                &self.gpu.upload(rstd)?,
                &self.up_bf16(dy)?,
                rows,
                dim,
                &mut dxd,
                &mut dwd,
            )?;
            self.add_bf16(&dxd, dx)?;
            self.down(&dwd, dweight)
        })
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
        if any_empty(&[x.len(), positions.len(), out.len()]) {
            return cpu::rope_fwd(x, positions, tokens, heads, head_dim, rope, out);
        }
        on_gpu(|| {
            let mut od = self.gpu.zeros(out.len())?;
            self.gpu.rope_fwd(
                &self.up_bf16(x)?,
                &self.gpu.upload(positions)?,
                tokens,
                heads,
                head_dim,
                rope,
                &mut od,
            )?;
            self.down_bf16(&od, out)
        })
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
        if any_empty(&[d_out.len(), positions.len(), dx.len()]) {
            return cpu::rope_bwd(d_out, positions, tokens, heads, head_dim, rope, dx);
        }
        on_gpu(|| {
            let mut dxd = self.gpu.zeros(dx.len())?;
            self.gpu.rope_bwd(
                &self.up_bf16(d_out)?,
                &self.gpu.upload(positions)?,
                tokens,
                heads,
                head_dim,
                rope,
                &mut dxd,
            )?;
            self.add_bf16(&dxd, dx)
        })
    }
}

#[cfg(test)]
mod tests {
    //! [`CudaBackend`] against [`CpuBackend`] through the [`Backend`] trait alone,
    //! every method on the same inputs: bf16-representable where the GPU computes in
    //! bf16 (so that staging rounds no input), forward outputs started as garbage
    //! (they must be overwritten), gradients started at random values (they must be
    //! added to). The inputs of a backward are the CPU reference's forward results,
    //! so that each method is compared alone. The fallbacks agree bit for bit, and
    //! inputs the CPU kernels refuse are refused. The kernels themselves are tested
    //! against the CPU in `meshplan-kernels`; this tests the staging. Skips without a
    //! GPU (saying why); `REQUIRE_GPU=1` turns the skip into a failure.

    use super::*;
    use crate::backend::CpuBackend;
    use crate::init::splitmix;
    use Transpose::{No, Yes};

    /// `n` values in `[-scale, scale)` rounded to bf16.
    fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        fp32_values(seed, n, scale)
            .into_iter()
            .map(|v| bf16::from_f32(v).to_f32())
            .collect()
    }

    /// `n` values in `[-scale, scale)`, for inputs the GPU reads in fp32.
    fn fp32_values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        (0..n as u64)
            .map(|i| {
                let u = (splitmix(seed ^ splitmix(i)) >> 40) as f32 / (1u64 << 24) as f32;
                scale * (2.0 * u - 1.0)
            })
            .collect()
    }

    fn ids(seed: u64, n: usize, below: u64) -> Vec<u32> {
        (0..n as u64)
            .map(|i| (splitmix(seed ^ splitmix(i)) % below) as u32)
            .collect()
    }

    fn floats(x: &[u32]) -> Vec<f32> {
        x.iter().map(|&v| v as f32).collect()
    }

    /// `|cuda - cpu| <= of_max * max|cpu| + rtol * |cpu|` elementwise: relative to
    /// the output's magnitude and to each value's.
    #[derive(Clone, Copy, Debug)]
    struct Tol {
        of_max: f32,
        rtol: f32,
    }

    /// One bf16 rounding of the result on top of fp32 noise.
    const BF16: Tol = Tol {
        of_max: 1e-2,
        rtol: 1.0 / 128.0,
    };
    /// Attention: bf16 probabilities inside the kernels as well.
    const ATTN: Tol = Tol {
        of_max: 2e-2,
        rtol: 1.0 / 64.0,
    };
    /// fp32 results of fp32 arithmetic in another order.
    const FP32: Tol = Tol {
        of_max: 1e-5,
        rtol: 1e-5,
    };
    /// fp32 sums over many bf16 terms (GEMM, statistics, combine weights).
    const SUMS: Tol = Tol {
        of_max: 1e-4,
        rtol: 1e-4,
    };
    /// Norm parameter gradients: fp32 sums over rows of terms recomputed from bf16
    /// operands (the kernels' own tests allow as much).
    const PARAM_GRAD: Tol = Tol {
        of_max: 1e-3,
        rtol: 1e-3,
    };
    /// Bit-for-bit: copies, ids, and the calls that run on the CPU.
    const EXACT: Tol = Tol {
        of_max: 0.0,
        rtol: 0.0,
    };

    /// The results of one run, in order: name, values, tolerance.
    #[derive(Default)]
    struct Outs(Vec<(String, Vec<f32>, Tol)>);

    impl Outs {
        fn push(&mut self, name: impl Into<String>, v: &[f32], tol: Tol) {
            self.0.push((name.into(), v.to_vec(), tol));
        }
    }

    fn pointwise(be: &dyn Backend, o: &mut Outs) {
        // 1003: the GPU kernels' 8-wide body and a scalar tail.
        let n = 1003;
        let x = values(1, n, 4.0);
        let dy = values(2, n, 1.0);
        let mut y = vec![f32::NAN; n];
        be.gelu_fwd(&x, &mut y).unwrap();
        o.push("gelu_fwd", &y, BF16);
        let mut dx = fp32_values(3, n, 1.0);
        be.gelu_bwd(&x, &dy, &mut dx).unwrap();
        o.push("gelu_bwd", &dx, BF16);

        let (rows, f) = (7, 33);
        let xs = values(4, rows * 2 * f, 3.0);
        let mut y = vec![f32::NAN; rows * f];
        be.swiglu_fwd(&xs, rows, f, &mut y).unwrap();
        o.push("swiglu_fwd", &y, BF16);
        let mut dx = fp32_values(5, rows * 2 * f, 1.0);
        be.swiglu_bwd(&xs, &values(6, rows * f, 1.0), rows, f, &mut dx)
            .unwrap();
        o.push("swiglu_bwd", &dx, BF16);

        let mut y = vec![f32::NAN; n];
        be.add(&x, &dy, &mut y).unwrap();
        o.push("add", &y, BF16);
        let (mut da, mut db) = (fp32_values(7, n, 1.0), fp32_values(8, n, 1.0));
        be.add_bwd(&dy, &mut da, &mut db).unwrap();
        o.push("add_bwd da", &da, BF16);
        o.push("add_bwd db", &db, BF16);
        let mut acc = fp32_values(9, n, 1.0);
        be.accumulate(&mut acc, &fp32_values(10, n, 1.0));
        o.push("accumulate", &acc, EXACT);

        // Empty buffers: nothing to do, and no zero-byte allocation.
        be.gelu_fwd(&[], &mut []).unwrap();
        be.add_bwd(&[], &mut [], &mut []).unwrap();
    }

    fn adamw(be: &dyn Backend, o: &mut Outs) {
        let n = 1001;
        let mut param = fp32_values(11, n, 1.0);
        let grad = fp32_values(12, n, 0.1);
        let mut m = fp32_values(13, n, 0.01);
        let mut v: Vec<f32> = fp32_values(14, n, 1e-4).iter().map(|x| x.abs()).collect();
        be.adamw_step(
            &mut param, &grad, &mut m, &mut v, 3, 1e-2, 0.9, 0.95, 1e-8, 0.1,
        )
        .unwrap();
        o.push("adamw param", &param, FP32);
        o.push("adamw m", &m, FP32);
        o.push("adamw v", &v, FP32);
    }

    fn attention(be: &dyn Backend, o: &mut Outs) {
        // Queries at positions 16..32 against two causal ring blocks of keys, at
        // 0..16 (all visible) and 16..32 (the diagonal); GQA 2:1, d != dv.
        let dims = AttnDims {
            batch: 2,
            sq: 16,
            sk: 16,
            hq: 4,
            hkv: 2,
            d: 16,
            dv: 8,
        };
        let (nq, nk, nv) = (2 * 16 * 4 * 16, 2 * 16 * 2 * 16, 2 * 16 * 2 * 8);
        let (no, nl) = (2 * 16 * 4 * 8, 2 * 4 * 16);
        let scale = 0.25;
        let q = values(20, nq, 1.0);
        let blocks = [
            (0, values(21, nk, 1.0), values(22, nv, 1.0)),
            (16, values(23, nk, 1.0), values(24, nv, 1.0)),
        ];
        let mut o_acc = vec![0.0; no];
        let mut lse_acc = vec![f32::NEG_INFINITY; nl];
        for (k_pos0, k, v) in &blocks {
            let (mut out, mut lse) = (vec![f32::NAN; no], vec![f32::NAN; nl]);
            be.attention_fwd(
                &dims, &q, k, v, 16, *k_pos0, true, scale, &mut out, &mut lse, None,
            )
            .unwrap();
            o.push(format!("attention_fwd k_pos0 {k_pos0} out"), &out, ATTN);
            o.push(format!("attention_fwd k_pos0 {k_pos0} lse"), &lse, SUMS);
            // The merge's inputs are the CPU's, so that it is compared alone.
            cpu::attention_fwd(
                &dims, &q, k, v, 16, *k_pos0, true, scale, &mut out, &mut lse, None,
            )
            .unwrap();
            be.attention_merge(&dims, &mut o_acc, &mut lse_acc, &out, &lse)
                .unwrap();
        }
        o.push("attention_merge out", &o_acc, EXACT);
        o.push("attention_merge lse", &lse_acc, EXACT);

        // Backward per block from the final (merged) output, as the GPU reads it.
        let o_final: Vec<f32> = o_acc.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
        let d_o = values(25, no, 1.0);
        let mut d_q = fp32_values(26, nq, 0.1);
        for (k_pos0, k, v) in &blocks {
            let (mut d_k, mut d_v) = (fp32_values(27, nk, 0.1), fp32_values(28, nv, 0.1));
            be.attention_bwd(
                &dims, &q, k, v, &o_final, &lse_acc, &d_o, 16, *k_pos0, true, scale, &mut d_q,
                &mut d_k, &mut d_v, None,
            )
            .unwrap();
            o.push(format!("attention_bwd k_pos0 {k_pos0} d_k"), &d_k, ATTN);
            o.push(format!("attention_bwd k_pos0 {k_pos0} d_v"), &d_v, ATTN);
        }
        o.push("attention_bwd d_q (both blocks)", &d_q, ATTN);

        // Dropout: the CPU kernels on either backend.
        let keep = |b: usize, h: usize, qp: usize, kp: usize| {
            !splitmix((b * 31 + h) as u64 ^ splitmix((qp * 1009 + kp) as u64)).is_multiple_of(4)
        };
        let drop = Dropout {
            p: 0.25,
            keep: &keep,
        };
        let (k, v) = (&blocks[0].1, &blocks[0].2);
        let (mut out, mut lse) = (vec![f32::NAN; no], vec![f32::NAN; nl]);
        be.attention_fwd(
            &dims,
            &q,
            k,
            v,
            0,
            0,
            true,
            scale,
            &mut out,
            &mut lse,
            Some(&drop),
        )
        .unwrap();
        o.push("attention_fwd dropout out", &out, EXACT);
        o.push("attention_fwd dropout lse", &lse, EXACT);
        let (mut d_q, mut d_k, mut d_v) = (vec![0.0; nq], vec![0.0; nk], vec![0.0; nv]);
        be.attention_bwd(
            &dims,
            &q,
            k,
            v,
            &out,
            &lse,
            &d_o,
            0,
            0,
            true,
            scale,
            &mut d_q,
            &mut d_k,
            &mut d_v,
            Some(&drop),
        )
        .unwrap();
        o.push("attention_bwd dropout d_q", &d_q, EXACT);
        o.push("attention_bwd dropout d_k", &d_k, EXACT);
        o.push("attention_bwd dropout d_v", &d_v, EXACT);

        // A head dimension over the GPU kernels' 256: the CPU kernel.
        let wide = AttnDims {
            batch: 1,
            sq: 3,
            sk: 3,
            hq: 1,
            hkv: 1,
            d: 260,
            dv: 8,
        };
        let (mut out, mut lse) = (vec![f32::NAN; 3 * 8], vec![f32::NAN; 3]);
        be.attention_fwd(
            &wide,
            &values(29, 3 * 260, 1.0),
            &values(30, 3 * 260, 1.0),
            &values(31, 3 * 8, 1.0),
            0,
            0,
            true,
            0.1,
            &mut out,
            &mut lse,
            None,
        )
        .unwrap();
        o.push("attention_fwd head dim 260 out", &out, EXACT);
        o.push("attention_fwd head dim 260 lse", &lse, EXACT);
    }

    fn embedding_and_loss(be: &dyn Backend, o: &mut Outs) {
        // Rows 10..60 of the vocabulary; some ids fall outside on either side.
        let (vocab_local, dim, start, n) = (50, 64, 10, 37);
        let table = values(40, vocab_local * dim, 1.0);
        let tok = ids(41, n, 65);
        let mut out = vec![f32::NAN; n * dim];
        be.embedding_fwd(&tok, &table, start, dim, &mut out)
            .unwrap();
        o.push("embedding_fwd", &out, EXACT);
        let mut d_table = fp32_values(42, vocab_local * dim, 1.0);
        be.embedding_bwd(&tok, &values(43, n * dim, 1.0), start, dim, &mut d_table)
            .unwrap();
        o.push("embedding_bwd", &d_table, FP32);

        // Cross-entropy on a vocabulary shard 3..40: the CPU pieces on either side.
        let (rows, v_local, vstart) = (5, 37, 3);
        let logits = values(44, rows * v_local, 3.0);
        let labels = ids(45, rows, 45);
        let (mut mx, mut se, mut tg, mut loss) = (
            vec![f32::NAN; rows],
            vec![f32::NAN; rows],
            vec![f32::NAN; rows],
            vec![f32::NAN; rows],
        );
        be.ce_row_max(&logits, rows, v_local, &mut mx).unwrap();
        be.ce_row_sumexp(&logits, rows, v_local, &mx, &mut se)
            .unwrap();
        be.ce_target_logit(&logits, &labels, rows, v_local, vstart, &mut tg)
            .unwrap();
        be.ce_loss(&mx, &se, &tg, &mut loss).unwrap();
        let mut d = fp32_values(46, rows * v_local, 1.0);
        be.ce_bwd(
            &logits, rows, v_local, &mx, &se, &labels, vstart, 0.2, &mut d,
        )
        .unwrap();
        for (name, v) in [
            ("ce_row_max", &mx),
            ("ce_row_sumexp", &se),
            ("ce_target_logit", &tg),
            ("ce_loss", &loss),
            ("ce_bwd", &d),
        ] {
            o.push(name, v, EXACT);
        }
    }

    fn matmul(be: &dyn Backend, o: &mut Outs) {
        let (m, k, n) = (13, 70, 9);
        let (a, b) = (values(50, m * k, 1.0), values(51, k * n, 1.0));
        let c0 = fp32_values(52, m * n, 1.0);
        for ta in [No, Yes] {
            for tb in [No, Yes] {
                for beta in [0.0, 1.0, 0.5] {
                    // beta 0 must not read C: NaN there stays out of the result.
                    let mut c = if beta == 0.0 {
                        vec![f32::NAN; m * n]
                    } else {
                        c0.clone()
                    };
                    be.matmul(ta, tb, m, k, n, &a, &b, beta, &mut c).unwrap();
                    o.push(format!("matmul {ta:?} {tb:?} beta {beta}"), &c, SUMS);
                }
            }
        }
        let batch = 3;
        let (a, b) = (
            values(53, batch * m * k, 1.0),
            values(54, batch * k * n, 1.0),
        );
        let mut c = fp32_values(55, batch * m * n, 1.0);
        be.matmul_batched(batch, Yes, No, m, k, n, &a, &b, 1.0, &mut c)
            .unwrap();
        o.push("matmul_batched", &c, SUMS);
        // k = 0: C = beta C; m = 0: nothing.
        let mut c = c0.clone();
        be.matmul(No, No, m, 0, n, &[], &[], 0.5, &mut c).unwrap();
        o.push("matmul k 0", &c, EXACT);
        be.matmul(No, No, 0, k, n, &[], &b[..k * n], 0.0, &mut [])
            .unwrap();
    }

    fn moe(be: &dyn Backend, o: &mut Outs) {
        for (tokens, experts, k, renorm, dim) in [(37, 8, 2, true, 64), (9, 1100, 3, false, 5)] {
            let tag = format!("{experts} experts");
            let nl = tokens * experts;
            let n = tokens * k;
            let logits = fp32_values(60, nl, 3.0);
            let (mut p, mut idx, mut w) =
                (vec![f32::NAN; nl], vec![u32::MAX; n], vec![f32::NAN; n]);
            be.moe_route_fwd(
                &logits, tokens, experts, k, renorm, &mut p, &mut idx, &mut w,
            )
            .unwrap();
            o.push(format!("moe_route_fwd probs, {tag}"), &p, FP32);
            o.push(
                format!("moe_route_fwd expert_idx, {tag}"),
                &floats(&idx),
                EXACT,
            );
            o.push(format!("moe_route_fwd weights, {tag}"), &w, FP32);
            // The CPU's routing feeds the rest, so that each call is compared alone.
            cpu::moe_route_fwd(
                &logits, tokens, experts, k, renorm, &mut p, &mut idx, &mut w,
            )
            .unwrap();
            let mut d_logits = fp32_values(61, nl, 1.0);
            be.moe_route_bwd(
                &p,
                &idx,
                &w,
                &fp32_values(62, n, 1.0),
                tokens,
                experts,
                k,
                renorm,
                &mut d_logits,
            )
            .unwrap();
            o.push(format!("moe_route_bwd, {tag}"), &d_logits, FP32);

            let x = values(63, tokens * dim, 1.0);
            let (mut out, mut counts, mut perm) = (
                vec![f32::NAN; n * dim],
                vec![usize::MAX; experts],
                vec![u32::MAX; n],
            );
            be.moe_dispatch_fwd(
                &x,
                &idx,
                tokens,
                k,
                experts,
                dim,
                &mut out,
                &mut counts,
                &mut perm,
            )
            .unwrap();
            o.push(format!("moe_dispatch_fwd out, {tag}"), &out, EXACT);
            let counts: Vec<f32> = counts.iter().map(|&c| c as f32).collect();
            o.push(format!("moe_dispatch_fwd counts, {tag}"), &counts, EXACT);
            o.push(
                format!("moe_dispatch_fwd perm, {tag}"),
                &floats(&perm),
                EXACT,
            );

            let mut dx = fp32_values(64, tokens * dim, 1.0);
            be.moe_dispatch_bwd(&values(65, n * dim, 1.0), &perm, tokens, k, dim, &mut dx)
                .unwrap();
            o.push(format!("moe_dispatch_bwd, {tag}"), &dx, BF16);
            let y = values(66, n * dim, 1.0);
            let mut out = vec![f32::NAN; tokens * dim];
            be.moe_combine_fwd(&y, &perm, &w, tokens, k, dim, &mut out)
                .unwrap();
            o.push(format!("moe_combine_fwd, {tag}"), &out, BF16);
            let (mut d_y, mut d_w) = (fp32_values(67, n * dim, 1.0), fp32_values(68, n, 1.0));
            be.moe_combine_bwd(
                &values(69, tokens * dim, 1.0),
                &y,
                &perm,
                &w,
                tokens,
                k,
                dim,
                &mut d_y,
                &mut d_w,
            )
            .unwrap();
            o.push(format!("moe_combine_bwd d_y, {tag}"), &d_y, BF16);
            o.push(format!("moe_combine_bwd d_weights, {tag}"), &d_w, SUMS);
        }

        // What the CPU kernels refuse is refused (the GPU kernels would skip it).
        let name = be.name();
        let (tokens, experts, k, dim) = (4, 8, 2, 3);
        let mut logits = fp32_values(70, tokens * experts, 1.0);
        logits[5] = f32::NAN;
        let (mut p, mut idx, mut w) = (vec![0.0; 32], vec![0; 8], vec![0.0; 8]);
        let r = be.moe_route_fwd(&logits, tokens, experts, k, true, &mut p, &mut idx, &mut w);
        assert!(r.is_err(), "{name}: NaN router logits");
        let bad_idx = [0, 1, 2, 8, 4, 5, 6, 7];
        let (mut out, mut counts, mut perm) = (vec![0.0; 24], vec![0; 8], vec![0; 8]);
        let x = values(71, tokens * dim, 1.0);
        let r = be.moe_dispatch_fwd(
            &x,
            &bad_idx,
            tokens,
            k,
            experts,
            dim,
            &mut out,
            &mut counts,
            &mut perm,
        );
        assert!(r.is_err(), "{name}: expert id out of range");
        let r = be.moe_dispatch_bwd(
            &values(72, 24, 1.0),
            &[0, 1, 2, 3, 4, 5, 6, 8],
            tokens,
            k,
            dim,
            &mut [0.0; 12],
        );
        assert!(r.is_err(), "{name}: permutation entry out of range");
        // A repeated entry is no error: each slot adds to its token.
        let mut dx = vec![0.0; 12];
        be.moe_dispatch_bwd(
            &values(73, 24, 1.0),
            &[0, 0, 2, 3, 4, 5, 6, 7],
            tokens,
            k,
            dim,
            &mut dx,
        )
        .unwrap();
        o.push("moe_dispatch_bwd repeated entry", &dx, EXACT);
    }

    fn norms_and_rope(be: &dyn Backend, o: &mut Outs) {
        let (rows, dim, eps) = (37, 96, 1e-5);
        let x: Vec<f32> = values(80, rows * dim, 2.0)
            .iter()
            .map(|v| bf16::from_f32(v + 0.5).to_f32())
            .collect();
        let w: Vec<f32> = values(81, dim, 0.5)
            .iter()
            .map(|v| bf16::from_f32(1.0 + v).to_f32())
            .collect();
        let bias = values(82, dim, 1.0);
        let dy = values(83, rows * dim, 1.0);

        let (mut y, mut mean, mut rstd) = (
            vec![f32::NAN; rows * dim],
            vec![f32::NAN; rows],
            vec![f32::NAN; rows],
        );
        be.layernorm_fwd(&x, &w, &bias, rows, dim, eps, &mut y, &mut mean, &mut rstd)
            .unwrap();
        o.push("layernorm_fwd y", &y, BF16);
        o.push("layernorm_fwd mean", &mean, SUMS);
        o.push("layernorm_fwd rstd", &rstd, SUMS);
        cpu::layernorm_fwd(&x, &w, &bias, rows, dim, eps, &mut y, &mut mean, &mut rstd).unwrap();
        let (mut dx, mut dw, mut db) = (
            fp32_values(84, rows * dim, 1.0),
            fp32_values(85, dim, 1.0),
            fp32_values(86, dim, 1.0),
        );
        be.layernorm_bwd(
            &x, &w, &mean, &rstd, &dy, rows, dim, &mut dx, &mut dw, &mut db,
        )
        .unwrap();
        o.push("layernorm_bwd dx", &dx, BF16);
        o.push("layernorm_bwd dweight", &dw, PARAM_GRAD);
        o.push("layernorm_bwd dbias", &db, PARAM_GRAD);

        let (mut y, mut rstd) = (vec![f32::NAN; rows * dim], vec![f32::NAN; rows]);
        be.rmsnorm_fwd(&x, &w, rows, dim, eps, &mut y, &mut rstd)
            .unwrap();
        o.push("rmsnorm_fwd y", &y, BF16);
        o.push("rmsnorm_fwd rstd", &rstd, SUMS);
        cpu::rmsnorm_fwd(&x, &w, rows, dim, eps, &mut y, &mut rstd).unwrap();
        let (mut dx, mut dw) = (fp32_values(87, rows * dim, 1.0), fp32_values(88, dim, 1.0));
        be.rmsnorm_bwd(&x, &w, &rstd, &dy, rows, dim, &mut dx, &mut dw)
            .unwrap();
        o.push("rmsnorm_bwd dx", &dx, BF16);
        o.push("rmsnorm_bwd dweight", &dw, PARAM_GRAD);

        let (tokens, heads, hd, rope) = (19, 4, 64, Rope::plain(500_000.0));
        let xr = values(89, tokens * heads * hd, 1.0);
        let pos: Vec<u32> = (0..tokens as u32).map(|t| t * 977 + 3).collect();
        let mut out = vec![f32::NAN; xr.len()];
        be.rope_fwd(&xr, &pos, tokens, heads, hd, rope, &mut out)
            .unwrap();
        o.push("rope_fwd", &out, BF16);
        let mut dx = fp32_values(90, xr.len(), 1.0);
        be.rope_bwd(&xr, &pos, tokens, heads, hd, rope, &mut dx)
            .unwrap();
        o.push("rope_bwd", &dx, BF16);
    }

    fn run(be: &dyn Backend) -> Vec<(String, Vec<f32>, Tol)> {
        let mut o = Outs::default();
        pointwise(be, &mut o);
        adamw(be, &mut o);
        attention(be, &mut o);
        embedding_and_loss(be, &mut o);
        matmul(be, &mut o);
        moe(be, &mut o);
        norms_and_rope(be, &mut o);
        o.0
    }

    #[test]
    fn cuda_backend_matches_the_cpu_backend() {
        // First, so that the sizes and the refusals are checked everywhere.
        let want = run(&CpuBackend);
        let be = match CudaBackend::new() {
            Ok(be) => be,
            Err(e) => {
                assert!(
                    std::env::var("REQUIRE_GPU").as_deref() != Ok("1"),
                    "REQUIRE_GPU=1 but no GPU can be used: {e}"
                );
                println!("cuda_backend_matches_the_cpu_backend: skipped, no GPU: {e}");
                return;
            }
        };
        assert_eq!(be.name(), "cuda");
        let got = run(&be);
        assert_eq!(got.len(), want.len());
        for ((name, g, tol), (wname, w, _)) in got.iter().zip(&want) {
            assert_eq!(name, wname);
            assert_eq!(g.len(), w.len(), "{name}: length");
            let max = w
                .iter()
                .filter(|x| x.is_finite())
                .fold(0.0f32, |m, x| m.max(x.abs()));
            for (i, (&x, &y)) in g.iter().zip(w).enumerate() {
                // Equal values pass (-inf log-sum-exps of rows that see no key).
                assert!(
                    x == y || (x - y).abs() <= tol.of_max * max + tol.rtol * y.abs(),
                    "{name}[{i}]: cuda {x} vs cpu {y} ({tol:?} of max {max})"
                );
            }
        }
    }

    #[test]
    fn fallback_predicates() {
        assert!(is_permutation(&[]));
        assert!(is_permutation(&[2, 0, 1]));
        assert!(!is_permutation(&[0, 0, 1]));
        assert!(!is_permutation(&[0, 3, 1]));
        assert!(experts_in_range(&[0, 7], 8));
        assert!(!experts_in_range(&[0, 8], 8));
        let dims = |d, dv| AttnDims {
            batch: 1,
            sq: 1,
            sk: 1,
            hq: 1,
            hkv: 1,
            d,
            dv,
        };
        let keep = |_: usize, _: usize, _: usize, _: usize| true;
        let drop = Dropout {
            p: 0.1,
            keep: &keep,
        };
        assert!(gpu_attention(&dims(256, 256), None));
        assert!(!gpu_attention(&dims(257, 64), None));
        assert!(!gpu_attention(&dims(64, 257), None));
        assert!(!gpu_attention(&dims(64, 64), Some(&drop)));
    }
}
