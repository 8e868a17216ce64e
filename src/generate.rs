//! `run` on an inference plan: prompts in, tokens out, TTFT / TPOT / tokens per
//! second measured beside the plan's prediction, and `--check` against one rank.

use crate::run::{bad, failure, predicted, predicted_memory, reference_plan, runtime, RunArgs};
use crate::{print_json, Failure};
use clap::Args;
use meshplan_executor::disagg::{self, DisaggReport};
use meshplan_executor::engine::Engine;
use meshplan_executor::infer::{
    byte_mismatches, check_inference, infer, InferOptions, InferReport,
};
use meshplan_executor::init::synthetic_sequence;
use meshplan_executor::sample::Sampling;
use meshplan_executor::tokenize::TextTokenizer;
use meshplan_ir::plan::Plan;
use meshplan_ir::Workload;
use std::path::PathBuf;

/// Prompts and sampling of `run` on an inference plan.
#[derive(Args, Clone, Debug, Default)]
pub(crate) struct GenerateFlags {
    /// Prompt token ids, e.g. `1,15,42`; repeat the flag for a batch of requests.
    #[arg(long = "prompt-ids", value_name = "IDS")]
    prompt_ids: Vec<String>,
    /// A text prompt (needs the checkpoint's tokenizer.json); repeat for a batch.
    #[arg(long, value_name = "TEXT")]
    prompt: Vec<String>,
    /// A file with one request per line: text with a tokenizer, else token ids.
    #[arg(long = "prompt-file", value_name = "FILE")]
    prompt_file: Option<PathBuf>,
    /// Tokens to generate per request (default: the plan's output_len).
    #[arg(long = "max-new-tokens", value_name = "N")]
    max_new_tokens: Option<usize>,
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    #[arg(long = "top-p", default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampling draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Generate --max-new-tokens for every request even past the checkpoint's
    /// end-of-sequence token (`eos_token_id`), as a benchmark does.
    #[arg(long = "ignore-eos")]
    ignore_eos: bool,
    /// With --json: every request's logits at every step (`requests[i].step_logits`),
    /// not only the first request's last.
    #[arg(long = "step-logits")]
    step_logits: bool,
}

impl GenerateFlags {
    /// Whether any generation flag was given (they mean nothing to a training plan).
    pub(crate) fn any_given(&self) -> bool {
        !self.prompt_ids.is_empty()
            || !self.prompt.is_empty()
            || self.prompt_file.is_some()
            || self.max_new_tokens.is_some()
            || self.temperature != 0.0
            || self.top_p != 1.0
            || self.seed != 0
            || self.ignore_eos
            || self.step_logits
    }
}

fn parse_ids(text: &str, what: &str) -> Result<Vec<u32>, Failure> {
    let ids: Result<Vec<u32>, _> = text
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>())
        .collect();
    match ids {
        Ok(v) if !v.is_empty() => Ok(v),
        Ok(_) => Err(bad(format!("{what}: no token id; expected e.g. 1,15,42"))),
        Err(e) => Err(bad(format!(
            "{what}: `{text}` is not a list of token ids ({e}); expected e.g. 1,15,42"
        ))),
    }
}

