//! Which part of a weight a rank holds, from the op's tensor-parallel role: the one
//! rule used to initialise shards, to slice the reference for `--check`, and to read
//! local sizes while computing.

use meshplan_ir::graph::{ExpertWeight, OpKind};
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
        let (f, c) = (n / 2, n / 2 / tp.size);
        return [0, f]
            .map(|h| (h + tp.rank * c, h + (tp.rank + 1) * c))
            .to_vec();
    }
    let c = n / tp.size;
    vec![(tp.rank * c, (tp.rank + 1) * c)]
}

/// (heads, kv heads, head dim) if `op` produces the input of a rope or attention op.
fn qkv_shape(graph: &Graph, op: &Op) -> Option<(u64, u64, usize)> {
    let mut cur = *op.outputs.first()?;
    // Follow through a rope op to the attention core.
    for _ in 0..2 {
        for o in graph.ops() {
            if o.inputs.first() != Some(&cur) {
                continue;
            }
            match &o.kind {
                OpKind::Attention(a) => return Some((a.heads, a.kv_heads, a.qk_dim as usize)),
                OpKind::Rope => cur = *o.outputs.first()?,
                _ => {}
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
    graph.ops().any(|o| {
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

/// What a rank holds of a `[rows, cols]` weight (a 1-D weight is one row).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardSpec {
    /// Everything.
    All,
    /// These column ranges of every row, in order.
    Cols(Vec<(usize, usize)>),
    /// These rows, whole.
    Rows(usize, usize),
}

/// The part of dense weight `w` (full shape `shape`) that `op` under `role` needs
/// on tensor rank `tp`, as index ranges: what [`local_weight`] copies out of the
/// full tensor, and a Hugging Face checkpoint reads of its files.
pub fn shard_spec(
    graph: &Graph,
    op: &Op,
    role: TpRole,
    w: TensorId,
    shape: &[usize],
    tp: TpPos,
) -> ShardSpec {
    if tp.size <= 1 {
        return ShardSpec::All;
    }
    let is_bias = shape.len() == 1 && op.inputs.get(2) == Some(&w);
    let rows_of = |rows: usize| {
        let c = rows / tp.size;
        ShardSpec::Rows(tp.rank * c, (tp.rank + 1) * c)
    };
    match role {
        // A head reading a table tied to the embedding (`bsh,vh->bsv`) splits the
        // table's vocabulary rows, as the embedding does.
        TpRole::VocabHead if shape.len() == 2 && weight_transposed(op) => rows_of(shape[0]),
        TpRole::ColumnParallel | TpRole::VocabHead => {
            let n = *shape.last().unwrap_or(&1);
            ShardSpec::Cols(column_ranges(graph, op, n, tp))
        }
        TpRole::RowParallel if !is_bias => rows_of(shape[0]),
        TpRole::VocabEmbedding => rows_of(shape[0]),
        _ => ShardSpec::All,
    }
}

/// Whether every weight's split over `tp` tensor ranks (and a routed experts op's
/// over `ep`) covers the whole tensor. The rules above take floor shares, so a
/// vocabulary or a width that the axis does not divide would lose its last rows or
/// columns without a word: a smaller model than the plan's. Such a plan is refused
/// before any rank starts, naming the weight.
pub(crate) fn check_split(graph: &Graph, tp: usize, ep: usize) -> Result<(), String> {
    let uneven = |w: &str, op: &str, n: String, by: &str| {
        Err(format!(
            "`{w}` of `{op}`: {n} does not split evenly over {by}, and the executor would drop \
             the rest; plan with a degree that divides it (or pad the model's size to a \
             multiple of it; the vocabulary with --make-vocab-size-divisible-by 128, as \
             Megatron-LM does)"
        ))
    };
    for op in graph.ops() {
        for &w in &op.inputs {
            let t = graph.tensor(w);
            let Ok(shape) = crate::program::fixed_shape(t) else {
                continue;
            };
            if t.kind != meshplan_ir::TensorKind::Weight {
                continue;
            }
            if op.role == TpRole::Experts {
                let (&[e, r, c], Some(part)) = (shape.as_slice(), ExpertWeight::of(op, w)) else {
                    continue;
                };
                if ep > 1 && e % ep != 0 {
                    return uneven(&t.name, &op.name, e.to_string(), &format!("ep={ep}"));
                }
                let by_tp = part.hidden_width(r as u64, c as u64) as usize;
                let halves = part == ExpertWeight::Up { gated: true };
                if ep <= 1
                    && tp > 1
                    && (!by_tp.is_multiple_of(tp) || (halves && !c.is_multiple_of(2)))
                {
                    return uneven(&t.name, &op.name, by_tp.to_string(), &format!("tp={tp}"));
                }
                continue;
            }
            let (Some(&rows), Some(&cols)) = (shape.first(), shape.last()) else {
                continue;
            };
            let spec = |rank| shard_spec(graph, op, op.role, w, &shape, TpPos { rank, size: tp });
            let (n, mut held) = match spec(0) {
                ShardSpec::All => continue,
                ShardSpec::Rows(..) => (rows, vec![false; rows]),
                ShardSpec::Cols(_) => (cols, vec![false; cols]),
            };
            for rank in 0..tp {
                let ranges = match spec(rank) {
                    ShardSpec::Rows(a, b) => vec![(a, b)],
                    ShardSpec::Cols(c) => c,
                    ShardSpec::All => vec![(0, n)],
                };
                for (a, b) in ranges {
                    held[a.min(n)..b.min(n)].fill(true);
                }
            }
            if held.contains(&false) {
                let n = if swiglu_up(graph, op) {
                    format!("each of its gate and up halves, {},", n / 2)
                } else {
                    n.to_string()
                };
                return uneven(&t.name, &op.name, n, &format!("tp={tp}"));
            }
        }
    }
    Ok(())
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
    let runs = held_runs(graph, (op, role, w), shape, tp, ep);
    let mut out = Vec::with_capacity(runs.iter().map(|r| r.len()).sum());
    for r in runs {
        out.extend_from_slice(&full[r]);
    }
    out
}

/// Where [`local_weight`]'s values sit in the full tensor: runs of consecutive
/// elements (row-major with `shape`), in the order the rank holds them. Seeded
/// weights draw only these elements, so a rank of `tp` draws its share and not the
/// whole tensor.
#[allow(clippy::single_range_in_vec_init)] // lists of runs, some of one run
pub fn held_runs(
    graph: &Graph,
    (op, role, w): (&Op, TpRole, TensorId),
    shape: &[usize],
    tp: TpPos,
    ep: TpPos,
) -> Vec<std::ops::Range<usize>> {
    let len: usize = shape.iter().product();
    if role == TpRole::Experts {
        return match ExpertWeight::of(op, w) {
            Some(part) => expert_runs(len, (shape, part), tp, ep),
            None => vec![0..len],
        };
    }
    match shard_spec(graph, op, role, w, shape, tp) {
        ShardSpec::All => vec![0..len],
        ShardSpec::Rows(a, b) => {
            let n = len / shape.first().copied().unwrap_or(1).max(1);
            vec![a * n..b * n]
        }
        ShardSpec::Cols(ranges) => {
            let n = shape.last().copied().unwrap_or(1).max(1);
            (0..len / n)
                .flat_map(|row| ranges.iter().map(move |&(a, b)| row * n + a..row * n + b))
                .collect()
        }
    }
}

/// Expert weights: `[experts, h, up]` and `[experts, f, h]` split by expert over
/// the expert axis when ep > 1; otherwise each expert's MLP is split over the tensor
/// axis like a dense one (up by column, each of a gated one's halves apart; down by
/// row).
#[allow(clippy::single_range_in_vec_init)] // as in held_runs
fn expert_runs(
    len: usize,
    (shape, part): (&[usize], ExpertWeight),
    tp: TpPos,
    ep: TpPos,
) -> Vec<std::ops::Range<usize>> {
    let &[e, r, c] = shape else {
        return vec![0..len];
    };
    if ep.size > 1 {
        let per = e / ep.size;
        return vec![ep.rank * per * r * c..(ep.rank + 1) * per * r * c];
    }
    if tp.size <= 1 {
        return vec![0..len];
    }
    let mut out = Vec::new();
    for x in 0..e {
        let m = x * r * c;
        match part {
            // Up `[h, 2f]` as [gate | up], or `[h, f]`: this rank's columns of each
            // half, or of the whole width.
            ExpertWeight::Up { gated } => {
                let halves: &[usize] = if gated { &[0, c / 2] } else { &[0] };
                let w = part.hidden_width(r as u64, c as u64) as usize / tp.size;
                for row in 0..r {
                    for h in halves {
                        let start = m + row * c + h;
                        out.push(start + tp.rank * w..start + (tp.rank + 1) * w);
                    }
                }
            }
            // Down `[f, h]`: this rank's rows.
            ExpertWeight::Down => {
                let rows = r / tp.size;
                out.push(m + tp.rank * rows * c..m + (tp.rank + 1) * rows * c);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA: &str = "name: t\ntransformer: {layers: 1, hidden: 16, heads: 4, kv_heads: 2, ffn_hidden: 32, mlp: swiglu, norm: rmsnorm, vocab: 32, tie_embeddings: false, position: rope}\ndtype: f32\nworkload: {kind: inference, prompt_len: 4, output_len: 4}\n";

    fn graph(yaml: &str) -> Graph {
        let spec = meshplan_ir::load::parse_model_yaml(yaml, "test.yaml").unwrap();
        meshplan_ir::model_graph(&spec).unwrap()
    }

    fn op<'g>(g: &'g Graph, name: &str) -> &'g Op {
        let mut ops = g.ops();
        ops.find(|o| o.name == name).unwrap()
    }

    /// Rank 1 of 2's slice of input `i` of op `name` (full values `0, 1, 2, ...`).
    fn slice_on_rank_1(g: &Graph, name: &str, i: usize, shape: &[usize]) -> Vec<usize> {
        let o = op(g, name);
        let full: Vec<usize> = (0..shape.iter().product()).collect();
        let tp = TpPos { rank: 1, size: 2 };
        local_weight(g, o, o.role, o.inputs[i], &full, shape, tp, TpPos::ONE)
    }

    /// Hidden 16, 4 query heads and 2 kv heads of width 4, vocabulary 32, on rank 1
    /// of 2 (hand-worked): the fused `q | k | v` projection `[16, 32]` keeps of each
    /// row query columns 8..16 (heads 2, 3), key columns 20..24 and value columns
    /// 28..32 (kv head 1); the output projection `[16, 16]` keeps rows 8..16; the
    /// embedding `[32, 16]` vocabulary rows 16..32; the final norm's weight stays
    /// whole.
    #[test]
    fn tensor_rank_slices_by_role() {
        let g = graph(LLAMA);
        let qkv = slice_on_rank_1(&g, "block.attn.qkv", 1, &[16, 32]);
        let row: Vec<usize> = (8..16).chain(20..24).chain(28..32).collect();
        let want: Vec<usize> = (0..16)
            .flat_map(|r| row.iter().map(move |c| r * 32 + c))
            .collect();
        assert_eq!(qkv, want);
        let proj = slice_on_rank_1(&g, "block.attn.proj", 1, &[16, 16]);
        assert_eq!(proj, (128..256).collect::<Vec<_>>());
        let embed = slice_on_rank_1(&g, "embed.tokens", 0, &[32, 16]);
        assert_eq!(embed, (256..512).collect::<Vec<_>>());
        let norm = slice_on_rank_1(&g, "head.norm", 1, &[16]);
        assert_eq!(norm, (0..16).collect::<Vec<_>>());
    }

    /// Experts split over tp (ep = 1) on rank 1 of 2, each weight told apart by its
    /// operand and the activation, not by its shape (hand-worked; 2 experts, hidden
    /// 16):
    /// - SwiGLU of width 4: up `[2, 16, 8]` is `[gate | up]` and no wider than
    ///   tall; each row keeps gate columns 2..4 and up columns 6..8. Down
    ///   `[2, 4, 16]` keeps rows 2..4 of each expert.
    /// - GELU of width 16: up `[2, 16, 16]` keeps columns 8..16 of each row (the
    ///   shape alone would have read it as a down projection: rows 8..16).
    #[test]
    fn expert_weights_split_by_their_part_not_their_shape() {
        let moe = |mlp: &str, f: u64| {
            LLAMA.replace(
                "mlp: swiglu",
                &format!("mlp: {mlp}, moe: {{experts: 2, top_k: 1, expert_ffn_hidden: {f}}}"),
            )
        };
        let g = graph(&moe("swiglu", 4));
        let up = slice_on_rank_1(&g, "block.moe.experts", 2, &[2, 16, 8]);
        let want: Vec<usize> = (0..32)
            .flat_map(|row| [2, 3, 6, 7].map(|c| row * 8 + c))
            .collect();
        assert_eq!(up, want);
        let down = slice_on_rank_1(&g, "block.moe.experts", 3, &[2, 4, 16]);
        let want: Vec<usize> = (32..64).chain(96..128).collect();
        assert_eq!(down, want);
        let g = graph(&moe("gelu", 16));
        let up = slice_on_rank_1(&g, "block.moe.experts", 2, &[2, 16, 16]);
        let want: Vec<usize> = (0..32)
            .flat_map(|row| (8..16).map(move |c| row * 16 + c))
            .collect();
        assert_eq!(up, want);
    }

    /// A head tied to the embedding (`[vocab, hidden]`, read transposed) holds the
    /// vocabulary rows the embedding holds: 16..32 of 32 on rank 1 of 2.
    #[test]
    fn tied_head_reads_vocabulary_rows() {
        let g = graph(&LLAMA.replace("tie_embeddings: false", "tie_embeddings: true"));
        let head = op(&g, "head.lm");
        assert!(weight_transposed(head));
        let tp = TpPos { rank: 1, size: 2 };
        let spec = shard_spec(&g, head, TpRole::VocabHead, head.inputs[1], &[32, 16], tp);
        assert_eq!(spec, ShardSpec::Rows(16, 32));
        let rows = slice_on_rank_1(&g, "head.lm", 1, &[32, 16]);
        assert_eq!(rows, (256..512).collect::<Vec<_>>());
        assert!(!weight_transposed(op(&g, "block.attn.qkv")));
    }

    #[test]
    fn kv_heads_split_or_replicated() {
        // 4 query heads, 2 kv heads.
        assert_eq!(local_heads(4, 2, TpPos { rank: 1, size: 2 }), (2, 1, 1));
        assert_eq!(local_heads(4, 2, TpPos { rank: 3, size: 4 }), (1, 1, 1));
        assert_eq!(local_heads(4, 2, TpPos { rank: 1, size: 4 }), (1, 1, 0));
        assert_eq!(local_heads(8, 8, TpPos { rank: 1, size: 2 }), (4, 4, 4));
    }
}
