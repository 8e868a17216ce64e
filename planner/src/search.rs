//! The search driver: every configuration the topology allows, priced by the cost
//! model, the best kept.
//!
//! Two phases, because pricing must stay cheap (a few microseconds per configuration)
//! while the intra-op ILP and the stage DP cost milliseconds:
//!
//! 1. **Sweep.** Enumerate mesh shapes (tensor, context and expert axes inside a node
//!    first), micro-batch sizes, ZeRO stage, recomputation, sequence parallelism and
//!    virtual stages; prune those whose model states alone overflow a GPU (a lower
//!    bound, so nothing feasible is lost); price the rest in parallel under the
//!    layout the degrees name and an even layer split.
//! 2. **Refine.** For the best configurations, solve the intra-op ILP of each
//!    distinct submesh shape (placements found from costs, see [`crate::intra`]),
//!    split the layers with the stage DP ([`crate::stages`]), and price again. The
//!    refined step time is what the ranking and the plan report.

use crate::cost_model::estimate::{check_train_shapes, Estimate};
use crate::cost_model::memory::model_state_bytes;
use crate::cost_model::{
    calib, estimate_inference, estimate_train_bounded, estimate_train_split, train_ctx, Cluster,
    InferenceLoad, PreparedGraph,
};
use crate::layout::{Layout, LayoutCache, LayoutKey};
use crate::stages::{one_f_one_b_in_flight, partition, MemoryLimit, StageCosts};
use meshplan_ir::{
    AttnImpl, Graph, ParallelConfig, PartialConfig, Recompute, Schedule, SegmentKind,
};
use rayon::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Limits and preferences of one search.
#[derive(Clone, Debug)]
pub struct SearchOptions {
    /// Keys the user fixed (`--config` given to `plan`).
    pub fixed: PartialConfig,
    /// Candidates to return.
    pub top_k: usize,
    /// Configurations refined with the ILP and the stage DP.
    pub refine: usize,
    /// Stop after pricing this many configurations.
    pub max_candidates: u64,
    /// Stop after this many seconds of sweeping.
    pub time_limit_s: f64,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            fixed: PartialConfig::default(),
            top_k: 5,
            refine: 24,
            max_candidates: 20_000_000,
            time_limit_s: 60.0,
        }
    }
}

/// Why the search ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// Every configuration in the space was considered.
    Exhausted,
    /// `max_candidates` configurations were priced.
    CandidateBudget,
    /// `time_limit_s` passed.
    TimeLimit,
}

/// One priced configuration.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The configuration.
    pub cfg: ParallelConfig,
    /// Its prediction.
    pub estimate: Estimate,
    /// Block layers per model chunk, if the stage DP chose an uneven split.
    pub layer_split: Option<Vec<u64>>,
    /// The placements it was priced under (after refinement).
    pub layout: Option<Arc<Layout>>,
}

impl Candidate {
    /// The score to minimise: step time for training, time per output token for
    /// inference (the deployment's throughput is its inverse).
    fn score(&self) -> f64 {
        match self.estimate.output_tokens_per_s {
            Some(t) if t > 0.0 => 1.0 / t,
            _ => self.estimate.step_time_s,
        }
    }

    /// Layers per chunk, even unless the stage DP chose otherwise.
    pub fn split_or_even(&self, layers: u64) -> Vec<u64> {
        match &self.layer_split {
            Some(s) => s.clone(),
            None => {
                let n = self.cfg.pp * self.cfg.vpp;
                (0..n)
                    .map(|j| (j + 1) * layers / n - j * layers / n)
                    .collect()
            }
        }
    }
}

