//! Which part of a weight a rank holds, from the op's tensor-parallel role: the one
//! rule used to initialise shards, to slice the reference for `--check`, and to read
//! local sizes while computing.

use meshplan_ir::graph::OpKind;
use meshplan_ir::{Graph, MlpKind, Op, TensorId, TpRole};

/// A rank's position on the tensor axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TpPos {
    /// Index on the axis.
    pub rank: usize,
    /// Axis size.
    pub size: usize,
}

impl TpPos {
    /// No tensor parallelism.
    pub const ONE: TpPos = TpPos { rank: 0, size: 1 };
}

/// Heads a rank computes: query heads and key/value heads (kv heads are replicated
/// when there are fewer than ranks), and the first kv head it holds.
///
/// The KV heads follow [`meshplan_ir::kv_move::kv_heads_held`], the rule the KV
/// move between serving pools reads too.
pub fn local_heads(heads: u64, kv_heads: u64, tp: TpPos) -> (usize, usize, usize) {
    let (first, count) =
        meshplan_ir::kv_move::kv_heads_held(kv_heads, tp.rank as u64, tp.size as u64);
    (heads as usize / tp.size, count as usize, first as usize)
}

/// Column ranges `[start, end)` of a `[.., n]` weight (or `[n]` bias) that a rank
/// holds when the op splits its output columns.
pub fn column_ranges(graph: &Graph, op: &Op, n: usize, tp: TpPos) -> Vec<(usize, usize)> {
    if tp.size <= 1 {
        return vec![(0, n)];
    }
    // The fused QKV projection: the rank's query heads, then its key and value heads.
    if let Some((heads, kv_heads, d)) = qkv_shape(graph, op) {
        let (hq, hkv, kv0) = local_heads(heads, kv_heads, tp);
        let q0 = tp.rank * hq;
        let k_base = heads as usize * d;
        let v_base = k_base + kv_heads as usize * d;
        return vec![
            (q0 * d, (q0 + hq) * d),
            (k_base + kv0 * d, k_base + (kv0 + hkv) * d),
            (v_base + kv0 * d, v_base + (kv0 + hkv) * d),
        ];
    }
    // A gated MLP's up projection is [gate | up]: split each half.
    if swiglu_up(graph, op) {
        let f = n / 2;
        let c = f / tp.size;
        return vec![
            (tp.rank * c, (tp.rank + 1) * c),
            (f + tp.rank * c, f + (tp.rank + 1) * c),
        ];
    }
    let c = n / tp.size;
    vec![(tp.rank * c, (tp.rank + 1) * c)]
}

