//! Matmul-like ops, from the einsum signature: every index may be sharded on an axis.
//!
//! - an index of the activation and the output (batch, sequence): data or sequence
//!   split, weights replicated (their gradient is partial);
//! - an index of the weight and the output: column parallel (`R x S(1) -> S(.)`);
//! - a contracted index: row parallel (`S(k) x S(0) -> P`), the output a pending sum;
//! - no index: replicated.
//!
//! Time follows `graph_cost`: the einsum as `batch x [m,k] x [k,n]` with the local
//! sizes, backward as two GEMMs.

use super::{shard_if, AxisChoice, Ctx, Family, Strategy};
use crate::placement::Placement;
use meshplan_ir::{OpKind, TpRole};

pub(crate) struct Matmul;

/// `(a, b, out)` letters of an einsum.
pub(crate) fn parts(einsum: &str) -> Option<(Vec<char>, Vec<char>, Vec<char>)> {
    let (lhs, out) = einsum.split_once("->")?;
    let (a, b) = lhs.split_once(',')?;
    Some((
        a.trim().chars().collect(),
        b.trim().chars().collect(),
        out.trim().chars().collect(),
    ))
}

fn letters(ctx: &Ctx) -> Option<(Vec<char>, Vec<char>, Vec<char>)> {
    match &ctx.op.kind {
        OpKind::Matmul { einsum } => {
            let (a, b, o) = parts(einsum)?;
            let (ta, tb) = (ctx.input(0)?, ctx.input(1)?);
            if ta.shape.len() != a.len() || tb.shape.len() != b.len() {
                return None;
            }
            Some((a, b, o))
        }
        _ => None,
    }
}

/// Whether the op's first output feeds a cross-entropy (an LM head).
fn feeds_loss(ctx: &Ctx) -> bool {
    let Some(&out) = ctx.op.outputs.first() else {
        return false;
    };
    ctx.graph
        .ops()
        .any(|o| matches!(o.kind, OpKind::CrossEntropy { .. }) && o.inputs.first() == Some(&out))
}

fn pos(v: &[char], c: char) -> Option<usize> {
    v.iter().position(|&x| x == c)
}

impl Family for Matmul {
    fn choices(&self, ctx: &Ctx, axis: usize) -> Vec<AxisChoice> {
        let n_in = ctx.op.inputs.len();
        let mut out = vec![AxisChoice::replicate(n_in, ctx.op.outputs.len())];
        let Some((la, lb, lo)) = letters(ctx) else {
            return Vec::new();
        };
        let (Some(ta), Some(tb)) = (ctx.input(0), ctx.input(1)) else {
            return Vec::new();
        };
        let bias = lo.last().copied();
        let mut seen = Vec::new();
        for (c, d) in la
            .iter()
            .zip(&ta.shape)
            .chain(lb.iter().zip(&tb.shape))
            .map(|(&c, &d)| (c, d))
        {
            if seen.contains(&c) {
                continue;
            }
            seen.push(c);
            if !ctx.splittable(d, axis) {
                continue;
            }
            let (pa, pb, po) = (pos(&la, c), pos(&lb, c), pos(&lo, c));
            let grad_of = |p: Option<usize>| match p {
                Some(i) => Placement::Shard(i as u8),
                None => Placement::Partial,
            };
            let mut inputs = vec![
                shard_if(pa.is_some(), pa.unwrap_or(0)),
                shard_if(pb.is_some(), pb.unwrap_or(0)),
            ];
            let mut grads = vec![grad_of(pa), grad_of(pb)];
            for _ in 2..n_in {
                let is_bias = Some(c) == bias;
                inputs.push(shard_if(is_bias, 0));
                grads.push(if is_bias {
                    Placement::Shard(0)
                } else if po.is_some() {
                    Placement::Partial
                } else {
                    Placement::Replicate
                });
            }
            let outputs = vec![grad_of(po); ctx.op.outputs.len()];
            let (label, role) = match (pa.is_some(), pb.is_some(), po.is_some()) {
                (false, true, true) if feeds_loss(ctx) => ("col".to_string(), TpRole::VocabHead),
                (false, true, true) => ("col".to_string(), TpRole::ColumnParallel),
                (true, true, false) => ("row".to_string(), TpRole::RowParallel),
                (_, _, true) => (format!("split({c})"), TpRole::Replicated),
                _ => (format!("sum({c})"), TpRole::Replicated),
            };
            out.push(AxisChoice {
                label,
                role,
                inputs,
                grads,
                outputs,
            });
        }
        out
    }

    fn finish(&self, ctx: &Ctx, combo: &[&AxisChoice], s: &mut Strategy) -> bool {
        let Some((la, lb, lo)) = letters(ctx) else {
            return false;
        };
        let (Some(ta), Some(tb)) = (ctx.input(0), ctx.input(1)) else {
            return false;
        };
        // The index each axis shards.
        let mut split: Vec<Option<char>> = vec![None; combo.len()];
        for (a, sp) in split.iter_mut().enumerate() {
            if let Some(Placement::Shard(d)) = s.inputs[0].get(a) {
                *sp = la.get(*d as usize).copied();
            } else if let Some(Placement::Shard(d)) = s.inputs[1].get(a) {
                *sp = lb.get(*d as usize).copied();
            }
        }
        let (mut batch, mut m, mut n, mut k) = (1.0, 1.0, 1.0, 1.0);
        let mut seen = Vec::new();
        for (c, d) in la
            .iter()
            .zip(&ta.shape)
            .chain(lb.iter().zip(&tb.shape))
            .map(|(&c, &d)| (c, d))
        {
            if seen.contains(&c) {
                continue;
            }
            seen.push(c);
            let div: f64 = split
                .iter()
                .enumerate()
                .filter(|(_, x)| **x == Some(c))
                .map(|(a, _)| ctx.axis_size(a) as f64)
                .product();
            let v = ctx.dim_value(d) / div;
            match (la.contains(&c), lb.contains(&c), lo.contains(&c)) {
                (true, true, true) => batch *= v,
                (true, true, false) => k *= v,
                (true, false, _) => m *= v,
                (false, true, _) => n *= v,
                _ => {}
            }
        }
        let bpe = tb.dtype.size_bytes() as f64;
        let (w, x, y) = (
            batch * k * n * bpe,
            batch * m * k * bpe,
            batch * m * n * bpe,
        );
        let r = &ctx.opts.roof;
        s.fwd_s = r.gemm_s(batch, m, n, k, w + x + y);
        s.bwd_s = r.gemm_s(batch, m, k, n, w + y + x) + r.gemm_s(batch, k, n, m, x + y + w);
        true
    }
}
