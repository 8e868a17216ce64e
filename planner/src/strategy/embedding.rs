//! Embedding lookups: `[ids], [table] -> [b, s, h]`.
//!
//! - vocabulary parallel: the table `Shard(0)` by rows, each rank looks up the ids
//!   it holds and writes zeros elsewhere: the output is `Partial` (role
//!   `VocabEmbedding`);
//! - hidden split: the table `Shard(1)`, the output `Shard(2)`;
//! - token split: ids and output split by batch or sequence, the table replicated
//!   (its gradient partial);
//! - replicated.
//!
//! Priced by bytes as `graph_cost` does: the output is written and its rows read.

use super::norm::token_splits;
use super::{AxisChoice, Ctx, Family, Strategy};
use crate::placement::Placement;
use meshplan_ir::TpRole;

pub(crate) struct Embedding;

impl Family for Embedding {
    fn choices(&self, ctx: &Ctx, axis: usize) -> Vec<AxisChoice> {
        let (n_in, n_out) = (ctx.op.inputs.len(), ctx.op.outputs.len());
        if n_in < 2 || n_out < 1 {
            return Vec::new();
        }
        let mut out = vec![AxisChoice::replicate(n_in, n_out)];
        let with = |ids: Placement, table: Placement, tgrad: Placement, y: Placement| {
            let mut inputs = vec![Placement::Replicate; n_in];
            let mut grads = vec![Placement::Replicate; n_in];
            inputs[0] = ids;
            grads[0] = ids;
            inputs[1] = table;
            grads[1] = tgrad;
            (inputs, grads, vec![y; n_out])
        };
        let (inputs, grads, outputs) = with(
            Placement::Replicate,
            Placement::Shard(0),
            Placement::Shard(0),
            Placement::Partial,
        );
        out.push(AxisChoice {
            label: "vocab".into(),
            role: TpRole::VocabEmbedding,
            inputs,
            grads,
            outputs,
        });
        let (inputs, grads, outputs) = with(
            Placement::Replicate,
            Placement::Shard(1),
            Placement::Shard(1),
            Placement::Shard(2),
        );
        out.push(AxisChoice {
            label: "hidden".into(),
            role: TpRole::Local,
            inputs,
            grads,
            outputs,
        });
        out.extend(token_splits(ctx, axis, 2));
        out
    }

    fn finish(&self, ctx: &Ctx, _combo: &[&AxisChoice], s: &mut Strategy) -> bool {
        let (f, b) = ctx.memory_bound(s, 1.0, 2.0);
        s.fwd_s = f;
        s.bwd_s = b;
        true
    }
}
