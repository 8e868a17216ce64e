//! Why a plan: its configuration's neighbours re-priced with the same cost model
//! (each degree doubled and halved against `dp`, micro-batch, ZeRO, recomputation,
//! sequence parallelism and virtual stages changed one at a time), ranked, each with
//! the time term that decides it; how step time responds to each degree; and
//! what-if deltas for more nodes, a longer sequence, a larger micro-batch.
//!
//! Every number is an estimate difference: `delta_s` of an alternative is its
//! estimate's step time minus the plan's, priced by the same function.

use crate::compare;
use crate::cost_model::estimate::{gib, Groups};
use crate::cost_model::{
    estimate_inference, estimate_train_split_with, Cluster, Estimate, InferenceLoad, Mechanisms,
    PreparedGraph,
};
use meshplan_ir::plan::Plan;
use meshplan_ir::{ParallelConfig, Recompute, Schedule, Workload};
use serde::Serialize;

/// The whole explanation (`explain --json` prints it).
#[derive(Clone, Debug, Serialize)]
pub struct Explanation {
    /// The plan's configuration.
    pub strategy: String,
    /// Model and cluster, in words.
    pub setting: String,
    /// `train` or `inference`.
    pub kind: String,
    /// The plan's configuration re-priced now (equals the plan's `predicted` when
    /// the cost model has not changed since).
    pub baseline: Estimate,
    /// The step time the plan file recorded.
    pub recorded_step_time_s: Option<f64>,
    /// Neighbours that run, fastest first (inference: most output tokens/s first).
    pub alternatives: Vec<Alternative>,
    /// Neighbours the cost model cannot run on this model and cluster, with why.
    pub cannot_run: Vec<Rejected>,
    /// Per degree: the step time at twice and half the degree (against `dp`).
    pub sensitivity: Vec<Sensitivity>,
    /// Changes of the workload or cluster rather than of the configuration.
    pub what_if: Vec<Alternative>,
    /// The layouts the search found within its tie margin of the fastest, as the plan
    /// recorded them (`search.extra.near_ties`): why this plan and not a faster one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub near_ties: Option<serde_json::Value>,
}

/// One re-priced neighbour.
#[derive(Clone, Debug, Serialize)]
pub struct Alternative {
    /// What changed, e.g. `tp 4->8, dp 40->20`.
    pub change: String,
    /// The full configuration.
    pub strategy: String,
    /// Fits in memory (and the SLO for inference).
    pub feasible: bool,
    /// Step time (training) or decode step (inference), s.
    pub step_time_s: f64,
    /// `step_time_s` minus the plan's.
    pub delta_s: f64,
    /// `delta_s` over the plan's step time, percent.
    pub delta_pct: f64,
    /// Changes of each time term, s (`compute`, `exposed_comm`, `bubble`).
    pub term_deltas_s: TermDeltas,
    /// The term that moves most in the direction of the total, or memory over
    /// capacity, in words with its numbers.
    pub deciding: String,
    /// Mesh axes that span more nodes than in the plan (their collectives then ride
    /// InfiniBand, not NVLink).
    pub crosses_infiniband: Vec<String>,
    /// Per-GPU memory, GiB.
    pub memory_gib: f64,
    /// Tokens per second, whole cluster (output tokens for inference).
    pub tokens_per_s: f64,
    /// Inference: time per output token, s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpot_s: Option<f64>,
    /// Inference: time to first token, s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_s: Option<f64>,
    /// The comparison line `compare` prints for the same pair.
    pub account: String,
}

/// How each time term moves.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct TermDeltas {
    /// Compute, s.
    pub compute: f64,
    /// Exposed communication, s.
    pub exposed_comm: f64,
    /// Pipeline bubble, s.
    pub bubble: f64,
}

/// A neighbour the cost model cannot run.
#[derive(Clone, Debug, Serialize)]
pub struct Rejected {
    /// What changed.
    pub change: String,
    /// Why it cannot run.
    pub reason: String,
}

