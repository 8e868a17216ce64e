//! One configuration evaluated end to end: training (pipeline simulated, data-parallel
//! reduction overlapped with backward, optimizer step) and inference (prefill and
//! decode). The same function serves `estimate`, `compare`, the planner's search and
//! the executor's predicted column.

use crate::calib;
use crate::cluster::{Cluster, GroupShape};
use crate::collective::{bytes_sent_per_rank, Collective, CommModel};
use crate::compute::Roofline;
use crate::framework::Mechanisms;
use crate::graph_cost::{LayoutCtx, PreparedGraph, SegCost};
use crate::memory::{model_states, MemoryLedger};
use crate::pipeline::{simulate, PipelineInput};
use crate::timeline::{InferenceTimeline, StageTail, TrainTimeline};
use meshplan_ir::{DimEnv, ParallelConfig, Recompute, SegmentKind, Workload};
use serde::Serialize;

/// Compute, exposed communication and bubble; they add up to the step time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TimeBreakdown {
    /// Kernels on the busiest GPU, recomputation and optimizer included (training: and
    /// the framework's host work per step, `calib::STEP_OVERHEAD_S`).
    pub compute: f64,
    /// Communication not hidden behind compute.
    pub exposed_comm: f64,
    /// Pipeline idle time.
    pub bubble: f64,
}

/// Bytes one GPU sends per step, by mesh axis.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CommBytes {
    /// Data axis (gradient reduction, ZeRO gathers).
    pub dp: f64,
    /// Tensor axis.
    pub tp: f64,
    /// Pipeline sends.
    pub pp: f64,
    /// Context axis.
    pub cp: f64,
    /// Expert axis.
    pub ep: f64,
}

/// The contract's estimate keys.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// Fits in memory and in the SLO (inference).
    pub feasible: bool,
    /// The configuration.
    pub config: ParallelConfig,
    /// One optimizer step (training) or one decode step (inference).
    pub step_time_s: f64,
    /// Tokens per second, whole cluster (output tokens for inference).
    pub tokens_per_s: f64,
    /// Model FLOPs (no recomputation) per second per GPU, in TFLOP/s.
    pub model_tflops_per_gpu: f64,
    /// Executed FLOPs (with recomputation) per second per GPU, in TFLOP/s.
    pub hardware_tflops_per_gpu: f64,
    /// Model FLOP utilisation.
    pub mfu: f64,
    /// Hardware FLOP utilisation.
    pub hfu: f64,
    /// Memory of the fullest GPU.
    pub memory_per_gpu_bytes: MemoryLedger,
    /// Where the step time goes.
    pub time_breakdown_s: TimeBreakdown,
    /// Bytes sent per GPU per step.
    pub comm_bytes_per_gpu: CommBytes,
    /// Micro-batches per step per pipeline.
    pub microbatches: u64,
    /// Bubble over step time.
    pub bubble_fraction: f64,
    /// GPU memory capacity.
    pub memory_capacity_bytes: f64,
    /// Inference: time to first token, s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_s: Option<f64>,
    /// Inference: time per output token, s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpot_s: Option<f64>,
    /// Inference: generated tokens per second, whole deployment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens_per_s: Option<f64>,
    /// Inference: requests whose KV cache fits at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u64>,
    /// Inference: KV cache tokens that fit, whole deployment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_capacity_tokens: Option<f64>,
    /// Why the configuration does not fit, when it does not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub infeasible_reason: Option<String>,
}

/// A configuration that cannot run at all on this model (as opposed to one that
/// runs out of memory, which is an [`Estimate`] with `feasible: false`).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{reason}")]
pub struct Unsupported {
    /// What does not fit together, with the arithmetic.
    pub reason: String,
}

fn unsupported(reason: String) -> Unsupported {
    Unsupported { reason }
}

/// Checks that the degrees use every GPU exactly once.
fn check_world_size(cfg: &ParallelConfig, gpus: u64) -> Result<(), Unsupported> {
    if cfg.world_size() == gpus {
        return Ok(());
    }
    Err(unsupported(format!(
        "dp({}) * tp({}) * pp({}) * cp({}) = {} != GPUs({gpus})",
        cfg.dp,
        cfg.tp,
        cfg.pp,
        cfg.cp,
        cfg.world_size()
    )))
}

/// [`check_shapes`] plus the rules of training: expert parallelism with `tp > 1`
/// needs sequence parallelism, as in Megatron-Core, so that each tensor rank
/// dispatches its own slice of the tokens (otherwise every tensor rank holds the
/// same tokens and would route them again).
pub fn check_train_shapes(
    pg: &PreparedGraph,
    cfg: &ParallelConfig,
    seq: u64,
) -> Result<(), Unsupported> {
    check_shapes(pg, cfg, seq)?;
    if pg.kv_heads > 0 && !cfg.dp_attention && !pg.kv_heads.is_multiple_of(cfg.tp) {
        // A key/value head copied on several tensor ranks would get a partial
        // gradient on each; Megatron-LM requires the split too.
        return Err(unsupported(format!(
            "kv_heads({}) % tp({}) != 0: training splits key/value heads over tp; copied kv heads are for inference",
            pg.kv_heads, cfg.tp
        )));
    }
    if pg.tied && cfg.pp > 1 && (cfg.zero >= 3 || (cfg.zero == 2 && cfg.dp * cfg.cp > 1)) {
        return Err(unsupported(format!(
            "tied embeddings on pp({}) stages with zero={}: the first and last stage reduce the shared table's gradient once per step, before the data axis shards it, and ZeRO-{} shards gradients in every micro-batch; use zero <= 1 or untie the embeddings",
            cfg.pp, cfg.zero, cfg.zero
        )));
    }
    if pg.experts > 0 && cfg.ep > 1 && cfg.tp > 1 && !cfg.sp {
        return Err(unsupported(format!(
            "ep({}) > 1 with tp({}) > 1 needs sp=true: each tensor rank dispatches its own slice of the tokens",
            cfg.ep, cfg.tp
        )));
    }
    Ok(())
}

/// Checks the degrees against the model's shapes.
pub fn check_shapes(pg: &PreparedGraph, cfg: &ParallelConfig, seq: u64) -> Result<(), Unsupported> {
    if pg.heads > 0 && !cfg.dp_attention && !pg.heads.is_multiple_of(cfg.tp) {
        return Err(unsupported(format!(
            "heads({}) % tp({}) != 0: tp must divide the attention heads",
            pg.heads, cfg.tp
        )));
    }
    if pg.kv_heads > 0
        && !cfg.dp_attention
        && !pg.kv_heads.is_multiple_of(cfg.tp)
        && !cfg.tp.is_multiple_of(pg.kv_heads)
    {
        return Err(unsupported(format!(
            "kv_heads({}) and tp({}): one must divide the other (kv heads are split or replicated over tp)",
            pg.kv_heads, cfg.tp
        )));
    }
    if !seq.is_multiple_of(cfg.cp) {
        return Err(unsupported(format!(
            "seq_len({seq}) % cp({}) != 0: cp must divide the sequence",
            cfg.cp
        )));
    }
    if cfg.ep > 1 && pg.experts == 0 {
        return Err(unsupported(format!(
            "ep({}) > 1 on a dense model: ep applies to MoE layers",
            cfg.ep
        )));
    }
    if pg.experts > 0 && !pg.experts.is_multiple_of(cfg.ep) {
        return Err(unsupported(format!(
            "experts({}) % ep({}) != 0: ep must divide the experts",
            pg.experts, cfg.ep
        )));
    }
    let chunks = cfg.pp * cfg.vpp;
    if pg.layers < chunks {
        return Err(unsupported(format!(
            "layers({}) < pp({}) * vpp({}) = {chunks}: every model chunk needs a layer",
            pg.layers, cfg.pp, cfg.vpp
        )));
    }
    if cfg.zero > 3 {
        return Err(unsupported(format!(
            "zero({}) must be 0, 1, 2 or 3",
            cfg.zero
        )));
    }
    Ok(())
}

/// The data-parallel degree of expert weights: the stage's ranks over ep when experts
/// are split by expert, the dense data axis when they are split over tp (ep = 1).
pub fn expert_dp_of(cfg: &ParallelConfig) -> u64 {
    if cfg.ep > 1 {
        (cfg.dp * cfg.cp * cfg.tp / cfg.ep).max(1)
    } else {
        cfg.dp * cfg.cp
    }
}

/// Where the axes sit: tensor innermost, then context, data, and pipeline outermost
/// (Megatron's order), experts on a contiguous block of ranks.
#[derive(Clone, Copy, Debug)]
pub struct Groups {
    /// Tensor axis.
    pub tp: GroupShape,
    /// Context axis.
    pub cp: GroupShape,
    /// Data axis for dense weights (`dp * cp` ranks).
    pub dp: GroupShape,
    /// Expert axis.
    pub ep: GroupShape,
    /// Data axis for expert weights.
    pub edp: GroupShape,
    /// The first and the last pipeline stage (a tied embedding's two holders).
    pub embed: GroupShape,
    /// Consecutive pipeline stages share a node.
    pub pp_same_node: bool,
}

