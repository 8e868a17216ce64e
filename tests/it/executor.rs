//! The executor end to end: every parallel mode of the tiny models trains to the same
//! losses and weights as the single-rank run, sends exactly the bytes the plan
//! predicts, and a failing rank stops the whole run with a message.

use meshplan_cost_model::{load_cluster, prepare_model, Cluster, PreparedGraph};
use meshplan_executor::train::{byte_mismatches, check_against, train, TrainOptions};
use meshplan_ir::plan::Plan;
use meshplan_ir::{load_model, model_graph, Graph, ModelSpec, PartialConfig, WorkloadOverrides};
use meshplan_planner::output::plan_for_config_with_buckets;
use std::path::Path;
use std::time::{Duration, Instant};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

pub(crate) struct Model {
    pub spec: ModelSpec,
    pub graph: Graph,
    pub pg: PreparedGraph,
}

pub(crate) fn model(name: &str) -> Model {
    let spec = load_model(
        Path::new(&format!("{ROOT}/models/{name}.yaml")),
        &WorkloadOverrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    Model { spec, graph, pg }
}

/// A model from YAML text.
pub(crate) fn model_of(text: &str) -> Model {
    let spec = meshplan_ir::parse_model_yaml(text, "test.yaml").unwrap_or_else(|e| panic!("{e}"));
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    Model { spec, graph, pg }
}

/// A vocabulary padded for tensor parallelism (`make_vocab_size_divisible_by`:
/// 250 tokens in 256 rows) trains as the unpadded model: the padded logits drop
/// out of the softmax, so every loss is the unpadded model's (whose first 250
/// table rows are drawn alike: the table is tied and row-major), on one rank and
/// vocabulary-parallel, where the last tensor rank holds the 6 padded rows; each
/// run equals its single-rank reference and moves the plan's bytes.
#[test]
fn a_padded_vocabulary_trains_as_the_unpadded_model_on_every_tensor_split() {
    let tiny = std::fs::read_to_string(format!("{ROOT}/models/tiny-gpt.yaml"))
        .expect("tiny-gpt")
        .replace("kv_heads: 2", "kv_heads: 4")
        .replace("tie_embeddings: false", "tie_embeddings: true");
    let unpadded = model_of(&tiny.replace("vocab: 256", "vocab: 250"));
    let padded = model_of(&tiny.replace(
        "vocab: 256",
        "vocab: 250\n  make_vocab_size_divisible_by: 64",
    ));
    assert_eq!(padded.graph.vocab_rows(), Some(256));
    let opts = TrainOptions::default();
    let base = train(&plan(&unpadded, "dp=1"), &opts).unwrap_or_else(|e| panic!("{e}"));
    for cfg in ["dp=1", "tp=2", "tp=4", "dp=2,tp=2,sp=true", "tp=2,pp=2"] {
        let p = plan(&padded, cfg);
        let run = train(&p, &opts).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        for (step, (a, b)) in run.losses.iter().zip(&base.losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "{cfg} step {step}: loss {a} padded, {b} unpadded"
            );
        }
        let mbs = p.strategy.mbs;
        let reference = plan(&padded, &format!("dp=1,mbs={mbs}"));
        let one = train(&reference, &opts.reference_of(&p)).unwrap_or_else(|e| panic!("{e}"));
        if let Err(why) = check_against(&p, &run, &one, 1e-5) {
            panic!("{cfg} differs from the single-rank run:\n{why}");
        }
        let bytes = byte_mismatches(&p, &run, opts.steps);
        assert!(bytes.is_empty(), "{cfg}: {bytes:?}");
    }
}