/// Step time against one degree.
#[derive(Clone, Debug, Serialize)]
pub struct Sensitivity {
    /// `tp`, `pp`, `cp`, `ep` or `mbs`.
    pub key: String,
    /// The plan's value.
    pub value: u64,
    /// Percent change of step time at twice the degree, if it runs and fits.
    pub doubled_pct: Option<f64>,
    /// Percent change of step time at half the degree, if it runs and fits.
    pub halved_pct: Option<f64>,
    /// Why twice the degree does not fit (memory, or the SLO for inference): its
    /// step time is then no improvement, whatever it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub doubled_infeasible: Option<String>,
    /// Why half the degree does not fit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub halved_infeasible: Option<String>,
}

/// What explaining needs from a plan file: its cluster and model as the cost
/// model's types.
pub struct Inputs {
    /// The plan's graph, prepared for pricing.
    pub pg: PreparedGraph,
    /// The cluster the plan was priced on.
    pub cluster: Cluster,
}

impl Inputs {
    /// From a plan file's contents; an error names the missing piece.
    pub fn from_plan(plan: &Plan) -> Result<Inputs, String> {
        let spec = plan.cluster.spec.clone().ok_or_else(|| {
            "the plan does not record its cluster's links (`cluster.spec`, written by plans of this meshplan); re-plan to explain it".to_string()
        })?;
        let cluster: Cluster = serde_json::from_value(spec)
            .map_err(|e| format!("cluster.spec: {e}; re-plan with this meshplan"))?;
        Ok(Inputs {
            pg: PreparedGraph::new(&plan.graph),
            cluster,
        })
    }
}

/// Prices `cfg` for `workload` (`split` when the pipeline shape is the plan's).
fn price(
    pg: &PreparedGraph,
    cluster: &Cluster,
    workload: &Workload,
    cfg: &ParallelConfig,
    split: Option<&[u64]>,
) -> Result<Estimate, String> {
    let r = match workload {
        Workload::Train {
            seq_len,
            global_batch,
            ..
        } => estimate_train_split_with(
            pg,
            cluster,
            cfg,
            *seq_len,
            *global_batch,
            split,
            &Mechanisms::of(workload.framework()),
        ),
        Workload::Inference { .. } => match InferenceLoad::from_workload(workload) {
            Some(load) => estimate_inference(pg, cluster, cfg, &load),
            None => return Err("not an inference workload".into()),
        },
    };
    r.map_err(|e| e.reason)
}

/// The configuration's neighbours: (what changed, configuration).
pub fn neighbours(
    c: &ParallelConfig,
    layers: u64,
    experts: u64,
    inference: bool,
) -> Vec<(String, ParallelConfig)> {
    let mut out: Vec<(String, ParallelConfig)> = Vec::new();
    let mut push = |name: String, n: ParallelConfig| {
        if n != *c && !out.iter().any(|(_, o)| *o == n) {
            out.push((name, n));
        }
    };
    // Degrees trade against dp, so the GPU count stays.
    type Get = fn(&ParallelConfig) -> u64;
    type Set = fn(&mut ParallelConfig, u64);
    let degrees: [(&str, Get, Set); 3] = [
        ("tp", |c| c.tp, |c, v| c.tp = v),
        ("pp", |c| c.pp, |c, v| c.pp = v),
        ("cp", |c| c.cp, |c, v| c.cp = v),
    ];
    for (key, get, set) in degrees {
        let v = get(c);
        if c.dp.is_multiple_of(2) {
            let mut n = *c;
            set(&mut n, v * 2);
            n.dp = c.dp / 2;
            fix_pipeline(&mut n, layers);
            fix_tp(&mut n);
            push(format!("{key} {v}->{}, dp {}->{}", v * 2, c.dp, n.dp), n);
        }
        if v > 1 && v.is_multiple_of(2) {
            let mut n = *c;
            set(&mut n, v / 2);
            n.dp = c.dp * 2;
            fix_pipeline(&mut n, layers);
            fix_tp(&mut n);
            push(format!("{key} {v}->{}, dp {}->{}", v / 2, c.dp, n.dp), n);
        }
    }
    if experts > 0 {
        for ep in [c.ep * 2, c.ep / 2] {
            if ep >= 1 && experts.is_multiple_of(ep) && (c.dp * c.tp * c.cp).is_multiple_of(ep) {
                push(format!("ep {}->{ep}", c.ep), ParallelConfig { ep, ..*c });
            }
        }
    }
    if inference {
        if c.tp > 1 {
            push(
                format!("dp_attention {}->{}", c.dp_attention, !c.dp_attention),
                ParallelConfig {
                    dp_attention: !c.dp_attention,
                    ..*c
                },
            );
        }
    } else {
        for mbs in [c.mbs * 2, c.mbs / 2] {
            if mbs >= 1 {
                push(
                    format!("mbs {}->{mbs}", c.mbs),
                    ParallelConfig { mbs, ..*c },
                );
            }
        }
        for zero in [c.zero.wrapping_sub(1), c.zero + 1] {
            if zero <= 3 && c.dp * c.cp > 1 {
                push(
                    format!("zero {}->{zero}", c.zero),
                    ParallelConfig { zero, ..*c },
                );
            }
        }
        for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
            push(
                format!("recompute {}->{}", rc_name(c.recompute), rc_name(rc)),
                ParallelConfig {
                    recompute: rc,
                    ..*c
                },
            );
        }
        if c.tp > 1 {
            push(
                format!("sp {}->{}", c.sp, !c.sp),
                ParallelConfig { sp: !c.sp, ..*c },
            );
        }
        if c.pp > 1 {
            for vpp in [c.vpp * 2, c.vpp / 2] {
                if vpp >= 1 && layers.is_multiple_of(c.pp * vpp) {
                    let schedule = if vpp > 1 {
                        Schedule::Interleaved
                    } else {
                        Schedule::OneFOneB
                    };
                    push(
                        format!("vpp {}->{vpp}", c.vpp),
                        ParallelConfig {
                            vpp,
                            schedule,
                            ..*c
                        },
                    );
                }
            }
        }
    }
    out
}

