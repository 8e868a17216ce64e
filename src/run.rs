//! `run`: execute a plan on the CPU backend (ranks as threads), report measured beside
//! predicted, and with `--check` compare with the single-rank run.

use crate::{print_json, Failure};
use meshplan_cost_model::estimate::gib;
use meshplan_cost_model::{parse_cluster_yaml, PreparedGraph};
use meshplan_executor::data::{DataSource, Sampler, TokenFile};
use meshplan_executor::train::{byte_mismatches, check_against, train, TrainOptions, TrainReport};
use meshplan_ir::plan::{Plan, PlanKind};
use meshplan_ir::{ParallelConfig, PartialConfig};
use meshplan_planner::output::plan_for_config;
use std::path::Path;

/// The flags of `run`.
pub(crate) struct RunArgs<'a> {
    pub plan: &'a Path,
    pub backend: &'a str,
    pub steps: u64,
    pub check: bool,
    pub json: bool,
    pub data: Option<&'a Path>,
    pub trace: Option<&'a Path>,
    pub unsupported: Vec<&'static str>,
    /// A checkpoint (inference plans).
    pub weights: Option<&'a Path>,
    /// Prompts and sampling (inference plans).
    pub generate: &'a crate::generate::GenerateFlags,
}

pub(crate) fn bad(message: String) -> Failure {
    Failure { code: 2, message }
}

pub(crate) fn runtime(message: String) -> Failure {
    Failure { code: 1, message }
}

/// The single-rank reference of a training plan: same model, data, seed and
/// micro-batch size, one GPU, no parallelism.
pub(crate) fn reference_plan(plan: &Plan) -> Result<Plan, String> {
    let yaml = format!(
        "name: reference\nnodes: 1\ngpus_per_node: 1\ngpu:\n  name: reference\n  memory_gib: {}\n  peak_tflops: {{bf16: 1, fp32: 1}}\n  hbm_gbps: 1\nintra_node:\n  link: none\n  bandwidth_gbps: 1\n  latency_us: 1\n",
        (plan.cluster.gpu_memory_bytes / (1u64 << 30) as f64).max(1.0)
    );
    let cluster =
        parse_cluster_yaml(&yaml, "reference cluster", None).map_err(|e| e.to_string())?;
    let cfg: ParallelConfig =
        PartialConfig::parse(&format!("dp=1,mbs={}", plan.strategy.mbs), "reference")
            .and_then(|p| p.resolve(1, "reference"))
            .map_err(|e| e.to_string())?;
    // The builder's standard roles: with one rank every layout is the same math.
    let mut graph = plan.graph.clone();
    for seg in &mut graph.segments {
        for op in &mut seg.ops {
            op.role = meshplan_ir::TpRole::Replicated;
        }
    }
    let pg = PreparedGraph::new(&graph);
    plan_for_config(
        &plan.model.name,
        &graph,
        &pg,
        &cluster,
        &plan.workload,
        &cfg,
    )
}

