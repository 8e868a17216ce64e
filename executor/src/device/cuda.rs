//! The CUDA [`Device`] (feature `cuda`): one GPU through the kernels of
//! [`meshplan_kernels::cuda`], bf16 activations and weight copies, fp32 master
//! weights, gradients and moments, every launch on the [`Gpu`]'s one stream (so
//! the stream's order is the program's, and a download waits for what came before
//! it).
//!
//! Each method is the `Gpu` launch of the same kernel family, with the host
//! device's fixed arguments made explicit: no context-parallel offset (attention
//! positions from 0), `beta` 0 for an activation GEMM and 1 for a weight gradient.

use super::{
    range_err, rows_of, AdamW, Attn, AttnBwd, AttnGrads, AttnOut, Ce, CeOut, CombineBwd, DResult,
    Device, DeviceError, Draw, Embed, Merge, Norm, NormBwd, NormOut, RopeQkv, Routed,
};
use crate::comm::Communicator;
use crate::device::Buffers;
use meshplan_ir::NormKind;
use meshplan_kernels::cpu::{AttnDims, GemmAt, Picks, RowDropout};
use meshplan_kernels::cuda::cudarc::driver::sys::CUevent_flags;
use meshplan_kernels::cuda::cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr, DriverError};
use meshplan_kernels::cuda::{bf16, Gpu, GpuError};

mod comm;
pub use comm::{CudaComm, Reduction};

/// The device's buffers (activations, fp32, ids), named short for the kernels'
/// one-line signatures.
type A = CudaSlice<bf16>;
type F = CudaSlice<f32>;
type I = CudaSlice<u32>;

impl From<GpuError> for DeviceError {
    fn from(e: GpuError) -> Self {
        DeviceError(e.to_string())
    }
}

fn driver(e: DriverError) -> DeviceError {
    GpuError::from(e).into()
}

/// One GPU as a [`Device`].
#[derive(Debug)]
pub struct CudaDevice {
    gpu: Gpu,
}

impl CudaDevice {
    /// Opens GPU `ordinal` and compiles (or reads from the PTX cache) every kernel
    /// module now, so that a missing driver, a compile error or a PTX the driver
    /// refuses is reported here rather than in the middle of the first step.
    pub fn on(ordinal: usize) -> Result<CudaDevice, DeviceError> {
        let gpu = Gpu::on(ordinal)?;
        gpu.load_all()?;
        Ok(CudaDevice { gpu })
    }

    /// The GPU the device launches on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// `dst[dst_off..dst_off + n] = src[src_off..src_off + n]` on the stream.
    fn copy_range<T: DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        src_off: usize,
        dst: &mut CudaSlice<T>,
        dst_off: usize,
        n: usize,
    ) -> DResult<()> {
        let s = range("copy source", src_off, n, src.len())?;
        let d = range("copy destination", dst_off, n, dst.len())?;
        if n == 0 {
            return Ok(());
        }
        self.gpu
            .stream()
            .memcpy_dtod(&src.slice(s), &mut dst.slice_mut(d))
            .map_err(driver)
    }
}

/// `off..off + n` when it lies within `len` elements.
fn range(what: &str, off: usize, n: usize, len: usize) -> DResult<std::ops::Range<usize>> {
    match off.checked_add(n) {
        Some(end) if end <= len => Ok(off..end),
        _ => Err(range_err(what)),
    }
}

/// The CUDA kernels take `q`, `k` and `v` apart ([`Device::READS_FUSED_QKV`] is
/// false, so the interpreter splits them first).
fn apart(a: &Attn<'_, CudaDevice>) -> DResult<()> {
    if a.fused {
        return Err(fused_refused());
    }
    Ok(())
}

fn fused_refused() -> DeviceError {
    DeviceError("the CUDA attention kernels take q, k and v apart, not fused rows".into())
}

impl Buffers for CudaDevice {
    type Act = CudaSlice<bf16>;
    type F32 = CudaSlice<f32>;
    type Ids = CudaSlice<u32>;
    type Mark = CudaEvent;