/// A pipeline change keeps the schedule valid: virtual stages only where the layers
/// divide, and 1F1B once there is one chunk per stage.
fn fix_pipeline(n: &mut ParallelConfig, layers: u64) {
    if n.pp == 1 || !layers.is_multiple_of(n.pp * n.vpp) {
        n.vpp = 1;
    }
    n.schedule = match (n.vpp > 1, n.schedule) {
        (true, _) => Schedule::Interleaved,
        (false, Schedule::Interleaved) => Schedule::OneFOneB,
        (false, s) => s,
    };
}

/// Sequence parallelism needs a tensor axis.
fn fix_tp(n: &mut ParallelConfig) {
    if n.tp == 1 {
        n.sp = false;
        n.tp_overlap = false;
    }
}

fn rc_name(r: Recompute) -> &'static str {
    match r {
        Recompute::None => "none",
        Recompute::Selective => "selective",
        Recompute::Full => "full",
    }
}

/// Axes whose group stays inside one node under `base` but spans nodes under `alt`.
pub fn crossings(base: &ParallelConfig, alt: &ParallelConfig, gpn: u64) -> Vec<String> {
    let (a, b) = (Groups::new(base, gpn), Groups::new(alt, gpn));
    let mut out = Vec::new();
    for (name, x, y) in [
        ("tp", a.tp, b.tp),
        ("cp", a.cp, b.cp),
        ("dp", a.dp, b.dp),
        ("ep", a.ep, b.ep),
    ] {
        if x.nodes() <= 1 && y.nodes() > 1 {
            out.push(name.to_string());
        }
    }
    out
}

fn pct(x: f64, of: f64) -> f64 {
    if of > 0.0 {
        100.0 * x / of
    } else {
        0.0
    }
}

