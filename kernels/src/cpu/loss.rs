//! Cross-entropy over logits that may be sharded along the vocabulary.
//!
//! Each rank holds `logits [rows, v_local]` for global vocabulary ids
//! `[vocab_start, vocab_start + v_local)`. The executor combines the pieces:
//!
//! 1. `ce_row_max` locally, AllReduce(max) -> `global_max`;
//! 2. `ce_row_sumexp(.., global_max)` and `ce_target_logit` locally,
//!    AllReduce(sum) each -> `global_sumexp`, `global_target`;
//! 3. `ce_loss` gives the per-row loss `max + ln(sumexp) - target`;
//! 4. `ce_bwd` gives each shard its slice of `softmax - onehot`.
//!
//! With one shard (`vocab_start = 0`, `v_local = vocab`) no communication is
//! needed and this is ordinary cross-entropy.

#![allow(clippy::too_many_arguments)]

use super::{check_len, lanes_max, par_rows, prod, splitmix, KernelError, LANES};

fn check_logits(logits: &[f32], rows: usize, v_local: usize) -> Result<(), KernelError> {
    check_len("logits", logits.len(), prod("logits", &[rows, v_local])?)
}

/// Local maximum of each row of `logits [rows, v_local]` into `max [rows]`
/// (`-inf` for an empty shard).
pub fn ce_row_max(
    logits: &[f32],
    rows: usize,
    v_local: usize,
    max: &mut [f32],
) -> Result<(), KernelError> {
    check_logits(logits, rows, v_local)?;
    check_len("max", max.len(), rows)?;
    par_rows(max, 1, |r0, max| {
        for (i, mx) in max.iter_mut().enumerate() {
            let r = r0 + i;
            *mx = lane_max(&logits[r * v_local..(r + 1) * v_local]);
        }
    });
    Ok(())
}

/// `sumexp[r] = sum_j exp(logits[r, j] - global_max[r])` over this shard.
pub fn ce_row_sumexp(
    logits: &[f32],
    rows: usize,
    v_local: usize,
    global_max: &[f32],
    sumexp: &mut [f32],
) -> Result<(), KernelError> {
    check_logits(logits, rows, v_local)?;
    check_len("global_max", global_max.len(), rows)?;
    check_len("sumexp", sumexp.len(), rows)?;
    par_rows(sumexp, 1, |r0, sumexp| {
        for (i, s) in sumexp.iter_mut().enumerate() {
            let r = r0 + i;
            let m = global_max[r];
            *s = logits[r * v_local..(r + 1) * v_local]
                .iter()
                .map(|&x| (x - m).exp())
                .sum();
        }
    });
    Ok(())
}

/// `target[r] = logits[r, labels[r] - vocab_start]` when this shard owns the
/// label, else 0 (so the sum over shards is the target logit).
pub fn ce_target_logit(
    logits: &[f32],
    labels: &[u32],
    rows: usize,
    v_local: usize,
    vocab_start: usize,
    target: &mut [f32],
) -> Result<(), KernelError> {
    check_logits(logits, rows, v_local)?;
    check_len("labels", labels.len(), rows)?;
    check_len("target", target.len(), rows)?;
    for r in 0..rows {
        target[r] = match local(labels[r], vocab_start, v_local) {
            Some(c) => logits[r * v_local + c],
            None => 0.0,
        };
    }
    Ok(())
}

fn local(label: u32, vocab_start: usize, v_local: usize) -> Option<usize> {
    (label as usize)
        .checked_sub(vocab_start)
        .filter(|&c| c < v_local)
}

/// Per-row loss from the reduced pieces:
/// `loss[r] = global_max[r] + ln(global_sumexp[r]) - global_target[r]`.
pub fn ce_loss(
    global_max: &[f32],
    global_sumexp: &[f32],
    global_target: &[f32],
    loss: &mut [f32],
) -> Result<(), KernelError> {
    let rows = loss.len();
    check_len("global_max", global_max.len(), rows)?;
    check_len("global_sumexp", global_sumexp.len(), rows)?;
    check_len("global_target", global_target.len(), rows)?;
    for r in 0..rows {
        loss[r] = global_max[r] + global_sumexp[r].ln() - global_target[r];
    }
    Ok(())
}