    fn act_bytes(&self) -> usize {
        2
    }
    fn act_zeros(&self, n: usize) -> DResult<CudaSlice<bf16>> {
        Ok(self.gpu.zeros(n)?)
    }
    fn f32_zeros(&self, n: usize) -> DResult<CudaSlice<f32>> {
        Ok(self.gpu.zeros(n)?)
    }
    fn f32_upload(&self, host: &[f32]) -> DResult<CudaSlice<f32>> {
        Ok(self.gpu.upload(host)?)
    }
    fn ids_upload(&self, host: &[u32]) -> DResult<CudaSlice<u32>> {
        Ok(self.gpu.upload(host)?)
    }
    fn ids_zeros(&self, n: usize) -> DResult<CudaSlice<u32>> {
        Ok(self.gpu.zeros(n)?)
    }
    fn f32_download(&self, x: &CudaSlice<f32>) -> DResult<Vec<f32>> {
        Ok(self.gpu.download(x)?)
    }
    fn ids_download(&self, x: &CudaSlice<u32>) -> DResult<Vec<u32>> {
        Ok(self.gpu.download(x)?)
    }
    fn act_download(&self, x: &CudaSlice<bf16>) -> DResult<Vec<f32>> {
        Ok(self.gpu.download(x)?.iter().map(|v| v.to_f32()).collect())
    }
    fn act_len(x: &CudaSlice<bf16>) -> usize {
        x.len()
    }
    fn f32_len(x: &CudaSlice<f32>) -> usize {
        x.len()
    }
    fn ids_len(x: &CudaSlice<u32>) -> usize {
        x.len()
    }
    fn to_act(&self, x: &CudaSlice<f32>, y: &mut CudaSlice<bf16>) -> DResult<()> {
        Ok(self.gpu.cast_f32_to_bf16(x, y)?)
    }
    fn f32_copy(&self, x: (&F, usize), y: (&mut F, usize), n: usize) -> DResult<()> {
        self.copy_range(x.0, x.1, y.0, y.1, n)
    }
    fn act_copy(&self, x: (&A, usize), y: (&mut A, usize), n: usize) -> DResult<()> {
        self.copy_range(x.0, x.1, y.0, y.1, n)
    }
    fn synchronize(&self) -> DResult<()> {
        Ok(self.gpu.synchronize()?)
    }
    fn mark(&self) -> DResult<CudaEvent> {
        // cudarc's default event has timing disabled, and `elapsed_ms` refuses it.
        self.gpu
            .stream()
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver)
    }
    fn seconds_between(&self, a: &CudaEvent, b: &CudaEvent) -> DResult<f64> {
        let ms = a.elapsed_ms(b).map_err(driver)?;
        Ok(f64::from(ms) / 1e3)
    }
    /// Device-wide (`total - free` of cuMemGetInfo): this process's buffers and
    /// cached pool, its context, and any other process on the same GPU.
    fn memory_in_use(&self) -> Option<u64> {
        let (free, total) = self.gpu.context().mem_get_info().ok()?;
        Some(total.saturating_sub(free) as u64)
    }
}

#[allow(clippy::too_many_arguments)]
impl Device for CudaDevice {
    type Reduction = Reduction;
    type Comm = CudaComm;