/// What a search found and what it cost.
#[derive(Clone, Debug)]
pub struct SearchReport {
    /// The best feasible candidates, best first.
    pub top: Vec<Candidate>,
    /// Configurations enumerated.
    pub enumerated: u64,
    /// Configurations priced by the cost model (including those whose pricing
    /// stopped at the lower bound, see `bounded`).
    pub evaluated: u64,
    /// Configurations dropped by the memory lower bound before pricing.
    pub pruned: u64,
    /// Configurations the model's shapes rule out (heads not divisible, ...).
    pub rejected: u64,
    /// One reason a configuration was ruled out (the first in sort order, so the
    /// report does not depend on thread timing).
    pub rejected_reason: Option<String>,
    /// Priced but over memory (or over the SLO). Depends on thread timing, like
    /// `bounded`: a configuration stopped at the bound is not checked for memory.
    pub infeasible: u64,
    /// Priced up to the pipeline simulation, then skipped because the step time's
    /// lower bound was already slower than the candidates held; how many depends on
    /// the order threads find good candidates in.
    pub bounded: u64,
    /// The infeasible configuration that came closest (smallest memory, or closest
    /// to the SLO), when nothing fits.
    pub closest_miss: Option<Candidate>,
    /// The pruned configuration with the smallest memory lower bound, and the bound.
    pub smallest_lower_bound: Option<(ParallelConfig, f64)>,
    /// Seconds, whole search.
    pub wall_s: f64,
    /// Seconds spent in the sweep.
    pub sweep_s: f64,
    /// Why the sweep ended.
    pub stop_reason: StopReason,
    /// Intra-op ILP problems solved.
    pub ilp_solves: u64,
    /// The LP solver.
    pub solver: &'static str,
    /// Inference: the best configuration for prefill alone (smallest TTFT).
    pub prefill_best: Option<Candidate>,
    /// Inference: the best configuration for decode alone (smallest TPOT).
    pub decode_best: Option<Candidate>,
}

/// The search could not start.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchError {
    /// Why.
    pub message: String,
}

impl std::fmt::Display for SearchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SearchError {}

/// Counts progress for a caller's progress bar.
#[derive(Debug, Default)]
pub struct Progress {
    /// Configurations enumerated (known once enumeration ends).
    pub total: AtomicU64,
    /// Configurations priced or pruned so far.
    pub done: AtomicU64,
}