impl Groups {
    /// Groups of `cfg` on `cluster`.
    pub fn new(cfg: &ParallelConfig, gpn: u64) -> Groups {
        let dense_dp = cfg.dp * cfg.cp;
        let stage = cfg.tp * cfg.cp * cfg.dp;
        // Experts split over ep (ep > 1) take the rest of the stage as their data axis;
        // with ep = 1 they are split over tp like the dense weights and share dp.
        let edp = if cfg.ep > 1 {
            (stage / cfg.ep).max(1)
        } else {
            dense_dp
        };
        Groups {
            tp: GroupShape::of_axis(cfg.tp, 1, gpn),
            cp: GroupShape::of_axis(cfg.cp, cfg.tp, gpn),
            // The dense gradient group spans the context ranks too (inner to dp).
            dp: GroupShape::of_axis(dense_dp, cfg.tp, gpn),
            ep: GroupShape::of_axis(cfg.ep, 1, gpn),
            edp: if cfg.ep > 1 {
                GroupShape::of_axis(edp, cfg.ep, gpn)
            } else {
                GroupShape::of_axis(dense_dp, cfg.tp, gpn)
            },
            embed: GroupShape::of_axis(2, (cfg.pp.max(2) - 1) * stage, gpn),
            pp_same_node: stage < gpn,
        }
    }
}

/// Per-chunk sums of segment costs.
#[derive(Clone, Copy, Debug, Default)]
struct Chunk {
    compute_f: f64,
    compute_b: f64,
    comm_f: f64,
    comm_b: f64,
    act: f64,
    transient: f64,
    params_dense: f64,
    params_expert: f64,
    tp_bytes: f64,
    tp_bytes_fwd: f64,
    ep_bytes_fwd: f64,
    cp_bytes: f64,
    ep_bytes: f64,
    recompute_comm: f64,
    seq_partial: f64,
    layers: f64,
}

impl Chunk {
    fn add(&mut self, c: &SegCost, n: f64) {
        // Recomputation's own communication is part of `recompute_s`; split it out so
        // compute and communication are reported apart.
        let recompute_comm =
            if c.recompute_s > 0.0 && c.flops_recompute >= c.flops_fwd && c.flops_fwd > 0.0 {
                c.comm_fwd_s
            } else {
                0.0
            };
        self.compute_f += n * c.fwd_s;
        self.compute_b += n * (c.bwd_s + c.recompute_s - recompute_comm);
        self.comm_f += n * c.comm_fwd_s;
        self.comm_b += n * (c.comm_bwd_s + recompute_comm);
        self.recompute_comm += n * recompute_comm;
        self.act += n * c.act_bytes;
        self.transient = self.transient.max(c.act_transient_bytes);
        self.params_dense += n * c.params_dense;
        self.params_expert += n * c.params_expert;
        self.seq_partial += n * c.params_seq_partial;
        self.tp_bytes += n * c.tp_bytes;
        self.tp_bytes_fwd += n * c.tp_bytes_fwd;
        self.ep_bytes_fwd += n * c.ep_bytes_fwd;
        self.cp_bytes += n * c.cp_bytes;
        self.ep_bytes += n * c.ep_bytes;
    }
}

/// The contiguous split of the block layers into `chunks` non-empty model chunks
/// whose busiest chunk (its layers' work, plus the embedding on the first chunk and
/// the head on the last) is lightest: the time-balanced split the stage DP finds when
/// memory does not bind, computed in `O(layers * log)` so the sweep can price every
/// pipeline configuration at it. `None` when the even split is as good (or there is
/// one chunk), so even splits stay the default.
///
/// A bottleneck `B` is feasible iff packing chunks greedily from the last one
/// (each as full as `B` allows, leaving a layer for every chunk before it) covers the
/// layers; feasibility is monotone in `B`, so the smallest is found by bisection.
/// Packing from the back leaves the earlier stages, which hold the most in-flight
/// activations under 1F1B, the fewer layers.
pub fn balanced_split(pg: &PreparedGraph, costs: &[SegCost], chunks: usize) -> Option<Vec<u64>> {
    let layers = pg.layers as usize;
    if chunks <= 1 || layers < chunks {
        return None;
    }
    let work = |c: &SegCost| c.fwd_s + c.bwd_s + c.recompute_s + c.comm_fwd_s + c.comm_bwd_s;
    let (mut first, mut last) = (0.0, 0.0);
    let mut blocks: Vec<(f64, usize)> = Vec::new();
    for ((kind, repeat), c) in pg.segment_kinds().zip(costs) {
        match kind {
            SegmentKind::Embed => first += work(c),
            SegmentKind::Head => last += work(c),
            SegmentKind::Block => blocks.push((work(c), repeat as usize)),
        }
    }
    balance_layers(first, last, &blocks, chunks)
}