    fn host_comm(comm: Box<dyn Communicator>) -> Box<CudaComm> {
        Box::new(CudaComm::Staged(comm))
    }
    fn first_non_finite(&self, xs: &[&CudaSlice<f32>]) -> DResult<Option<usize>> {
        Ok(self.gpu.first_non_finite(xs)?)
    }
    fn f32_zero(&self, x: &mut CudaSlice<f32>) -> DResult<()> {
        self.gpu.stream().memset_zeros(x).map_err(driver)
    }
    fn f32_scale(&self, x: &mut CudaSlice<f32>, a: f32) -> DResult<()> {
        Ok(self.gpu.scale_f32(x, a)?)
    }
    fn f32_accumulate(&self, acc: &mut CudaSlice<f32>, x: &CudaSlice<f32>) -> DResult<()> {
        Ok(self.gpu.add_f32(x, acc)?)
    }
    fn accumulate(&self, acc: &mut CudaSlice<bf16>, x: &CudaSlice<bf16>) -> DResult<()> {
        Ok(self.gpu.accumulate(acc, x)?)
    }
    fn matmul(&self, g: GemmAt, a: &A, b: &A, c: &mut A) -> DResult<()> {
        Ok(self.gpu.gemm_at(&g, a, b, 0.0, c)?)
    }
    fn matmul_acc(&self, g: GemmAt, a: &A, b: &A, c: &mut F) -> DResult<()> {
        Ok(self.gpu.gemm_at(&g, a, b, 1.0, c)?)
    }
    fn bias_add(&self, y: &mut A, bias: &A) -> DResult<()> {
        let (rows, n) = (rows_of("y", y.len(), bias.len())?, bias.len());
        Ok(self.gpu.bias_add(y, bias, rows, n)?)
    }
    fn bias_grad(&self, dy: &A, dbias: &mut F) -> DResult<()> {
        let (rows, n) = (rows_of("dy", dy.len(), dbias.len())?, dbias.len());
        Ok(self.gpu.bias_grad(dy, rows, n, dbias)?)
    }
    fn split_qkv(&self, x: &A, dims: &AttnDims, [q, k, v]: [&mut A; 3]) -> DResult<()> {
        Ok(self.gpu.split_qkv(x, dims, q, k, v)?)
    }
    fn join_qkv(&self, [dq, dk, dv]: [&A; 3], dims: &AttnDims, dx: &mut A) -> DResult<()> {
        Ok(self.gpu.join_qkv(dq, dk, dv, dims, dx)?)
    }
    fn swap_axes(&self, x: &A, [p, q, w]: [usize; 3], y: &mut A) -> DResult<()> {
        Ok(self.gpu.transpose_bs(x, p, q, w, true, y)?)
    }
    fn rope_qkv(&self, r: &RopeQkv<'_, Self>, y: &mut CudaSlice<bf16>) -> DResult<()> {
        let (hq, hkv, d, width) = r.shape;
        let (x, pos, rows, rope, back) = (r.x, r.positions, r.rows, r.rope, r.backward);
        Ok(self
            .gpu
            .rope_qkv(x, pos, rows, hq, hkv, d, width, rope, back, y)?)
    }
    fn attention_fwd(&self, a: &Attn<'_, Self>, out: AttnOut<'_, Self>) -> DResult<()> {
        apart(a)?;
        let (q0, k0) = a.pos0;
        let (q, k, v, causal, scale) = (a.q, a.k, a.v, a.causal, a.scale);
        Ok(self.gpu.attention_fwd(
            a.dims, q, k, v, q0, k0, causal, scale, a.dropout, out.o, out.lse,
        )?)
    }
    fn attention_bwd(&self, a: &Attn<'_, Self>, b: AttnBwd<'_, Self>) -> DResult<()> {
        apart(a)?;
        let (q0, k0) = a.pos0;
        let (q, k, v, causal, scale) = (a.q, a.k, a.v, a.causal, a.scale);
        let AttnGrads::Apart(d_q, d_k, d_v) = b.grads else {
            return Err(fused_refused());
        };
        let (o, lse, d_o) = (b.o, b.lse, b.d_o);
        Ok(self.gpu.attention_bwd(
            a.dims, q, k, v, o, lse, d_o, q0, k0, causal, scale, a.dropout, d_q, d_k, d_v,
        )?)
    }
    fn attention_merge(&self, dims: &AttnDims, m: Merge<'_, Self>) -> DResult<()> {
        let (o_acc, lse_acc, o_blk, lse_blk) = (m.o_acc, m.lse_acc, m.o_blk, m.lse_blk);
        Ok(self
            .gpu
            .attention_merge(dims, o_acc, lse_acc, o_blk, lse_blk)?)
    }
    fn embedding_fwd(&self, e: &Embed<'_, Self>, w: &A, y: &mut A) -> DResult<()> {
        Ok(self.gpu.embedding_fwd(e.ids, w, e.vocab_start, e.dim, y)?)
    }
    fn embedding_bwd(&self, e: &Embed<'_, Self>, dy: &A, dw: &mut F) -> DResult<()> {
        Ok(self
            .gpu
            .embedding_bwd(e.ids, dy, e.vocab_start, e.dim, dw)?)
    }
    fn norm_fwd(&self, n: &Norm<'_, Self>, out: NormOut<'_, Self>) -> DResult<()> {
        let NormOut { y, mean, rstd } = out;
        let (g, x, w) = (&self.gpu, n.x, n.w);
        if n.kind == NormKind::Rmsnorm {
            return Ok(g.rmsnorm_fwd(x, w, n.rows, n.dim, n.eps, y, rstd)?);
        }
        let (b, mean) = super::layernorm_parts(n.b, mean)?;
        Ok(g.layernorm_fwd(x, w, b, n.rows, n.dim, n.eps, y, mean, rstd)?)
    }
    fn norm_bwd(&self, n: &Norm<'_, Self>, b: NormBwd<'_, Self>) -> DResult<()> {
        let (g, x, w, rows, dim) = (&self.gpu, n.x, n.w, n.rows, n.dim);
        if n.kind == NormKind::Rmsnorm {
            return Ok(g.rmsnorm_bwd(x, w, b.rstd, b.dy, rows, dim, b.dx, b.dw)?);
        }
        let (mean, db) = super::layernorm_parts(b.mean, b.db)?;
        Ok(g.layernorm_bwd(x, w, mean, b.rstd, b.dy, rows, dim, b.dx, b.dw, db)?)
    }
    fn gelu_fwd(&self, x: &CudaSlice<bf16>, y: &mut CudaSlice<bf16>) -> DResult<()> {
        Ok(self.gpu.gelu_fwd(x, y)?)
    }
    fn gelu_bwd(&self, x: &A, dy: &A, dx: &mut A) -> DResult<()> {
        Ok(self.gpu.gelu_bwd(x, dy, dx)?)
    }
    fn swiglu_fwd(&self, x: &A, f: usize, y: &mut A) -> DResult<()> {
        Ok(self
            .gpu
            .swiglu_fwd(x, rows_of("x", x.len(), 2 * f)?, f, y)?)
    }
    fn swiglu_bwd(&self, x: &A, g: &A, f: usize, dx: &mut A) -> DResult<()> {
        Ok(self
            .gpu
            .swiglu_bwd(x, g, rows_of("x", x.len(), 2 * f)?, f, dx)?)
    }
    fn dropout(&self, x: &A, w: usize, d: &RowDropout, y: &mut A) -> DResult<()> {
        Ok(self
            .gpu
            .dropout_rows(x, rows_of("x", x.len(), w)?, w, d, y)?)
    }
    fn moe_route(&self, logits: &A, r: &mut Routed<Self>) -> DResult<()> {
        // The routing kernel reads fp32 scores.
        let mut l32 = self.gpu.zeros::<f32>(logits.len())?;
        self.gpu.cast_bf16_to_f32(logits, &mut l32)?;
        let m = r.m;
        let (tokens, experts, k, renorm) = (m.tokens, m.experts, m.k, m.renormalize);
        let (probs, idx, wts) = (&mut r.probs, &mut r.idx, &mut r.wts);
        Ok(self
            .gpu
            .moe_route_fwd(&l32, tokens, experts, k, renorm, probs, idx, wts)?)
    }
    fn moe_route_bwd(&self, r: &Routed<Self>, dw: &F, dx: &mut A) -> DResult<()> {
        let mut d32 = self.gpu.zeros::<f32>(dx.len())?;
        let m = r.m;
        let (tokens, experts, k, renorm) = (m.tokens, m.experts, m.k, m.renormalize);
        let (probs, idx, wts) = (&r.probs, &r.idx, &r.wts);
        (self.gpu).moe_route_bwd(probs, idx, wts, dw, tokens, experts, k, renorm, &mut d32)?;
        Ok(self.gpu.add_f32_into_bf16(&d32, dx)?)
    }
    fn moe_dispatch(&self, r: &mut Routed<Self>, x: &A, y: &mut A) -> DResult<()> {
        let m = r.m;
        let mut counts = self.gpu.zeros::<u32>(m.experts)?;
        let (idx, perm) = (&r.idx, &mut r.perm);
        (self.gpu).moe_dispatch_fwd(
            x,
            idx,
            m.tokens,
            m.k,
            m.experts,
            m.dim,
            y,
            &mut counts,
            perm,
        )?;
        let host = |c: Vec<u32>| c.into_iter().map(|c| c as usize).collect();
        if let Some(c) = r.capacity {
            let mut at = self.gpu.zeros::<u32>(m.tokens * m.k)?;
            let mut pad = self.gpu.zeros::<u32>(m.experts * c.per_expert(m.tokens))?;
            let mut kept = self.gpu.zeros::<u32>(m.experts)?;
            let on = (&r.perm, &counts);
            (self.gpu).moe_capacity(on, m.k, c, (&mut at, &mut pad), &mut kept)?;
            r.kept = host(self.gpu.download(&kept)?);
            r.padded = Some([pad, at]);
        }
        // The exchange's sizes: a few integers, the op's only downloads.
        r.counts = host(self.gpu.download(&counts)?);
        Ok(())
    }
    fn moe_dispatch_bwd(&self, r: &Routed<Self>, dy: &A, dx: &mut A) -> DResult<()> {
        let m = r.m;
        Ok(self
            .gpu
            .moe_dispatch_bwd(dy, &r.perm, m.tokens, m.k, m.dim, dx)?)
    }
    fn moe_combine(&self, r: &Routed<Self>, y: &A, out: &mut A) -> DResult<()> {
        let m = r.m;
        Ok(self
            .gpu
            .moe_combine_fwd(y, &r.perm, &r.wts, m.tokens, m.k, m.dim, out)?)
    }
    fn moe_combine_bwd(&self, r: &Routed<Self>, g: CombineBwd<'_, Self>) -> DResult<()> {
        let (m, perm, wts) = (r.m, &r.perm, &r.wts);
        let (dy, y, d_y, d_wts) = (g.dy, g.y, g.d_y, g.d_wts);
        Ok(self
            .gpu
            .moe_combine_bwd(dy, y, perm, wts, m.tokens, m.k, m.dim, d_y, d_wts)?)
    }
    fn gather_rows(&self, x: &A, i: &I, w: usize, y: &mut A) -> DResult<()> {
        Ok(self.gpu.gather_rows(x, i, w, y)?)
    }
    fn add(
        &self,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> DResult<()> {
        Ok(self.gpu.add(a, b, out)?)
    }
    fn cross_entropy(&self, c: &Ce<'_, Self>, out: CeOut<'_, Self>) -> DResult<()> {
        let (logits, labels, rows, v) = (c.logits, c.labels, c.rows, c.v_local);
        let (loss, dlogits) = (out.loss, out.dlogits);
        Ok(self
            .gpu
            .ce_fused(logits, labels, rows, v, c.scale, loss, dlogits)?)
    }
    fn ce_row_max(&self, c: &Ce<'_, Self>, max: &mut CudaSlice<f32>) -> DResult<()> {
        Ok(self.gpu.ce_row_max(c.logits, c.rows, c.v_local, max)?)
    }
    fn ce_sums(&self, c: &Ce<'_, Self>, max: &Self::F32, out: [&mut Self::F32; 2]) -> DResult<()> {
        let [se, target] = out;
        let (logits, labels, rows, v, start) =
            (c.logits, c.labels, c.rows, c.v_local, c.vocab_start);
        Ok(self
            .gpu
            .ce_sumexp_target(logits, labels, rows, v, start, max, se, target)?)
    }
    fn ce_finish(&self, c: &Ce<'_, Self>, s: [&F; 3], out: CeOut<'_, Self>) -> DResult<()> {
        let (logits, labels, rows, v, start) =
            (c.logits, c.labels, c.rows, c.v_local, c.vocab_start);
        let (loss, dlogits) = (out.loss, out.dlogits);
        Ok(self
            .gpu
            .ce_finish(logits, labels, rows, v, start, c.scale, s, loss, dlogits)?)
    }
    fn act_to_f32(&self, x: &A) -> DResult<F> {
        let mut y = self.gpu.zeros::<f32>(x.len())?;
        self.gpu.cast_bf16_to_f32(x, &mut y)?;
        Ok(y)
    }
    fn pick(&self, x: &F, d: Picks, draw: Option<Draw<'_>>) -> DResult<Vec<u32>> {
        let mut tokens = self.gpu.zeros::<u32>(d.rows)?;
        match draw {
            None => self.gpu.argmax_parts(x, d, &mut tokens)?,
            Some((s, requests)) => {
                let requests = self.gpu.upload(requests)?;
                self.gpu.sample_parts(x, d, s, &requests, &mut tokens)?;
            }
        }
        Ok(self.gpu.download(&tokens)?)
    }
    fn adamw(&self, a: AdamW<'_, Self>) -> DResult<()> {
        let (b1, b2, eps, wd) = a.hyper;
        // The fused kernel always writes a bf16 copy: a scratch one when unwanted.
        let mut scratch;
        let compute = match a.compute {
            Some(c) => c,
            None => {
                scratch = self.gpu.zeros::<bf16>(a.param.len())?;
                &mut scratch
            }
        };
        let (param, grad, m, v, step, lr) = (a.param, a.grad, a.m, a.v, a.step, a.lr);
        Ok(self
            .gpu
            .adamw_step(param, grad, m, v, compute, step, lr, b1, b2, eps, wd)?)
    }
}

#[cfg(test)]
mod tests {
    //! [`CudaDevice`] against [`HostDevice`] through the [`Device`] trait alone, on
    //! the same bf16-representable inputs: the mapping of each method onto its GPU
    //! kernel (argument order, transposes, fixed offsets, overwrite or accumulate).
    //! The kernels themselves are tested against the CPU in `meshplan-kernels`.
    //! Skips without a GPU (saying why); `REQUIRE_GPU=1` turns the skip into a
    //! failure.

