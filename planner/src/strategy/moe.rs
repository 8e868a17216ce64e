//! Routed experts (`[x, router logits, w_up [E,h,U], w_down [E,F,h]] -> [y, routed
//! tensors]`), priced as `graph_cost` prices them (grouped GEMMs per local expert,
//! permutation by bytes).
//!
//! - expert parallel on an `ep` axis: tokens split (batch or sequence), experts split
//!   (`Shard(0)` on both weights), tokens moved to their experts and back by
//!   All-to-All (dispatch and combine, forward and backward);
//! - experts split with tokens replicated: each rank runs its experts on all tokens,
//!   the output a partial sum (no All-to-All);
//! - expert tensor parallel: every expert's MLP column/row split (`Shard(2)` of
//!   `w_up`, `Shard(1)` of `w_down`), the output partial;
//! - token split with replicated experts (data parallel), and replicated.
//!
//! The routed tensors hold one rank's share of the dispatched rows; with balanced
//! routing that is `1/n` of them, which their placement records without requiring the
//! row count to divide.

use super::norm::token_splits;
use super::{AxisChoice, CommItem, Ctx, Family, Phase, Strategy};
use crate::placement::Placement;
use meshplan_cost_model::collective::bytes_sent_per_rank;
use meshplan_cost_model::Collective;
use meshplan_ir::{OpKind, TpRole};

pub(crate) struct Experts;

impl Family for Experts {
    fn choices(&self, ctx: &Ctx, axis: usize) -> Vec<AxisChoice> {
        use Placement::*;
        let OpKind::Experts(e) = &ctx.op.kind else {
            return Vec::new();
        };
        if ctx.op.inputs.len() != 4 || ctx.op.outputs.is_empty() {
            return Vec::new();
        }
        let n_out = ctx.op.outputs.len();
        let n = ctx.axis_size(axis);
        let mut out = vec![AxisChoice::replicate(4, n_out)];
        out.extend(token_splits(ctx, axis, 2));
        let routed = |first: Placement, rest: Placement| {
            let mut v = vec![rest; n_out];
            v[0] = first;
            v
        };
        if e.ffn % n == 0 {
            let mut outputs = routed(Partial, Shard(3));
            if n_out > 1 {
                outputs[1] = Replicate;
            }
            out.push(AxisChoice {
                label: "etp".into(),
                role: TpRole::Experts,
                inputs: vec![Replicate, Replicate, Shard(2), Shard(1)],
                grads: vec![Partial, Partial, Shard(2), Shard(1)],
                outputs,
            });
        }
        if e.experts % n == 0 {
            out.push(AxisChoice {
                label: "experts".into(),
                role: TpRole::Experts,
                inputs: vec![Replicate, Replicate, Shard(0), Shard(0)],
                grads: vec![Partial, Partial, Shard(0), Shard(0)],
                outputs: routed(Partial, Shard(2)),
            });
            if ctx.axis_name(axis) == "ep" {
                let Some(x) = ctx.input(0) else {
                    return out;
                };
                for d in 0..2usize.min(x.shape.len()) {
                    let t = Shard(d as u8);
                    out.push(AxisChoice {
                        label: format!("ep({d})"),
                        role: TpRole::Experts,
                        inputs: vec![t, t, Shard(0), Shard(0)],
                        grads: vec![t, t, Shard(0), Shard(0)],
                        outputs: vec![t; n_out],
                    });
                }
            }
        }
        out
    }

    fn checked_outputs(&self, _ctx: &Ctx) -> usize {
        1
    }

    fn finish(&self, ctx: &Ctx, combo: &[&AxisChoice], s: &mut Strategy) -> bool {
        let OpKind::Experts(e) = &ctx.op.kind else {
            return false;
        };
        let env = &ctx.opts.env;
        let token_div = ctx.split_product(combo, |c| {
            c.label.starts_with("split") || c.label.starts_with("ep(")
        });
        let a2a_div = ctx.split_product(combo, |c| c.label.starts_with("ep("));
        let expert_div = ctx.split_product(combo, |c| {
            c.label == "experts" || c.label.starts_with("ep(")
        });
        let ffn_div = ctx.split_product(combo, |c| c.label == "etp");
        let (ed, fd) = (expert_div.round() as u64, ffn_div.round() as u64);
        if ed == 0 || fd == 0 || e.experts % ed != 0 || e.ffn % fd != 0 || e.experts == 0 {
            return false;
        }
        let bpe = ctx.input(2).map_or(2.0, |t| t.dtype.size_bytes() as f64);
        let tokens = env.batch * env.seq / token_div;
        // Capacity groups are a rank's slice of a sequence (dropless while decoding).
        let group = (env.kv <= env.seq).then_some(env.seq);
        let dispatched = e.dispatched_rows(tokens, group);
        let experts_local = e.experts as f64 / expert_div;
        let rows = dispatched * a2a_div / e.experts as f64;
        let ffn = e.ffn as f64 / ffn_div;
        let mats = e.mlp.matrices() as f64;
        let up_w = if mats > 2.0 { 2.0 } else { 1.0 };
        let h = e.hidden as f64;
        let r = &ctx.opts.roof;
        let up = r.gemm_s(
            1.0,
            rows,
            ffn * up_w,
            h,
            h * ffn * up_w * bpe + rows * (h + ffn * up_w) * bpe,
        );
        let down = r.gemm_s(1.0, rows, h, ffn, ffn * h * bpe + rows * (h + ffn) * bpe);
        let act = r.memory_s(rows * ffn * (up_w + 1.0) * bpe);
        let permute = r.memory_s(4.0 * rows * experts_local * h * bpe);
        s.fwd_s = experts_local * (up + down + act) + permute;
        s.bwd_s = experts_local * (2.0 * (up + down) + 1.5 * act) + permute;
        for (ai, c) in combo.iter().enumerate() {
            let Some(axis) = ctx.mesh.axes.get(ai) else {
                return false;
            };
            if !c.label.starts_with("ep(") || axis.size <= 1 {
                continue;
            }
            // Dispatch and combine: this rank's tokens, top_k copies (or padded
            // capacity) of width h.
            let bytes = dispatched * h * bpe;
            let kind = Collective::AllToAll;
            for phase in [
                Phase::Forward,
                Phase::Forward,
                Phase::Backward,
                Phase::Backward,
            ] {
                s.comm.push(CommItem {
                    axis: ai,
                    kind: Some(kind),
                    bytes,
                    time_s: ctx.opts.comm.time_s(kind, axis.group, bytes),
                    sent_bytes: bytes_sent_per_rank(kind, axis.size, bytes),
                    phase,
                });
            }
        }
        true
    }
}
