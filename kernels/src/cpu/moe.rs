//! Mixture-of-experts routing, dispatch and combine.
//!
//! Routing: `probs = softmax(logits)` over **all** experts, then the top `k`
//! experts per token by logit (ties broken towards the lower expert index,
//! selected experts listed in descending order). The routing weights are
//! either the selected probabilities renormalised to sum to one
//! (`renormalize = true`; Mixtral / Qwen-MoE `norm_topk_prob`, equal to a
//! softmax over the selected logits only) or the raw probabilities
//! (`renormalize = false`; Switch / GShard style). Note that with
//! `renormalize` and `k = 1` every weight is 1 (exactly) and the router receives
//! no gradient through the weights (exactly none).
//!
//! Dispatch sorts the `tokens * k` assignments by expert (stable, so token
//! order is kept within an expert) and gathers the token rows in that order;
//! `perm[slot]` is the assignment index `t * k + j` the slot came from and
//! `counts[e]` the number of slots of expert `e` (the All-to-All split sizes
//! for expert parallelism). Combine scatters the expert outputs back to token
//! order, weighted by the routing weights.

#![allow(clippy::too_many_arguments)]

use super::{check_len, invalid, prod, KernelError};

/// Sizes of one routed-experts call: `tokens` rows of width `dim`, each routed to
/// `k` of `experts` experts, weights renormalised over the chosen `k` or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeDims {
    /// Token rows.
    pub tokens: usize,
    /// Experts routed over.
    pub experts: usize,
    /// Experts per token.
    pub k: usize,
    /// Row width (hidden size).
    pub dim: usize,
    /// Whether the chosen experts' weights sum to one.
    pub renormalize: bool,
}

/// Marks a row of [`gather_rows`]'s index list as zeros.
pub const NO_ROW: u32 = u32::MAX;

/// `out[r] = src[idx[r]]`, rows of width `dim`, zeros where `idx[r]` is
/// [`NO_ROW`]: the row moves of expert parallelism (padding to capacity, and
/// source-major to expert-major order and back).
pub fn gather_rows(
    src: &[f32],
    idx: &[u32],
    dim: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_len("out", out.len(), prod("out", &[idx.len(), dim])?)?;
    let rows = src.len() / dim.max(1);
    for (r, &i) in idx.iter().enumerate() {
        let o = &mut out[r * dim..(r + 1) * dim];
        if i == NO_ROW {
            o.fill(0.0);
        } else if (i as usize) < rows {
            let i = i as usize;
            o.copy_from_slice(&src[i * dim..(i + 1) * dim]);
        } else {
            return Err(invalid(
                "idx",
                format!("row {i} of a source of {rows} rows"),
            ));
        }
    }
    Ok(())
}

fn check_route(tokens: usize, experts: usize, k: usize) -> Result<(usize, usize), KernelError> {
    if k == 0 || k > experts {
        return Err(invalid("k", format!("must be in 1..={experts}, got {k}")));
    }
    Ok((
        prod("logits", &[tokens, experts])?,
        prod("expert_idx", &[tokens, k])?,
    ))
}

