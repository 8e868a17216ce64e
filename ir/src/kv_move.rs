//! A request's KV cache moving from a prefill pool to a decode pool (disaggregated
//! serving): which (layer, KV head) shards each decode rank needs, which prefill rank
//! sends each, and the bytes every rank sends and receives. The executor moves the
//! caches along [`kv_route`] and `--check` compares what it counted with
//! [`kv_transfer_bytes`], the same walk.
//!
//! Both pools are ordinary inference plans of one model (the plan's `serving`
//! section: the decode pool on top, the prefill pool in `prefill_plan`). A rank holds,
//! per block layer of its pipeline stage and per request, the keys and values of its
//! own KV heads ([`kv_heads_held`]): split over `tp`, replicated when there are fewer
//! KV heads than tensor ranks, all of them when the attention is replicated.
//!
//! Request `i` is prefilled by prefill replica `i % dp` and decoded by decode replica
//! `i % dp` (each pool's own `dp`). Inside one such pair, each decode rank receives
//! every (layer, head) it holds, one piece each, from the prefill rank of the
//! stage holding that layer whose tensor rank holds the head; when several do (heads
//! replicated over the prefill's tensor ranks) the decode rank's tensor position,
//! modulo their number, picks one, which spreads the sends. A piece is the prompt's
//! keys and values of one head, `prompt_len x (qk_dim + v_dim)` elements.
//!
//! Pieces are listed by decode rank (stage, tensor rank), then layer, then head:
//! senders and receivers walk the same list, so the messages between any two ranks
//! are sent and expected in one order and nothing waits on anything but its data.
//!
//! Per request, the whole cache (`prompt_len x layers x kv_heads x (qk_dim +
//! v_dim)` elements) crosses once when no decode rank shares a head with another;
//! a head the decode pool replicates over `r` tensor ranks crosses `r` times.

use crate::graph::{OpKind, SegmentKind, TpRole};
use crate::plan::{Instr, PhaseKind, Plan, PlanKind};

/// A rank's place inside its pool replica: pipeline stage and tensor rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PoolPos {
    /// Pipeline stage.
    pub stage: u64,
    /// Position on the `tp` axis.
    pub tp: u64,
}

/// One head of one layer of a request's KV cache, sent from a prefill rank to a
/// decode rank of the pair of replicas serving the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPiece {
    /// Block layer.
    pub layer: u64,
    /// KV head (global index).
    pub head: u64,
    /// The sending prefill rank.
    pub from: PoolPos,
    /// The head's index among the heads the sender holds for this layer.
    pub from_index: u64,
    /// The receiving decode rank.
    pub to: PoolPos,
    /// The head's index among the heads the receiver holds for this layer.
    pub to_index: u64,
    /// Heads the receiver holds for this layer.
    pub to_heads: u64,
    /// Key width per head.
    pub qk_dim: u64,
    /// Value width per head.
    pub v_dim: u64,
}

impl KvPiece {
    /// Elements of the piece for a prompt of `prompt_len` tokens (keys, then values).
    pub fn elements(&self, prompt_len: u64) -> u64 {
        prompt_len * (self.qk_dim + self.v_dim)
    }
}

/// KV heads a tensor rank holds: `(first, count)`. Split over the `tp` ranks when
/// there are at least as many heads; otherwise each head is replicated over
/// `tp / kv_heads` consecutive ranks and a rank holds one.
pub fn kv_heads_held(kv_heads: u64, tp_rank: u64, tp: u64) -> (u64, u64) {
    let tp = tp.max(1);
    if kv_heads >= tp {
        (tp_rank * kv_heads / tp, kv_heads / tp)
    } else {
        (tp_rank / (tp / kv_heads.max(1)), 1)
    }
}

/// One block layer's KV cache in a pool: where it lives and how it is split.
#[derive(Clone, Copy, Debug, PartialEq)]
struct LayerKv {
    layer: u64,
    stage: u64,
    kv_heads: u64,
    qk_dim: u64,
    v_dim: u64,
    /// Every tensor rank holds every head (the attention is not split).
    replicated: bool,
}

