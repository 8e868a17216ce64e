//! Lowering into `plan.json` against the cost model: the bytes a stage's program sends
//! equal the estimate's `comm_bytes_per_gpu` on every axis, across a matrix of
//! configurations; the Megatron block has exactly two tensor-parallel AllReduces in
//! forward; plans are deterministic, compact and round-trip through serde; rank
//! tables are complete; schedules run every (chunk, micro-batch) forward and backward
//! once, in the order the cost model's pipeline simulation runs them.

use meshplan_cost_model::pipeline::{simulate, PipelineInput};
use meshplan_cost_model::{
    estimate_inference, estimate_train_split, load_cluster, prepare_model, Cluster, Estimate,
    InferenceLoad, PreparedGraph,
};
use meshplan_ir::plan::{
    instrs_bytes_sent, Axis, AxisBytes, CollectiveKind, Exchange, Instr, Pass, PhaseKind, Plan,
    SearchInfo, Target,
};
use meshplan_ir::{
    load_model, model_graph, parse_model_yaml, Graph, ModelSpec, ParallelConfig, PartialConfig,
    Schedule, SegmentKind, Workload, WorkloadOverrides,
};
use meshplan_planner::lower::{
    lower_inference, lower_train, stage_orders, standard_placements, LowerInput,
};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

// === helpers ===

struct Model {
    spec: ModelSpec,
    graph: Graph,
    pg: PreparedGraph,
}

fn shipped(rel: &str) -> Model {
    let spec = load_model(
        &PathBuf::from(ROOT).join(rel),
        &WorkloadOverrides::default(),
    )
    .unwrap_or_else(|e| panic!("{rel}: {e}"));
    from_spec(spec)
}

fn from_spec(spec: ModelSpec) -> Model {
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    Model { spec, graph, pg }
}

fn cluster(rel: &str, nodes: u64) -> Cluster {
    load_cluster(&PathBuf::from(ROOT).join(rel), Some(nodes)).unwrap_or_else(|e| panic!("{e}"))
}

fn config(text: &str, gpus: u64) -> ParallelConfig {
    PartialConfig::parse(text, "--config")
        .and_then(|p| p.resolve(gpus, "--config"))
        .unwrap_or_else(|e| panic!("{text}: {e}"))
}

use meshplan_cost_model::estimate::even_layer_split;

fn search_info() -> SearchInfo {
    SearchInfo {
        candidates_evaluated: 1,
        pruned: 0,
        wall_s: 0.0,
        solver: "standard-layout".into(),
        stop_reason: "fixed_config".into(),
        extra: BTreeMap::new(),
    }
}

/// A training configuration lowered, with its estimate.
struct Lowered {
    plan: Plan,
    est: Estimate,
    cfg: ParallelConfig,
}

fn train(m: &Model, cl: &Cluster, cfg_text: &str) -> Lowered {
    let cfg = config(cfg_text, cl.gpus());
    let Some(Workload::Train {
        seq_len,
        global_batch,
        ..
    }) = m.spec.workload
    else {
        panic!("{}: not a training workload", m.spec.name)
    };
    let split = even_layer_split(m.pg.layers, cfg.pp, cfg.vpp);
    let est = estimate_train_split(&m.pg, cl, &cfg, seq_len, global_batch, Some(&split))
        .unwrap_or_else(|e| panic!("{cfg_text}: {e}"));
    let workload = m.spec.workload.clone().unwrap_or_else(|| unreachable!());
    let plan = lower_train(&LowerInput {
        dp_bucket_params: meshplan_cost_model::calib::DP_BUCKET_PARAMS,
        model_name: &m.spec.name,
        graph: &m.graph,
        prepared: &m.pg,
        cluster: cl,
        cfg: &cfg,
        workload: &workload,
        layer_split: &split,
        placements: standard_placements(&m.graph, &cfg),
        estimate: &est,
        search: search_info(),
    })
    .unwrap_or_else(|e| panic!("{cfg_text}: {e}"));
    Lowered { plan, est, cfg }
}

fn inference(m: &Model, cl: &Cluster, cfg_text: &str) -> Lowered {
    let cfg = config(cfg_text, cl.gpus());
    let workload = m.spec.workload.clone().unwrap_or_else(|| unreachable!());
    let load = InferenceLoad::from_workload(&workload).expect("an inference workload");
    let est = estimate_inference(&m.pg, cl, &cfg, &load).unwrap_or_else(|e| panic!("{e}"));
    let split = even_layer_split(m.pg.layers, cfg.pp, 1);
    let plan = lower_inference(&LowerInput {
        dp_bucket_params: meshplan_cost_model::calib::DP_BUCKET_PARAMS,
        model_name: &m.spec.name,
        graph: &m.graph,
        prepared: &m.pg,
        cluster: cl,
        cfg: &cfg,
        workload: &workload,
        layer_split: &split,
        placements: standard_placements(&m.graph, &cfg),
        estimate: &est,
        search: search_info(),
    })
    .unwrap_or_else(|e| panic!("{cfg_text}: {e}"));
    Lowered { plan, est, cfg }
}

#[track_caller]
fn assert_close(what: &str, got: f64, want: f64) {
    let err = (got - want).abs() / want.abs().max(1.0);
    assert!(
        err <= 1e-9,
        "{what}: program {got}, estimate {want} (relative error {err:.3e})"
    );
}

