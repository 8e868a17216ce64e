//! Serving deployments: continuous batching on one pool, or a prefill pool handing
//! KV caches to a decode pool, priced from the same per-instance estimate as
//! `estimate` ([`inference_timeline`]).
//!
//! # The model
//!
//! An *instance* is one server: `dp x tp x pp` GPUs (`dp` > 1 only where the
//! experts span its attention replicas, or with DP-attention). Its prefill of one
//! prompt of `L` tokens takes `T_pf(L)`; its decode step over `B` requests at the mean
//! context takes `T_dec(B)` (weights and KV cache read, the batch's FLOPs). Under
//! DP-attention a prompt's attention runs whole on one tensor rank: one prompt's
//! `T_pf` (a TTFT) keeps it there, while the pool's service time per prompt
//! (`prefill_service_s`, what the queues and the fused iterations below use) takes a
//! `1 / tp` share of the attention half, the ranks prefilling prompts of their own
//! side by side.
//!
//! **Aggregated** (continuous batching with chunked prefill of `S` tokens): in
//! steady state every iteration decodes the `C` requests in flight and prefills the
//! prompts of the requests that replace the finished ones, `p = C L / O` tokens on
//! average (mean prompt `L`, mean output `O`); `p > S` is unstable. One fused
//! iteration reads the weights once:
//! `T_it(p) = max(T_dec(C) + T_pf(L) p / L - W, T_dec(C), T_pf(L) p / L)`, `W` the
//! weight read. TPOT is `T_it(p)`; a prompt waits (M/D/1 at load `p / S`) and then
//! takes `ceil(L_q / S)` full-chunk iterations (`L_q` the prompt at the SLO's
//! percentile).
//!
//! **Disaggregated**: `x` prefill instances each serve `1 / T_pf(L)` requests per
//! second; `y` decode instances at batch `B` serve `B / (O T_dec(B))`. The deployment
//! serves the smaller rate; TTFT is the prefill queue's wait (M/D/1), `T_pf(L_q)` and
//! the KV move ([`kv_transfer`]).
//!
//! Queueing uses the M/D/1 mean wait `rho / (2 (1 - rho))` service times (Poisson
//! arrivals, deterministic service), the textbook form (Kleinrock, *Queueing Systems*
//! vol. 1, Pollaczek-Khinchine with zero service variance).

use crate::cluster::Cluster;
use crate::compute::Roofline;
use crate::estimate::{
    inference_timeline, prefill_service_s, Estimate, InferenceLoad, Unsupported,
};
use crate::graph_cost::PreparedGraph;
use meshplan_ir::serving::{ModeChoice, Objective, ServingMode};
use meshplan_ir::{ParallelConfig, Workload};

/// Highest prefill-queue load a deployment is run at without a TTFT bound: beyond
/// it the M/D/1 wait grows without limit (at 0.9 it is 4.5 service times).
pub const RHO_MAX: f64 = 0.9;

/// What a deployment is asked to serve, in the cost model's units.
#[derive(Clone, Debug, PartialEq)]
pub struct ServeLoad {
    /// Mean prompt tokens.
    pub prompt_mean: f64,
    /// Prompt tokens at the SLO's percentile.
    pub prompt_at: f64,
    /// Mean output tokens.
    pub output_mean: f64,
    /// Output tokens at the SLO's percentile (the KV cache a request may reach).
    pub output_at: f64,
    /// The SLO's percentile, 0-1.
    pub percentile: f64,
    /// TTFT bound, s.
    pub ttft_max_s: Option<f64>,
    /// TPOT bound, s.
    pub tpot_max_s: Option<f64>,
    /// Floor on tokens/s per user.
    pub min_user_tps: Option<f64>,
    /// Offered load, requests/s (then the fewest GPUs are sought).
    pub arrival_rate: Option<f64>,
    /// Requests in flight per instance to search.
    pub concurrency: (u64, u64),
    /// Chunked-prefill sizes to search.
    pub chunks: Vec<u64>,
    /// What to maximise.
    pub objective: Objective,
    /// Which deployments to search.
    pub mode: ModeChoice,
}

/// Default chunked-prefill sizes: SGLang's and vLLM's defaults lie in this range.
pub const DEFAULT_CHUNKS: [u64; 5] = [512, 1024, 2048, 4096, 8192];

/// Most requests in flight per instance searched when the workload gives no range.
pub const DEFAULT_MAX_CONCURRENCY: u64 = 4096;

