//! Elementwise ops follow their input: additions, dropout, the MLP nonlinearity
//! (SwiGLU halves the last dim: both halves of a column stay on one rank, as Megatron
//! interleaves them), rotary embeddings (per head), and top-k routing.
//!
//! - token dims (batch, sequence) may be split on every input and output alike;
//! - the last dim may be split by the nonlinearity and rope (the MLP width, the
//!   heads: role `Local`), not by additions and dropout: splitting the residual
//!   stream's width is cost-equivalent to splitting its sequence, which is the
//!   sequence-parallel layout and is left to the sequence split (norms, which reduce
//!   over the width, admit only that one).
//!
//! An addition of two partial sums could stay partial (`P + P -> P`, one reduction
//! instead of two); it is left out because no standard role prices it, and a layout
//! that `graph_cost` cannot price identically would make the planner's choice and the
//! estimate disagree (a vocabulary-parallel position table would tie with a replicated
//! one here and cost an extra AllReduce there).

use super::norm::token_splits;
use super::{AxisChoice, Ctx, Family, Strategy};
use crate::placement::Placement;
use meshplan_ir::{OpKind, TpRole};

pub(crate) struct Pointwise;

impl Family for Pointwise {
    fn choices(&self, ctx: &Ctx, axis: usize) -> Vec<AxisChoice> {
        let (n_in, n_out) = (ctx.op.inputs.len(), ctx.op.outputs.len());
        let mut out = vec![AxisChoice::replicate(n_in, n_out)];
        let rank = ctx.input(0).map_or(0, |t| t.shape.len());
        out.extend(token_splits(ctx, axis, rank.saturating_sub(1)));
        match ctx.op.kind {
            OpKind::Activation(_) | OpKind::Rope if rank > 0 => {
                let same_rank = ctx
                    .op
                    .inputs
                    .iter()
                    .chain(&ctx.op.outputs)
                    .all(|&id| ctx.tensor(id).is_some_and(|t| t.shape.len() == rank));
                if same_rank {
                    let last = Placement::Shard((rank - 1) as u8);
                    out.push(AxisChoice {
                        label: "local".into(),
                        role: TpRole::Local,
                        inputs: vec![last; n_in],
                        grads: vec![last; n_in],
                        outputs: vec![last; n_out],
                    });
                }
            }
            _ => {}
        }
        out
    }

    fn finish(&self, ctx: &Ctx, _combo: &[&AxisChoice], s: &mut Strategy) -> bool {
        let factor = match ctx.op.kind {
            OpKind::Activation(_) => 1.5,
            OpKind::Add => 0.0,
            _ => 1.0,
        };
        let (f, b) = ctx.memory_bound(s, factor, 1.0);
        s.fwd_s = f;
        s.bwd_s = b;
        true
    }
}
