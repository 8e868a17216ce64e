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

use crate::cost_model::estimate::{check_train_shapes, gib, Estimate};
use crate::cost_model::memory::{model_state_bytes, model_states};
use crate::cost_model::{
    calib,
    estimate::{estimate_train_balanced_with, even_layer_split},
    estimate_inference, estimate_train_split_with, estimate_train_with, train_ctx, Cluster,
    InferenceLoad, Mechanisms, PreparedGraph,
};
use crate::layout::{Layout, LayoutCache, LayoutKey};
use crate::stages::{one_f_one_b_in_flight, partition, MemoryLimit, StageCosts};
use meshplan_ir::{
    AttnImpl, Framework, Graph, ParallelConfig, PartialConfig, Recompute, Schedule, SegmentKind,
    Workload,
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
    /// The framework the plan is for: the search takes only what it can run.
    pub framework: Framework,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            fixed: PartialConfig::default(),
            top_k: 5,
            refine: 24,
            max_candidates: 20_000_000,
            time_limit_s: 60.0,
            framework: Framework::default(),
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
    pub fn score(&self) -> f64 {
        match self.estimate.output_tokens_per_s {
            Some(t) if t > 0.0 => 1.0 / t,
            _ => self.estimate.step_time_s,
        }
    }

    /// Layers per chunk, even unless the stage DP chose otherwise.
    pub fn split_or_even(&self, layers: u64) -> Vec<u64> {
        match &self.layer_split {
            Some(s) => s.clone(),
            None => even_layer_split(layers, self.cfg.pp, self.cfg.vpp),
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
    /// How many of `top`'s first entries tie within [`NEAR_TIE`] of the fastest (the
    /// first is the simplest of them); 1 when the best stands alone.
    pub near_ties: usize,
    /// Inference, when nothing fits: the nearest workloads and clusters that would.
    pub remedy: Option<InferenceRemedy>,
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
    // `d <= n / d`, not `d * d <= n`: the square wraps for n near 2^64 and the loop
    // never ends.
    while d <= n / d {
        if n.is_multiple_of(d) {
            small.push(d);
            if d != n / d {
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

/// `fixed` in `--config` syntax (`dp=1,tp=2`), its keys in canonical order.
pub fn fixed_keys_text(fixed: &PartialConfig) -> String {
    // The enums serialise to the spelling `--config` parses.
    let word = |v: serde_json::Value| v.as_str().map(str::to_string).unwrap_or_default();
    let f = fixed;
    let keys: [(&str, Option<String>); 14] = [
        ("dp", f.dp.map(|v| v.to_string())),
        ("tp", f.tp.map(|v| v.to_string())),
        ("pp", f.pp.map(|v| v.to_string())),
        ("cp", f.cp.map(|v| v.to_string())),
        ("ep", f.ep.map(|v| v.to_string())),
        ("mbs", f.mbs.map(|v| v.to_string())),
        ("zero", f.zero.map(|v| v.to_string())),
        (
            "recompute",
            f.recompute
                .map(|v| word(serde_json::to_value(v).unwrap_or_default())),
        ),
        ("sp", f.sp.map(|v| v.to_string())),
        ("vpp", f.vpp.map(|v| v.to_string())),
        (
            "schedule",
            f.schedule
                .map(|v| word(serde_json::to_value(v).unwrap_or_default())),
        ),
        ("dp_attention", f.dp_attention.map(|v| v.to_string())),
        (
            "attn",
            f.attn
                .map(|v| word(serde_json::to_value(v).unwrap_or_default())),
        ),
        ("tp_overlap", f.tp_overlap.map(|v| v.to_string())),
    ];
    keys.iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={v}")))
        .collect::<Vec<_>>()
        .join(",")
}

/// Why no configuration of `cluster` completes `fixed` (whose search space came out
/// empty), and what to change.
pub fn unsatisfiable_because(
    fixed: &PartialConfig,
    cluster: &Cluster,
    layers: u64,
    inference: bool,
) -> String {
    let n = cluster.gpus();
    let gpn = cluster.gpus_per_node;
    // Inference configurations have no context axis: dp x tp x pp covers the GPUs.
    let degrees: &[(&str, Option<u64>)] = if inference {
        &[("dp", fixed.dp), ("tp", fixed.tp), ("pp", fixed.pp)]
    } else {
        &[
            ("dp", fixed.dp),
            ("tp", fixed.tp),
            ("pp", fixed.pp),
            ("cp", fixed.cp),
        ]
    };
    let all = degrees
        .iter()
        .map(|(k, _)| *k)
        .collect::<Vec<_>>()
        .join(" x ");
    let given: Vec<(&str, u64)> = degrees
        .iter()
        .filter_map(|(k, v)| v.map(|v| (*k, v)))
        .collect();
    let names = given
        .iter()
        .map(|(k, _)| *k)
        .collect::<Vec<_>>()
        .join(" x ");
    let values = given
        .iter()
        .map(|(_, v)| v.to_string())
        .collect::<Vec<_>>()
        .join(" x ");
    let product: u64 = given.iter().map(|(_, v)| *v).product();
    let product_text = match given.as_slice() {
        [(k, v)] => format!("{k}={v}"),
        _ => format!("their product {names} = {values} = {product}"),
    };
    if given.len() == degrees.len() && product != n {
        return format!(
            "their product {names} = {values} = {product} != {n} GPUs; choose degrees whose product is {n}, or leave dp out to fill the rest"
        );
    }
    if !given.is_empty() && !n.is_multiple_of(product) {
        return format!(
            "{product_text} does not divide {n} GPUs; choose degrees whose product divides {n}"
        );
    }
    // Inference plans have one stage chunk per rank: vpp and schedule do not apply.
    let interleaved = fixed
        .schedule
        .filter(|_| !inference)
        .map(|s| s == Schedule::Interleaved);
    match (fixed.vpp.filter(|_| !inference), interleaved) {
        (Some(v), Some(false)) if v > 1 => {
            return format!("vpp={v} needs schedule=interleaved (or leave schedule out)")
        }
        (Some(1), Some(true)) => {
            return "schedule=interleaved needs vpp > 1 (or leave vpp out)".into()
        }
        _ => {}
    }
    if fixed.pp == Some(1) && interleaved == Some(true) {
        return "virtual stages (vpp > 1, schedule=interleaved) need pp > 1".into();
    }
    format!(
        "the degrees left free cannot make up the rest: {all} must equal {n} GPUs, with tp dividing the {gpn} GPUs of a node and pp at most the model's {layers} layers"
    )
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
            Some(o) => miss_distance(&c.estimate, None) < miss_distance(&o.estimate, None),
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

/// How far an infeasible estimate is from fitting: memory over capacity, or (with an
/// inference `load`) the worst SLO ratio.
fn miss_distance(e: &Estimate, load: Option<&InferenceLoad>) -> f64 {
    (e.memory_per_gpu_bytes.total / e.memory_capacity_bytes).max(slo_ratio(e, load))
}

/// One objective a configuration misses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Violation {
    /// Per-GPU memory (weights, KV cache, activations, workspace) over capacity, bytes.
    Memory {
        /// Bytes needed per GPU.
        need: f64,
        /// Bytes a GPU has.
        capacity: f64,
    },
    /// Time to first token over the SLO, s.
    Ttft {
        /// Predicted.
        got: f64,
        /// The SLO.
        max: f64,
    },
    /// Time per output token over the SLO, s.
    Tpot {
        /// Predicted.
        got: f64,
        /// The SLO.
        max: f64,
    },
}

impl Violation {
    /// How many times its bound the value is.
    pub fn ratio(&self) -> f64 {
        match *self {
            Violation::Memory { need, capacity } => need / capacity,
            Violation::Ttft { got, max } | Violation::Tpot { got, max } => got / max,
        }
    }

    /// The objective's name as the message and the model file write it.
    pub fn objective(&self) -> &'static str {
        match self {
            Violation::Memory { .. } => "memory",
            Violation::Ttft { .. } => "TTFT",
            Violation::Tpot { .. } => "TPOT",
        }
    }
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let over = 100.0 * (self.ratio() - 1.0);
        match *self {
            Violation::Memory { need, capacity } => write!(
                f,
                "per-GPU memory {:.1} GiB > {:.1} GiB capacity (+{:.1} GiB, {over:.1}% over)",
                gib(need),
                gib(capacity),
                gib(need - capacity)
            ),
            Violation::Ttft { got, max } => write!(
                f,
                "TTFT {:.1} ms > SLO {:.1} ms (+{:.1} ms, {over:.1}% over)",
                got * 1e3,
                max * 1e3,
                (got - max) * 1e3
            ),
            Violation::Tpot { got, max } => write!(
                f,
                "TPOT {:.2} ms > SLO {:.2} ms (+{:.2} ms, {over:.1}% over)",
                got * 1e3,
                max * 1e3,
                (got - max) * 1e3
            ),
        }
    }
}

/// The objectives `e` misses, worst (largest ratio to its bound) first; the SLO
/// counts only with an inference `load`.
pub fn violations(e: &Estimate, load: Option<&InferenceLoad>) -> Vec<Violation> {
    let mut v = Vec::new();
    if e.memory_per_gpu_bytes.total > e.memory_capacity_bytes {
        v.push(Violation::Memory {
            need: e.memory_per_gpu_bytes.total,
            capacity: e.memory_capacity_bytes,
        });
    }
    if let Some(load) = load {
        if let (Some(max), Some(got)) = (load.ttft_max_s, e.ttft_s) {
            if got > max {
                v.push(Violation::Ttft { got, max });
            }
        }
        if let (Some(max), Some(got)) = (load.tpot_max_s, e.tpot_s) {
            if got > max {
                v.push(Violation::Tpot { got, max });
            }
        }
    }
    v.sort_by(|a, b| b.ratio().total_cmp(&a.ratio()));
    v
}

/// What would serve an inference load that no configuration serves, each found by
/// pricing again with one thing changed.
#[derive(Clone, Debug)]
pub struct InferenceRemedy {
    /// The most concurrent requests some configuration serves within memory and the
    /// SLO, with the fastest configuration at that concurrency.
    pub concurrency: Option<(u64, Candidate)>,
    /// The fewest nodes (up to 8 times as many) on which some configuration serves
    /// the whole load, with the fastest there.
    pub nodes: Option<(u64, Candidate)>,
    /// The longest prompt some configuration serves, the most concurrent requests at
    /// that length, and the fastest configuration; looked for only when no
    /// concurrency helps (TTFT is one request's prefill, so fewer requests cannot
    /// bring it down).
    pub prompt_len: Option<(u64, u64, Candidate)>,
}

/// The fastest configuration of `cluster` that serves `load` within memory and the
/// SLO, if any.
fn best_serving(
    pg: &PreparedGraph,
    cluster: &Cluster,
    load: &InferenceLoad,
    fixed: &PartialConfig,
) -> Option<Candidate> {
    let mut fit: Vec<Candidate> = inference_space(pg, cluster, fixed)
        .par_iter()
        .filter_map(|cfg| {
            let e = estimate_inference(pg, cluster, cfg, load).ok()?;
            (e.feasible && slo_ratio(&e, Some(load)) <= 1.0).then_some(Candidate {
                cfg: *cfg,
                estimate: e,
                layer_split: None,
                layout: None,
            })
        })
        .collect();
    sort_candidates(&mut fit);
    fit.into_iter().next()
}

/// The largest `x` in `1..hi` for which `serve(x)` finds a configuration, assuming
/// that a smaller `x` (fewer requests, a shorter prompt) never makes things worse.
fn largest_serving(hi: u64, serve: impl Fn(u64) -> Option<Candidate>) -> Option<(u64, Candidate)> {
    if hi <= 1 {
        return None;
    }
    let mut best = (1, serve(1)?);
    let (mut lo, mut hi) = (1, hi);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match serve(mid) {
            Some(c) => {
                lo = mid;
                best = (mid, c);
            }
            None => hi = mid,
        }
    }
    Some(best)
}

/// Looks for what would serve `load` when nothing on `cluster` does.
pub fn inference_remedy(
    pg: &PreparedGraph,
    cluster: &Cluster,
    load: &InferenceLoad,
    fixed: &PartialConfig,
) -> InferenceRemedy {
    let concurrency = largest_serving(load.concurrency, |c| {
        let l = InferenceLoad {
            concurrency: c,
            ..*load
        };
        best_serving(pg, cluster, &l, fixed)
    });
    // Up to 64 node counts between one more and eight times as many.
    let most = cluster.nodes.saturating_mul(8).max(cluster.nodes + 1);
    let step = ((most - cluster.nodes) / 64).max(1);
    let nodes = (1..)
        .map(|i| cluster.nodes + i * step)
        .take_while(|&n| n <= most)
        .find_map(|n| {
            let bigger = Cluster {
                nodes: n,
                ..cluster.clone()
            };
            best_serving(pg, &bigger, load, fixed).map(|c| (n, c))
        });
    let prompt_len = if concurrency.is_none() {
        // One request is the easiest load: the prompt is found for it, then the
        // concurrency for that prompt.
        let one = InferenceLoad {
            concurrency: 1,
            ..*load
        };
        largest_serving(load.prompt_len, |p| {
            let l = InferenceLoad {
                prompt_len: p,
                ..one
            };
            best_serving(pg, cluster, &l, fixed)
        })
        .map(|(p, c1)| {
            let at = InferenceLoad {
                prompt_len: p,
                ..*load
            };
            match best_serving(pg, cluster, &at, fixed) {
                Some(c) => (p, load.concurrency, c),
                None => largest_serving(load.concurrency, |c| {
                    let l = InferenceLoad {
                        concurrency: c,
                        ..at
                    };
                    best_serving(pg, cluster, &l, fixed)
                })
                .map_or((p, 1, c1), |(n, c)| (p, n, c)),
            }
        })
    } else {
        None
    };
    InferenceRemedy {
        concurrency,
        nodes,
        prompt_len,
    }
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

/// Step times within this fraction of the fastest are a tie: the cost model cannot
/// tell them apart (its error on the published runs it was fitted to is 3.1% mean,
/// see `tests/it/calibration.rs`), so the choice among them goes to the simplest
/// layout, not to whichever rounding came out ahead.
pub const NEAR_TIE: f64 = 0.01;

/// Bytes each GPU sends per step over every axis.
pub fn network_bytes(e: &Estimate) -> f64 {
    let b = &e.comm_bytes_per_gpu;
    b.dp + b.tp + b.pp + b.cp + b.ep
}

/// Parallel axes in use (degree above one, virtual stages counted as an axis).
pub fn parallel_axes(c: &ParallelConfig) -> usize {
    [c.dp, c.tp, c.pp, c.cp, c.ep, c.vpp]
        .iter()
        .filter(|&&d| d > 1)
        .count()
}

/// Whether `b` is simpler than `a` by a margin the cost model can stand behind: fewer
/// bytes on the network (by more than [`NEAR_TIE`]); or as many bytes and fewer
/// parallel axes; or as many bytes and axes and less memory (by more than
/// [`NEAR_TIE`]). Smaller differences, a few kilobytes of memory say, do not outweigh
/// speed.
pub fn simpler(b: &Candidate, a: &Candidate) -> bool {
    let (ba, bb) = (network_bytes(&a.estimate), network_bytes(&b.estimate));
    if bb < ba * (1.0 - NEAR_TIE) {
        return true;
    }
    if bb > ba * (1.0 + NEAR_TIE) {
        return false;
    }
    let (xa, xb) = (parallel_axes(&a.cfg), parallel_axes(&b.cfg));
    if xb != xa {
        return xb < xa;
    }
    let (ma, mb) = (
        a.estimate.memory_per_gpu_bytes.total,
        b.estimate.memory_per_gpu_bytes.total,
    );
    mb < ma * (1.0 - NEAR_TIE)
}

/// Orders a best-first list so that the simplest of the candidates within
/// [`NEAR_TIE`] of the fastest leads: walking them fastest first, a candidate
/// replaces the one held when it is [`simpler`]. The rest keep their order. Returns
/// how many tied.
pub fn prefer_simplest(v: &mut [Candidate]) -> usize {
    sort_candidates(v);
    let Some(best) = v.first().map(Candidate::score) else {
        return 0;
    };
    let tied = v
        .iter()
        .take_while(|c| c.score() <= best * (1.0 + NEAR_TIE))
        .count();
    let mut chosen = 0;
    for i in 1..tied {
        if simpler(&v[i], &v[chosen]) {
            chosen = i;
        }
    }
    v[..=chosen].rotate_right(1);
    tied
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
    let fw = opts.framework;
    let needs = meshplan_ir::framework::Needs::of(graph, pg.layers, global_batch);
    let fixed = opts.fixed.or_attn(fw.default_attn(&needs));
    let mut space = training_space(pg, cluster, &fixed, seq_len, global_batch);
    // How the framework runs each layout (gradient precision, blocking sends, ZeRO-3
    // granularity): every price below is the framework's.
    let mech = Mechanisms::of(fw);
    let before = space.len();
    let mut first_refusal = None;
    space.retain(|c| {
        let why = fw.cannot_run(c, &needs);
        if first_refusal.is_none() {
            first_refusal = why.first().map(|w| format!("{c}: {w}"));
        }
        why.is_empty()
    });
    // meshplan's executor can pad; it does so only when nothing exact is left.
    if space
        .iter()
        .any(|c| !meshplan_ir::framework::pads(c, global_batch))
    {
        space.retain(|c| !meshplan_ir::framework::pads(c, global_batch));
    }
    if space.is_empty() && before > 0 {
        return Err(SearchError {
            message: format!(
                "--framework {fw} cannot run any of the {before} configurations of {} GPUs{}; for example {}",
                cluster.gpus(),
                if opts.fixed == PartialConfig::default() {
                    String::new()
                } else {
                    format!(" with {}", fixed_keys_text(&opts.fixed))
                },
                first_refusal.unwrap_or_default()
            ),
        });
    }
    if space.is_empty() {
        return Err(SearchError {
            message: format!(
                "no configuration of {} GPUs satisfies the fixed keys {}: {}",
                cluster.gpus(),
                fixed_keys_text(&opts.fixed),
                unsatisfiable_because(&opts.fixed, cluster, pg.layers, false)
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
                // Every pipeline configuration at its time-balanced split, so that
                // layer counts the stages do not divide compete at their best; the
                // even split where the balanced one does not fit in memory.
                let priced = estimate_train_balanced_with(
                    pg,
                    cluster,
                    cfg,
                    seq_len,
                    global_batch,
                    acc.bound,
                    &mech,
                )
                .and_then(|p| match p {
                    // The framework cannot take the balanced split: its even one, or
                    // where stages cannot be even its own uneven one.
                    Some((_, split)) if !takes_split(fw, cfg, split.as_deref(), pg.layers) => {
                        let fallback = framework_split(fw, cfg, pg.layers).ok_or_else(|| {
                            meshplan_cost_model::estimate::Unsupported {
                                reason: format!(
                                    "{fw} cannot split {} layers over {} stages of {} chunks",
                                    pg.layers, cfg.pp, cfg.vpp
                                ),
                            }
                        })?;
                        estimate_train_with(
                            pg,
                            cluster,
                            cfg,
                            seq_len,
                            global_batch,
                            fallback.as_deref(),
                            acc.bound,
                            &mech,
                        )
                        .map(|e| e.map(|e| (e, fallback)))
                    }
                    other => Ok(other),
                });
                match priced {
                    Ok(None) => {
                        acc.evaluated += 1;
                        acc.bounded += 1;
                    }
                    Ok(Some((e, layer_split))) => {
                        acc.evaluated += 1;
                        let c = Candidate {
                            cfg: *cfg,
                            estimate: e,
                            layer_split,
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
        .map(|c| refine_train(c, graph, pg, cluster, &cache, seq_len, global_batch, fw))
        .collect::<Result<Vec<_>, _>>()?;
    let mut top: Vec<Candidate> = refined
        .into_iter()
        .filter(|c| c.estimate.feasible)
        .collect();
    let near_ties = prefer_simplest(&mut top);
    // The near-ties stay, whatever `top_k`: the plan records them for `explain`.
    top.truncate(opts.top_k.max(near_ties).max(1));
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
        remedy: None,
        near_ties,
    })
}

/// `c` (priced under the standard placements) with the ILP's `layout` where that
/// prices faster; the plan is written with the placements its prediction was priced
/// under.
fn with_inference_layout(
    c: Candidate,
    layout: Arc<Layout>,
    pg: &PreparedGraph,
    cluster: &Cluster,
    load: &InferenceLoad,
) -> Candidate {
    if layout.standard {
        return Candidate {
            layout: Some(layout),
            ..c
        };
    }
    let lpg = layout.prepared.as_ref().unwrap_or(pg);
    match estimate_inference(lpg, cluster, &c.cfg, load) {
        Ok(e)
            if e.feasible && {
                let ilp = Candidate {
                    cfg: c.cfg,
                    estimate: e.clone(),
                    layer_split: None,
                    layout: None,
                };
                ilp.score() < c.score() * (1.0 - 1e-9)
            } =>
        {
            Candidate {
                estimate: e,
                layout: Some(layout),
                ..c
            }
        }
        _ => c,
    }
}

/// One complete configuration priced as the search prices it (the sweep's balanced
/// split, then the standard and ILP placements at the even, balanced and stage-DP
/// splits for training; the better of the standard and ILP placements for
/// inference): what `estimate` and `compare` report, so that they agree with `plan`.
/// Training is priced as the workload's framework runs it; whether that framework can
/// run `cfg` at all is the caller's check (`Framework::cannot_run`).
pub fn price_config(
    graph: &Graph,
    pg: &PreparedGraph,
    cluster: &Cluster,
    workload: &Workload,
    cfg: &ParallelConfig,
) -> Result<Candidate, SearchError> {
    let framework = workload.framework();
    let cache = LayoutCache::new(graph, cluster);
    let err = |e: crate::cost_model::estimate::Unsupported| SearchError { message: e.reason };
    match workload {
        Workload::Train {
            seq_len,
            global_batch,
            ..
        } => {
            let (estimate, layer_split) = estimate_train_balanced_with(
                pg,
                cluster,
                cfg,
                *seq_len,
                *global_batch,
                f64::INFINITY,
                &Mechanisms::of(framework),
            )
            .map_err(err)?
            .ok_or_else(|| SearchError {
                message: format!("{cfg}: the step time is not a number"),
            })?;
            let swept = Candidate {
                cfg: *cfg,
                estimate,
                layer_split,
                layout: None,
            };
            refine_train(
                &swept,
                graph,
                pg,
                cluster,
                &cache,
                *seq_len,
                *global_batch,
                framework,
            )
        }
        Workload::Inference { .. } => {
            let load = InferenceLoad::from_workload(workload).ok_or_else(|| SearchError {
                message: "an inference workload without its load".into(),
            })?;
            let estimate = estimate_inference(pg, cluster, cfg, &load).map_err(err)?;
            let c = Candidate {
                cfg: *cfg,
                estimate,
                layer_split: None,
                layout: None,
            };
            let layout = cache
                .get(LayoutKey::inference(cfg, &load), graph, pg)
                .map_err(|message| SearchError { message })?;
            Ok(with_inference_layout(c, layout, pg, cluster, &load))
        }
    }
}

/// Per-micro-batch stage costs of a configuration for the stage DP, model states
/// as framework `mech` holds them.
pub fn stage_costs(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    seq_len: u64,
    mech: &Mechanisms,
) -> StageCosts {
    let ctx = train_ctx(pg, cluster, cfg, seq_len);
    let costs = ctx.price(pg);
    let hold = mech.holding(pg.dtype.size_bytes() as f64);
    let state = |params: f64| {
        let (p, g, o) = model_states(params, cfg.dp * cfg.cp, cfg.zero, hold);
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
    (seq_len, microbatches): (u64, u64),
    mech: &Mechanisms,
) -> Option<Vec<u64>> {
    let chunks = (cfg.pp * cfg.vpp) as usize;
    if chunks <= 1 {
        return None;
    }
    let sc = stage_costs(pg, cluster, cfg, seq_len, mech);
    let lim = (cfg.vpp == 1).then(|| MemoryLimit {
        in_flight: match cfg.schedule {
            Schedule::Gpipe => vec![microbatches as f64; chunks],
            _ => one_f_one_b_in_flight(chunks, microbatches as usize),
        },
        capacity_bytes: cluster.gpu.memory_bytes - calib::RUNTIME_RESERVED_BYTES,
    });
    partition(&sc, chunks, lim.as_ref()).map(|s| s.layers)
}

/// Whether `fw` can run `split` (`None`: the even split of `layers`).
/// The split a framework runs when the time-balanced one is not its: the even split
/// (`Some(None)`) where it takes it, else its own uneven one, else `None`.
fn framework_split(fw: Framework, cfg: &ParallelConfig, layers: u64) -> Option<Option<Vec<u64>>> {
    if takes_split(fw, cfg, None, layers) {
        return Some(None);
    }
    fw.ends_split(layers, cfg.pp, cfg.vpp).map(Some)
}

fn takes_split(fw: Framework, cfg: &ParallelConfig, split: Option<&[u64]>, layers: u64) -> bool {
    match split {
        Some(s) => fw.split_ok(s, cfg.pp, cfg.vpp),
        None => fw.split_ok(&even_layer_split(layers, cfg.pp, cfg.vpp), cfg.pp, cfg.vpp),
    }
}

#[allow(clippy::too_many_arguments)] // the search's context, passed as it is
fn refine_train(
    c: &Candidate,
    graph: &Graph,
    pg: &PreparedGraph,
    cluster: &Cluster,
    cache: &LayoutCache,
    seq_len: u64,
    global_batch: u64,
    fw: Framework,
) -> Result<Candidate, SearchError> {
    let cfg = &c.cfg;
    let layout = cache
        .get(LayoutKey::train(cfg, seq_len), graph, pg)
        .map_err(|message| SearchError { message })?;
    // The ILP's placements and the standard (Megatron) ones, each at the even split,
    // the time-balanced split and the stage DP's memory-aware split: the best that
    // fits wins. The sweep's own price (standard, balanced) is among them, so
    // refinement never makes a candidate slower; the ILP's placements (found from
    // the same costs) and the even split win ties.
    let mech = Mechanisms::of(fw);
    // A framework other than meshplan's executor runs its own placements: tp is
    // Megatron tensor parallelism there, so an ILP layout that uses the axis for
    // something else (the batch, say) would be a different run than the one exported.
    let mut layouts: Vec<(Option<Arc<Layout>>, &PreparedGraph)> =
        if fw == Framework::Meshplan || layout.standard {
            vec![(Some(layout.clone()), layout.prepared.as_ref().unwrap_or(pg))]
        } else {
            Vec::new()
        };
    if !layout.standard {
        layouts.push((None, pg));
    }
    let mut best: Option<Candidate> = None;
    let consider = |best: &mut Option<Candidate>, cand: Candidate| {
        let better = match best {
            None => true,
            Some(b) => {
                (cand.estimate.feasible && !b.estimate.feasible)
                    || (cand.estimate.feasible == b.estimate.feasible
                        && cand.estimate.step_time_s < b.estimate.step_time_s * (1.0 - 1e-9))
            }
        };
        if better {
            *best = Some(cand);
        }
    };
    for (lay, lpg) in layouts {
        let mut splits: Vec<Option<Vec<u64>>> = vec![None];
        if cfg.pp * cfg.vpp > 1 {
            if let Ok(Some((_, Some(s)))) = estimate_train_balanced_with(
                lpg,
                cluster,
                cfg,
                seq_len,
                global_batch,
                f64::INFINITY,
                &mech,
            ) {
                splits.push(Some(s));
            }
            let microbatches = global_batch.div_ceil(cfg.dp * cfg.mbs);
            if let Some(s) = dp_split(lpg, cluster, cfg, (seq_len, microbatches), &mech) {
                splits.push(Some(s));
            }
        }
        if let Some(s) = fw.ends_split(pg.layers, cfg.pp, cfg.vpp) {
            splits.push(Some(s));
        }
        splits.retain(|s| takes_split(fw, cfg, s.as_deref(), pg.layers));
        for split in splits {
            if split.is_some()
                && best
                    .as_ref()
                    .is_some_and(|b| b.layer_split == split && b.layout.is_some() == lay.is_some())
            {
                continue;
            }
            let e = match estimate_train_split_with(
                lpg,
                cluster,
                cfg,
                seq_len,
                global_batch,
                split.as_deref(),
                &mech,
            ) {
                Ok(e) => e,
                Err(e) if split.is_none() => return Err(SearchError { message: e.reason }),
                Err(_) => continue,
            };
            consider(
                &mut best,
                Candidate {
                    cfg: *cfg,
                    estimate: e,
                    layer_split: split,
                    layout: lay.clone(),
                },
            );
        }
    }
    best.ok_or_else(|| SearchError {
        message: format!("{cfg}: no layout priced"),
    })
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
                "no inference configuration of {} GPUs satisfies the fixed keys {}: {}",
                cluster.gpus(),
                fixed_keys_text(&opts.fixed),
                unsatisfiable_because(&opts.fixed, cluster, pg.layers, true)
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
                    // The closest miss is the one whose worst objective is least over
                    // its bound; ties go to the configuration's text for a stable report.
                    let d = miss_distance(&c.estimate, Some(load));
                    let better = sweep.closest.as_ref().is_none_or(|o| {
                        let od = miss_distance(&o.estimate, Some(load));
                        d < od || (d == od && c.cfg.to_string() < o.cfg.to_string())
                    });
                    if better {
                        sweep.closest = Some(c);
                    }
                }
            }
            Err(e) => sweep.reject(e),
        }
    }
    let tied = prefer_simplest(&mut sweep.best);
    let remedy = (sweep.best.is_empty() && sweep.closest.is_some())
        .then(|| inference_remedy(pg, cluster, load, &opts.fixed));
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
    // The near-ties stay, whatever `top_k`, as in `search_train`.
    sweep.best.truncate(opts.top_k.max(tied).max(1));
    let cache = LayoutCache::new(graph, cluster);
    let mut top = Vec::new();
    for c in sweep.best {
        let layout = cache
            .get(LayoutKey::inference(&c.cfg, load), graph, pg)
            .map_err(|message| SearchError { message })?;
        top.push(with_inference_layout(c, layout, pg, cluster, load));
    }
    let near_ties = prefer_simplest(&mut top);
    // The prefill and decode bests over every placement priced, the ILP's included.
    let least = |by: fn(&Estimate) -> Option<f64>, other: &Option<Candidate>| {
        let t = |c: &Candidate| by(&c.estimate).unwrap_or(f64::INFINITY);
        top.iter()
            .chain(other)
            .min_by(|a, b| t(a).total_cmp(&t(b)))
            .cloned()
    };
    let prefill_best = least(|e| e.ttft_s, &prefill_best);
    let decode_best = least(|e| e.tpot_s, &decode_best);
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
        remedy,
        near_ties,
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