#[track_caller]
fn assert_bytes(what: &str, got: AxisBytes, want: AxisBytes) {
    for axis in Axis::ALL {
        assert_close(
            &format!("{what}: {} bytes", axis.name()),
            got.get(axis),
            want.get(axis),
        );
    }
}

fn estimate_bytes(est: &Estimate) -> AxisBytes {
    let c = est.comm_bytes_per_gpu;
    AxisBytes {
        dp: c.dp,
        tp: c.tp,
        pp: c.pp,
        cp: c.cp,
        ep: c.ep,
    }
}

/// The estimate's bytes equal the program's, for the busiest stage of each axis.
#[track_caller]
fn check_train(m: &Model, cl: &Cluster, cfg_text: &str) -> Lowered {
    let l = train(m, cl, cfg_text);
    let got = l.plan.busiest_bytes(PhaseKind::Train);
    assert_bytes(
        &format!("{} {cfg_text}", m.spec.name),
        got,
        estimate_bytes(&l.est),
    );
    // The program's own summary agrees with a fresh walk.
    for p in &l.plan.programs {
        for ph in &p.phases {
            assert_eq!(ph.comm_bytes_per_gpu, ph.bytes_sent());
        }
    }
    l
}

// === byte equality across configurations ===

#[test]
fn gpt3_on_3840_gpus_bytes_match_the_estimate() {
    let m = shipped("models/gpt3-175b.yaml");
    let cl = cluster("topologies/dgx-a100-80g.yaml", 480);
    for cfg in [
        "dp=60,tp=8,pp=8,mbs=1,recompute=full",
        "dp=60,tp=8,pp=8,mbs=1,recompute=full,sp=true",
        "dp=60,tp=8,pp=8,mbs=1,recompute=full,zero=1",
        "dp=60,tp=8,pp=8,mbs=1,recompute=full,vpp=2",
        "dp=60,tp=8,pp=8,mbs=2,recompute=selective,sp=true,schedule=gpipe",
        "dp=240,tp=8,pp=2,mbs=1,recompute=full",
        "dp=240,tp=8,pp=2,mbs=1,recompute=full,vpp=2",
    ] {
        let l = check_train(&m, &cl, cfg);
        assert!(l.est.comm_bytes_per_gpu.tp > 0.0);
        assert!(l.est.comm_bytes_per_gpu.dp > 0.0);
        assert!(l.est.comm_bytes_per_gpu.pp > 0.0);
    }
}

#[test]
fn llama3_8b_tp2_dp4_matches_without_adjustment() {
    let m = shipped("models/llama3-8b.yaml");
    let cl = cluster("topologies/dgx-a100-80g.yaml", 1);
    for cfg in ["tp=2,dp=4", "tp=2,dp=4,sp=true,zero=1", "tp=2,dp=4,zero=3"] {
        let l = check_train(&m, &cl, cfg);
        // No pipeline and no context axis: no known difference applies, the raw
        // program bytes are the estimate's.
        assert_bytes(
            cfg,
            l.plan.busiest_bytes(PhaseKind::Train),
            estimate_bytes(&l.est),
        );
    }
}

/// ZeRO-2 reduce-scatters every micro-batch's gradients and gathers the updated
/// parameters once a step; ZeRO-1 reduce-scatters once. With parameters and
/// gradients of one width, ZeRO-1 sends 2 x (n-1)/n of a stage's weights over the
/// data axis and ZeRO-2 (m + 1) x (n-1)/n of them: at m = 8 / (dp 2 x mbs 1) = 4
/// micro-batches, 2.5 times ZeRO-1's bytes, in the estimate and in the programs
/// (whose scatters close chunk 0's backward, with the sequence-partial sums before
/// them, and leave the step list the optimizer and the gathers).
#[test]
fn zero2_scatters_every_micro_batch_and_gathers_once() {
    use meshplan_ir::plan::{CollectiveKind, Instr, Target};
    let gpt = shipped("models/tiny-gpt.yaml");
    let cl = cluster("topologies/cpu-test-mesh.yaml", 1);
    let one = check_train(&gpt, &cl, "dp=2,tp=2,pp=2,mbs=1,sp=true,zero=1");
    let two = check_train(&gpt, &cl, "dp=2,tp=2,pp=2,mbs=1,sp=true,zero=2");
    let (b1, b2) = (one.est.comm_bytes_per_gpu.dp, two.est.comm_bytes_per_gpu.dp);
    assert!(b1 > 0.0);
    assert!((b2 / b1 - 2.5).abs() < 1e-12, "ZeRO-2 {b2} / ZeRO-1 {b1}");
    // The sequence-partial sums go with the scatters: one per micro-batch.
    assert!((two.est.comm_bytes_per_gpu.tp / one.est.comm_bytes_per_gpu.tp) > 1.0);
    for p in &two.plan.programs {
        let ph = &p.phases[0];
        let is_scatter = |i: &Instr| {
            matches!(
                i,
                Instr::Collective {
                    kind: CollectiveKind::ReduceScatter,
                    target: Target::GradBucket { .. },
                    ..
                }
            )
        };
        assert!(
            !ph.step.iter().any(is_scatter),
            "a scatter left in the step list"
        );
        let end = &ph.chunks[0].backward;
        let first = end
            .iter()
            .position(is_scatter)
            .expect("scatters in the backward");
        assert!(
            end[first..].iter().all(is_scatter),
            "the scatters close the backward"
        );
        assert!(matches!(
            end[first - 1],
            Instr::Collective {
                target: Target::SeqPartialGrads,
                ..
            }
        ));
    }
}

