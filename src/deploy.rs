//! `deploy`: the best serving deployment within the SLOs (aggregated or prefill and
//! decode pools), the throughput-latency frontier, and the plan of what wins.

use crate::{no_fit, print_json, Failure};
use meshplan_cost_model::serving::{instance_cluster, ServeLoad, ServePoint};
use meshplan_ir::plan::Plan;
use meshplan_ir::serving::{KvTransfer, PoolInfo, ServingInfo, ServingMode};
use meshplan_ir::{ParallelConfig, PartialConfig, Workload, WorkloadOverrides};
use meshplan_planner::deploy::{deploy as search, remedy, short_pool, DeployReport, Fixed};
use meshplan_planner::output::plan_for_config;
use std::path::PathBuf;

/// The flags of `deploy`.
pub(crate) struct DeployArgs {
    pub model: PathBuf,
    pub cluster: PathBuf,
    pub output: PathBuf,
    pub nodes: Option<u64>,
    pub calibration: Option<PathBuf>,
    pub config: Option<String>,
    pub prefill_config: Option<String>,
    pub decode_config: Option<String>,
    pub dcp: Option<u64>,
    pub figures: Option<PathBuf>,
    pub png: bool,
    pub workload: WorkloadOverrides,
    pub json: bool,
}

fn pool_json(p: &meshplan_cost_model::serving::Pool) -> serde_json::Value {
    serde_json::json!({
        "strategy": p.cfg.to_string(),
        "config": p.cfg,
        "dcp": p.dcp,
        "instances": p.instances,
        "gpus_per_instance": p.gpus,
        "concurrency_per_instance": p.concurrency,
        "chunked_prefill_tokens": p.chunk,
    })
}

/// A deployment as the contract's JSON keys.
pub(crate) fn point_json(p: &ServePoint) -> serde_json::Value {
    serde_json::json!({
        "mode": p.mode,
        "ttft_s": p.ttft_s,
        "tpot_s": p.tpot_s,
        "output_tokens_per_s": p.tokens_per_s,
        "output_tokens_per_s_per_gpu": p.per_gpu(),
        "output_tokens_per_s_per_user": p.per_user(),
        "requests_per_s": p.request_rate,
        "gpus": p.gpus,
        "prefill_load": p.prefill_load,
        "decode": pool_json(&p.decode),
        "prefill": p.prefill.as_ref().map(pool_json),
        "kv_transfer": p.kv.map(|k| serde_json::json!({
            "bytes_per_request": k.moved,
            "cache_bytes_per_request": k.bytes,
            "bytes_per_gpu": k.bytes_per_gpu,
            "time_s": k.time_s,
            "link": if k.same_node { "nvlink" } else { "infiniband" },
        })),
    })
}

fn line(p: &ServePoint) -> String {
    let pools = match &p.prefill {
        Some(pre) => format!(
            "{}P [{}] : {}D [{}] x{} in flight",
            pre.instances,
            short_pool(pre),
            p.decode.instances,
            short_pool(&p.decode),
            p.decode.concurrency
        ),
        None => format!(
            "{} x [{}] x{} in flight, chunk {}",
            p.decode.instances,
            short_pool(&p.decode),
            p.decode.concurrency,
            p.decode.chunk
        ),
    };
    format!(
        "{:>8.1} tok/s/GPU {:>7.1} tok/s/user  TTFT {:>7.1} ms  TPOT {:>6.2} ms  {} GPUs  {pools}",
        p.per_gpu(),
        p.per_user(),
        p.ttft_s * 1e3,
        p.tpot_s * 1e3,
        p.gpus
    )
}

/// The pool's workload as `plan` would price it: the mean request, the pool's
/// requests in flight.
fn pool_workload(w: &Workload, load: &ServeLoad, requests: u64) -> Workload {
    match w.clone() {
        Workload::Inference { slo, serving, .. } => Workload::Inference {
            prompt_len: (load.prompt_mean.round() as u64).max(1),
            output_len: (load.output_mean.round() as u64).max(1),
            concurrency: requests.max(1),
            slo,
            serving,
        },
        t => t,
    }
}

fn pool_plan(
    inp: &crate::plan::Inputs,
    load: &ServeLoad,
    pool: &meshplan_cost_model::serving::Pool,
) -> Result<Plan, Failure> {
    let cfg = ParallelConfig {
        dp: pool.cfg.dp * pool.instances,
        ..pool.cfg
    };
    let cluster = instance_cluster(&inp.cluster, cfg.world_size());
    let w = pool_workload(&inp.workload, load, pool.instances * pool.concurrency);
    let mut plan = plan_for_config(&inp.spec.name, &inp.graph, &inp.pg, &cluster, &w, &cfg)
        .map_err(|message| Failure { code: 1, message })?;
    plan.model.transformer = inp.spec.transformer().cloned();
    Ok(plan)
}

