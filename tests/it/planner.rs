//! The search against hand-tuned configurations: the hand-tuned choice is in the
//! search space and fits, and the planner's best is at least as fast under the same
//! cost model; fixed keys are honoured; budgets stop the sweep with a reason.

use crate::calibration::cases;
use meshplan_cost_model::{estimate_train, load_cluster, prepare_model, Cluster, PreparedGraph};
use meshplan_ir::{load_model, model_graph, Graph, PartialConfig, WorkloadOverrides};
use meshplan_planner::search::{
    memory_lower_bound, search_inference, search_train, training_space, SearchOptions, StopReason,
};
use std::path::Path;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn model(name: &str) -> (meshplan_ir::ModelSpec, Graph, PreparedGraph) {
    let spec = load_model(
        Path::new(&format!("{ROOT}/models/{name}.yaml")),
        &WorkloadOverrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    (spec, graph, pg)
}

fn cluster(name: &str, nodes: u64) -> Cluster {
    load_cluster(
        Path::new(&format!("{ROOT}/topologies/{name}.yaml")),
        Some(nodes),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn fixed(s: &str) -> PartialConfig {
    PartialConfig::parse(s, "test").unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn gpt3_on_3840_a100s_beats_megatron_8x8x60_and_its_vpp_variants() {
    let (_, graph, pg) = model("gpt3-175b");
    let cl = cluster("dgx-a100-80g", 480);
    let (seq, gb) = (2048, 1536);
    let report = search_train(&graph, &pg, &cl, seq, gb, &SearchOptions::default(), None)
        .unwrap_or_else(|e| panic!("{e}"));
    let best = report.top.first().expect("a feasible plan");
    assert_eq!(report.stop_reason, StopReason::Exhausted);
    assert!(report.evaluated > 1000, "{}", report.evaluated);
    let space = training_space(&pg, &cl, &PartialConfig::default(), seq, gb);
    for hand in [
        "dp=60,tp=8,pp=8,mbs=1,recompute=full",
        "dp=60,tp=8,pp=8,mbs=1,recompute=full,vpp=2",
        "dp=60,tp=8,pp=8,mbs=1,recompute=full,vpp=3",
        "dp=60,tp=8,pp=8,mbs=1,recompute=full,vpp=4",
    ] {
        let cfg = fixed(hand)
            .resolve(cl.gpus(), "test")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(space.contains(&cfg), "{hand} is in the search space");
        let e = estimate_train(&pg, &cl, &cfg, seq, gb).unwrap_or_else(|e| panic!("{e}"));
        assert!(e.feasible, "{hand}: {:?}", e.infeasible_reason);
        assert!(
            memory_lower_bound(&pg, &cfg) <= cl.gpu.memory_bytes,
            "{hand} survives pruning"
        );
        assert!(
            best.estimate.step_time_s <= e.step_time_s * (1.0 + 1e-12),
            "planner {} ({:.3} s) slower than {hand} ({:.3} s)",
            best.cfg,
            best.estimate.step_time_s,
            e.step_time_s
        );
        eprintln!(
            "{hand}: {:.3} s; planner {}: {:.3} s ({:.1}% faster)",
            e.step_time_s,
            best.cfg,
            best.estimate.step_time_s,
            100.0 * (1.0 - best.estimate.step_time_s / e.step_time_s)
        );
    }
}

#[test]
fn planner_is_at_least_as_fast_as_every_published_configuration() {
    // The Megatron weak-scaling rows (Narayanan et al. 2021, Megatron-Core on H100):
    // hand-tuned layouts of the framework the search models by default. The other
    // published rows fix framework settings the search does not vary (micro-batches
    // of 6, FSDP wrappers) and are priced, not searched, in calibration.rs.
    for case in cases()
        .into_iter()
        .filter(|c| c.id.starts_with("megatron-sc21-t1") || c.id.starts_with("megatron-core-h100"))
    {
        // The kernel choice and overlap are implementation facts of the published
        // run, not parallel choices: fix them, search the rest.
        let mut f = PartialConfig {
            attn: Some(case.cfg.attn),
            tp_overlap: Some(case.cfg.tp_overlap),
            ..PartialConfig::default()
        };
        f.attn = Some(case.cfg.attn);
        let opts = SearchOptions {
            fixed: f,
            ..SearchOptions::default()
        };
        let space = training_space(&case.pg, &case.cluster, &f, case.seq_len, case.global_batch);
        assert!(
            space.contains(&case.cfg),
            "{}: {} is in the search space",
            case.id,
            case.config_text
        );
        let published = estimate_train(
            &case.pg,
            &case.cluster,
            &case.cfg,
            case.seq_len,
            case.global_batch,
        )
        .unwrap_or_else(|e| panic!("{}: {e}", case.id));
        let report = search_train(
            &case.graph,
            &case.pg,
            &case.cluster,
            case.seq_len,
            case.global_batch,
            &opts,
            None,
        )
        .unwrap_or_else(|e| panic!("{}: {e}", case.id));
        let best = report.top.first().expect("feasible");
        assert!(
            best.estimate.step_time_s <= published.step_time_s * (1.0 + 1e-12),
            "{}: planner {} {:.3} s vs published {} {:.3} s",
            case.id,
            best.cfg,
            best.estimate.step_time_s,
            case.config_text,
            published.step_time_s
        );
        eprintln!(
            "{:<32} published {:>8.3} s, planner {:>8.3} s ({:+.1}%) {}",
            case.id,
            published.step_time_s,
            best.estimate.step_time_s,
            100.0 * (best.estimate.step_time_s / published.step_time_s - 1.0),
            best.cfg
        );
    }
}

#[test]
fn fixed_keys_are_honoured_and_the_rest_searched() {
    let (_, graph, pg) = model("tiny-gpt");
    let cl = cluster("cpu-test-mesh", 1);
    let seq = 64;
    let opts = SearchOptions {
        fixed: fixed("tp=2,pp=2"),
        top_k: 50,
        ..SearchOptions::default()
    };
    let report =
        search_train(&graph, &pg, &cl, seq, 16, &opts, None).unwrap_or_else(|e| panic!("{e}"));
    assert!(report.top.len() > 1, "more than one candidate");
    for c in &report.top {
        assert_eq!((c.cfg.tp, c.cfg.pp), (2, 2), "{}", c.cfg);
        assert_eq!(c.cfg.dp * c.cfg.tp * c.cfg.pp * c.cfg.cp, cl.gpus());
    }
    // Something besides the fixed keys varied.
    let first = report.top[0].cfg;
    assert!(report.top.iter().any(|c| c.cfg != first));
    // The near-ties first (the simplest of them leading), within NEAR_TIE of the
    // fastest; the rest sorted fastest first.
    let n = report.near_ties;
    let fastest = report.top[..n]
        .iter()
        .map(|c| c.estimate.step_time_s)
        .fold(f64::INFINITY, f64::min);
    for c in &report.top[..n] {
        assert!(c.estimate.step_time_s <= fastest * (1.0 + meshplan_planner::search::NEAR_TIE));
    }
    for w in report.top[n..].windows(2) {
        assert!(w[0].estimate.step_time_s <= w[1].estimate.step_time_s);
    }
}

#[test]
fn the_candidate_budget_stops_the_sweep_and_says_so() {
    let (_, graph, pg) = model("gpt3-175b");
    let cl = cluster("dgx-a100-80g", 480);
    let opts = SearchOptions {
        max_candidates: 1000,
        ..SearchOptions::default()
    };
    let report =
        search_train(&graph, &pg, &cl, 2048, 1536, &opts, None).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.stop_reason, StopReason::CandidateBudget);
    assert!(report.evaluated + report.pruned + report.rejected < report.enumerated);
}

#[test]
fn nothing_fits_reports_the_closest_miss() {
    // Llama 3 405B on one DGX A100: 810 GB of bf16 weights on 640 GB of HBM.
    let (_, graph, pg) = model("llama3-405b");
    let cl = cluster("dgx-a100-80g", 1);
    let report = search_train(&graph, &pg, &cl, 8192, 16, &SearchOptions::default(), None)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(report.top.is_empty());
    assert!(report.pruned > 0, "the lower bound prunes");
    // Everything was pruned or priced over memory; if any was priced, the closest
    // miss is the smallest memory among them.
    if let Some(c) = &report.closest_miss {
        assert!(c.estimate.memory_per_gpu_bytes.total > cl.gpu.memory_bytes);
    }
}

#[test]
fn inference_search_honours_the_slo_and_reports_prefill_and_decode() {
    let (spec, graph, pg) = model("llama3-70b-inference");
    let cl = cluster("h200-node", 1);
    let load = meshplan_cost_model::InferenceLoad::from_workload(
        spec.workload.as_ref().expect("workload"),
    )
    .expect("inference");
    let report = search_inference(&graph, &pg, &cl, &load, &SearchOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let best = report.top.first().expect("a deployment");
    let e = &best.estimate;
    assert!(e.feasible);
    if let Some(max) = load.ttft_max_s {
        assert!(e.ttft_s.expect("ttft") <= max);
    }
    if let Some(max) = load.tpot_max_s {
        assert!(e.tpot_s.expect("tpot") <= max);
    }
    let prefill = report.prefill_best.as_ref().expect("prefill best");
    let decode = report.decode_best.as_ref().expect("decode best");
    assert!(prefill.estimate.ttft_s <= e.ttft_s);
    assert!(decode.estimate.tpot_s <= e.tpot_s);
    assert!(e.max_concurrency.expect("max concurrency") >= 1);
    // An SLO nobody can meet: nothing is returned, the closest miss is.
    let strict = meshplan_cost_model::InferenceLoad {
        ttft_max_s: Some(1e-6),
        ..load
    };
    let r = search_inference(&graph, &pg, &cl, &strict, &SearchOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(r.top.is_empty());
    assert!(r.closest_miss.is_some());
}

#[test]
fn megatron_layout_found_by_the_ilp_lowers_to_two_all_reduces_per_layer() {
    // A GPT block at hidden 8192, sequence 2048 on the 8 GPUs of one DGX A100 node,
    // tensor parallel over all 8: the search's placements come from the ILP, which
    // finds column-parallel QKV and MLP-up, row-parallel projection and MLP-down;
    // the plan written from them has exactly two AllReduce per layer in forward.
    let yaml = "name: gpt-block-8192\ntransformer:\n  layers: 2\n  hidden: 8192\n  heads: 64\n  mlp: gelu\n  norm: layernorm\n  vocab: 51200\ndtype: bf16\nworkload:\n  kind: train\n  seq_len: 2048\n  global_batch: 8\n";
    let spec =
        meshplan_ir::parse_model_yaml(yaml, "gpt-block.yaml").unwrap_or_else(|e| panic!("{e}"));
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    let cl = cluster("dgx-a100-80g", 1);
    let opts = SearchOptions {
        fixed: fixed("tp=8,sp=false,mbs=1"),
        ..SearchOptions::default()
    };
    let report =
        search_train(&graph, &pg, &cl, 2048, 8, &opts, None).unwrap_or_else(|e| panic!("{e}"));
    let best = report.top.first().expect("feasible");
    // The ILP's own layout for the best configuration, written into a plan (the
    // search keeps the standard placements here: they price 3% faster, the ILP's
    // solution holding twice the bytes per GPU).
    let layout = meshplan_planner::layout::LayoutCache::new(&graph, &cl)
        .get(
            meshplan_planner::layout::LayoutKey::train(&best.cfg, 2048),
            &graph,
            &pg,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let best = &meshplan_planner::search::Candidate {
        layout: Some(layout.clone()),
        ..best.clone()
    };
    let role = |name: &str| {
        layout
            .roles
            .iter()
            .find(|&&(s, o, _)| graph.segments[s].ops[o].name == name)
            .map(|&(_, _, r)| r)
            .unwrap_or_else(|| panic!("no role for {name}"))
    };
    use meshplan_ir::TpRole::{ColumnParallel, RowParallel};
    assert_eq!(role("block.attn.qkv"), ColumnParallel);
    assert_eq!(role("block.mlp.up"), ColumnParallel);
    assert_eq!(role("block.attn.proj"), RowParallel);
    assert_eq!(role("block.mlp.down"), RowParallel);
    let placements: std::collections::BTreeMap<_, _> = layout.placements.iter().cloned().collect();
    assert_eq!(placements["block.attn.qkv.w"], vec!["S(1)".to_string()]);
    assert_eq!(placements["block.mlp.down.w"], vec!["S(0)".to_string()]);
    let workload = spec.workload.clone().expect("workload");
    let plan =
        meshplan_planner::output::plan_of(&spec.name, &graph, &pg, &cl, &workload, best, &report)
            .unwrap_or_else(|e| panic!("{e}"));
    use meshplan_ir::plan::{Axis, CollectiveKind, Instr};
    let ph = &plan.programs[0].phases[0];
    let (body, repeat) = ph.chunks[0]
        .forward
        .iter()
        .find_map(|i| match i {
            Instr::Segment {
                kind: meshplan_ir::SegmentKind::Block,
                body,
                repeat,
                ..
            } => Some((body, *repeat)),
            _ => None,
        })
        .expect("a block in the forward list");
    assert_eq!(repeat, 2);
    let tp: Vec<CollectiveKind> = body
        .iter()
        .filter_map(|i| match i {
            Instr::Collective {
                kind,
                axis: Axis::Tp,
                ..
            } => Some(*kind),
            _ => None,
        })
        .collect();
    assert_eq!(tp, [CollectiveKind::AllReduce, CollectiveKind::AllReduce]);
    assert_eq!(
        plan.placements["block.attn.qkv.w"]
            .last()
            .map(String::as_str),
        Some("S(1)")
    );
}
