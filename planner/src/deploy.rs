//! The serving search behind `meshplan deploy`: instance configurations (tp, pp,
//! ep, DP-attention, and `dp` where experts span attention replicas), requests in
//! flight, chunked-prefill size, and the split into prefill and decode pools; the
//! throughput-latency frontier over all of them and the best deployment within the
//! SLOs.

use crate::cost_model::serving::{
    aggregated, disaggregated, frontier, kv_replicas, kv_transfer, md1_max_load, price_instance,
    InstanceCost, ServeLoad, ServePoint, RHO_MAX,
};
use crate::cost_model::{Cluster, PreparedGraph};
use crate::search::{divisors, inference_space};
use meshplan_ir::serving::{ModeChoice, Objective, ServingMode};
use meshplan_ir::{ParallelConfig, PartialConfig};
use std::time::Instant;

/// Prefill instance configurations kept for pairing with decode pools: the fastest
/// per request and the most requests per GPU-second, a few of each.
const PREFILL_KEEP: usize = 6;

/// What the search found.
#[derive(Clone, Debug)]
pub struct DeployReport {
    /// Every deployment priced (for disaggregated ones, the best pool ratio of each
    /// pairing).
    pub points: Vec<ServePoint>,
    /// Indices of the frontier (tokens/s per GPU against tokens/s per user) among
    /// the points that fit and meet the TTFT bound.
    pub frontier: Vec<usize>,
    /// The best deployment within the SLOs.
    pub best: Option<usize>,
    /// The best aggregated and disaggregated ones within the SLOs.
    pub best_aggregated: Option<usize>,
    /// See `best_aggregated`.
    pub best_disaggregated: Option<usize>,
    /// Instance configurations priced (those that fit at least one request).
    pub instances: usize,
    /// Instance configurations tried.
    pub instances_tried: usize,
    /// Seconds the search took.
    pub wall_s: f64,
}

impl DeployReport {
    /// The deployment nearest to the SLOs when none meets them.
    pub fn closest(&self, load: &ServeLoad) -> Option<usize> {
        (0..self.points.len()).min_by(|&a, &b| {
            self.points[a]
                .slo_ratio(load)
                .total_cmp(&self.points[b].slo_ratio(load))
        })
    }

    /// Which wins and why, from the two bests' numbers.
    pub fn verdict(&self) -> Option<String> {
        let (a, d) = (
            &self.points[self.best_aggregated?],
            &self.points[self.best_disaggregated?],
        );
        let (wa, wd) = (a.per_gpu(), d.per_gpu());
        let pre = d.prefill.expect("a disaggregated point has a prefill pool");
        let kv = d.kv.map_or(0.0, |k| k.time_s);
        let share = (pre.instances * pre.gpus) as f64 / d.gpus as f64;
        Some(if wd > wa {
            format!(
                "disaggregated wins: {wd:.1} vs {wa:.1} tokens/s per GPU ({:+.0}%): decode iterations carry no prompt chunks (TPOT {:.1} vs {:.1} ms), so each decode GPU holds {} requests in flight against {}; the prefill pool takes {:.0}% of the GPUs and the KV move adds {:.2} ms to TTFT",
                (wd / wa - 1.0) * 100.0,
                d.tpot_s * 1e3,
                a.tpot_s * 1e3,
                d.decode.concurrency,
                a.decode.concurrency,
                share * 100.0,
                kv * 1e3
            )
        } else {
            format!(
                "aggregated wins: {wa:.1} vs {wd:.1} tokens/s per GPU ({:+.0}%): prefill chunks fill the decode iterations' idle compute on the same GPUs, while the disaggregated deployment gives {:.0}% of its GPUs to prefill at load {:.2} and moves each KV cache in {:.2} ms",
                (wa / wd - 1.0) * 100.0,
                share * 100.0,
                d.prefill_load,
                kv * 1e3
            )
        })
    }
}

/// A configuration as the keys a serving instance sets (`tp=8,ep=16,dp_attention`),
/// the defaults left out.
pub fn short(c: &ParallelConfig) -> String {
    let mut parts = vec![format!("tp={}", c.tp)];
    for (k, v) in [("pp", c.pp), ("dp", c.dp), ("ep", c.ep)] {
        if v > 1 {
            parts.push(format!("{k}={v}"));
        }
    }
    if c.dp_attention {
        parts.push("dp_attention".into());
    }
    parts.join(",")
}