fn pool_info(p: &meshplan_cost_model::serving::Pool, predicted: serde_json::Value) -> PoolInfo {
    PoolInfo {
        instances: p.instances,
        gpus_per_instance: p.gpus,
        strategy: p.cfg,
        dcp: p.dcp,
        concurrency: p.concurrency,
        chunked_prefill: p.chunk,
        predicted,
    }
}

/// The plan of the winning deployment: the decoding pool's programs, the prefill
/// pool's beside them.
fn deployment_plan(
    inp: &crate::plan::Inputs,
    load: &ServeLoad,
    report: &DeployReport,
    best: &ServePoint,
) -> Result<Plan, Failure> {
    let mut plan = pool_plan(inp, load, &best.decode)?;
    let prefill_plan = match &best.prefill {
        Some(pre) => Some(Box::new(pool_plan(inp, load, pre)?)),
        None => None,
    };
    let predicted = point_json(best);
    plan.search.solver = "deploy (instances x requests in flight x chunk x pool ratio)".into();
    plan.search.candidates_evaluated = report.points.len() as u64;
    plan.search.wall_s = report.wall_s;
    plan.search.stop_reason = "exhausted".into();
    plan.serving = Some(ServingInfo {
        mode: best.mode,
        decode: pool_info(&best.decode, predicted["decode"].clone()),
        prefill: best
            .prefill
            .as_ref()
            .map(|p| pool_info(p, predicted["prefill"].clone())),
        prefill_plan,
        kv_transfer: best.kv.map(|k| KvTransfer {
            bytes_per_request: k.moved,
            time_s: k.time_s,
            link: if k.same_node { "nvlink" } else { "infiniband" }.into(),
        }),
        predicted,
    });
    Ok(plan)
}

fn miss_failure(
    inp: &crate::plan::Inputs,
    load: &ServeLoad,
    fixed: &Fixed,
    report: &DeployReport,
) -> Failure {
    let Some(c) = report.closest(load) else {
        if report.instances > 0 {
            return no_fit(format!(
                "no deployment of `{}` on {} x {} GPUs could be formed from the {} instance configurations that fit (pools that fit neither the cluster together nor the --prefill-config / --decode-config / serving.mode asked for); loosen those keys or add GPUs",
                inp.spec.name, inp.cluster.nodes, inp.cluster.gpus_per_node, report.instances
            ));
        }
        return no_fit(format!(
            "no serving instance of `{}` fits {} x {} GPUs ({} configurations tried): every one runs out of memory for one request; use more GPUs per node or more memory",
            inp.spec.name, inp.cluster.nodes, inp.cluster.gpus_per_node, report.instances_tried
        ));
    };
    let near = &report.points[c];
    let r = remedy(&inp.pg, &inp.cluster, load, fixed, report);
    let mut fixes = Vec::new();
    if let Some((nodes, p)) = &r.more_nodes {
        fixes.push(format!(
            "--nodes {nodes} ({:.1} tokens/s per GPU, TTFT {:.0} ms, TPOT {:.1} ms)",
            p.per_gpu(),
            p.ttft_s * 1e3,
            p.tpot_s * 1e3
        ));
    }
    if let Some(t) = r.tpot_s {
        fixes.push(format!("a TPOT bound of {:.1} ms or more", t * 1e3));
    }
    if let Some(t) = r.ttft_s {
        fixes.push(format!("a TTFT bound of {:.0} ms or more", t * 1e3));
    }
    if let Some(p) = r.prompt_at {
        fixes.push(format!(
            "prompts of at most {p:.0} tokens at the SLO's percentile (now {:.0})",
            load.prompt_at
        ));
    }
    let what = if fixes.is_empty() {
        "nothing searched (8x the nodes, looser bounds, prompts 16x shorter) meets them".to_string()
    } else {
        format!("these would: {}", fixes.join("; "))
    };
    no_fit(format!(
        "no deployment of `{}` on {} x {} GPUs meets the SLOs ({} deployments priced); the closest misses {} ({}); {what}",
        inp.spec.name,
        inp.cluster.nodes,
        inp.cluster.gpus_per_node,
        report.points.len(),
        near.misses(load).join(", "),
        line(near).trim(),
    ))
}