impl ServeLoad {
    /// From an inference workload; `None` for training.
    pub fn from_workload(w: &Workload) -> Option<ServeLoad> {
        let Workload::Inference {
            prompt_len,
            output_len,
            slo,
            serving,
            ..
        } = w
        else {
            return None;
        };
        let sp = serving.clone().unwrap_or_default();
        let pct = slo.as_ref().and_then(|s| s.percentile).unwrap_or(50.0) / 100.0;
        let (prompt_mean, prompt_at) = match &sp.prompt {
            Some(d) => (d.mean(), d.quantile(pct)),
            None => (*prompt_len as f64, *prompt_len as f64),
        };
        let (output_mean, output_at) = match &sp.output {
            Some(d) => (d.mean(), d.quantile(pct)),
            None => (*output_len as f64, *output_len as f64),
        };
        Some(ServeLoad {
            prompt_mean,
            prompt_at,
            output_mean,
            output_at,
            percentile: pct,
            ttft_max_s: slo.as_ref().and_then(|s| s.ttft_ms).map(|v| v / 1e3),
            tpot_max_s: slo.as_ref().and_then(|s| s.tpot_ms).map(|v| v / 1e3),
            min_user_tps: sp.min_tokens_per_s_per_user,
            arrival_rate: sp.arrival_rate,
            concurrency: sp
                .concurrency
                .map_or((1, DEFAULT_MAX_CONCURRENCY), |c| (c.min, c.max)),
            chunks: if sp.chunked_prefill.is_empty() {
                DEFAULT_CHUNKS.to_vec()
            } else {
                sp.chunked_prefill.clone()
            },
            objective: sp.objective,
            mode: sp.mode,
        })
    }

    /// The same load with prompts scaled by `f` (for remedies).
    pub fn with_prompts_scaled(&self, f: f64) -> ServeLoad {
        ServeLoad {
            prompt_mean: (self.prompt_mean * f).max(1.0),
            prompt_at: (self.prompt_at * f).max(1.0),
            ..self.clone()
        }
    }
}

/// KV-cache bytes of one token over all layers (GQA: `2 kv_heads head_dim` elements
/// per layer; MLA: the latent and the shared rotary key).
pub fn kv_bytes_per_token(pg: &PreparedGraph) -> f64 {
    pg.layers as f64 * pg.kv_bytes_per_token_layer
}

/// Ways one instance's KV cache is split over its GPUs: over pipeline stages by
/// layer, over tensor ranks by KV head (replicated past the head count), and not at
/// all under DP-attention (a rank holds its own requests' whole cache).
pub fn kv_split(pg: &PreparedGraph, cfg: &ParallelConfig) -> f64 {
    let heads = if cfg.dp_attention {
        1.0
    } else {
        (cfg.tp as f64).min(pg.kv_cache_heads.max(1) as f64)
    };
    cfg.pp as f64 * heads
}

/// A prompt's KV cache moving from a prefill instance to a decode instance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvMove {
    /// Bytes of the whole cache.
    pub bytes: f64,
    /// Bytes sent over the link: the cache once per copy the decode instance keeps
    /// of it (over tensor ranks).
    pub moved: f64,
    /// Bytes the busiest GPU sends or receives: each decode GPU receives its own
    /// shard, each prefill GPU sends its shard once per decode copy its copies
    /// serve, all pairs at once.
    pub bytes_per_gpu: f64,
    /// Seconds: one point-to-point transfer of `bytes_per_gpu` (alpha + bytes / beta).
    pub time_s: f64,
    /// Both pools inside one node (NVLink), else across InfiniBand.
    pub same_node: bool,
}

/// The KV move of a `tokens`-token prompt between the two pools' instances.
pub fn kv_transfer(
    pg: &PreparedGraph,
    cluster: &Cluster,
    prefill: &ParallelConfig,
    decode: &ParallelConfig,
    tokens: f64,
    same_node: bool,
) -> KvMove {
    let bytes = tokens * kv_bytes_per_token(pg);
    // A head held by several decode ranks is sent to each; its prefill holders take
    // turns, so a prefill GPU sends its shard ceil(decode copies / prefill copies)
    // times.
    let copies = |c: &ParallelConfig| kv_replicas(pg, c).max(1) as f64;
    let sends = (copies(decode) / copies(prefill)).ceil().max(1.0);
    let send = bytes / kv_split(pg, prefill) * sends;
    let recv = bytes / kv_split(pg, decode);
    let per_gpu = send.max(recv);
    let comm = crate::CommModel::new(cluster);
    KvMove {
        bytes,
        moved: bytes * copies(decode),
        bytes_per_gpu: per_gpu,
        time_s: comm.p2p_time_s(same_node, per_gpu),
        same_node,
    }
}