impl LayerKv {
    fn held(&self, tp_rank: u64, tp: u64) -> (u64, u64) {
        if self.replicated {
            (0, self.kv_heads)
        } else {
            kv_heads_held(self.kv_heads, tp_rank, tp)
        }
    }
}

/// A pool plan's `tp` degree and the KV cache of each of its block layers.
fn pool_layers(plan: &Plan, pool: &str) -> Result<(u64, Vec<LayerKv>), String> {
    if plan.kind != PlanKind::Inference {
        return Err(format!("the {pool} pool's plan is not an inference plan"));
    }
    let size = |name: &str| {
        let i = plan.mesh.axes.iter().position(|a| a == name);
        i.map_or(1, |i| plan.mesh.shape[i])
    };
    if size("cp") > 1 {
        return Err(format!(
            "the {pool} pool splits the sequence over cp={}; its KV cache is not moved",
            size("cp")
        ));
    }
    let mut layers = Vec::new();
    for program in &plan.programs {
        let Some(phase) = program.phases.iter().find(|p| p.kind == PhaseKind::Prefill) else {
            return Err(format!(
                "the {pool} pool's program {} has no prefill phase",
                program.id
            ));
        };
        for ch in &phase.chunks {
            let mut layer = ch.layer_start;
            for instr in &ch.forward {
                let Instr::Segment {
                    name,
                    kind: SegmentKind::Block,
                    repeat,
                    ..
                } = instr
                else {
                    continue;
                };
                let seg = plan.graph.segments.iter().find(|s| &s.name == name);
                let att = seg.and_then(|s| {
                    s.ops.iter().find_map(|o| match &o.kind {
                        OpKind::Attention(a) => Some((o, a)),
                        _ => None,
                    })
                });
                for _ in 0..*repeat {
                    if let Some((op, a)) = att {
                        if op.inputs.len() != 1 {
                            return Err(format!(
                                "`{}`: a latent (MLA) cache is not moved between pools",
                                op.name
                            ));
                        }
                        layers.push(LayerKv {
                            layer,
                            stage: program.stage,
                            kv_heads: a.kv_heads,
                            qk_dim: a.qk_dim,
                            v_dim: a.v_dim,
                            replicated: op.role == TpRole::Replicated,
                        });
                    }
                    layer += 1;
                }
            }
        }
    }
    layers.sort_by_key(|l| l.layer);
    layers.dedup_by_key(|l| l.layer);
    Ok((size("tp"), layers))
}