/// The CPU test mesh with `gpus` ranks on its one node.
pub(crate) fn mesh(gpus: u64) -> Cluster {
    let mut c = load_cluster(
        Path::new(&format!("{ROOT}/topologies/cpu-test-mesh.yaml")),
        Some(1),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    c.gpus_per_node = gpus;
    c
}

pub(crate) fn plan(m: &Model, cfg: &str) -> Plan {
    plan_buckets(m, cfg, meshplan_cost_model::calib::DP_BUCKET_PARAMS)
}

pub(crate) fn plan_buckets(m: &Model, cfg: &str, bucket: f64) -> Plan {
    let gpus = {
        let p = PartialConfig::parse(cfg, "test").unwrap_or_else(|e| panic!("{e}"));
        p.dp.unwrap_or(1) * p.tp.unwrap_or(1) * p.pp.unwrap_or(1) * p.cp.unwrap_or(1)
    };
    let cl = mesh(gpus);
    let c = PartialConfig::parse(cfg, "test")
        .and_then(|p| p.resolve(cl.gpus(), "test"))
        .unwrap_or_else(|e| panic!("{e}"));
    let workload = m.spec.workload.clone().expect("workload");
    plan_for_config_with_buckets(&m.spec.name, &m.graph, &m.pg, &cl, &workload, &c, bucket)
        .unwrap_or_else(|e| panic!("{cfg}: {e}"))
}

/// Trains `cfg` and its single-rank reference for 5 steps; asserts equal losses
/// (1e-5 relative) and weights, and bytes equal to the plan's.
#[track_caller]
fn check(m: &Model, cfg: &str) {
    check_plan(m, cfg, plan(m, cfg));
}

#[track_caller]
pub(crate) fn check_plan(m: &Model, cfg: &str, p: Plan) {
    check_plan_with(m, cfg, p, true);
}

/// [`check_plan`]; with `goldens_required` false, a configuration no golden was
/// recorded for is compared with its single-rank run alone (a matrix beyond the
/// recorded one).
#[track_caller]
/// The name of `cfg`'s golden on model `m` ([`check_plan_with`]'s).
pub(crate) fn golden_name(m: &Model, cfg: &str) -> String {
    let tag = crate::exec_golden::model_tag(&m.spec);
    format!("{}-{tag}-{cfg}", m.spec.name)
}

pub(crate) fn check_plan_with(m: &Model, cfg: &str, p: Plan, goldens_required: bool) {
    let opts = TrainOptions::default();
    let mbs = p.strategy.mbs;
    let reference = plan(m, &format!("dp=1,mbs={mbs}"));
    // The run and its single-rank reference (both on the device interpreter, what
    // `run --backend cpu` uses) against the goldens the general interpreter
    // recorded, and against each other.
    let run = train(&p, &opts).unwrap_or_else(|e| panic!("{cfg}: {e}"));
    let base =
        train(&reference, &opts.reference_of(&p)).unwrap_or_else(|e| panic!("reference: {e}"));
    let name = golden_name(m, cfg);
    if goldens_required {
        crate::exec_golden::check(&name, &run);
        crate::exec_golden::check(&format!("{name}-reference"), &base);
    } else if crate::exec_golden::check_where_recorded(&name, &run) {
        crate::exec_golden::check(&format!("{name}-reference"), &base);
    }
    match check_against(&p, &run, &base, 1e-5) {
        Ok(lines) => eprintln!("{cfg}: {}", lines.last().cloned().unwrap_or_default()),
        Err(why) => panic!("{cfg} differs from the single-rank run:\n{why}"),
    }
    let mut bytes = byte_mismatches(&p, &run, opts.steps);
    if p.strategy.ep > 1 && p.graph.dropless_experts() {
        // Dropless expert parallelism moves as many tokens as the router sends each
        // expert: the plan prices balanced routing, so on this axis the two agree only
        // on average. Under an expert capacity the buffers are padded and the bytes
        // must match exactly like every other axis'. Each rank against its own
        // stage's program: a stage of dense layers sends none.
        for r in &run.ranks {
            let program = p.ranks[r.rank].program as usize;
            let predicted = p.programs[program].phases[0].bytes_sent().ep * opts.steps as f64;
            let got = r.counts.axis_bytes_sent("ep");
            eprintln!(
                "{cfg}: rank {} ep bytes {got} vs plan {predicted} ({:+.2}%)",
                r.rank,
                100.0 * (got / predicted - 1.0)
            );
            assert!(
                (got - predicted).abs() <= 0.1 * predicted,
                "{cfg}: ep bytes"
            );
        }
        bytes.retain(|m| !m.contains(" ep: "));
    }
    assert!(
        bytes.is_empty(),
        "{cfg}: bytes differ from the plan:\n{}",
        bytes.join("\n")
    );
    assert!(
        run.losses[4] < run.losses[0],
        "{cfg}: the loss falls: {:?}",
        run.losses
    );
}

#[test]
fn dense_dp2() {
    check(&model("tiny-gpt"), "dp=2");
}

#[test]
fn dense_tp2() {
    check(&model("tiny-gpt"), "tp=2");
}

#[test]
fn dense_tp2_sp() {
    check(&model("tiny-gpt"), "tp=2,sp=true");
}

#[test]
fn dense_pp2_1f1b() {
    check(&model("tiny-gpt"), "pp=2,mbs=1");
}

/// tiny-gpt with 4 layers, so two stages can hold two chunks each.
pub(crate) fn four_layers() -> Model {
    let text = std::fs::read_to_string(format!("{ROOT}/models/tiny-gpt.yaml")).expect("model");
    let text = text.replace("layers: 2", "layers: 4");
    let spec =
        meshplan_ir::parse_model_yaml(&text, "tiny-gpt-4l.yaml").unwrap_or_else(|e| panic!("{e}"));
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    Model { spec, graph, pg }
}

#[test]
fn dense_pp2_gpipe() {
    check(&model("tiny-gpt"), "pp=2,mbs=1,schedule=gpipe");
}

#[test]
fn dense_pp2_vpp2() {
    check(&four_layers(), "pp=2,vpp=2,mbs=1");
}

#[test]
fn dense_zero_1_2_3() {
    let m = model("tiny-gpt");
    for z in 1..=3 {
        check(&m, &format!("dp=2,zero={z}"));
    }
}

#[test]
fn dense_cp2_ring_attention() {
    let m = model("tiny-gpt");
    check(&m, "cp=2");
    check(&m, "cp=2,dp=2,recompute=full");
}

/// Dense gradient buckets (each its own collective) in the first stage's step, or
/// (ZeRO-2) at the end of its micro-batches' backward.
pub(crate) fn dense_grad_buckets(p: &Plan) -> usize {
    use meshplan_ir::plan::{Instr, ParamSet, Target};
    let phase = &p.programs[0].phases[0];
    (phase.step.iter())
        .chain(&phase.chunks[0].backward)
        .filter(|i| {
            matches!(
                i,
                Instr::Collective {
                    target: Target::GradBucket {
                        set: ParamSet::Dense,
                        range: Some(_)
                    },
                    ..
                }
            )
        })
        .count()
}

#[test]
fn dense_dp2_gradient_buckets() {
    // 10,000-parameter buckets: tiny-gpt's ~120k parameters reduce in 13 buckets,
    // each its own collective, with and without ZeRO.
    let m = model("tiny-gpt");
    for cfg in ["dp=2", "dp=2,zero=1", "dp=2,tp=2,zero=2"] {
        let p = plan_buckets(&m, cfg, 10_000.0);
        let buckets = dense_grad_buckets(&p);
        assert!(buckets > 5, "{cfg}: {buckets} buckets");
        check_plan(&m, &format!("{cfg},buckets=10000"), p);
    }
}

#[test]
fn dense_dp2_tp2_pp2() {
    check(&model("tiny-gpt"), "dp=2,tp=2,pp=2,mbs=1");
}

#[test]
fn moe_dp2_and_ep2() {
    let m = model("tiny-moe");
    check(&m, "dp=2");
    check(&m, "dp=2,ep=2");
    check(&m, "tp=2");
}

/// A model whose first layer is dense and whose second routes to experts (DeepSeek's
/// `first_k_dense_replace`) trains like one rank on every axis and under ZeRO-3
/// and recomputation. Its two blocks name their ops and weights alike: each layer
/// runs its own block's ops, and ZeRO-3 shards each layer's weights with that
/// layer rather than holding the attention weights whole as a table both blocks
/// read.
#[test]
fn dense_then_moe_layers_train_like_one_rank() {
    let m = model("tiny-moe-dense-first");
    for cfg in [
        "dp=2,tp=2,pp=2,ep=2,zero=3,sp=true",
        "dp=2,cp=2,pp=2,ep=2,recompute=selective",
        "dp=4,tp=2,sp=false",
        "dp=4,pp=2,zero=3,recompute=full",
    ] {
        check_plan_with(&m, cfg, plan(&m, cfg), false);
    }
}

#[test]
fn moe_with_capacity_ep2_sends_exactly_the_planned_bytes() {
    // Capacity groups are a rank's slice of a sequence; with cp=2 the reference
    // (one rank, whole sequences) drops by the same half-sequence groups.
    let m = model("tiny-moe-capacity");
    // Capacity factor 1.0 on a router that is not balanced: some tokens must be
    // dropped, or this test would not exercise capacity at all.
    let run = train(&plan(&m, "dp=2,ep=2"), &TrainOptions::default()).unwrap();
    let (slots, dropped): (u64, u64) = run.ranks.iter().fold((0, 0), |a, r| {
        (a.0 + r.expert_slots.0, a.1 + r.expert_slots.1)
    });
    eprintln!("capacity 1.0: {dropped} of {slots} expert assignments dropped");
    assert!(dropped > 0 && dropped < slots / 2, "{dropped} of {slots}");
    check(&m, "dp=2,ep=2");
    check(&m, "cp=2,ep=2");
    check(&m, "tp=2");
}

#[test]
fn a_failing_rank_stops_every_rank_with_a_message() {
    let m = model("tiny-gpt");
    let p = plan(&m, "dp=2,tp=2,pp=2,mbs=1");
    let opts = TrainOptions {
        fail_at: Some((5, 1)),
        timeout: Some(Duration::from_secs(20)),
        ..TrainOptions::default()
    };
    let t = Instant::now();
    let err = train(&p, &opts).expect_err("a rank failed");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "stopped within seconds"
    );
    assert!(err.message().contains("rank 5 failed"), "{}", err.message());
    assert!(err.message().contains("waiting in"), "{}", err.message());
}