/// M/D/1 mean wait, in service times, at load `rho` (infinite at or past 1).
pub fn md1_wait(rho: f64) -> f64 {
    if rho <= 0.0 {
        0.0
    } else if rho >= 1.0 {
        f64::INFINITY
    } else {
        rho / (2.0 * (1.0 - rho))
    }
}

/// The highest load whose M/D/1 wait is at most `slack` seconds for service time
/// `service` (the inverse of [`md1_wait`]), capped at [`RHO_MAX`].
pub fn md1_max_load(slack: f64, service: f64) -> f64 {
    if slack <= 0.0 || service <= 0.0 {
        return if service <= 0.0 { RHO_MAX } else { 0.0 };
    }
    let a = slack / service;
    (2.0 * a / (1.0 + 2.0 * a)).min(RHO_MAX)
}

/// A cluster of `gpus` of the original's GPUs: inside one node when they fit in
/// one, else as many whole nodes as they fill, or (a count no node size divides)
/// nodes of their greatest common divisor, so that every tensor group of a
/// power-of-two width stays inside a node.
pub fn instance_cluster(cluster: &Cluster, gpus: u64) -> Cluster {
    let gpus = gpus.max(1);
    let gpn = if gpus <= cluster.gpus_per_node {
        gpus
    } else {
        meshplan_ir::config::gcd(gpus, cluster.gpus_per_node)
    };
    Cluster {
        nodes: gpus / gpn,
        gpus_per_node: gpn,
        ..cluster.clone()
    }
}

/// One instance priced: prefill of the mean and the percentile prompt, and decode
/// steps at each batch that fits its memory.
#[derive(Clone, Debug)]
pub struct InstanceCost {
    /// The instance's configuration.
    pub cfg: ParallelConfig,
    /// Decode context parallelism (1: none).
    pub dcp: u64,
    /// Its GPUs.
    pub gpus: u64,
    /// Prefill of the mean prompt, s: its service time as a prefill server, while
    /// prompts keep it busy (`prefill_service_s`: under DP-attention each attention
    /// rank prefills a prompt of its own at once).
    pub prefill_mean_s: f64,
    /// Prefill of the percentile prompt, s: one prompt's own time to first token.
    pub prefill_at_s: f64,
    /// Reading the fullest GPU's weights once, s.
    pub weight_read_s: f64,
    /// Requests whose KV cache fits at once (percentile lengths).
    pub kv_capacity: u64,
    /// `(batch, decode step s)` for each batch that fits, increasing.
    pub decode: Vec<(u64, f64)>,
}

/// Batches searched: powers of two in the range, and its ends.
pub fn batches(lo: u64, hi: u64) -> Vec<u64> {
    let mut out = vec![lo];
    let mut b = 1u64;
    while b < hi {
        if b > lo {
            out.push(b);
        }
        b *= 2;
    }
    if hi > lo {
        out.push(hi);
    }
    out
}

/// Copies of the KV cache an instance keeps over its tensor ranks: MLA's latent on
/// every rank, or fewer KV heads than ranks. Decode context parallelism splits
/// these copies' tokens instead (it divides this count).
pub fn kv_replicas(pg: &PreparedGraph, cfg: &ParallelConfig) -> u64 {
    if cfg.dp_attention {
        return 1;
    }
    cfg.tp / cfg.tp.min(pg.kv_cache_heads.max(1))
}

/// What decode context parallelism (`dcp` ranks of a tensor group each holding
/// 1/dcp of every request's cached tokens, SGLang's `--dcp-size`, vLLM's
/// `--decode-context-parallel-size`) changes in a decode step of `batch` requests at
/// context `ctx`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DcpStep {
    /// KV read no longer done by each GPU, s: `(1 - 1/dcp) B ctx kv_bytes layers / HBM`.
    pub saved_s: f64,
    /// The two collectives per layer over the dcp group, s: an AllGather of the
    /// queries of the group's heads (absorbed into the latent width) and a
    /// ReduceScatter of the partial outputs with their log-sum-exp (fp32).
    pub added_s: f64,
    /// Bytes each GPU sends for them per step.
    pub bytes: f64,
}

