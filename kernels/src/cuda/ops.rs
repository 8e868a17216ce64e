//! One launch method per kernel on [`Gpu`], each the device twin of the CPU
//! reference of the same name in [`crate::cpu`] (same sizes, layouts and
//! overwrite/accumulate rules; bf16 where the compute is bf16).
//!
//! Every method checks its buffers' lengths against the sizes and that the sizes fit
//! the kernel's `int` parameters before launching, and returns
//! [`GpuError::Args`] otherwise: the kernels themselves trust their arguments.
//! Launches are asynchronous on [`Gpu::stream`]. Ids (tokens, labels, experts,
//! permutation entries) outside their range are skipped by the kernels rather than
//! checked here, which would need a copy back to the host.

#![allow(clippy::too_many_arguments)] // the CPU kernels' own argument lists

use super::gpu::{Gpu, GpuError};
use super::KernelModule as M;
use crate::cpu::{
    check_capacity, check_len, check_nucleus, check_picks, invalid, prod, AttnDims, AttnDropout,
    Capacity, DropoutDraw, KernelError, Nucleus, Picks, Rope, RowDropout,
};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;

/// `v` as a kernel's `int` argument.
pub(super) fn int(name: &'static str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| invalid(name, format!("{v} does not fit in a 32-bit int")))
}

/// `v` as a kernel's `long long` element count.
pub(super) fn long(name: &'static str, v: usize) -> Result<i64, KernelError> {
    i64::try_from(v).map_err(|_| invalid(name, format!("{v} does not fit in 64 bits")))
}

/// One block of `threads` per row (`rows` > 0, at most `i32::MAX`).
pub(super) fn per_row(rows: usize, threads: u32, shared_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared_bytes,
    }
}

/// Rows per block of the norm kernels, one warp each (`NORM_WARPS` in norm.cu).
const NORM_WARPS: usize = 8;

/// The norm forward kernels' launch: one warp per row.
fn norm_rows(rows: usize) -> LaunchConfig {
    per_row(
        rows.div_ceil(NORM_WARPS),
        (NORM_WARPS * WARP_SIZE) as u32,
        0,
    )
}

/// The norms' parameter-gradient kernels: one thread per `cols_per_thread`
/// columns over chunks of at least 64 rows (more when the grid's y extent would
/// pass 65535). Returns the launch, the chunk's rows and the number of chunks.
fn norm_param_chunks(
    rows: usize,
    dim: usize,
    cols_per_thread: usize,
) -> Result<(LaunchConfig, i32, usize), KernelError> {
    const THREADS: usize = 256;
    let chunk = rows.div_ceil(65_535).max(64);
    let chunks = rows.div_ceil(chunk);
    let blocks = dim.div_ceil(cols_per_thread).div_ceil(THREADS);
    let cfg = LaunchConfig {
        grid_dim: (int("dim", blocks)? as u32, chunks as u32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok((cfg, int("chunk", chunk)?, chunks))
}

/// Threads per block of the row kernels (embedding rows, layout changes).
pub(super) const ROW_THREADS: u32 = 256;
/// Threads of a warp (`WARP` in the prelude).
const WARP_SIZE: usize = 32;
/// Threads per block of the elementwise (grid-stride) kernels.
const ELEM_THREADS: u32 = 256;
/// Threads per block of the fused cross-entropy (`CE_THREADS` in loss.cu).
const CE_THREADS: u32 = 512;
/// Warps per block of the routing kernels (`MOE_WARPS` in moe.cu).
const MOE_WARPS: usize = 4;
/// Attention's tile sizes (`ATT_*` in attention.cu).
const ATT_BC: usize = 32;
const ATT_WARPS: usize = 4;
const ATT_ROWS: usize = 16;
/// The tensor-core attention kernels' tiles (`FA_*` in attention.cu): queries and
/// keys per tile, warps of the backward's block.
const FA_TILE: usize = 64;
const FA_WARPS: usize = 4;
/// Warps of the tensor-core forward's block (16 queries each).
const FA_FWD_WARPS: usize = 8;
/// Largest head dimension the attention kernels hold in registers.
const ATT_HEAD_DIM_MAX: usize = 256;

/// A dropout mask's parameters as the kernels take them by value: the twin of
/// `struct DropoutArgs` in prelude.cuh (same fields, order and sizes: six 64-bit
/// words, then four 32-bit ones).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct DropoutArgs {
    seed: u64,
    step: u64,
    site: u64,
    thr: u64,
    sample0: u64,
    pos0: u64,
    scale: f32,
    mbs: i32,
    on: i32,
    pad: i32,
}

// SAFETY: `DropoutArgs` is `repr(C)` plain data (integers and a float, no pointers
// or padding the C side reads differently), laid out as the prelude's struct.
#[allow(unsafe_code)]
unsafe impl DeviceRepr for DropoutArgs {}

impl DropoutArgs {
    fn draw(d: &DropoutDraw, scale: f32) -> DropoutArgs {
        DropoutArgs {
            seed: d.seed,
            step: d.step,
            site: d.site,
            thr: d.threshold(),
            scale,
            on: 1,
            ..DropoutArgs::default()
        }
    }

    fn rows(d: &RowDropout) -> Result<DropoutArgs, KernelError> {
        check_p(d.draw.p)?;
        Ok(DropoutArgs {
            sample0: d.sample0,
            pos0: d.pos0,
            mbs: int("dropout.mbs", d.mbs.max(1))?,
            ..DropoutArgs::draw(&d.draw, d.scale())
        })
    }

    /// Attention's mask: the survivors' factor rounded as the CPU kernel does it
    /// (in f32 from an f32 `p`); `pos0` carries the first global head.
    fn attention(d: Option<&AttnDropout>) -> Result<DropoutArgs, KernelError> {
        let Some(a) = d else {
            return Ok(DropoutArgs::default());
        };
        check_p(a.draw.p)?;
        let p = a.draw.p as f32;
        Ok(DropoutArgs {
            sample0: a.sample0,
            pos0: a.head0,
            ..DropoutArgs::draw(&a.draw, 1.0 / (1.0 - p))
        })
    }
}

fn check_p(p: f64) -> Result<(), KernelError> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(invalid("dropout.p", format!("must be in [0, 1), got {p}")))
    }
}

/// Launches `f` on the `Gpu`'s stream with the arguments in order.
macro_rules! launch {
    ($gpu:expr, $f:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let cfg: LaunchConfig = $cfg;
        let f = $f;
        let mut builder = $gpu.stream.launch_builder(&f);
        $( builder.arg($arg); )*
        // SAFETY: the arguments follow the kernel's C signature in kernels/cuda
        // (order and types: device buffers for pointers, i32 for int, i64 for long
        // long, f32 for float); the calling method checked every buffer's length
        // against the sizes passed and that the launch covers exactly those sizes;
        // buffers written by the kernel are borrowed mutably, so no other host
        // reference aliases them.
        #[allow(unsafe_code)]
        let launched = unsafe { builder.launch(cfg) };
        launched.map(|_| ()).map_err(GpuError::from)
    }};
}
pub(super) use launch;