/// A table tied between the first and the last stage has its gradient summed
/// once a step, which ZeRO-2's per-micro-batch scatter would precede: refused, as
/// under ZeRO-3, naming the fix.
#[test]
fn zero2_refuses_a_table_tied_across_stages() {
    let text = std::fs::read_to_string(PathBuf::from(ROOT).join("models/tiny-gpt.yaml")).unwrap();
    let tied = from_spec(
        parse_model_yaml(
            &text.replace("tie_embeddings: false", "tie_embeddings: true"),
            "tied.yaml",
        )
        .unwrap(),
    );
    let cl = cluster("topologies/cpu-test-mesh.yaml", 1);
    let Some(Workload::Train {
        seq_len,
        global_batch,
        ..
    }) = tied.spec.workload
    else {
        panic!("a training workload")
    };
    let est = |c: &str| {
        let cfg = config(c, cl.gpus());
        estimate_train_split(&tied.pg, &cl, &cfg, seq_len, global_batch, None)
    };
    let e = est("dp=2,tp=2,pp=2,mbs=1,zero=2").expect_err("refused");
    assert!(e.to_string().contains("use zero <= 1 or untie"), "{e}");
    assert!(est("dp=2,tp=2,pp=2,mbs=1,zero=1").is_ok());
}

#[test]
fn tiny_models_on_the_cpu_mesh_match_on_every_axis() {
    let gpt = shipped("models/tiny-gpt.yaml");
    let moe = shipped("models/tiny-moe.yaml");
    let cl = cluster("topologies/cpu-test-mesh.yaml", 1);
    for cfg in [
        "dp=8",
        "dp=2,tp=2,pp=2",
        "dp=4,tp=2",
        "dp=4,pp=2,recompute=full",
        "dp=4,cp=2",
        "dp=2,cp=2,tp=2,recompute=full",
        "dp=2,cp=2,tp=2,sp=true,zero=3",
        "dp=2,tp=2,pp=2,schedule=gpipe,zero=2",
    ] {
        check_train(&gpt, &cl, cfg);
    }
    // A tied table across stages: one AllReduce of its gradient between the first and
    // the last stage, on the pipeline axis.
    let text = std::fs::read_to_string(PathBuf::from(ROOT).join("models/tiny-gpt.yaml")).unwrap();
    let tied = from_spec(
        parse_model_yaml(
            &text.replace("tie_embeddings: false", "tie_embeddings: true"),
            "tied.yaml",
        )
        .unwrap_or_else(|e| panic!("{e}")),
    );
    for cfg in [
        "dp=2,tp=2,pp=2",
        "dp=4,pp=2,zero=1",
        "dp=2,tp=2,pp=2,sp=true",
    ] {
        let l = check_train(&tied, &cl, cfg);
        let tied_ar = |stage: usize| {
            l.plan.programs[stage].phases[0]
                .step
                .iter()
                .filter(|i| {
                    matches!(
                        i,
                        Instr::Collective {
                            target: meshplan_ir::plan::Target::TiedGrads,
                            ..
                        }
                    )
                })
                .count()
        };
        let last = l.cfg.pp as usize - 1;
        assert_eq!((tied_ar(0), tied_ar(last)), (1, 1), "{cfg}");
        if last > 1 {
            assert_eq!(tied_ar(1), 0, "{cfg}: a middle stage holds no tied table");
        }
    }
    let cfg = config("dp=4,pp=2,zero=3", cl.gpus());
    let err = estimate_train_split(&tied.pg, &cl, &cfg, 32, 8, None).expect_err("zero=3 refused");
    assert!(err.reason.contains("tied embeddings"), "{}", err.reason);
    for cfg in [
        "dp=8,ep=2",
        "dp=4,tp=2,ep=2,sp=true",
        "dp=4,tp=2,ep=4,sp=true,zero=3",
        "dp=4,tp=2,sp=true",
        "dp=4,tp=2",
        "dp=2,tp=2,pp=2,ep=2,sp=true,recompute=full",
        "dp=4,cp=2,ep=2,zero=1",
    ] {
        let l = check_train(&moe, &cl, cfg);
        if l.cfg.ep > 1 {
            assert!(l.est.comm_bytes_per_gpu.ep > 0.0, "{cfg}: no expert bytes");
        }
    }
}

#[test]
fn context_parallel_ring_bytes_per_layer() {
    // tiny-gpt, cp=2, one stage: each layer passes its key/value block around the
    // ring once in forward and twice in backward (3 passes), plus once more when the
    // forward is recomputed (4); the embedding and head pass nothing. Both the
    // program and the estimate must say so.
    let m = shipped("models/tiny-gpt.yaml");
    let cl = cluster("topologies/cpu-test-mesh.yaml", 1);
    let layers = m.pg.layers as f64;
    let plain = train(&m, &cl, "dp=4,cp=2");
    let per_pass = plain.plan.busiest_bytes(PhaseKind::Train).cp
        / (3.0 * layers * plain.est.microbatches as f64);
    assert!(per_pass > 0.0);
    for (cfg, passes) in [("dp=4,cp=2", 3.0), ("dp=4,cp=2,recompute=full", 4.0)] {
        let l = check_train(&m, &cl, cfg);
        let want = passes * layers * per_pass * l.est.microbatches as f64;
        assert_close(cfg, l.plan.busiest_bytes(PhaseKind::Train).cp, want);
        assert_close(cfg, l.est.comm_bytes_per_gpu.cp, want);
    }
}

