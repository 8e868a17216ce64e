//! The attention core (scores, softmax, weighted sum; a flash kernel as `graph_cost`
//! prices it): inputs `[b, s, width]` (fused QKV, or Q and KV), output `[b, s, h dv]`.
//!
//! - head split (`Shard(2)` everywhere, role `Local`): query and key/value heads both
//!   divide by the axes splitting them (GQA);
//! - batch split;
//! - sequence split on a `cp` axis, two ways: ring attention (key/value blocks passed
//!   around the ring, overlapped with the previous block's attention, as `graph_cost`
//!   prices context parallelism) or Ulysses (All-to-All from sequence to heads before,
//!   and back after, forward and backward);
//! - replicated.

use super::{AxisChoice, CommItem, Ctx, Family, Phase, Strategy};
use crate::placement::Placement;
use meshplan_cost_model::collective::bytes_sent_per_rank;
use meshplan_cost_model::graph_cost::causal_fraction;
use meshplan_cost_model::Collective;
use meshplan_ir::{OpKind, TpRole};

pub(crate) struct Attention;

fn uniform(label: &str, role: TpRole, p: Placement, n_in: usize, n_out: usize) -> AxisChoice {
    AxisChoice {
        label: label.into(),
        role,
        inputs: vec![p; n_in],
        grads: vec![p; n_in],
        outputs: vec![p; n_out],
    }
}

impl Family for Attention {
    fn choices(&self, ctx: &Ctx, axis: usize) -> Vec<AxisChoice> {
        let (n_in, n_out) = (ctx.op.inputs.len(), ctx.op.outputs.len());
        let OpKind::Attention(a) = &ctx.op.kind else {
            return Vec::new();
        };
        let n = ctx.axis_size(axis);
        let mut out = vec![AxisChoice::replicate(n_in, n_out)];
        out.push(uniform(
            "batch",
            TpRole::Replicated,
            Placement::Shard(0),
            n_in,
            n_out,
        ));
        if a.heads % n == 0 && a.kv_heads % n == 0 {
            out.push(uniform(
                "heads",
                TpRole::Local,
                Placement::Shard(2),
                n_in,
                n_out,
            ));
        }
        if ctx.axis_name(axis) == "cp" {
            out.push(uniform(
                "ring",
                TpRole::Replicated,
                Placement::Shard(1),
                n_in,
                n_out,
            ));
            if a.heads % n == 0 && a.kv_heads % n == 0 {
                out.push(uniform(
                    "ulysses",
                    TpRole::Replicated,
                    Placement::Shard(1),
                    n_in,
                    n_out,
                ));
            }
        }
        out
    }

    fn finish(&self, ctx: &Ctx, combo: &[&AxisChoice], s: &mut Strategy) -> bool {
        let OpKind::Attention(a) = &ctx.op.kind else {
            return false;
        };
        let env = &ctx.opts.env;
        let head_div = ctx.split_product(combo, |c| c.label == "heads" || c.label == "ulysses");
        let batch_div = ctx.split_product(combo, |c| c.label == "batch");
        let ring_div = ctx.split_product(combo, |c| c.label == "ring");
        let hd = head_div.round() as u64;
        if hd == 0 || a.heads % hd != 0 || a.kv_heads % hd != 0 {
            return false;
        }
        let bpe = ctx.input(0).map_or(2.0, |t| t.dtype.size_bytes() as f64);
        let (batch, heads, kv_heads) = (
            env.batch / batch_div,
            a.heads as f64 / head_div,
            a.kv_heads as f64 / head_div,
        );
        let s_local = env.seq / ring_div;
        let (dq, dv) = (a.qk_dim as f64, a.v_dim as f64);
        let flops = 2.0 * batch * heads * s_local * env.kv * (dq + dv);
        let io =
            batch * env.kv * kv_heads * (dq + dv) * bpe + batch * s_local * heads * (dq + dv) * bpe;
        let frac = if a.causal {
            causal_fraction(env.seq, env.kv)
        } else {
            1.0
        };
        let r = &ctx.opts.roof;
        (s.fwd_s, s.bwd_s) = r.flash_s(flops * frac, io, dq, env.kv);
        // Log-sum-exp per query row, fp32.
        s.saved_bytes += batch * heads * s_local * 4.0;
        for (ai, c) in combo.iter().enumerate() {
            let Some(axis) = ctx.mesh.axes.get(ai) else {
                return false;
            };
            let n = axis.size as f64;
            if axis.size <= 1 {
                continue;
            }
            match c.label.as_str() {
                "ring" => {
                    // Key/value block of this rank: its tokens, its kv heads.
                    let per_head = 2.0 * dq.max(dv) * bpe;
                    let block = batch * env.seq / ring_div * kv_heads * per_head;
                    let same_node = axis.group.per_node > 1;
                    let step = ctx.opts.comm.p2p_time_s(same_node, block);
                    let steps = n - 1.0;
                    let f = (steps * step - s.fwd_s * steps / n).max(0.0);
                    let b = (2.0 * steps * step - s.bwd_s * steps / n).max(0.0);
                    for (t, k, phase) in [(f, 1.0, Phase::Forward), (b, 2.0, Phase::Backward)] {
                        s.comm.push(CommItem {
                            axis: ai,
                            kind: None,
                            bytes: block,
                            time_s: t,
                            sent_bytes: k * steps * block,
                            phase,
                        });
                    }
                }
                "ulysses" => {
                    // Inputs from sequence- to head-split, the output back; the
                    // gradients the other way round.
                    let in_bytes: f64 = (0..ctx.op.inputs.len())
                        .filter_map(|i| Some(ctx.local_bytes(ctx.input(i)?, s.inputs.get(i)?)))
                        .sum();
                    let out_bytes = ctx
                        .output(0)
                        .zip(s.outputs.first())
                        .map_or(0.0, |(t, p)| ctx.local_bytes(t, p));
                    for phase in [Phase::Forward, Phase::Backward] {
                        for bytes in [in_bytes, out_bytes] {
                            let k = Collective::AllToAll;
                            s.comm.push(CommItem {
                                axis: ai,
                                kind: Some(k),
                                bytes,
                                time_s: ctx.opts.comm.time_s(k, axis.group, bytes),
                                sent_bytes: bytes_sent_per_rank(k, axis.size, bytes),
                                phase,
                            });
                        }
                    }
                }
                _ => {}
            }
        }
        true
    }
}