impl Gpu {
    /// A grid-stride launch over `n` elements (`n` > 0): enough blocks to fill the
    /// device a few times over, no more.
    pub(super) fn elementwise(&self, n: usize) -> LaunchConfig {
        let max_blocks = (self.info().sm_count.max(1) as usize) * 32;
        let blocks = n.div_ceil(ELEM_THREADS as usize).clamp(1, max_blocks);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (ELEM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    // === embedding ===

    /// [`crate::cpu::embedding_fwd`]: `out [ids.len(), dim] (bf16)` from the local
    /// rows of `table [vocab_local, dim] (bf16)`; ids this shard does not own give
    /// zero rows.
    pub fn embedding_fwd(
        &self,
        ids: &CudaSlice<u32>,
        table: &CudaSlice<bf16>,
        vocab_start: usize,
        dim: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let vl = vocab_local(table.len(), dim)?;
        check_len("out", out.len(), prod("out", &[ids.len(), dim])?)?;
        let (vs, vl, dm, tokens) = (
            int("vocab_start", vocab_start)?,
            int("table", vl)?,
            int("dim", dim)?,
            int("ids", ids.len())?,
        );
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(M::Embedding, "embedding_fwd_bf16")?;
        launch!(
            self,
            f,
            per_row(tokens as usize, 128, 0),
            [ids, table, &vs, &vl, &dm, out]
        )
    }

    /// [`crate::cpu::embedding_bwd`]: `d_table [vocab_local, dim] (fp32) +=` the
    /// rows of `d_out [ids.len(), dim] (bf16)` of owned ids (atomics: repeated ids
    /// add in no fixed order).
    pub fn embedding_bwd(
        &self,
        ids: &CudaSlice<u32>,
        d_out: &CudaSlice<bf16>,
        vocab_start: usize,
        dim: usize,
        d_table: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let vl = vocab_local(d_table.len(), dim)?;
        check_len("d_out", d_out.len(), prod("d_out", &[ids.len(), dim])?)?;
        let (vs, vl, dm, tokens) = (
            int("vocab_start", vocab_start)?,
            int("d_table", vl)?,
            int("dim", dim)?,
            int("ids", ids.len())?,
        );
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(M::Embedding, "embedding_bwd_bf16")?;
        launch!(
            self,
            f,
            per_row(tokens as usize, 128, 0),
            [ids, d_out, &vs, &vl, &dm, d_table]
        )
    }

    // === norms ===

    /// [`crate::cpu::layernorm_fwd`]: `y (bf16)`, `mean`, `rstd (fp32)` from
    /// `x [rows, dim]`, `weight`, `bias [dim]` (bf16).
    pub fn layernorm_fwd(
        &self,
        x: &CudaSlice<bf16>,
        weight: &CudaSlice<bf16>,
        bias: &CudaSlice<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
        y: &mut CudaSlice<bf16>,
        mean: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        check_rows(
            rows,
            dim,
            &[("x", x.len()), ("y", y.len())],
            &[("mean", mean.len()), ("rstd", rstd.len())],
            &[("weight", weight.len()), ("bias", bias.len())],
        )?;
        let (r, d) = (int("rows", rows)?, int("dim", dim)?);
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(M::Norm, "layernorm_fwd_bf16")?;
        launch!(
            self,
            f,
            norm_rows(rows),
            [x, weight, bias, &r, &d, &eps, y, mean, rstd]
        )
    }

    /// [`crate::cpu::layernorm_bwd`]: `dx (bf16) +=`, `dweight`, `dbias (fp32) +=`,
    /// from the forward's `mean`/`rstd`. The parameter gradients are summed over
    /// rows in a fixed order (per-block partials, then one column sum).
    pub fn layernorm_bwd(
        &self,
        x: &CudaSlice<bf16>,
        weight: &CudaSlice<bf16>,
        mean: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        dy: &CudaSlice<bf16>,
        rows: usize,
        dim: usize,
        dx: &mut CudaSlice<bf16>,
        dweight: &mut CudaSlice<f32>,
        dbias: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        check_rows(
            rows,
            dim,
            &[("x", x.len()), ("dy", dy.len()), ("dx", dx.len())],
            &[("mean", mean.len()), ("rstd", rstd.len())],
            &[
                ("weight", weight.len()),
                ("dweight", dweight.len()),
                ("dbias", dbias.len()),
            ],
        )?;
        let (r, d) = (int("rows", rows)?, int("dim", dim)?);
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(M::Norm, "layernorm_bwd_bf16")?;
        launch!(
            self,
            f,
            norm_rows(rows),
            [x, weight, mean, rstd, dy, &r, &d, dx]
        )?;
        // Eight columns per thread when every row is 16-byte aligned (whole
        // allocations are; rows of a multiple of 8 bf16 keep it).
        let vec = dim.is_multiple_of(8);
        let (cfg, chunk, chunks) = norm_param_chunks(rows, dim, if vec { 8 } else { 1 })?;
        let stride = int("dim", 2 * dim)?;
        let mut partial = self.zeros::<f32>(prod("partial", &[chunks, 2, dim])?)?;
        let f = self.function(M::Norm, "layernorm_param_grads")?;
        let vec = i32::from(vec);
        launch!(
            self,
            f,
            cfg,
            [x, mean, rstd, dy, &r, &d, &chunk, &vec, &mut partial]
        )?;
        let nb = chunks as i32;
        let cfg = self.elementwise(dim);
        let pw = partial.slice(..);
        let f = self.function(M::Norm, "colsum_add_f32")?;
        launch!(self, f, cfg, [&pw, &nb, &d, &stride, dweight])?;
        let pb = partial.slice(dim..);
        let f = self.function(M::Norm, "colsum_add_f32")?;
        launch!(self, f, cfg, [&pb, &nb, &d, &stride, dbias])
    }

    /// [`crate::cpu::rmsnorm_fwd`]: `y (bf16)` and `rstd (fp32)` from
    /// `x [rows, dim]`, `weight [dim]` (bf16).
    pub fn rmsnorm_fwd(
        &self,
        x: &CudaSlice<bf16>,
        weight: &CudaSlice<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
        y: &mut CudaSlice<bf16>,
        rstd: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        check_rows(
            rows,
            dim,
            &[("x", x.len()), ("y", y.len())],
            &[("rstd", rstd.len())],
            &[("weight", weight.len())],
        )?;
        let (r, d) = (int("rows", rows)?, int("dim", dim)?);
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(M::Norm, "rmsnorm_fwd_bf16")?;
        launch!(self, f, norm_rows(rows), [x, weight, &r, &d, &eps, y, rstd])
    }

    /// [`crate::cpu::rmsnorm_bwd`]: `dx (bf16) +=`, `dweight (fp32) +=`.
    pub fn rmsnorm_bwd(
        &self,
        x: &CudaSlice<bf16>,
        weight: &CudaSlice<bf16>,
        rstd: &CudaSlice<f32>,
        dy: &CudaSlice<bf16>,
        rows: usize,
        dim: usize,
        dx: &mut CudaSlice<bf16>,
        dweight: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        check_rows(
            rows,
            dim,
            &[("x", x.len()), ("dy", dy.len()), ("dx", dx.len())],
            &[("rstd", rstd.len())],
            &[("weight", weight.len()), ("dweight", dweight.len())],
        )?;
        let (r, d) = (int("rows", rows)?, int("dim", dim)?);
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(M::Norm, "rmsnorm_bwd_bf16")?;
        launch!(self, f, norm_rows(rows), [x, weight, rstd, dy, &r, &d, dx])?;
        let (cfg, chunk, chunks) = norm_param_chunks(rows, dim, 1)?;
        let mut partial = self.zeros::<f32>(prod("partial", &[chunks, dim])?)?;
        let f = self.function(M::Norm, "rmsnorm_param_grads")?;
        launch!(self, f, cfg, [x, rstd, dy, &r, &d, &chunk, &mut partial])?;
        let nb = chunks as i32;
        let f = self.function(M::Norm, "colsum_add_f32")?;
        launch!(
            self,
            f,
            self.elementwise(dim),
            [&partial, &nb, &d, &d, dweight]
        )
    }

    // === RoPE ===

    /// [`crate::cpu::rope_fwd`]: `out = R(angle) x` on `x [tokens, heads, head_dim]`
    /// (bf16) at `positions [tokens]`.
    pub fn rope_fwd(
        &self,
        x: &CudaSlice<bf16>,
        positions: &CudaSlice<u32>,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rope: Rope,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        self.rope(x, positions, tokens, heads, head_dim, rope, false, out)
    }

    /// [`crate::cpu::rope_bwd`]: `dx += R(-angle) d_out`.
    pub fn rope_bwd(
        &self,
        d_out: &CudaSlice<bf16>,
        positions: &CudaSlice<u32>,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rope: Rope,
        dx: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        self.rope(d_out, positions, tokens, heads, head_dim, rope, true, dx)
    }

    fn rope(
        &self,
        x: &CudaSlice<bf16>,
        positions: &CudaSlice<u32>,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rope: Rope,
        backward: bool,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        if !head_dim.is_multiple_of(2) {
            return Err(invalid("head_dim", format!("must be even, got {head_dim}")).into());
        }
        check_len("positions", positions.len(), tokens)?;
        let n = prod("x", &[tokens, heads, head_dim])?;
        check_len("x", x.len(), n)?;
        check_len("out", out.len(), n)?;
        let (t, h, hd) = (
            int("tokens", tokens)?,
            int("heads", heads)?,
            int("head_dim", head_dim)?,
        );
        if n == 0 {
            return Ok(());
        }
        let (sign, acc) = if backward {
            (-1.0f32, 1i32)
        } else {
            (1.0f32, 0i32)
        };
        let threads = ((head_dim / 2).div_ceil(32) * 32).clamp(32, 256) as u32;
        let f = self.function(M::Rope, "rope_bf16")?;
        launch!(
            self,
            f,
            per_row(tokens, threads, 0),
            [
                x,
                positions,
                &t,
                &h,
                &hd,
                &rope.theta,
                &rope.factor,
                &rope.low_wavelength,
                &rope.high_wavelength,
                &sign,
                &acc,
                out
            ]
        )
    }

    // === pointwise ===

    /// [`crate::cpu::gelu_fwd`] (tanh approximation): `y = gelu(x)`.
    pub fn gelu_fwd(&self, x: &CudaSlice<bf16>, y: &mut CudaSlice<bf16>) -> Result<(), GpuError> {
        check_len("y", y.len(), x.len())?;
        let n = long("x", x.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Activation, "gelu_fwd_bf16")?;
        launch!(self, f, self.elementwise(x.len()), [x, &n, y])
    }

    /// [`crate::cpu::dropout_rows`]: `y = x * mask` over `[rows, width]`, the mask
    /// drawn by the same hash as the CPU's.
    pub fn dropout_rows(
        &self,
        x: &CudaSlice<bf16>,
        rows: usize,
        width: usize,
        d: &RowDropout,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let n = prod("rows * width", &[rows, width])?;
        check_len("x", x.len(), n)?;
        check_len("y", y.len(), n)?;
        let args = DropoutArgs::rows(d)?;
        if n == 0 {
            return Ok(());
        }
        let (r, w) = (int("rows", rows)?, int("width", width)?);
        let f = self.function(M::Activation, "dropout_bf16")?;
        launch!(self, f, self.elementwise(n), [x, &r, &w, &args, y])
    }

    /// [`crate::cpu::gelu_bwd`]: `dx += dy * gelu'(x)`.
    pub fn gelu_bwd(
        &self,
        x: &CudaSlice<bf16>,
        dy: &CudaSlice<bf16>,
        dx: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        check_len("dy", dy.len(), x.len())?;
        check_len("dx", dx.len(), x.len())?;
        let n = long("x", x.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Activation, "gelu_bwd_bf16")?;
        launch!(self, f, self.elementwise(x.len()), [x, dy, &n, dx])
    }

    /// [`crate::cpu::swiglu_fwd`]: `y [rows, f] = silu(gate) * up` from
    /// `x [rows, 2f]` = `[gate | up]`.
    pub fn swiglu_fwd(
        &self,
        x: &CudaSlice<bf16>,
        rows: usize,
        f: usize,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        check_swiglu(rows, f, x.len(), y.len(), "y")?;
        let (r, fi) = (int("rows", rows)?, int("f", f)?);
        int("x", x.len())?;
        if rows == 0 {
            return Ok(());
        }
        let k = self.function(M::Activation, "swiglu_fwd_bf16")?;
        launch!(self, k, self.elementwise(y.len()), [x, &r, &fi, y])
    }

    /// [`crate::cpu::swiglu_bwd`]: `dx [rows, 2f] +=` from `dy [rows, f]`.
    pub fn swiglu_bwd(
        &self,
        x: &CudaSlice<bf16>,
        dy: &CudaSlice<bf16>,
        rows: usize,
        f: usize,
        dx: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        check_swiglu(rows, f, x.len(), dy.len(), "dy")?;
        check_len("dx", dx.len(), x.len())?;
        let (r, fi) = (int("rows", rows)?, int("f", f)?);
        int("x", x.len())?;
        if rows == 0 {
            return Ok(());
        }
        let k = self.function(M::Activation, "swiglu_bwd_bf16")?;
        launch!(self, k, self.elementwise(dy.len()), [x, dy, &r, &fi, dx])
    }

    /// [`crate::cpu::add`]: `out = a + b`.
    pub fn add(
        &self,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        check_len("b", b.len(), a.len())?;
        check_len("out", out.len(), a.len())?;
        let n = long("a", a.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Activation, "add_bf16")?;
        launch!(self, f, self.elementwise(a.len()), [a, b, &n, out])
    }

    /// [`crate::cpu::add_bwd`]: `da += d_out`, `db += d_out`.
    pub fn add_bwd(
        &self,
        d_out: &CudaSlice<bf16>,
        da: &mut CudaSlice<bf16>,
        db: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        check_len("da", da.len(), d_out.len())?;
        check_len("db", db.len(), d_out.len())?;
        let n = long("d_out", d_out.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Activation, "add_bwd_bf16")?;
        launch!(self, f, self.elementwise(d_out.len()), [d_out, &n, da, db])
    }

    // === casts ===

    /// `y = bf16(x)`, round to nearest even.
    pub fn cast_f32_to_bf16(
        &self,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        check_len("y", y.len(), x.len())?;
        let n = long("x", x.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Cast, "cast_f32_to_bf16")?;
        launch!(self, f, self.elementwise(x.len()), [x, &n, y])
    }

    /// `y = f32(x)` (exact).
    pub fn cast_bf16_to_f32(
        &self,
        x: &CudaSlice<bf16>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        check_len("y", y.len(), x.len())?;
        let n = long("x", x.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Cast, "cast_bf16_to_f32")?;
        launch!(self, f, self.elementwise(x.len()), [x, &n, y])
    }

    /// `y += x` with `y` bf16 (added in fp32, rounded once).
    pub fn add_f32_into_bf16(
        &self,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        check_len("y", y.len(), x.len())?;
        let n = long("x", x.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Cast, "add_f32_into_bf16")?;
        launch!(self, f, self.elementwise(x.len()), [x, &n, y])
    }

    // === loss ===

    /// Fused cross-entropy over unsharded `logits [rows, vocab]` (bf16): writes the
    /// per-row `loss [rows]` (fp32, `max + ln(sumexp) - target`) and
    /// `dlogits = scale * (softmax - onehot)` (bf16, written, not added): the CPU's
    /// `ce_row_max`, `ce_row_sumexp`, `ce_target_logit`, `ce_loss` and `ce_bwd` with
    /// one shard, in one pass plus the gradient's.
    pub fn ce_fused(
        &self,
        logits: &CudaSlice<bf16>,
        labels: &CudaSlice<u32>,
        rows: usize,
        vocab: usize,
        scale: f32,
        loss: &mut CudaSlice<f32>,
        dlogits: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        if vocab == 0 {
            return Err(invalid("vocab", "must be positive").into());
        }
        let n = prod("logits", &[rows, vocab])?;
        check_len("logits", logits.len(), n)?;
        check_len("labels", labels.len(), rows)?;
        check_len("loss", loss.len(), rows)?;
        check_len("dlogits", dlogits.len(), n)?;
        let (r, v) = (int("rows", rows)?, int("vocab", vocab)?);
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(M::Loss, "ce_fused_bf16")?;
        launch!(
            self,
            f,
            per_row(rows, CE_THREADS, 0),
            [logits, labels, &r, &v, &scale, loss, dlogits]
        )
    }

    /// [`crate::cpu::attention_merge`] on bf16 outputs and fp32 log-sum-exps:
    /// `(o_acc, lse_acc)` become the merge of themselves with `(o_blk, lse_blk)`.
    pub fn attention_merge(
        &self,
        dims: &AttnDims,
        o_acc: &mut CudaSlice<bf16>,
        lse_acc: &mut CudaSlice<f32>,
        o_blk: &CudaSlice<bf16>,
        lse_blk: &CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let (ol, ll) = (dims.o_len()?, dims.lse_len()?);
        check_len("o_acc", o_acc.len(), ol)?;
        check_len("o_blk", o_blk.len(), ol)?;
        check_len("lse_acc", lse_acc.len(), ll)?;
        check_len("lse_blk", lse_blk.len(), ll)?;
        if ll == 0 {
            return Ok(());
        }
        let (b, sq) = (int("batch", dims.batch)?, int("sq", dims.sq)?);
        let (hq, dv) = (int("hq", dims.hq)?, int("dv", dims.dv)?);
        let threads = ELEM_THREADS as usize;
        let cfg = LaunchConfig {
            grid_dim: ((ll * WARP_SIZE).div_ceil(threads) as u32, 1, 1),
            block_dim: (ELEM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function(M::Attention, "attention_merge_bf16")?;
        launch!(
            self,
            f,
            cfg,
            [o_acc, lse_acc, o_blk, lse_blk, &b, &sq, &hq, &dv]
        )
    }

    /// [`crate::cpu::argmax_parts`]: greedy decoding's pick of each row of fp32
    /// logits gathered `[parts, rows, cols]` (`tokens` overwritten).
    pub fn argmax_parts(
        &self,
        x: &CudaSlice<f32>,
        d: Picks,
        tokens: &mut CudaSlice<u32>,
    ) -> Result<(), GpuError> {
        check_picks(x.len(), d)?;
        check_len("tokens", tokens.len(), d.rows)?;
        let (rows, cols) = (int("rows", d.rows)?, int("cols", d.cols)?);
        let limit = int("limit", d.limit)?;
        if d.rows == 0 {
            return Ok(());
        }
        let f = self.function(M::Loss, "argmax_parts_f32")?;
        let cfg = per_row(d.rows, CE_THREADS, 0);
        launch!(self, f, cfg, [x, &rows, &cols, &limit, tokens])
    }

    /// [`crate::cpu::sample_parts`]: each row of fp32 logits gathered `[parts,
    /// rows, cols]` draws a token for its request (`tokens` overwritten).
    pub fn sample_parts(
        &self,
        x: &CudaSlice<f32>,
        d: Picks,
        s: Nucleus,
        requests: &CudaSlice<u32>,
        tokens: &mut CudaSlice<u32>,
    ) -> Result<(), GpuError> {
        check_picks(x.len(), d)?;
        check_nucleus(s)?;
        check_len("requests", requests.len(), d.rows)?;
        check_len("tokens", tokens.len(), d.rows)?;
        let (rows, cols) = (int("rows", d.rows)?, int("cols", d.cols)?);
        let limit = int("limit", d.limit)?;
        if d.rows == 0 {
            return Ok(());
        }
        let f = self.function(M::Loss, "sample_parts_f32")?;
        let cfg = per_row(d.rows, CE_THREADS, 0);
        let (t, p, seed, step) = (s.temperature, s.top_p, s.seed, s.step);
        launch!(
            self,
            f,
            cfg,
            [x, &rows, &cols, &limit, requests, &t, &p, &seed, &step, tokens]
        )
    }

    /// [`crate::cpu::ce_row_max`] on a bf16 shard of the logits (`max` overwritten).
    pub fn ce_row_max(
        &self,
        logits: &CudaSlice<bf16>,
        rows: usize,
        v_local: usize,
        max: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let (r, v) = self.ce_shard(logits, rows, v_local)?;
        check_len("max", max.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(M::Loss, "ce_row_max_bf16")?;
        launch!(self, f, per_row(rows, CE_THREADS, 0), [logits, &r, &v, max])
    }

    /// [`crate::cpu::ce_row_sumexp`] and [`crate::cpu::ce_target_logit`] of one
    /// shard in one pass (`sumexp`, `target` overwritten).
    #[allow(clippy::too_many_arguments)]
    pub fn ce_sumexp_target(
        &self,
        logits: &CudaSlice<bf16>,
        labels: &CudaSlice<u32>,
        rows: usize,
        v_local: usize,
        vocab_start: usize,
        max: &CudaSlice<f32>,
        sumexp: &mut CudaSlice<f32>,
        target: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let (r, v) = self.ce_shard(logits, rows, v_local)?;
        for (what, n) in [("labels", labels.len()), ("max", max.len())] {
            check_len(what, n, rows)?;
        }
        check_len("sumexp", sumexp.len(), rows)?;
        check_len("target", target.len(), rows)?;
        let start = int("vocab_start", vocab_start)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(M::Loss, "ce_sumexp_target_bf16")?;
        launch!(
            self,
            f,
            per_row(rows, CE_THREADS, 0),
            [logits, labels, &r, &v, &start, max, sumexp, target]
        )
    }

    /// [`crate::cpu::ce_loss`] and [`crate::cpu::ce_bwd`] of one shard from the
    /// statistics summed over every shard (`loss`, `dlogits` overwritten).
    #[allow(clippy::too_many_arguments)]
    pub fn ce_finish(
        &self,
        logits: &CudaSlice<bf16>,
        labels: &CudaSlice<u32>,
        rows: usize,
        v_local: usize,
        vocab_start: usize,
        scale: f32,
        [max, sumexp, target]: [&CudaSlice<f32>; 3],
        loss: &mut CudaSlice<f32>,
        dlogits: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let (r, v) = self.ce_shard(logits, rows, v_local)?;
        for (what, n) in [
            ("labels", labels.len()),
            ("max", max.len()),
            ("sumexp", sumexp.len()),
            ("target", target.len()),
        ] {
            check_len(what, n, rows)?;
        }
        check_len("loss", loss.len(), rows)?;
        check_len("dlogits", dlogits.len(), logits.len())?;
        let start = int("vocab_start", vocab_start)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(M::Loss, "ce_finish_bf16")?;
        launch!(
            self,
            f,
            per_row(rows, CE_THREADS, 0),
            [logits, labels, &r, &v, &start, &scale, max, sumexp, target, loss, dlogits]
        )
    }

    /// Checks a shard `logits [rows, v_local]`; its sizes as the kernels take them.
    fn ce_shard(
        &self,
        logits: &CudaSlice<bf16>,
        rows: usize,
        v_local: usize,
    ) -> Result<(i32, i32), GpuError> {
        if v_local == 0 {
            return Err(invalid("v_local", "must be positive").into());
        }
        check_len("logits", logits.len(), prod("logits", &[rows, v_local])?)?;
        Ok((int("rows", rows)?, int("v_local", v_local)?))
    }

    /// `acc += x`, fp32.
    pub fn add_f32(&self, x: &CudaSlice<f32>, acc: &mut CudaSlice<f32>) -> Result<(), GpuError> {
        check_len("x", x.len(), acc.len())?;
        let n = long("acc", acc.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Cast, "add_f32")?;
        launch!(self, f, self.elementwise(acc.len()), [x, &n, acc])
    }

    /// `x *= a`.
    pub fn scale_f32(&self, x: &mut CudaSlice<f32>, a: f32) -> Result<(), GpuError> {
        let n = long("x", x.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Cast, "scale_f32")?;
        launch!(self, f, self.elementwise(x.len()), [x, &n, &a])
    }

    /// The index of the first of `xs` holding a NaN or an infinity: one kernel per
    /// tensor over the device's copies, one read of the result.
    pub fn first_non_finite(&self, xs: &[&CudaSlice<f32>]) -> Result<Option<usize>, GpuError> {
        let mut found = self.upload(&[u32::MAX])?;
        let f = self.function(M::Cast, "non_finite_f32")?;
        for (i, x) in xs.iter().enumerate() {
            let n = long("x", x.len())?;
            if n == 0 {
                continue;
            }
            let tag = u32::try_from(i).map_err(|_| invalid("xs", "more than 2^32 tensors"))?;
            launch!(
                self,
                f.clone(),
                self.elementwise(x.len()),
                [*x, &n, &tag, &mut found]
            )?;
        }
        let first = self.download(&found)?[0];
        Ok((first != u32::MAX).then_some(first as usize))
    }

    // === optimizer ===

    /// [`crate::cpu::adamw_step`] on fp32 `param`, `grad`, `m`, `v`, also writing
    /// `param_bf16`, the bf16 copy the next forward reads. `step` is 1-based; the
    /// bias corrections are computed in f64 here, as on the CPU.
    pub fn adamw_step(
        &self,
        param: &mut CudaSlice<f32>,
        grad: &CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        param_bf16: &mut CudaSlice<bf16>,
        step: u64,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    ) -> Result<(), GpuError> {
        let n = param.len();
        check_len("grad", grad.len(), n)?;
        check_len("m", m.len(), n)?;
        check_len("v", v.len(), n)?;
        check_len("param_bf16", param_bf16.len(), n)?;
        if step == 0 {
            return Err(invalid("step", "is 1-based; got 0").into());
        }
        let t = step.min(i32::MAX as u64) as i32;
        let bc1 = 1.0 - (beta1 as f64).powi(t);
        let bc2 = 1.0 - (beta2 as f64).powi(t);
        let step_size = (lr as f64 / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let decay = 1.0 - lr * weight_decay;
        let nl = long("param", n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Adamw, "adamw_f32")?;
        launch!(
            self,
            f,
            self.elementwise(n.div_ceil(4)),
            [
                param, grad, m, v, param_bf16, &nl, &beta1, &beta2, &eps, &step_size, &bc2_sqrt,
                &decay
            ]
        )
    }

    // === attention ===

    /// [`crate::cpu::attention_fwd`] without dropout: `out [batch, sq, hq, dv]`
    /// (bf16) and `lse [batch, hq, sq]` (fp32) from bf16 `q`, `k`, `v`; head
    /// dimensions up to 256.
    pub fn attention_fwd(
        &self,
        dims: &AttnDims,
        q: &CudaSlice<bf16>,
        k: &CudaSlice<bf16>,
        v: &CudaSlice<bf16>,
        q_pos0: usize,
        k_pos0: usize,
        causal: bool,
        scale: f32,
        dropout: Option<&AttnDropout>,
        out: &mut CudaSlice<bf16>,
        lse: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let a = AttnArgs::new(dims, q_pos0, k_pos0, causal)?;
        let drop = DropoutArgs::attention(dropout)?;
        check_len("q", q.len(), a.q_len)?;
        check_len("k", k.len(), a.k_len)?;
        check_len("v", v.len(), a.v_len)?;
        check_len("out", out.len(), a.o_len)?;
        check_len("lse", lse.len(), a.lse_len)?;
        if dims.batch == 0 || dims.sq == 0 {
            return Ok(());
        }
        // The tensor-core kernels where they serve the shape, else the scalar ones;
        // both take the same arguments.
        let (name, shared, cfg) = if let Some(fd) = flash_dim(dims) {
            let name = match fd {
                32 => "flash_fwd_bf16_32",
                64 => "flash_fwd_bf16_64",
                _ => "flash_fwd_bf16_128",
            };
            let shared = 4 * FA_TILE * (fd + 8) * 2;
            let grid = (
                int("sq", dims.sq.div_ceil(16 * FA_FWD_WARPS))? as u32,
                dims.hq as u32,
                dims.batch as u32,
            );
            (name, shared, (grid, FA_FWD_WARPS))
        } else {
            let (d, dv) = (dims.d, dims.dv);
            let shared = (ATT_ROWS * d + ATT_BC * (d | 1) + ATT_BC * dv + ATT_ROWS * ATT_BC) * 4;
            let name = if dv <= 128 {
                "attention_fwd_bf16_128"
            } else {
                "attention_fwd_bf16_256"
            };
            let rows = dims.sq * (dims.hq / dims.hkv);
            let grid = (
                int("sq * hq / hkv", rows.div_ceil(ATT_ROWS))? as u32,
                dims.hkv as u32,
                dims.batch as u32,
            );
            (name, shared, (grid, ATT_WARPS))
        };
        let f = self.function(M::Attention, name)?;
        self.allow_shared(&f, shared, "dims")?;
        let cfg = LaunchConfig {
            grid_dim: cfg.0,
            block_dim: ((cfg.1 * 32) as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let AttnArgs {
            sq,
            sk,
            hq,
            hkv,
            d,
            dv,
            q_pos0,
            k_pos0,
            causal,
            ..
        } = a;
        launch!(
            self,
            f,
            cfg,
            [
                q, k, v, &sq, &sk, &hq, &hkv, &d, &dv, &q_pos0, &k_pos0, &causal, &scale, &drop,
                out, lse
            ]
        )
    }

    /// [`crate::cpu::attention_bwd`] without dropout: `d_q`, `d_k`, `d_v` (bf16)
    /// `+=` from `d_o`, using the final `o` and `lse` of the forward (over all KV
    /// blocks, for ring attention). dQ is summed in an fp32 buffer and added once.
    pub fn attention_bwd(
        &self,
        dims: &AttnDims,
        q: &CudaSlice<bf16>,
        k: &CudaSlice<bf16>,
        v: &CudaSlice<bf16>,
        o: &CudaSlice<bf16>,
        lse: &CudaSlice<f32>,
        d_o: &CudaSlice<bf16>,
        q_pos0: usize,
        k_pos0: usize,
        causal: bool,
        scale: f32,
        dropout: Option<&AttnDropout>,
        d_q: &mut CudaSlice<bf16>,
        d_k: &mut CudaSlice<bf16>,
        d_v: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let a = AttnArgs::new(dims, q_pos0, k_pos0, causal)?;
        let drop = DropoutArgs::attention(dropout)?;
        check_len("q", q.len(), a.q_len)?;
        check_len("k", k.len(), a.k_len)?;
        check_len("v", v.len(), a.v_len)?;
        check_len("o", o.len(), a.o_len)?;
        check_len("lse", lse.len(), a.lse_len)?;
        check_len("d_o", d_o.len(), a.o_len)?;
        check_len("d_q", d_q.len(), a.q_len)?;
        check_len("d_k", d_k.len(), a.k_len)?;
        check_len("d_v", d_v.len(), a.v_len)?;
        if dims.batch == 0 || dims.sq == 0 || dims.sk == 0 {
            return Ok(());
        }
        // D = rowsum(dO * O), one warp per row.
        let mut delta = self.zeros::<f32>(a.lse_len)?;
        let rows = dims.batch * dims.sq * dims.hq;
        let (b, sq, hq, dv) = (int("batch", dims.batch)?, a.sq, a.hq, a.dv);
        let f = self.function(M::Attention, "attention_bwd_delta")?;
        launch!(
            self,
            f,
            LaunchConfig {
                grid_dim: (int("batch * sq * hq", rows.div_ceil(8))? as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            [o, d_o, &b, &sq, &hq, &dv, &mut delta]
        )?;
        let mut dq_acc = self.zeros::<f32>(a.q_len)?;
        // The tensor-core kernels where they serve the shape, else the scalar ones;
        // both take the same arguments and the same grid of key tiles.
        let (name, shared, tile, warps) = if let Some(fd) = flash_dim(dims) {
            let name = match fd {
                32 => "flash_bwd_bf16_32",
                64 => "flash_bwd_bf16_64",
                _ => "flash_bwd_bf16_128",
            };
            let shared = (6 * FA_TILE * (fd + 8) + FA_TILE * (FA_TILE + 8)) * 2 + 4 * FA_TILE * 4;
            (name, shared, FA_TILE, FA_WARPS)
        } else {
            let (d, dvu) = (dims.d, dims.dv);
            let shared = (ATT_BC * ((d | 1) + (dvu | 1)) + ATT_WARPS * (d + dvu + 2 * ATT_BC)) * 4;
            let name = if d.max(dvu) <= 128 {
                "attention_bwd_bf16_128"
            } else {
                "attention_bwd_bf16_256"
            };
            (name, shared, ATT_BC, ATT_WARPS)
        };
        let f = self.function(M::Attention, name)?;
        self.allow_shared(&f, shared, "dims")?;
        let cfg = LaunchConfig {
            grid_dim: (
                int("sk", dims.sk.div_ceil(tile))? as u32,
                dims.hkv as u32,
                dims.batch as u32,
            ),
            block_dim: ((warps * 32) as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let AttnArgs {
            sk,
            hkv,
            d,
            q_pos0,
            k_pos0,
            causal,
            ..
        } = a;
        launch!(
            self,
            f,
            cfg,
            [
                q,
                k,
                v,
                lse,
                &delta,
                d_o,
                &sq,
                &sk,
                &hq,
                &hkv,
                &d,
                &dv,
                &q_pos0,
                &k_pos0,
                &causal,
                &scale,
                &drop,
                &mut dq_acc,
                d_k,
                d_v
            ]
        )?;
        self.add_f32_into_bf16(&dq_acc, d_q)
    }

    // === mixture of experts ===

    /// [`crate::cpu::gather_rows`]: `out[r] = src[idx[r]]`, zeros where `idx[r]`
    /// is [`crate::cpu::NO_ROW`] (an index past `src` also gives zeros, unchecked
    /// here).
    pub fn gather_rows(
        &self,
        src: &CudaSlice<bf16>,
        idx: &CudaSlice<u32>,
        dim: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        check_len("out", out.len(), prod("out", &[idx.len(), dim])?)?;
        if idx.is_empty() || dim == 0 {
            return Ok(());
        }
        let (src_rows, rows, d) = (
            int("src rows", src.len() / dim)?,
            int("rows", idx.len())?,
            int("dim", dim)?,
        );
        let f = self.function(M::Moe, "gather_rows_bf16")?;
        launch!(
            self,
            f,
            per_row(idx.len(), ROW_THREADS, 0),
            [src, &src_rows, idx, &rows, &d, out]
        )
    }

    /// [`crate::cpu::moe_route_fwd`] on fp32 `logits [tokens, experts]`
    /// (experts at most 1024): `probs`, `expert_idx [tokens, k]`, `weights`.
    pub fn moe_route_fwd(
        &self,
        logits: &CudaSlice<f32>,
        tokens: usize,
        experts: usize,
        k: usize,
        renormalize: bool,
        probs: &mut CudaSlice<f32>,
        expert_idx: &mut CudaSlice<u32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let (nl, nk) = check_route(tokens, experts, k)?;
        check_len("logits", logits.len(), nl)?;
        check_len("probs", probs.len(), nl)?;
        check_len("expert_idx", expert_idx.len(), nk)?;
        check_len("weights", weights.len(), nk)?;
        let (t, e, kk, rn) = (
            int("tokens", tokens)?,
            int("experts", experts)?,
            int("k", k)?,
            i32::from(renormalize),
        );
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(M::Moe, "moe_route_fwd_f32")?;
        launch!(
            self,
            f,
            per_row(tokens.div_ceil(MOE_WARPS), (MOE_WARPS * 32) as u32, 0),
            [logits, &t, &e, &kk, &rn, probs, expert_idx, weights]
        )
    }

    /// [`crate::cpu::moe_route_bwd`]: `d_logits +=` from `d_weights`.
    pub fn moe_route_bwd(
        &self,
        probs: &CudaSlice<f32>,
        expert_idx: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        d_weights: &CudaSlice<f32>,
        tokens: usize,
        experts: usize,
        k: usize,
        renormalize: bool,
        d_logits: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let (nl, nk) = check_route(tokens, experts, k)?;
        check_len("probs", probs.len(), nl)?;
        check_len("expert_idx", expert_idx.len(), nk)?;
        check_len("weights", weights.len(), nk)?;
        check_len("d_weights", d_weights.len(), nk)?;
        check_len("d_logits", d_logits.len(), nl)?;
        let (t, e, kk, rn) = (
            int("tokens", tokens)?,
            int("experts", experts)?,
            int("k", k)?,
            i32::from(renormalize),
        );
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(M::Moe, "moe_route_bwd_f32")?;
        launch!(
            self,
            f,
            per_row(tokens.div_ceil(MOE_WARPS), (MOE_WARPS * 32) as u32, 0),
            [probs, expert_idx, weights, d_weights, &t, &e, &kk, &rn, d_logits]
        )
    }

    /// [`crate::cpu::moe_dispatch_fwd`]: groups the rows of `x [tokens, dim]` by
    /// expert (stable, token order within an expert): `out [tokens * k, dim]`,
    /// `counts [experts]` (u32) and `perm [tokens * k]`, equal to the CPU's.
    pub fn moe_dispatch_fwd(
        &self,
        x: &CudaSlice<bf16>,
        expert_idx: &CudaSlice<u32>,
        tokens: usize,
        k: usize,
        experts: usize,
        dim: usize,
        out: &mut CudaSlice<bf16>,
        counts: &mut CudaSlice<u32>,
        perm: &mut CudaSlice<u32>,
    ) -> Result<(), GpuError> {
        if k == 0 {
            return Err(invalid("k", "must be positive").into());
        }
        let n = prod("expert_idx", &[tokens, k])?;
        check_len("x", x.len(), prod("x", &[tokens, dim])?)?;
        check_len("expert_idx", expert_idx.len(), n)?;
        check_len("out", out.len(), prod("out", &[n, dim])?)?;
        check_len("counts", counts.len(), experts)?;
        check_len("perm", perm.len(), n)?;
        let (ni, kk, e, dm, t) = (
            int("tokens * k", n)?,
            int("k", k)?,
            int("experts", experts)?,
            int("dim", dim)?,
            int("tokens", tokens)?,
        );
        if experts == 0 {
            return Ok(());
        }
        let f = self.function(M::Moe, "moe_count")?;
        launch!(
            self,
            f,
            per_row(experts, 256, 0),
            [expert_idx, &ni, &e, &mut *counts]
        )?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Moe, "moe_perm")?;
        launch!(
            self,
            f,
            per_row(experts, 256, 0),
            [expert_idx, &*counts, &ni, &e, &mut *perm]
        )?;
        let f = self.function(M::Moe, "moe_gather_bf16")?;
        launch!(
            self,
            f,
            per_row(n, 128, 0),
            [x, &*perm, &ni, &kk, &dm, &t, out]
        )
    }

    /// [`crate::cpu::moe_capacity`] on a dispatch's `perm [tokens k]` and its
    /// `counts [experts]` left on the device: `at [tokens k]`, `pad [experts *
    /// per_expert]` and `kept [experts]`, all overwritten.
    pub fn moe_capacity(
        &self,
        (perm, counts): (&CudaSlice<u32>, &CudaSlice<u32>),
        k: usize,
        c: Capacity,
        (at, pad): (&mut CudaSlice<u32>, &mut CudaSlice<u32>),
        kept: &mut CudaSlice<u32>,
    ) -> Result<(), GpuError> {
        let (n, experts) = (perm.len(), counts.len());
        let sizes = (at.len(), pad.len(), kept.len());
        let per_expert = check_capacity((n, experts), k, c, sizes)?;
        let (kk, group, cap) = (int("k", k)?, int("group", c.group)?, int("cap", c.cap)?);
        let (pe, _) = (int("per_expert", per_expert)?, int("tokens * k", n)?);
        if experts == 0 {
            return Ok(());
        }
        let f = self.function(M::Moe, "moe_capacity")?;
        launch!(
            self,
            f,
            per_row(experts, 256, 0),
            [perm, counts, &kk, &group, &cap, &pe, at, pad, kept]
        )
    }

    /// [`crate::cpu::moe_dispatch_bwd`]: `dx [tokens, dim] +=` each token's slots
    /// of `d_out [tokens * k, dim]`.
    pub fn moe_dispatch_bwd(
        &self,
        d_out: &CudaSlice<bf16>,
        perm: &CudaSlice<u32>,
        tokens: usize,
        k: usize,
        dim: usize,
        dx: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let n = prod("perm", &[tokens, k])?;
        check_len("perm", perm.len(), n)?;
        check_len("d_out", d_out.len(), prod("d_out", &[n, dim])?)?;
        check_len("dx", dx.len(), prod("dx", &[tokens, dim])?)?;
        let (t, kk, dm) = (int("tokens", tokens)?, int("k", k)?, int("dim", dim)?);
        int("tokens * k", n)?;
        if n == 0 || dim == 0 {
            return Ok(());
        }
        let inv = self.invert_perm(perm)?;
        let f = self.function(M::Moe, "moe_dispatch_bwd_bf16")?;
        launch!(
            self,
            f,
            per_row(tokens, 128, 0),
            [d_out, &inv, &t, &kk, &dm, dx]
        )
    }

    /// [`crate::cpu::moe_combine_fwd`]: `out [tokens, dim]` (written) from the
    /// expert outputs `y [tokens * k, dim]` in dispatch order and the routing
    /// `weights [tokens, k]` (fp32).
    pub fn moe_combine_fwd(
        &self,
        y: &CudaSlice<bf16>,
        perm: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        tokens: usize,
        k: usize,
        dim: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let n = prod("perm", &[tokens, k])?;
        check_len("perm", perm.len(), n)?;
        check_len("y", y.len(), prod("y", &[n, dim])?)?;
        check_len("weights", weights.len(), n)?;
        check_len("out", out.len(), prod("out", &[tokens, dim])?)?;
        let (t, kk, dm) = (int("tokens", tokens)?, int("k", k)?, int("dim", dim)?);
        int("tokens * k", n)?;
        if tokens == 0 || dim == 0 {
            return Ok(());
        }
        let inv = self.invert_perm(perm)?;
        let f = self.function(M::Moe, "moe_combine_fwd_bf16")?;
        launch!(
            self,
            f,
            per_row(tokens, 128, 0),
            [y, &inv, weights, &t, &kk, &dm, out]
        )
    }

    /// [`crate::cpu::moe_combine_bwd`]: `d_y [tokens * k, dim] (bf16) +=` and
    /// `d_weights [tokens, k] (fp32) +=`.
    pub fn moe_combine_bwd(
        &self,
        d_out: &CudaSlice<bf16>,
        y: &CudaSlice<bf16>,
        perm: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        tokens: usize,
        k: usize,
        dim: usize,
        d_y: &mut CudaSlice<bf16>,
        d_weights: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let n = prod("perm", &[tokens, k])?;
        check_len("perm", perm.len(), n)?;
        let ny = prod("y", &[n, dim])?;
        check_len("d_out", d_out.len(), prod("d_out", &[tokens, dim])?)?;
        check_len("y", y.len(), ny)?;
        check_len("weights", weights.len(), n)?;
        check_len("d_y", d_y.len(), ny)?;
        check_len("d_weights", d_weights.len(), n)?;
        let (t, kk, dm) = (int("tokens", tokens)?, int("k", k)?, int("dim", dim)?);
        int("tokens * k", n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Moe, "moe_combine_bwd_bf16")?;
        launch!(
            self,
            f,
            per_row(n, 128, 0),
            [d_out, y, perm, weights, &t, &kk, &dm, d_y, d_weights]
        )
    }

    /// `inv[perm[s]] = s` in a new buffer (`perm` non-empty).
    fn invert_perm(&self, perm: &CudaSlice<u32>) -> Result<CudaSlice<u32>, GpuError> {
        let n = int("perm", perm.len())?;
        // Entries no slot names stay out of range, so the kernels skip them.
        let mut inv = self.upload(&vec![u32::MAX; perm.len()])?;
        let f = self.function(M::Moe, "moe_invert_perm")?;
        launch!(self, f, self.elementwise(perm.len()), [perm, &n, &mut inv])?;
        Ok(inv)
    }
}

fn vocab_local(table_len: usize, dim: usize) -> Result<usize, KernelError> {
    if dim == 0 {
        return Err(invalid("dim", "must be positive"));
    }
    if !table_len.is_multiple_of(dim) {
        return Err(invalid(
            "table",
            format!("length {table_len} is not a multiple of dim {dim}"),
        ));
    }
    Ok(table_len / dim)
}

fn check_rows(
    rows: usize,
    dim: usize,
    xs: &[(&'static str, usize)],
    per_row: &[(&'static str, usize)],
    per_col: &[(&'static str, usize)],
) -> Result<(), KernelError> {
    if dim == 0 {
        return Err(invalid("dim", "must be positive"));
    }
    let n = prod("x", &[rows, dim])?;
    for &(name, len) in xs {
        check_len(name, len, n)?;
    }
    for &(name, len) in per_row {
        check_len(name, len, rows)?;
    }
    for &(name, len) in per_col {
        check_len(name, len, dim)?;
    }
    Ok(())
}

fn check_swiglu(
    rows: usize,
    f: usize,
    x_len: usize,
    y_len: usize,
    yname: &'static str,
) -> Result<(), KernelError> {
    if f == 0 {
        return Err(invalid("f", "must be positive"));
    }
    check_len("x", x_len, prod("x", &[rows, 2, f])?)?;
    check_len(yname, y_len, prod(yname, &[rows, f])?)
}

fn check_route(tokens: usize, experts: usize, k: usize) -> Result<(usize, usize), KernelError> {
    if k == 0 || k > experts {
        return Err(invalid("k", format!("must be in 1..={experts}, got {k}")));
    }
    if experts > 1024 {
        return Err(invalid(
            "experts",
            format!("at most 1024 on the GPU (one warp per token), got {experts}"),
        ));
    }
    Ok((
        prod("logits", &[tokens, experts])?,
        prod("expert_idx", &[tokens, k])?,
    ))
}

/// The head dimension of the tensor-core kernel (`flash_*_bf16_{32,64,128}`) that
/// serves these sizes, if one does: equal query/key and value widths of 32, 64 or
/// 128. Every other shape runs on the scalar kernels.
fn flash_dim(dims: &AttnDims) -> Option<usize> {
    (dims.d == dims.dv && matches!(dims.d, 32 | 64 | 128)).then_some(dims.d)
}

/// An attention call's sizes, checked and converted to the kernels' ints.
struct AttnArgs {
    sq: i32,
    sk: i32,
    hq: i32,
    hkv: i32,
    d: i32,
    dv: i32,
    q_pos0: i32,
    k_pos0: i32,
    causal: i32,
    q_len: usize,
    k_len: usize,
    v_len: usize,
    o_len: usize,
    lse_len: usize,
}

impl AttnArgs {
    fn new(
        dims: &AttnDims,
        q_pos0: usize,
        k_pos0: usize,
        causal: bool,
    ) -> Result<AttnArgs, KernelError> {
        let AttnDims {
            batch,
            sq,
            sk,
            hq,
            hkv,
            d,
            dv,
        } = *dims;
        if hkv == 0 || !hq.is_multiple_of(hkv) {
            return Err(invalid(
                "dims.hkv",
                format!("hq ({hq}) must be a positive multiple of hkv ({hkv})"),
            ));
        }
        for (name, x) in [("dims.d", d), ("dims.dv", dv)] {
            if x == 0 || x > ATT_HEAD_DIM_MAX {
                return Err(invalid(
                    name,
                    format!("must be in 1..={ATT_HEAD_DIM_MAX} on the GPU, got {x}"),
                ));
            }
        }
        for (name, x) in [("dims.batch", batch), ("dims.hkv", hkv)] {
            if x > 65_535 {
                return Err(invalid(name, format!("at most 65535 on the GPU, got {x}")));
            }
        }
        // Positions and row counts the kernels form must stay in int range.
        int("q_pos0 + sq", q_pos0.saturating_add(sq))?;
        int("k_pos0 + sk", k_pos0.saturating_add(sk))?;
        int("sq * hq", sq.saturating_mul(hq))?;
        Ok(AttnArgs {
            sq: int("dims.sq", sq)?,
            sk: int("dims.sk", sk)?,
            hq: int("dims.hq", hq)?,
            hkv: int("dims.hkv", hkv)?,
            d: int("dims.d", d)?,
            dv: int("dims.dv", dv)?,
            q_pos0: int("q_pos0", q_pos0)?,
            k_pos0: int("k_pos0", k_pos0)?,
            causal: i32::from(causal),
            q_len: prod("q", &[batch, sq, hq, d])?,
            k_len: prod("k", &[batch, sk, hkv, d])?,
            v_len: prod("v", &[batch, sk, hkv, dv])?,
            o_len: prod("out", &[batch, sq, hq, dv])?,
            lse_len: prod("lse", &[batch, hq, sq])?,
        })
    }
}