/// Gradient of `scale * sum_r loss[r]` w.r.t. this shard's logits,
/// accumulated into `dlogits [rows, v_local]`:
/// `dlogits[r, j] += scale * (exp(logits[r, j] - max[r]) / sumexp[r] - [j is the label])`.
/// `scale` is typically `1 / tokens` for a mean loss.
pub fn ce_bwd(
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
    check_logits(logits, rows, v_local)?;
    check_len("global_max", global_max.len(), rows)?;
    check_len("global_sumexp", global_sumexp.len(), rows)?;
    check_len("labels", labels.len(), rows)?;
    check_len("dlogits", dlogits.len(), logits.len())?;
    if v_local == 0 {
        return Ok(());
    }
    par_rows(dlogits, v_local, |r0, dlogits| {
        for (i, dr) in dlogits.chunks_exact_mut(v_local).enumerate() {
            let r = r0 + i;
            let (m, inv) = (global_max[r], 1.0 / global_sumexp[r]);
            let lr = &logits[r * v_local..(r + 1) * v_local];
            for (d, &x) in dr.iter_mut().zip(lr) {
                *d += scale * ((x - m).exp() * inv);
            }
            if let Some(c) = local(labels[r], vocab_start, v_local) {
                dr[c] -= scale;
            }
        }
    });
    Ok(())
}

/// The whole cross-entropy of one shard holding every column (no vocabulary
/// split), forward and backward in one pass over each row: `loss [rows]` and
/// `dlogits = scale * (softmax - onehot)`, both overwritten. Bit for bit what
/// [`ce_row_max`], [`ce_row_sumexp`], [`ce_target_logit`], [`ce_loss`] and
/// [`ce_bwd`] into zeros give (the same sums in the same order), with each
/// `exp` computed once instead of twice and the row maxima taken over lanes
/// (a maximum does not depend on the order).
pub fn cross_entropy(
    logits: &[f32],
    labels: &[u32],
    rows: usize,
    v_local: usize,
    vocab_start: usize,
    scale: f32,
    loss: &mut [f32],
    dlogits: &mut [f32],
) -> Result<(), KernelError> {
    check_logits(logits, rows, v_local)?;
    check_len("labels", labels.len(), rows)?;
    check_len("loss", loss.len(), rows)?;
    check_len("dlogits", dlogits.len(), logits.len())?;
    if v_local == 0 {
        // Every row's sum is empty: `ce_loss` of a zero sum.
        return ce_loss(
            &vec![f32::NEG_INFINITY; rows],
            &vec![0.0; rows],
            &vec![0.0; rows],
            loss,
        );
    }
    let row = |r: usize, l: &mut f32, dr: &mut [f32]| {
        let x = &logits[r * v_local..(r + 1) * v_local];
        let m = lane_max(x);
        // The sum in `ce_row_sumexp`'s order, its additions overlapping the
        // next `exp`s (no exp is -0, so the sum's first term is exact either way).
        let mut sumexp = 0.0f32;
        for (d, &xi) in dr.iter_mut().zip(x) {
            *d = (xi - m).exp();
            sumexp += *d;
        }
        let inv = 1.0 / sumexp;
        // `0.0 +`: `ce_bwd` adds into zeros, which turns a -0 into +0.
        for d in dr.iter_mut() {
            *d = 0.0 + scale * (*d * inv);
        }
        let target = match local(labels[r], vocab_start, v_local) {
            Some(c) => {
                dr[c] -= scale;
                x[c]
            }
            None => 0.0,
        };
        *l = m + sumexp.ln() - target;
    };
    if super::intra_op_threads() <= 1 || rows < 2 {
        for (r, (l, dr)) in loss
            .iter_mut()
            .zip(dlogits.chunks_exact_mut(v_local))
            .enumerate()
        {
            row(r, l, dr);
        }
        return Ok(());
    }
    use rayon::prelude::*;
    loss.par_iter_mut()
        .zip(dlogits.par_chunks_exact_mut(v_local))
        .enumerate()
        .for_each(|(r, (l, dr))| row(r, l, dr));
    Ok(())
}