/// The [`DcpStep`] of `dcp` on instance `cfg` (inside one node).
pub fn dcp_step(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    dcp: u64,
    batch: f64,
    ctx: f64,
) -> DcpStep {
    if dcp <= 1 {
        return DcpStep {
            saved_s: 0.0,
            added_s: 0.0,
            bytes: 0.0,
        };
    }
    let inst = instance_cluster(cluster, cfg.world_size());
    let hbm = Roofline::new(&inst, pg.dtype).hbm_bytes_per_s;
    let comm = crate::CommModel::new(&inst);
    let d = dcp as f64;
    let layers = pg.layers as f64;
    let kvb = pg.kv_bytes_per_token_layer;
    let heads_local = pg.heads as f64 / cfg.tp as f64;
    let q = batch * heads_local * d * kvb;
    let o = batch * heads_local * d * (kvb + 4.0);
    let group = crate::GroupShape {
        size: dcp,
        per_node: dcp,
    };
    use crate::collective::bytes_sent_per_rank;
    use meshplan_ir::plan::CollectiveKind::{AllGather, ReduceScatter};
    DcpStep {
        saved_s: (1.0 - 1.0 / d) * batch * ctx * kvb * layers / hbm,
        added_s: layers * (comm.time_s(AllGather, group, q) + comm.time_s(ReduceScatter, group, o)),
        bytes: layers
            * (bytes_sent_per_rank(AllGather, dcp, q) + bytes_sent_per_rank(ReduceScatter, dcp, o)),
    }
}

/// Prices one instance; `None` when even one request does not fit its memory.
/// `dcp` > 1 splits the cached tokens of each request over that many tensor ranks
/// (it must divide [`kv_replicas`]).
pub fn price_instance(
    pg: &PreparedGraph,
    cluster: &Cluster,
    cfg: &ParallelConfig,
    dcp: u64,
    load: &ServeLoad,
) -> Result<Option<InstanceCost>, Unsupported> {
    let inst = instance_cluster(cluster, cfg.world_size());
    let at = |prompt: f64, output: f64, conc: u64| InferenceLoad {
        prompt_len: (prompt.round() as u64).max(1),
        output_len: (output.round() as u64).max(1),
        concurrency: conc,
        ttft_max_s: None,
        tpot_max_s: None,
    };
    // Capacity at the percentile lengths: the cache a request may grow to.
    let (one, _) = inference_timeline(pg, &inst, cfg, &at(load.prompt_at, load.output_at, 1))?;
    let fits = |e: &Estimate| e.memory_per_gpu_bytes.total <= e.memory_capacity_bytes;
    if !fits(&one) {
        return Ok(None);
    }
    // The cache, split dcp ways, holds dcp times the requests.
    let kv_capacity = one.max_concurrency.unwrap_or(0).saturating_mul(dcp.max(1));
    let ctx = load.prompt_mean + load.output_mean / 2.0;
    // The pool's service time per prompt (DP-attention prefills one prompt on each
    // attention rank at once); a prompt's own TTFT is `one`'s.
    let mean_prompt = at(load.prompt_mean, load.output_mean, 1).prompt_len;
    let service = prefill_service_s(pg, &inst, cfg, mean_prompt)?;
    let roof = Roofline::new(&inst, pg.dtype);
    let hi = load.concurrency.1.min(kv_capacity);
    let mut decode = Vec::new();
    if hi >= load.concurrency.0 {
        for b in batches(load.concurrency.0, hi) {
            let (e, _) =
                inference_timeline(pg, &inst, cfg, &at(load.prompt_mean, load.output_mean, b))?;
            let d = dcp_step(pg, cluster, cfg, dcp, b as f64, ctx);
            let step = e.tpot_s.unwrap_or(f64::INFINITY) - d.saved_s + d.added_s;
            decode.push((b, step));
        }
    }
    Ok(Some(InstanceCost {
        cfg: *cfg,
        dcp: dcp.max(1),
        gpus: cfg.world_size(),
        prefill_mean_s: service,
        prefill_at_s: one.ttft_s.unwrap_or(0.0),
        weight_read_s: one.memory_per_gpu_bytes.params / roof.hbm_bytes_per_s,
        kv_capacity,
        decode,
    }))
}

/// A pool of a deployment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pool {
    /// The instance configuration.
    pub cfg: ParallelConfig,
    /// Decode context parallelism (1: none).
    pub dcp: u64,
    /// GPUs per instance.
    pub gpus: u64,
    /// Instances.
    pub instances: u64,
    /// Requests in flight per instance (1 for a prefill pool).
    pub concurrency: u64,
    /// Chunked-prefill tokens (the whole mean prompt for a prefill pool).
    pub chunk: u64,
}