/// [`balanced_split`] on plain numbers: the work `first` on chunk 0 and `last` on the
/// last chunk, and runs of identical block layers `(work, count)` in model order.
pub fn balance_layers(
    first: f64,
    last: f64,
    blocks: &[(f64, usize)],
    chunks: usize,
) -> Option<Vec<u64>> {
    let layers: usize = blocks.iter().map(|b| b.1).sum();
    if chunks <= 1
        || layers < chunks
        || blocks.iter().any(|b| !b.0.is_finite() || b.0 < 0.0)
        || !(first + last).is_finite()
    {
        return None;
    }
    let extra =
        |j: usize| (if j == 0 { first } else { 0.0 }) + (if j == chunks - 1 { last } else { 0.0 });
    let even_split = even_layer_split(layers as u64, chunks as u64, 1);
    let even = |j: usize| even_split[j];
    // Identical layers (the common case): a chunk's capacity under a bottleneck is a
    // division, and the best bottleneck is `k` layers plus one of the extras, so a
    // bisection over `k` per extra finds it without building a list.
    let t0 = blocks[0].0;
    if t0 > 0.0 && blocks.iter().all(|b| b.0 == t0) {
        let cap = |b: f64, j: usize| ((b - extra(j)) / t0 * (1.0 + 1e-12)).floor();
        // Layers per chunk under bottleneck `b`, packed from the last chunk into `n`.
        let fill = |b: f64, n: &mut [u64]| -> bool {
            let mut left = layers as f64;
            for j in (1..chunks).rev() {
                let k = cap(b, j).min(left - j as f64);
                if k < 1.0 {
                    return false;
                }
                n[j] = k as u64;
                left -= k;
            }
            n[0] = left as u64;
            left >= 1.0 && left <= cap(b, 0)
        };
        // Whether bottleneck `b` fits, in O(1): every chunk holds a layer, and the
        // capacities (the first, the middle ones alike, the last) cover the layers.
        let fits = |b: f64| -> bool {
            let (c0, cl) = (cap(b, 0), cap(b, chunks - 1));
            let mid = chunks.saturating_sub(2) as f64;
            let cm = if chunks > 2 { cap(b, 1) } else { f64::INFINITY };
            c0 >= 1.0
                && cl >= 1.0
                && cm >= 1.0
                && c0 + mid * cm.min(layers as f64) + cl >= layers as f64
        };
        let mut split = vec![0u64; chunks];
        let mut best = f64::INFINITY;
        for e in [0.0, first, last, first + last] {
            if !fits(layers as f64 * t0 + e) {
                continue;
            }
            let (mut lo, mut hi) = (1usize, layers);
            while lo < hi {
                let mid = (lo + hi) / 2;
                if fits(mid as f64 * t0 + e) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            best = best.min(lo as f64 * t0 + e);
        }
        if !best.is_finite() || !fill(best, &mut split) {
            return None;
        }
        let load = |n: &dyn Fn(usize) -> u64| {
            (0..chunks)
                .map(|j| extra(j) + n(j) as f64 * t0)
                .fold(0.0f64, f64::max)
        };
        let lighter = load(&|j| split[j]) < load(&even) * (1.0 - 1e-9);
        return lighter.then_some(split);
    }
    let t: Vec<f64> = blocks
        .iter()
        .flat_map(|&(w, n)| std::iter::repeat_n(w, n))
        .collect();
    // Layers per chunk under bottleneck `b`, or None if it does not fit.
    let pack = |b: f64| -> Option<Vec<u64>> {
        let mut n = vec![0u64; chunks];
        let mut end = layers; // layers end..layers are placed
        for j in (0..chunks).rev() {
            let mut load = extra(j);
            let mut start = end;
            let keep = j; // one layer for each earlier chunk
            if j == 0 {
                start = 0;
                load += t[..end].iter().sum::<f64>();
            } else {
                while start > keep && (start == end || load + t[start - 1] <= b) {
                    load += t[start - 1];
                    start -= 1;
                }
            }
            if start == end || load > b {
                return None;
            }
            n[j] = (end - start) as u64;
            end = start;
        }
        Some(n)
    };
    let load_of = |n: &[u64]| {
        let mut at = 0usize;
        n.iter()
            .enumerate()
            .map(|(j, &k)| {
                let w = extra(j) + t[at..at + k as usize].iter().sum::<f64>();
                at += k as usize;
                w
            })
            .fold(0.0f64, f64::max)
    };
    let even_b = load_of(&even_split);
    let total: f64 = t.iter().sum::<f64>() + first + last;
    let mut lo = (total / chunks as f64).max(t.iter().copied().fold(0.0, f64::max));
    let mut hi = even_b;
    if pack(lo).is_some() {
        hi = lo;
    } else {
        for _ in 0..64 {
            let mid = 0.5 * (lo + hi);
            if pack(mid).is_some() {
                hi = mid;
            } else {
                lo = mid;
            }
            if hi - lo <= 1e-6 * hi {
                break;
            }
        }
    }
    let split = pack(hi)?;
    // Only a strictly lighter bottleneck is worth an uneven split.
    (load_of(&split) < even_b * (1.0 - 1e-9)).then_some(split)
}

#[cfg(test)]
mod balance_tests {
    use super::balance_layers;

    #[test]
    fn a_heavy_head_takes_layers_off_the_last_stage() {
        // 6 layers of 1 s over 4 stages, the embedding 1.5 s on the first: the even
        // split [2, 2, 1, 1] has a 3.5 s bottleneck (2 layers + embedding); a
        // bottleneck of 2.5 s holds (stage 0 needs a layer + 1.5 s), packed from the
        // back: [1, 1, 2, 2]. With the 1.5 s on the last stage instead the even split
        // is already as good (2, 2, 1, 1 + 1.5).
        assert_eq!(
            balance_layers(1.5, 0.0, &[(1.0, 6)], 4),
            Some(vec![1, 1, 2, 2])
        );
        assert_eq!(balance_layers(0.0, 1.5, &[(1.0, 6)], 4), None);
        // GPT-3's 96 layers over 20 stages, embedding 0.5 and head 2.0 layers of
        // work: a bottleneck of 5 fits 3 + 5 x 18 + 3 (3.5 on stage 0, 5 on the
        // last); 4.5 fits only 4 + 4 x 18 + 2 = 78 layers. Evenly the last stage
        // holds 5 layers and the head: 7.
        let mut want = vec![5u64; 20];
        (want[0], want[19]) = (3, 3);
        assert_eq!(balance_layers(0.5, 2.0, &[(1.0, 96)], 20), Some(want));
    }

    #[test]
    fn an_even_split_that_is_as_good_stays_even() {
        // 8 layers over 4 stages with no extra work: 2 each is optimal.
        assert_eq!(balance_layers(0.0, 0.0, &[(1.0, 8)], 4), None);
        assert_eq!(balance_layers(0.0, 0.0, &[(1.0, 8)], 1), None);
    }

    #[test]
    fn different_layers_balance_by_work() {
        // Two dense layers of 1 s then four MoE layers of 2 s over 2 stages: 10 s of
        // work, 5 s each at best: [dense, dense, moe] = 4 s, [moe x3] = 6 s; or
        // [dense, dense, moe, moe] = 6 s and [moe, moe] = 4 s: 6 s is the best
        // bottleneck, and the even split [3, 3] (4 s / 6 s) is as good.
        assert_eq!(balance_layers(0.0, 0.0, &[(1.0, 2), (2.0, 4)], 2), None);
        // With a 3 s head on the last stage the first stage takes 4 layers (6 s)
        // and the last 2 MoE layers + head (7 s), against 3 + 6 = 9 s evenly.
        assert_eq!(
            balance_layers(0.0, 3.0, &[(1.0, 2), (2.0, 4)], 2),
            Some(vec![4, 2])
        );
    }
}

/// The even split of `layers` block layers over `pp` stages of `vpp` chunks each
/// (chunk `c * pp + i` is stage `i`'s `c`-th): every chunk holds `layers / (pp vpp)`
/// layers and the first `layers mod (pp vpp)` chunks one more, so no stage holds more
/// than one layer more than another (126 layers over 16 stages of 7 chunks: every
/// stage 7 or 8 layers, not two stages of 14).
pub fn even_layer_split(layers: u64, pp: u64, vpp: u64) -> Vec<u64> {
    let chunks = pp.max(1) * vpp.max(1);
    let (base, rem) = (layers / chunks, layers % chunks);
    (0..chunks).map(|j| base + u64::from(j < rem)).collect()
}

/// Splits the segments' costs into the `pp x vpp` model chunks: the embedding on the
/// first chunk, the head on the last, and the blocks by `split` (layers per chunk, in
/// chunk order) or by [`even_layer_split`].
fn build_chunks(
    pg: &PreparedGraph,
    costs: &[SegCost],
    pp: u64,
    vpp: u64,
    split: Option<&[u64]>,
) -> (Vec<Chunk>, f64) {
    let chunks = (pp * vpp) as usize;
    let mut out = vec![Chunk::default(); chunks];
    let even;
    let split = match split {
        Some(s) => s,
        None => {
            even = even_layer_split(pg.layers, pp, vpp);
            &even
        }
    };
    // Chunk j holds layers bounds[j]..bounds[j + 1].
    let bounds: Vec<usize> = std::iter::once(0)
        .chain(split.iter().scan(0usize, |acc, &n| {
            *acc += n as usize;
            Some(*acc)
        }))
        .collect();
    let mut layer = 0usize;
    let mut shared = 0.0;
    for ((kind, repeat), c) in pg.segment_kinds().zip(costs) {
        match kind {
            SegmentKind::Embed => {
                out[0].add(c, 1.0);
                shared = c.params_shared;
            }
            SegmentKind::Head => out[chunks - 1].add(c, 1.0),
            SegmentKind::Block => {
                let (start, end) = (layer, layer + repeat as usize);
                for (j, ch) in out.iter_mut().enumerate() {
                    let (lo, hi) = (bounds[j], bounds[j + 1]);
                    let n = hi.min(end).saturating_sub(lo.max(start));
                    if n > 0 {
                        ch.add(c, n as f64);
                        ch.layers += n as f64;
                    }
                }
                layer = end;
            }
        }
    }
    // With one chunk the tied embedding is held once, not twice.
    if chunks == 1 {
        out[0].params_dense -= shared;
    }
    (out, shared)
}

/// Model FLOPs of one sequence's forward pass (matrix products and attention).
fn forward_flops_per_sequence(pg: &PreparedGraph, env: &DimEnv) -> f64 {
    pg.segment_kinds()
        .zip(pg.segment_forward_flops(env))
        .map(|((_, r), f)| r as f64 * f)
        .sum()
}

/// The layout context of a training configuration: what [`LayoutCtx::price`] needs to
/// price each segment for one micro-batch.
pub fn train_ctx(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
) -> LayoutCtx {
    let groups = Groups::new(cfg, cluster.gpus_per_node);
    let seq = seq_len as f64;
    LayoutCtx {
        tp: cfg.tp,
        cp: cfg.cp,
        ep: cfg.ep,
        sp: cfg.sp && cfg.tp > 1,
        attn: cfg.attn,
        recompute: cfg.recompute,
        env: DimEnv {
            batch: cfg.mbs as f64,
            seq,
            kv: seq,
        },
        roof: Roofline::new(cluster, pg.dtype),
        comm: CommModel::new(cluster),
        tp_group: groups.tp,
        cp_group: groups.cp,
        ep_group: groups.ep,
        dp_attention: false,
        dpa_amortized: false,
        tp_overlap: cfg.tp_overlap,
        sampling: false,
    }
}

/// Estimates one training configuration, blocks split evenly over pipeline chunks.
pub fn estimate_train(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    global_batch: u64,
) -> Result<Estimate, Unsupported> {
    estimate_train_split(pg, cluster, cfg, seq_len, global_batch, None)
}

/// Estimates one training configuration with `split[j]` block layers on model chunk
/// `j` (chunk `c * pp + i` is stage `i`'s `c`-th virtual chunk); `None` splits evenly.
pub fn estimate_train_split(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    global_batch: u64,
    split: Option<&[u64]>,
) -> Result<Estimate, Unsupported> {
    estimate_train_split_with(
        pg,
        cluster,
        cfg,
        seq_len,
        global_batch,
        split,
        &Mechanisms::default(),
    )
}

/// [`estimate_train_split`] as framework `mech` runs the configuration.
pub fn estimate_train_split_with(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    global_batch: u64,
    split: Option<&[u64]>,
    mech: &Mechanisms,
) -> Result<Estimate, Unsupported> {
    estimate_train_with(
        pg,
        cluster,
        cfg,
        seq_len,
        global_batch,
        split,
        f64::INFINITY,
        mech,
    )?
    .ok_or_else(|| unsupported(format!("{cfg}: the step time is not a number")))
}

/// [`estimate_train_split`], or `None` as soon as a lower bound of the step time
/// (the busiest stage's work plus the data-parallel tail) exceeds `bound_s`: a search
/// holding candidates faster than `bound_s` need not simulate the schedule.
pub fn estimate_train_bounded(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    global_batch: u64,
    split: Option<&[u64]>,
    bound_s: f64,
) -> Result<Option<Estimate>, Unsupported> {
    estimate_train_with(
        pg,
        cluster,
        cfg,
        seq_len,
        global_batch,
        split,
        bound_s,
        &Mechanisms::default(),
    )
}

/// [`estimate_train_bounded`] as framework `mech` runs the configuration.
#[allow(clippy::too_many_arguments)]
pub fn estimate_train_with(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    global_batch: u64,
    split: Option<&[u64]>,
    bound_s: f64,
    mech: &Mechanisms,
) -> Result<Option<Estimate>, Unsupported> {
    Ok(train_impl(
        pg,
        cluster,
        cfg,
        seq_len,
        global_batch,
        split,
        bound_s,
        false,
        false,
        mech,
    )?
    .map(|(e, _, _)| e))
}

/// [`estimate_train_bounded`] at the [`balanced_split`] of the layers (the even split
/// where that is as good, or where the balanced one does not fit in memory): the
/// price the search sweeps every configuration at, with the split it used (`None`:
/// even).
pub fn estimate_train_balanced_bounded(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    global_batch: u64,
    bound_s: f64,
) -> Result<Option<(Estimate, Option<LayerSplit>)>, Unsupported> {
    estimate_train_balanced_with(
        pg,
        cluster,
        cfg,
        seq_len,
        global_batch,
        bound_s,
        &Mechanisms::default(),
    )
}

/// [`estimate_train_balanced_bounded`] as framework `mech` runs the configuration.
pub fn estimate_train_balanced_with(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    global_batch: u64,
    bound_s: f64,
    mech: &Mechanisms,
) -> Result<Option<(Estimate, Option<LayerSplit>)>, Unsupported> {
    let run = |balance| {
        train_impl(
            pg,
            cluster,
            cfg,
            seq_len,
            global_batch,
            None,
            bound_s,
            false,
            balance,
            mech,
        )
    };
    match run(true)? {
        Some((e, _, Some(_))) if !e.feasible => Ok(run(false)?.map(|(e, _, _)| (e, None))),
        other => Ok(other.map(|(e, _, split)| (e, split))),
    }
}

/// [`estimate_train_split`] with the schedule it simulated: per virtual stage the
/// forward and backward times (and their communication), the pipeline transfer, each
/// stage's step tail (exposed gradient reduction, tensor-axis sync, optimizer) and
/// memory. [`Timeline::spans`](crate::timeline::Timeline::spans) replays the same simulation task by task.
pub fn train_timeline(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    global_batch: u64,
    split: Option<&[u64]>,
) -> Result<(Estimate, TrainTimeline), Unsupported> {
    train_timeline_with(
        pg,
        cluster,
        cfg,
        seq_len,
        global_batch,
        split,
        &Mechanisms::default(),
    )
}

/// [`train_timeline`] as framework `mech` runs the configuration.
pub fn train_timeline_with(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    global_batch: u64,
    split: Option<&[u64]>,
    mech: &Mechanisms,
) -> Result<(Estimate, TrainTimeline), Unsupported> {
    match train_impl(
        pg,
        cluster,
        cfg,
        seq_len,
        global_batch,
        split,
        f64::INFINITY,
        true,
        false,
        mech,
    )? {
        Some((e, Some(t), _)) => Ok((e, t)),
        _ => Err(unsupported(format!("{cfg}: the step time is not a number"))),
    }
}

/// Block layers per model chunk.
pub type LayerSplit = Vec<u64>;

/// Seconds one pass (forward or backward) of one micro-batch keeps a GPU's share of
/// its node's NICs busy with the stage's own traffic: `cp_bytes` and `ep_bytes` (sent
/// per micro-batch, both passes) where their groups span nodes, half in each pass,
/// and one pipeline transfer of `p2p_bytes` where consecutive stages sit on
/// different nodes, each over the per-GPU inter-node bandwidth.
pub fn nic_busy_per_pass(
    comm: &CommModel,
    groups: &Groups,
    cp_bytes: f64,
    ep_bytes: f64,
    p2p_bytes: f64,
    pipelined: bool,
) -> f64 {
    let be = comm.inter.bandwidth_bytes_per_s;
    let mut bytes = 0.0;
    if groups.cp.nodes() > 1 {
        bytes += cp_bytes / 2.0;
    }
    if groups.ep.nodes() > 1 {
        bytes += ep_bytes / 2.0;
    }
    if pipelined && !groups.pp_same_node {
        bytes += p2p_bytes;
    }
    bytes / be
}

/// ZeRO-3 communication of one micro-batch on one stage: what stays exposed and what
/// runs beside compute.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Zero3Exposure {
    /// Seconds the stage waits on gathers and scatters.
    pub exposed_s: f64,
    /// Seconds of communication that overlap compute.
    pub hidden_s: f64,
}

