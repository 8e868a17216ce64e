//! Pictures and the predicted trace: golden SVG files (regenerated with
//! `UPDATE_GOLDEN=1`, the generator being these tests), what each picture must show
//! (checked on the shapes the SVG is written from), pictures of a GPT-3 3840-GPU plan
//! and of Llama 3 70B inference plans, and `draw` / `--figures` / `--trace` through
//! the binary.

use crate::cli::{meshplan, temp_file};
use meshplan_cost_model::timeline::{InferenceTimeline, StageTail, TrainTimeline};
use meshplan_cost_model::{
    load_cluster, prepare_model, InferenceLoad, Lane, MemoryLedger, SpanKind, Timeline,
};
use meshplan_ir::plan::{Pass, Plan, PlanKind};
use meshplan_ir::{load_model, model_graph, PartialConfig, Schedule, Workload, WorkloadOverrides};
use meshplan_planner::output::{plan_for_config, plan_of};
use meshplan_planner::search::{search_inference, search_train, SearchOptions};
use meshplan_viz::canvas::{Canvas, Item};
use meshplan_viz::compare::{compare_bars, CompareBar};
use meshplan_viz::{gantt, memory, mesh, plan_figures, plan_trace, timeline_of};
use std::path::{Path, PathBuf};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const MB: usize = 1 << 20;

/// Compares `text` with `tests/data/golden/NAME`, or writes it under `UPDATE_GOLDEN=1`.
#[track_caller]
pub(crate) fn golden(name: &str, text: &str) {
    let path = PathBuf::from(format!("{ROOT}/tests/data/golden/{name}"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().expect("dir")).expect("golden dir");
        std::fs::write(&path, text).expect("write golden");
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run `UPDATE_GOLDEN=1 cargo test --release -p meshplan-tests --test it draw` to create it",
            path.display()
        )
    });
    if want != text {
        let line = want
            .lines()
            .zip(text.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(want.lines().count().min(text.lines().count()));
        panic!(
            "{} differs from the output at line {}:\n  golden: {:?}\n  now:    {:?}\nif the change is intended, regenerate with UPDATE_GOLDEN=1",
            path.display(),
            line + 1,
            want.lines().nth(line),
            text.lines().nth(line)
        );
    }
}

fn workload_of(spec: &meshplan_ir::ModelSpec) -> Workload {
    spec.workload.clone().expect("a shipped workload")
}