/// `alt` against `base`: the deltas and the deciding term.
fn alternative(
    change: String,
    base: &Estimate,
    alt: &Estimate,
    gpn: u64,
    inference: bool,
) -> Alternative {
    let (a, b) = (&base.time_breakdown_s, &alt.time_breakdown_s);
    let d = TermDeltas {
        compute: b.compute - a.compute,
        exposed_comm: b.exposed_comm - a.exposed_comm,
        bubble: b.bubble - a.bubble,
    };
    let delta = alt.step_time_s - base.step_time_s;
    let cross = crossings(&base.config, &alt.config, gpn);
    let mem = gib(alt.memory_per_gpu_bytes.total);
    let cap = gib(alt.memory_capacity_bytes);
    let deciding = if !alt.feasible && mem > cap {
        format!(
            "memory {mem:.1} GiB per GPU > {cap:.1} GiB capacity (+{:.1} GiB over)",
            mem - cap
        )
    } else if !alt.feasible {
        alt.infeasible_reason
            .clone()
            .unwrap_or_else(|| "does not fit".into())
    } else if !inference && delta.abs() < 1e-9 * base.step_time_s.max(1.0) {
        format!(
            "same step time; memory {:.1} -> {mem:.1} GiB per GPU",
            gib(base.memory_per_gpu_bytes.total)
        )
    } else if inference {
        let (tb, ta) = (base.tpot_s.unwrap_or(0.0), alt.tpot_s.unwrap_or(0.0));
        let (fb, fa) = (base.ttft_s.unwrap_or(0.0), alt.ttft_s.unwrap_or(0.0));
        format!(
            "TPOT {:+.2} ms ({:+.1}%), TTFT {:+.1} ms ({:+.1}%)",
            (ta - tb) * 1e3,
            pct(ta - tb, tb),
            (fa - fb) * 1e3,
            pct(fa - fb, fb)
        )
    } else {
        let mut terms = [
            ("compute", d.compute),
            ("exposed communication", d.exposed_comm),
            ("bubble", d.bubble),
        ];
        // The term that pushes hardest the way the total moved.
        let sign = if delta >= 0.0 { 1.0 } else { -1.0 };
        terms.sort_by(|x, y| (sign * y.1).total_cmp(&(sign * x.1)));
        let (name, v) = terms[0];
        format!(
            "{name} {v:+.3} s ({:+.1}% of the plan's step time)",
            pct(v, base.step_time_s)
        )
    };
    let deciding = if cross.is_empty() {
        deciding
    } else {
        format!(
            "{} would cross InfiniBand: {deciding}",
            cross
                .iter()
                .map(|ax| format!("{ax}={}", axis_value(&alt.config, ax)))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    Alternative {
        change,
        strategy: alt.config.to_string(),
        feasible: alt.feasible,
        step_time_s: alt.step_time_s,
        delta_s: delta,
        delta_pct: pct(delta, base.step_time_s),
        term_deltas_s: d,
        deciding,
        crosses_infiniband: cross,
        memory_gib: mem,
        tokens_per_s: alt.output_tokens_per_s.unwrap_or(alt.tokens_per_s),
        tpot_s: alt.tpot_s,
        ttft_s: alt.ttft_s,
        account: compare::account(base, None, alt, None),
    }
}

fn axis_value(c: &ParallelConfig, axis: &str) -> u64 {
    match axis {
        "tp" => c.tp,
        "cp" => c.cp,
        "dp" => c.dp * c.cp,
        _ => c.ep,
    }
}

/// Explains `plan` on its own cluster and model.
pub fn explain(plan: &Plan, inp: &Inputs) -> Result<Explanation, String> {
    let c = plan.strategy;
    let gpn = inp.cluster.gpus_per_node;
    let inference = matches!(plan.workload, Workload::Inference { .. });
    let split_for = |n: &ParallelConfig| -> Option<Vec<u64>> {
        (n.pp == c.pp && n.vpp == c.vpp && !inference).then(|| plan.layer_split.clone())
    };
    let base = price(
        &inp.pg,
        &inp.cluster,
        &plan.workload,
        &c,
        split_for(&c).as_deref(),
    )
    .map_err(|e| format!("the plan's own configuration {c} no longer prices: {e}"))?;

    let mut alternatives = Vec::new();
    let mut cannot_run = Vec::new();
    let mut sensitivity: Vec<Sensitivity> = Vec::new();
    let framework = plan.workload.framework();
    for (change, n) in neighbours(&c, inp.pg.layers, inp.pg.experts, inference) {
        // An alternative the plan's framework cannot run is no alternative for its user.
        let why = match &plan.workload {
            Workload::Train { global_batch, .. } => framework
                .cannot_run(
                    &n,
                    &meshplan_ir::framework::Needs::of(&plan.graph, inp.pg.layers, *global_batch),
                )
                .into_iter()
                .next(),
            Workload::Inference { .. } => None,
        };
        if let Some(why) = why {
            cannot_run.push(Rejected {
                change,
                reason: format!("--framework {framework} cannot run it: {why}"),
            });
            continue;
        }
        match price(
            &inp.pg,
            &inp.cluster,
            &plan.workload,
            &n,
            split_for(&n).as_deref(),
        ) {
            Ok(e) => alternatives.push(alternative(change, &base, &e, gpn, inference)),
            Err(reason) => cannot_run.push(Rejected { change, reason }),
        }
    }
    let rank = |a: &Alternative| {
        let speed = if inference {
            -a.tokens_per_s
        } else {
            a.step_time_s
        };
        (!a.feasible, speed)
    };
    alternatives.sort_by(|x, y| {
        let (fx, sx) = rank(x);
        let (fy, sy) = rank(y);
        fx.cmp(&fy).then(sx.total_cmp(&sy))
    });

    for (key, value) in [
        ("tp", c.tp),
        ("pp", c.pp),
        ("cp", c.cp),
        ("ep", c.ep),
        ("mbs", c.mbs),
    ] {
        // A move that does not fit gets its reason instead of a percentage: a faster
        // step that runs out of memory (or misses the SLO) is not an improvement.
        let find = |to: u64| -> (Option<f64>, Option<String>) {
            let prefix = format!("{key} {value}->{to}");
            match alternatives
                .iter()
                .find(|a| a.change == prefix || a.change.starts_with(&format!("{prefix},")))
            {
                Some(a) if a.feasible => (Some(a.delta_pct), None),
                Some(a) => (None, Some(a.deciding.clone())),
                None => (None, None),
            }
        };
        let (doubled_pct, doubled_infeasible) = find(value * 2);
        let (halved_pct, halved_infeasible) = if value > 1 {
            find(value / 2)
        } else {
            (None, None)
        };
        let any = doubled_pct.is_some()
            || halved_pct.is_some()
            || doubled_infeasible.is_some()
            || halved_infeasible.is_some();
        if any {
            sensitivity.push(Sensitivity {
                key: key.into(),
                value,
                doubled_pct,
                halved_pct,
                doubled_infeasible,
                halved_infeasible,
            });
        }
    }

    let what_if = what_ifs(plan, inp, &base, inference);
    let recorded = plan.predicted.get("step_time_s").and_then(|v| v.as_f64());
    Ok(Explanation {
        strategy: c.to_string(),
        setting: format!(
            "{} on {} x {} ({} GPUs, {} per node)",
            plan.model.name,
            inp.cluster.nodes,
            inp.cluster.name,
            inp.cluster.gpus(),
            gpn
        ),
        kind: if inference { "inference" } else { "train" }.into(),
        baseline: base,
        recorded_step_time_s: recorded,
        alternatives,
        cannot_run,
        sensitivity,
        what_if,
        near_ties: plan.search.extra.get("near_ties").cloned(),
    })
}

/// More nodes, a longer sequence, a larger micro-batch: the same configuration with
/// `dp` taking up the new GPUs.
fn what_ifs(plan: &Plan, inp: &Inputs, base: &Estimate, inference: bool) -> Vec<Alternative> {
    let c = plan.strategy;
    let gpn = inp.cluster.gpus_per_node;
    let mut out = Vec::new();
    // One more node, or the fewest more that the model-parallel group divides.
    let group = c.tp * c.pp * c.cp;
    let mut extra = 1;
    while !((inp.cluster.nodes + extra) * gpn).is_multiple_of(group) && extra <= group {
        extra += 1;
    }
    let mut bigger = inp.cluster.clone();
    bigger.nodes += extra;
    let n = ParallelConfig {
        dp: bigger.gpus() / group,
        ..c
    };
    let name = if extra == 1 {
        format!(
            "one more node ({} nodes, dp {}->{})",
            bigger.nodes, c.dp, n.dp
        )
    } else {
        format!(
            "{extra} more nodes, the fewest that tp x pp x cp = {group} GPUs divide ({} nodes, dp {}->{})",
            bigger.nodes, c.dp, n.dp
        )
    };
    if let Ok(e) = price(&inp.pg, &bigger, &plan.workload, &n, None) {
        out.push(alternative(name, base, &e, gpn, inference));
    }
    match &plan.workload {
        Workload::Train {
            seq_len,
            global_batch,
            optimizer,
            framework,
        } => {
            let longer = Workload::Train {
                seq_len: seq_len * 2,
                global_batch: *global_batch,
                optimizer: optimizer.clone(),
                framework: *framework,
            };
            if let Ok(e) = price(&inp.pg, &inp.cluster, &longer, &c, Some(&plan.layer_split)) {
                out.push(alternative(
                    format!(
                        "sequence {}->{} (same sequences per step)",
                        seq_len,
                        seq_len * 2
                    ),
                    base,
                    &e,
                    gpn,
                    inference,
                ));
            }
            let mbs = ParallelConfig {
                mbs: c.mbs * 2,
                ..c
            };
            if let Ok(e) = price(
                &inp.pg,
                &inp.cluster,
                &plan.workload,
                &mbs,
                Some(&plan.layer_split),
            ) {
                out.push(alternative(
                    format!("micro-batch {}->{}", c.mbs, c.mbs * 2),
                    base,
                    &e,
                    gpn,
                    inference,
                ));
            }
        }
        Workload::Inference {
            prompt_len,
            output_len,
            concurrency,
            slo,
            serving,
        } => {
            let longer = Workload::Inference {
                prompt_len: prompt_len * 2,
                output_len: *output_len,
                concurrency: *concurrency,
                slo: slo.clone(),
                serving: serving.clone(),
            };
            if let Ok(e) = price(&inp.pg, &inp.cluster, &longer, &c, None) {
                out.push(alternative(
                    format!("prompt {}->{}", prompt_len, prompt_len * 2),
                    base,
                    &e,
                    gpn,
                    inference,
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshplan_ir::PartialConfig;

    fn cfg(s: &str, gpus: u64) -> ParallelConfig {
        PartialConfig::parse(s, "test")
            .and_then(|p| p.resolve(gpus, "test"))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn degrees_trade_against_dp_and_schedules_stay_valid() {
        let c = cfg("dp=60,tp=8,pp=8,mbs=1,recompute=full,vpp=2", 3840);
        let n = neighbours(&c, 96, 0, false);
        let find = |name: &str| {
            n.iter()
                .find(|(k, _)| k == name)
                .map(|(_, c)| *c)
                .unwrap_or_else(|| {
                    panic!(
                        "no `{name}` in {:?}",
                        n.iter().map(|x| &x.0).collect::<Vec<_>>()
                    )
                })
        };
        let tp16 = find("tp 8->16, dp 60->30");
        assert_eq!((tp16.tp, tp16.dp, tp16.world_size()), (16, 30, 3840));
        // 96 layers make 16 stages x 2 chunks of 3: the interleaving stays.
        let pp16 = find("pp 8->16, dp 60->30");
        assert_eq!((pp16.vpp, pp16.schedule), (2, Schedule::Interleaved));
        // With 4 chunks per stage, 16 stages would need 64 chunks of 1.5 layers: the
        // neighbour falls back to one chunk and 1F1B.
        let c4 = cfg("dp=60,tp=8,pp=8,mbs=1,vpp=4,schedule=interleaved", 3840);
        let (_, pp16_4) = neighbours(&c4, 96, 0, false)
            .into_iter()
            .find(|(k, _)| k.starts_with("pp 8->16"))
            .expect("pp x2");
        assert_eq!((pp16_4.vpp, pp16_4.schedule), (1, Schedule::OneFOneB));
        let pp4 = find("pp 8->4, dp 60->120");
        assert_eq!(pp4.world_size(), 3840);
        let vpp1 = find("vpp 2->1");
        assert_eq!(vpp1.schedule, Schedule::OneFOneB);
        assert!(n.iter().all(|(_, x)| x.world_size() == 3840 && *x != c));
        // Inference: degrees and DP-attention, no training knobs.
        let i = cfg("dp=1,tp=8", 8);
        let n = neighbours(&i, 80, 0, true);
        assert!(n
            .iter()
            .any(|(k, x)| k == "dp_attention false->true" && x.dp_attention));
        assert!(!n
            .iter()
            .any(|(k, _)| k.starts_with("zero") || k.starts_with("mbs")));
    }

    #[test]
    fn a_tensor_axis_wider_than_a_node_crosses_infiniband() {
        let base = cfg("dp=60,tp=8,pp=8", 3840);
        let wide = cfg("dp=30,tp=16,pp=8", 3840);
        assert_eq!(crossings(&base, &wide, 8), vec!["tp".to_string()]);
        assert!(crossings(&wide, &base, 8).is_empty());
        // cp outside a full node of tp leaves the node too.
        let cp2 = cfg("dp=30,tp=8,pp=8,cp=2", 3840);
        assert_eq!(crossings(&base, &cp2, 8), vec!["cp".to_string()]);
    }
}