/// The requests the flags give, or the plan's own workload (its concurrency of
/// synthetic prompts of `prompt_len` tokens).
fn requests(
    plan: &Plan,
    flags: &GenerateFlags,
    tok: Option<&TextTokenizer>,
) -> Result<Vec<Vec<u32>>, Failure> {
    let mut out = Vec::new();
    for (i, ids) in flags.prompt_ids.iter().enumerate() {
        out.push(parse_ids(ids, &format!("--prompt-ids #{}", i + 1))?);
    }
    let need_tok = |what: &str| {
        bad(format!(
            "{what} needs a tokenizer: give --weights DIR holding tokenizer.json, or token ids with --prompt-ids"
        ))
    };
    for text in &flags.prompt {
        let t = tok.ok_or_else(|| need_tok("--prompt"))?;
        out.push(t.encode(text).map_err(bad)?);
    }
    if let Some(path) = &flags.prompt_file {
        let file = path.display().to_string();
        let text = meshplan_ir::load::read_text(path).map_err(|e| bad(e.to_string()))?;
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            out.push(match tok {
                Some(t) => t
                    .encode(line)
                    .map_err(|e| bad(format!("{file}:{}: {e}", n + 1)))?,
                None => parse_ids(
                    line,
                    &format!("{file}:{} (no tokenizer.json, so token ids)", n + 1),
                )?,
            });
        }
        // Else the plan's synthetic prompts would run in their place, unsaid.
        if out.is_empty() {
            return Err(bad(format!(
                "{file}: no request (every line is blank); give one prompt per line"
            )));
        }
    }
    if out.is_empty() {
        if let Workload::Inference {
            prompt_len,
            concurrency,
            ..
        } = &plan.workload
        {
            // The tokens, not the table's rows: a padded row is no token.
            let vocab = plan.graph.vocab().unwrap_or(2);
            for i in 0..*concurrency {
                let mut s = synthetic_sequence(7, 0, i, *prompt_len as usize, vocab);
                s.truncate(*prompt_len as usize);
                out.push(s);
            }
        }
    }
    Ok(out)
}

/// `meshplan run PLAN` on an inference plan.
pub(crate) fn run(
    a: &RunArgs<'_>,
    plan: &Plan,
    file: &str,
    engine: meshplan_executor::engine::Engine,
) -> Result<(), Failure> {
    let flags = a.generate;
    let checkpoint = match a.weights {
        Some(dir) => Some(crate::run::hf_weights(dir, plan)?),
        None => None,
    };
    let tok = match a.weights {
        Some(dir) => TextTokenizer::from_dir(dir).map_err(bad)?,
        None => None,
    };
    let requests = requests(plan, flags, tok.as_ref())?;
    let output_len = match &plan.workload {
        Workload::Inference { output_len, .. } => *output_len as usize,
        Workload::Train { .. } => 1,
    };
    // A disaggregated deployment runs both pools: the prefill pool's ranks, then
    // the decode pool's (the plan's own).
    let pools = disagg::pools(plan).map_err(|m| bad(format!("{file}: {m}")))?;
    let pool_plans: Vec<&Plan> = match pools {
        Some((prefill, decode)) => vec![prefill, decode],
        None => vec![plan],
    };
    let ranks: usize = pool_plans.iter().map(|p| p.ranks.len()).sum();
    // Ranks are threads of this process, each holding its fp32 weights.
    let host_bytes: f64 = pool_plans
        .iter()
        .map(|p| {
            let s = &p.strategy;
            let replicas = (p.ranks.len() as f64 / (s.tp * s.pp).max(1) as f64).max(1.0);
            4.0 * p.model.params * replicas
        })
        .sum();
    const HOST_BUDGET: f64 = 16.0 * (1u64 << 30) as f64;
    if engine.on_host() && (host_bytes > HOST_BUDGET || ranks > 256) {
        return Err(runtime(format!(
            "{file}: the CPU backend runs every rank as a thread of this process; {ranks} ranks holding {:.1} GiB of fp32 weights exceed its {:.0} GiB budget",
            host_bytes / (1u64 << 30) as f64,
            HOST_BUDGET / (1u64 << 30) as f64
        )));
    }
    if flags.step_logits && !a.json {
        return Err(bad(
            "--step-logits adds every step's logits to the --json output; give --json too".into(),
        ));
    }
    let opts = InferOptions {
        requests,
        max_new_tokens: flags.max_new_tokens.unwrap_or(output_len),
        sampling: Sampling {
            temperature: flags.temperature,
            top_p: flags.top_p,
            seed: flags.seed,
        },
        eos: match &checkpoint {
            Some(ck) if !flags.ignore_eos => ck.eos_tokens().map_err(|e| bad(e.to_string()))?,
            _ => Vec::new(),
        },
        weights: checkpoint,
        threads_per_rank: crate::run::threads_per_rank(a.threads, ranks)?,
        step_logits: flags.step_logits,
        ..InferOptions::default()
    };
    if pools.is_some() {
        return run_disaggregated(a, (engine, plan, ranks), file, &opts, tok.as_ref());
    }
    meshplan_executor::infer::check_inputs(plan, &opts).map_err(|m| bad(format!("{file}: {m}")))?;
    let report =
        shown_progress((plan, ranks, engine), &opts, |o| engine.infer(plan, o)).map_err(failure)?;
    let check = checked(a.check, engine, plan, &opts, &report)?;
    let bytes = byte_mismatches(plan, &opts, &report);
    let shown = Shown {
        check: check.as_ref(),
        bytes: bytes.as_deref(),
        disagg: None,
    };
    print_report(plan, &report, tok.as_ref(), &shown, a.json);
    verdict(a.check, &shown)
}