/// Graphs the interpreter cannot feed or whose ops lack operands it reads (an
/// explicit graph that starts from an activation, a weightless norm, an experts
/// op short of its weights: all pass the plan's checks) are refused with a
/// message before any rank starts, not by a rank's index panic.
#[test]
fn graphs_the_executor_cannot_run_are_refused_before_any_rank_starts() {
    let refused = |p: &Plan| match train(p, &TrainOptions::default()) {
        Err(e) => e.message().to_string(),
        Ok(_) => panic!("trained"),
    };
    let mlp = refused(&plan(&model("examples/mlp-graph"), "dp=2"));
    assert!(
        mlp.contains("`x` enters the model's graph from outside it")
            && mlp.contains("planned, estimated and compared, not run"),
        "{mlp}"
    );
    let mut p = plan(&model("tiny-gpt"), "tp=2");
    let norm = (p.graph.segments.iter_mut().flat_map(|s| s.ops.iter_mut()))
        .find(|o| matches!(o.kind, meshplan_ir::OpKind::Norm(_)))
        .expect("a norm");
    let name = norm.name.clone();
    norm.inputs.truncate(1);
    let msg = refused(&p);
    assert!(
        msg.contains(&format!("norm `{name}` has no one-dim scale weight")),
        "{msg}"
    );
    let mut p = plan(&model("tiny-moe"), "dp=2,ep=2");
    let experts = p.graph.segments.iter_mut().flat_map(|s| s.ops.iter_mut());
    let experts = experts
        .filter(|o| matches!(o.kind, meshplan_ir::OpKind::Experts(_)))
        .map(|o| {
            o.inputs.truncate(2);
            o.name.clone()
        })
        .last()
        .expect("an experts op");
    let msg = refused(&p);
    assert!(
        msg.contains(&format!("experts op `{experts}` has 2 inputs")),
        "{msg}"
    );
}