    use super::*;
    use crate::device::HostDevice;
    use crate::init::splitmix;
    use meshplan_kernels::cpu::Rope;
    use meshplan_kernels::cpu::Transpose::{No, Yes};

    /// `n` values in `[-scale, scale)` rounded to bf16, so that rounding an input
    /// to the GPU's compute precision changes nothing.
    fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        (0..n as u64)
            .map(|i| {
                let u = (splitmix(seed ^ splitmix(i)) >> 40) as f32 / (1u64 << 24) as f32;
                bf16::from_f32(scale * (2.0 * u - 1.0)).to_f32()
            })
            .collect()
    }

    fn ids(seed: u64, n: usize, below: u64) -> Vec<u32> {
        (0..n as u64)
            .map(|i| (splitmix(seed ^ splitmix(i)) % below) as u32)
            .collect()
    }

    /// An activation buffer holding `x`: the trait has no bf16 upload, so through
    /// an fp32 buffer and [`Buffers::to_act`].
    fn act<D: Device>(dev: &D, x: &[f32]) -> D::Act {
        let f = dev.f32_upload(x).unwrap();
        let mut a = dev.act_zeros(x.len()).unwrap();
        dev.to_act(&f, &mut a).unwrap();
        a
    }

    /// A result to compare: its name, values and tolerance `(atol, rtol)`.
    type Out = (String, Vec<f32>, (f32, f32));