/// Router forward for `logits [tokens, experts]`. Writes
/// `probs [tokens, experts]` (softmax over all experts, saved for the
/// backward), `expert_idx [tokens, k]` and `weights [tokens, k]`.
/// NaN logits are rejected because they make the top-k order meaningless.
pub fn moe_route_fwd(
    logits: &[f32],
    tokens: usize,
    experts: usize,
    k: usize,
    renormalize: bool,
    probs: &mut [f32],
    expert_idx: &mut [u32],
    weights: &mut [f32],
) -> Result<(), KernelError> {
    let (nl, nk) = check_route(tokens, experts, k)?;
    check_len("logits", logits.len(), nl)?;
    check_len("probs", probs.len(), nl)?;
    check_len("expert_idx", expert_idx.len(), nk)?;
    check_len("weights", weights.len(), nk)?;
    if experts > u32::MAX as usize {
        return Err(invalid("experts", "does not fit in u32"));
    }
    if logits.iter().any(|x| x.is_nan()) {
        return Err(invalid("logits", "contains NaN"));
    }
    let mut taken = vec![false; experts];
    for t in 0..tokens {
        let lr = &logits[t * experts..(t + 1) * experts];
        let pr = &mut probs[t * experts..(t + 1) * experts];
        let mx = lr.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut z = 0.0f32;
        for (p, &l) in pr.iter_mut().zip(lr) {
            *p = (l - mx).exp();
            z += *p;
        }
        let inv = 1.0 / z;
        for p in pr.iter_mut() {
            *p *= inv;
        }
        taken.fill(false);
        let idx = &mut expert_idx[t * k..(t + 1) * k];
        let w = &mut weights[t * k..(t + 1) * k];
        let mut sel_sum = 0.0f32;
        for j in 0..k {
            // strict `>` keeps the lowest index among equal logits
            let mut best: Option<usize> = None;
            for e in 0..experts {
                if !taken[e] && best.is_none_or(|b| lr[e] > lr[b]) {
                    best = Some(e);
                }
            }
            // `check_route` keeps k <= experts, so an untaken expert always remains.
            let Some(e) = best else {
                return Err(invalid("k", "exceeds the number of experts"));
            };
            taken[e] = true;
            idx[j] = e as u32;
            w[j] = pr[e];
            sel_sum += pr[e];
        }
        if renormalize {
            let inv = 1.0 / sel_sum;
            for x in w.iter_mut() {
                *x *= inv;
            }
            // One expert's weight is 1 exactly: `p * (1 / p)` can round below it,
            // and the backward's `w (dw - w dw)` would hand the router rounding
            // noise where its gradient is zero, which AdamW scales up to a full
            // step of random sign.
            if k == 1 {
                w[0] = 1.0;
            }
        }
    }
    Ok(())
}

/// Router backward: accumulates into `d_logits [tokens, experts]` the
/// gradient of the routing weights' loss given `d_weights [tokens, k]`, using
/// `probs`, `expert_idx`, `weights` saved by [`moe_route_fwd`] with the same
/// `renormalize`. The top-k selection itself is piecewise constant and has
/// no gradient.
///
/// - renormalised: `d_logit[e_j] += w_j (dw_j - sum_i w_i dw_i)`, other
///   experts get nothing (the weights depend only on the selected logits);
/// - raw: `d_logit[e] += p_e (dp_e - sum_j w_j dw_j)` with `dp_e = dw_j` for
///   the selected `e = e_j`, 0 otherwise.
pub fn moe_route_bwd(
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
    let (nl, nk) = check_route(tokens, experts, k)?;
    check_len("probs", probs.len(), nl)?;
    check_len("expert_idx", expert_idx.len(), nk)?;
    check_len("weights", weights.len(), nk)?;
    check_len("d_weights", d_weights.len(), nk)?;
    check_len("d_logits", d_logits.len(), nl)?;
    check_experts(expert_idx, experts)?;
    for t in 0..tokens {
        let idx = &expert_idx[t * k..(t + 1) * k];
        let w = &weights[t * k..(t + 1) * k];
        let dw = &d_weights[t * k..(t + 1) * k];
        let dl = &mut d_logits[t * experts..(t + 1) * experts];
        let wdw: f32 = w.iter().zip(dw).map(|(&a, &b)| a * b).sum();
        if renormalize {
            for j in 0..k {
                dl[idx[j] as usize] += w[j] * (dw[j] - wdw);
            }
        } else {
            let pr = &probs[t * experts..(t + 1) * experts];
            for (d, &p) in dl.iter_mut().zip(pr) {
                *d -= p * wdw;
            }
            for j in 0..k {
                let e = idx[j] as usize;
                dl[e] += pr[e] * dw[j];
            }
        }
    }
    Ok(())
}

fn check_experts(expert_idx: &[u32], experts: usize) -> Result<(), KernelError> {
    match expert_idx.iter().find(|&&e| e as usize >= experts) {
        Some(e) => Err(invalid(
            "expert_idx",
            format!("expert {e} >= experts ({experts})"),
        )),
        None => Ok(()),
    }
}

fn check_perm(perm: &[u32], n: usize) -> Result<(), KernelError> {
    check_len("perm", perm.len(), n)?;
    match perm.iter().find(|&&a| a as usize >= n) {
        Some(a) => Err(invalid(
            "perm",
            format!("assignment {a} >= tokens * k ({n})"),
        )),
        None => Ok(()),
    }
}