/// Each rank of `p` as a process of its own would run it (`train_device_rank`,
/// what a launched GPU rank runs), here as threads over the in-process
/// communicator: each rank's result, in rank order.
pub(crate) fn launched_ranks(
    p: &Plan,
    opts: &TrainOptions,
) -> Vec<Result<LaunchedRank, meshplan_executor::train::ExecError>> {
    use meshplan_executor::comm::{Communicator, ThreadComm};
    use meshplan_executor::device::train::train_device_rank;
    use meshplan_executor::device::HostDevice;
    std::thread::scope(|s| {
        let ranks: Vec<_> = ThreadComm::create(p.ranks.len(), opts.timeout)
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let comm: Box<dyn Communicator> = Box::new(c);
                    train_device_rank(p, opts, HostDevice, comm)
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|h| h.join().expect("no panic"))
            .collect()
    })
}

/// What a launched rank returns: its report (on rank 0 with the final weights,
/// every rank's) and the checkpoints it wrote.
pub(crate) type LaunchedRank = (
    Vec<meshplan_executor::train::RankReport>,
    Vec<meshplan_executor::ckpt::Saved>,
);

/// One rank a process: the failing rank's error names it and says why, in words,
/// not as a debug dump.
#[test]
fn a_launched_rank_reports_its_failure_in_words() {
    let p = plan(&model("tiny-gpt"), "dp=2");
    let opts = TrainOptions {
        fail_at: Some((1, 1)),
        // Nothing tells rank 0 here (a launcher stops the other processes): it
        // waits for rank 1 until this timeout.
        timeout: Some(Duration::from_secs(2)),
        ..TrainOptions::default()
    };
    let results = launched_ranks(&p, &opts);
    let failed = results[1].as_ref().expect_err("rank 1 fails at step 1");
    assert_eq!(failed.message(), "rank 1: injected failure at step 1");
}