    /// One bf16 rounding of the result on top of fp32 noise.
    const BF16: (f32, f32) = (2e-2, 1.0 / 128.0);
    /// fp32 results of the same fp32 arithmetic.
    const FP32: (f32, f32) = (1e-6, 1e-5);
    /// Bit-for-bit copies.
    const EXACT: (f32, f32) = (0.0, 0.0);

    fn run<D: Device>(dev: &D) -> Vec<Out> {
        let mut out: Vec<Out> = Vec::new();
        for cases in [
            gemm_cases,
            layout_cases,
            bias_cases,
            cross_entropy_cases,
            adamw_cases,
            copies_cases,
        ] {
            cases(dev, &mut out);
        }
        out
    }

    fn act_out<D: Device>(dev: &D, out: &mut Vec<Out>, name: String, x: &D::Act, tol: (f32, f32)) {
        out.push((name, dev.act_download(x).unwrap(), tol));
    }

    fn f32_out<D: Device>(dev: &D, out: &mut Vec<Out>, name: String, x: &D::F32, tol: (f32, f32)) {
        out.push((name, dev.f32_download(x).unwrap(), tol));
    }

    /// Every transpose pair, bf16 activations out and fp32 gradients added into.
    fn gemm_cases<D: Device>(dev: &D, out: &mut Vec<Out>) {
        let (m, k, n) = (13, 70, 9);
        let (a, b) = (
            act(dev, &values(1, m * k, 1.0)),
            act(dev, &values(2, k * n, 1.0)),
        );
        for ta in [No, Yes] {
            for tb in [No, Yes] {
                let mut c = dev.act_zeros(m * n).unwrap();
                dev.matmul(GemmAt::whole(ta, tb, m, k, n), &a, &b, &mut c)
                    .unwrap();
                act_out(dev, out, format!("matmul {ta:?} {tb:?}"), &c, BF16);
                let mut c = dev.f32_upload(&values(3, m * n, 1.0)).unwrap();
                dev.matmul_acc(GemmAt::whole(ta, tb, m, k, n), &a, &b, &mut c)
                    .unwrap();
                f32_out(
                    dev,
                    out,
                    format!("matmul_acc {ta:?} {tb:?}"),
                    &c,
                    (1e-3, 1e-4),
                );
            }
        }
    }

