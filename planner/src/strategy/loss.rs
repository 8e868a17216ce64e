//! Softmax cross-entropy over the vocabulary: `[logits [b,s,V], labels [b,s]] -> loss`.
//!
//! - vocabulary sharded: each rank holds `V/n` logits per token; the max, the sum of
//!   exponentials and the target logit are AllReduced, one float per token each
//!   (role `VocabLoss`, priced as `graph_cost` prices it);
//! - token split: logits and labels split by batch or sequence, the loss a partial sum;
//! - replicated.

use super::{AxisChoice, Ctx, Family, Strategy};
use super::{CommItem, Phase};
use crate::placement::Placement;
use meshplan_cost_model::collective::bytes_sent_per_rank;
use meshplan_cost_model::Collective;
use meshplan_ir::TpRole;

pub(crate) struct CrossEntropy;

impl Family for CrossEntropy {
    fn choices(&self, ctx: &Ctx, axis: usize) -> Vec<AxisChoice> {
        let (n_in, n_out) = (ctx.op.inputs.len(), ctx.op.outputs.len());
        let Some(logits) = ctx.input(0) else {
            return Vec::new();
        };
        let rank = logits.shape.len();
        let mut out = vec![AxisChoice::replicate(n_in, n_out)];
        if rank == 0 {
            return out;
        }
        let mut inputs = vec![Placement::Replicate; n_in];
        inputs[0] = Placement::Shard((rank - 1) as u8);
        out.push(AxisChoice {
            label: "vocab".into(),
            role: TpRole::VocabLoss,
            grads: inputs.clone(),
            inputs,
            outputs: vec![Placement::Replicate; n_out],
        });
        for d in 0..rank - 1 {
            if !ctx.splittable(logits.shape[d], axis) {
                continue;
            }
            let inputs: Vec<Placement> = ctx
                .op
                .inputs
                .iter()
                .map(|&id| {
                    if ctx
                        .tensor(id)
                        .is_some_and(|t| t.shape.get(d) == Some(&logits.shape[d]))
                    {
                        Placement::Shard(d as u8)
                    } else {
                        Placement::Replicate
                    }
                })
                .collect();
            out.push(AxisChoice {
                label: format!("split({d})"),
                role: TpRole::Replicated,
                grads: inputs.clone(),
                inputs,
                outputs: vec![Placement::Partial; n_out],
            });
        }
        out
    }

    fn finish(&self, ctx: &Ctx, combo: &[&AxisChoice], s: &mut Strategy) -> bool {
        let (f, b) = ctx.memory_bound(s, 2.0, 1.0);
        s.fwd_s = f;
        s.bwd_s = b;
        let token_div = ctx.split_product(combo, |c| c.label.starts_with("split"));
        let tokens = ctx.opts.env.batch * ctx.opts.env.seq / token_div;
        for (a, c) in combo.iter().enumerate() {
            let Some(axis) = ctx.mesh.axes.get(a) else {
                return false;
            };
            if c.role != TpRole::VocabLoss || axis.size <= 1 {
                continue;
            }
            // Max, sum of exponentials and the target logit: one f32 per token each.
            let bytes = tokens * 4.0;
            for _ in 0..3 {
                s.comm.push(CommItem {
                    axis: a,
                    kind: Some(Collective::AllReduce),
                    bytes,
                    time_s: ctx
                        .opts
                        .comm
                        .time_s(Collective::AllReduce, axis.group, bytes),
                    sent_bytes: bytes_sent_per_rank(Collective::AllReduce, axis.size, bytes),
                    phase: Phase::Forward,
                });
            }
        }
        true
    }
}