/// One rank a process, traced: rank 0 receives every rank's timeline, the spans
/// (names and categories, in order) one process records of the same plan.
#[test]
fn a_launched_trace_holds_every_rank() {
    let p = plan(&model("tiny-gpt"), "dp=2,tp=2,pp=2,mbs=1");
    // Without `--check`: the trace alone brings the reports.
    let opts = TrainOptions {
        steps: 2,
        trace: true,
        final_weights: false,
        ..TrainOptions::default()
    };
    let whole = train(&p, &opts).expect("one process");
    let mut results = launched_ranks(&p, &opts);
    let (reports, _) = results.remove(0).expect("rank 0");
    assert_eq!(reports.len(), p.ranks.len());
    let shape = |r: &meshplan_executor::train::RankReport| {
        (r.spans.iter())
            .map(|s| (s.name.clone(), s.cat))
            .collect::<Vec<_>>()
    };
    for (a, b) in reports.iter().zip(&whole.ranks) {
        assert_eq!(a.rank, b.rank);
        assert!(
            a.spans.len() > 10,
            "rank {}: {} spans",
            a.rank,
            a.spans.len()
        );
        assert_eq!(shape(a), shape(b), "rank {}", a.rank);
        assert_eq!(a.clock0_unix_s, reports[0].clock0_unix_s);
    }
}