/// [`short`] with the pool's decode context parallelism.
pub fn short_pool(p: &crate::cost_model::serving::Pool) -> String {
    if p.dcp > 1 {
        format!("{},dcp={}", short(&p.cfg), p.dcp)
    } else {
        short(&p.cfg)
    }
}

/// Instance configurations of `gpus` GPUs: data parallelism inside an instance only
/// where experts span its attention replicas or attention runs data-parallel (else
/// it is just more instances).
pub fn instance_configs(
    pg: &PreparedGraph,
    cluster: &Cluster,
    gpus: u64,
    fixed: &PartialConfig,
) -> Vec<ParallelConfig> {
    let inst = crate::cost_model::serving::instance_cluster(cluster, gpus);
    inference_space(pg, &inst, fixed)
        .into_iter()
        .filter(|c| c.dp == 1 || (pg.experts > 0 && (c.ep > c.tp || c.dp_attention)))
        .collect()
}

/// Keys fixed for every instance, and for each pool of a disaggregated deployment
/// (the aggregated deployment's instances take `decode`'s too).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fixed {
    /// Every instance.
    pub all: PartialConfig,
    /// Prefill instances.
    pub prefill: PartialConfig,
    /// Decode (and aggregated) instances.
    pub decode: PartialConfig,
    /// Decode context parallelism of decode instances (`None`: searched).
    pub decode_dcp: Option<u64>,
}

impl From<PartialConfig> for Fixed {
    fn from(all: PartialConfig) -> Fixed {
        Fixed {
            all,
            ..Fixed::default()
        }
    }
}

/// Searches every deployment of `load` on `cluster`.
pub fn deploy(
    pg: &PreparedGraph,
    cluster: &Cluster,
    load: &ServeLoad,
    fixed: &Fixed,
) -> DeployReport {
    let t0 = Instant::now();
    let n = cluster.gpus();
    let mut tried = 0;
    let mut insts: Vec<InstanceCost> = Vec::new();
    // Instance sizes: those that tile the cluster or a node, and the powers of two
    // that fit in a node (pools of different sizes may share the cluster unevenly).
    let mut sizes = divisors(n);
    let fit = cluster.gpus_per_node.min(n);
    sizes.extend(
        divisors(cluster.gpus_per_node)
            .into_iter()
            .filter(|&g| g <= n),
    );
    sizes.extend((0..63).map(|k| 1u64 << k).take_while(|&g| g <= fit));
    sizes.sort_unstable();
    sizes.dedup();
    for g in sizes {
        for cfg in instance_configs(pg, cluster, g, &fixed.all) {
            tried += 1;
            if let Ok(Some(c)) = price_instance(pg, cluster, &cfg, 1, load) {
                insts.push(c);
            }
            // Decode context parallelism where the cache is copied over tensor ranks.
            let copies = kv_replicas(pg, &cfg);
            for dcp in divisors(copies).into_iter().filter(|&d| d > 1) {
                if fixed.decode_dcp.is_some_and(|f| f != dcp) {
                    continue;
                }
                tried += 1;
                if let Ok(Some(c)) = price_instance(pg, cluster, &cfg, dcp, load) {
                    insts.push(c);
                }
            }
        }
    }
    let mut points = Vec::new();
    let decoders: Vec<&InstanceCost> = insts
        .iter()
        .filter(|i| fixed.decode.matches(&i.cfg) && fixed.decode_dcp.is_none_or(|d| d == i.dcp))
        .collect();
    if load.mode != ModeChoice::Disaggregated {
        for inst in &decoders {
            aggregated_points(inst, n, load, &mut points);
        }
    }
    if load.mode != ModeChoice::Aggregated {
        let prefillers: Vec<&InstanceCost> = insts
            .iter()
            .filter(|i| i.dcp == 1 && fixed.prefill.matches(&i.cfg))
            .collect();
        disaggregated_points(pg, cluster, &prefillers, &decoders, load, &mut points);
    }
    let ttft_ok = |p: &ServePoint| load.ttft_max_s.is_none_or(|b| p.ttft_s <= b);
    let eligible: Vec<usize> = (0..points.len()).filter(|&i| ttft_ok(&points[i])).collect();
    let sub: Vec<ServePoint> = eligible.iter().map(|&i| points[i].clone()).collect();
    let front = frontier(&sub).into_iter().map(|i| eligible[i]).collect();
    let best_of = |mode: Option<ServingMode>| {
        (0..points.len())
            .filter(|&i| points[i].meets(load) && mode.is_none_or(|m| points[i].mode == m))
            .max_by(|&a, &b| better(&points[a], &points[b], load))
    };
    DeployReport {
        best: best_of(None),
        best_aggregated: best_of(Some(ServingMode::Aggregated)),
        best_disaggregated: best_of(Some(ServingMode::Disaggregated)),
        frontier: front,
        points,
        instances: insts.len(),
        instances_tried: tried,
        wall_s: t0.elapsed().as_secs_f64(),
    }
}

