//! Blockwise (flash-style) scaled dot-product attention with GQA, explicit
//! global positions, and exact merging of partial results for ring attention.
//!
//! Layouts (row-major): `q [batch, sq, hq, d]`, `k [batch, sk, hkv, d]`,
//! `v [batch, sk, hkv, dv]`, `out [batch, sq, hq, dv]`, `lse [batch, hq, sq]`
//! (natural log-sum-exp of the scaled scores). Query head `h` reads kv head
//! `h / (hq / hkv)`.
//!
//! Keys are processed [`KEY_TILE`] at a time with an online softmax, so no
//! `[sq, sk]` matrix is ever materialised. Query `i` sits at global position
//! `q_pos0 + i` and key `j` at `k_pos0 + j`; with `causal`, keys at a later
//! position than the query are masked. A ring rank therefore calls
//! [`attention_fwd`] once per KV block with that block's `k_pos0`, folds the
//! results with [`attention_merge`], and in the backward calls
//! [`attention_bwd`] per block with the *final* `out`/`lse`: the softmax
//! probabilities `exp(s - lse_final)` and `D = sum(dO * O_final)` are then
//! those of the full attention, so the per-block gradients sum exactly to the
//! full gradient.
//!
//! A query row with no visible key (every key masked) gets `out = 0` and
//! `lse = -inf`; merge and backward treat such rows without producing NaN.

#![allow(clippy::too_many_arguments)] // mirrors the CUDA kernel signature

use super::layout::qkv_columns;
use super::matmul::{matmul_on, Transpose};
use super::{check_len, fast_exp, invalid, lanes_max, par_map, par_rows, prod, KernelError, LANES};

/// Number of keys processed per tile of the online softmax.
pub const KEY_TILE: usize = 64;

/// Dropout on the attention probabilities (GPT-2's `attn_pdrop`): probability
/// `p` of dropping, and `keep(b, h, q_pos, k_pos)` telling, for the call's batch
/// row `b` and query head `h` at global positions `q_pos`, `k_pos`, whether the
/// entry survives. A pure function of its arguments, it regenerates the same mask
/// in the backward (and on every ring block) without storing it; kept entries are
/// scaled by `1 / (1 - p)`. The log-sum-exp is that of the undropped scores.
pub struct Dropout<'a> {
    /// Probability of dropping an entry, in `[0, 1)`.
    pub p: f32,
    /// Whether an entry survives.
    pub keep: &'a (dyn Fn(usize, usize, usize, usize) -> bool + Sync),
}

impl std::fmt::Debug for Dropout<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dropout").field("p", &self.p).finish()
    }
}

impl Dropout<'_> {
    fn check(&self) -> Result<f32, KernelError> {
        if !(0.0..1.0).contains(&self.p) {
            return Err(invalid(
                "dropout.p",
                format!("must be in [0, 1), got {}", self.p),
            ));
        }
        Ok(1.0 / (1.0 - self.p))
    }

    /// Multiplies `row` (keys `k_pos0..` of query `q_pos`) by the mask's scale.
    fn apply(&self, inv: f32, b: usize, h: usize, q_pos: usize, k_pos0: usize, row: &mut [f32]) {
        for (j, x) in row.iter_mut().enumerate() {
            *x *= if (self.keep)(b, h, q_pos, k_pos0 + j) {
                inv
            } else {
                0.0
            };
        }
    }
}