/// `meshplan run`.
pub(crate) fn run(a: &RunArgs<'_>) -> Result<(), Failure> {
    if let Some(flag) = a.unsupported.first() {
        return Err(bad(format!(
            "{flag} is not supported yet by `run` (it arrives with real weights, data and traces); run without it"
        )));
    }
    match a.backend {
        "cpu" => {}
        "cuda" => {
            return Err(runtime(
                "--backend cuda: this build has no CUDA backend yet (it arrives with the CUDA issue); use --backend cpu".into(),
            ))
        }
        other => return Err(bad(format!("--backend {other}: expected cpu or cuda"))),
    }
    let file = a.plan.display().to_string();
    let text = std::fs::read_to_string(a.plan).map_err(|e| bad(format!("{file}: {e}")))?;
    let plan = Plan::from_json(&text).map_err(|e| {
        bad(format!(
            "{file}: not a plan written by `meshplan plan`: {e}"
        ))
    })?;
    if plan.kind == PlanKind::Inference {
        if a.data.is_some() || a.trace.is_some() {
            return Err(bad(format!(
                "{file}: --data and --trace are read for training plans; this is an inference plan (give prompts with --prompt-ids, --prompt or --prompt-file)"
            )));
        }
        return crate::generate::run(a, &plan, &file);
    }
    if a.generate.any_given() {
        return Err(bad(format!(
            "{file}: prompts and sampling flags are for inference plans; this is a training plan"
        )));
    }
    if a.weights.is_some() {
        return Err(bad(
            "--weights is read for inference plans; training from a checkpoint is not supported yet (run without it)".into(),
        ));
    }
    // Ranks are threads of this process holding fp32 weights, gradients and Adam
    // state: refuse what cannot fit rather than exhausting the machine.
    let s = &plan.strategy;
    let replicas = (plan.ranks.len() as f64 / (s.tp * s.pp).max(1) as f64).max(1.0);
    let host_bytes = 16.0 * plan.model.params * replicas;
    const HOST_BUDGET: f64 = 16.0 * (1u64 << 30) as f64;
    if host_bytes > HOST_BUDGET || plan.ranks.len() > 256 {
        return Err(runtime(format!(
            "{file}: the CPU backend runs every rank as a thread of this process; {} ranks holding {:.1} GiB of fp32 weights, gradients and Adam state exceed its {:.0} GiB budget (use a small model, e.g. models/tiny-gpt.yaml on topologies/cpu-test-mesh.yaml)",
            plan.ranks.len(),
            host_bytes / (1u64 << 30) as f64,
            HOST_BUDGET / (1u64 << 30) as f64
        )));
    }
    if a.steps == 0 {
        return Err(bad("--steps must be at least 1".into()));
    }
    let data = match a.data {
        None => DataSource::Synthetic,
        Some(path) => {
            let vocab = plan.graph.vocab().unwrap_or(u64::MAX);
            let file = TokenFile::open(path, vocab).map_err(|e| bad(e.message))?;
            let (seq, gb) = match plan.workload {
                meshplan_ir::Workload::Train {
                    seq_len,
                    global_batch,
                    ..
                } => (seq_len as usize, global_batch),
                _ => (0, 0),
            };
            Sampler::new(file.len(), seq, gb, TrainOptions::default().seed)
                .map_err(|m| bad(format!("{}: {m}", path.display())))?;
            DataSource::File {
                file: std::sync::Arc::new(file),
            }
        }
    };
    let opts = TrainOptions {
        steps: a.steps,
        data,
        trace: a.trace.is_some(),
        ..TrainOptions::default()
    };
    let report = train(&plan, &opts).map_err(|e| runtime(e.message))?;
    if let Some(path) = a.trace {
        let spans: Vec<_> = report
            .ranks
            .iter()
            .map(|r| (r.rank, r.spans.clone()))
            .collect();
        let text = meshplan_executor::trace::chrome_trace(&plan, &spans).to_json();
        crate::plan::write_atomically(path, text.as_bytes(), "trace")?;
        eprintln!(
            "trace written to {} ({} spans; open in https://ui.perfetto.dev)",
            path.display(),
            spans.iter().map(|(_, s)| s.len()).sum::<usize>()
        );
    }
    let bytes = byte_mismatches(&plan, &report, a.steps);
    let check = if a.check {
        let reference = reference_plan(&plan).map_err(runtime)?;
        let base = train(&reference, &opts.reference_of(&plan))
            .map_err(|e| runtime(format!("reference: {}", e.message)))?;
        Some(check_against(&plan, &report, &base, 1e-5))
    } else {
        None
    };
    print_report(&plan, &report, &bytes, check.as_ref(), a.json);
    if let Some(Err(why)) = &check {
        return Err(runtime(format!(
            "the run differs from the single-rank reference:\n{why}"
        )));
    }
    // Dropless expert-parallel bytes follow the router's choices; the plan prices
    // balanced routing, so on that axis a difference is reported, not failed. Under
    // an expert capacity the buffers are padded and must match like every axis.
    let dropless = plan.graph.dropless_experts();
    let (routed, exact): (Vec<&String>, Vec<&String>) =
        bytes.iter().partition(|m| dropless && m.contains(" ep: "));
    if !routed.is_empty() {
        eprintln!(
            "note: expert-parallel bytes depend on the routing; the plan assumes balanced experts:\n  {}",
            routed.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n  ")
        );
    }
    if a.check && !exact.is_empty() {
        return Err(runtime(format!(
            "measured communication differs from the plan:\n{}",
            exact
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        )));
    }
    Ok(())
}