/// `run` on a disaggregated deployment: both pools as one world (`ranks` in
/// all), the KV caches moving from the prefill ranks to the decode ranks.
fn run_disaggregated(
    a: &RunArgs<'_>,
    (engine, plan, ranks): (Engine, &Plan, usize),
    file: &str,
    opts: &InferOptions,
    tok: Option<&TextTokenizer>,
) -> Result<(), Failure> {
    disagg::check_disaggregated(plan, opts).map_err(|m| bad(format!("{file}: {m}")))?;
    let run = shown_progress((plan, ranks, engine), opts, |o| {
        engine.infer_disaggregated(plan, o)
    })
    .map_err(failure)?;
    let check = checked(a.check, engine, plan, opts, &run.report)?;
    let bytes = disagg::byte_mismatches(plan, opts, &run);
    let shown = Shown {
        check: check.as_ref(),
        bytes: bytes.as_deref(),
        disagg: Some(&run),
    };
    print_report(plan, &run.report, tok, &shown, a.json);
    verdict(a.check, &shown)
}

/// Runs `generate` with `opts` and a progress bar of the tokens generated, after
/// saying what it generates. The reference of `--check` runs without them.
fn shown_progress<T>(
    (plan, ranks, engine): (&Plan, usize, Engine),
    opts: &InferOptions,
    generate: impl FnOnce(&InferOptions) -> T,
) -> T {
    let n = opts.requests.len();
    tracing::info!(
        "generating up to {} tokens for each of {n} request{} of {} on {ranks} ranks ({})",
        opts.max_new_tokens,
        if n == 1 { "" } else { "s" },
        plan.model.name,
        engine.describe()
    );
    let (bar, hook) = crate::log::bar_with_hook(
        opts.max_new_tokens as u64,
        format!("generating {}", plan.model.name),
    );
    let opts = InferOptions {
        on_token: Some(hook),
        ..opts.clone()
    };
    let out = generate(&opts);
    bar.finish_and_clear();
    out
}

/// `--check`'s verdict: its line and the largest logit difference, or why it
/// failed.
type Verdict = Result<(String, f64), String>;

/// `--check`'s verdict: the fp32 CPU run must match the single-rank run to
/// rounding; a bf16 one to the mixed-precision tolerance on the prompt's logits.
fn checked(
    check: bool,
    engine: Engine,
    plan: &Plan,
    opts: &InferOptions,
    report: &InferReport,
) -> Result<Option<Verdict>, Failure> {
    if !check {
        return Ok(None);
    }
    let base = reference(plan, opts)?;
    Ok(Some(match engine {
        Engine::Cpu => check_inference(report, &base),
        _ => meshplan_executor::infer::check_inference_mixed(report, &base),
    }))
}

/// The single-rank run of the same requests (`--check`).
fn reference(plan: &Plan, opts: &InferOptions) -> Result<InferReport, Failure> {
    let reference = reference_plan(plan).map_err(runtime)?;
    infer(
        &reference,
        &InferOptions {
            threads_per_rank: crate::run::threads_per_rank(None, 1)?,
            ..opts.reference_of(plan)
        },
    )
    .map_err(|e| runtime(format!("reference: {e}")))
}