/// ZeRO-2's data-parallel time in a step of `m` micro-batches, `(exposed,
/// hidden)`: a reduce-scatter of `rs` seconds per micro-batch and one all-gather of
/// `ag`. The last micro-batch's scatter and the gather run in its backward's
/// `window`, as ZeRO-1's do, the last of `buckets` always exposed; each earlier
/// scatter beside the next micro-batch's forward and backward (`next`).
pub fn zero2_exposure(
    (rs, ag): (f64, f64),
    (window, next): (f64, f64),
    buckets: f64,
    m: f64,
) -> (f64, f64) {
    let last = rs + ag;
    let e_last = (last - window).max(last / buckets.max(1.0));
    let e_mid = (rs - next).max(0.0);
    let earlier = (m - 1.0).max(0.0);
    (
        e_last + earlier * e_mid,
        (last - e_last) + earlier * (rs - e_mid),
    )
}

/// ZeRO-3 / FSDP over `group` for one micro-batch of a stage holding `p_bytes` of
/// parameters (gradients `g_bytes`) in `layers` layers, whose forward takes `fwd_s`
/// and backward (recomputation included) `bwd_s`.
///
/// # Assumptions
/// - Parameters are gathered one layer at a time, `mech.zero3_calls_per_layer`
///   collectives per layer, each paying its ring latency: once for the forward and
///   once for the backward (the recomputed forward runs right before the layer's
///   backward and uses the same gather); each layer's gradients are reduce-scattered
///   after its backward.
/// - A layer's gather is issued `mech.zero3_prefetch_layers` layers ahead, so it hides
///   only behind that many layers' compute: the first gather of each pass and the last
///   scatter are exposed, and each other layer exposes what its communication exceeds
///   the compute in front of it.
#[allow(clippy::too_many_arguments)]
pub fn zero3_exposure(
    comm: &CommModel,
    group: GroupShape,
    p_bytes: f64,
    g_bytes: f64,
    layers: f64,
    fwd_s: f64,
    bwd_s: f64,
    mech: &Mechanisms,
) -> Zero3Exposure {
    let units = layers.max(1.0);
    let calls = mech.zero3_calls_per_layer.max(1.0);
    let gather = calls * comm.time_s(Collective::AllGather, group, p_bytes / (units * calls));
    let scatter = calls * comm.time_s(Collective::ReduceScatter, group, g_bytes / (units * calls));
    let d = mech.zero3_prefetch_layers.max(0.0);
    let (cf, cb) = (fwd_s / units, bwd_s / units);
    let fwd = gather + (units - 1.0) * (gather - d * cf).max(0.0);
    let bwd = gather + scatter + (units - 1.0) * (gather + scatter - d * cb).max(0.0);
    let total = units * (2.0 * gather + scatter);
    let exposed = (fwd + bwd).min(total);
    Zero3Exposure {
        exposed_s: exposed,
        hidden_s: total - exposed,
    }
}

/// What [`train_impl`] priced: the estimate, the schedule it simulated (when asked)
/// and the balanced split it chose (when asked to balance and it is not even).
type Priced = (Estimate, Option<TrainTimeline>, Option<LayerSplit>);