/// Dispatch forward: groups the rows of `x [tokens, dim]` by expert.
///
/// Writes `out [tokens * k, dim]` (slot `s` holds row `perm[s] / k` of `x`),
/// `counts [experts]` and `perm [tokens * k]` (see the module docs).
pub fn moe_dispatch_fwd(
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
    let n = prod("expert_idx", &[tokens, k])?;
    check_len("x", x.len(), prod("x", &[tokens, dim])?)?;
    check_len("expert_idx", expert_idx.len(), n)?;
    check_len("out", out.len(), prod("out", &[n, dim])?)?;
    check_len("counts", counts.len(), experts)?;
    check_len("perm", perm.len(), n)?;
    if k == 0 {
        return Err(invalid("k", "must be positive"));
    }
    if n > u32::MAX as usize {
        return Err(invalid("tokens", "tokens * k does not fit in u32"));
    }
    check_experts(expert_idx, experts)?;
    counts.fill(0);
    for &e in expert_idx {
        counts[e as usize] += 1;
    }
    let mut next: Vec<usize> = counts
        .iter()
        .scan(0usize, |acc, &c| {
            let start = *acc;
            *acc += c;
            Some(start)
        })
        .collect();
    for (a, &e) in expert_idx.iter().enumerate() {
        let s = next[e as usize];
        next[e as usize] += 1;
        perm[s] = a as u32;
        let t = a / k;
        out[s * dim..(s + 1) * dim].copy_from_slice(&x[t * dim..(t + 1) * dim]);
    }
    Ok(())
}

/// Expert capacity: every group of `group` consecutive tokens sends each expert
/// at most `cap` of its slots (GShard, Switch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Tokens of a capacity group (a divisor of the tokens).
    pub group: usize,
    /// Slots an expert keeps of each group.
    pub cap: usize,
}

impl Capacity {
    /// Rows each expert is padded to, of `tokens` tokens: `cap` for each group.
    pub fn per_expert(&self, tokens: usize) -> usize {
        tokens / self.group.max(1) * self.cap
    }
}

/// [`moe_capacity`]'s sizes, checked wherever it runs: `slots` dispatch slots
/// of `k` a token over `experts` experts, held to `c`, into `at`, `pad` and
/// `kept` of lengths `sizes`. The rows each expert is padded to.
pub fn check_capacity(
    (slots, experts): (usize, usize),
    k: usize,
    c: Capacity,
    (at, pad, kept): (usize, usize, usize),
) -> Result<usize, KernelError> {
    if k == 0 || c.group == 0 {
        return Err(invalid("k, group", "must be positive"));
    }
    let tokens = slots / k;
    check_len("perm", slots, prod("perm", &[tokens, k])?)?;
    if !tokens.is_multiple_of(c.group) {
        return Err(invalid(
            "group",
            format!("{tokens} tokens are not whole groups of {}", c.group),
        ));
    }
    let per_expert = c.per_expert(tokens);
    check_len("at", at, slots)?;
    check_len("pad", pad, prod("pad", &[experts, per_expert])?)?;
    check_len("kept", kept, experts)?;
    if pad > NO_ROW as usize {
        return Err(invalid("pad", "more padded rows than u32 indexes"));
    }
    Ok(per_expert)
}