/// Every piece of one request's KV cache, in the order both sides walk them (see
/// the module doc); the same for every pair of replicas. An error says why the
/// pools' caches do not correspond (different models, a pool this cannot move).
pub fn kv_route(prefill: &Plan, decode: &Plan) -> Result<Vec<KvPiece>, String> {
    let (tp_p, pre) = pool_layers(prefill, "prefill")?;
    let (tp_d, dec) = pool_layers(decode, "decode")?;
    if prefill.model.name != decode.model.name || prefill.model.layers != decode.model.layers {
        return Err(format!(
            "the prefill pool runs `{}` ({} layers) and the decode pool `{}` ({} layers): the pools must serve one model",
            prefill.model.name, prefill.model.layers, decode.model.name, decode.model.layers
        ));
    }
    let stages_d = decode
        .programs
        .iter()
        .map(|p| p.stage + 1)
        .max()
        .unwrap_or(1);
    let mut out = Vec::new();
    for stage in 0..stages_d {
        for tp in 0..tp_d {
            for d in dec.iter().filter(|l| l.stage == stage) {
                let p = pre.iter().find(|p| p.layer == d.layer).ok_or_else(|| {
                    format!(
                        "layer {} has a KV cache in the decode pool but not in the prefill pool",
                        d.layer
                    )
                })?;
                if (p.kv_heads, p.qk_dim, p.v_dim) != (d.kv_heads, d.qk_dim, d.v_dim) {
                    return Err(format!(
                        "layer {}: the pools' attention differs ({} KV heads of {}+{} against {} of {}+{})",
                        d.layer, p.kv_heads, p.qk_dim, p.v_dim, d.kv_heads, d.qk_dim, d.v_dim
                    ));
                }
                let (first, count) = d.held(tp, tp_d);
                for head in first..first + count {
                    let holders: Vec<(u64, u64)> = (0..tp_p)
                        .filter_map(|t| {
                            let (f, n) = p.held(t, tp_p);
                            (f..f + n).contains(&head).then_some((t, head - f))
                        })
                        .collect();
                    let Some(&(from_tp, from_index)) =
                        holders.get((tp as usize) % holders.len().max(1))
                    else {
                        return Err(format!(
                            "no prefill rank holds KV head {head} of layer {}",
                            d.layer
                        ));
                    };
                    out.push(KvPiece {
                        layer: d.layer,
                        head,
                        from: PoolPos {
                            stage: p.stage,
                            tp: from_tp,
                        },
                        from_index,
                        to: PoolPos { stage, tp },
                        to_index: head - first,
                        to_heads: count,
                        qk_dim: d.qk_dim,
                        v_dim: d.v_dim,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// Where a rank of a pool plan sits: its data-parallel replica and its place in it.
pub fn pool_pos(plan: &Plan, rank: usize) -> Option<(u64, PoolPos)> {
    let entry = plan.ranks.get(rank)?;
    let coord = |name: &str| {
        let i = plan.mesh.axes.iter().position(|a| a == name);
        i.map_or(0, |i| entry.coords[i])
    };
    let stage = plan.programs.get(entry.program as usize)?.stage;
    Some((
        coord("dp"),
        PoolPos {
            stage,
            tp: coord("tp"),
        },
    ))
}

/// The rank of a pool plan at `pos` of data-parallel replica `replica`.
pub fn pool_rank(plan: &Plan, replica: u64, pos: PoolPos) -> Option<usize> {
    (0..plan.ranks.len()).find(|&r| pool_pos(plan, r) == Some((replica, pos)))
}

/// Bytes of one request's KV move, per rank of each pool.
#[derive(Clone, Debug, PartialEq)]
pub struct KvBytes {
    /// Per prefill-pool rank: bytes it sends for each request its replica prefills.
    pub sent: Vec<f64>,
    /// Per decode-pool rank: bytes it receives for each request its replica decodes.
    pub received: Vec<f64>,
}

impl KvBytes {
    /// The busiest GPU's bytes, sent or received: the figure the cost model prices
    /// the move by (`meshplan_cost_model::serving::kv_transfer`'s `bytes_per_gpu`).
    pub fn per_gpu(&self) -> f64 {
        self.sent
            .iter()
            .chain(&self.received)
            .copied()
            .fold(0.0, f64::max)
    }
}

/// The bytes each prefill rank sends and each decode rank receives for one request
/// of `prompt_len` tokens, at `elem_bytes` per cached element (the model's dtype as
/// planned; the CPU executor's fp32 cache moves 4).
pub fn kv_transfer_bytes(
    prefill: &Plan,
    decode: &Plan,
    prompt_len: u64,
    elem_bytes: f64,
) -> Result<KvBytes, String> {
    let route = kv_route(prefill, decode)?;
    let tally = |plan: &Plan, side: fn(&KvPiece) -> PoolPos| -> Vec<f64> {
        (0..plan.ranks.len())
            .map(|r| {
                let Some((_, pos)) = pool_pos(plan, r) else {
                    return 0.0;
                };
                route
                    .iter()
                    .filter(|p| side(p) == pos)
                    .map(|p| p.elements(prompt_len) as f64 * elem_bytes)
                    .sum()
            })
            .collect()
    };
    Ok(KvBytes {
        sent: tally(prefill, |p| p.from),
        received: tally(decode, |p| p.to),
    })
}

#[cfg(test)]
mod tests {
    use super::kv_heads_held;

    #[test]
    fn heads_split_or_replicate_over_tensor_ranks() {
        assert_eq!(kv_heads_held(8, 1, 4), (2, 2));
        assert_eq!(kv_heads_held(2, 0, 1), (0, 2));
        // Two heads over four ranks: ranks 0-1 hold head 0, ranks 2-3 head 1.
        let heads: Vec<u64> = (0..4).map(|t| kv_heads_held(2, t, 4).0).collect();
        assert_eq!(heads, [0, 0, 1, 1]);
    }
}