/// One priced deployment.
#[derive(Clone, Debug, PartialEq)]
pub struct ServePoint {
    /// Aggregated or disaggregated.
    pub mode: ServingMode,
    /// The pool that decodes (the whole deployment when aggregated).
    pub decode: Pool,
    /// The prefill pool (disaggregated).
    pub prefill: Option<Pool>,
    /// The KV move (disaggregated).
    pub kv: Option<KvMove>,
    /// TTFT at the SLO's percentile, s.
    pub ttft_s: f64,
    /// TPOT, s.
    pub tpot_s: f64,
    /// Requests served per second.
    pub request_rate: f64,
    /// Output tokens per second, whole deployment.
    pub tokens_per_s: f64,
    /// GPUs the deployment uses.
    pub gpus: u64,
    /// Load of the prefill queue (its M/D/1 `rho`).
    pub prefill_load: f64,
}

impl ServePoint {
    /// Output tokens/s per GPU used.
    pub fn per_gpu(&self) -> f64 {
        self.tokens_per_s / self.gpus as f64
    }

    /// Output tokens/s each user sees (1 / TPOT).
    pub fn per_user(&self) -> f64 {
        1.0 / self.tpot_s
    }

    /// How far past the SLOs, as the largest ratio of achieved to bound (at most 1:
    /// met).
    pub fn slo_ratio(&self, load: &ServeLoad) -> f64 {
        let mut r: f64 = 0.0;
        if let Some(b) = load.ttft_max_s {
            r = r.max(self.ttft_s / b);
        }
        if let Some(b) = load.tpot_max_s {
            r = r.max(self.tpot_s / b);
        }
        if let Some(u) = load.min_user_tps {
            r = r.max(u / self.per_user());
        }
        r
    }

    /// Within every SLO.
    pub fn meets(&self, load: &ServeLoad) -> bool {
        self.slo_ratio(load) <= 1.0 + 1e-12
    }

    /// The objective's value (larger is better).
    pub fn score(&self, objective: Objective) -> f64 {
        match objective {
            Objective::PerGpu => self.per_gpu(),
            Objective::PerUser => self.per_user(),
        }
    }

    /// The SLOs it misses, in words.
    pub fn misses(&self, load: &ServeLoad) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(b) = load.ttft_max_s.filter(|&b| self.ttft_s > b) {
            out.push(format!(
                "TTFT {:.0} ms > {:.0} ms",
                self.ttft_s * 1e3,
                b * 1e3
            ));
        }
        if let Some(b) = load.tpot_max_s.filter(|&b| self.tpot_s > b) {
            out.push(format!(
                "TPOT {:.1} ms > {:.1} ms",
                self.tpot_s * 1e3,
                b * 1e3
            ));
        }
        if let Some(u) = load.min_user_tps.filter(|&u| self.per_user() < u) {
            out.push(format!("{:.1} tokens/s per user < {u:.1}", self.per_user()));
        }
        out
    }
}

/// One fused continuous-batching iteration: the decode step of the batch plus
/// `tokens` prompt tokens, the weights read once.
pub fn fused_iteration_s(inst: &InstanceCost, decode_s: f64, tokens: f64, prompt: f64) -> f64 {
    if tokens <= 0.0 {
        return decode_s;
    }
    let share = inst.prefill_mean_s * tokens / prompt.max(1.0);
    (decode_s + share - inst.weight_read_s)
        .max(decode_s)
        .max(share)
}

/// The aggregated deployment of `replicas` instances at `batch` requests each
/// (`decode_s` its decode step) and chunk `chunk`; `None` when the chunk cannot
/// keep up with the prompts arriving.
pub fn aggregated(
    inst: &InstanceCost,
    batch: u64,
    decode_s: f64,
    chunk: u64,
    replicas: u64,
    load: &ServeLoad,
) -> Option<ServePoint> {
    let (l, o) = (load.prompt_mean, load.output_mean.max(1.0));
    let s = chunk as f64;
    let c = batch as f64;
    // Prompt tokens each iteration must take in to replace finished requests.
    let p = c * l / o;
    if p > s * RHO_MAX {
        return None;
    }
    let tpot = fused_iteration_s(inst, decode_s, p, l);
    let full = fused_iteration_s(inst, decode_s, s.min(load.prompt_at), l);
    let rho = p / s;
    let service = (l / s).max(1.0) * full;
    let ttft = md1_wait(rho) * service + (load.prompt_at / s).ceil() * full;
    let rate = replicas as f64 * c / (o * tpot);
    Some(ServePoint {
        mode: ServingMode::Aggregated,
        decode: Pool {
            cfg: inst.cfg,
            dcp: inst.dcp,
            gpus: inst.gpus,
            instances: replicas,
            concurrency: batch,
            chunk,
        },
        prefill: None,
        kv: None,
        ttft_s: ttft,
        tpot_s: tpot,
        request_rate: rate,
        tokens_per_s: rate * o,
        gpus: replicas * inst.gpus,
        prefill_load: rho,
    })
}