#[allow(clippy::too_many_arguments)]
fn train_impl(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    global_batch: u64,
    split: Option<&[u64]>,
    bound_s: f64,
    want_timeline: bool,
    balance: bool,
    mech: &Mechanisms,
) -> Result<Option<Priced>, Unsupported> {
    let gpus = cluster.gpus();
    check_world_size(cfg, gpus)?;
    check_train_shapes(pg, cfg, seq_len)?;
    let nchunks = (cfg.pp * cfg.vpp) as usize;
    if let Some(s) = split {
        if s.len() != nchunks || s.iter().sum::<u64>() != pg.layers {
            return Err(unsupported(format!(
                "a layer split must give {nchunks} chunks summing to {} layers, got {s:?}",
                pg.layers
            )));
        }
    }
    let groups = Groups::new(cfg, cluster.gpus_per_node);
    let ctx = train_ctx(pg, cluster, cfg, seq_len);
    let (roof, comm) = (ctx.roof, ctx.comm);
    let seq = seq_len as f64;
    let costs = ctx.price(pg);
    let balanced = if balance && split.is_none() {
        balanced_split(pg, &costs, nchunks)
    } else {
        None
    };
    let split = split.or(balanced.as_deref());
    let (chunks, shared) = build_chunks(pg, &costs, cfg.pp, cfg.vpp, split);
    let microbatches = global_batch.div_ceil(cfg.dp * cfg.mbs);
    if cfg.vpp > 1 && microbatches < cfg.pp {
        return Err(unsupported(format!(
            "the interleaved schedule needs at least pp({}) micro-batches, got {microbatches} = ceil(global_batch({global_batch}) / (dp({}) * mbs({})))",
            cfg.pp, cfg.dp, cfg.mbs
        )));
    }
    let m = microbatches as f64;

    // Pipeline.
    let bpe = pg.dtype.size_bytes() as f64;
    let grad_bpe = mech.grad_sum_bytes(bpe);
    // Without sequence parallelism each tensor rank sends its 1/tp slice and the
    // receiver gathers it over the tensor axis (Megatron's scatter-gather), unless the
    // framework's pipeline engine sends every tensor rank's whole copy; with sequence
    // parallelism the activation is already split along the sequence and stays so.
    let whole = cfg.tp > 1 && !ctx.sp && mech.p2p_whole_activation;
    let p2p_bytes = pg.boundary_bytes_per_token * cfg.mbs as f64 * seq
        / cfg.cp as f64
        / if cfg.tp > 1 && !whole {
            cfg.tp as f64
        } else {
            1.0
        };
    let p2p_gather = cfg.pp > 1 && cfg.tp > 1 && !ctx.sp && !whole;
    let p2p_s = if cfg.pp > 1 {
        comm.p2p_time_s(groups.pp_same_node, p2p_bytes)
            + if p2p_gather {
                comm.time_s(Collective::AllGather, groups.tp, p2p_bytes * cfg.tp as f64)
            } else {
                0.0
            }
    } else {
        0.0
    };
    // A blocking pipeline engine keeps the stage busy while it sends; every
    // micro-batch costs the stage the framework's host-side step.
    let held = if mech.p2p_blocking { p2p_s } else { 0.0 };
    let per_pass = held + cluster.constants.microbatch_overhead_s / (2.0 * cfg.vpp as f64);
    let fwd: Vec<f64> = chunks
        .iter()
        .map(|c| c.compute_f + c.comm_f + per_pass)
        .collect();
    let bwd: Vec<f64> = chunks
        .iter()
        .map(|c| c.compute_b + c.comm_b + per_pass)
        .collect();
    // Per stage: data-parallel reduction, optimizer, memory.
    let pp = cfg.pp as usize;
    let dense_dp = cfg.dp * cfg.cp;
    let expert_dp = expert_dp_of(cfg);
    let mut worst_mem = MemoryLedger::default();
    let mut worst_tail = 0.0f64;
    let mut dp_bytes_max = 0.0f64;
    let mut crit = (0.0f64, 0.0f64); // (compute, comm) of the busiest stage
    let mut stage_mem = Vec::with_capacity(pp);
    let mut sp_sync_bytes_stage: Vec<f64> = Vec::with_capacity(pp);
    let mut tied_bytes_stage: Vec<f64> = Vec::with_capacity(pp);
    let mut busiest_work = 0.0f64;
    let mut tails: Vec<StageTail> = Vec::with_capacity(if want_timeline { pp } else { 0 });
    let mut critical_stage = 0usize;
    // The busiest stage's compute and communication per step, as compared.
    let mut busiest_load = f64::NEG_INFINITY;
    for i in 0..pp {
        let mine: Vec<&Chunk> = (0..cfg.vpp as usize).map(|c| &chunks[c * pp + i]).collect();
        let dense: f64 = mine.iter().map(|c| c.params_dense).sum();
        let expert: f64 = mine.iter().map(|c| c.params_expert).sum();
        let compute: f64 = mine.iter().map(|c| c.compute_f + c.compute_b).sum::<f64>() * m;
        let comm_s: f64 = mine.iter().map(|c| c.comm_f + c.comm_b).sum::<f64>() * m;

        // Gradient reduction: AllReduce (ZeRO 0), ReduceScatter + AllGather (1), a
        // ReduceScatter per micro-batch + AllGather (2), per layer gathers and
        // scatters in every micro-batch (3).
        let fwd_mb: f64 = mine.iter().map(|c| c.compute_f).sum();
        let bwd_mb: f64 = mine.iter().map(|c| c.compute_b).sum();
        let last_bwd = bwd_mb / cfg.vpp as f64;
        let stage_layers: f64 = mine.iter().map(|c| c.layers).sum::<f64>().max(1.0);
        // The stage's own traffic across nodes in one micro-batch's forward or
        // backward (context ring, expert All-to-All, pipeline sends whose groups leave
        // the node) holds the NICs a data-parallel collective across nodes would use
        // beside it: the two share the links, so that time hides none of it.
        let nic_pass = nic_busy_per_pass(
            &comm,
            &groups,
            mine.iter().map(|c| c.cp_bytes).sum::<f64>(),
            mine.iter().map(|c| c.ep_bytes).sum::<f64>(),
            p2p_bytes,
            cfg.pp > 1,
        );
        let (dp_bytes, exposed_dp) = {
            let mut bytes = 0.0;
            let mut exposed = 0.0;
            // Communication that runs beside compute and slows it.
            let mut hidden = 0.0;
            for (params, group, n) in [
                (dense, groups.dp, dense_dp),
                (expert, groups.edp, expert_dp),
            ] {
                if n <= 1 || params <= 0.0 {
                    continue;
                }
                let shared = if group.nodes() > 1 { nic_pass } else { 0.0 };
                // Gradients travel in the framework's precision, never below the
                // compute dtype's; parameters as compute copies.
                let (p_bytes, g_bytes) = (params * bpe, params * grad_bpe);
                if cfg.zero >= 3 {
                    let b = 2.0 * bytes_sent_per_rank(Collective::AllGather, n, p_bytes)
                        + bytes_sent_per_rank(Collective::ReduceScatter, n, g_bytes);
                    bytes += b * m;
                    let z = zero3_exposure(
                        &comm,
                        group,
                        p_bytes,
                        g_bytes,
                        stage_layers,
                        (fwd_mb - shared).max(0.0),
                        (bwd_mb - shared).max(0.0),
                        mech,
                    );
                    exposed += z.exposed_s * m;
                    hidden += z.hidden_s * m;
                } else if cfg.zero == 2 {
                    // ZeRO-2 reduce-scatters every micro-batch's gradients (no rank
                    // holds them whole from one micro-batch to the next) and gathers
                    // the updated parameters once. The last micro-batch's scatter and
                    // the gather are exposed as ZeRO-1's are; each earlier scatter
                    // runs beside the next micro-batch's forward and backward.
                    let rs = comm.time_s(Collective::ReduceScatter, group, g_bytes);
                    let ag = comm.time_s(Collective::AllGather, group, p_bytes);
                    bytes += m * bytes_sent_per_rank(Collective::ReduceScatter, n, g_bytes)
                        + bytes_sent_per_rank(Collective::AllGather, n, p_bytes);
                    let buckets = (params / calib::DP_BUCKET_PARAMS).ceil().max(1.0);
                    let window = (last_bwd - shared / cfg.vpp as f64).max(0.0);
                    let next = (fwd_mb + bwd_mb - shared).max(0.0);
                    let (e, h) = zero2_exposure((rs, ag), (window, next), buckets, m);
                    exposed += e;
                    hidden += h;
                } else {
                    let t = if cfg.zero == 0 {
                        comm.time_s(Collective::AllReduce, group, g_bytes)
                    } else {
                        comm.time_s(Collective::ReduceScatter, group, g_bytes)
                            + comm.time_s(Collective::AllGather, group, p_bytes)
                    };
                    let b = if cfg.zero == 0 {
                        bytes_sent_per_rank(Collective::AllReduce, n, g_bytes)
                    } else {
                        bytes_sent_per_rank(Collective::ReduceScatter, n, g_bytes)
                            + bytes_sent_per_rank(Collective::AllGather, n, p_bytes)
                    };
                    bytes += b;
                    // Buckets reduce while the last micro-batch's backward runs; the
                    // last bucket is always exposed.
                    let buckets = (params / calib::DP_BUCKET_PARAMS).ceil().max(1.0);
                    let window = (last_bwd - shared / cfg.vpp as f64).max(0.0);
                    let e = (t - window).max(t / buckets);
                    exposed += e;
                    hidden += t - e;
                }
            }
            (
                bytes,
                exposed + cluster.constants.comm_compute_slowdown * hidden,
            )
        };
        // Sequence parallelism leaves norm gradients partial over the tensor axis:
        // one AllReduce of them per step, before the optimizer; under ZeRO-2 and -3
        // with data parallelism one per micro-batch (under ZeRO-3 per segment copy),
        // before the ReduceScatter leaves each rank a slice of them (as the plan
        // lowers it).
        let seq_partial: f64 = mine.iter().map(|c| c.seq_partial).sum();
        let (sp_sync_s, sp_sync_bytes) = if seq_partial > 0.0 {
            let per_mb = cfg.zero >= 2 && dense_dp > 1;
            let times = if per_mb { m } else { 1.0 };
            let g = seq_partial * grad_bpe;
            (
                times * comm.time_s(Collective::AllReduce, groups.tp, g),
                times * bytes_sent_per_rank(Collective::AllReduce, cfg.tp, g),
            )
        } else {
            (0.0, 0.0)
        };
        sp_sync_bytes_stage.push(sp_sync_bytes);
        // A table tied between embedding and head lives on the first and the last
        // stage: their gradients meet in one AllReduce per step (Megatron's embedding
        // group), before the data-parallel reduction, exposed like it.
        let (tied_s, tied_bytes) = if pp > 1 && shared > 0.0 && (i == 0 || i == pp - 1) {
            let g = shared * grad_bpe;
            (
                comm.time_s(Collective::AllReduce, groups.embed, g),
                bytes_sent_per_rank(Collective::AllReduce, 2, g),
            )
        } else {
            (0.0, 0.0)
        };
        let exposed_dp = exposed_dp + tied_s;
        tied_bytes_stage.push(tied_bytes);
        let opt_params = dense / if cfg.zero >= 1 { dense_dp as f64 } else { 1.0 }
            + expert / if cfg.zero >= 1 { expert_dp as f64 } else { 1.0 };
        // The update and the framework's host work per step.
        let optimizer_s = roof.memory_s(opt_params * calib::ADAMW_BYTES_PER_PARAM)
            + cluster.constants.step_overhead_s;
        let tail = exposed_dp + optimizer_s + sp_sync_s;
        worst_tail = worst_tail.max(tail);
        dp_bytes_max = dp_bytes_max.max(dp_bytes);
        if compute + comm_s > busiest_load {
            busiest_load = compute + comm_s;
            crit = (compute + optimizer_s, comm_s + exposed_dp);
            critical_stage = i;
        }
        if want_timeline {
            tails.push(StageTail {
                exposed_dp_s: exposed_dp,
                sp_sync_s,
                optimizer_s,
                memory: MemoryLedger::default(),
            });
        }

        // Memory.
        let hold = mech.holding(bpe);
        let (pd, gd, od) = model_states(dense, dense_dp, cfg.zero, hold);
        let (pe, ge, oe) = model_states(expert, expert_dp, cfg.zero, hold);
        let act_per_mb = mine.iter().map(|c| c.act).fold(0.0, f64::max);
        let transient = mine.iter().map(|c| c.transient).fold(0.0, f64::max);
        let bucket_buffers = 2.0 * (dense + expert).min(calib::DP_BUCKET_PARAMS) * bpe;
        stage_mem.push((
            MemoryLedger {
                params: pd + pe,
                grads: gd + ge,
                optimizer: od + oe,
                activations: transient,
                kv_cache: 0.0,
                workspace: calib::RUNTIME_RESERVED_BYTES + bucket_buffers,
                total: 0.0,
            },
            act_per_mb,
        ));
        // Stage i cannot start before micro-batch 0 has come through the stages before
        // it, nor finish before its last gradient has gone back through them.
        let stage_work: f64 = (0..cfg.vpp as usize)
            .map(|c| fwd[c * pp + i] + bwd[c * pp + i])
            .sum();
        let fill: f64 = (0..i).map(|j| fwd[j] + bwd[j] + 2.0 * p2p_s).sum();
        busiest_work = busiest_work.max(stage_work * m + fill);
    }
    // No schedule finishes before its busiest stage has done its work between the
    // pipeline's fill and drain: a search already holding better candidates skips the
    // simulation.
    if busiest_work + worst_tail > bound_s {
        return Ok(None);
    }
    let pipe = simulate(&PipelineInput {
        pp: cfg.pp as usize,
        vpp: cfg.vpp as usize,
        microbatches: microbatches as usize,
        forward_s: &fwd,
        backward_s: &bwd,
        p2p_s,
        schedule: cfg.schedule,
    });
    for (i, (mut ledger, act_per_mb)) in stage_mem.into_iter().enumerate() {
        ledger.activations += pipe.max_in_flight[i] as f64 * act_per_mb;
        let ledger = ledger.summed();
        if let Some(t) = tails.get_mut(i) {
            t.memory = ledger;
        }
        if ledger.total > worst_mem.total {
            worst_mem = ledger;
        }
    }
    let step = pipe.makespan_s + worst_tail;
    let compute = crit.0.min(step);
    let exposed_comm = crit.1.min(step - compute);
    let bubble = (step - compute - exposed_comm).max(0.0);

    // FLOPs: model FLOPs from the unsharded graph, recomputation on top.
    let global = LayoutCtx {
        tp: 1,
        cp: 1,
        ep: 1,
        sp: false,
        env: DimEnv {
            batch: 1.0,
            seq,
            kv: seq,
        },
        ..ctx
    }
    .price(pg);
    let fwd_per_seq = forward_flops_per_sequence(
        pg,
        &DimEnv {
            batch: 1.0,
            seq,
            kv: seq,
        },
    );
    let recompute_per_seq: f64 = pg
        .segment_kinds()
        .zip(&global)
        .filter(|((k, _), _)| *k == SegmentKind::Block)
        .map(|((_, r), c)| r as f64 * c.flops_recompute)
        .sum();
    let model_flops = 3.0 * fwd_per_seq * global_batch as f64;
    let hw_flops = model_flops + recompute_per_seq * global_batch as f64;
    let peak = roof.peak_flops;
    let model_tflops = model_flops / (gpus as f64 * step) / 1e12;
    let hw_tflops = hw_flops / (gpus as f64 * step) / 1e12;

    // Bytes of the stage that sends the most, over its chunks and micro-batches.
    let busiest = |field: fn(&Chunk) -> f64| {
        m * (0..pp)
            .map(|i| {
                (0..cfg.vpp as usize)
                    .map(|c| field(&chunks[c * pp + i]))
                    .sum::<f64>()
            })
            .fold(0.0, f64::max)
    };
    // Boundary transfers of stage i per step: an activation out of every chunk but
    // the model's last and a gradient out of every chunk but its first; receives mirror
    // sends.
    let transfers = |i: usize| {
        if cfg.pp <= 1 {
            return 0.0;
        }
        let mut n = 2.0 * cfg.vpp as f64;
        if i == 0 {
            n -= 1.0;
        }
        if i + 1 == pp {
            n -= 1.0;
        }
        n * m
    };
    let gather_sent = if p2p_gather {
        bytes_sent_per_rank(Collective::AllGather, cfg.tp, p2p_bytes * cfg.tp as f64)
    } else {
        0.0
    };
    let tp_bytes = (0..pp)
        .map(|i| {
            m * (0..cfg.vpp as usize)
                .map(|c| chunks[c * pp + i].tp_bytes)
                .sum::<f64>()
                + transfers(i) * gather_sent
                + sp_sync_bytes_stage[i]
        })
        .fold(0.0, f64::max);
    let cp_bytes = busiest(|c| c.cp_bytes);
    let ep_bytes = busiest(|c| c.ep_bytes);
    let pp_bytes = (0..pp)
        .map(|i| transfers(i) * p2p_bytes + tied_bytes_stage[i])
        .fold(0.0, f64::max);

    let capacity = cluster.gpu.memory_bytes;
    let feasible = worst_mem.total <= capacity;
    let infeasible_reason = (!feasible).then(|| {
        format!(
            "per-GPU memory {:.1} GiB > {:.1} GiB capacity (params {:.1}, grads {:.1}, optimizer {:.1}, activations {:.1} GiB)",
            gib(worst_mem.total),
            gib(capacity),
            gib(worst_mem.params),
            gib(worst_mem.grads),
            gib(worst_mem.optimizer),
            gib(worst_mem.activations)
        )
    });
    let timeline = want_timeline.then(|| TrainTimeline {
        pp: cfg.pp as usize,
        vpp: cfg.vpp as usize,
        microbatches: microbatches as usize,
        schedule: cfg.schedule,
        forward_s: fwd.clone(),
        backward_s: bwd.clone(),
        forward_comm_s: chunks.iter().map(|c| c.comm_f).collect(),
        backward_comm_s: chunks.iter().map(|c| c.comm_b).collect(),
        p2p_s,
        stages: tails,
        critical_stage,
        step_s: step,
        memory_capacity_bytes: cluster.gpu.memory_bytes,
    });
    let estimate = Estimate {
        feasible,
        config: *cfg,
        step_time_s: step,
        tokens_per_s: global_batch as f64 * seq / step,
        model_tflops_per_gpu: model_tflops,
        hardware_tflops_per_gpu: hw_tflops,
        mfu: model_tflops * 1e12 / peak,
        hfu: hw_tflops * 1e12 / peak,
        memory_per_gpu_bytes: worst_mem,
        time_breakdown_s: TimeBreakdown {
            compute,
            exposed_comm,
            bubble,
        },
        comm_bytes_per_gpu: CommBytes {
            dp: dp_bytes_max,
            tp: tp_bytes,
            pp: pp_bytes,
            cp: cp_bytes,
            ep: ep_bytes,
        },
        microbatches,
        bubble_fraction: bubble / step,
        memory_capacity_bytes: capacity,
        ttft_s: None,
        tpot_s: None,
        output_tokens_per_s: None,
        max_concurrency: None,
        kv_capacity_tokens: None,
        infeasible_reason,
    };
    Ok(Some((estimate, timeline, balanced)))
}