pub(crate) fn deploy(a: &DeployArgs) -> Result<(), Failure> {
    if let Some(d) = &a.figures {
        crate::draw::check_dir("--figures", d)?;
    }
    let inp = crate::plan::load(
        &a.model,
        &a.cluster,
        a.nodes,
        a.calibration.as_deref(),
        &a.workload,
    )?;
    let Some(load) = ServeLoad::from_workload(&inp.workload) else {
        return Err(Failure {
            code: 2,
            message: format!(
                "{}: `deploy` plans serving; the workload is training (`kind: train`): give `kind: inference` (in the model file or --workload FILE), or use `meshplan plan`",
                a.model.display()
            ),
        });
    };
    let keys = |text: &Option<String>, flag: &str| -> Result<PartialConfig, Failure> {
        let p = match text {
            Some(c) => PartialConfig::parse(c, flag)?,
            None => PartialConfig::default(),
        };
        p.check_workload(true, flag)?;
        Ok(p)
    };
    let fixed = Fixed {
        all: keys(&a.config, "--config")?,
        prefill: keys(&a.prefill_config, "--prefill-config")?,
        decode: keys(&a.decode_config, "--decode-config")?,
        decode_dcp: a.dcp,
    };
    if a.dcp == Some(0) {
        return Err(Failure {
            code: 2,
            message: "--dcp must be at least 1 (1: no decode context parallelism)".into(),
        });
    }
    let report = search(&inp.pg, &inp.cluster, &load, &fixed);
    let Some(b) = report.best else {
        return Err(miss_failure(&inp, &load, &fixed, &report));
    };
    let best = &report.points[b];
    let plan = deployment_plan(&inp, &load, &report, best)?;
    let bytes = plan.to_json().map_err(|e| Failure {
        code: 1,
        message: format!("cannot serialise the plan: {e}"),
    })?;
    crate::atomic::write_atomically(&a.output, &bytes, "plan")?;
    crate::plan::warn_if_not_run(&plan);
    if let Some(dir) = &a.figures {
        let figure = meshplan_viz::Figure {
            name: "frontier",
            canvas: frontier_figure(&inp.spec.name, &load, &report),
        };
        crate::draw::write_figures(dir, &[figure], a.png)?;
    }
    let pick = |i: Option<usize>| i.map(|i| point_json(&report.points[i]));
    if a.json {
        print_json(&serde_json::json!({
            "plan_file": a.output.display().to_string(),
            "mode": best.mode,
            "best": point_json(best),
            "best_aggregated": pick(report.best_aggregated),
            "best_disaggregated": pick(report.best_disaggregated),
            "verdict": report.verdict(),
            "frontier": report.frontier.iter().map(|&i| point_json(&report.points[i])).collect::<Vec<_>>(),
            "load": {
                "prompt_mean": load.prompt_mean,
                "prompt_at_percentile": load.prompt_at,
                "output_mean": load.output_mean,
                "percentile": load.percentile * 100.0,
                "ttft_max_s": load.ttft_max_s,
                "tpot_max_s": load.tpot_max_s,
                "arrival_rate": load.arrival_rate,
            },
            "search": {
                "instances_tried": report.instances_tried,
                "instances_priced": report.instances,
                "deployments_priced": report.points.len(),
                "wall_s": report.wall_s,
            },
        }));
        return Ok(());
    }
    tracing::info!(
        "searched {} instance configurations ({} fit), {} deployments, in {:.3} s",
        report.instances_tried,
        report.instances,
        report.points.len(),
        report.wall_s
    );
    println!("frontier (tokens/s per GPU against tokens/s per user; TTFT met):");
    for &i in &report.frontier {
        let p = &report.points[i];
        let mark = if p.meets(&load) { "*" } else { " " };
        println!("  {mark} {}", line(p));
    }
    for (name, i) in [
        ("aggregated   ", report.best_aggregated),
        ("disaggregated", report.best_disaggregated),
    ] {
        match i {
            Some(i) => println!("best {name} {}", line(&report.points[i])),
            None => println!("best {name} none within the SLOs"),
        }
    }
    if let Some(v) = report.verdict() {
        println!("{v}");
    }
    let mode = match best.mode {
        ServingMode::Aggregated => "aggregated",
        ServingMode::Disaggregated => "disaggregated",
    };
    println!(
        "deployment ({mode}) written to {} ({} bytes); `meshplan export {} --to sglang` prints its launch lines",
        a.output.display(),
        bytes.len(),
        a.output.display()
    );
    Ok(())
}

fn frontier_figure(model: &str, load: &ServeLoad, report: &DeployReport) -> meshplan_viz::Canvas {
    let pt = |p: &ServePoint| meshplan_viz::frontier::Point {
        per_user: p.per_user(),
        per_gpu: p.per_gpu(),
        disaggregated: p.mode == ServingMode::Disaggregated,
        meets: p.meets(load),
    };
    meshplan_viz::frontier::frontier_svg(&meshplan_viz::frontier::Frontier {
        title: format!("{model}: serving frontier"),
        points: report.points.iter().map(pt).collect(),
        frontier: report.frontier.clone(),
        best: report.best,
        min_user_tps: load
            .tpot_max_s
            .map(|t| 1.0 / t)
            .into_iter()
            .chain(load.min_user_tps)
            .reduce(f64::max),
    })
}
