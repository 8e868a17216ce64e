//! Launch methods for `layout.cu`: the data movement and small reductions the
//! device interpreter (the executor's `device` module) needs between kernels, each
//! the device twin of its host form there (`HostDevice` and the `split_qkv`,
//! `join_qkv`, `bshd_to_sbhd`, `sbhd_to_bshd` and `rope_qkv_host` helpers of the
//! executor's `train`). Same rules as [`super::ops`]: lengths and `int` ranges
//! checked before any launch, launches asynchronous on [`Gpu::stream`].

#![allow(clippy::too_many_arguments)] // the host forms' own argument lists

use super::gpu::{Gpu, GpuError};
use super::ops::{int, launch, long, per_row, ROW_THREADS};
use super::KernelModule as M;
use crate::cpu::{check_len, invalid, prod, AttnDims, KernelError, Rope};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

/// Threads per block of the bias gradient's column-sum pass.
const COLSUM_THREADS: u32 = 256;
/// Fewest rows a chunk of the bias gradient sums (fewer would only grow the
/// partial buffer).
const BIAS_CHUNK_MIN_ROWS: usize = 32;

/// The sizes of a fused-QKV split or join, checked: element counts of `x`, `q`,
/// `k`, `v`, and the kernel's ints `[b, s, hq, hkv, d, dv]`.
struct QkvSizes {
    x: usize,
    q: usize,
    k: usize,
    v: usize,
    rows: usize,
    ints: [i32; 6],
}

impl QkvSizes {
    fn new(dims: &AttnDims) -> Result<QkvSizes, KernelError> {
        let rows = prod("rows", &[dims.batch, dims.sq])?;
        let qw = prod("q", &[dims.hq, dims.d])?;
        let kw = prod("k", &[dims.hkv, dims.d])?;
        let vw = prod("v", &[dims.hkv, dims.dv])?;
        let width = qw
            .checked_add(kw)
            .and_then(|w| w.checked_add(vw))
            .ok_or_else(|| invalid("dims", "the fused row width overflows usize"))?;
        // The kernel forms the row width and the row index in int.
        int("fused row width", width)?;
        int("batch * sq", rows)?;
        Ok(QkvSizes {
            x: prod("x", &[rows, width])?,
            q: prod("q", &[rows, qw])?,
            k: prod("k", &[rows, kw])?,
            v: prod("v", &[rows, vw])?,
            rows,
            ints: [
                int("dims.batch", dims.batch)?,
                int("dims.sq", dims.sq)?,
                int("dims.hq", dims.hq)?,
                int("dims.hkv", dims.hkv)?,
                int("dims.d", dims.d)?,
                int("dims.dv", dims.dv)?,
            ],
        })
    }
}

impl Gpu {
    /// Fused QKV rows `x [s, b, (hq d | hkv d | hkv dv)]` (`s` = `dims.sq`, `b` =
    /// `dims.batch`) into `q [b, s, hq, d]`, `k [b, s, hkv, d]`,
    /// `v [b, s, hkv, dv]` (written, bit for bit).
    pub fn split_qkv(
        &self,
        x: &CudaSlice<bf16>,
        dims: &AttnDims,
        q: &mut CudaSlice<bf16>,
        k: &mut CudaSlice<bf16>,
        v: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let n = QkvSizes::new(dims)?;
        check_len("x", x.len(), n.x)?;
        check_len("q", q.len(), n.q)?;
        check_len("k", k.len(), n.k)?;
        check_len("v", v.len(), n.v)?;
        if n.rows == 0 {
            return Ok(());
        }
        let [b, s, hq, hkv, d, dv] = n.ints;
        let f = self.function(M::Layout, "split_qkv_bf16")?;
        launch!(
            self,
            f,
            per_row(n.rows, ROW_THREADS, 0),
            [x, &b, &s, &hq, &hkv, &d, &dv, q, k, v]
        )
    }

    /// The inverse of [`Gpu::split_qkv`]: `x` (written) from `q`, `k`, `v`.
    pub fn join_qkv(
        &self,
        q: &CudaSlice<bf16>,
        k: &CudaSlice<bf16>,
        v: &CudaSlice<bf16>,
        dims: &AttnDims,
        x: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let n = QkvSizes::new(dims)?;
        check_len("q", q.len(), n.q)?;
        check_len("k", k.len(), n.k)?;
        check_len("v", v.len(), n.v)?;
        check_len("x", x.len(), n.x)?;
        if n.rows == 0 {
            return Ok(());
        }
        let [b, s, hq, hkv, d, dv] = n.ints;
        let f = self.function(M::Layout, "join_qkv_bf16")?;
        launch!(
            self,
            f,
            per_row(n.rows, ROW_THREADS, 0),
            [q, k, v, &b, &s, &hq, &hkv, &d, &dv, x]
        )
    }

    /// `y [s, b, w]` from `x [b, s, w]` (`to_sbhd`), or `y [b, s, w]` from
    /// `x [s, b, w]`; `y` written.
    pub fn transpose_bs(
        &self,
        x: &CudaSlice<bf16>,
        b: usize,
        s: usize,
        w: usize,
        to_sbhd: bool,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        let n = prod("x", &[b, s, w])?;
        check_len("x", x.len(), n)?;
        check_len("y", y.len(), n)?;
        let rows = prod("b * s", &[b, s])?;
        let (bi, si, wi) = (int("b", b)?, int("s", s)?, int("w", w)?);
        int("b * s", rows)?;
        if rows == 0 {
            return Ok(());
        }
        let to = i32::from(to_sbhd);
        let f = self.function(M::Layout, "transpose_bs_bf16")?;
        launch!(
            self,
            f,
            per_row(rows, ROW_THREADS, 0),
            [x, &bi, &si, &wi, &to, y]
        )
    }