    /// Fused QKV rows [s, b, width] split and joined back, RoPE on them both ways.
    fn layout_cases<D: Device>(dev: &D, out: &mut Vec<Out>) {
        let (dims, rows, width, x) = fused_rows(dev);
        let mut q = dev.act_zeros(rows * dims.hq * dims.d).unwrap();
        let mut kk = dev.act_zeros(rows * dims.hkv * dims.d).unwrap();
        let mut v = dev.act_zeros(rows * dims.hkv * dims.dv).unwrap();
        dev.split_qkv(&x, &dims, [&mut q, &mut kk, &mut v]).unwrap();
        act_out(dev, out, "split_qkv q".into(), &q, EXACT);
        act_out(dev, out, "split_qkv k".into(), &kk, EXACT);
        act_out(dev, out, "split_qkv v".into(), &v, EXACT);
        let mut joined = dev.act_zeros(rows * width).unwrap();
        dev.join_qkv([&q, &kk, &v], &dims, &mut joined).unwrap();
        act_out(dev, out, "join_qkv".into(), &joined, EXACT);
        let mut t = dev.act_zeros(rows * width).unwrap();
        dev.swap_axes(&x, [dims.batch, dims.sq, width], &mut t)
            .unwrap();
        act_out(dev, out, "transpose_bs".into(), &t, EXACT);
        let positions = dev
            .ids_upload(&(0..rows as u32).map(|r| 37 * r + 5).collect::<Vec<_>>())
            .unwrap();
        for backward in [false, true] {
            let mut y = dev.act_zeros(rows * width).unwrap();
            let r = RopeQkv {
                x: &x,
                positions: &positions,
                rows,
                shape: (dims.hq, dims.hkv, dims.d, width),
                rope: Rope::plain(10_000.0),
                backward,
            };
            dev.rope_qkv(&r, &mut y).unwrap();
            act_out(dev, out, format!("rope_qkv backward={backward}"), &y, BF16);
        }
    }