/// Orders two deployments that meet the SLOs: the objective; under an offered load
/// the fewest GPUs first. Ties go to the faster per user, then the simpler layout.
fn better(a: &ServePoint, b: &ServePoint, load: &ServeLoad) -> std::cmp::Ordering {
    let primary = if load.arrival_rate.is_some() {
        b.gpus.cmp(&a.gpus)
    } else {
        a.score(load.objective).total_cmp(&b.score(load.objective))
    };
    let secondary = match load.objective {
        Objective::PerGpu => a.per_user().total_cmp(&b.per_user()),
        Objective::PerUser => a.per_gpu().total_cmp(&b.per_gpu()),
    };
    primary
        .then(secondary)
        .then(b.ttft_s.total_cmp(&a.ttft_s))
        .then(b.gpus.cmp(&a.gpus))
        .then(b.decode.cfg.to_string().cmp(&a.decode.cfg.to_string()))
}

fn aggregated_points(inst: &InstanceCost, n: u64, load: &ServeLoad, out: &mut Vec<ServePoint>) {
    let max_replicas = n / inst.gpus;
    for &(b, step) in &inst.decode {
        for &chunk in &load.chunks {
            let Some(one) = aggregated(inst, b, step, chunk, 1, load) else {
                continue;
            };
            let replicas = match load.arrival_rate {
                Some(r) => (r / one.request_rate).ceil() as u64,
                None => max_replicas,
            };
            if replicas == 0 || replicas > max_replicas {
                continue;
            }
            if let Some(mut p) = aggregated(inst, b, step, chunk, replicas, load) {
                if let Some(r) = load.arrival_rate {
                    p.request_rate = r;
                    p.tokens_per_s = r * load.output_mean;
                }
                out.push(p);
            }
        }
    }
}

/// Prefill instances worth pairing: the few fastest on the percentile prompt and the
/// few with the most prompts per GPU-second.
fn prefill_candidates<'a>(insts: &[&'a InstanceCost]) -> Vec<&'a InstanceCost> {
    let mut by_speed: Vec<&InstanceCost> = insts.to_vec();
    by_speed.sort_by(|a, b| a.prefill_at_s.total_cmp(&b.prefill_at_s));
    let mut by_rate = by_speed.clone();
    by_rate.sort_by(|a, b| {
        (a.prefill_mean_s * a.gpus as f64).total_cmp(&(b.prefill_mean_s * b.gpus as f64))
    });
    let mut out: Vec<&InstanceCost> = Vec::new();
    for c in by_speed
        .into_iter()
        .take(PREFILL_KEEP)
        .chain(by_rate.into_iter().take(PREFILL_KEEP))
    {
        if !out.iter().any(|o| o.cfg == c.cfg) {
            out.push(c);
        }
    }
    out
}

fn disaggregated_points(
    pg: &PreparedGraph,
    cluster: &Cluster,
    prefillers: &[&InstanceCost],
    decoders: &[&InstanceCost],
    load: &ServeLoad,
    out: &mut Vec<ServePoint>,
) {
    let n = cluster.gpus();
    let gpn = cluster.gpus_per_node;
    for pre in prefill_candidates(prefillers) {
        for &dec in decoders {
            let used_min = pre.gpus + dec.gpus;
            if used_min > n {
                continue;
            }
            // Both pools in one node when the whole deployment fits in one.
            let same_node = n <= gpn;
            let kv = kv_transfer(pg, cluster, &pre.cfg, &dec.cfg, load.prompt_at, same_node);
            for &(b, step) in &dec.decode {
                let best = match load.arrival_rate {
                    Some(rate) => sized_for_rate(pre, dec, b, step, kv, rate, n, load),
                    None => best_ratio(pre, dec, b, step, kv, n, load),
                };
                out.extend(best);
            }
        }
    }
}