    /// RoPE on fused QKV rows `x [rows, width]`: the `hq` query heads and the `hkv`
    /// key heads after them (`d` wide each, [`crate::cpu::rope_fwd`]'s pairing)
    /// rotated at `positions [rows]`, forward or, with `backward`, by the inverse
    /// rotation ([`crate::cpu::rope_bwd`] into zeros); the remaining columns (the
    /// values) copied. `y` written.
    pub fn rope_qkv(
        &self,
        x: &CudaSlice<bf16>,
        positions: &CudaSlice<u32>,
        rows: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        width: usize,
        rope: Rope,
        backward: bool,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        if !d.is_multiple_of(2) {
            return Err(invalid("d", format!("must be even, got {d}")).into());
        }
        let heads = hq
            .checked_add(hkv)
            .ok_or_else(|| invalid("hq + hkv", "overflows usize"))?;
        let rotated = prod("(hq + hkv) * d", &[heads, d])?;
        if rotated > width {
            return Err(invalid(
                "width",
                format!("{width} is narrower than the {rotated} query and key columns"),
            )
            .into());
        }
        let n = prod("x", &[rows, width])?;
        check_len("x", x.len(), n)?;
        check_len("y", y.len(), n)?;
        check_len("positions", positions.len(), rows)?;
        int("rows", rows)?;
        let (h, hd, w) = (int("hq + hkv", heads)?, int("d", d)?, int("width", width)?);
        if rows == 0 {
            return Ok(());
        }
        let sign = if backward { -1.0f32 } else { 1.0 };
        let threads = ((d / 2).div_ceil(32) * 32).clamp(32, 256) as u32;
        let f = self.function(M::Layout, "rope_qkv_bf16")?;
        launch!(
            self,
            f,
            per_row(rows, threads, 0),
            [
                x,
                positions,
                &h,
                &hd,
                &w,
                &rope.theta,
                &rope.factor,
                &rope.low_wavelength,
                &rope.high_wavelength,
                &sign,
                y
            ]
        )
    }

    /// `y [rows, n] += bias [n]` on every row (fp32 add, rounded once).
    pub fn bias_add(
        &self,
        y: &mut CudaSlice<bf16>,
        bias: &CudaSlice<bf16>,
        rows: usize,
        n: usize,
    ) -> Result<(), GpuError> {
        check_len("bias", bias.len(), n)?;
        check_len("y", y.len(), prod("y", &[rows, n])?)?;
        let (r, c) = (int("rows", rows)?, int("n", n)?);
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let f = self.function(M::Layout, "bias_add_bf16")?;
        launch!(self, f, self.elementwise(y.len()), [bias, &r, &c, y])
    }

    /// `dbias [n] (fp32) += sum_r dy [rows, n] (bf16)`, fp32 sums in a fixed order
    /// (rows in order within each chunk of rows, then the chunks in order).
    pub fn bias_grad(
        &self,
        dy: &CudaSlice<bf16>,
        rows: usize,
        n: usize,
        dbias: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        check_len("dbias", dbias.len(), n)?;
        check_len("dy", dy.len(), prod("dy", &[rows, n])?)?;
        let (r, c) = (int("rows", rows)?, int("n", n)?);
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let max_chunks = 4 * self.info().sm_count.max(1) as usize;
        let per_chunk = rows.div_ceil(rows.div_ceil(BIAS_CHUNK_MIN_ROWS).min(max_chunks));
        let chunks = rows.div_ceil(per_chunk);
        let mut partial = self.zeros::<f32>(prod("partial", &[chunks, n])?)?;
        let (pc, nc) = (int("rows per chunk", per_chunk)?, int("chunks", chunks)?);
        let f = self.function(M::Layout, "bias_grad_f32")?;
        // Eight columns per thread when rows stay 16-byte aligned.
        let vec = n.is_multiple_of(8);
        let threads = if vec { n / 8 } else { n };
        let vec = i32::from(vec);
        launch!(
            self,
            f,
            LaunchConfig {
                grid_dim: (
                    threads.div_ceil(COLSUM_THREADS as usize) as u32,
                    chunks as u32,
                    1
                ),
                block_dim: (COLSUM_THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
            [dy, &r, &c, &pc, &vec, &mut partial]
        )?;
        let f = self.function(M::Norm, "colsum_add_f32")?;
        launch!(self, f, self.elementwise(n), [&partial, &nc, &c, &c, dbias])
    }

    /// [`crate::cpu::accumulate`]: `acc += x` (fp32 add, rounded once).
    pub fn accumulate(
        &self,
        acc: &mut CudaSlice<bf16>,
        x: &CudaSlice<bf16>,
    ) -> Result<(), GpuError> {
        check_len("x", x.len(), acc.len())?;
        let n = long("acc", acc.len())?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(M::Layout, "accumulate_bf16")?;
        launch!(self, f, self.elementwise(acc.len()), [x, &n, acc])
    }
}