/// The largest of `xs` (`-inf` when empty), as `f32::max` folded in order gives
/// it, but over [`LANES`] independent lanes that the compiler vectorises.
fn lane_max(xs: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (mi, &x) in m.iter_mut().zip(c) {
            *mi = mi.max(x);
        }
    }
    for (mi, &x) in m.iter_mut().zip(chunks.remainder()) {
        *mi = mi.max(x);
    }
    lanes_max(m)
}

/// Sizes of [`argmax_parts`]: `rows` rows of logits split by columns into `parts`
/// shards of `cols` each, laid out `[parts, rows, cols]` (a tensor group's shards
/// gathered in group order), of which the first `limit` global columns count (the
/// rest pad the vocabulary).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Picks {
    /// Shards of a row.
    pub parts: usize,
    /// Rows.
    pub rows: usize,
    /// Columns of a shard.
    pub cols: usize,
    /// Global columns that count, `1..=parts * cols`.
    pub limit: usize,
}

impl Picks {
    /// Row `r`'s global columns that count, in order: shard by shard, each
    /// shard's row in place.
    fn row(self, x: &[f32], r: usize) -> impl Iterator<Item = &f32> {
        let part = move |p: usize| &x[(p * self.rows + r) * self.cols..][..self.cols];
        (0..self.parts).flat_map(part).take(self.limit)
    }
}

/// Whether `len` values hold `d`'s shards and its limit is among their columns.
pub fn check_picks(len: usize, d: Picks) -> Result<(), KernelError> {
    check_len("x", len, prod("x", &[d.parts, d.rows, d.cols])?)?;
    if d.limit == 0 || d.limit > d.parts * d.cols {
        return Err(KernelError::Invalid {
            name: "limit",
            reason: format!("{} columns of {} x {}", d.limit, d.parts, d.cols),
        });
    }
    Ok(())
}

/// Greedy decoding's pick of each row: the global column of its largest logit,
/// the first of equal ones, as a left-to-right scan finds it (a NaN never wins;
/// a row whose first logit is NaN picks 0).
pub fn argmax_parts(x: &[f32], d: Picks) -> Result<Vec<u32>, KernelError> {
    check_picks(x.len(), d)?;
    let pick = |r: usize| {
        let mut cols = d.row(x, r).enumerate();
        let Some((_, &first)) = cols.next() else {
            return 0;
        };
        let (mut best, mut top) = (0, first);
        for (g, &v) in cols {
            if v > top {
                (best, top) = (g, v);
            }
        }
        best as u32
    };
    Ok((0..d.rows).map(pick).collect())
}

/// Temperature and nucleus (top-p) sampling: the softmax temperature (> 0), the
/// nucleus mass in (0, 1], and the generator's seed and the generation step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Nucleus {
    /// Softmax temperature, > 0.
    pub temperature: f32,
    /// Nucleus mass, in (0, 1].
    pub top_p: f32,
    /// Seed of the draws.
    pub seed: u64,
    /// Generation step (0: the first token).
    pub step: u64,
}

/// Whether `s` is a draw [`sample_parts`] can make, on any device: a finite
/// positive temperature and a nucleus in (0, 1].
pub fn check_nucleus(s: Nucleus) -> Result<(), KernelError> {
    if s.temperature > 0.0 && s.temperature.is_finite() && s.top_p > 0.0 && s.top_p <= 1.0 {
        return Ok(());
    }
    Err(KernelError::Invalid {
        name: "nucleus",
        reason: format!("temperature {} and top_p {}", s.temperature, s.top_p),
    })
}

/// A token's weight in [`sample_parts`] is `exp((x - max) / T)` in units of
/// `2^-40`: integers, so that sums are exact in any order, on any device.
pub const WEIGHT_ONE: f64 = (1u64 << 40) as f64;

/// The uniform in [0, 1) that `request` draws at `step` (SplitMix64 of the three).
pub fn sample_uniform(seed: u64, request: u64, step: u64) -> f64 {
    let k = splitmix(seed ^ splitmix(request.wrapping_mul(0x9e37_79b9).wrapping_add(step)));
    (k >> 11) as f64 / (1u64 << 53) as f64
}