fn print_report(
    plan: &Plan,
    r: &TrainReport,
    bytes: &[String],
    check: Option<&Result<Vec<String>, String>>,
    json: bool,
) {
    let predicted_step = plan
        .predicted
        .get("step_time_s")
        .and_then(|v| v.as_f64())
        .unwrap_or(f64::NAN);
    let predicted_mem = plan
        .predicted
        .pointer("/memory_per_gpu_bytes/total")
        .and_then(|v| v.as_f64())
        .unwrap_or(f64::NAN);
    let median = {
        let mut s = r.step_s.clone();
        s.sort_by(f64::total_cmp);
        s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let worst = r.ranks.iter().max_by(|a, b| {
        (a.state_bytes + a.peak_activation_bytes)
            .total_cmp(&(b.state_bytes + b.peak_activation_bytes))
    });
    let (measured_states, measured_acts) =
        worst.map_or((0.0, 0.0), |w| (w.state_bytes, w.peak_activation_bytes));
    let measured_mem = measured_states + measured_acts;
    let (slots, dropped) = r.ranks.iter().fold((0u64, 0u64), |a, k| {
        (a.0 + k.expert_slots.0, a.1 + k.expert_slots.1)
    });
    let mut per_axis = serde_json::Map::new();
    for rank in &r.ranks {
        for (axis, b) in rank.counts.per_axis() {
            let e = per_axis.entry(axis).or_insert(serde_json::json!(0.0));
            let prev = e.as_f64().unwrap_or(0.0);
            *e = serde_json::json!(prev.max(b / r.step_s.len() as f64));
        }
    }
    if json {
        print_json(&serde_json::json!({
            "steps": r.losses.iter().zip(&r.step_s).enumerate().map(|(i, (l, s))| serde_json::json!({
                "step": i,
                "loss": l,
                "step_time_s": s,
                "tokens_per_s": r.tokens_per_step as f64 / s,
            })).collect::<Vec<_>>(),
            "loss": r.losses,
            "measured": {
                "step_time_s": median,
                "tokens_per_s": r.tokens_per_step as f64 / median,
                "comm_bytes_per_gpu": per_axis,
                "expert_assignments": slots,
                "expert_assignments_dropped": dropped,
                "memory_per_gpu_bytes": {
                    "states": measured_states,
                    "activations": measured_acts,
                    "total": measured_mem,
                },
            },
            "predicted": plan.predicted,
            "bytes_match_plan": bytes.is_empty(),
            "byte_mismatches": bytes,
            "check": check.map(|c| match c {
                Ok(lines) => serde_json::json!({"passed": true, "details": lines}),
                Err(why) => serde_json::json!({"passed": false, "details": why}),
            }),
        }));
        return;
    }
    println!(
        "{} on {} ranks ({}), {} steps",
        plan.model.name,
        plan.ranks.len(),
        plan.strategy,
        r.losses.len()
    );
    for (i, (l, s)) in r.losses.iter().zip(&r.step_s).enumerate() {
        println!(
            "step {i:>3}  loss {l:.6}  {:.3} s  {:.0} tokens/s",
            s,
            r.tokens_per_step as f64 / s
        );
    }
    println!(
        "step time    measured {median:.4} s (median), predicted {predicted_step:.4} s for the plan's cluster ({})",
        plan.cluster.gpu
    );
    println!(
        "memory       measured {:.4} GiB (states {:.4} + activations {:.4}, fullest rank), predicted {:.4} GiB per GPU",
        gib(measured_mem),
        gib(measured_states),
        gib(measured_acts),
        gib(predicted_mem)
    );
    if slots > 0 {
        println!(
            "experts      {dropped} of {slots} token-expert assignments over capacity ({:.2}%)",
            100.0 * dropped as f64 / slots as f64
        );
    }
    if bytes.is_empty() {
        println!("comm bytes   equal to the plan's on every rank and axis");
    } else if bytes.iter().all(|m| m.contains(" ep: ")) {
        println!(
            "comm bytes   equal to the plan's on every axis but ep (routed tokens; see stderr)"
        );
    } else {
        println!(
            "comm bytes   differ from the plan:\n  {}",
            bytes.join("\n  ")
        );
    }
    match check {
        Some(Ok(lines)) => println!(
            "check        passed: {}",
            lines.last().cloned().unwrap_or_default()
        ),
        Some(Err(_)) => println!("check        FAILED (details on stderr)"),
        None => {}
    }
}