/// Bytes to GiB.
pub fn gib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0 * 1024.0)
}

/// Inference workload parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InferenceLoad {
    /// Prompt tokens per request.
    pub prompt_len: u64,
    /// Generated tokens per request.
    pub output_len: u64,
    /// Requests decoded together, whole deployment.
    pub concurrency: u64,
    /// Time-to-first-token bound, s.
    pub ttft_max_s: Option<f64>,
    /// Time-per-output-token bound, s.
    pub tpot_max_s: Option<f64>,
}

impl InferenceLoad {
    /// From a workload, if it is an inference one.
    pub fn from_workload(w: &Workload) -> Option<InferenceLoad> {
        match w {
            Workload::Inference {
                prompt_len,
                output_len,
                concurrency,
                slo,
                ..
            } => Some(InferenceLoad {
                prompt_len: *prompt_len,
                output_len: *output_len,
                concurrency: *concurrency,
                ttft_max_s: slo.as_ref().and_then(|s| s.ttft_ms).map(|v| v / 1e3),
                tpot_max_s: slo.as_ref().and_then(|s| s.tpot_ms).map(|v| v / 1e3),
            }),
            Workload::Train { .. } => None,
        }
    }
}

/// Estimates one inference configuration: prefill of one request for TTFT, a decode
/// step of the deployment's concurrent requests at the mean context for TPOT.
///
/// # Assumptions
/// `concurrency` requests are spread evenly over the `dp` replicas; pipeline stages
/// run one after another for one batch (no micro-batching across stages), so PP adds
/// capacity, not speed; the KV cache takes what memory the weights leave.
pub fn estimate_inference(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    load: &InferenceLoad,
) -> Result<Estimate, Unsupported> {
    inference_timeline(pg, cluster, cfg, load).map(|(e, _)| e)
}

/// [`estimate_inference`] with the timeline it assumed: each stage's prefill and
/// decode forward (and their communication), the hop between stages, and each stage's
/// memory.
pub fn inference_timeline(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    load: &InferenceLoad,
) -> Result<(Estimate, InferenceTimeline), Unsupported> {
    timeline_with(pg, cluster, cfg, load, false)
}

/// Seconds an instance spends per prompt of `prompt_len` tokens while prompts keep
/// its prefill busy (a serving pool's service time): one prompt's prefill, its
/// TTFT; under DP-attention the attention half at `1 / tp` of a prompt, the
/// attention ranks prefilling prompts of their own side by side
/// (`LayoutCtx::dpa_amortized`). A lone prompt's TTFT under DP-attention is longer:
/// its attention runs whole on one rank.
pub fn prefill_service_s(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    prompt_len: u64,
) -> Result<f64, Unsupported> {
    let load = InferenceLoad {
        prompt_len,
        output_len: 1,
        concurrency: 1,
        ttft_max_s: None,
        tpot_max_s: None,
    };
    let (_, t) = timeline_with(pg, cluster, cfg, &load, true)?;
    Ok(t.ttft_s)
}