    /// The fused QKV rows the layout and bias cases read: their sizes, row count,
    /// width and values.
    fn fused_rows<D: Device>(dev: &D) -> (AttnDims, usize, usize, D::Act) {
        let dims = AttnDims {
            batch: 2,
            sq: 3,
            sk: 3,
            hq: 4,
            hkv: 2,
            d: 8,
            dv: 6,
        };
        let rows = dims.batch * dims.sq;
        let width = dims.qkv_width();
        (dims, rows, width, act(dev, &values(4, rows * width, 1.0)))
    }

    /// Bias, accumulate.
    fn bias_cases<D: Device>(dev: &D, out: &mut Vec<Out>) {
        let (_, rows, width, x) = fused_rows(dev);
        let mut y = act(dev, &values(5, rows * width, 1.0));
        dev.bias_add(&mut y, &act(dev, &values(6, width, 1.0)))
            .unwrap();
        act_out(dev, out, "bias_add".into(), &y, BF16);
        let mut db = dev.f32_upload(&values(7, width, 1.0)).unwrap();
        dev.bias_grad(&x, &mut db).unwrap();
        f32_out(dev, out, "bias_grad".into(), &db, (1e-5, 1e-5));
        dev.accumulate(&mut y, &x).unwrap();
        act_out(dev, out, "accumulate".into(), &y, BF16);
    }