/// Holds the dispatch slots (`perm`, `counts` as [`moe_dispatch_fwd`] left them:
/// expert-major, in token order within an expert) to capacity `c`: each expert
/// keeps the first `c.cap` of its slots from every token group and is padded to
/// `per_expert = c.per_expert(tokens)` rows, kept slots first, in order. Writes
/// `at[s]` (slot `s`'s padded row `e * per_expert + i`, or [`NO_ROW`] where the
/// token skips the expert), `pad[r]` (the slot in padded row `r`, or [`NO_ROW`]
/// for padding) and `kept[e]`. Both are row indices for [`gather_rows`]: `pad`
/// pads slot-ordered rows, `at` brings them back.
pub fn moe_capacity(
    perm: &[u32],
    counts: &[usize],
    k: usize,
    c: Capacity,
    (at, pad): (&mut [u32], &mut [u32]),
    kept: &mut [usize],
) -> Result<(), KernelError> {
    let sizes = (at.len(), pad.len(), kept.len());
    let per_expert = check_capacity((perm.len(), counts.len()), k, c, sizes)?;
    check_perm(perm, perm.len())?;
    if counts.iter().sum::<usize>() != perm.len() {
        return Err(invalid("counts", "do not add up to the slots"));
    }
    pad.fill(NO_ROW);
    let mut s = 0;
    for (e, (&n, kept)) in counts.iter().zip(kept.iter_mut()).enumerate() {
        *kept = 0;
        let mut group = usize::MAX;
        let mut in_group = 0;
        for slot in s..s + n {
            let g = perm[slot] as usize / k / c.group;
            (group, in_group) = if g == group {
                (g, in_group + 1)
            } else {
                (g, 0)
            };
            at[slot] = NO_ROW;
            if in_group < c.cap {
                let row = e * per_expert + *kept;
                at[slot] = row as u32;
                pad[row] = slot as u32;
                *kept += 1;
            }
        }
        s += n;
    }
    Ok(())
}

/// Dispatch backward: `dx[perm[s] / k] += d_out[s]` for every slot, in slot
/// order.
pub fn moe_dispatch_bwd(
    d_out: &[f32],
    perm: &[u32],
    tokens: usize,
    k: usize,
    dim: usize,
    dx: &mut [f32],
) -> Result<(), KernelError> {
    let n = prod("perm", &[tokens, k])?;
    check_perm(perm, n)?;
    check_len("d_out", d_out.len(), prod("d_out", &[n, dim])?)?;
    check_len("dx", dx.len(), prod("dx", &[tokens, dim])?)?;
    for (s, &a) in perm.iter().enumerate() {
        let t = a as usize / k;
        for (d, &g) in dx[t * dim..(t + 1) * dim]
            .iter_mut()
            .zip(&d_out[s * dim..(s + 1) * dim])
        {
            *d += g;
        }
    }
    Ok(())
}

/// Combine forward: `out[t] = sum over slots s with perm[s] / k == t of
/// weights[perm[s]] * y[s]`, for expert outputs `y [tokens * k, dim]` in
/// dispatch order; writes `out [tokens, dim]`.
pub fn moe_combine_fwd(
    y: &[f32],
    perm: &[u32],
    weights: &[f32],
    tokens: usize,
    k: usize,
    dim: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let n = prod("perm", &[tokens, k])?;
    check_perm(perm, n)?;
    check_len("y", y.len(), prod("y", &[n, dim])?)?;
    check_len("weights", weights.len(), n)?;
    check_len("out", out.len(), prod("out", &[tokens, dim])?)?;
    out.fill(0.0);
    for (s, &a) in perm.iter().enumerate() {
        let (t, w) = (a as usize / k, weights[a as usize]);
        for (o, &v) in out[t * dim..(t + 1) * dim]
            .iter_mut()
            .zip(&y[s * dim..(s + 1) * dim])
        {
            *o += w * v;
        }
    }
    Ok(())
}