/// What a run is reported with besides its own figures.
struct Shown<'a> {
    /// `--check`'s verdict against the single-rank run.
    check: Option<&'a Verdict>,
    /// Differences from the plan's bytes (`None`: not compared).
    bytes: Option<&'a [String]>,
    /// The pools of a disaggregated run.
    disagg: Option<&'a DisaggReport>,
}

/// Exit 1 when the run differs from the reference or, under `--check`, from the
/// plan's bytes.
fn verdict(check: bool, shown: &Shown<'_>) -> Result<(), Failure> {
    if let Some(Err(why)) = shown.check {
        return Err(runtime(format!(
            "the run differs from the single-rank reference:\n{why}"
        )));
    }
    if let (true, Some(b)) = (check, shown.bytes) {
        if !b.is_empty() {
            return Err(runtime(format!(
                "measured communication differs from the plan:\n{}",
                b.join("\n")
            )));
        }
    }
    Ok(())
}

/// A disaggregated run's pools and KV move, as `--json` keys.
fn disagg_json(plan: &Plan, d: &DisaggReport) -> serde_json::Value {
    let serving = plan.serving.as_ref();
    let prefill = disagg::prefill_pool(plan);
    let pool = |p: Option<&Plan>, ranks: usize| {
        serde_json::json!({
            "ranks": ranks,
            "strategy": p.map(|p| p.strategy.to_string()),
        })
    };
    let np = d.prefill_ranks;
    serde_json::json!({
        "kv_transfer_bytes": d.kv_transfer_bytes(),
        "kv_sent_bytes_per_rank": d.report.counts[..np]
            .iter()
            .map(|c| c.axis_bytes_sent(disagg::KV_AXIS))
            .collect::<Vec<_>>(),
        "kv_received_bytes_per_rank": &d.kv_received[np..],
        "kv_transfer_bytes_per_request_planned": serving
            .and_then(|s| s.kv_transfer.as_ref())
            .map(|k| k.bytes_per_request),
        "pools": {
            "prefill": pool(prefill, d.prefill_ranks),
            "decode": pool(Some(plan), d.report.counts.len() - d.prefill_ranks),
        },
    })
}