fn is_boundary_gather(i: &Instr) -> bool {
    use meshplan_ir::plan::Target;
    matches!(i, Instr::Collective { axis: Axis::Tp, kind: CollectiveKind::AllGather, target, .. }
        if matches!(target, Target::HiddenStates | Target::HiddenStatesGrad))
}

fn boundary_gather_bytes(l: &Lowered, stage: usize) -> f64 {
    let mb = l.est.microbatches as f64;
    let ph = &l.plan.programs[stage].phases[0];
    let mut gathers = 0.0;
    for ch in &ph.chunks {
        for list in [&ch.forward, &ch.backward] {
            for i in list.iter().filter(|i| is_boundary_gather(i)) {
                gathers += instrs_bytes_sent(std::slice::from_ref(i), mb).tp;
            }
        }
    }
    gathers
}

#[test]
fn boundary_transfers_and_gathers_per_stage() {
    // GPT-3, pp=8, tp=8: a middle stage receives an activation and a gradient per
    // micro-batch and all-gathers each over tp: 2 m (tp-1) p2p bytes, p2p being the
    // scattered share `b s h bpe / tp`; it sends 2 m p2p bytes. The first and last
    // stages send half of that, and both hold GPT-3's tied embedding table, whose
    // gradient (51200 x 12288 / tp, fp32 in meshplan's executor) they sum in one
    // AllReduce of two ranks, each sending its whole payload: the ends send the
    // most. With sequence parallelism nothing is gathered.
    let m = shipped("models/gpt3-175b.yaml");
    let cl = cluster("topologies/dgx-a100-80g.yaml", 480);
    let l = check_train(&m, &cl, "dp=60,tp=8,pp=8,mbs=1,recompute=full");
    let p2p = 1.0 * 2048.0 * 12288.0 * 2.0 / 8.0;
    let mb = l.est.microbatches as f64;
    assert_close(
        "middle gathers",
        boundary_gather_bytes(&l, 3),
        2.0 * mb * 7.0 * p2p,
    );
    assert_close(
        "first gathers",
        boundary_gather_bytes(&l, 0),
        mb * 7.0 * p2p,
    );
    let tied = 51200.0 * 12288.0 / 8.0 * 4.0;
    assert!(mb * p2p + tied > 2.0 * mb * p2p);
    assert_close("pp bytes", l.est.comm_bytes_per_gpu.pp, mb * p2p + tied);
    let sp = check_train(&m, &cl, "dp=60,tp=8,pp=8,mbs=1,recompute=full,sp=true");
    assert_eq!(boundary_gather_bytes(&sp, 3), 0.0);
    // pp=2: every stage sends one kind only, and the table's sum.
    let two = check_train(&m, &cl, "dp=240,tp=8,pp=2,mbs=1,recompute=full,zero=1");
    let mb2 = two.est.microbatches as f64;
    assert_close(
        "pp=2 pp bytes",
        two.est.comm_bytes_per_gpu.pp,
        mb2 * p2p + tied,
    );
}

#[test]
fn inference_decode_bytes_match_the_estimate() {
    let m = shipped("models/llama3-70b-inference.yaml");
    let cl = cluster("topologies/dgx-a100-80g.yaml", 1);
    for cfg in ["tp=8", "tp=4,dp=2", "tp=8,dp_attention=true"] {
        let l = inference(&m, &cl, cfg);
        assert_bytes(
            cfg,
            l.plan.busiest_bytes(PhaseKind::Decode),
            estimate_bytes(&l.est),
        );
        assert!(l.est.comm_bytes_per_gpu.tp > 0.0);
        for p in &l.plan.programs {
            let kinds: Vec<PhaseKind> = p.phases.iter().map(|ph| ph.kind).collect();
            assert_eq!(kinds, [PhaseKind::Prefill, PhaseKind::Decode]);
            assert_eq!(p.phases[1].dims.seq, 1.0);
            assert!(p
                .phases
                .iter()
                .all(|ph| ph.chunks.iter().all(|c| c.backward.is_empty())));
        }
    }
    // With pipeline stages each GPU sends its own stage's bytes.
    let cl2 = cluster("topologies/dgx-a100-80g.yaml", 2);
    let l = inference(&m, &cl2, "tp=8,pp=2");
    assert_close(
        "tp, busiest stage",
        l.plan.busiest_bytes(PhaseKind::Decode).tp,
        l.est.comm_bytes_per_gpu.tp,
    );
    assert_close(
        "pp",
        l.plan.busiest_bytes(PhaseKind::Decode).pp,
        l.est.comm_bytes_per_gpu.pp,
    );
}

/// Every collective of `instrs` with the times it runs (segment repeats multiplied).
fn collectives(instrs: &[Instr], times: u64, out: &mut Vec<(Instr, u64)>) {
    for i in instrs {
        match i {
            Instr::Segment { repeat, body, .. } => collectives(body, times * repeat, out),
            Instr::Collective { .. } => out.push((i.clone(), times)),
            _ => {}
        }
    }
}