    /// Cross-entropy: loss written, dlogits written (not added to the ones).
    fn cross_entropy_cases<D: Device>(dev: &D, out: &mut Vec<Out>) {
        let (ce_rows, vocab) = (5, 37);
        let logits = act(dev, &values(8, ce_rows * vocab, 3.0));
        let labels = dev.ids_upload(&ids(9, ce_rows, vocab as u64)).unwrap();
        let mut loss = dev.f32_upload(&vec![7.0; ce_rows]).unwrap();
        let mut dlogits = act(dev, &vec![1.0; ce_rows * vocab]);
        let c = Ce {
            logits: &logits,
            labels: &labels,
            rows: ce_rows,
            v_local: vocab,
            vocab_start: 0,
            scale: 0.2,
        };
        let ce_out = CeOut {
            loss: &mut loss,
            dlogits: &mut dlogits,
        };
        dev.cross_entropy(&c, ce_out).unwrap();
        f32_out(dev, out, "ce loss".into(), &loss, (1e-4, 1e-4));
        act_out(dev, out, "ce dlogits".into(), &dlogits, (1e-4, 1.0 / 128.0));
    }

    /// AdamW: the fp32 master, moments and the refreshed compute copy.
    fn adamw_cases<D: Device>(dev: &D, out: &mut Vec<Out>) {
        let np = 103;
        let mut param = dev.f32_upload(&values(10, np, 1.0)).unwrap();
        let grad = dev.f32_upload(&values(11, np, 0.1)).unwrap();
        let mut m1 = dev.f32_upload(&values(12, np, 0.01)).unwrap();
        let v0: Vec<f32> = values(13, np, 1e-4).iter().map(|x| x.abs()).collect();
        let mut v1 = dev.f32_upload(&v0).unwrap();
        let mut compute = dev.act_zeros(np).unwrap();
        dev.adamw(AdamW {
            param: &mut param,
            grad: &grad,
            m: &mut m1,
            v: &mut v1,
            compute: Some(&mut compute),
            step: 3,
            lr: 1e-2,
            hyper: (0.9, 0.95, 1e-8, 0.1),
        })
        .unwrap();
        act_out(
            dev,
            out,
            "adamw compute copy".into(),
            &compute,
            (1e-6, 1.0 / 128.0),
        );
        for (name, buf) in [("adamw param", &param), ("adamw m", &m1), ("adamw v", &v1)] {
            f32_out(dev, out, name.into(), buf, FP32);
        }
    }

    /// A sub-range copy between fp32 buffers.
    fn copies_cases<D: Device>(dev: &D, out: &mut Vec<Out>) {
        let src = dev.f32_upload(&values(14, 20, 1.0)).unwrap();
        let mut dst = dev.f32_zeros(16).unwrap();
        dev.f32_copy((&src, 5), (&mut dst, 3), 10).unwrap();
        f32_out(dev, out, "f32_copy".into(), &dst, EXACT);
        assert!(dev.f32_copy((&src, 15), (&mut dst, 0), 10).is_err());
        assert!(dev.f32_copy((&src, 0), (&mut dst, 7), 10).is_err());
    }

    #[test]
    fn cuda_device_matches_the_host_device() {
        // First, so that the sizes and the expected errors are checked everywhere.
        let want = run(&HostDevice);
        let dev = match CudaDevice::on(0) {
            Ok(dev) => dev,
            Err(e) => {
                assert!(
                    std::env::var("REQUIRE_GPU").as_deref() != Ok("1"),
                    "REQUIRE_GPU=1 but no GPU can be used: {e}"
                );
                println!("cuda_device_matches_the_host_device: skipped, no GPU: {e}");
                return;
            }
        };
        let start = dev.mark().unwrap();
        let got = run(&dev);
        let end = dev.mark().unwrap();
        assert_eq!(got.len(), want.len());
        for ((name, g, (atol, rtol)), (wname, w, _)) in got.iter().zip(&want) {
            assert_eq!(name, wname);
            assert_eq!(g.len(), w.len(), "{name}: length");
            for (i, (&x, &y)) in g.iter().zip(w).enumerate() {
                assert!(
                    x == y || (x - y).abs() <= atol + rtol * y.abs(),
                    "{name}[{i}]: cuda {x} vs host {y}"
                );
            }
        }
        dev.synchronize().unwrap();
        let seconds = dev.seconds_between(&start, &end).unwrap();
        assert!(seconds.is_finite() && seconds >= 0.0, "{seconds}");
        assert!(dev.memory_in_use().is_some_and(|b| b > 0));
    }
}