/// The pool ratio with the most tokens per GPU (the whole cluster, or less when
/// the leftover cannot hold another instance).
fn best_ratio(
    pre: &InstanceCost,
    dec: &InstanceCost,
    b: u64,
    step: f64,
    kv: crate::cost_model::serving::KvMove,
    n: u64,
    load: &ServeLoad,
) -> Option<ServePoint> {
    let mut best: Option<ServePoint> = None;
    for x in 1..=(n - dec.gpus) / pre.gpus {
        let y = (n - x * pre.gpus) / dec.gpus;
        if y == 0 {
            continue;
        }
        if let Some(p) = disaggregated(pre, x, dec, b, step, y, kv, None, load) {
            if best.as_ref().is_none_or(|q| p.per_gpu() > q.per_gpu()) {
                best = Some(p);
            }
        }
    }
    best
}

/// The fewest instances of each pool that serve `rate` within the TTFT bound.
#[allow(clippy::too_many_arguments)]
fn sized_for_rate(
    pre: &InstanceCost,
    dec: &InstanceCost,
    b: u64,
    step: f64,
    kv: crate::cost_model::serving::KvMove,
    rate: f64,
    n: u64,
    load: &ServeLoad,
) -> Option<ServePoint> {
    let service = pre.prefill_mean_s;
    let slack = load
        .ttft_max_s
        .map_or(f64::INFINITY, |t| t - pre.prefill_at_s - kv.time_s);
    let rho = if slack.is_finite() {
        md1_max_load(slack, service)
    } else {
        RHO_MAX
    };
    if rho <= 0.0 {
        return None;
    }
    let x = (rate * service / rho).ceil().max(1.0) as u64;
    let y = (rate * load.output_mean * step / b as f64).ceil().max(1.0) as u64;
    if x * pre.gpus + y * dec.gpus > n {
        return None;
    }
    disaggregated(pre, x, dec, b, step, y, kv, Some(rate), load)
}

/// What would serve a load no deployment serves.
#[derive(Clone, Debug, Default)]
pub struct DeployRemedy {
    /// Nodes of this cluster that would serve it, and the best deployment there.
    pub more_nodes: Option<(u64, ServePoint)>,
    /// The tightest TPOT bound some deployment meets along with the other SLOs.
    pub tpot_s: Option<f64>,
    /// The tightest TTFT bound some deployment meets along with the other SLOs.
    pub ttft_s: Option<f64>,
    /// The longest percentile prompt (tokens) that would be served, halving.
    pub prompt_at: Option<f64>,
}

/// Searches what would serve `load` when nothing in `report` does: more nodes (up
/// to 8 times), a looser TPOT or TTFT, shorter prompts (down to 1/16).
pub fn remedy(
    pg: &PreparedGraph,
    cluster: &Cluster,
    load: &ServeLoad,
    fixed: &Fixed,
    report: &DeployReport,
) -> DeployRemedy {
    let pts = &report.points;
    let without = |tpot: bool| ServeLoad {
        tpot_max_s: if tpot { None } else { load.tpot_max_s },
        ttft_max_s: if tpot { load.ttft_max_s } else { None },
        min_user_tps: if tpot { None } else { load.min_user_tps },
        ..load.clone()
    };
    let (no_tpot, no_ttft) = (without(true), without(false));
    let tpot_s = pts
        .iter()
        .filter(|p| p.meets(&no_tpot))
        .map(|p| p.tpot_s)
        .min_by(f64::total_cmp)
        .filter(|_| load.tpot_max_s.is_some() || load.min_user_tps.is_some());
    let ttft_s = pts
        .iter()
        .filter(|p| p.meets(&no_ttft))
        .map(|p| p.ttft_s)
        .min_by(f64::total_cmp)
        .filter(|_| load.ttft_max_s.is_some());
    let mut more_nodes = None;
    for f in [2, 4, 8] {
        let bigger = Cluster {
            nodes: cluster.nodes * f,
            ..cluster.clone()
        };
        let r = deploy(pg, &bigger, load, fixed);
        if let Some(b) = r.best {
            more_nodes = Some((bigger.nodes, r.points[b].clone()));
            break;
        }
    }
    let mut prompt_at = None;
    for f in [0.5, 0.25, 0.125, 0.0625] {
        let shorter = load.with_prompts_scaled(f);
        if deploy(pg, cluster, &shorter, fixed).best.is_some() {
            prompt_at = Some(shorter.prompt_at);
            break;
        }
    }
    DeployRemedy {
        more_nodes,
        tpot_s,
        ttft_s,
        prompt_at,
    }
}