/// One (batch row, kv head) task's gradients in the backward: its query heads'
/// `dQ [group, sq, d]`, and the kv head's `dK [nk, d]` and `dV [nk, dv]`.
type GroupGrads = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Where attention reads its queries, keys and values.
#[derive(Debug, Clone, Copy)]
pub enum Qkv<'a> {
    /// Three tensors in the module's layouts: `q [batch, sq, hq, d]`,
    /// `k [batch, sk, hkv, d]` and `v [batch, sk, hkv, dv]`.
    Apart(&'a [f32], &'a [f32], &'a [f32]),
    /// The fused rows a `q | k | v` projection writes, sequence-major:
    /// `x [s, batch, hq d | hkv d | hkv dv]` (`sq == sk == s`), read in place.
    /// The output `o` and its gradient are then sequence-major too, `[s, batch,
    /// hq, dv]`: the rows the output projection reads, with no copy between.
    Fused(&'a [f32]),
}

/// Where attention's backward adds the gradients of `q`, `k` and `v`.
#[derive(Debug)]
pub enum QkvGrads<'a> {
    /// Three tensors in the layouts of [`Qkv::Apart`].
    Apart(&'a mut [f32], &'a mut [f32], &'a mut [f32]),
    /// One buffer of fused rows laid out as [`Qkv::Fused`]'s.
    Fused(&'a mut [f32]),
}

/// Where row `j` of head `h` of batch row `b` of an operand starts.
#[derive(Debug, Clone, Copy)]
struct Rows {
    offset: usize,
    batch: usize,
    seq: usize,
    head: usize,
}

impl Rows {
    /// `[batch, s, heads, width]`.
    fn dense(s: usize, heads: usize, width: usize) -> Rows {
        Rows {
            offset: 0,
            batch: s * heads * width,
            seq: heads * width,
            head: width,
        }
    }

    fn at(&self, b: usize, j: usize, h: usize) -> usize {
        self.offset + b * self.batch + j * self.seq + h * self.head
    }
}

impl<'a> Qkv<'a> {
    /// Where the output's (and its gradient's) rows are: `[batch, sq, hq, dv]`
    /// beside split operands, `[sq, batch, hq, dv]` beside fused rows.
    fn out_rows(&self, dims: &AttnDims) -> Rows {
        let (batch, sq, hq, dv) = (dims.batch, dims.sq, dims.hq, dims.dv);
        match self {
            Qkv::Apart(..) => Rows::dense(sq, hq, dv),
            Qkv::Fused(_) => Rows {
                offset: 0,
                batch: hq * dv,
                seq: batch * hq * dv,
                head: dv,
            },
        }
    }

    /// The three operands with their row layouts, their lengths checked.
    fn operands(&self, dims: &AttnDims) -> Result<[(&'a [f32], Rows); 3], KernelError> {
        let (sq, sk, hq, hkv, d, dv) = (dims.sq, dims.sk, dims.hq, dims.hkv, dims.d, dims.dv);
        match *self {
            Qkv::Apart(q, k, v) => {
                check_len("q", q.len(), dims.q_len()?)?;
                check_len("k", k.len(), dims.k_len()?)?;
                check_len("v", v.len(), dims.v_len()?)?;
                Ok([
                    (q, Rows::dense(sq, hq, d)),
                    (k, Rows::dense(sk, hkv, d)),
                    (v, Rows::dense(sk, hkv, dv)),
                ])
            }
            Qkv::Fused(x) => {
                if sq != sk {
                    return Err(invalid(
                        "dims.sk",
                        format!("fused q | k | v rows need sk == sq ({sq}), got {sk}"),
                    ));
                }
                let (start, _, row) = qkv_columns(dims);
                check_len("x", x.len(), prod("x", &[sq, dims.batch, row])?)?;
                let at = |offset, head| Rows {
                    offset,
                    batch: row,
                    seq: dims.batch * row,
                    head,
                };
                Ok([
                    (x, at(start[0], d)),
                    (x, at(start[1], d)),
                    (x, at(start[2], dv)),
                ])
            }
        }
    }
}

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnDims {
    /// Batch size.
    pub batch: usize,
    /// Query length (local).
    pub sq: usize,
    /// Key/value length (local block).
    pub sk: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads; must divide `hq`.
    pub hkv: usize,
    /// Query/key head dimension.
    pub d: usize,
    /// Value head dimension.
    pub dv: usize,
}

impl AttnDims {
    fn group(&self) -> Result<usize, KernelError> {
        if self.hkv == 0 || !self.hq.is_multiple_of(self.hkv) {
            return Err(invalid(
                "dims.hkv",
                format!(
                    "hq ({}) must be a positive multiple of hkv ({})",
                    self.hq, self.hkv
                ),
            ));
        }
        Ok(self.hq / self.hkv)
    }

    fn q_len(&self) -> Result<usize, KernelError> {
        prod("q", &[self.batch, self.sq, self.hq, self.d])
    }
    fn k_len(&self) -> Result<usize, KernelError> {
        prod("k", &[self.batch, self.sk, self.hkv, self.d])
    }
    fn v_len(&self) -> Result<usize, KernelError> {
        prod("v", &[self.batch, self.sk, self.hkv, self.dv])
    }
    /// Width of a fused `q | k | v` row: `hq d + hkv d + hkv dv`.
    pub fn qkv_width(&self) -> usize {
        super::layout::qkv_columns(self).2
    }
    /// Elements of the output, `[batch, sq, hq, dv]`.
    pub fn o_len(&self) -> Result<usize, KernelError> {
        prod("out", &[self.batch, self.sq, self.hq, self.dv])
    }
    /// Elements of the log-sum-exps, `[batch, hq, sq]`.
    pub fn lse_len(&self) -> Result<usize, KernelError> {
        prod("lse", &[self.batch, self.hq, self.sq])
    }
}

/// Number of leading keys of the block visible to query position `qpos`.
fn visible_keys(sk: usize, qpos: usize, k_pos0: usize, causal: bool) -> usize {
    if !causal {
        sk
    } else if qpos < k_pos0 {
        0
    } else {
        sk.min(qpos - k_pos0 + 1)
    }
}

/// Number of query rows per tile: each tile's score block is one
/// `[Q_TILE, KEY_TILE]` product.
const Q_TILE: usize = 64;

/// Copies rows `j0..j0 + n` of head `h` of batch `b` of `x` (laid out as
/// `rows` says) into the contiguous `[n, width]` prefix of `dst`.
fn gather(
    x: &[f32],
    rows: &Rows,
    width: usize,
    at: (usize, usize, usize),
    n: usize,
    dst: &mut [f32],
) {
    let (b, h, j0) = at;
    if width == 0 {
        return;
    }
    for (j, row) in (j0..j0 + n).zip(dst[..n * width].chunks_exact_mut(width)) {
        row.copy_from_slice(&x[rows.at(b, j, h)..][..width]);
    }
}

/// Adds the contiguous `[n, width]` prefix of `src` into rows `j0..j0 + n`
/// of head `h` of batch `b` of a `[batch, s, heads, width]` tensor.
fn scatter_add(
    dst: &mut [f32],
    s: usize,
    heads: usize,
    width: usize,
    at: (usize, usize, usize),
    n: usize,
    src: &[f32],
) {
    let (b, h, j0) = at;
    if width == 0 {
        return;
    }
    for (j, row) in (j0..j0 + n).zip(src[..n * width].chunks_exact(width)) {
        for (x, &y) in dst[((b * s + j) * heads + h) * width..][..width]
            .iter_mut()
            .zip(row)
        {
            *x += y;
        }
    }
}

/// Multiplies `xs` by `scale` and returns the maximum of the products.
fn scale_and_max(xs: &mut [f32], scale: f32) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (mi, x) in m.iter_mut().zip(c) {
            *x *= scale;
            *mi = mi.max(*x);
        }
    }
    for (mi, x) in m.iter_mut().zip(chunks.into_remainder()) {
        *x *= scale;
        *mi = mi.max(*x);
    }
    lanes_max(m)
}

/// Replaces each `x` with `exp(x - shift)` and returns their sum.
fn exp_shift_and_sum(xs: &mut [f32], shift: f32) -> f32 {
    for x in xs.iter_mut() {
        *x = fast_exp(*x - shift);
    }
    let mut s = [0.0f32; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (si, &x) in s.iter_mut().zip(c) {
            *si += x;
        }
    }
    for (si, &x) in s.iter_mut().zip(chunks.remainder()) {
        *si += x;
    }
    s.iter().sum()
}

/// Attention forward over one KV block. Writes `out` and `lse` (see the
/// module docs for layouts and masking).
///
/// Per (batch, query head) and tile of `Q_TILE` queries, the tile's scores
/// against each [`KEY_TILE`] keys are one matrix product, folded into the
/// rows' running max and sum, and `P V` is a second product; key tiles that
/// lie entirely after the tile's last query (causal) are skipped.
pub fn attention_fwd(
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
    let qkv = Qkv::Apart(q, k, v);
    attention_fwd_qkv(
        dims,
        qkv,
        (q_pos0, k_pos0),
        causal,
        scale,
        out,
        lse,
        dropout,
    )
}

/// [`attention_fwd`] with the operands where [`Qkv`] says: read in place from
/// fused rows, the results are bit for bit those of the split tensors (only
/// where each row is copied from changes).
pub fn attention_fwd_qkv(
    dims: &AttnDims,
    qkv: Qkv<'_>,
    (q_pos0, k_pos0): (usize, usize),
    causal: bool,
    scale: f32,
    out: &mut [f32],
    lse: &mut [f32],
    dropout: Option<&Dropout<'_>>,
) -> Result<(), KernelError> {
    let group = dims.group()?;
    let inv_keep = dropout.map(Dropout::check).transpose()?;
    let [(q, qr), (k, kr), (v, vr)] = qkv.operands(dims)?;
    let o_rows = qkv.out_rows(dims);
    check_len("out", out.len(), dims.o_len()?)?;
    check_len("lse", lse.len(), dims.lse_len()?)?;
    let AttnDims {
        batch,
        sq,
        sk,
        hq,
        hkv,
        d,
        dv,
    } = *dims;
    if sq == 0 {
        return Ok(());
    }
    // Keys any query of the call can see (the last query sees the most).
    let nk_all = visible_keys(sk, q_pos0 + sq - 1, k_pos0, causal);
    // One task per (batch row, kv head): its query heads' outputs do not
    // interleave with any other task's work, so tasks run in parallel and the
    // result is the same whatever the thread count.
    let task = |bg: usize| -> Result<(Vec<f32>, Vec<f32>), KernelError> {
        let (b, g) = (bg / hkv, bg % hkv);
        // Scratch: the kv head's keys and values, one query tile, its score
        // block and output accumulator, and per-row softmax state.
        let mut kb = vec![0.0f32; nk_all * d];
        let mut vb = vec![0.0f32; nk_all * dv];
        let mut qb = vec![0.0f32; Q_TILE * d];
        let mut sb = vec![0.0f32; Q_TILE * KEY_TILE];
        let mut acc = vec![0.0f32; Q_TILE * dv];
        let mut mrow = [0.0f32; Q_TILE];
        let mut lrow = [0.0f32; Q_TILE];
        let mut nvis = [0usize; Q_TILE];
        // This task's outputs: `[group, sq, dv]` and `[group, sq]`.
        let mut og = vec![0.0f32; group * sq * dv];
        let mut lg = vec![0.0f32; group * sq];
        gather(k, &kr, d, (b, g, 0), nk_all, &mut kb);
        gather(v, &vr, dv, (b, g, 0), nk_all, &mut vb);
        for hi in 0..group {
            let h = g * group + hi;
            for i0 in (0..sq).step_by(Q_TILE) {
                let mt = Q_TILE.min(sq - i0);
                for (r, n) in nvis[..mt].iter_mut().enumerate() {
                    *n = visible_keys(sk, q_pos0 + i0 + r, k_pos0, causal);
                }
                let nk = nvis[..mt].iter().copied().max().unwrap_or(0);
                gather(q, &qr, d, (b, h, i0), mt, &mut qb);
                mrow[..mt].fill(f32::NEG_INFINITY);
                lrow[..mt].fill(0.0);
                acc[..mt * dv].fill(0.0);
                for t0 in (0..nk).step_by(KEY_TILE) {
                    let nt = KEY_TILE.min(nk - t0);
                    let s = &mut sb[..mt * nt];
                    matmul_on(
                        1,
                        Transpose::No,
                        Transpose::Yes,
                        mt,
                        d,
                        nt,
                        &qb[..mt * d],
                        &kb[t0 * d..(t0 + nt) * d],
                        0.0,
                        s,
                    )?;
                    for (r, srow) in s.chunks_exact_mut(nt).enumerate() {
                        let lim = nvis[r].saturating_sub(t0).min(nt);
                        let (vis, hidden) = srow.split_at_mut(lim);
                        hidden.fill(0.0);
                        if lim == 0 {
                            continue;
                        }
                        let tmax = scale_and_max(vis, scale);
                        let m_new = mrow[r].max(tmax);
                        // exp(-inf) = 0 on the row's first tile, so the empty
                        // state is rescaled away without a special case.
                        let alpha = (mrow[r] - m_new).exp();
                        if alpha != 1.0 {
                            lrow[r] *= alpha;
                            for a in &mut acc[r * dv..(r + 1) * dv] {
                                *a *= alpha;
                            }
                        }
                        lrow[r] += exp_shift_and_sum(vis, m_new);
                        mrow[r] = m_new;
                        // The normaliser counts every entry; only P V sees the mask.
                        if let (Some(dr), Some(inv)) = (dropout, inv_keep) {
                            dr.apply(inv, b, h, q_pos0 + i0 + r, k_pos0 + t0, vis);
                        }
                    }
                    matmul_on(
                        1,
                        Transpose::No,
                        Transpose::No,
                        mt,
                        nt,
                        dv,
                        s,
                        &vb[t0 * dv..(t0 + nt) * dv],
                        1.0,
                        &mut acc[..mt * dv],
                    )?;
                }
                for r in 0..mt {
                    let i = i0 + r;
                    let orow = &mut og[(hi * sq + i) * dv..][..dv];
                    let li = &mut lg[hi * sq + i];
                    if nvis[r] == 0 {
                        orow.fill(0.0);
                        *li = f32::NEG_INFINITY;
                        continue;
                    }
                    let inv = 1.0 / lrow[r];
                    for (o, &a) in orow.iter_mut().zip(&acc[r * dv..(r + 1) * dv]) {
                        *o = a * inv;
                    }
                    *li = mrow[r] + lrow[r].ln();
                }
            }
        }
        Ok((og, lg))
    };
    let parts = par_map(batch * hkv, task)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    for (bg, (_, lg)) in parts.iter().enumerate() {
        let (b, g) = (bg / hkv, bg % hkv);
        // The group's query heads are adjacent, so its lse rows are one run.
        lse[(b * hq + g * group) * sq..][..group * sq].copy_from_slice(lg);
    }
    // `out` from the tasks' rows, its outer rows (batch rows, or positions for
    // sequence-major rows) over the pool.
    let by_batch = matches!(qkv, Qkv::Apart(..));
    let inner = if by_batch { sq } else { batch };
    let chunk = inner * hq * dv;
    if chunk == 0 {
        return Ok(());
    }
    par_rows(out, chunk, |o0, rows| {
        for (oi, ob) in rows.chunks_exact_mut(chunk).enumerate() {
            let base = (o0 + oi) * chunk;
            for j in 0..inner {
                let (b, i) = if by_batch { (o0 + oi, j) } else { (j, o0 + oi) };
                for g in 0..hkv {
                    let og = &parts[b * hkv + g].0;
                    for hi in 0..group {
                        let at = o_rows.at(b, i, g * group + hi) - base;
                        ob[at..][..dv].copy_from_slice(&og[(hi * sq + i) * dv..][..dv]);
                    }
                }
            }
        }
    });
    Ok(())
}

/// Folds a partial result `(o_blk, lse_blk)` over another set of keys into
/// the running `(o_acc, lse_acc)`:
/// `lse = logaddexp(lse_acc, lse_blk)`,
/// `o = exp(lse_acc - lse) o_acc + exp(lse_blk - lse) o_blk`.
///
/// Exact up to rounding, associative and commutative in exact arithmetic.
/// A side with `lse = -inf` contributes nothing and its `o` is never read, so
/// the accumulator may start as `lse = -inf`; start it with `o = 0` so that
/// rows no block ever reaches keep the forward's `out = 0` convention. Uses
/// `batch`, `sq`, `hq`, `dv` of `dims`.
pub fn attention_merge(
    dims: &AttnDims,
    o_acc: &mut [f32],
    lse_acc: &mut [f32],
    o_blk: &[f32],
    lse_blk: &[f32],
) -> Result<(), KernelError> {
    let AttnDims {
        batch, sq, hq, dv, ..
    } = *dims;
    let ol = dims.o_len()?;
    let ll = dims.lse_len()?;
    check_len("o_acc", o_acc.len(), ol)?;
    check_len("o_blk", o_blk.len(), ol)?;
    check_len("lse_acc", lse_acc.len(), ll)?;
    check_len("lse_blk", lse_blk.len(), ll)?;
    for b in 0..batch {
        for h in 0..hq {
            for i in 0..sq {
                let li = (b * hq + h) * sq + i;
                let (la, lb) = (lse_acc[li], lse_blk[li]);
                let oa = &mut o_acc[((b * sq + i) * hq + h) * dv..][..dv];
                let ob = &o_blk[((b * sq + i) * hq + h) * dv..][..dv];
                if lb == f32::NEG_INFINITY {
                    continue;
                }
                if la == f32::NEG_INFINITY {
                    oa.copy_from_slice(ob);
                    lse_acc[li] = lb;
                    continue;
                }
                let mx = la.max(lb);
                let lse = mx + (-(la - lb).abs()).exp().ln_1p();
                let (wa, wb) = ((la - lse).exp(), (lb - lse).exp());
                for (a, &x) in oa.iter_mut().zip(ob) {
                    *a = wa * *a + wb * x;
                }
                lse_acc[li] = lse;
            }
        }
    }
    Ok(())
}

/// Attention backward over one KV block, accumulating into `d_q`, `d_k`,
/// `d_v` (same layouts as `q`, `k`, `v`).
///
/// `o` and `lse` must be the final forward results over *all* KV blocks
/// (for a single block, simply the output of [`attention_fwd`]); `d_o` is
/// the gradient of `o`. Rows whose final `lse` is `-inf` saw no key and get
/// no gradient.
///
/// FlashAttention-2 order: per (batch, kv head), query head of its group and
/// tile of `Q_TILE` queries, each visible [`KEY_TILE`] keys recompute
/// `P = exp(S - lse)` and take `dV += Pᵀ dO`, `dP = dO Vᵀ`,
/// `dS = P ∘ (dP - D)` with `D = rowsum(dO ∘ O)`, `dQ += dS K scale` and
/// `dK += dSᵀ Q scale`, all as matrix products over the tile.
pub fn attention_bwd(
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
    let (qkv, pos0) = (Qkv::Apart(q, k, v), (q_pos0, k_pos0));
    let grads = QkvGrads::Apart(d_q, d_k, d_v);
    attention_bwd_qkv(
        dims,
        qkv,
        (o, lse, d_o),
        pos0,
        causal,
        scale,
        grads,
        dropout,
    )
}

/// [`attention_bwd`] with the operands where [`Qkv`] says and the gradients
/// added where [`QkvGrads`] says: bit for bit the same gradients (as for
/// [`attention_fwd_qkv`], only where rows are copied from and to changes).
pub fn attention_bwd_qkv(
    dims: &AttnDims,
    qkv: Qkv<'_>,
    (o, lse, d_o): (&[f32], &[f32], &[f32]),
    (q_pos0, k_pos0): (usize, usize),
    causal: bool,
    scale: f32,
    mut grads: QkvGrads<'_>,
    dropout: Option<&Dropout<'_>>,
) -> Result<(), KernelError> {
    let group = dims.group()?;
    let inv_keep = dropout.map(Dropout::check).transpose()?;
    let [(q, qr), (k, kr), (v, vr)] = qkv.operands(dims)?;
    let o_rows = qkv.out_rows(dims);
    let ol = dims.o_len()?;
    check_len("o", o.len(), ol)?;
    check_len("lse", lse.len(), dims.lse_len()?)?;
    check_len("d_o", d_o.len(), ol)?;
    match &grads {
        QkvGrads::Apart(d_q, d_k, d_v) => {
            check_len("d_q", d_q.len(), dims.q_len()?)?;
            check_len("d_k", d_k.len(), dims.k_len()?)?;
            check_len("d_v", d_v.len(), dims.v_len()?)?;
        }
        QkvGrads::Fused(dx) => {
            Qkv::Fused(&dx[..]).operands(dims)?;
        }
    }
    let AttnDims {
        batch,
        sq,
        sk,
        hq,
        hkv,
        d,
        dv,
    } = *dims;
    if sq == 0 {
        return Ok(());
    }
    let nk_all = visible_keys(sk, q_pos0 + sq - 1, k_pos0, causal);
    if nk_all == 0 {
        return Ok(());
    }
    // One task per (batch row, kv head), as in the forward: it owns the kv
    // head's dK and dV and its query heads' dQ, which the tasks' results add
    // into the outputs in task order.
    let task = |bg: usize| -> Result<GroupGrads, KernelError> {
        let (b, g) = (bg / hkv, bg % hkv);
        // Scratch: the kv head's keys, values and their gradient accumulators;
        // one query tile with its dO, dQ accumulator, probability and dP/dS
        // blocks, and per-row lse and D.
        let mut kb = vec![0.0f32; nk_all * d];
        let mut vb = vec![0.0f32; nk_all * dv];
        let mut dkb = vec![0.0f32; nk_all * d];
        let mut dvb = vec![0.0f32; nk_all * dv];
        // This task's dQ: `[group, sq, d]`.
        let mut dqg = vec![0.0f32; group * sq * d];
        let mut qb = vec![0.0f32; Q_TILE * d];
        let mut dob = vec![0.0f32; Q_TILE * dv];
        let mut dqb = vec![0.0f32; Q_TILE * d];
        let mut pb = vec![0.0f32; Q_TILE * KEY_TILE];
        let mut dsb = vec![0.0f32; Q_TILE * KEY_TILE];
        // Under dropout: the mask's scale per entry (Z) and the dropped P (P Z).
        let mut zb = vec![
            0.0f32;
            if dropout.is_some() {
                Q_TILE * KEY_TILE
            } else {
                0
            }
        ];
        let mut pzb = vec![0.0f32; zb.len()];
        let mut lrow = [0.0f32; Q_TILE];
        let mut drow = [0.0f32; Q_TILE];
        let mut nvis = [0usize; Q_TILE];
        gather(k, &kr, d, (b, g, 0), nk_all, &mut kb);
        gather(v, &vr, dv, (b, g, 0), nk_all, &mut vb);
        for hi in 0..group {
            let h = g * group + hi;
            for i0 in (0..sq).step_by(Q_TILE) {
                let mt = Q_TILE.min(sq - i0);
                for r in 0..mt {
                    let i = i0 + r;
                    let l = lse[(b * hq + h) * sq + i];
                    lrow[r] = l;
                    // A row whose final lse is -inf saw no key anywhere.
                    nvis[r] = if l == f32::NEG_INFINITY {
                        0
                    } else {
                        visible_keys(sk, q_pos0 + i, k_pos0, causal)
                    };
                }
                let nk = nvis[..mt].iter().copied().max().unwrap_or(0);
                if nk == 0 {
                    continue;
                }
                gather(q, &qr, d, (b, h, i0), mt, &mut qb);
                gather(d_o, &o_rows, dv, (b, h, i0), mt, &mut dob);
                for (r, dr) in drow[..mt].iter_mut().enumerate() {
                    let row = o_rows.at(b, i0 + r, h);
                    *dr = o[row..row + dv]
                        .iter()
                        .zip(&d_o[row..row + dv])
                        .fold(0.0f32, |s, (&x, &y)| s + x * y);
                }
                dqb[..mt * d].fill(0.0);
                for t0 in (0..nk).step_by(KEY_TILE) {
                    let nt = KEY_TILE.min(nk - t0);
                    let kt = &kb[t0 * d..(t0 + nt) * d];
                    let vt = &vb[t0 * dv..(t0 + nt) * dv];
                    let p = &mut pb[..mt * nt];
                    matmul_on(
                        1,
                        Transpose::No,
                        Transpose::Yes,
                        mt,
                        d,
                        nt,
                        &qb[..mt * d],
                        kt,
                        0.0,
                        p,
                    )?;
                    for (r, prow) in p.chunks_exact_mut(nt).enumerate() {
                        let lim = nvis[r].saturating_sub(t0).min(nt);
                        let (vis, hidden) = prow.split_at_mut(lim);
                        let l = lrow[r];
                        for x in vis.iter_mut() {
                            *x = fast_exp(scale * *x - l);
                        }
                        hidden.fill(0.0);
                    }
                    // Under dropout O = (P Z) V: dV takes P Z, and dP's entries
                    // are scaled by Z before dS (D = rowsum(dO O) still holds).
                    let z = if let (Some(dr), Some(inv)) = (dropout, inv_keep) {
                        let z = &mut zb[..mt * nt];
                        let pz = &mut pzb[..mt * nt];
                        for (r, zrow) in z.chunks_exact_mut(nt).enumerate() {
                            zrow.fill(1.0);
                            dr.apply(inv, b, h, q_pos0 + i0 + r, k_pos0 + t0, zrow);
                        }
                        for ((x, &pj), &zj) in pz.iter_mut().zip(p.iter()).zip(z.iter()) {
                            *x = pj * zj;
                        }
                        Some(&zb[..mt * nt])
                    } else {
                        None
                    };
                    // dV += (P Z)^T dO
                    matmul_on(
                        1,
                        Transpose::Yes,
                        Transpose::No,
                        nt,
                        mt,
                        dv,
                        if z.is_some() { &pzb[..mt * nt] } else { p },
                        &dob[..mt * dv],
                        1.0,
                        &mut dvb[t0 * dv..(t0 + nt) * dv],
                    )?;
                    // dP = dO V^T, then dS = scale * P * (dP - D) in place
                    let ds = &mut dsb[..mt * nt];
                    matmul_on(
                        1,
                        Transpose::No,
                        Transpose::Yes,
                        mt,
                        dv,
                        nt,
                        &dob[..mt * dv],
                        vt,
                        0.0,
                        ds,
                    )?;
                    for (r, (dsrow, prow)) in
                        ds.chunks_exact_mut(nt).zip(p.chunks_exact(nt)).enumerate()
                    {
                        let lim = nvis[r].saturating_sub(t0).min(nt);
                        let dd = drow[r];
                        if let Some(z) = z {
                            let zrow = &z[r * nt..r * nt + lim];
                            for ((x, &pj), &zj) in
                                dsrow[..lim].iter_mut().zip(&prow[..lim]).zip(zrow)
                            {
                                *x = scale * pj * (*x * zj - dd);
                            }
                        } else {
                            for (x, &pj) in dsrow[..lim].iter_mut().zip(&prow[..lim]) {
                                *x = scale * pj * (*x - dd);
                            }
                        }
                        dsrow[lim..].fill(0.0);
                    }
                    // dQ += dS K, dK += dS^T Q (scale already in dS)
                    matmul_on(
                        1,
                        Transpose::No,
                        Transpose::No,
                        mt,
                        nt,
                        d,
                        ds,
                        kt,
                        1.0,
                        &mut dqb[..mt * d],
                    )?;
                    matmul_on(
                        1,
                        Transpose::Yes,
                        Transpose::No,
                        nt,
                        mt,
                        d,
                        ds,
                        &qb[..mt * d],
                        1.0,
                        &mut dkb[t0 * d..(t0 + nt) * d],
                    )?;
                }
                let dst = &mut dqg[(hi * sq + i0) * d..][..mt * d];
                for (x, &y) in dst.iter_mut().zip(&dqb[..mt * d]) {
                    *x += y;
                }
            }
        }
        Ok((dqg, dkb, dvb))
    };
    let parts = par_map(batch * hkv, task)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    // Each batch row of the gradients from its tasks (task `b * hkv + g`), the
    // rows over the pool: one addition per element, so the split changes nothing.
    type Add<'a> = &'a (dyn Fn(&mut [f32], usize) + Sync);
    let by_batch = |dst: &mut [f32], row: usize, add: Add<'_>| {
        if row > 0 {
            par_rows(dst, row, |b0, rows| {
                for (bi, db) in rows.chunks_exact_mut(row).enumerate() {
                    (0..hkv).for_each(|g| add(db, (b0 + bi) * hkv + g));
                }
            });
        }
    };
    let (d_q, d_k, d_v) = match &mut grads {
        QkvGrads::Apart(d_q, d_k, d_v) => (&mut **d_q, &mut **d_k, &mut **d_v),
        QkvGrads::Fused(dx) => {
            fused_grads(dims, nk_all, &parts, dx);
            return Ok(());
        }
    };
    by_batch(d_q, sq * hq * d, &|db, t| {
        for hi in 0..group {
            let (h, src) = ((t % hkv) * group + hi, &parts[t].0[hi * sq * d..]);
            scatter_add(db, sq, hq, d, (0, h, 0), sq, src);
        }
    });
    by_batch(d_k, sk * hkv * d, &|db, t| {
        scatter_add(db, sk, hkv, d, (0, t % hkv, 0), nk_all, &parts[t].1);
    });
    by_batch(d_v, sk * hkv * dv, &|db, t| {
        scatter_add(db, sk, hkv, dv, (0, t % hkv, 0), nk_all, &parts[t].2);
    });
    Ok(())
}