/// The disaggregated deployment: `x` prefill instances of `pre`, `y` decode
/// instances of `dec` at `batch` (`decode_s` its step), the KV move `kv` (of the
/// percentile prompt, for TTFT). `rate` fixes the offered load; `None` runs the
/// deployment as fast as its SLOs allow.
#[allow(clippy::too_many_arguments)]
pub fn disaggregated(
    pre: &InstanceCost,
    x: u64,
    dec: &InstanceCost,
    batch: u64,
    decode_s: f64,
    y: u64,
    kv: KvMove,
    rate: Option<f64>,
    load: &ServeLoad,
) -> Option<ServePoint> {
    let o = load.output_mean.max(1.0);
    let service = pre.prefill_mean_s;
    let fixed = pre.prefill_at_s + kv.time_s;
    let slack = load.ttft_max_s.map_or(f64::INFINITY, |b| b - fixed);
    let rho_max = if slack.is_finite() {
        md1_max_load(slack, service)
    } else {
        RHO_MAX
    };
    let prefill_rate = x as f64 / service;
    let decode_rate = y as f64 * batch as f64 / (o * decode_s);
    let served = match rate {
        Some(r) => r,
        None => (prefill_rate * rho_max.max(1e-9)).min(decode_rate),
    };
    if served > decode_rate * (1.0 + 1e-9) || served >= prefill_rate {
        return None;
    }
    let rho = served / prefill_rate;
    Some(ServePoint {
        mode: ServingMode::Disaggregated,
        decode: Pool {
            cfg: dec.cfg,
            dcp: dec.dcp,
            gpus: dec.gpus,
            instances: y,
            concurrency: batch,
            chunk: 0,
        },
        prefill: Some(Pool {
            cfg: pre.cfg,
            dcp: 1,
            gpus: pre.gpus,
            instances: x,
            concurrency: 1,
            chunk: load.prompt_mean.round() as u64,
        }),
        kv: Some(kv),
        ttft_s: md1_wait(rho) * service + fixed,
        tpot_s: decode_s,
        request_rate: served,
        tokens_per_s: served * o,
        gpus: x * pre.gpus + y * dec.gpus,
        prefill_load: rho,
    })
}

/// Indices of the Pareto frontier of `points` over (tokens/s per user, tokens/s per
/// GPU), in increasing order of per-user speed.
pub fn frontier(points: &[ServePoint]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..points.len()).collect();
    idx.sort_by(|&a, &b| {
        points[b]
            .per_user()
            .total_cmp(&points[a].per_user())
            .then(points[b].per_gpu().total_cmp(&points[a].per_gpu()))
    });
    let mut out = Vec::new();
    let mut best = f64::NEG_INFINITY;
    for i in idx {
        if points[i].per_gpu() > best {
            best = points[i].per_gpu();
            out.push(i);
        }
    }
    out.reverse();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md1_wait_and_its_inverse() {
        // rho 0.5: 0.5 / (2 x 0.5) = 0.5 service times.
        assert_eq!(md1_wait(0.5), 0.5);
        assert_eq!(md1_wait(1.0), f64::INFINITY);
        // Slack of 0.5 service times: a = 0.5, rho = 1 / 2.
        assert!((md1_max_load(0.5, 1.0) - 0.5).abs() < 1e-12);
        assert!((md1_wait(md1_max_load(0.3, 1.0)) - 0.3).abs() < 1e-12);
        assert_eq!(md1_max_load(100.0, 1.0), RHO_MAX);
        assert_eq!(md1_max_load(-1.0, 1.0), 0.0);
    }

    #[test]
    fn batches_are_powers_of_two_within_the_range() {
        assert_eq!(batches(1, 20), vec![1, 2, 4, 8, 16, 20]);
        assert_eq!(batches(3, 3), vec![3]);
        assert_eq!(batches(3, 8), vec![3, 4, 8]);
    }
}