#[test]
fn tied_embeddings_and_dropout_train_like_one_rank() {
    let text = std::fs::read_to_string(format!("{ROOT}/models/tiny-gpt.yaml")).expect("model");
    let variant = |from: &str, to: &str, name: &str| {
        let spec = meshplan_ir::parse_model_yaml(&text.replace(from, to), name)
            .unwrap_or_else(|e| panic!("{e}"));
        let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
        let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
        Model { spec, graph, pg }
    };
    let tied = variant("tie_embeddings: false", "tie_embeddings: true", "tied.yaml");
    // With one stage the tied table is one weight; across stages the first and the
    // last stage each hold it and sum its gradients (the plan's `embed` group).
    check(&tied, "dp=2");
    check(&tied, "pp=2,mbs=1");
    check(&tied, "dp=2,tp=2,pp=2,zero=1,mbs=1");
    check(&tied, "tp=2,pp=2,sp=true,mbs=1");
    let dropout = variant(
        "position: rope",
        "position: rope\n  dropout: true",
        "dropout.yaml",
    );
    // Dropout masks are drawn from global coordinates (sample, position, column or
    // head and key), so every sharding, and recomputation, drops the same entries.
    for cfg in [
        "dp=2",
        "tp=2,sp=true",
        "cp=2",
        "dp=2,tp=2,pp=2,mbs=1",
        "tp=2,cp=2,recompute=full",
        "dp=2,recompute=selective",
        "dp=2,tp=2,sp=true,mbs=2",
    ] {
        check(&dropout, cfg);
    }
    // A learned position table is looked up by position, under every split of the
    // sequence: one step moves every row of it by about the learning rate (Adam),
    // where looking it up by token id would leave most rows to weight decay alone.
    let learned = variant(
        "position: rope",
        "position: learned\n  max_positions: 32",
        "learned.yaml",
    );
    for cfg in ["dp=2", "tp=2,sp=true", "cp=2", "pp=2,mbs=1"] {
        check(&learned, cfg);
    }
    let one = TrainOptions {
        steps: 1,
        ..TrainOptions::default()
    };
    let run = train(&plan(&learned, "dp=2"), &one).unwrap();
    let w = &run.ranks[0].weights[&("embed.positions.w".to_string(), u64::MAX)];
    let w0 = meshplan_executor::init::init_full(
        one.seed,
        "embed.positions.w",
        u64::MAX,
        w.len(),
        meshplan_executor::init::InitKind::Normal(0.02),
    );
    for row in 0..32 {
        let moved = (0..64)
            .map(|j| (w[row * 64 + j] - w0[row * 64 + j]).abs())
            .fold(0.0f32, f32::max);
        assert!(moved > 1e-3, "position row {row} moved only {moved}");
    }
    // And dropout is on: the first loss differs from the same model without it.
    let without = train(&plan(&model("tiny-gpt"), "dp=2"), &TrainOptions::default()).unwrap();
    let with = train(&plan(&dropout, "dp=2"), &TrainOptions::default()).unwrap();
    assert!(
        (with.losses[0] - without.losses[0]).abs() > 1e-4 * without.losses[0],
        "{} vs {}",
        with.losses[0],
        without.losses[0]
    );
}

#[test]
fn moe_under_sequence_parallelism() {
    // Experts split over tp: the router scores this rank's tokens, the plan gathers
    // tokens and scores and reduce-scatters the gradients. With ep > 1 each tensor
    // rank dispatches its own tokens to the expert axis.
    let m = model("tiny-moe");
    check(&m, "tp=2,sp=true");
    check(&m, "tp=2,ep=2,sp=true");
    let c = model("tiny-moe-capacity");
    check(&c, "tp=2,sp=true");
    check(&c, "dp=2,tp=2,ep=4,sp=true");
    check(&c, "tp=2,ep=2,sp=true,pp=2,mbs=1");
}

#[test]
fn the_step_hook_hears_every_step_once_from_rank_0() {
    use meshplan_executor::train::StepHook;
    use std::sync::{Arc, Mutex};
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let opts = TrainOptions {
        steps: 3,
        on_step: Some(StepHook(Arc::new(move |n| s2.lock().unwrap().push(n)))),
        ..TrainOptions::default()
    };
    train(&plan(&model("tiny-gpt"), "dp=2,tp=2,pp=2,mbs=1"), &opts).unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![1, 2, 3]);
}

/// A run that only reports hands no weights back (on a GPU each rank would
/// download all it holds, and ZeRO-3 gather it first, for nothing), and trains the
/// same: the same losses and bytes as one that hands them back for a comparison.
#[test]
fn a_run_keeps_its_final_weights_only_when_asked() {
    let p = plan(&model("tiny-gpt"), "dp=2,tp=2,zero=3");
    let run = |final_weights| {
        let opts = TrainOptions {
            steps: 2,
            final_weights,
            ..TrainOptions::default()
        };
        train(&p, &opts).unwrap()
    };
    let (kept, left) = (run(true), run(false));
    assert_eq!(kept.losses, left.losses);
    for (a, b) in kept.ranks.iter().zip(&left.ranks) {
        assert!(!a.weights.is_empty(), "rank {}", a.rank);
        assert!(b.weights.is_empty(), "rank {}", b.rank);
        assert_eq!(a.counts, b.counts, "rank {} bytes", a.rank);
        assert_eq!(a.state_bytes, b.state_bytes, "rank {}", a.rank);
    }
}