#[test]
fn moe_inference_over_tp_and_ep_gathers_the_slices_the_estimate_prices() {
    // Mixtral serving 6 requests on 8 GPUs, dp=2,tp=4,ep=8: each tensor rank routes
    // its slice of the replica's tokens and the slices' outputs are gathered over
    // tp. Decoding 3 requests a replica, the slices are ceil(3 / 4) = 1 row, padded
    // to 4 rows of 4096 bf16 values: 32,768 bytes gathered a layer; the busiest
    // rank routes one token.
    let text = std::fs::read_to_string(PathBuf::from(ROOT).join("models/mixtral-8x7b.yaml"))
        .expect("mixtral");
    let head = text.split("\nworkload:").next().expect("a model");
    let yaml = format!(
        "{head}\nworkload:\n  kind: inference\n  prompt_len: 1000\n  output_len: 200\n  concurrency: 6\n"
    );
    let spec = parse_model_yaml(&yaml, "mixtral-inference.yaml").unwrap_or_else(|e| panic!("{e}"));
    let m = from_spec(spec);
    let cl = cluster("topologies/dgx-a100-80g.yaml", 1);
    let l = inference(&m, &cl, "dp=2,tp=4,ep=8,dp_attention=false");
    for (kind, rows) in [(PhaseKind::Decode, 4.0), (PhaseKind::Prefill, 1000.0)] {
        let phase = l.plan.programs[0]
            .phases
            .iter()
            .find(|p| p.kind == kind)
            .expect("the phase");
        let mut all = Vec::new();
        for ch in &phase.chunks {
            collectives(&ch.forward, 1, &mut all);
        }
        let gathers: Vec<(f64, f64, u64)> = all
            .iter()
            .filter_map(|(i, n)| match i {
                Instr::Collective {
                    kind: CollectiveKind::AllGather,
                    axis: Axis::Tp,
                    target:
                        Target::Experts {
                            exchange: Exchange::Gather,
                            ..
                        },
                    payload_bytes,
                    bytes_sent,
                    ..
                } => Some((*payload_bytes, *bytes_sent, *n)),
                _ => None,
            })
            .collect();
        let payload = rows * 4096.0 * 2.0;
        assert_eq!(
            gathers,
            [(payload, payload * 3.0 / 4.0, 32)],
            "{kind:?}: one gather of the sliced outputs a layer"
        );
        // The busiest rank dispatches its slice, ceil(3 / 4) = 1 token decoding and
        // 1000 / 4 = 250 prefilling, each to its top 2 experts (dropless).
        let dispatch: Vec<f64> = all
            .iter()
            .filter_map(|(i, _)| match i {
                Instr::Collective {
                    target:
                        Target::Experts {
                            exchange: Exchange::Dispatch,
                            ..
                        },
                    payload_bytes,
                    ..
                } => Some(*payload_bytes),
                _ => None,
            })
            .collect();
        assert_eq!(
            dispatch,
            [rows / 4.0 * 2.0 * 4096.0 * 2.0],
            "{kind:?}: dispatch"
        );
    }
    assert_bytes(
        "dp=2,tp=4,ep=8",
        l.plan.busiest_bytes(PhaseKind::Decode),
        estimate_bytes(&l.est),
    );
}

// === structure ===

const MEGATRON_BLOCK: &str = "\
name: gpt-block-8192
transformer:
  layers: 2
  hidden: 8192
  heads: 64
  mlp: gelu
  norm: layernorm
  vocab: 51200
dtype: bf16
workload:
  kind: train
  seq_len: 2048
  global_batch: 8
";

#[test]
fn megatron_block_has_two_tp_all_reduces_in_forward() {
    let spec = parse_model_yaml(MEGATRON_BLOCK, "gpt-block.yaml").unwrap_or_else(|e| panic!("{e}"));
    let m = from_spec(spec);
    let cl = cluster("topologies/dgx-a100-80g.yaml", 1);
    let l = check_train(&m, &cl, "tp=8");
    let ph = &l.plan.programs[0].phases[0];
    let block = ph.chunks[0]
        .forward
        .iter()
        .find_map(|i| match i {
            Instr::Segment {
                kind: SegmentKind::Block,
                body,
                repeat,
                ..
            } => Some((body, *repeat)),
            _ => None,
        })
        .expect("a block segment in the forward list");
    assert_eq!(block.1, 2, "the block appears once with its repeat count");
    let tp_collectives: Vec<(CollectiveKind, &meshplan_ir::plan::Target)> = block
        .0
        .iter()
        .filter_map(|i| match i {
            Instr::Collective {
                kind, axis, target, ..
            } if *axis == Axis::Tp => Some((*kind, target)),
            _ => None,
        })
        .collect();
    let act = meshplan_ir::plan::Target::activation;
    assert_eq!(
        tp_collectives,
        [
            (CollectiveKind::AllReduce, &act("block.attn.proj.out")),
            (CollectiveKind::AllReduce, &act("block.mlp.down.out")),
        ]
    );
    // Each is a `[1, 2048, 8192]` bf16 activation: 32 MiB, 2 (tp-1)/tp of it sent.
    let full = 2048.0 * 8192.0 * 2.0;
    for i in block.0 {
        if let Instr::Collective {
            payload_bytes,
            bytes_sent,
            axis: Axis::Tp,
            ..
        } = i
        {
            assert_eq!(*payload_bytes, full);
            assert_eq!(*bytes_sent, 2.0 * 7.0 / 8.0 * full);
        }
    }
    // Local shapes: the QKV weight is split by columns over 8 ranks.
    let qkv = block.0.iter().find_map(|i| match i {
        Instr::Compute { name, inputs, .. } if name == "block.attn.qkv" => Some(inputs.clone()),
        _ => None,
    });
    let qkv = qkv.expect("the qkv matmul");
    assert_eq!(qkv[0].shape, [1, 2048, 8192]);
    assert_eq!(qkv[1].shape, [8192, 3 * 8192 / 8]);
}