/// [`inference_timeline`], its prefill (the TTFT) priced `amortized` under
/// DP-attention ([`prefill_service_s`]).
fn timeline_with(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    load: &InferenceLoad,
    amortized: bool,
) -> Result<(Estimate, InferenceTimeline), Unsupported> {
    let gpus = cluster.gpus();
    check_world_size(cfg, gpus)?;
    check_shapes(pg, cfg, load.prompt_len.max(cfg.cp))?;
    let groups = Groups::new(cfg, cluster.gpus_per_node);
    let roof = Roofline::new(cluster, pg.dtype);
    let comm = CommModel::new(cluster);
    let per_replica = load.concurrency.div_ceil(cfg.dp).max(1) as f64;
    let base = LayoutCtx {
        tp: cfg.tp,
        cp: cfg.cp,
        ep: cfg.ep,
        sp: false,
        attn: cfg.attn,
        recompute: Recompute::None,
        env: DimEnv {
            batch: 1.0,
            seq: load.prompt_len as f64,
            kv: load.prompt_len as f64,
        },
        roof,
        comm,
        tp_group: groups.tp,
        cp_group: groups.cp,
        ep_group: groups.ep,
        dp_attention: cfg.dp_attention,
        dpa_amortized: amortized,
        tp_overlap: cfg.tp_overlap,
        sampling: true,
    };
    let chunks_of = |ctx: &LayoutCtx| {
        let costs = ctx.price(pg);
        // Inference keeps no activations for backward: one layer's tensors are live at a time.
        let live = costs.iter().map(|c| c.act_bytes).fold(0.0, f64::max);
        (build_chunks(pg, &costs, cfg.pp, 1, None).0, live)
    };
    let bpe = pg.dtype.size_bytes() as f64;
    let hop = |tokens: f64| {
        if cfg.pp > 1 {
            comm.p2p_time_s(groups.pp_same_node, tokens * pg.boundary_bytes_per_token)
        } else {
            0.0
        }
    };
    let pp_hop = |tokens: f64| (cfg.pp.max(1) - 1) as f64 * hop(tokens);
    let forward_s = |chunks: &[crate::estimate::Chunk]| {
        chunks.iter().map(|c| c.compute_f + c.comm_f).sum::<f64>()
    };
    let (prefill, live_prefill) = chunks_of(&base);
    let ttft = forward_s(&prefill) + pp_hop(load.prompt_len as f64);
    let mean_ctx = load.prompt_len as f64 + load.output_len as f64 / 2.0;
    let decode_ctx = LayoutCtx {
        env: DimEnv {
            batch: per_replica,
            seq: 1.0,
            kv: mean_ctx,
        },
        cp: 1,
        // A step waits on the rank with the most requests.
        dpa_amortized: false,
        ..base
    };
    let (decode, live_decode) = chunks_of(&decode_ctx);
    let tpot = forward_s(&decode) + pp_hop(per_replica);

    // Memory: weights of the fullest stage, the larger of the two steps' live
    // activations, and the KV cache for this replica's share of requests.
    let weights = decode
        .iter()
        .map(|c| (c.params_dense + c.params_expert) * bpe)
        .fold(0.0, f64::max);
    let live = live_prefill.max(live_decode);
    let layers_per_stage = (pg.layers as f64 / cfg.pp as f64).ceil();
    // KV heads split over tp (replicated when fewer than tp); DP-attention keeps whole
    // heads but only this rank's requests.
    let kv_split = if cfg.dp_attention {
        cfg.tp as f64
    } else {
        (cfg.tp as f64).min(pg.kv_cache_heads.max(1) as f64)
    };
    let kv_per_token_gpu = layers_per_stage * pg.kv_bytes_per_token_layer / kv_split;
    let ctx_tokens = (load.prompt_len + load.output_len) as f64;
    let kv_need = per_replica * ctx_tokens * kv_per_token_gpu;
    let workspace = calib::RUNTIME_RESERVED_BYTES;
    let capacity = cluster.gpu.memory_bytes;
    let free = (capacity - weights - live - workspace).max(0.0);
    let kv_tokens_replica = if kv_per_token_gpu > 0.0 {
        free / kv_per_token_gpu * 1.0
    } else {
        f64::INFINITY
    };
    // A replica's KV tokens are spread over its tp ranks (or its requests over them).
    let kv_capacity_tokens = kv_tokens_replica * cfg.dp as f64;
    let max_concurrency = (kv_capacity_tokens / ctx_tokens)
        .floor()
        .min(u64::MAX as f64) as u64;
    let ledger = MemoryLedger {
        params: weights,
        grads: 0.0,
        optimizer: 0.0,
        activations: live,
        kv_cache: kv_need,
        workspace,
        total: 0.0,
    }
    .summed();
    let mut reasons = Vec::new();
    if ledger.total > capacity {
        reasons.push(format!(
            "per-GPU memory {:.1} GiB > {:.1} GiB capacity (weights {:.1}, KV cache {:.1} GiB)",
            gib(ledger.total),
            gib(capacity),
            gib(weights),
            gib(kv_need)
        ));
    }
    if let Some(b) = load.ttft_max_s {
        if ttft > b {
            reasons.push(format!("TTFT {:.1} ms > SLO {:.1} ms", ttft * 1e3, b * 1e3));
        }
    }
    if let Some(b) = load.tpot_max_s {
        if tpot > b {
            reasons.push(format!("TPOT {:.2} ms > SLO {:.2} ms", tpot * 1e3, b * 1e3));
        }
    }
    let timeline = InferenceTimeline {
        pp: cfg.pp as usize,
        prefill_s: prefill.iter().map(|c| c.compute_f + c.comm_f).collect(),
        prefill_comm_s: prefill.iter().map(|c| c.comm_f).collect(),
        decode_s: decode.iter().map(|c| c.compute_f + c.comm_f).collect(),
        decode_comm_s: decode.iter().map(|c| c.comm_f).collect(),
        hop_prefill_s: hop(load.prompt_len as f64),
        hop_decode_s: hop(per_replica),
        memory: decode
            .iter()
            .map(|c| {
                MemoryLedger {
                    params: (c.params_dense + c.params_expert) * bpe,
                    grads: 0.0,
                    optimizer: 0.0,
                    activations: live,
                    kv_cache: kv_need,
                    workspace,
                    total: 0.0,
                }
                .summed()
            })
            .collect(),
        ttft_s: ttft,
        tpot_s: tpot,
        memory_capacity_bytes: capacity,
    };
    let output_tps = load.concurrency as f64 / tpot;
    let flops_per_token = forward_flops_per_sequence(
        pg,
        &DimEnv {
            batch: 1.0,
            seq: 1.0,
            kv: mean_ctx,
        },
    );
    let tflops = output_tps * flops_per_token / gpus as f64 / 1e12;
    // Each GPU belongs to one stage: its bytes are its own stage's.
    let tp_bytes: f64 = decode.iter().map(|c| c.tp_bytes_fwd).fold(0.0, f64::max);
    let ep_bytes: f64 = decode.iter().map(|c| c.ep_bytes_fwd).fold(0.0, f64::max);
    let estimate = Estimate {
        feasible: reasons.is_empty(),
        config: *cfg,
        step_time_s: tpot,
        tokens_per_s: output_tps,
        model_tflops_per_gpu: tflops,
        hardware_tflops_per_gpu: tflops,
        mfu: tflops * 1e12 / roof.peak_flops,
        hfu: tflops * 1e12 / roof.peak_flops,
        memory_per_gpu_bytes: ledger,
        time_breakdown_s: TimeBreakdown {
            compute: decode.iter().map(|c| c.compute_f).sum(),
            exposed_comm: decode.iter().map(|c| c.comm_f).sum::<f64>() + pp_hop(per_replica),
            bubble: 0.0,
        },
        comm_bytes_per_gpu: CommBytes {
            dp: 0.0,
            tp: tp_bytes,
            pp: if cfg.pp > 1 {
                per_replica * pg.boundary_bytes_per_token
            } else {
                0.0
            },
            cp: 0.0,
            ep: ep_bytes,
        },
        microbatches: 1,
        bubble_fraction: 0.0,
        memory_capacity_bytes: capacity,
        ttft_s: Some(ttft),
        tpot_s: Some(tpot),
        output_tokens_per_s: Some(output_tps),
        max_concurrency: Some(max_concurrency),
        kv_capacity_tokens: Some(kv_capacity_tokens),
        infeasible_reason: (!reasons.is_empty()).then(|| reasons.join("; ")),
    };
    Ok((estimate, timeline))
}

/// Prepares a model for pricing: builds its graph and takes the KV-cache size from
/// the architecture (MLA caches a latent, not per-head keys and values).
pub fn prepare_model(spec: &meshplan_ir::ModelSpec) -> Result<PreparedGraph, meshplan_ir::IrError> {
    let graph = meshplan_ir::model_graph(spec)?;
    let mut pg = PreparedGraph::new(&graph);
    if let Some(t) = spec.transformer() {
        pg.set_kv_bytes_per_token_layer(t.kv_cache_bytes_per_token_per_layer(spec.dtype) as f64);
        if t.mla.is_some() {
            pg.kv_cache_heads = 1;
        }
    }
    Ok(pg)
}

/// FLOPs per token of the forward pass at a sequence length (attention at that context).
pub fn flops_per_token_forward(pg: &PreparedGraph, seq: u64) -> f64 {
    let s = seq as f64;
    forward_flops_per_sequence(
        pg,
        &DimEnv {
            batch: 1.0,
            seq: s,
            kv: s,
        },
    ) / s
}

/// Bytes per parameter of the model states (compute copy, gradients, fp32 masters
/// and AdamW's moments) of a model computing in `bpe` bytes per element, as
/// `framework` holds them, before ZeRO divides any: 18 for bf16 with fp32
/// gradients (Megatron-LM, meshplan's executor), the ZeRO paper's 16 with 2-byte
/// gradients (DeepSpeed), 16 for fp32 (no separate master).
pub fn state_bytes_per_param(framework: meshplan_ir::Framework, bpe: f64) -> f64 {
    let (p, g, o) = model_states(1.0, 1, 0, Mechanisms::of(framework).holding(bpe));
    p + g + o
}