#[test]
fn kernel_threads_per_rank_do_not_change_a_single_bit() {
    // Each rank's kernels split rows, heads and output tiles over a pool of their
    // own; no reduction is split, so losses and every weight are bit-identical to
    // single-threaded ranks, on a plain and on a ring-attention, MoE-free mesh.
    let m = model("tiny-gpt");
    for cfg in ["dp=1", "dp=2,tp=2", "cp=2,mbs=2"] {
        let p = plan(&m, cfg);
        let run = |threads| {
            train(
                &p,
                &TrainOptions {
                    steps: 3,
                    threads_per_rank: threads,
                    ..TrainOptions::default()
                },
            )
            .unwrap_or_else(|e| panic!("{cfg} on {threads} threads: {e}"))
        };
        // Two and three threads: a linear's backward runs its two products side
        // by side on halves of the pool (1 + 1, and 1 + 2 threads).
        let one = run(1);
        for many in [run(2), run(3)] {
            assert_eq!(one.losses, many.losses, "{cfg}: losses");
            for (a, b) in one.ranks.iter().zip(&many.ranks) {
                assert_eq!(a.weights, b.weights, "{cfg}: rank {} weights", a.rank);
                assert_eq!(a.counts, b.counts, "{cfg}: rank {} bytes", a.rank);
            }
        }
    }
}