/// A logit's weight: `round(exp((x - max) / t) * 2^40)`, 0 for a NaN.
fn weight(x: f32, max: f32, t: f64) -> u64 {
    if x.is_nan() {
        return 0;
    }
    (((f64::from(x) - f64::from(max)) / t).exp() * WEIGHT_ONE).round() as u64
}

/// The largest of the weights `q` with `S(>= w) >= need` (`S(>= w)`: the sum of
/// the weights at least `w`; `need` at most their total), and `S(> w)`: a radix
/// select from the top digit of 8 bits down (the largest weight, 2^40, has bit
/// 40), keeping the largest digit whose weights, with every heavier one, still
/// reach `need`. The CUDA kernel selects alike.
fn select_weight(q: &[u64], need: u64) -> (u64, u64) {
    let (mut prefix, mut above) = (0u64, 0u64);
    for shift in (0..=40).rev().step_by(8) {
        let mut hist = [0u64; 256];
        for &w in q {
            if w >> (shift + 8) == prefix {
                hist[((w >> shift) & 255) as usize] += w;
            }
        }
        let mut d = 255;
        while d > 0 && above + hist[d] < need {
            above += hist[d];
            d -= 1;
        }
        prefix = (prefix << 8) | d as u64;
    }
    (prefix, above)
}

