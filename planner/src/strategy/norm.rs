//! Normalisations (LayerNorm, RMSNorm): they reduce over the last dim, which cannot be
//! split; the token dims can (data or sequence parallel), the weights stay replicated
//! and their gradient is then partial.

use super::{AxisChoice, Ctx, Family, Strategy};
use crate::placement::Placement;
use meshplan_ir::TensorKind;

pub(crate) struct Norm;

/// Splits of the leading (token) dims of an op whose activations all start with the
/// same dims: `Shard(d)` on every activation and index, weights replicated with
/// partial gradients. Used by norms and as the token split of other families.
pub(crate) fn token_splits(ctx: &Ctx, axis: usize, lead: usize) -> Vec<AxisChoice> {
    let mut out = Vec::new();
    let Some(x) = ctx.input(0) else {
        return out;
    };
    for d in 0..lead.min(x.shape.len()) {
        if !ctx.splittable(x.shape[d], axis) {
            continue;
        }
        let same = |id: &meshplan_ir::TensorId| {
            ctx.tensor(*id).is_some_and(|t| {
                t.kind == TensorKind::Weight || t.shape.get(d) == Some(&x.shape[d])
            })
        };
        if !ctx.op.inputs.iter().all(same) || !ctx.op.outputs.iter().all(same) {
            continue;
        }
        let place = |id: &meshplan_ir::TensorId, grad: bool| match ctx.tensor(*id) {
            Some(t) if t.kind == TensorKind::Weight => {
                if grad {
                    Placement::Partial
                } else {
                    Placement::Replicate
                }
            }
            _ => Placement::Shard(d as u8),
        };
        out.push(AxisChoice {
            label: format!("split({d})"),
            role: meshplan_ir::TpRole::Replicated,
            inputs: ctx.op.inputs.iter().map(|i| place(i, false)).collect(),
            grads: ctx.op.inputs.iter().map(|i| place(i, true)).collect(),
            outputs: ctx.op.outputs.iter().map(|i| place(i, false)).collect(),
        });
    }
    out
}

impl Family for Norm {
    fn choices(&self, ctx: &Ctx, axis: usize) -> Vec<AxisChoice> {
        let mut out = vec![AxisChoice::replicate(
            ctx.op.inputs.len(),
            ctx.op.outputs.len(),
        )];
        let rank = ctx.input(0).map_or(0, |t| t.shape.len());
        out.extend(token_splits(ctx, axis, rank.saturating_sub(1)));
        out
    }

    fn finish(&self, ctx: &Ctx, _combo: &[&AxisChoice], s: &mut Strategy) -> bool {
        let (f, b) = ctx.memory_bound(s, 1.5, 1.0);
        s.fwd_s = f;
        s.bwd_s = b;
        true
    }
}