/// Combine backward: accumulates `d_y [tokens * k, dim]`
/// (`weights[perm[s]] * d_out[t]`) and `d_weights [tokens, k]`
/// (`d_out[t] . y[s]`).
pub fn moe_combine_bwd(
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
    let n = prod("perm", &[tokens, k])?;
    check_perm(perm, n)?;
    let ny = prod("y", &[n, dim])?;
    check_len("d_out", d_out.len(), prod("d_out", &[tokens, dim])?)?;
    check_len("y", y.len(), ny)?;
    check_len("weights", weights.len(), n)?;
    check_len("d_y", d_y.len(), ny)?;
    check_len("d_weights", d_weights.len(), n)?;
    for (s, &a) in perm.iter().enumerate() {
        let (a, t) = (a as usize, a as usize / k);
        let g = &d_out[t * dim..(t + 1) * dim];
        let w = weights[a];
        let mut dw = 0.0f32;
        for ((d, &gv), &yv) in d_y[s * dim..(s + 1) * dim]
            .iter_mut()
            .zip(g)
            .zip(&y[s * dim..(s + 1) * dim])
        {
            *d += w * gv;
            dw += gv * yv;
        }
        d_weights[a] += dw;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, assert_grad_close, dot64, numeric_grad, Rng};

    #[test]
    fn gather_rows_moves_rows_and_zeroes_the_missing() {
        let src = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = [9.0; 8];
        gather_rows(&src, &[2, NO_ROW, 0, 2], 2, &mut out).unwrap();
        assert_eq!(out, [5.0, 6.0, 0.0, 0.0, 1.0, 2.0, 5.0, 6.0]);
        assert!(gather_rows(&src, &[3], 2, &mut out[..2]).is_err());
        assert!(gather_rows(&src, &[0], 2, &mut out).is_err());
    }

    #[test]
    fn capacity_keeps_the_first_slots_of_each_group_and_pads_every_expert() {
        // Tokens 0, 1, 2 go to expert 0 and token 3 to expert 1 (k = 1); groups of
        // two tokens, one slot per expert and group: token 1 is over capacity.
        // Each expert is padded to 2 rows (2 groups x 1).
        let c = Capacity { group: 2, cap: 1 };
        let (mut at, mut pad, mut kept) = (vec![0; 4], vec![0; 4], vec![0; 2]);
        let perm = [0, 1, 2, 3];
        moe_capacity(&perm, &[3, 1], 1, c, (&mut at, &mut pad), &mut kept).unwrap();
        assert_eq!(at, [0, NO_ROW, 1, 2]);
        assert_eq!(pad, [0, 2, 3, NO_ROW]);
        assert_eq!(kept, [2, 1]);
        let mut padded = vec![0.0; 4];
        gather_rows(&[1.0, 2.0, 3.0, 4.0], &pad, 1, &mut padded).unwrap();
        assert_eq!(padded, [1.0, 3.0, 4.0, 0.0]);
        let mut back = vec![0.0; 4];
        gather_rows(&padded, &at, 1, &mut back).unwrap();
        assert_eq!(back, [1.0, 0.0, 3.0, 4.0]);
        // k = 2 (assignment t k + j): four tokens in groups of two, one slot per
        // expert and group, so 2 rows per expert. Expert 0 holds assignments 0, 2,
        // 4, 6 (tokens 0 to 3), expert 1 assignments 1, 3, 5 (tokens 0, 1, 2),
        // expert 2 assignment 7 (token 3).
        let c = Capacity { group: 2, cap: 1 };
        let perm = [0, 2, 4, 6, 1, 3, 5, 7];
        let (mut at, mut pad, mut kept) = (vec![0; 8], vec![0; 6], vec![0; 3]);
        moe_capacity(&perm, &[4, 3, 1], 2, c, (&mut at, &mut pad), &mut kept).unwrap();
        // Expert 0 keeps token 0 (group 0) and token 2 (group 1); expert 1 keeps
        // token 0 and token 2; expert 2 keeps token 3.
        assert_eq!(at, [0, NO_ROW, 1, NO_ROW, 2, NO_ROW, 3, 4]);
        assert_eq!(pad, [0, 2, 4, 6, 7, NO_ROW]);
        assert_eq!(kept, [2, 2, 1]);
        let bad = |perm: &[u32], counts: &[usize], c| {
            let (mut at, mut pad, mut kept) = (vec![0; perm.len()], vec![0; 8], vec![0; 2]);
            moe_capacity(perm, counts, 1, c, (&mut at, &mut pad), &mut kept).is_err()
        };
        assert!(bad(&[0, 1, 2], &[2, 1], Capacity { group: 2, cap: 1 }));
        assert!(bad(&[0, 1, 2, 3], &[2, 1], Capacity { group: 2, cap: 2 }));
        assert!(bad(&[0, 1, 2, 3], &[2, 2], Capacity { group: 0, cap: 2 }));
        assert!(!bad(&[0, 1, 2, 3], &[2, 2], Capacity { group: 2, cap: 2 }));
    }

    fn route(
        logits: &[f32],
        tokens: usize,
        experts: usize,
        k: usize,
        renorm: bool,
    ) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
        let mut p = vec![0.0; tokens * experts];
        let mut idx = vec![0; tokens * k];
        let mut w = vec![0.0; tokens * k];
        moe_route_fwd(logits, tokens, experts, k, renorm, &mut p, &mut idx, &mut w).unwrap();
        (p, idx, w)
    }

    /// Logits whose top-k gaps are far larger than the finite-difference step.
    fn separated_logits(rng: &mut Rng, tokens: usize, experts: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(tokens * experts);
        for _ in 0..tokens {
            let mut vals: Vec<f32> = (0..experts).map(|e| e as f32 * 0.4).collect();
            for i in (1..experts).rev() {
                vals.swap(i, rng.below(i as u64 + 1) as usize);
            }
            out.extend(vals.iter().map(|v| v + 0.05 * rng.f32()));
        }
        out
    }

    #[test]
    fn route_top2_tie_break_and_weights_by_hand() {
        let logits = [1.0, 3.0, 2.0, 3.0];
        let (p, idx, w) = route(&logits, 1, 4, 2, true);
        assert_eq!(idx, [1, 3]);
        assert_close("tied weights", &w, &[0.5, 0.5], 1e-6);
        let z = 1f32.exp() + 2.0 * 3f32.exp() + 2f32.exp();
        assert!((p[1] - 3f32.exp() / z).abs() < 1e-6);
        let (_, idx, w) = route(&logits, 1, 4, 3, false);
        assert_eq!(idx, [1, 3, 2]);
        assert_close(
            "raw weights",
            &w,
            &[3f32.exp() / z, 3f32.exp() / z, 2f32.exp() / z],
            1e-6,
        );
        let (_, idx, w) = route(&logits, 1, 4, 3, true);
        assert_eq!(idx, [1, 3, 2]);
        let zs = 2.0 * 3f32.exp() + 2f32.exp();
        assert_close(
            "renorm weights",
            &w,
            &[3f32.exp() / zs, 3f32.exp() / zs, 2f32.exp() / zs],
            1e-6,
        );
    }

    /// Renormalised over one expert, the weight is 1 and the router's gradient
    /// zero, exactly: `p * (1 / p)` rounds below 1 for some `p` (here for some of
    /// 2,000 random tokens), and the backward would then pass rounding noise, of
    /// the order of `dw * 6e-8`, which AdamW's division by its own scale turns into
    /// full steps of random sign.
    #[test]
    fn one_renormalised_expert_weighs_one_and_passes_no_gradient_exactly() {
        let mut rng = Rng::new(7);
        let (tokens, experts) = (2000, 8);
        let logits: Vec<f32> = (0..tokens * experts).map(|_| 4.0 * rng.f32()).collect();
        let (p, idx, w) = route(&logits, tokens, experts, 1, true);
        let inexact = (0..tokens)
            .filter(|&t| {
                let pt = p[t * experts + idx[t] as usize];
                pt * (1.0 / pt) != 1.0
            })
            .count();
        assert!(
            inexact > 0,
            "no token whose reciprocal rounds: the test checks nothing"
        );
        assert!(w.iter().all(|&x| x == 1.0));
        let dw = rng.vec(tokens);
        let mut dl = vec![0.0; logits.len()];
        moe_route_bwd(&p, &idx, &w, &dw, tokens, experts, 1, true, &mut dl).unwrap();
        assert!(dl.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn route_backward_matches_finite_differences_both_modes() {
        let mut rng = Rng::new(51);
        let (tokens, experts, k) = (5, 6, 2);
        let logits = separated_logits(&mut rng, tokens, experts);
        let dw = rng.vec(tokens * k);
        for renorm in [true, false] {
            let (p, idx, w) = route(&logits, tokens, experts, k, renorm);
            let mut dl = vec![0.0; logits.len()];
            moe_route_bwd(&p, &idx, &w, &dw, tokens, experts, k, renorm, &mut dl).unwrap();
            let n = numeric_grad(&logits, 2e-3, |x| {
                let (_, i2, w2) = route(x, tokens, experts, k, renorm);
                assert_eq!(i2, idx, "selection must not flip under the FD step");
                dot64(&dw, &w2)
            });
            assert_grad_close(&format!("route renorm={renorm}"), &dl, &n, 1e-2, 2e-3);
            if renorm {
                // unselected experts get exactly zero
                for t in 0..tokens {
                    for e in 0..experts {
                        if !idx[t * k..(t + 1) * k].contains(&(e as u32)) {
                            assert_eq!(dl[t * experts + e], 0.0);
                        }
                    }
                }
            } else {
                assert!(dl.iter().all(|&x| x != 0.0));
            }
        }
    }

    #[test]
    fn dispatch_groups_by_expert_and_combine_round_trips() {
        let mut rng = Rng::new(52);
        let (tokens, experts, k, dim) = (9, 4, 2, 3);
        let logits = separated_logits(&mut rng, tokens, experts);
        let (_, idx, w) = route(&logits, tokens, experts, k, true);
        let x = rng.vec(tokens * dim);
        let mut disp = vec![0.0; tokens * k * dim];
        let mut counts = vec![99; experts];
        let mut perm = vec![0; tokens * k];
        moe_dispatch_fwd(
            &x,
            &idx,
            tokens,
            k,
            experts,
            dim,
            &mut disp,
            &mut counts,
            &mut perm,
        )
        .unwrap();
        assert_eq!(counts.iter().sum::<usize>(), tokens * k);
        let mut sorted = perm.clone();
        sorted.sort();
        assert_eq!(sorted, (0..(tokens * k) as u32).collect::<Vec<_>>());
        let mut s = 0;
        for (e, &c) in counts.iter().enumerate() {
            for s in s..s + c {
                let a = perm[s] as usize;
                assert_eq!(idx[a] as usize, e);
                assert_eq!(
                    &disp[s * dim..(s + 1) * dim],
                    &x[a / k * dim..(a / k + 1) * dim]
                );
            }
            // stable: token order kept within an expert
            assert!(perm[s..s + c].windows(2).all(|p| p[0] < p[1]));
            s += c;
        }
        // identity experts + weights summing to one -> combine gives x back
        let mut out = vec![f32::NAN; tokens * dim];
        moe_combine_fwd(&disp, &perm, &w, tokens, k, dim, &mut out).unwrap();
        assert_close("round trip", &out, &x, 1e-6);
    }

    #[test]
    fn dispatch_and_combine_backward_match_finite_differences() {
        let mut rng = Rng::new(53);
        let (tokens, experts, k, dim) = (6, 3, 2, 4);
        let logits = separated_logits(&mut rng, tokens, experts);
        let (_, idx, w) = route(&logits, tokens, experts, k, false);
        let x = rng.vec(tokens * dim);
        let n = tokens * k;
        let mut disp = vec![0.0; n * dim];
        let mut counts = vec![0; experts];
        let mut perm = vec![0; n];
        moe_dispatch_fwd(
            &x,
            &idx,
            tokens,
            k,
            experts,
            dim,
            &mut disp,
            &mut counts,
            &mut perm,
        )
        .unwrap();

        let r = rng.vec(n * dim);
        let mut dx = vec![0.0; x.len()];
        moe_dispatch_bwd(&r, &perm, tokens, k, dim, &mut dx).unwrap();
        let nx = numeric_grad(&x, 2e-3, |x| {
            let mut o = vec![0.0; n * dim];
            let (mut c, mut p) = (vec![0; experts], vec![0; n]);
            moe_dispatch_fwd(x, &idx, tokens, k, experts, dim, &mut o, &mut c, &mut p).unwrap();
            dot64(&r, &o)
        });
        assert_grad_close("dispatch dx", &dx, &nx, 1e-2, 2e-3);

        let y = rng.vec(n * dim);
        let g = rng.vec(tokens * dim);
        let mut dy = vec![0.0; y.len()];
        let mut dw = vec![0.0; n];
        moe_combine_bwd(&g, &y, &perm, &w, tokens, k, dim, &mut dy, &mut dw).unwrap();
        let comb = |y: &[f32], w: &[f32]| {
            let mut o = vec![0.0; tokens * dim];
            moe_combine_fwd(y, &perm, w, tokens, k, dim, &mut o).unwrap();
            dot64(&g, &o)
        };
        let ny = numeric_grad(&y, 2e-3, |y| comb(y, &w));
        let nw = numeric_grad(&w, 2e-3, |w| comb(&y, w));
        assert_grad_close("combine dy", &dy, &ny, 1e-2, 2e-3);
        assert_grad_close("combine dw", &dw, &nw, 1e-2, 2e-3);
    }

    /// Route -> dispatch -> per-expert scaling -> combine, differentiated end
    /// to end through the router logits and the token inputs.
    #[test]
    fn full_moe_layer_gradient_matches_finite_differences() {
        let mut rng = Rng::new(54);
        let (tokens, experts, k, dim) = (5, 4, 2, 3);
        let logits = separated_logits(&mut rng, tokens, experts);
        let x = rng.vec(tokens * dim);
        let g = rng.vec(tokens * dim);
        let n = tokens * k;
        let expert_scale = |e: usize| 1.0 + e as f32;
        let layer = |logits: &[f32], x: &[f32]| {
            let (p, idx, w) = route(logits, tokens, experts, k, true);
            let mut disp = vec![0.0; n * dim];
            let (mut counts, mut perm) = (vec![0; experts], vec![0; n]);
            moe_dispatch_fwd(
                x,
                &idx,
                tokens,
                k,
                experts,
                dim,
                &mut disp,
                &mut counts,
                &mut perm,
            )
            .unwrap();
            for s in 0..n {
                let e = idx[perm[s] as usize] as usize;
                disp[s * dim..(s + 1) * dim]
                    .iter_mut()
                    .for_each(|v| *v *= expert_scale(e));
            }
            let mut out = vec![0.0; tokens * dim];
            moe_combine_fwd(&disp, &perm, &w, tokens, k, dim, &mut out).unwrap();
            (out, disp, p, idx, w, perm)
        };
        let (_, y, p, idx, w, perm) = layer(&logits, &x);
        let mut dy = vec![0.0; n * dim];
        let mut dw = vec![0.0; n];
        moe_combine_bwd(&g, &y, &perm, &w, tokens, k, dim, &mut dy, &mut dw).unwrap();
        for s in 0..n {
            let e = idx[perm[s] as usize] as usize;
            dy[s * dim..(s + 1) * dim]
                .iter_mut()
                .for_each(|v| *v *= expert_scale(e));
        }
        let mut dx = vec![0.0; x.len()];
        moe_dispatch_bwd(&dy, &perm, tokens, k, dim, &mut dx).unwrap();
        let mut dl = vec![0.0; logits.len()];
        moe_route_bwd(&p, &idx, &w, &dw, tokens, experts, k, true, &mut dl).unwrap();
        let nl = numeric_grad(&logits, 2e-3, |l| dot64(&g, &layer(l, &x).0));
        let nx = numeric_grad(&x, 2e-3, |xx| dot64(&g, &layer(&logits, xx).0));
        assert_grad_close("moe d_logits", &dl, &nl, 1e-2, 2e-3);
        assert_grad_close("moe dx", &dx, &nx, 1e-2, 2e-3);
        assert!(dl.iter().any(|&v| v.abs() > 1e-3));
    }

    #[test]
    fn validation_errors() {
        let mut p = [0.0; 4];
        let (mut idx, mut w) = ([0u32; 3], [0.0; 3]);
        assert!(
            moe_route_fwd(&[0.0; 4], 1, 4, 0, true, &mut p, &mut idx[..0], &mut w[..0]).is_err()
        );
        assert!(moe_route_fwd(&[0.0; 4], 1, 4, 5, true, &mut p, &mut idx, &mut w).is_err());
        assert!(matches!(
            moe_route_fwd(
                &[f32::NAN, 0.0, 0.0, 0.0],
                1,
                4,
                1,
                true,
                &mut p,
                &mut idx[..1],
                &mut w[..1]
            ),
            Err(KernelError::Invalid { name: "logits", .. })
        ));
        let mut out = [0.0; 2];
        let (mut c, mut perm) = ([0usize; 2], [0u32; 2]);
        assert!(matches!(
            moe_dispatch_fwd(
                &[1.0, 2.0],
                &[0, 2],
                2,
                1,
                2,
                1,
                &mut out,
                &mut c,
                &mut perm
            ),
            Err(KernelError::Invalid {
                name: "expert_idx",
                ..
            })
        ));
        assert!(matches!(
            moe_combine_fwd(&[1.0, 2.0], &[0, 7], &[1.0, 1.0], 2, 1, 1, &mut out),
            Err(KernelError::Invalid { name: "perm", .. })
        ));
    }
}