/// Samples each row of logits laid out as for [`argmax_parts`], row `r` drawing
/// for request `requests[r]`. Every token weighs [`weight`] (integers, so every
/// device sums them alike); in order of decreasing weight, equal ones by column,
/// the nucleus is the shortest prefix whose weight reaches `ceil(top_p * Z)` of
/// the row's total `Z`, and the token is the first whose running weight exceeds
/// `floor(u * mass)` of the nucleus's `mass`, `u` the request's
/// [`sample_uniform`]. Both are found without sorting ([`select_weight`]). A row
/// whose largest logit (NaNs aside) is infinite picks the first column holding
/// it, and a row of NaNs column 0.
pub fn sample_parts(
    x: &[f32],
    d: Picks,
    s: Nucleus,
    requests: &[u32],
) -> Result<Vec<u32>, KernelError> {
    check_picks(x.len(), d)?;
    check_nucleus(s)?;
    check_len("requests", requests.len(), d.rows)?;
    let t = f64::from(s.temperature);
    let pick = |r: usize| {
        let row: Vec<f32> = d.row(x, r).copied().collect();
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        if !max.is_finite() {
            return row.iter().position(|&v| v == max).unwrap_or(0) as u32;
        }
        let q: Vec<u64> = row.iter().map(|&v| weight(v, max, t)).collect();
        let z: u64 = q.iter().sum();
        let need = ((f64::from(s.top_p) * z as f64).ceil() as u64).clamp(1, z);
        // The nucleus: every weight above w1, then the first k columns of weight w1.
        let (w1, above1) = select_weight(&q, need);
        let mass = above1 + (need - above1).div_ceil(w1) * w1;
        let u = sample_uniform(s.seed, u64::from(requests[r]), s.step);
        let at = ((u * mass as f64) as u64).min(mass - 1);
        // The token: the first whose running weight exceeds `at`, the j-th column of
        // weight w2 (w2 >= w1, and within the nucleus where w2 == w1).
        let (w2, above2) = select_weight(&q, at + 1);
        let j = ((at - above2) / w2) as usize;
        let token = q.iter().enumerate().filter(|&(_, &w)| w == w2).nth(j);
        token.map_or(0, |(g, _)| g as u32)
    };
    Ok((0..d.rows).map(pick).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, assert_grad_close, numeric_grad, Rng};

    /// Unsharded loss vector, composed from the pieces.
    fn ce_full(
        logits: &[f32],
        labels: &[u32],
        rows: usize,
        v: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut m = vec![0.0; rows];
        let mut s = vec![0.0; rows];
        let mut t = vec![0.0; rows];
        let mut loss = vec![0.0; rows];
        ce_row_max(logits, rows, v, &mut m).unwrap();
        ce_row_sumexp(logits, rows, v, &m, &mut s).unwrap();
        ce_target_logit(logits, labels, rows, v, 0, &mut t).unwrap();
        ce_loss(&m, &s, &t, &mut loss).unwrap();
        (loss, m, s)
    }

    /// The fused whole cross-entropy against the five kernels it replaces, bit
    /// for bit: on one thread and on a pool of two, with labels inside and
    /// outside the shard, ties, a `-0.0` scale product and large logits.
    #[test]
    fn fused_cross_entropy_equals_the_composed_kernels_bit_for_bit() {
        let mut rng = Rng::new(43);
        for (rows, v, start) in [(1, 1, 0), (5, 17, 0), (33, 40, 3), (64, 300, 0)] {
            let mut logits: Vec<f32> = rng.vec(rows * v).iter().map(|x| 30.0 * x).collect();
            logits[0] = 0.0;
            if v > 2 {
                logits[1] = logits[2]; // a tie for the maximum somewhere
            }
            let labels: Vec<u32> = (0..rows)
                .map(|_| rng.below((v + 2 * start) as u64) as u32)
                .collect();
            for scale in [1.0 / rows as f32, 0.5, -0.25] {
                let composed = || {
                    let (mut m, mut se, mut t) =
                        (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
                    let mut loss = vec![0.0; rows];
                    let mut d = vec![0.0; rows * v];
                    ce_row_max(&logits, rows, v, &mut m).unwrap();
                    ce_row_sumexp(&logits, rows, v, &m, &mut se).unwrap();
                    ce_target_logit(&logits, &labels, rows, v, start, &mut t).unwrap();
                    ce_loss(&m, &se, &t, &mut loss).unwrap();
                    ce_bwd(&logits, rows, v, &m, &se, &labels, start, scale, &mut d).unwrap();
                    (loss, d)
                };
                let fused = || {
                    let mut loss = vec![7.0; rows];
                    let mut d = vec![7.0; rows * v];
                    cross_entropy(&logits, &labels, rows, v, start, scale, &mut loss, &mut d)
                        .unwrap();
                    (loss, d)
                };
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                let (want_loss, want_d) = composed();
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(2)
                    .build()
                    .unwrap();
                for (loss, d) in [fused(), pool.install(fused)] {
                    assert_eq!(
                        bits(&loss),
                        bits(&want_loss),
                        "loss, {rows}x{v} scale {scale}"
                    );
                    assert_eq!(bits(&d), bits(&want_d), "dlogits, {rows}x{v} scale {scale}");
                }
            }
        }
    }

    #[test]
    fn three_class_example_by_hand() {
        // logits [1, 2, 3], label 0: loss = ln(e + e^2 + e^3) - 1 = 2.4076059
        let (loss, m, s) = ce_full(&[1.0, 2.0, 3.0], &[0], 1, 3);
        assert!((loss[0] - 2.407_606).abs() < 1e-6, "{}", loss[0]);
        let mut d = [0.0; 3];
        ce_bwd(&[1.0, 2.0, 3.0], 1, 3, &m, &s, &[0], 0, 1.0, &mut d).unwrap();
        // softmax = [0.09003057, 0.24472847, 0.66524096]
        assert_close(
            "ce grad",
            &d,
            &[0.090_030_57 - 1.0, 0.244_728_47, 0.665_240_96],
            1e-6,
        );
    }

    #[test]
    fn unsharded_gradient_matches_finite_differences() {
        let mut rng = Rng::new(41);
        let (rows, v) = (4, 7);
        let logits: Vec<f32> = rng.vec(rows * v).iter().map(|x| 3.0 * x).collect();
        let labels: Vec<u32> = (0..rows).map(|_| rng.below(v as u64) as u32).collect();
        let scale = 1.0 / rows as f32;
        let (_, m, s) = ce_full(&logits, &labels, rows, v);
        let mut d = vec![0.0; rows * v];
        ce_bwd(&logits, rows, v, &m, &s, &labels, 0, scale, &mut d).unwrap();
        let n = numeric_grad(&logits, 2e-3, |x| {
            let (loss, _, _) = ce_full(x, &labels, rows, v);
            loss.iter().map(|&l| l as f64).sum::<f64>() * scale as f64
        });
        assert_grad_close("ce dlogits", &d, &n, 1e-2, 2e-3);
        // each row's gradient sums to zero (softmax sums to one)
        for r in 0..rows {
            assert!(d[r * v..(r + 1) * v].iter().sum::<f32>().abs() < 1e-6);
        }
    }

    #[test]
    fn two_shards_match_unsharded_loss_and_gradient() {
        let mut rng = Rng::new(42);
        let (rows, v, split) = (6, 11, 4);
        let logits: Vec<f32> = rng.vec(rows * v).iter().map(|x| 5.0 * x).collect();
        let labels: Vec<u32> = (0..rows)
            .map(|r| {
                if r < 3 {
                    r as u32
                } else {
                    (v - 1 - r) as u32 + 3
                }
            })
            .collect();
        assert!(
            labels.iter().any(|&l| (l as usize) < split)
                && labels.iter().any(|&l| l as usize >= split)
        );
        let (loss_full, m_full, s_full) = ce_full(&logits, &labels, rows, v);
        let mut d_full = vec![0.0; rows * v];
        ce_bwd(
            &logits,
            rows,
            v,
            &m_full,
            &s_full,
            &labels,
            0,
            0.5,
            &mut d_full,
        )
        .unwrap();

        let shard = |lo: usize, hi: usize| -> Vec<f32> {
            (0..rows)
                .flat_map(|r| logits[r * v + lo..r * v + hi].iter().copied())
                .collect()
        };
        let shards = [(0usize, shard(0, split)), (split, shard(split, v))];
        let width = |s: usize| if s == 0 { split } else { v - split };
        // step 1: max, reduced by hand
        let mut gmax = vec![f32::NEG_INFINITY; rows];
        for (start, lg) in &shards {
            let mut m = vec![0.0; rows];
            ce_row_max(lg, rows, width(*start), &mut m).unwrap();
            for r in 0..rows {
                gmax[r] = gmax[r].max(m[r]);
            }
        }
        // step 2: sumexp and target, summed by hand
        let mut gsum = vec![0.0; rows];
        let mut gtgt = vec![0.0; rows];
        for (start, lg) in &shards {
            let mut s = vec![0.0; rows];
            let mut t = vec![0.0; rows];
            ce_row_sumexp(lg, rows, width(*start), &gmax, &mut s).unwrap();
            ce_target_logit(lg, &labels, rows, width(*start), *start, &mut t).unwrap();
            for r in 0..rows {
                gsum[r] += s[r];
                gtgt[r] += t[r];
            }
        }
        let mut loss = vec![0.0; rows];
        ce_loss(&gmax, &gsum, &gtgt, &mut loss).unwrap();
        assert_close("sharded loss", &loss, &loss_full, 1e-6);
        for (start, lg) in &shards {
            let w = width(*start);
            let mut d = vec![0.0; rows * w];
            ce_bwd(lg, rows, w, &gmax, &gsum, &labels, *start, 0.5, &mut d).unwrap();
            for r in 0..rows {
                assert_close(
                    "sharded grad",
                    &d[r * w..(r + 1) * w],
                    &d_full[r * v + start..r * v + start + w],
                    1e-6,
                );
            }
        }
    }

    #[test]
    fn stable_for_large_logits_and_validates() {
        let (loss, _, _) = ce_full(&[1000.0, 0.0], &[0], 1, 2);
        assert!(loss[0].is_finite() && loss[0].abs() < 1e-6);
        let mut m = [0.0; 2];
        assert!(ce_row_max(&[0.0; 5], 2, 3, &mut m).is_err());
        assert!(ce_loss(&[0.0], &[1.0, 1.0], &[0.0], &mut [0.0]).is_err());
    }

    #[test]
    fn argmax_reads_a_row_across_its_shards() {
        // Two rows of 6 columns in 2 shards of 3, the last column padding:
        // row 0 = [1, 5, 2 | 5, 0, 9], row 1 = [NaN, 7, 1 | 2, 3, -1].
        let x = [
            1.0,
            5.0,
            2.0, // shard 0, row 0
            f32::NAN,
            7.0,
            1.0, // shard 0, row 1
            5.0,
            0.0,
            9.0, // shard 1, row 0
            2.0,
            3.0,
            -1.0, // shard 1, row 1
        ];
        let d = Picks {
            parts: 2,
            rows: 2,
            cols: 3,
            limit: 5,
        };
        // Row 0: 9 is padding; the first 5 (column 1) wins the tie with column 3.
        // Row 1: no logit compares greater than a NaN first one: 0.
        assert_eq!(argmax_parts(&x, d).unwrap(), [1, 0]);
        assert_eq!(argmax_parts(&x, Picks { limit: 6, ..d }).unwrap(), [5, 0]);
        // A NaN past the first never wins.
        let y = [0.0, f32::NAN, -1.0, 0.5];
        let one = Picks {
            parts: 1,
            rows: 1,
            cols: 4,
            limit: 4,
        };
        assert_eq!(argmax_parts(&y, one).unwrap(), [3]);
        let all_low = [f32::NEG_INFINITY; 4];
        assert_eq!(argmax_parts(&all_low, one).unwrap(), [0]);
        assert!(argmax_parts(&y, Picks { limit: 0, ..one }).is_err());
        assert!(argmax_parts(&y, Picks { limit: 5, ..one }).is_err());
        assert!(argmax_parts(&y[..3], one).is_err());
    }

    /// Draws of `n` requests (0..n) at `step` from one row.
    fn draws(row: &[f32], top_p: f32, seed: u64, step: u64, n: u32) -> Vec<u32> {
        let d = Picks {
            parts: 1,
            rows: 1,
            cols: row.len(),
            limit: row.len(),
        };
        let s = Nucleus {
            temperature: 1.0,
            top_p,
            seed,
            step,
        };
        (0..n)
            .map(|r| sample_parts(row, d, s, &[r]).unwrap()[0])
            .collect()
    }

    #[test]
    fn equal_logits_split_the_draw_by_the_nucleus() {
        // Four equal logits weigh 2^40 each (exp(0) = 1). top_p 1: Z = 2^42, the
        // nucleus is all four, and the token is floor(u * 4). top_p 0.5: need = 2^41,
        // the nucleus is columns 0 and 1 (equal weights by column), token floor(u * 2).
        let n = 64;
        let u: Vec<f64> = (0..n).map(|r| sample_uniform(7, r as u64, 3)).collect();
        let want = |k: f64| u.iter().map(|u| (u * k) as u32).collect::<Vec<_>>();
        assert_eq!(draws(&[0.0; 4], 1.0, 7, 3, n), want(4.0));
        assert_eq!(draws(&[0.0; 4], 0.5, 7, 3, n), want(2.0));
        // Shards of 2 and a padding column: three equal columns count, floor(u * 3).
        let x = [0.0, 0.0, 0.0, 9.0];
        let d = Picks {
            parts: 2,
            rows: 1,
            cols: 2,
            limit: 3,
        };
        let s = Nucleus {
            temperature: 0.7,
            top_p: 1.0,
            seed: 7,
            step: 3,
        };
        let three: Vec<u32> = (0..n)
            .map(|r| sample_parts(&x, d, s, &[r]).unwrap()[0])
            .collect();
        assert_eq!(three, want(3.0));
        assert!(three.contains(&2) && !three.contains(&3));
    }

    #[test]
    fn the_nucleus_keeps_the_heaviest_and_never_a_nan() {
        // Weights 2^40 and 2^40 e^-10: top_p 0.5 needs less than column 1 holds.
        assert!(draws(&[0.0, 10.0], 0.5, 1, 0, 50).iter().all(|&t| t == 1));
        assert!(draws(&[f32::NAN, 0.0, f32::NAN], 1.0, 1, 0, 50)
            .iter()
            .all(|&t| t == 1));
        // No finite largest logit: its first column, or 0 for a row of NaNs.
        assert_eq!(
            draws(&[1.0, f32::INFINITY, f32::INFINITY], 1.0, 1, 0, 1),
            [1]
        );
        assert_eq!(draws(&[f32::NEG_INFINITY; 3], 1.0, 1, 0, 1), [0]);
        assert_eq!(draws(&[f32::NAN; 3], 1.0, 1, 0, 1), [0]);
        let one = Picks {
            parts: 1,
            rows: 1,
            cols: 2,
            limit: 2,
        };
        let s = Nucleus {
            temperature: 1.0,
            top_p: 1.0,
            seed: 0,
            step: 0,
        };
        for bad in [
            Nucleus {
                temperature: 0.0,
                ..s
            },
            Nucleus { top_p: 0.0, ..s },
            Nucleus { top_p: 1.5, ..s },
        ] {
            assert!(
                sample_parts(&[0.0, 1.0], one, bad, &[0]).is_err(),
                "{bad:?}"
            );
        }
        assert!(sample_parts(&[0.0, 1.0], one, s, &[]).is_err());
    }

    #[test]
    fn frequencies_follow_the_softmax_within_the_nucleus() {
        // p = softmax([0, ln 2, ln 3]) = [1/6, 2/6, 3/6].
        let row = [0.0, 2f32.ln(), 3f32.ln()];
        let n = 30_000u64;
        let count = |top_p: f32, seed: u64| {
            let mut c = [0usize; 3];
            for step in 0..n {
                c[draws(&row, top_p, seed, step, 1)[0] as usize] += 1;
            }
            c.map(|k| k as f64 / n as f64)
        };
        let within = |got: f64, want: f64| {
            // Five standard deviations of a binomial proportion.
            let sd = (want * (1.0 - want) / n as f64).sqrt();
            assert!((got - want).abs() < 5.0 * sd, "{got} vs {want}");
        };
        for (got, want) in count(1.0, 5).iter().zip([1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0]) {
            within(*got, want);
        }
        // top_p 0.75 keeps 3/6 + 2/6: renormalised, 2/5 and 3/5, never column 0.
        let c = count(0.75, 5);
        assert_eq!(c[0], 0.0);
        within(c[2], 0.6);
        // The same seed draws the same tokens; another does not.
        assert_eq!(draws(&row, 1.0, 1, 4, 64), draws(&row, 1.0, 1, 4, 64));
        assert_ne!(draws(&row, 1.0, 1, 4, 64), draws(&row, 1.0, 2, 4, 64));
    }

    #[test]
    fn selecting_draws_what_sorting_draws() {
        // The definition, walked in sorted order, on rows of ties (a coarse grid)
        // and of distinct values, over temperatures, nuclei and steps.
        fn sorted_walk(row: &[f32], s: Nucleus, request: u32) -> u32 {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let q: Vec<u64> = row
                .iter()
                .map(|&v| weight(v, max, f64::from(s.temperature)))
                .collect();
            let mut order: Vec<usize> = (0..q.len()).collect();
            order.sort_by(|&a, &b| q[b].cmp(&q[a]).then(a.cmp(&b)));
            let z: u64 = q.iter().sum();
            let need = ((f64::from(s.top_p) * z as f64).ceil() as u64).clamp(1, z);
            let (mut mass, mut kept) = (0, 0);
            while mass < need {
                mass += q[order[kept]];
                kept += 1;
            }
            let u = sample_uniform(s.seed, u64::from(request), s.step);
            let at = ((u * mass as f64) as u64).min(mass - 1);
            let mut acc = 0;
            let g = order[..kept].iter().find(|&&g| {
                acc += q[g];
                acc > at
            });
            *g.unwrap() as u32
        }
        let mut rng = Rng::new(41);
        for (cols, grid) in [(7, 1.0), (300, 2.0), (5000, 0.0), (64, 0.0)] {
            let row: Vec<f32> = rng
                .vec(cols)
                .iter()
                .map(|&v| {
                    if grid > 0.0 {
                        (grid * 3.0 * v).round()
                    } else {
                        6.0 * v
                    }
                })
                .collect();
            let d = Picks {
                parts: 1,
                rows: 1,
                cols,
                limit: cols,
            };
            for (temperature, top_p) in [(1.0, 1.0), (0.5, 0.9), (2.0, 0.3), (0.05, 0.99)] {
                for step in 0..40 {
                    let s = Nucleus {
                        temperature,
                        top_p,
                        seed: 3,
                        step,
                    };
                    let got = sample_parts(&row, d, s, &[step as u32]).unwrap()[0];
                    assert_eq!(got, sorted_walk(&row, s, step as u32), "{cols} {s:?}");
                }
            }
        }
    }
}
