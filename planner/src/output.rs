//! The search's best candidate as a plan file: its layout's graph (roles from the
//! ILP), placements per axis, the stage DP's layer split and the search's report.

use crate::cost_model::{Cluster, PreparedGraph};
use crate::lower::{lower_inference, lower_train, standard_placements, LowerInput};
use crate::search::{Candidate, SearchReport};
use meshplan_ir::plan::{Plan, SearchInfo};
use meshplan_ir::{Graph, Workload};
use std::collections::BTreeMap;

/// The best candidate as per-rank programs: its layout's graph (roles from the ILP),
/// the placements per axis (`dp` and `cp` from the data and context split, `tp` from
/// the ILP's solution), the stage DP's layer split.
pub fn plan_of(
    model_name: &str,
    model_graph: &Graph,
    model_pg: &PreparedGraph,
    cluster: &Cluster,
    workload: &Workload,
    best: &Candidate,
    report: &SearchReport,
) -> Result<Plan, String> {
    let layout = best.layout.as_deref();
    let graph = layout.and_then(|l| l.graph.as_ref()).unwrap_or(model_graph);
    let prepared = layout.and_then(|l| l.prepared.as_ref()).unwrap_or(model_pg);
    let mut placements = standard_placements(graph, &best.cfg);
    if let Some(l) = layout {
        let solved: BTreeMap<&str, &Vec<String>> =
            l.placements.iter().map(|(n, p)| (n.as_str(), p)).collect();
        for (name, place) in placements.iter_mut() {
            if let (Some(tp), Some(last)) = (
                solved.get(name.as_str()).and_then(|p| p.last()),
                place.last_mut(),
            ) {
                *last = tp.clone();
            }
        }
    }
    let split = best.split_or_even(model_pg.layers);
    let mut extra = BTreeMap::new();
    extra.insert(
        "candidates_enumerated".to_string(),
        serde_json::json!(report.enumerated),
    );
    extra.insert("rejected".to_string(), serde_json::json!(report.rejected));
    extra.insert(
        "ilp_solves".to_string(),
        serde_json::json!(report.ilp_solves),
    );
    if report.near_ties > 1 {
        // The candidates the cost model cannot tell apart from the fastest, and why
        // this one was taken: `explain` shows them beside the plan.
        let ties: Vec<serde_json::Value> = report
            .top
            .iter()
            .take(report.near_ties)
            .map(|c| {
                serde_json::json!({
                    "config": c.cfg.to_string(),
                    "step_time_s": c.estimate.step_time_s,
                    "output_tokens_per_s": c.estimate.output_tokens_per_s,
                    "network_bytes_per_gpu": crate::search::network_bytes(&c.estimate),
                    "parallel_axes": crate::search::parallel_axes(&c.cfg),
                    "memory_per_gpu_bytes": c.estimate.memory_per_gpu_bytes.total,
                })
            })
            .collect();
        extra.insert(
            "near_ties".to_string(),
            serde_json::json!({
                "within": crate::search::NEAR_TIE,
                "rule": "fewest bytes on the network, then fewest parallel axes, then least memory",
                "candidates": ties,
            }),
        );
    }
    extra.insert(
        "layout".to_string(),
        serde_json::json!(match layout {
            Some(l) if l.fallback.is_some() => l.fallback.clone().unwrap_or_default(),
            Some(l) if l.standard => "ilp (equals the standard layout)".to_string(),
            Some(_) => "ilp".to_string(),
            None => "standard".to_string(),
        }),
    );
    let search = SearchInfo {
        candidates_evaluated: report.evaluated,
        pruned: report.pruned,
        wall_s: report.wall_s,
        solver: report.solver.to_string(),
        stop_reason: serde_json::to_value(report.stop_reason)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        extra,
    };
    let input = LowerInput {
        dp_bucket_params: crate::cost_model::calib::DP_BUCKET_PARAMS,
        model_name,
        graph,
        prepared,
        cluster,
        cfg: &best.cfg,
        workload,
        layer_split: &split,
        placements,
        estimate: &best.estimate,
        search,
    };
    let r = match workload {
        Workload::Train { .. } => lower_train(&input),
        Workload::Inference { .. } => lower_inference(&input),
    };
    r.map_err(|e| format!("cannot lower {}: {e}", best.cfg))
}

/// The plan of one hand-given (training or inference) configuration under the standard layout and
/// an even layer split: what `run --check` lowers for its single-rank reference, and
/// what tests run the executor on.
pub fn plan_for_config(
    model_name: &str,
    graph: &Graph,
    pg: &PreparedGraph,
    cluster: &Cluster,
    workload: &Workload,
    cfg: &meshplan_ir::ParallelConfig,
) -> Result<Plan, String> {
    plan_for_config_with_buckets(
        model_name,
        graph,
        pg,
        cluster,
        workload,
        cfg,
        crate::cost_model::calib::DP_BUCKET_PARAMS,
    )
}

/// [`plan_for_config`] with gradient buckets of `bucket_params` parameters (tests use
/// small buckets to exercise several on small models).
pub fn plan_for_config_with_buckets(
    model_name: &str,
    graph: &Graph,
    pg: &PreparedGraph,
    cluster: &Cluster,
    workload: &Workload,
    cfg: &meshplan_ir::ParallelConfig,
    bucket_params: f64,
) -> Result<Plan, String> {
    let search = SearchInfo {
        candidates_evaluated: 1,
        pruned: 0,
        wall_s: 0.0,
        solver: "none (hand-given configuration)".into(),
        stop_reason: "given".into(),
        extra: BTreeMap::new(),
    };
    let (seq_len, global_batch) = match workload {
        Workload::Train {
            seq_len,
            global_batch,
            ..
        } => (seq_len, global_batch),
        Workload::Inference { .. } => {
            // The split the estimate's chunks use, so the plan runs what was priced.
            let split = crate::cost_model::estimate::even_layer_split(pg.layers, cfg.pp, 1);
            let load = crate::cost_model::InferenceLoad::from_workload(workload)
                .ok_or("an inference workload without its load")?;
            let est = crate::cost_model::estimate_inference(pg, cluster, cfg, &load)
                .map_err(|e| format!("{cfg}: {e}"))?;
            return lower_inference(&LowerInput {
                dp_bucket_params: bucket_params,
                model_name,
                graph,
                prepared: pg,
                cluster,
                cfg,
                workload,
                layer_split: &split,
                placements: standard_placements(graph, cfg),
                estimate: &est,
                search,
            })
            .map_err(|e| format!("cannot lower {cfg}: {e}"));
        }
    };
    let split = crate::cost_model::estimate::even_layer_split(pg.layers, cfg.pp, cfg.vpp);
    let est = crate::cost_model::estimate_train_split_with(
        pg,
        cluster,
        cfg,
        *seq_len,
        *global_batch,
        Some(&split),
        &crate::cost_model::Mechanisms::of(workload.framework()),
    )
    .map_err(|e| format!("{cfg}: {e}"))?;
    lower_train(&LowerInput {
        dp_bucket_params: bucket_params,
        model_name,
        graph,
        prepared: pg,
        cluster,
        cfg,
        workload,
        layer_split: &split,
        placements: standard_placements(graph, cfg),
        estimate: &est,
        search,
    })
    .map_err(|e| format!("cannot lower {cfg}: {e}"))
}