/// The plan `meshplan plan MODEL CLUSTER --nodes N [--config FIXED]` writes.
fn searched_plan(model: &str, cluster: &str, nodes: u64, fixed: Option<&str>) -> Plan {
    let spec = load_model(
        Path::new(&format!("{ROOT}/models/{model}.yaml")),
        &WorkloadOverrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    let cl = load_cluster(
        Path::new(&format!("{ROOT}/topologies/{cluster}.yaml")),
        Some(nodes),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let opts = SearchOptions {
        fixed: fixed
            .map(|f| PartialConfig::parse(f, "test").unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_default(),
        ..SearchOptions::default()
    };
    let workload = workload_of(&spec);
    let report = match &workload {
        Workload::Train {
            seq_len,
            global_batch,
            ..
        } => search_train(&graph, &pg, &cl, *seq_len, *global_batch, &opts, None),
        Workload::Inference { .. } => {
            let load = InferenceLoad::from_workload(&workload).expect("inference");
            search_inference(&graph, &pg, &cl, &load, &opts)
        }
    }
    .unwrap_or_else(|e| panic!("{e}"));
    let best = report.top.first().expect("a feasible plan");
    plan_of(&spec.name, &graph, &pg, &cl, &workload, best, &report)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// tiny-gpt on the CPU test mesh, dp=2,tp=2,pp=2 (what `plan --config` lowers).
fn tiny_plan() -> Plan {
    let spec = load_model(
        Path::new(&format!("{ROOT}/models/tiny-gpt.yaml")),
        &WorkloadOverrides::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let graph = model_graph(&spec).unwrap_or_else(|e| panic!("{e}"));
    let pg = prepare_model(&spec).unwrap_or_else(|e| panic!("{e}"));
    let cl = load_cluster(
        Path::new(&format!("{ROOT}/topologies/cpu-test-mesh.yaml")),
        None,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let cfg = PartialConfig::parse("dp=2,tp=2,pp=2", "test")
        .and_then(|p| p.resolve(cl.gpus(), "test"))
        .unwrap_or_else(|e| panic!("{e}"));
    plan_for_config(&spec.name, &graph, &pg, &cl, &workload_of(&spec), &cfg)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn bounds(i: &Item) -> (f64, f64, f64, f64) {
    i.bounds().expect("a rectangle")
}

fn stage_of(i: &Item) -> usize {
    i.data("s").expect("data-s").parse().expect("a stage")
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-30)
}

/// Compute-lane classes of the Gantt chart (everything but sends and the comm stripes).
const COMPUTE_LANE: [&str; 8] = [
    "fwd",
    "bwd",
    "prefill",
    "decode",
    "dp-comm",
    "tp-sync",
    "optimizer",
    "bubble",
];

/// Checks a Gantt chart against the timeline it was drawn from: one row per stage;
/// each stage's boxes tile `0..end` (px = seconds x scale); returns per stage the
/// task boxes in x order as (pass, chunk, mb).
fn check_gantt(c: &Canvas, tl: &Timeline) -> Vec<Vec<(Pass, u64, u64)>> {
    let pp = tl.pp();
    let rows: Vec<&str> = c.texts("row").collect();
    let want: Vec<String> = (0..pp).map(|s| format!("stage {s}")).collect();
    assert_eq!(rows, want, "one row per pipeline stage");
    let k = gantt::px_per_s(tl);
    let mut orders = Vec::new();
    for s in 0..pp {
        type Boxed<'a> = (&'a str, (f64, f64, f64, f64), &'a Item);
        let mut lane: Vec<Boxed> = COMPUTE_LANE
            .iter()
            .flat_map(|cls| c.rects(cls).map(move |i| (*cls, bounds(i), i)))
            .filter(|(_, _, i)| stage_of(i) == s)
            .collect();
        lane.sort_by(|a, b| a.1 .0.total_cmp(&b.1 .0));
        let mut x = gantt::LEFT;
        for (_, (x0, _, w, _), _) in &lane {
            assert!(
                (x0 - x).abs() < 1e-6,
                "stage {s}: a gap or overlap at {x0} (previous box ends at {x})"
            );
            x = x0 + w;
        }
        assert!(
            close(x - gantt::LEFT, tl.end_s() * k, 1e-9),
            "stage {s}: the row ends at the step's end"
        );
        orders.push(
            lane.iter()
                .filter(|(cls, _, _)| *cls == "fwd" || *cls == "bwd")
                .map(|(cls, _, i)| {
                    (
                        if *cls == "fwd" { Pass::F } else { Pass::B },
                        i.data("c").expect("chunk").parse().expect("n"),
                        i.data("mb").expect("mb").parse().expect("n"),
                    )
                })
                .collect(),
        );
    }
    orders
}

/// Idle time of `stage` in the chart, s.
fn bubble_s(c: &Canvas, tl: &Timeline, stage: usize) -> f64 {
    c.rects("bubble")
        .filter(|i| stage_of(i) == stage)
        .map(|i| bounds(i).2)
        .sum::<f64>()
        / gantt::px_per_s(tl)
}

/// Checks the memory bars: each stage's parts stack to its ledger's total, from the
/// baseline; returns the px per byte.
fn check_memory(c: &Canvas, stages: &[MemoryLedger], capacity: f64) -> f64 {
    let (k, base) = memory::scale(stages, capacity);
    for (s, m) in stages.iter().enumerate() {
        let mut parts: Vec<(f64, f64, f64, f64)> = memory::PARTS
            .iter()
            .flat_map(|(cls, _, _)| c.rects(cls))
            .filter(|i| stage_of(i) == s)
            .map(bounds)
            .collect();
        parts.sort_by(|a, b| b.1.total_cmp(&a.1));
        let height: f64 = parts.iter().map(|p| p.3).sum();
        assert!(
            close(height, m.total * k, 1e-9),
            "stage {s}: bar {height} px, total {} px",
            m.total * k
        );
        // Stacked: each part starts where the one below ends.
        let mut y = base;
        for p in &parts {
            assert!((p.1 + p.3 - y).abs() < 1e-6);
            y = p.1;
        }
    }
    let cap = c
        .items
        .iter()
        .find_map(|i| match i {
            Item::Line { class, y1, .. } if class == "capacity" => Some(*y1),
            _ => None,
        })
        .expect("a capacity line");
    assert!((cap - (base - capacity * k)).abs() < 1e-6);
    k
}

fn axis_class(c: &Canvas, axis: &str) -> String {
    c.items
        .iter()
        .find_map(|i| match i {
            Item::Rect { class, .. }
                if class.starts_with("axis-") && i.data("axis") == Some(axis) =>
            {
                Some(class.clone())
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no row for axis {axis}"))
}

fn hand_train() -> TrainTimeline {
    let pp = 4;
    let vpp = 2;
    let tail = |dp: f64, sp: f64| StageTail {
        exposed_dp_s: dp,
        sp_sync_s: sp,
        optimizer_s: 0.05,
        memory: MemoryLedger {
            params: 4e9,
            grads: 4e9,
            optimizer: 6e9,
            activations: 2e10,
            kv_cache: 0.0,
            workspace: 1e9,
            total: 3.5e10,
        },
    };
    TrainTimeline {
        pp,
        vpp,
        microbatches: 8,
        schedule: Schedule::Interleaved,
        forward_s: (0..pp * vpp).map(|v| 0.1 + 0.01 * v as f64).collect(),
        backward_s: (0..pp * vpp).map(|v| 0.2 + 0.02 * v as f64).collect(),
        forward_comm_s: vec![0.02; pp * vpp],
        backward_comm_s: vec![0.04; pp * vpp],
        p2p_s: 0.01,
        stages: vec![
            tail(0.1, 0.02),
            tail(0.12, 0.02),
            tail(0.1, 0.0),
            tail(0.08, 0.0),
        ],
        critical_stage: 3,
        step_s: 0.0,
        memory_capacity_bytes: 80.0 * 1024.0 * 1024.0 * 1024.0,
    }
}

fn hand_inference() -> InferenceTimeline {
    let mem = MemoryLedger {
        params: 2e10,
        grads: 0.0,
        optimizer: 0.0,
        activations: 5e8,
        kv_cache: 3e10,
        workspace: 1e9,
        total: 5.15e10,
    };
    InferenceTimeline {
        pp: 2,
        prefill_s: vec![0.12, 0.11],
        prefill_comm_s: vec![0.01, 0.01],
        decode_s: vec![0.02, 0.021],
        decode_comm_s: vec![0.004, 0.004],
        hop_prefill_s: 0.003,
        hop_decode_s: 0.0005,
        memory: vec![mem, mem],
        ttft_s: 0.233,
        tpot_s: 0.0415,
        memory_capacity_bytes: 80.0 * 1024.0 * 1024.0 * 1024.0,
    }
}

#[test]
fn golden_pictures_and_trace_of_a_tiny_plan() {
    let plan = tiny_plan();
    let figs = plan_figures(&plan).unwrap_or_else(|e| panic!("{e}"));
    let names: Vec<&str> = figs.iter().map(|f| f.name).collect();
    assert_eq!(names, ["pipeline", "memory", "mesh"]);
    for f in &figs {
        golden(&format!("tiny-gpt-{}.svg", f.name), &f.canvas.to_svg());
    }
    golden(
        "tiny-gpt-trace.json",
        &plan_trace(&plan)
            .unwrap_or_else(|e| panic!("{e}"))
            .to_json(),
    );
    let tl = timeline_of(&plan).unwrap_or_else(|e| panic!("{e}"));
    let orders = check_gantt(&figs[0].canvas, &tl);
    for (s, order) in orders.iter().enumerate() {
        let want: Vec<(Pass, u64, u64)> = plan.programs[s].phases[0]
            .schedule
            .iter()
            .map(|t| (t.pass, t.chunk, t.mb))
            .collect();
        assert_eq!(
            order, &want,
            "stage {s}: the chart runs the plan's schedule"
        );
    }
}

#[test]
fn golden_interleaved_and_inference_schedules() {
    let mut t = hand_train();
    // The step as the estimate adds it: makespan plus the longest tail.
    let probe = Timeline::Train(TrainTimeline {
        step_s: 100.0,
        ..t.clone()
    });
    let makespan = probe
        .spans()
        .iter()
        .filter(|s| matches!(s.kind, SpanKind::Forward | SpanKind::Backward))
        .map(|s| s.end_s)
        .fold(0.0, f64::max);
    t.step_s = makespan + 0.12 + 0.02 + 0.05;
    let tl = Timeline::Train(t);
    tl.validate().unwrap_or_else(|e| panic!("{e}"));
    let c = gantt::gantt(&tl, "interleaved 1F1B, pp=4, vpp=2, 8 micro-batches");
    golden("interleaved-pipeline.svg", &c.to_svg());
    let orders = check_gantt(&c, &tl);
    for order in &orders {
        // Every (chunk, micro-batch) once forward and once backward.
        for pass in [Pass::F, Pass::B] {
            let mut seen: Vec<(u64, u64)> = order
                .iter()
                .filter(|t| t.0 == pass)
                .map(|t| (t.1, t.2))
                .collect();
            seen.sort();
            let want: Vec<(u64, u64)> = (0..2).flat_map(|c| (0..8).map(move |m| (c, m))).collect();
            assert_eq!(seen, want);
        }
    }
    // Sends: one per forward except the last virtual stage's, one per backward except
    // the first's.
    assert_eq!(c.rects("p2p").count(), 2 * (4 * 2 * 8 - 8));

    let inf = Timeline::Inference(hand_inference());
    let c = gantt::gantt(&inf, "inference, pp=2");
    golden("inference-pipeline.svg", &c.to_svg());
    check_gantt(&c, &inf);
    assert_eq!(c.rects("prefill").count(), 2);
    assert_eq!(c.rects("decode").count(), 2);
    let m = memory::memory_bars(
        &inf.stage_memory(),
        inf.memory_capacity_bytes(),
        8,
        "inference memory",
    );
    golden("inference-memory.svg", &m.to_svg());
    check_memory(&m, &inf.stage_memory(), inf.memory_capacity_bytes());
    assert_eq!(m.rects("mem-kv-cache").count(), 2);
}

#[test]
fn golden_compare_bars_add_up_to_each_step_time() {
    let bar = |name: &str, c: f64, x: f64, b: f64| CompareBar {
        name: name.into(),
        strategy: format!("dp=60,tp=8,pp=8 ({name})"),
        compute_s: Some(c),
        exposed_comm_s: x,
        bubble_s: b,
        feasible: true,
        error: None,
    };
    let bars = vec![
        bar("planner", 9.0, 0.5, 1.2),
        bar("megatron 8x8x60", 9.6, 0.8, 2.4),
        CompareBar {
            compute_s: None,
            error: Some("heads(96) % tp(7) != 0".into()),
            ..bar("tp=7", 0.0, 0.0, 0.0)
        },
    ];
    let c = compare_bars(&bars, "GPT-3 175B on 3840 GPUs", "one training step");
    golden("compare.svg", &c.to_svg());
    let k = meshplan_viz::compare::px_per_s(&bars);
    for (i, b) in bars.iter().enumerate() {
        let w: f64 = c
            .items
            .iter()
            .filter(|it| it.data("row") == Some(&i.to_string()))
            .map(|it| bounds(it).2)
            .sum();
        let want = b
            .compute_s
            .map(|x| x + b.exposed_comm_s + b.bubble_s)
            .unwrap_or(0.0)
            * k;
        assert!(close(w, want, 1e-9), "row {i}: {w} px, want {want}");
    }
    assert_eq!(c.rects("cmp-bubble").count(), 2);
    assert!(c.texts("error").any(|t| t.contains("heads(96)")));
}

#[test]
fn gpt3_on_3840_gpus_every_picture() {
    let plan = searched_plan("gpt3-175b", "dgx-a100-80g", 480, None);
    check_train_plan(&plan);
    // Megatron's interleaved layout: 26 micro-batches on 8 stages leave a partial
    // group, which the simulation (and the plan's schedule) reorder alike.
    let plan = searched_plan(
        "gpt3-175b",
        "dgx-a100-80g",
        480,
        Some("dp=60,tp=8,pp=8,mbs=1,recompute=full,vpp=2"),
    );
    assert_eq!(plan.strategy.vpp, 2);
    check_train_plan(&plan);
}

/// Every picture and the trace of a training plan on 480 DGX A100 nodes.
fn check_train_plan(plan: &Plan) {
    let plan = plan.clone();
    let tl = timeline_of(&plan).unwrap_or_else(|e| panic!("{e}"));
    let Timeline::Train(t) = &tl else {
        panic!("a training timeline")
    };
    let p = &plan.predicted;
    let num = |v: &serde_json::Value| v.as_f64().expect("a number");
    assert_eq!(t.pp as u64, plan.strategy.pp);
    assert_eq!(t.step_s, num(&p["step_time_s"]), "the estimate's own step");
    let figs = plan_figures(&plan).unwrap_or_else(|e| panic!("{e}"));
    let (g, m, mm) = (&figs[0].canvas, &figs[1].canvas, &figs[2].canvas);

    // Gantt: the plan's schedule, every micro-batch once each way per chunk.
    let orders = check_gantt(g, &tl);
    let m_per_chunk = t.microbatches * t.vpp;
    for (s, order) in orders.iter().enumerate() {
        assert_eq!(order.iter().filter(|o| o.0 == Pass::F).count(), m_per_chunk);
        assert_eq!(order.iter().filter(|o| o.0 == Pass::B).count(), m_per_chunk);
        let want: Vec<(Pass, u64, u64)> = plan.programs[s].phases[0]
            .schedule
            .iter()
            .map(|t| (t.pass, t.chunk, t.mb))
            .collect();
        assert_eq!(order, &want, "stage {s}");
    }
    // The estimate books the critical stage's idle time, and the tensor-axis gradient
    // sync its compute and communication leave out, as bubble.
    let crit = t.critical_stage;
    let idle = bubble_s(g, &tl, crit) + t.stages[crit].sp_sync_s;
    let bubble = num(&p["time_breakdown_s"]["bubble"]);
    assert!(close(idle, bubble, 1e-9), "{idle} vs {bubble}");

    // Memory: stacked parts sum to each stage's ledger; the fullest is the estimate's.
    let stages = tl.stage_memory();
    check_memory(m, &stages, tl.memory_capacity_bytes());
    let fullest = stages.iter().map(|l| l.total).fold(0.0, f64::max);
    assert_eq!(fullest, num(&p["memory_per_gpu_bytes"]["total"]));
    assert_eq!(m.rects("mem-params").count(), t.pp);

    // Mesh: tp inside a node over NVLink, data and pipeline axes over InfiniBand; one
    // box per node, coloured by the stage its GPUs belong to.
    let gpn = plan.cluster.gpus_per_node;
    assert!(plan.strategy.tp <= gpn);
    assert_eq!(axis_class(mm, "tp"), "axis-nvlink");
    assert_eq!(axis_class(mm, "dp"), "axis-ib");
    assert_eq!(axis_class(mm, "pp"), "axis-ib");
    assert_eq!(
        mm.rects("group-tp").count() as u64,
        gpn / plan.strategy.tp,
        "node 0 outlines its tp groups"
    );
    let nodes: Vec<&Item> = mm.rects("node").collect();
    assert_eq!(nodes.len(), 480);
    let stage_nodes = 480 / plan.strategy.pp as usize;
    for (n, item) in nodes.iter().enumerate() {
        assert_eq!(stage_of(item), n / stage_nodes);
    }

    // Trace: the executor's names and layout, the plan's step.
    let trace = plan_trace(&plan).unwrap_or_else(|e| panic!("{e}"));
    let spans: Vec<_> = trace.trace_events.iter().filter(|e| e.ph == "X").collect();
    for s in 0..t.pp as u64 {
        let fwd = spans
            .iter()
            .filter(|e| e.pid == s && e.cat == "compute" && e.name.starts_with("fwd mb"))
            .count();
        assert_eq!(fwd, m_per_chunk);
        let end = spans
            .iter()
            .filter(|e| e.pid == s)
            .map(|e| e.ts + e.dur)
            .fold(0.0, f64::max);
        assert!(close(end, t.step_s * 1e6, 1e-9));
    }
    assert!(spans.iter().any(|e| e.cat == "bubble"));
    assert!(spans.iter().any(|e| e.name == "bwd mb3 c0"));

    // Sizes: a 3840-rank plan's pictures stay small and render as PNG too.
    for f in &figs {
        let svg = f.canvas.to_svg();
        let name = format!("gpt3-175b 3840 GPUs {}: {}", plan.strategy, f.name);
        eprintln!("{name}.svg {} bytes", svg.len());
        assert!(svg.len() < MB, "{name}.svg is {} bytes", svg.len());
        let png = meshplan_viz::render(&f.canvas, true).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&png[1..4], b"PNG");
        eprintln!("{name}.png {} bytes", png.len());
    }
}

#[test]
fn llama3_70b_inference_every_picture() {
    for fixed in [None, Some("pp=2,tp=8")] {
        let plan = searched_plan("llama3-70b-inference", "dgx-a100-80g", 2, fixed);
        assert_eq!(plan.kind, PlanKind::Inference);
        let tl = timeline_of(&plan).unwrap_or_else(|e| panic!("{e}"));
        let Timeline::Inference(t) = &tl else {
            panic!("an inference timeline")
        };
        let figs = plan_figures(&plan).unwrap_or_else(|e| panic!("{e}"));
        let g = &figs[0].canvas;
        check_gantt(g, &tl);
        let k = gantt::px_per_s(&tl);
        // One prefill and one decode per stage; each stage's prefill starts after the
        // previous stage's and the hop; the last prefill ends at TTFT.
        let mut pre: Vec<(f64, f64, f64, f64)> = g.rects("prefill").map(bounds).collect();
        pre.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert_eq!(pre.len(), t.pp);
        assert_eq!(g.rects("decode").count(), t.pp);
        for w in pre.windows(2) {
            assert!(close(w[1].0 - (w[0].0 + w[0].2), t.hop_prefill_s * k, 1e-6) || t.pp == 1);
        }
        let last = pre.last().expect("a prefill");
        assert!(close(last.0 + last.2 - gantt::LEFT, t.ttft_s * k, 1e-9));
        // The plan's prediction priced the standard layout; the timeline the layout the
        // programs were lowered with (see the issue note): the same times within 1%.
        let ttft = plan.predicted["ttft_s"].as_f64().expect("ttft");
        assert!(close(t.ttft_s, ttft, 0.01), "{} vs {ttft}", t.ttft_s);
        check_memory(
            &figs[1].canvas,
            &tl.stage_memory(),
            tl.memory_capacity_bytes(),
        );
        assert_eq!(figs[1].canvas.rects("mem-kv-cache").count(), t.pp);
        assert_eq!(axis_class(&figs[2].canvas, "tp"), "axis-nvlink");
        let trace = plan_trace(&plan).unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<&str> = trace
            .trace_events
            .iter()
            .filter(|e| e.ph == "X" && e.cat == "compute")
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(names.iter().filter(|n| **n == "prefill").count(), t.pp);
        for f in &figs {
            let svg = f.canvas.to_svg();
            eprintln!(
                "llama3-70b-inference {:?}: {}.svg {} bytes",
                fixed,
                f.name,
                svg.len()
            );
            assert!(svg.len() < MB);
        }
    }
}

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meshplan-draw-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn plan_figures_trace_and_draw_through_the_binary() {
    let dir = out_dir("cli");
    std::fs::create_dir_all(&dir).expect("dir");
    let plan = dir.join("plan.json");
    let figs = dir.join("figs");
    let trace = dir.join("trace.json");
    let s = |p: &Path| p.display().to_string();
    meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "dp=2,tp=2,pp=2",
        "-o",
        &s(&plan),
        "--figures",
        &s(&figs),
        "--trace",
        &s(&trace),
    ])
    .expect_code(0);
    for f in ["pipeline.svg", "memory.svg", "mesh.svg"] {
        let text = std::fs::read_to_string(figs.join(f)).expect("a figure");
        assert!(text.starts_with("<svg"));
    }
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).expect("trace")).expect("json");
    assert!(t["traceEvents"].as_array().is_some_and(|v| !v.is_empty()));

    // draw: the same pictures from the file, as PNG.
    let png = dir.join("png");
    meshplan(&["draw", &s(&plan), "-o", &s(&png), "--png"]).expect_code(0);
    for f in ["pipeline.png", "memory.png", "mesh.png"] {
        let bytes = std::fs::read(png.join(f)).expect("a png");
        assert_eq!(&bytes[1..4], b"PNG");
    }
    let svg = dir.join("svg");
    meshplan(&["draw", &s(&plan), "-o", &s(&svg)]).expect_code(0);
    assert_eq!(
        std::fs::read(svg.join("pipeline.svg")).expect("svg"),
        std::fs::read(figs.join("pipeline.svg")).expect("svg"),
        "draw and plan --figures draw the same picture"
    );

    // compare --figures.
    let cmp = dir.join("cmp");
    meshplan(&[
        "compare",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "dp=2,tp=2,pp=2",
        "--figures",
        &s(&cmp),
    ])
    .expect_code(0);
    let text = std::fs::read_to_string(cmp.join("compare.svg")).expect("compare.svg");
    assert!(text.contains("cmp-compute"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_to_draw_exits_2_naming_the_file_and_the_fix() {
    let missing = meshplan(&["draw", "no/such/plan.json", "-o", "/tmp/x"]);
    missing.expect_code(2).stderr_has(&["no/such/plan.json"]);
    let not_plan = temp_file("not-a-plan.json", "{\"hello\": 1}");
    meshplan(&["draw", &not_plan.display().to_string()])
        .expect_code(2)
        .stderr_has(&["not-a-plan.json", "not a plan file", "meshplan plan"]);

    // A plan without its timeline (an older file): names the field and the fix.
    let mut plan = tiny_plan();
    if let serde_json::Value::Object(m) = &mut plan.predicted {
        m.remove("timeline");
    }
    let old = temp_file("old-plan.json", &plan.to_json_pretty().expect("json"));
    meshplan(&["draw", &old.display().to_string()])
        .expect_code(2)
        .stderr_has(&[
            "old-plan.json",
            "predicted.timeline",
            "re-run `meshplan plan`",
        ]);

    // A timeline whose lists do not match its stages.
    let mut plan = tiny_plan();
    plan.predicted["timeline"]["forward_s"] = serde_json::json!([1.0]);
    let bad = temp_file("bad-timeline.json", &plan.to_json_pretty().expect("json"));
    meshplan(&["draw", &bad.display().to_string()])
        .expect_code(2)
        .stderr_has(&["bad-timeline.json", "forward_s"]);

    // --figures naming a file, before any search runs.
    let file = temp_file("a-file", "x");
    meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--figures",
        &file.display().to_string(),
    ])
    .expect_code(2)
    .stderr_has(&["--figures", "a-file", "directory"]);
    meshplan(&[
        "draw",
        &old.display().to_string(),
        "--trace",
        "/no/such/dir/trace.json",
    ])
    .expect_code(2)
    .stderr_has(&["--trace", "/no/such/dir"]);
}

#[test]
fn mesh_map_links_follow_the_node_boundary() {
    let desc = |shape: [u64; 4], gpn: u64| mesh::MeshDesc {
        axes: ["pp", "dp", "cp", "tp"].map(String::from).to_vec(),
        shape: shape.to_vec(),
        gpus_per_node: gpn,
        nodes: shape.iter().product::<u64>().div_ceil(gpn),
        title: "t".into(),
    };
    // tp = 16 on 8-GPU nodes crosses InfiniBand; tp = 2, dp = 4 fit in one node.
    let c = mesh::mesh_map(&desc([1, 2, 1, 16], 8));
    assert_eq!(axis_class(&c, "tp"), "axis-ib");
    let c = mesh::mesh_map(&desc([2, 4, 1, 2], 8));
    assert_eq!(axis_class(&c, "tp"), "axis-nvlink");
    assert_eq!(axis_class(&c, "dp"), "axis-nvlink");
    assert_eq!(axis_class(&c, "pp"), "axis-ib");
    assert_eq!(axis_class(&c, "cp"), "axis-unused");
    // Node 0 outlines its four tp pairs; two nodes, one per stage.
    assert_eq!(c.rects("group-tp").count(), 4);
    assert_eq!(c.rects("node").count(), 2);
    // Two stages in one node: the node is drawn GPU by GPU.
    let c = mesh::mesh_map(&desc([2, 1, 1, 4], 8));
    let stripes: Vec<usize> = c.rects("gpu-stripe").map(stage_of).collect();
    assert_eq!(stripes, [0, 0, 0, 0, 1, 1, 1, 1]);
}

#[test]
fn the_gantt_lane_of_a_stage_holds_its_sends() {
    let mut t = hand_train();
    t.step_s = 100.0;
    let tl = Timeline::Train(t);
    let spans = tl.spans();
    let sends = spans.iter().filter(|s| s.lane == Lane::P2p).count();
    let c = gantt::gantt(&tl, "t");
    assert_eq!(c.rects("p2p").count(), sends);
}