#[test]
fn plans_are_deterministic_and_round_trip() {
    let m = shipped("models/tiny-moe.yaml");
    let cl = cluster("topologies/cpu-test-mesh.yaml", 1);
    let cfg = "dp=2,tp=2,pp=2,ep=2,sp=true,recompute=full";
    let a = train(&m, &cl, cfg).plan;
    let b = train(&m, &cl, cfg).plan;
    let (ja, jb) = (a.to_json().expect("json"), b.to_json().expect("json"));
    assert_eq!(ja, jb, "two lowerings differ");
    let text = a.to_json_pretty().expect("json");
    let back = Plan::from_json(&text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back, a);
    assert_eq!(back.to_json().expect("json"), ja);
    // The contract's top-level keys.
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    for key in [
        "format",
        "model",
        "cluster",
        "workload",
        "mesh",
        "strategy",
        "placements",
        "predicted",
        "programs",
        "ranks",
        "search",
        "layer_split",
    ] {
        assert!(v.get(key).is_some(), "missing `{key}`");
    }
    assert_eq!(v["format"], 1);
    assert_eq!(
        v["mesh"]["axes"],
        serde_json::json!(["pp", "dp", "cp", "tp"])
    );
    assert_eq!(
        v["placements"]["block.attn.qkv.w"],
        serde_json::json!(["R", "R", "S(1)"])
    );
    assert!(
        v["predicted"]["comm_bytes_per_gpu"]["ep"]
            .as_f64()
            .unwrap_or(0.0)
            > 0.0
    );
    assert_eq!(v["search"]["stop_reason"], "fixed_config");
    // A future format is refused with a message.
    let newer = text.replacen("\"format\": 1", "\"format\": 99", 1);
    assert!(Plan::from_json(&newer).is_err());
}

#[test]
fn gpt3_plan_is_small_and_its_rank_table_complete() {
    let m = shipped("models/gpt3-175b.yaml");
    let cl = cluster("topologies/dgx-a100-80g.yaml", 480);
    let l = train(&m, &cl, "dp=60,tp=8,pp=8,mbs=1,recompute=full");
    let bytes = l.plan.to_json().expect("json");
    assert!(
        bytes.len() < 10_000_000,
        "plan.json is {} bytes",
        bytes.len()
    );
    let plan = &l.plan;
    assert_eq!(plan.programs.len(), 8);
    assert_eq!(plan.ranks.len(), 3840);
    let shape = &plan.mesh.shape;
    assert_eq!(shape, &[8, 60, 1, 8]);
    let mut coords = BTreeSet::new();
    for (i, r) in plan.ranks.iter().enumerate() {
        assert_eq!(r.rank, i as u64);
        assert_eq!(r.node, r.rank / 8);
        assert_eq!(r.local_gpu, r.rank % 8);
        // Row-major over (pp, dp, cp, tp): tp innermost.
        let flat = ((r.coords[0] * shape[1] + r.coords[1]) * shape[2] + r.coords[2]) * shape[3]
            + r.coords[3];
        assert_eq!(flat, r.rank);
        assert_eq!(r.program as u64, r.coords[0]);
        assert!(
            coords.insert(r.coords.clone()),
            "duplicate coords {:?}",
            r.coords
        );
    }
    // A tensor group is one node's 8 GPUs.
    let tp = plan
        .mesh
        .groups
        .iter()
        .find(|g| g.name == "tp")
        .expect("tp group");
    assert_eq!((tp.size, tp.stride), (8, 1));
}

fn check_schedule(plan: &Plan) {
    for p in &plan.programs {
        for ph in p.phases.iter().filter(|ph| ph.kind == PhaseKind::Train) {
            let mut f_at = BTreeMap::new();
            let mut b_at = BTreeMap::new();
            for (pos, t) in ph.schedule.iter().enumerate() {
                let slot = if t.pass == Pass::F {
                    &mut f_at
                } else {
                    &mut b_at
                };
                assert!(
                    slot.insert((t.chunk, t.mb), pos).is_none(),
                    "stage {}: {:?} twice",
                    p.stage,
                    t
                );
            }
            let chunks = ph.chunks.len() as u64;
            assert_eq!(f_at.len() as u64, chunks * ph.microbatches);
            assert_eq!(b_at.len() as u64, chunks * ph.microbatches);
            for (k, f) in &f_at {
                assert!(
                    b_at[k] > *f,
                    "stage {}: backward of {k:?} before forward",
                    p.stage
                );
            }
        }
    }
}