/// Adds the backward tasks' gradients (task `b * hkv + g`, as
/// [`attention_bwd_qkv`] makes them) into fused rows `dx [s, batch, hq d |
/// hkv d | hkv dv]`, the rows over the pool: one addition per element, as
/// [`scatter_add`] makes into split tensors.
fn fused_grads(dims: &AttnDims, nk_all: usize, parts: &[GroupGrads], dx: &mut [f32]) {
    let AttnDims {
        batch,
        sq,
        hq,
        hkv,
        d,
        dv,
        ..
    } = *dims;
    let (group, (start, _, row)) = (hq / hkv, qkv_columns(dims));
    let add = |dst: &mut [f32], src: &[f32]| {
        for (x, &y) in dst.iter_mut().zip(src) {
            *x += y;
        }
    };
    if row == 0 {
        return;
    }
    par_rows(dx, row, |t0, rows| {
        for (t, xr) in (t0..).zip(rows.chunks_exact_mut(row)) {
            let (j, b) = (t / batch, t % batch);
            let (q, rest) = xr.split_at_mut(start[1]);
            let (k, v) = rest.split_at_mut(start[2] - start[1]);
            for g in 0..hkv {
                let (dq, dk, dv_) = &parts[b * hkv + g];
                for hi in 0..group {
                    let h = g * group + hi;
                    add(&mut q[h * d..][..d], &dq[(hi * sq + j) * d..][..d]);
                }
                if j < nk_all {
                    add(&mut k[g * d..][..d], &dk[j * d..][..d]);
                    add(&mut v[g * dv..][..dv], &dv_[j * dv..][..dv]);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, assert_grad_close, dot64, numeric_grad, Rng};

    struct Case {
        dims: AttnDims,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        q_pos0: usize,
        causal: bool,
        scale: f32,
    }

    fn case(seed: u64, dims: AttnDims, q_pos0: usize, causal: bool) -> Case {
        let mut rng = Rng::new(seed);
        let mul = |v: Vec<f32>, s: f32| v.into_iter().map(|x| x * s).collect::<Vec<_>>();
        Case {
            q: mul(rng.vec(dims.q_len().unwrap()), 2.0),
            k: mul(rng.vec(dims.k_len().unwrap()), 2.0),
            v: rng.vec(dims.v_len().unwrap()),
            scale: 1.0 / (dims.d as f32).sqrt(),
            dims,
            q_pos0,
            causal,
        }
    }

    fn fwd(c: &Case, k: &[f32], v: &[f32], sk: usize, k_pos0: usize) -> (Vec<f32>, Vec<f32>) {
        let dims = AttnDims { sk, ..c.dims };
        let mut o = vec![f32::NAN; dims.o_len().unwrap()];
        let mut l = vec![f32::NAN; dims.lse_len().unwrap()];
        attention_fwd(
            &dims, &c.q, k, v, c.q_pos0, k_pos0, c.causal, c.scale, &mut o, &mut l, None,
        )
        .unwrap();
        (o, l)
    }

    #[test]
    fn fused_rows_in_and_out_give_the_split_tensors_results_bit_for_bit() {
        let keep = |b: usize, h: usize, i: usize, j: usize| {
            !(b * 31 + h * 17 + i * 7 + j * 3).is_multiple_of(5)
        };
        let drop = Dropout {
            p: 0.2,
            keep: &keep,
        };
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        // (batch, s, hq, hkv, d, dv): ragged sizes, GQA, and a sequence over
        // more than one query and key tile.
        for (n, &(batch, s, hq, hkv, d, dv)) in [
            (3, 7, 4, 2, 3, 5),
            (2, 130, 2, 1, 8, 8),
            (1, 65, 3, 3, 4, 2),
        ]
        .iter()
        .enumerate()
        {
            let dims = dims(batch, s, s, hq, hkv, d, dv);
            let row = hq * d + hkv * d + hkv * dv;
            let mut rng = Rng::new(40 + n as u64);
            let x = rng.vec(s * batch * row);
            let d_o = rng.vec(dims.o_len().unwrap());
            // Beside fused rows the output and its gradient are sequence-major.
            let seq_major = |x: &[f32], to: bool| {
                let mut y = vec![0.0; x.len()];
                let (p, q) = if to { (batch, s) } else { (s, batch) };
                crate::cpu::transpose_bs(x, (p, q, hq * dv), true, &mut y).unwrap();
                y
            };
            let d_o_rows = seq_major(&d_o, true);
            let (mut q, mut k, mut v) = (
                vec![0.0; dims.q_len().unwrap()],
                vec![0.0; dims.k_len().unwrap()],
                vec![0.0; dims.v_len().unwrap()],
            );
            crate::cpu::split_qkv(&x, &dims, &mut q, &mut k, &mut v).unwrap();
            for (causal, dropout, threads) in [
                (true, None, 1),
                (false, None, 2),
                (true, Some(&drop), 2),
                (false, Some(&drop), 3),
            ] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let run = |qkv: Qkv<'_>, into_rows: bool| {
                    pool.install(|| {
                        let mut o = vec![f32::NAN; dims.o_len().unwrap()];
                        let mut l = vec![f32::NAN; dims.lse_len().unwrap()];
                        let (pos, sc) = ((2, 2), 0.4);
                        attention_fwd_qkv(&dims, qkv, pos, causal, sc, &mut o, &mut l, dropout)
                            .unwrap();
                        let mut g = [q.len(), k.len(), v.len()].map(|n| vec![0.0; n]);
                        let fused = matches!(qkv, Qkv::Fused(_));
                        let d_o = if fused { &d_o_rows } else { &d_o };
                        let ins = (&o[..], &l[..], &d_o[..]);
                        let mut dx = vec![0.0; x.len()];
                        let grads = if into_rows {
                            QkvGrads::Fused(&mut dx)
                        } else {
                            let [gq, gk, gv] = &mut g;
                            QkvGrads::Apart(gq, gk, gv)
                        };
                        attention_bwd_qkv(&dims, qkv, ins, pos, causal, sc, grads, dropout)
                            .unwrap();
                        if into_rows {
                            let [gq, gk, gv] = &mut g;
                            crate::cpu::split_qkv(&dx, &dims, gq, gk, gv).unwrap();
                        }
                        (if fused { seq_major(&o, false) } else { o }, l, g)
                    })
                };
                let apart = run(Qkv::Apart(&q, &k, &v), false);
                let fused = run(Qkv::Fused(&x), false);
                let joined = run(Qkv::Fused(&x), true);
                let what = format!(
                    "case {n}, causal {causal}, dropout {}, {threads} threads",
                    dropout.is_some()
                );
                assert_eq!(bits(&apart.0), bits(&fused.0), "out, {what}");
                assert_eq!(bits(&apart.1), bits(&fused.1), "lse, {what}");
                for i in 0..3 {
                    assert_eq!(bits(&apart.2[i]), bits(&fused.2[i]), "gradient {i}, {what}");
                    let w = format!("gradient {i} into fused rows, {what}");
                    assert_eq!(bits(&apart.2[i]), bits(&joined.2[i]), "{w}");
                }
                let finite = |x: &[f32]| x.iter().all(|v| v.is_finite());
                assert!(
                    finite(&apart.0) && apart.2.iter().all(|g| finite(g)),
                    "{what}"
                );
                assert!(apart.2[1].iter().any(|&g| g != 0.0), "{what}");
            }
        }
        // Fused rows are one sequence: queries and keys of different lengths refuse.
        let dm = dims(1, 2, 3, 1, 1, 1, 1);
        let (mut o, mut l) = (vec![0.0; 2], vec![0.0; 2]);
        let e = attention_fwd_qkv(
            &dm,
            Qkv::Fused(&[0.0; 9]),
            (0, 0),
            true,
            1.0,
            &mut o,
            &mut l,
            None,
        );
        assert!(
            matches!(
                e,
                Err(KernelError::Invalid {
                    name: "dims.sk",
                    ..
                })
            ),
            "{e:?}"
        );
    }

    /// Full score matrix and softmax in f64: the definition the tiled kernel
    /// must reproduce.
    fn naive(c: &Case) -> (Vec<f32>, Vec<f32>) {
        let AttnDims {
            batch,
            sq,
            sk,
            hq,
            hkv,
            d,
            dv,
        } = c.dims;
        let group = hq / hkv;
        let mut o = vec![0.0f32; c.dims.o_len().unwrap()];
        let mut lse = vec![0.0f32; c.dims.lse_len().unwrap()];
        for b in 0..batch {
            for h in 0..hq {
                let g = h / group;
                for i in 0..sq {
                    let qr = &c.q[((b * sq + i) * hq + h) * d..][..d];
                    let s: Vec<Option<f64>> = (0..sk)
                        .map(|j| {
                            if c.causal && j > c.q_pos0 + i {
                                return None;
                            }
                            let kr = &c.k[((b * sk + j) * hkv + g) * d..][..d];
                            Some(c.scale as f64 * dot64(qr, kr))
                        })
                        .collect();
                    let mx = s.iter().flatten().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                    let z: f64 = s.iter().flatten().map(|x| (x - mx).exp()).sum();
                    lse[(b * hq + h) * sq + i] = (mx + z.ln()) as f32;
                    for e in 0..dv {
                        let mut acc = 0.0f64;
                        for (j, sj) in s.iter().enumerate() {
                            if let Some(sj) = sj {
                                acc += (sj - mx).exp() / z
                                    * c.v[((b * sk + j) * hkv + g) * dv + e] as f64;
                            }
                        }
                        o[((b * sq + i) * hq + h) * dv + e] = acc as f32;
                    }
                }
            }
        }
        (o, lse)
    }

    fn dims(
        batch: usize,
        sq: usize,
        sk: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        dv: usize,
    ) -> AttnDims {
        AttnDims {
            batch,
            sq,
            sk,
            hq,
            hkv,
            d,
            dv,
        }
    }

    #[test]
    fn tiled_forward_matches_naive_causal_noncausal_gqa_odd_sizes() {
        // sk = 150 spans three tiles (64, 64, 22); GQA 4:1 and 1:1.
        for (seed, dm, q_pos0, causal) in [
            (1, dims(2, 7, 150, 8, 2, 5, 3), 143, true),
            (2, dims(2, 7, 150, 8, 2, 5, 3), 0, false),
            (3, dims(1, 70, 70, 4, 1, 6, 7), 0, true),
            (4, dims(1, 13, 131, 3, 3, 4, 4), 60, true),
            (5, dims(1, 3, 1, 4, 1, 3, 2), 0, false),
            // Decode: one query at the end of a cached context.
            (6, dims(1, 1, 37, 4, 2, 8, 8), 36, true),
        ] {
            let c = case(seed, dm, q_pos0, causal);
            let (o, l) = fwd(&c, &c.k, &c.v, dm.sk, 0);
            let (ro, rl) = naive(&c);
            assert_close(&format!("out seed {seed}"), &o, &ro, 2e-5);
            assert_close(&format!("lse seed {seed}"), &l, &rl, 2e-5);
        }
    }

    #[test]
    fn fully_masked_rows_give_zero_and_neg_inf() {
        // keys start at global position 5; queries at 3..8 -> first two rows see nothing
        let dm = dims(1, 5, 4, 2, 1, 3, 2);
        let c = case(7, dm, 3, true);
        let (o, l) = fwd(&c, &c.k, &c.v, dm.sk, 5);
        for h in 0..2 {
            for i in 0..5 {
                let li = l[h * 5 + i];
                let row = &o[(i * 2 + h) * 2..][..2];
                if i < 2 {
                    assert_eq!(li, f32::NEG_INFINITY);
                    assert_eq!(row, [0.0, 0.0]);
                } else {
                    assert!(li.is_finite());
                }
                assert!(row.iter().all(|x| x.is_finite()));
            }
        }
        // backward through those rows adds nothing and stays finite
        let d_o = vec![1.0; o.len()];
        let mut dq = vec![0.0; c.q.len()];
        let mut dk = vec![0.0; c.k.len()];
        let mut dvv = vec![0.0; c.v.len()];
        attention_bwd(
            &dm, &c.q, &c.k, &c.v, &o, &l, &d_o, 3, 5, true, c.scale, &mut dq, &mut dk, &mut dvv,
            None,
        )
        .unwrap();
        assert!(dq[..2 * 2 * 3].iter().all(|&x| x == 0.0));
        assert!(dq.iter().chain(&dk).chain(&dvv).all(|x| x.is_finite()));
        assert!(dvv.iter().any(|&x| x != 0.0));
    }

    /// Split K/V along the sequence into `nblk` blocks (uneven sizes).
    fn split(c: &Case, nblk: usize) -> Vec<(usize, usize)> {
        let sk = c.dims.sk;
        let mut bounds: Vec<usize> = (0..=nblk).map(|b| b * sk / nblk).collect();
        bounds[1] += 1; // make block sizes unequal
        bounds.windows(2).map(|w| (w[0], w[1])).collect()
    }

    fn slice_kv(x: &[f32], dm: &AttnDims, width: usize, j0: usize, j1: usize) -> Vec<f32> {
        let row = dm.hkv * width;
        (0..dm.batch)
            .flat_map(|b| {
                x[(b * dm.sk + j0) * row..(b * dm.sk + j1) * row]
                    .iter()
                    .copied()
            })
            .collect()
    }

    fn unslice_add(
        dst: &mut [f32],
        src: &[f32],
        dm: &AttnDims,
        width: usize,
        j0: usize,
        j1: usize,
    ) {
        let row = dm.hkv * width;
        let n = (j1 - j0) * row;
        for b in 0..dm.batch {
            for (x, &y) in dst[(b * dm.sk + j0) * row..][..n]
                .iter_mut()
                .zip(&src[b * n..][..n])
            {
                *x += y;
            }
        }
    }

    #[test]
    fn ring_blocks_forward_merge_and_backward_sum_equal_full() {
        for (seed, causal, nblk) in [(11, true, 2), (12, true, 4), (13, false, 2), (14, false, 4)] {
            // queries are the second half of a 2*sq sequence (as on a cp rank)
            let dm = dims(2, 9, 150, 8, 2, 5, 3);
            let c = case(seed, dm, 75, causal);
            let (o_full, l_full) = fwd(&c, &c.k, &c.v, dm.sk, 0);

            let mut o_acc = vec![f32::NAN; o_full.len()];
            let mut l_acc = vec![f32::NEG_INFINITY; l_full.len()];
            let blocks = split(&c, nblk);
            for &(j0, j1) in &blocks {
                let kb = slice_kv(&c.k, &dm, dm.d, j0, j1);
                let vb = slice_kv(&c.v, &dm, dm.dv, j0, j1);
                let (ob, lb) = fwd(&c, &kb, &vb, j1 - j0, j0);
                attention_merge(&dm, &mut o_acc, &mut l_acc, &ob, &lb).unwrap();
            }
            assert_close(&format!("ring out {seed}"), &o_acc, &o_full, 1e-5);
            assert_close(&format!("ring lse {seed}"), &l_acc, &l_full, 1e-5);

            let mut rng = Rng::new(seed + 100);
            let d_o = rng.vec(o_full.len());
            let mut dq = vec![0.0; c.q.len()];
            let mut dk = vec![0.0; c.k.len()];
            let mut dvv = vec![0.0; c.v.len()];
            attention_bwd(
                &dm, &c.q, &c.k, &c.v, &o_full, &l_full, &d_o, 75, 0, causal, c.scale, &mut dq,
                &mut dk, &mut dvv, None,
            )
            .unwrap();
            let mut rq = vec![0.0; c.q.len()];
            let mut rk = vec![0.0; c.k.len()];
            let mut rv = vec![0.0; c.v.len()];
            for &(j0, j1) in &blocks {
                let bd = AttnDims { sk: j1 - j0, ..dm };
                let kb = slice_kv(&c.k, &dm, dm.d, j0, j1);
                let vb = slice_kv(&c.v, &dm, dm.dv, j0, j1);
                let mut dkb = vec![0.0; kb.len()];
                let mut dvb = vec![0.0; vb.len()];
                attention_bwd(
                    &bd, &c.q, &kb, &vb, &o_acc, &l_acc, &d_o, 75, j0, causal, c.scale, &mut rq,
                    &mut dkb, &mut dvb, None,
                )
                .unwrap();
                unslice_add(&mut rk, &dkb, &dm, dm.d, j0, j1);
                unslice_add(&mut rv, &dvb, &dm, dm.dv, j0, j1);
            }
            assert_close(&format!("ring dq {seed}"), &rq, &dq, 1e-4);
            assert_close(&format!("ring dk {seed}"), &rk, &dk, 1e-4);
            assert_close(&format!("ring dv {seed}"), &rv, &dvv, 1e-4);
        }
    }

    #[test]
    fn merge_handles_neg_inf_on_either_side() {
        let dm = dims(1, 2, 0, 1, 1, 1, 1);
        let mut o = [5.0, f32::NAN];
        let mut l = [0.0, f32::NEG_INFINITY];
        attention_merge(
            &dm,
            &mut o,
            &mut l,
            &[f32::NAN, 7.0],
            &[f32::NEG_INFINITY, 1.0],
        )
        .unwrap();
        assert_eq!(o, [5.0, 7.0]);
        assert_eq!(l, [0.0, 1.0]);
        // equal-weight blocks average, lse grows by ln 2
        let mut o = [1.0, 0.0];
        let mut l = [0.5, f32::NEG_INFINITY];
        attention_merge(&dm, &mut o, &mut l, &[3.0, 0.0], &[0.5, f32::NEG_INFINITY]).unwrap();
        assert!((o[0] - 2.0).abs() < 1e-6 && (l[0] - (0.5 + 2f32.ln())).abs() < 1e-6);
        assert_eq!((o[1], l[1]), (0.0, f32::NEG_INFINITY));
    }

    fn check_fd(c: &Case, k_pos0: usize, seed: u64) {
        check_fd_dropout(c, k_pos0, seed, None);
    }

    fn check_fd_dropout(c: &Case, k_pos0: usize, seed: u64, dropout: Option<&Dropout<'_>>) {
        let dm = c.dims;
        let mut o = vec![0.0; dm.o_len().unwrap()];
        let mut l = vec![0.0; dm.lse_len().unwrap()];
        attention_fwd(
            &dm, &c.q, &c.k, &c.v, c.q_pos0, k_pos0, c.causal, c.scale, &mut o, &mut l, dropout,
        )
        .unwrap();
        let d_o = Rng::new(seed).vec(o.len());
        let mut dq = vec![0.0; c.q.len()];
        let mut dk = vec![0.0; c.k.len()];
        let mut dvv = vec![0.0; c.v.len()];
        attention_bwd(
            &dm, &c.q, &c.k, &c.v, &o, &l, &d_o, c.q_pos0, k_pos0, c.causal, c.scale, &mut dq,
            &mut dk, &mut dvv, dropout,
        )
        .unwrap();
        let loss = |q: &[f32], k: &[f32], v: &[f32]| {
            let mut o = vec![0.0; dm.o_len().unwrap()];
            let mut l = vec![0.0; dm.lse_len().unwrap()];
            attention_fwd(
                &dm, q, k, v, c.q_pos0, k_pos0, c.causal, c.scale, &mut o, &mut l, dropout,
            )
            .unwrap();
            dot64(&d_o, &o)
        };
        let h = 2e-3;
        let nq = numeric_grad(&c.q, h, |q| loss(q, &c.k, &c.v));
        let nk = numeric_grad(&c.k, h, |k| loss(&c.q, k, &c.v));
        let nv = numeric_grad(&c.v, h, |v| loss(&c.q, &c.k, v));
        assert_grad_close("attn dq", &dq, &nq, 1e-2, 3e-3);
        assert_grad_close("attn dk", &dk, &nk, 1e-2, 3e-3);
        assert_grad_close("attn dv", &dvv, &nv, 1e-2, 3e-3);
    }

    #[test]
    fn backward_matches_finite_differences() {
        // GQA 4:1, causal with queries offset into the sequence
        check_fd(&case(21, dims(1, 5, 6, 4, 1, 3, 2), 1, true), 0, 121);
        // GQA 2:1, non-causal, batch 2
        check_fd(&case(22, dims(2, 3, 4, 4, 2, 3, 3), 0, false), 0, 122);
        // keys span two tiles; queries near the end, block offset k_pos0 = 2
        check_fd(&case(23, dims(1, 3, 70, 2, 1, 3, 2), 67, true), 2, 123);
    }

    /// A fixed pseudo-random mask over (batch row, head, query, key).
    fn mask(b: usize, h: usize, i: usize, j: usize) -> bool {
        let x = (b * 1_000_003 + h * 10_007 + i * 101 + j).wrapping_mul(0x9e37_79b9);
        (x >> 7) % 10 >= 3
    }

    #[test]
    fn dropout_forward_matches_masked_naive_and_backward_matches_finite_differences() {
        let dr = Dropout {
            p: 0.3,
            keep: &mask,
        };
        let c = case(31, dims(2, 5, 70, 4, 2, 3, 2), 65, true);
        let dm = c.dims;
        let mut o = vec![0.0; dm.o_len().unwrap()];
        let mut l = vec![0.0; dm.lse_len().unwrap()];
        attention_fwd(
            &dm,
            &c.q,
            &c.k,
            &c.v,
            c.q_pos0,
            0,
            c.causal,
            c.scale,
            &mut o,
            &mut l,
            Some(&dr),
        )
        .unwrap();
        // The definition in f64: softmax over every visible key, then each kept
        // probability scaled by 1 / (1 - p), dropped ones zero; lse undropped.
        let (_, lse_ref) = naive(&c);
        assert_close("dropout lse", &l, &lse_ref, 1e-5);
        let (sq, sk, hq, hkv, d, dv) = (dm.sq, dm.sk, dm.hq, dm.hkv, dm.d, dm.dv);
        let mut dropped = 0;
        for b in 0..dm.batch {
            for h in 0..hq {
                let g = h / (hq / hkv);
                for i in 0..sq {
                    let qpos = c.q_pos0 + i;
                    let qr = &c.q[((b * sq + i) * hq + h) * d..][..d];
                    let l = lse_ref[(b * hq + h) * sq + i] as f64;
                    for e in 0..dv {
                        let mut acc = 0.0f64;
                        for j in 0..sk.min(qpos + 1) {
                            if !mask(b, h, qpos, j) {
                                dropped += usize::from(e == 0);
                                continue;
                            }
                            let kr = &c.k[((b * sk + j) * hkv + g) * d..][..d];
                            let pij = (c.scale as f64 * dot64(qr, kr) - l).exp() / 0.7;
                            acc += pij * c.v[((b * sk + j) * hkv + g) * dv + e] as f64;
                        }
                        let got = o[((b * sq + i) * hq + h) * dv + e] as f64;
                        assert!(
                            (got - acc).abs() < 1e-4,
                            "b{b} h{h} i{i} e{e}: {got} vs {acc}"
                        );
                    }
                }
            }
        }
        assert!(dropped > 100, "the mask drops entries ({dropped})");
        check_fd_dropout(
            &case(32, dims(1, 5, 6, 4, 1, 3, 2), 1, true),
            0,
            132,
            Some(&dr),
        );
        check_fd_dropout(
            &case(33, dims(1, 3, 70, 2, 1, 3, 2), 67, true),
            2,
            133,
            Some(&dr),
        );
        let bad = Dropout {
            p: 1.0,
            keep: &mask,
        };
        let e = attention_fwd(
            &dm,
            &c.q,
            &c.k,
            &c.v,
            0,
            0,
            true,
            1.0,
            &mut o,
            &mut l,
            Some(&bad),
        );
        assert!(e.is_err());
    }

    #[test]
    fn fast_exp_is_accurate_and_handles_edges() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 97.0 * i as f32 / 200_000.0;
            let r = (x as f64).exp();
            worst = worst.max((fast_exp(x) as f64 - r).abs() / r);
        }
        assert!(worst < 4e-7, "max relative error {worst}");
        assert_eq!(fast_exp(0.0), 1.0);
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp(-1e30), 0.0);
        assert!(fast_exp(f32::NAN).is_nan());
    }

    #[test]
    fn validation_errors() {
        let dm = dims(1, 1, 1, 3, 2, 1, 1);
        let mut o = [0.0; 3];
        let mut l = [0.0; 3];
        assert!(matches!(
            attention_fwd(
                &dm, &[0.0; 3], &[0.0; 2], &[0.0; 2], 0, 0, true, 1.0, &mut o, &mut l, None
            ),
            Err(KernelError::Invalid {
                name: "dims.hkv",
                ..
            })
        ));
        let dm = dims(1, 1, 1, 2, 1, 1, 1);
        assert!(matches!(
            attention_fwd(
                &dm,
                &[0.0; 2],
                &[0.0; 2],
                &[0.0; 1],
                0,
                0,
                true,
                1.0,
                &mut o[..2],
                &mut l[..2],
                None
            ),
            Err(KernelError::Length { name: "k", .. })
        ));
    }
}