/// Divisors of `n` in increasing order.
pub fn divisors(n: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            small.push(d);
            if d * d != n {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

fn pick<T: Copy>(fixed: Option<T>, all: &[T]) -> Vec<T> {
    match fixed {
        Some(v) => vec![v],
        None => all.to_vec(),
    }
}

fn pick_degree(fixed: Option<u64>, all: impl Iterator<Item = u64>) -> Vec<u64> {
    match fixed {
        Some(v) => vec![v],
        None => all.collect(),
    }
}

/// The training search space: every complete configuration consistent with `fixed`.
pub fn training_space(
    pg: &PreparedGraph,
    cluster: &Cluster,
    fixed: &PartialConfig,
    seq_len: u64,
    global_batch: u64,
) -> Vec<ParallelConfig> {
    let n = cluster.gpus();
    let gpn = cluster.gpus_per_node;
    let mut out = Vec::new();
    // Tensor parallelism stays inside a node, where NVLink carries its per-layer
    // collectives; context parallelism may cross nodes (its ring overlaps compute).
    let tps = pick_degree(
        fixed.tp,
        divisors(n)
            .into_iter()
            .filter(|&t| t <= gpn && gpn.is_multiple_of(t)),
    );
    for &tp in &tps {
        let cps = pick_degree(
            fixed.cp,
            divisors(n / tp.max(1))
                .into_iter()
                .filter(|&c| c <= 16 && seq_len.is_multiple_of(2 * c) || c == 1),
        );
        for &cp in &cps {
            if tp * cp == 0 || !n.is_multiple_of(tp * cp) {
                continue;
            }
            let pps = pick_degree(
                fixed.pp,
                divisors(n / (tp * cp))
                    .into_iter()
                    .filter(|&p| p <= pg.layers),
            );
            for &pp in &pps {
                if !n.is_multiple_of(tp * cp * pp) {
                    continue;
                }
                let dp = n / (tp * cp * pp);
                if fixed.dp.is_some_and(|d| d != dp) {
                    continue;
                }
                let eps = if pg.experts > 0 {
                    pick_degree(
                        fixed.ep,
                        divisors(dp * tp * cp)
                            .into_iter()
                            .filter(|&e| pg.experts.is_multiple_of(e)),
                    )
                } else {
                    vec![fixed.ep.unwrap_or(1)]
                };
                let per_replica = global_batch.div_ceil(dp);
                let mbss = pick_degree(
                    fixed.mbs,
                    (0..8)
                        .map(|i| 1u64 << i)
                        .filter(|&b| b <= per_replica.max(1)),
                );
                let zeros = pick(fixed.zero, if dp * cp > 1 { &[0, 1, 2, 3] } else { &[0] });
                let rcs = pick(
                    fixed.recompute,
                    &[Recompute::None, Recompute::Selective, Recompute::Full],
                );
                let sps = pick(fixed.sp, if tp > 1 { &[false, true] } else { &[false] });
                let vpps = pick_degree(
                    fixed.vpp,
                    [1u64, 2, 3, 4, 6, 8]
                        .into_iter()
                        .filter(|&v| v == 1 || (pp > 1 && pg.layers >= pp * v)),
                );
                for &ep in &eps {
                    for &mbs in &mbss {
                        for &vpp in &vpps {
                            let schedules = match fixed.schedule {
                                Some(s) => vec![s],
                                None if vpp > 1 => vec![Schedule::Interleaved],
                                None => vec![Schedule::OneFOneB],
                            };
                            for &schedule in &schedules {
                                if (vpp > 1) != (schedule == Schedule::Interleaved) {
                                    continue;
                                }
                                for &zero in &zeros {
                                    for &recompute in &rcs {
                                        for &sp in &sps {
                                            out.push(ParallelConfig {
                                                dp,
                                                tp,
                                                pp,
                                                cp,
                                                ep,
                                                mbs,
                                                zero,
                                                recompute,
                                                sp,
                                                vpp,
                                                schedule,
                                                dp_attention: false,
                                                attn: fixed.attn.unwrap_or(AttnImpl::Flash),
                                                tp_overlap: fixed.tp_overlap.unwrap_or(false),
                                            });
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// A lower bound of the per-GPU bytes of `cfg` (model states over every split that
/// could apply, plus the runtime's reserve): above capacity, the configuration cannot
/// fit whatever the activations.
pub fn memory_lower_bound(pg: &PreparedGraph, cfg: &ParallelConfig) -> f64 {
    let per_gpu_params = pg.params_total / (cfg.tp * cfg.pp * cfg.ep) as f64;
    let (p, g, o) = model_state_bytes(per_gpu_params, cfg.dp * cfg.cp, cfg.zero);
    p + g + o + calib::RUNTIME_RESERVED_BYTES
}

struct Sweep {
    best: Vec<Candidate>,
    smallest_lb: Option<(ParallelConfig, f64)>,
    /// The k-th best score once k candidates are held: anything slower cannot enter.
    bound: f64,
    /// Skipped because their step time's lower bound exceeded `bound`.
    bounded: u64,
    closest: Option<Candidate>,
    evaluated: u64,
    pruned: u64,
    rejected: u64,
    rejected_reason: Option<String>,
    infeasible: u64,
}

impl Sweep {
    fn reject(&mut self, why: String) {
        self.rejected += 1;
        if self.rejected_reason.as_ref().is_none_or(|r| why < *r) {
            self.rejected_reason = Some(why);
        }
    }

    fn new() -> Sweep {
        Sweep {
            best: Vec::new(),
            smallest_lb: None,
            bound: f64::INFINITY,
            bounded: 0,
            closest: None,
            evaluated: 0,
            pruned: 0,
            rejected: 0,
            rejected_reason: None,
            infeasible: 0,
        }
    }

    fn keep(&mut self, c: Candidate, k: usize) {
        self.best.push(c);
        if self.best.len() >= 2 * k.max(1) {
            self.trim(k);
        }
    }

    fn trim(&mut self, k: usize) {
        sort_candidates(&mut self.best);
        self.best.truncate(k);
        if self.best.len() >= k.max(1) {
            self.bound = self.bound.min(self.best[k.max(1) - 1].score());
        }
    }

    fn miss(&mut self, c: Candidate) {
        let better = match &self.closest {
            None => true,
            Some(o) => miss_distance(&c) < miss_distance(o),
        };
        if better {
            self.closest = Some(c);
        }
    }

    fn merge(mut self, other: Sweep, k: usize) -> Sweep {
        self.best.extend(other.best);
        self.trim(k);
        if let Some(c) = other.closest {
            self.miss(c);
        }
        self.evaluated += other.evaluated;
        self.pruned += other.pruned;
        self.rejected += other.rejected;
        if let Some(r) = other.rejected_reason {
            self.rejected -= 1;
            self.reject(r);
        }
        self.infeasible += other.infeasible;
        self.bounded += other.bounded;
        if let Some((c, b)) = other.smallest_lb {
            self.note_lb(c, b);
        }
        self
    }

    fn note_lb(&mut self, cfg: ParallelConfig, bytes: f64) {
        let smaller = match &self.smallest_lb {
            None => true,
            Some((o, b)) => bytes < *b || (bytes == *b && cfg.to_string() < o.to_string()),
        };
        if smaller {
            self.smallest_lb = Some((cfg, bytes));
        }
    }
}

/// How far an infeasible candidate is from fitting: memory over capacity, or the
/// worst SLO ratio.
fn miss_distance(c: &Candidate) -> f64 {
    let e = &c.estimate;
    let mem = e.memory_per_gpu_bytes.total / e.memory_capacity_bytes;
    mem.max(slo_ratio(e, None))
}

fn slo_ratio(e: &Estimate, load: Option<&InferenceLoad>) -> f64 {
    let Some(load) = load else { return 0.0 };
    let mut r: f64 = 0.0;
    if let (Some(max), Some(t)) = (load.ttft_max_s, e.ttft_s) {
        r = r.max(t / max);
    }
    if let (Some(max), Some(t)) = (load.tpot_max_s, e.tpot_s) {
        r = r.max(t / max);
    }
    r
}

/// Best first; ties broken by the configuration's text so the order is deterministic.
fn sort_candidates(v: &mut [Candidate]) {
    v.sort_by(|a, b| {
        a.score()
            .total_cmp(&b.score())
            .then_with(|| {
                a.estimate
                    .memory_per_gpu_bytes
                    .total
                    .total_cmp(&b.estimate.memory_per_gpu_bytes.total)
            })
            .then_with(|| a.cfg.to_string().cmp(&b.cfg.to_string()))
    });
}

/// Searches training configurations of `graph` (prepared as `pg`) on `cluster`.
pub fn search_train(
    graph: &Graph,
    pg: &PreparedGraph,
    cluster: &Cluster,
    seq_len: u64,
    global_batch: u64,
    opts: &SearchOptions,
    progress: Option<&Progress>,
) -> Result<SearchReport, SearchError> {
    let start = Instant::now();
    let space = training_space(pg, cluster, &opts.fixed, seq_len, global_batch);
    if space.is_empty() {
        return Err(SearchError {
            message: format!(
                "no configuration of {} GPUs satisfies the fixed keys {:?}",
                cluster.gpus(),
                opts.fixed
            ),
        });
    }
    if let Some(p) = progress {
        p.total.store(space.len() as u64, Ordering::Relaxed);
    }
    let capacity = cluster.gpu.memory_bytes;
    let keep = opts.refine.max(opts.top_k).max(1);
    let priced = AtomicU64::new(0);
    let mut stop = StopReason::Exhausted;
    let stop_flag = std::sync::atomic::AtomicU8::new(0);
    // The best k-th score any thread holds: a valid bound for every thread.
    let shared_bound = AtomicU64::new(f64::INFINITY.to_bits());
    let sweep = space
        .par_chunks(256)
        .fold(Sweep::new, |mut acc, chunk| {
            if stop_flag.load(Ordering::Relaxed) != 0 {
                return acc;
            }
            acc.bound = acc
                .bound
                .min(f64::from_bits(shared_bound.load(Ordering::Relaxed)));
            for cfg in chunk {
                let lb = memory_lower_bound(pg, cfg);
                if lb > capacity {
                    acc.pruned += 1;
                    acc.note_lb(*cfg, lb);
                    continue;
                }
                if let Err(e) = check_train_shapes(pg, cfg, seq_len) {
                    acc.reject(e.reason);
                    continue;
                }
                match estimate_train_bounded(
                    pg,
                    cluster,
                    cfg,
                    seq_len,
                    global_batch,
                    None,
                    acc.bound,
                ) {
                    Ok(None) => {
                        acc.evaluated += 1;
                        acc.bounded += 1;
                    }
                    Ok(Some(e)) => {
                        acc.evaluated += 1;
                        let c = Candidate {
                            cfg: *cfg,
                            estimate: e,
                            layer_split: None,
                            layout: None,
                        };
                        if c.estimate.feasible {
                            acc.keep(c, keep);
                        } else {
                            acc.infeasible += 1;
                            acc.miss(c);
                        }
                    }
                    Err(e) => acc.reject(e.reason),
                }
            }
            shared_bound.fetch_min(acc.bound.to_bits(), Ordering::Relaxed);
            if let Some(p) = progress {
                p.done.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
            let n = priced.fetch_add(chunk.len() as u64, Ordering::Relaxed) + chunk.len() as u64;
            if n >= opts.max_candidates {
                stop_flag.store(1, Ordering::Relaxed);
            } else if start.elapsed().as_secs_f64() > opts.time_limit_s {
                stop_flag.store(2, Ordering::Relaxed);
            }
            acc
        })
        .reduce(Sweep::new, |a, b| a.merge(b, keep));
    match stop_flag.load(Ordering::Relaxed) {
        1 => stop = StopReason::CandidateBudget,
        2 => stop = StopReason::TimeLimit,
        _ => {}
    }
    let sweep_s = start.elapsed().as_secs_f64();
    let mut sweep = sweep;
    sweep.trim(keep);

    // Refinement: the ILP's placements and the stage DP's split.
    let cache = LayoutCache::new(graph, cluster);
    let refined: Vec<Candidate> = sweep
        .best
        .par_iter()
        .map(|c| refine_train(c, graph, pg, cluster, &cache, seq_len, global_batch))
        .collect::<Result<Vec<_>, _>>()?;
    let mut top: Vec<Candidate> = refined
        .into_iter()
        .filter(|c| c.estimate.feasible)
        .collect();
    sort_candidates(&mut top);
    top.truncate(opts.top_k.max(1));
    Ok(SearchReport {
        top,
        enumerated: space.len() as u64,
        evaluated: sweep.evaluated,
        pruned: sweep.pruned,
        rejected: sweep.rejected,
        rejected_reason: sweep.rejected_reason.clone(),
        infeasible: sweep.infeasible,
        bounded: sweep.bounded,
        closest_miss: sweep.closest,
        smallest_lower_bound: sweep.smallest_lb,
        wall_s: start.elapsed().as_secs_f64(),
        sweep_s,
        stop_reason: stop,
        ilp_solves: cache.solves(),
        solver: crate::layout::SOLVER,
        prefill_best: None,
        decode_best: None,
    })
}

/// Per-micro-batch stage costs of a configuration for the stage DP.
pub fn stage_costs(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
) -> StageCosts {
    let ctx = train_ctx(pg, cluster, cfg, seq_len);
    let costs = ctx.price(pg);
    let state = |params: f64| {
        let (p, g, o) = model_state_bytes(params, cfg.dp * cfg.cp, cfg.zero);
        p + g + o
    };
    let mut sc = StageCosts::default();
    for ((kind, repeat), c) in pg.segment_kinds().zip(&costs) {
        let t = c.fwd_s + c.bwd_s + c.recompute_s + c.comm_fwd_s + c.comm_bwd_s;
        let stat = state(c.params_dense + c.params_expert);
        match kind {
            SegmentKind::Embed => {
                sc.first_time_s += t;
                sc.first_static_bytes += stat;
                sc.first_act_bytes += c.act_bytes;
            }
            SegmentKind::Head => {
                sc.last_time_s += t;
                sc.last_static_bytes += stat;
                sc.last_act_bytes += c.act_bytes;
            }
            SegmentKind::Block => {
                for _ in 0..repeat {
                    sc.layer_time_s.push(t);
                    sc.layer_static_bytes.push(stat);
                    sc.layer_act_bytes.push(c.act_bytes);
                }
            }
        }
    }
    sc
}

/// The stage DP's split for `cfg`, if it differs from the even one. With virtual
/// stages the DP balances the model chunks by time; with one chunk per stage it also
/// keeps each stage's model states and in-flight activations under the capacity.
pub fn dp_split(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    microbatches: u64,
) -> Option<Vec<u64>> {
    let chunks = (cfg.pp * cfg.vpp) as usize;
    if chunks <= 1 {
        return None;
    }
    let sc = stage_costs(pg, cluster, cfg, seq_len);
    let lim = (cfg.vpp == 1).then(|| MemoryLimit {
        in_flight: match cfg.schedule {
            Schedule::Gpipe => vec![microbatches as f64; chunks],
            _ => one_f_one_b_in_flight(chunks, microbatches as usize),
        },
        capacity_bytes: cluster.gpu.memory_bytes - calib::RUNTIME_RESERVED_BYTES,
    });
    partition(&sc, chunks, lim.as_ref()).map(|s| s.layers)
}

fn refine_train(
    c: &Candidate,
    graph: &Graph,
    pg: &PreparedGraph,
    cluster: &Cluster,
    cache: &LayoutCache,
    seq_len: u64,
    global_batch: u64,
) -> Result<Candidate, SearchError> {
    let cfg = &c.cfg;
    let layout = cache
        .get(LayoutKey::train(cfg, seq_len), graph, pg)
        .map_err(|message| SearchError { message })?;
    let lpg = layout.prepared.as_ref().unwrap_or(pg);
    let even = estimate_train_split(lpg, cluster, cfg, seq_len, global_batch, None)
        .map_err(|e| SearchError { message: e.reason })?;
    let mut best = Candidate {
        cfg: *cfg,
        estimate: even,
        layer_split: None,
        layout: Some(layout.clone()),
    };
    if let Some(split) = dp_split(lpg, cluster, cfg, seq_len, best.estimate.microbatches) {
        if let Ok(e) = estimate_train_split(lpg, cluster, cfg, seq_len, global_batch, Some(&split))
        {
            let better = e.feasible
                && (!best.estimate.feasible || e.step_time_s < best.estimate.step_time_s);
            if better {
                best.estimate = e;
                best.layer_split = Some(split);
            }
        }
    }
    Ok(best)
}

/// The inference search space.
pub fn inference_space(
    pg: &PreparedGraph,
    cluster: &Cluster,
    fixed: &PartialConfig,
) -> Vec<ParallelConfig> {
    let n = cluster.gpus();
    let gpn = cluster.gpus_per_node;
    let mut out = Vec::new();
    for tp in pick_degree(fixed.tp, divisors(n).into_iter().filter(|&t| t <= gpn)) {
        for pp in pick_degree(
            fixed.pp,
            divisors(n / tp.max(1))
                .into_iter()
                .filter(|&p| p <= pg.layers),
        ) {
            if tp * pp == 0 || !n.is_multiple_of(tp * pp) {
                continue;
            }
            let dp = n / (tp * pp);
            if fixed.dp.is_some_and(|d| d != dp) {
                continue;
            }
            let eps = if pg.experts > 0 {
                pick_degree(
                    fixed.ep,
                    divisors(dp * tp)
                        .into_iter()
                        .filter(|&e| pg.experts.is_multiple_of(e)),
                )
            } else {
                vec![fixed.ep.unwrap_or(1)]
            };
            // DP-attention serves MoE models (SGLang's `--enable-dp-attention` for
            // DeepSeek): a dense model keeps attention on its tensor ranks unless the
            // configuration asks for it.
            let dpas = pick(
                fixed.dp_attention,
                if tp > 1 && pg.experts > 0 {
                    &[false, true]
                } else {
                    &[false]
                },
            );
            for &ep in &eps {
                for &dp_attention in &dpas {
                    out.push(ParallelConfig {
                        dp,
                        tp,
                        pp,
                        cp: 1,
                        ep,
                        mbs: 1,
                        zero: 0,
                        recompute: Recompute::None,
                        sp: false,
                        vpp: 1,
                        schedule: Schedule::OneFOneB,
                        dp_attention,
                        attn: fixed.attn.unwrap_or(AttnImpl::Flash),
                        tp_overlap: fixed.tp_overlap.unwrap_or(false),
                    });
                }
            }
        }
    }
    out
}

/// Searches inference configurations: the best deployment (most output tokens per
/// second within memory and the SLO), and the best for prefill and for decode alone.
pub fn search_inference(
    graph: &Graph,
    pg: &PreparedGraph,
    cluster: &Cluster,
    load: &InferenceLoad,
    opts: &SearchOptions,
) -> Result<SearchReport, SearchError> {
    let start = Instant::now();
    let space = inference_space(pg, cluster, &opts.fixed);
    if space.is_empty() {
        return Err(SearchError {
            message: format!(
                "no inference configuration of {} GPUs satisfies the fixed keys {:?}",
                cluster.gpus(),
                opts.fixed
            ),
        });
    }
    let results: Vec<(ParallelConfig, Result<Estimate, String>)> = space
        .par_iter()
        .map(|cfg| {
            (
                *cfg,
                estimate_inference(pg, cluster, cfg, load).map_err(|e| e.reason),
            )
        })
        .collect();
    let mut sweep = Sweep::new();
    let mut all_fit = Vec::new();
    for (cfg, r) in results {
        match r {
            Ok(e) => {
                sweep.evaluated += 1;
                let c = Candidate {
                    cfg,
                    estimate: e,
                    layer_split: None,
                    layout: None,
                };
                let slo = slo_ratio(&c.estimate, Some(load));
                if c.estimate.feasible && slo <= 1.0 {
                    all_fit.push(c.clone());
                    sweep.best.push(c);
                } else {
                    sweep.infeasible += 1;
                    let d = (c.estimate.memory_per_gpu_bytes.total
                        / c.estimate.memory_capacity_bytes)
                        .max(slo);
                    let better = sweep.closest.as_ref().is_none_or(|o| {
                        d < (o.estimate.memory_per_gpu_bytes.total
                            / o.estimate.memory_capacity_bytes)
                            .max(slo_ratio(&o.estimate, Some(load)))
                    });
                    if better {
                        sweep.closest = Some(c);
                    }
                }
            }
            Err(e) => sweep.reject(e),
        }
    }
    sort_candidates(&mut sweep.best);
    let by = |f: fn(&Estimate) -> f64| {
        let mut v = all_fit.clone();
        v.sort_by(|a, b| {
            f(&a.estimate)
                .total_cmp(&f(&b.estimate))
                .then_with(|| a.cfg.to_string().cmp(&b.cfg.to_string()))
        });
        v.into_iter().next()
    };
    let prefill_best = by(|e| e.ttft_s.unwrap_or(f64::INFINITY));
    let decode_best = by(|e| e.tpot_s.unwrap_or(f64::INFINITY));
    sweep.best.truncate(opts.top_k.max(1));
    let cache = LayoutCache::new(graph, cluster);
    let mut top = Vec::new();
    for c in sweep.best {
        let layout = cache
            .get(LayoutKey::inference(&c.cfg, load), graph, pg)
            .map_err(|message| SearchError { message })?;
        top.push(Candidate {
            layout: Some(layout),
            ..c
        });
    }
    Ok(SearchReport {
        top,
        enumerated: space.len() as u64,
        evaluated: sweep.evaluated,
        pruned: 0,
        rejected: sweep.rejected,
        rejected_reason: sweep.rejected_reason.clone(),
        infeasible: sweep.infeasible,
        bounded: 0,
        closest_miss: sweep.closest,
        smallest_lower_bound: None,
        wall_s: start.elapsed().as_secs_f64(),
        sweep_s: start.elapsed().as_secs_f64(),
        stop_reason: StopReason::Exhausted,
        ilp_solves: cache.solves(),
        solver: crate::layout::SOLVER,
        prefill_best,
        decode_best,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_in_order() {
        assert_eq!(divisors(12), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(1), vec![1]);
        assert_eq!(divisors(3840).len(), 36);
    }
}