/// The memory ledger of one unsharded replica: training states as the workload's
/// framework holds them ([`state_bytes_per_param`]) and the activations of one
/// sequence (flash attention, no recomputation), or for inference the weights and
/// the KV cache of the workload.
pub fn replica_memory(pg: &PreparedGraph, workload: &Workload) -> MemoryLedger {
    let roof = Roofline::uncalibrated(1e12, 1e12, calib::GEMM_EFFICIENCY_MAX);
    let one = GroupShape {
        size: 1,
        per_node: 1,
    };
    let link = crate::cluster::Link {
        bandwidth_bytes_per_s: 1e9,
        latency_s: 0.0,
    };
    let ctx = |seq: f64| LayoutCtx {
        tp: 1,
        cp: 1,
        ep: 1,
        sp: false,
        attn: meshplan_ir::AttnImpl::Flash,
        recompute: Recompute::None,
        env: DimEnv {
            batch: 1.0,
            seq,
            kv: seq,
        },
        roof,
        comm: CommModel::exact(link, link),
        tp_group: one,
        cp_group: one,
        ep_group: one,
        dp_attention: false,
        dpa_amortized: false,
        tp_overlap: false,
        sampling: false,
    };
    let p = pg.params_total;
    let bpe = pg.dtype.size_bytes() as f64;
    match workload {
        Workload::Train { seq_len, .. } => {
            let costs = ctx(*seq_len as f64).price(pg);
            let act: f64 = pg
                .segment_kinds()
                .zip(&costs)
                .map(|((_, r), c)| r as f64 * c.act_bytes)
                .sum();
            let hold = Mechanisms::of(workload.framework()).holding(bpe);
            let (params, grads, optimizer) = model_states(p, 1, 0, hold);
            MemoryLedger {
                params,
                grads,
                optimizer,
                activations: act,
                kv_cache: 0.0,
                workspace: calib::RUNTIME_RESERVED_BYTES,
                total: 0.0,
            }
            .summed()
        }
        Workload::Inference {
            prompt_len,
            output_len,
            concurrency,
            ..
        } => {
            let tokens = (*concurrency * (*prompt_len + *output_len)) as f64;
            MemoryLedger {
                params: p * bpe,
                grads: 0.0,
                optimizer: 0.0,
                activations: 0.0,
                kv_cache: crate::memory::kv_cache_bytes(
                    pg.layers,
                    tokens,
                    pg.kv_bytes_per_token_layer,
                ),
                workspace: calib::RUNTIME_RESERVED_BYTES,
                total: 0.0,
            }
            .summed()
        }
    }
}

#[cfg(test)]
mod zero2_tests {
    use super::zero2_exposure;

    #[test]
    fn zero2_exposes_what_its_windows_do_not_hide() {
        let close = |(a, b): (f64, f64), (x, y): (f64, f64)| {
            assert!(
                (a - x).abs() < 1e-12 && (b - y).abs() < 1e-12,
                "({a}, {b}) vs ({x}, {y})"
            );
        };
        // Scatter 0.3 s, gather 0.2 s, 4 micro-batches, 10 buckets. The last
        // micro-batch's 0.5 s against a 0.4 s backward: 0.1 s out (more than a
        // bucket's 0.05 s); each earlier 0.3 s scatter against 0.25 s of the next
        // micro-batch: 0.05 s out, three times. Exposed 0.25 s, hidden 0.4 + 3 x 0.25.
        close(
            zero2_exposure((0.3, 0.2), (0.4, 0.25), 10.0, 4.0),
            (0.25, 1.15),
        );
        // Windows of a second hide all but the last bucket: 0.05 s.
        close(
            zero2_exposure((0.3, 0.2), (1.0, 1.0), 10.0, 4.0),
            (0.05, 1.35),
        );
        // One micro-batch is ZeRO-1's reduction: scatter and gather in the backward.
        close(
            zero2_exposure((0.3, 0.2), (0.4, 0.25), 10.0, 1.0),
            (0.1, 0.4),
        );
    }
}

#[cfg(test)]
mod zero3_tests {
    use super::*;
    use crate::cluster::Link;

    fn exact() -> CommModel {
        let l = |gbps: f64| Link {
            bandwidth_bytes_per_s: gbps * 1e9,
            latency_s: 0.0,
        };
        CommModel::exact(l(300.0), l(25.0))
    }

    #[test]
    fn gathers_hide_behind_compute_until_the_per_layer_compute_is_shorter() {
        // 10B parameters in fp16 (20 GB, gradients 20 GB) in 40 layers, gathered over
        // 32 ranks on 4 nodes: a layer's 0.5 GB AllGather takes, pipelined, the larger
        // of 7/8 x 0.5 GB / 300 GB/s = 1.458 ms in the node and 3/4 x 0.5 GB / 8 /
        // 25 GB/s = 1.875 ms across: 1.875 ms; its ReduceScatter the same.
        let group = GroupShape {
            size: 32,
            per_node: 8,
        };
        let m = Mechanisms::of(meshplan_ir::Framework::Torchtitan).with_grad_bytes(2.0);
        let (g, s) = (1.875e-3, 1.875e-3);
        let total = 40.0 * (2.0 * g + s); // 225 ms per micro-batch
                                          // Compute-bound: 4 ms forward and 8 ms backward per layer (160 ms, 320 ms):
                                          // only the first gather of each pass and the last scatter wait.
        let z = zero3_exposure(&exact(), group, 20e9, 20e9, 40.0, 0.160, 0.320, &m);
        assert!((z.exposed_s - (g + g + s)).abs() < 1e-12, "{z:?}");
        assert!((z.hidden_s - (total - 3.0 * g)).abs() < 1e-12);
        // Communication-bound: 1 ms forward, 2 ms backward per layer: every later
        // layer exposes 0.875 ms forward and 1.75 ms backward:
        // 1.875 + 39 x 0.875 + 3.75 + 39 x 1.75 = 108.0 ms exposed.
        let z = zero3_exposure(&exact(), group, 20e9, 20e9, 40.0, 0.040, 0.080, &m);
        let want = 1.875e-3 + 39.0 * 0.875e-3 + 3.75e-3 + 39.0 * 1.75e-3;
        assert!(
            (z.exposed_s - want).abs() < 1e-12,
            "{} vs {want}",
            z.exposed_s
        );
        assert!((want - 0.108).abs() < 1e-12);
        assert!((z.exposed_s + z.hidden_s - total).abs() < 1e-12);
        // The crossover: a forward of exactly one gather per layer (1.875 ms, and a
        // backward of gather + scatter, 3.75 ms) is the last compute that hides it.
        let z = zero3_exposure(&exact(), group, 20e9, 20e9, 40.0, 0.075, 0.150, &m);
        assert!((z.exposed_s - 3.0 * g).abs() < 1e-12);
        let z = zero3_exposure(&exact(), group, 20e9, 20e9, 40.0, 0.074, 0.148, &m);
        assert!(z.exposed_s > 3.0 * g);
    }

    #[test]
    fn deepspeed_pays_the_ring_latency_once_per_parameter() {
        // With a 10 us step latency and 4 gathers per layer (DeepSpeed gathers each
        // weight), each gather of 1/4 of the layer pays the latency of the 2-node
        // ring (1 step across at 10 us) and of the 14 other in-node steps (10 us).
        let l = |gbps: f64| Link {
            bandwidth_bytes_per_s: gbps * 1e9,
            latency_s: 10e-6,
        };
        let comm = CommModel::exact(l(300.0), l(25.0));
        let group = GroupShape {
            size: 16,
            per_node: 8,
        };
        let one = zero3_exposure(
            &comm,
            group,
            1e3,
            1e3,
            1.0,
            0.0,
            0.0,
            &Mechanisms::default(),
        );
        let ds = zero3_exposure(
            &comm,
            group,
            1e3,
            1e3,
            1.0,
            0.0,
            0.0,
            &Mechanisms::of(meshplan_ir::Framework::Deepspeed),
        );
        // Tiny buffers: latency only. One collective: the in-node phase (7 steps,
        // 70 us) and the crossing (10 us) overlap: 70 us, plus 16 - 8 - 2 + 1 = 7
        // in-node steps = 70 us: 140 us; the exposure of 2 gathers + 1 scatter is
        // 3 x 140 us (plus the bytes, < 1 ns).
        assert!((one.exposed_s - 3.0 * 140e-6).abs() < 1e-8, "{one:?}");
        assert!((ds.exposed_s - 4.0 * one.exposed_s).abs() < 1e-7, "{ds:?}");
    }
}

#[cfg(test)]
mod nic_tests {
    use super::*;
    use crate::cluster::Link;

    #[test]
    fn traffic_that_leaves_the_node_holds_its_nics() {
        // tp=8 fills a node, so cp=2 spans two nodes: 1 GB of ring traffic per
        // micro-batch is 0.5 GB a pass, 20 ms at 25 GB/s per GPU; pp=2 puts the next
        // stage on another node too: +100 MB, 4 ms. Inside the node (tp=2, cp=2 on
        // 8-GPU nodes) the ring holds no NIC.
        let l = |gbps: f64| Link {
            bandwidth_bytes_per_s: gbps * 1e9,
            latency_s: 0.0,
        };
        let comm = CommModel::exact(l(300.0), l(25.0));
        let cfg = |text: &str, gpus: u64| {
            meshplan_ir::PartialConfig::parse(text, "test")
                .and_then(|c| c.resolve(gpus, "test"))
                .expect("config")
        };
        let across = Groups::new(&cfg("dp=2,cp=2,tp=8,pp=2", 64), 8);
        let t = nic_busy_per_pass(&comm, &across, 1e9, 0.0, 100e6, true);
        assert!((t - 0.024).abs() < 1e-12, "{t}");
        let inside = Groups::new(&cfg("dp=2,cp=2,tp=2", 8), 8);
        assert_eq!(
            nic_busy_per_pass(&comm, &inside, 1e9, 0.0, 100e6, false),
            0.0
        );
    }
}