#[test]
fn schedules_run_every_task_once_forward_first() {
    let m = shipped("models/gpt3-175b.yaml");
    let cl = cluster("topologies/dgx-a100-80g.yaml", 480);
    for cfg in [
        "dp=60,tp=8,pp=8,mbs=1,recompute=full",
        // 26 micro-batches on 8 stages: a partial last group, reordered.
        "dp=60,tp=8,pp=8,mbs=1,recompute=full,vpp=2",
        "dp=60,tp=8,pp=8,mbs=1,recompute=full,schedule=gpipe",
    ] {
        check_schedule(&train(&m, &cl, cfg).plan);
    }
}

/// Makespan of running each stage's schedule in order, each task as soon as its input
/// has arrived (the rule of the cost model's simulation).
fn makespan(
    orders: &[Vec<meshplan_ir::plan::Task>],
    vpp: usize,
    m: usize,
    f: &[f64],
    b: &[f64],
    p2p: f64,
) -> f64 {
    let pp = orders.len();
    let nvs = pp * vpp;
    let mut f_done = vec![f64::NAN; nvs * m];
    let mut b_done = vec![f64::NAN; nvs * m];
    let mut next = vec![0usize; pp];
    let mut clock = vec![0.0f64; pp];
    loop {
        let mut progressed = false;
        for i in 0..pp {
            while let Some(t) = orders[i].get(next[i]) {
                let (c, mb) = (t.chunk as usize, t.mb as usize);
                let vs = c * pp + i;
                let ready = match t.pass {
                    Pass::F if vs == 0 => 0.0,
                    Pass::F => f_done[(vs - 1) * m + mb] + p2p,
                    Pass::B if vs == nvs - 1 => f_done[vs * m + mb],
                    Pass::B => b_done[(vs + 1) * m + mb] + p2p,
                };
                if ready.is_nan() {
                    break;
                }
                let end = clock[i].max(ready) + if t.pass == Pass::F { f[vs] } else { b[vs] };
                clock[i] = end;
                if t.pass == Pass::F {
                    f_done[vs * m + mb] = end;
                } else {
                    b_done[vs * m + mb] = end;
                }
                next[i] += 1;
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    assert!(
        (0..pp).all(|i| next[i] == orders[i].len()),
        "the schedule deadlocks"
    );
    clock.iter().cloned().fold(0.0, f64::max)
}

#[test]
fn stage_orders_reproduce_the_pipeline_simulation() {
    for (pp, vpp, m, schedule) in [
        (4usize, 1usize, 8usize, Schedule::OneFOneB),
        (8, 1, 26, Schedule::OneFOneB),
        (4, 1, 8, Schedule::Gpipe),
        (4, 2, 8, Schedule::Interleaved),
        (8, 2, 26, Schedule::Interleaved),
        (4, 3, 6, Schedule::Interleaved),
        (2, 2, 3, Schedule::Interleaved),
        (1, 1, 5, Schedule::OneFOneB),
    ] {
        let nvs = pp * vpp;
        // Uneven durations and a hop, so that the order matters.
        let f: Vec<f64> = (0..nvs).map(|v| 1.0 + 0.37 * (v % 3) as f64).collect();
        let b: Vec<f64> = (0..nvs).map(|v| 2.1 + 0.21 * (v % 4) as f64).collect();
        let p2p = 0.13;
        let sim = simulate(&PipelineInput {
            pp,
            vpp,
            microbatches: m,
            forward_s: &f,
            backward_s: &b,
            p2p_s: p2p,
            schedule,
        });
        let orders = stage_orders(pp as u64, vpp as u64, m as u64, schedule)
            .unwrap_or_else(|e| panic!("{e}"));
        let got = makespan(&orders, vpp, m, &f, &b, p2p);
        assert!(
            (got - sim.makespan_s).abs() < 1e-9,
            "pp={pp} vpp={vpp} m={m} {schedule:?}: {got} vs {}",
            sim.makespan_s
        );
    }
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let m = shipped("models/tiny-gpt.yaml");
    let cl = cluster("topologies/cpu-test-mesh.yaml", 1);
    let l = train(&m, &cl, "dp=8");
    let workload = m.spec.workload.clone().unwrap_or_else(|| unreachable!());
    let cfg = l.cfg;
    let base = |split: &'static [u64], placements: Vec<(String, Vec<String>)>| {
        lower_train(&LowerInput {
            dp_bucket_params: meshplan_cost_model::calib::DP_BUCKET_PARAMS,
            model_name: "tiny",
            graph: &m.graph,
            prepared: &m.pg,
            cluster: &cl,
            cfg: &cfg,
            workload: &workload,
            layer_split: split,
            placements,
            estimate: &l.est,
            search: search_info(),
        })
    };
    assert!(base(&[1], vec![]).is_err(), "a split missing a layer");
    assert!(base(&[1, 1], vec![]).is_err(), "two chunks on one stage");
    // A name placed twice alike is one placement (blocks of two kinds share tensor
    // names); placed twice differently, it is an error.
    let same = vec![
        ("x".to_string(), vec!["R".into(), "R".into(), "R".into()]),
        ("x".to_string(), vec!["R".into(), "R".into(), "R".into()]),
    ];
    assert!(base(&[2], same).is_ok(), "a tensor placed twice alike");
    let dup = vec![
        ("x".to_string(), vec!["R".into(), "R".into(), "R".into()]),
        ("x".to_string(), vec!["S(0)".into(), "R".into(), "R".into()]),
    ];
    assert!(
        base(&[2], dup).is_err(),
        "a tensor placed twice differently"
    );
    assert!(base(&[2], vec![]).is_ok());
    let big = config("dp=16", 16);
    let err = lower_train(&LowerInput {
        dp_bucket_params: meshplan_cost_model::calib::DP_BUCKET_PARAMS,
        model_name: "tiny",
        graph: &m.graph,
        prepared: &m.pg,
        cluster: &cl,
        cfg: &big,
        workload: &workload,
        layer_split: &[2],
        placements: vec![],
        estimate: &l.est,
        search: search_info(),
    });
    assert!(err.is_err(), "16 ranks on an 8-GPU cluster");
    let inf = lower_inference(&LowerInput {
        dp_bucket_params: meshplan_cost_model::calib::DP_BUCKET_PARAMS,
        model_name: "tiny",
        graph: &m.graph,
        prepared: &m.pg,
        cluster: &cl,
        cfg: &cfg,
        workload: &workload,
        layer_split: &[2],
        placements: vec![],
        estimate: &l.est,
        search: search_info(),
    });
    assert!(inf.is_err(), "inference lowering of a training workload");
}

#[test]
fn a_hand_given_inference_plan_splits_its_layers_as_the_estimate_chunks_them() {
    // Llama 3 70B's 80 layers over 3 pipeline stages: the estimate's chunks (and the
    // searched plans) hold [27, 27, 26]; a hand-given configuration's plan must run
    // the same split, not [26, 27, 27].
    let m = shipped("models/llama3-70b-inference.yaml");
    let cl = cluster("topologies/dgx-h100.yaml", 3);
    let cfg = config("tp=8,pp=3", 24);
    let workload = m.spec.workload.clone().expect("a workload");
    let plan = meshplan_planner::output::plan_for_config(
        &m.spec.name,
        &m.graph,
        &m.pg,
        &cl,
        &workload,
        &cfg,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(plan.layer_split, vec![27, 27, 26]);
    assert_eq!(plan.layer_split, even_layer_split(80, 3, 1));
}

/// The compute instructions of `instrs` named `name`, once per segment repeat.
fn computes<'i>(instrs: &'i [Instr], name: &str, out: &mut Vec<&'i Instr>) {
    for i in instrs {
        match i {
            Instr::Segment { body, .. } => computes(body, name, out),
            Instr::Compute { name: n, .. } if n == name => out.push(i),
            _ => {}
        }
    }
}

#[test]
fn dp_attention_lowers_the_busiest_ranks_whole_requests() {
    // Llama 3 70B serving 12 requests on 8 GPUs with DP-attention (tp=8): each
    // tensor rank attends whole requests of its own with whole attention weights,
    // so a decode step waits on the rank holding ceil(12 / 8) = 2 of them, and a
    // prompt's prefill runs on one rank whole, as the cost model prices it. The
    // qkv projection (8192 -> 64 x 128 + 2 x 8 x 128 = 10240 columns) of one layer:
    //   prefill, one prompt of 2048 tokens: 2 x 2048 x 8192 x 10240 = 343,597,383,680;
    //   decode, 2 requests' tokens: 2 x 2 x 8192 x 10240 = 335,544,320.
    // An even 1/8 of either (the lowering's share before) is 42,949,672,960 and
    // 251,658,240. The MLP's gate/up projection stays split over tp:
    //   decode, 12 tokens gathered: 2 x 12 x 8192 x 2 x 28672 / 8 = 1,409,286,144.
    let text =
        std::fs::read_to_string(PathBuf::from(ROOT).join("models/llama3-70b-inference.yaml"))
            .expect("llama");
    let yaml = text.replace("concurrency: 64", "concurrency: 12");
    assert_ne!(yaml, text);
    let spec = parse_model_yaml(&yaml, "llama-12.yaml").unwrap_or_else(|e| panic!("{e}"));
    let m = from_spec(spec);
    let cl = cluster("topologies/dgx-a100-80g.yaml", 1);
    let l = inference(&m, &cl, "tp=8,dp_attention=true");
    let flops = |kind: PhaseKind, op: &str| -> Vec<f64> {
        let phase = (l.plan.programs[0].phases.iter())
            .find(|p| p.kind == kind)
            .expect("the phase");
        let mut found = Vec::new();
        for ch in &phase.chunks {
            computes(&ch.forward, op, &mut found);
        }
        found
            .iter()
            .map(|i| match i {
                Instr::Compute { flops, .. } => *flops,
                _ => unreachable!(),
            })
            .collect()
    };
    let qkv_prefill = flops(PhaseKind::Prefill, "block.attn.qkv");
    let qkv_decode = flops(PhaseKind::Decode, "block.attn.qkv");
    assert!(!qkv_prefill.is_empty() && !qkv_decode.is_empty());
    assert!(
        qkv_prefill.iter().all(|&f| f == 343_597_383_680.0),
        "{qkv_prefill:?}"
    );
    assert!(
        qkv_decode.iter().all(|&f| f == 335_544_320.0),
        "{qkv_decode:?}"
    );
    let up = flops(PhaseKind::Decode, "block.mlp.up");
    assert!(!up.is_empty());
    assert!(up.iter().all(|&f| f == 1_409_286_144.0), "{up:?}");
}