/// (heads, kv heads, head dim) if `op` produces the input of a rope or attention op.
fn qkv_shape(graph: &Graph, op: &Op) -> Option<(u64, u64, usize)> {
    let out = *op.outputs.first()?;
    let mut cur = out;
    // Follow through a rope op to the attention core.
    for _ in 0..2 {
        for seg in &graph.segments {
            for o in &seg.ops {
                if o.inputs.first() == Some(&cur) {
                    match &o.kind {
                        OpKind::Attention(a) => {
                            return Some((a.heads, a.kv_heads, a.qk_dim as usize))
                        }
                        OpKind::Rope => {
                            cur = *o.outputs.first()?;
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    None
}

/// Whether `op`'s output feeds a SwiGLU activation.
fn swiglu_up(graph: &Graph, op: &Op) -> bool {
    let Some(out) = op.outputs.first() else {
        return false;
    };
    graph.segments.iter().flat_map(|s| &s.ops).any(|o| {
        o.inputs.first() == Some(out) && matches!(o.kind, OpKind::Activation(MlpKind::Swiglu))
    })
}

/// Whether a matmul's weight is stored `[n, k]` (its operand leads with the output's
/// last index), as a table tied to the embedding is (`bsh,vh->bsv`): the product is
/// then `x wᵀ`.
pub fn weight_transposed(op: &Op) -> bool {
    let OpKind::Matmul { einsum } = &op.kind else {
        return false;
    };
    let Some((lhs, out)) = einsum.split_once("->") else {
        return false;
    };
    let w = lhs.split(',').nth(1).unwrap_or("").trim();
    matches!((w.chars().next(), out.trim().chars().last()), (Some(a), Some(b)) if a == b)
}

/// The rows (first-dim ranges) a rank holds of a weight split along its first dim.
fn row_range(rows: usize, tp: TpPos) -> (usize, usize) {
    let c = rows / tp.size;
    (tp.rank * c, (tp.rank + 1) * c)
}

/// The local part of weight `w` (its full values row-major with `shape`) used by
/// `op` under `role`. Generic over the element so that slicing element indices
/// gives where each local value sits in the full tensor (checkpoints assemble full
/// tensors from that, and so cannot disagree with this rule).
#[allow(clippy::too_many_arguments)] // the weight, its op, and the rank's two positions
pub fn local_weight<T: Copy>(
    graph: &Graph,
    op: &Op,
    role: TpRole,
    w: TensorId,
    full: &[T],
    shape: &[usize],
    tp: TpPos,
    ep: TpPos,
) -> Vec<T> {
    if role == TpRole::Experts {
        return expert_slice(full, shape, tp, ep);
    }
    if tp.size <= 1 {
        return full.to_vec();
    }
    let is_bias = shape.len() == 1 && op.inputs.get(2) == Some(&w);
    match role {
        // A head reading a table tied to the embedding (`bsh,vh->bsv`) splits the
        // table's vocabulary rows, as the embedding does.
        TpRole::VocabHead if weight_transposed(op) => {
            let rows = shape[0];
            let n = full.len() / rows.max(1);
            let (a, b) = row_range(rows, tp);
            full[a * n..b * n].to_vec()
        }
        TpRole::ColumnParallel | TpRole::VocabHead => {
            let n = *shape.last().unwrap_or(&1);
            let rows = full.len() / n.max(1);
            let ranges = column_ranges(graph, op, n, tp);
            let mut out = Vec::new();
            for r in 0..rows {
                for &(a, b) in &ranges {
                    out.extend_from_slice(&full[r * n + a..r * n + b]);
                }
            }
            out
        }
        TpRole::RowParallel if !is_bias => {
            let rows = shape[0];
            let n = full.len() / rows.max(1);
            let (a, b) = row_range(rows, tp);
            full[a * n..b * n].to_vec()
        }
        TpRole::VocabEmbedding => {
            let rows = shape[0];
            let n = full.len() / rows.max(1);
            let (a, b) = row_range(rows, tp);
            full[a * n..b * n].to_vec()
        }
        _ => full.to_vec(),
    }
}

/// Expert weights: `[experts, h, up]` and `[experts, f, h]` split by expert over
/// the expert axis when ep > 1; otherwise each expert's MLP is split over the tensor
/// axis like a dense one (gate and up halves by column, down by row).
fn expert_slice<T: Copy>(full: &[T], shape: &[usize], tp: TpPos, ep: TpPos) -> Vec<T> {
    if shape.len() != 3 {
        return full.to_vec();
    }
    let (e, r, c) = (shape[0], shape[1], shape[2]);
    if ep.size > 1 {
        let per = e / ep.size;
        return full[ep.rank * per * r * c..(ep.rank + 1) * per * r * c].to_vec();
    }
    if tp.size <= 1 {
        return full.to_vec();
    }
    let mut out = Vec::with_capacity(full.len() / tp.size);
    for x in 0..e {
        let m = &full[x * r * c..(x + 1) * r * c];
        if c > r {
            // Up `[h, 2f]` as [gate | up]: this rank's columns of each half.
            let f = c / 2;
            let w = f / tp.size;
            for row in 0..r {
                out.extend_from_slice(&m[row * c + tp.rank * w..row * c + (tp.rank + 1) * w]);
                out.extend_from_slice(
                    &m[row * c + f + tp.rank * w..row * c + f + (tp.rank + 1) * w],
                );
            }
        } else {
            // Down `[f, h]`: this rank's rows.
            let rows = r / tp.size;
            out.extend_from_slice(&m[tp.rank * rows * c..(tp.rank + 1) * rows * c]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_heads_split_or_replicated() {
        // 4 query heads, 2 kv heads.
        assert_eq!(local_heads(4, 2, TpPos { rank: 1, size: 2 }), (2, 1, 1));
        assert_eq!(local_heads(4, 2, TpPos { rank: 3, size: 4 }), (1, 1, 1));
        assert_eq!(local_heads(4, 2, TpPos { rank: 1, size: 4 }), (1, 1, 0));
        assert_eq!(local_heads(8, 8, TpPos { rank: 1, size: 2 }), (4, 4, 4));
    }
}