#[test]
fn check_names_a_wrong_embedding_without_a_layer_number() {
    // A run whose token table alone is off by 1e-3 everywhere (a third of the 3e-3
    // learning rate, over 5 steps: 6.7e-2 of lr x steps, above the 1e-2 bound):
    // `check_against` fails naming the weight, with no layer for a weight outside the
    // repeated blocks.
    let m = model("tiny-gpt");
    let p = plan(&m, "dp=1");
    let opts = TrainOptions::default();
    let base = train(&p, &opts).unwrap_or_else(|e| panic!("{e}"));
    let mut run = base.clone();
    for ((name, _), w) in run.ranks[0].weights.iter_mut() {
        if name == "embed.tokens.w" {
            w.iter_mut().for_each(|x| *x += 1e-3);
        }
    }
    let why = check_against(&p, &run, &base, 1e-5).expect_err("the table is off");
    assert!(why.contains("`embed.tokens.w` (rms 1.00e-3"), "{why}");
    assert!(!why.contains(&u64::MAX.to_string()), "{why}");
    // And the unchanged run passes.
    check_against(&p, &base, &base, 1e-5).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_diverging_run_stops_naming_the_step_and_the_tensor() {
    // A learning rate of 1e30 turns the first update into weights of 1e30, whose
    // activations overflow: the run stops with an error instead of training on NaN.
    let p = plan(&model("tiny-gpt"), "dp=2,tp=2");
    let opts = TrainOptions {
        lr: 1e30,
        ..TrainOptions::default()
    };
    let err = train(&p, &opts).expect_err("a diverging run fails");
    assert!(
        err.message().contains("stopping")
            && err.message().contains("step ")
            && (err.message().contains("holds") || err.message().contains("the loss is")),
        "{}",
        err.message()
    );
    // The device interpreter (the GPU's, here on host memory) stops as well.
    use meshplan_executor::device::{train::train_device, HostDevice};
    let p = plan(&model("tiny-gpt"), "dp=8");
    let opts = TrainOptions {
        lr: 1e30,
        steps: 4,
        ..TrainOptions::default()
    };
    let err = train_device(&p, &opts, &|_| Ok(HostDevice)).expect_err("a diverging run fails");
    assert!(
        err.message().contains("stopping")
            && (err.message().contains("holds") || err.message().contains("the loss is")),
        "{}",
        err.message()
    );
    // An infinite learning rate makes the first update infinite while step 0's
    // loss is still finite: the run stops at step 0 naming the first weight the
    // general interpreter named (its message, recorded before it was deleted:
    // "step 0: weight `block.attn.proj.w` layer 0 holds NaN after the update").
    let inf = TrainOptions {
        lr: f32::INFINITY,
        steps: 3,
        ..TrainOptions::default()
    };
    let p = plan(&model("tiny-gpt"), "dp=2,tp=2,ep=1");
    let m = train(&p, &inf).expect_err("diverges").message().to_string();
    assert!(
        m.contains("step 0: weight `block.attn.proj.w` layer 0 holds")
            && m.contains("a learning rate too large"),
        "{m}"
    );
    // ZeRO-3 holds no whole weight between steps: the check reads the parts, and
    // names the weight whose part first went bad (the first copy's first weight).
    let p = plan(&model("tiny-gpt"), "dp=2,zero=3");
    let m = train_device(&p, &inf, &|_| Ok(HostDevice))
        .expect_err("diverges")
        .message()
        .to_string();
    eprintln!("{m}");
    assert!(
        m.contains("step 0: weight `")
            && m.contains(" holds ")
            && m.contains("a learning rate too large"),
        "{m}"
    );
    // Nor does a bf16 model's ZeRO-1 rank hold whole masters: the check reads its
    // parts of them.
    use meshplan_executor::device::emulate::Bf16Host;
    let bf16 = crate::matrix::variant("tiny-gpt", &[("dtype: f32", "dtype: bf16")], "bf16.yaml");
    let p = plan(&bf16, "dp=2,zero=1");
    let m = train_device(&p, &inf, &|_| Ok(Bf16Host))
        .expect_err("diverges")
        .message()
        .to_string();
    assert!(
        m.contains("step 0: weight `") && m.contains(" holds "),
        "{m}"
    );
}

/// Every collective's target in `v` (a plan as JSON) rewritten to the string the
/// plans before the typed protocol held; how many.
fn to_legacy_targets(v: &mut serde_json::Value) -> usize {
    match v {
        serde_json::Value::Object(m) => {
            let mut n = 0;
            if m.get("op").and_then(|o| o.as_str()) == Some("collective") {
                let t: meshplan_ir::plan::Target =
                    serde_json::from_value(m["tensor"].clone()).expect("a typed target");
                m.insert("tensor".into(), serde_json::Value::String(t.to_string()));
                n += 1;
            }
            n + m.values_mut().map(to_legacy_targets).sum::<usize>()
        }
        serde_json::Value::Array(a) => a.iter_mut().map(to_legacy_targets).sum(),
        _ => 0,
    }
}

#[test]
fn plans_written_before_the_typed_protocol_run_bit_for_bit() {
    // Activation and gradient collectives (tp, sp), loss statistics (vocabulary
    // parallel head), hidden states (pp), ZeRO-3 segment sets, buckets, tied
    // gradients, expert exchanges.
    for (m, cfg) in [
        (model("tiny-gpt"), "dp=2,tp=2,sp=true,zero=1"),
        (model("tiny-gpt"), "tp=2,pp=2,sp=true,mbs=1"),
        (model("tiny-gpt"), "dp=2,zero=3"),
        (model("tiny-moe"), "dp=2,ep=2"),
    ] {
        let p = plan(&m, cfg);
        let mut v = serde_json::to_value(&p).expect("plan as JSON");
        let rewritten = to_legacy_targets(&mut v);
        assert!(rewritten > 0, "{cfg}: no collective");
        let text = serde_json::to_string(&v).expect("serialises");
        assert!(
            !text.contains(r#""tensor":{"#),
            "{cfg}: a typed target left"
        );
        let old = Plan::from_json(&text).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        assert_eq!(
            old, p,
            "{cfg}: the older strings read back as the same plan"
        );
        let opts = TrainOptions {
            steps: 2,
            ..TrainOptions::default()
        };
        let a = train(&p, &opts).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        let b = train(&old, &opts).unwrap_or_else(|e| panic!("{cfg}: {e}"));
        assert_eq!(
            crate::exec_golden::fingerprint(&a),
            crate::exec_golden::fingerprint(&b),
            "{cfg}"
        );
    }
}