fn print_report(
    plan: &Plan,
    r: &InferReport,
    tok: Option<&TextTokenizer>,
    shown: &Shown<'_>,
    json: bool,
) {
    let (check, bytes) = (shown.check, shown.bytes);
    let text = |ids: &[u32]| tok.and_then(|t| t.decode(ids).ok());
    let comm: serde_json::Map<String, serde_json::Value> = {
        let mut m = serde_json::Map::new();
        for c in &r.counts {
            for (axis, b) in c.per_axis() {
                let e = m.entry(axis).or_insert(serde_json::json!(0.0));
                let prev = e.as_f64().unwrap_or(0.0);
                *e = serde_json::json!(prev.max(b));
            }
        }
        m
    };
    if json {
        let first = r.requests.first();
        let mut out = serde_json::json!({
            "tokens": first.map(|q| q.tokens.clone()).unwrap_or_default(),
            "text": first.and_then(|q| text(&q.tokens)),
            "logits": first.map(|q| q.logits.clone()).unwrap_or_default(),
            "requests": r.requests.iter().map(|q| {
                let mut o = serde_json::json!({
                    "prompt_len": q.prompt_len,
                    "tokens": q.tokens,
                    "text": text(&q.tokens),
                    "finish_reason": if q.ended_at_eos { "eos" } else { "length" },
                    "ttft_s": q.ttft_s,
                    "tpot_s": q.tpot_s,
                });
                if !q.step_logits.is_empty() {
                    o["step_logits"] = serde_json::json!(q.step_logits);
                }
                o
            }).collect::<Vec<_>>(),
            "ttft_s": r.ttft_s,
            "tpot_s": r.tpot_s,
            "output_tokens_per_s": r.output_tokens_per_s,
            "wall_s": r.wall_s,
            "predicted_ttft_s": predicted(plan, "ttft_s"),
            "predicted_tpot_s": predicted(plan, "tpot_s"),
            "predicted_output_tokens_per_s": predicted(plan, "output_tokens_per_s"),
            "measured": {
                "kv_cache_bytes": r.kv_cache_bytes,
                "weight_bytes": r.weight_bytes,
                "comm_bytes_per_gpu": comm,
            },
            "predicted": plan.predicted,
            "bytes_match_plan": bytes.map(|b| b.is_empty()),
            "byte_mismatches": bytes,
            "check": check.map(|c| match c {
                Ok((line, worst)) => serde_json::json!({"passed": true, "details": line, "max_abs_logit_diff": worst}),
                Err(why) => serde_json::json!({"passed": false, "details": why}),
            }),
        });
        if let (Some(d), Some(o)) = (shown.disagg, out.as_object_mut()) {
            if let serde_json::Value::Object(extra) = disagg_json(plan, d) {
                o.extend(extra);
            }
        }
        print_json(&out);
        return;
    }
    match shown
        .disagg
        .and_then(|d| Some((d, disagg::pools(plan).ok()??.0)))
    {
        Some((d, prefill)) => println!(
            "{} on {} prefill ranks ({}) and {} decode ranks ({}), {} requests",
            plan.model.name,
            d.prefill_ranks,
            prefill.strategy,
            plan.ranks.len(),
            plan.strategy,
            r.requests.len()
        ),
        None => println!(
            "{} on {} ranks ({}), {} requests",
            plan.model.name,
            plan.ranks.len(),
            plan.strategy,
            r.requests.len()
        ),
    }
    for (i, q) in r.requests.iter().enumerate() {
        let shown = match text(&q.tokens) {
            Some(t) => format!("{t:?}"),
            None => format!("{:?}", q.tokens),
        };
        println!(
            "request {i}: {} prompt tokens -> {shown}  (TTFT {:.2} ms, TPOT {:.2} ms)",
            q.prompt_len,
            q.ttft_s * 1e3,
            q.tpot_s * 1e3
        );
    }
    println!(
        "TTFT         measured {:.3} ms (mean), predicted {:.3} ms for the plan's cluster ({})",
        r.ttft_s * 1e3,
        predicted(plan, "ttft_s") * 1e3,
        plan.cluster.gpu
    );
    println!(
        "TPOT         measured {:.3} ms (mean), predicted {:.3} ms",
        r.tpot_s * 1e3,
        predicted(plan, "tpot_s") * 1e3
    );
    println!(
        "output       measured {:.0} tokens/s, predicted {:.0} tokens/s",
        r.output_tokens_per_s,
        predicted(plan, "output_tokens_per_s")
    );
    // Measured in the engine's compute precision (fp32 on the CPU), predicted in
    // the plan's; the prediction's runtime workspace (CUDA context, library
    // buffers) is shown apart, as the run allocates none of it on the CPU.
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let part = |key: &str| predicted_memory(plan, key);
    println!(
        "memory       fullest rank: weights {:.3} MiB, KV cache {:.3} MiB (at the engine's compute precision); predicted per GPU: weights {:.3} MiB, KV cache {:.3} MiB ({}), activations {:.3} MiB, runtime workspace {:.3} MiB",
        mib(r.weight_bytes),
        mib(r.kv_cache_bytes),
        mib(part("params")),
        mib(part("kv_cache")),
        plan.model.dtype,
        mib(part("activations")),
        mib(part("workspace"))
    );
    if let Some(d) = shown.disagg {
        println!(
            "KV moved     {:.0} bytes from the prefill pool to the decode pool ({} requests)",
            d.kv_transfer_bytes(),
            r.requests.len()
        );
    }
    if let Some(line) = meshplan_executor::infer::routed_ep_summary(r) {
        println!("routed bytes {line}");
    }
    match bytes {
        Some([]) => println!("comm bytes   equal to the plan's on every rank and axis"),
        Some(b) => println!("comm bytes   differ from the plan:\n  {}", b.join("\n  ")),
        None => println!("comm bytes   not compared (the prompts are not the plan's workload)"),
    }
    match check {
        Some(Ok((line, _))) => println!("check        passed: {line}"),
        Some(Err(_)) => println!("check        FAILED (details on stderr)"),
        None => {}
    }
}
