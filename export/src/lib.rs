//! A plan as a framework's own configuration: Megatron-LM arguments, a torchtitan
//! TOML (0.2) or command line (0.3), a DeepSpeed JSON, SGLang and vLLM server flags.
//!
//! Exporters read only the [`Plan`]. Each one either writes everything the plan
//! chose in the framework's spelling, or refuses with [`CannotExpress`], naming
//! what the framework lacks and what approximating it would lose: an export that
//! silently runs a different configuration than the one priced would make the
//! prediction meaningless.
//!
//! A serving deployment (`meshplan deploy`: a plan with a `serving` section) exports
//! to SGLang and vLLM as launch commands, one per server of each pool, each pool's
//! through the same per-plan exporter as a plain plan (see `deploy`).

use meshplan_ir::plan::{Plan, PlanKind};
use meshplan_ir::spec::TransformerSpec;
use meshplan_ir::{DType, Workload};
use std::fmt;

mod deepspeed;
mod deploy;
mod megatron;
mod sglang;
mod torchtitan;
mod vllm;

/// A framework a plan can be exported to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Megatron-LM `pretrain_gpt.py` arguments.
    Megatron,
    /// torchtitan TOML job config (torchtitan 0.2 and earlier).
    Torchtitan,
    /// torchtitan command-line overrides (torchtitan 0.3, which reads no TOML).
    TorchtitanCli,
    /// DeepSpeed JSON config (ZeRO data parallelism).
    Deepspeed,
    /// SGLang `launch_server` flags.
    Sglang,
    /// vLLM `vllm serve` flags.
    Vllm,
}

impl Target {
    /// Every target, in the order the CLI lists them.
    pub const ALL: [Target; 6] = [
        Target::Megatron,
        Target::Torchtitan,
        Target::TorchtitanCli,
        Target::Deepspeed,
        Target::Sglang,
        Target::Vllm,
    ];

    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            Target::Megatron => "megatron",
            Target::Torchtitan => "torchtitan",
            Target::TorchtitanCli => "torchtitan-cli",
            Target::Deepspeed => "deepspeed",
            Target::Sglang => "sglang",
            Target::Vllm => "vllm",
        }
    }

    /// Parses the CLI spelling.
    pub fn parse(s: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == s)
    }

    fn trains(self) -> bool {
        matches!(
            self,
            Target::Megatron | Target::Torchtitan | Target::TorchtitanCli | Target::Deepspeed
        )
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The target cannot express the plan: what it lacks, and what approximating it
/// would lose.
#[derive(Clone, Debug, PartialEq)]
pub struct CannotExpress {
    /// The target.
    pub target: Target,
    /// One sentence per thing the target cannot express.
    pub reasons: Vec<String>,
}

impl fmt::Display for CannotExpress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot export this plan to {}: {}",
            self.target,
            self.reasons.join("; ")
        )
    }
}

impl std::error::Error for CannotExpress {}

/// The plan in the target's spelling: a command-line argument list (one option per
/// line, `#` comments), a TOML file or a JSON file.
pub fn export(plan: &Plan, target: Target) -> Result<String, CannotExpress> {
    let mut r = Refusals::new(target);
    match (target.trains(), plan.kind) {
        (true, PlanKind::Inference) => r.push(format!(
            "{target} trains models and this is an inference plan; export it --to sglang or --to vllm"
        )),
        (false, PlanKind::Train) => r.push(format!(
            "{target} serves models and this is a training plan; export it --to megatron, --to torchtitan or --to deepspeed"
        )),
        _ => {}
    }
    r.check()?;
    if plan.serving.is_some() && !target.trains() {
        return deploy::export(plan, target);
    }
    match target {
        Target::Megatron => megatron::export(plan),
        Target::Torchtitan | Target::TorchtitanCli => torchtitan::export(plan, target),
        Target::Deepspeed => deepspeed::export(plan),
        Target::Sglang => sglang::export(plan),
        Target::Vllm => vllm::export(plan),
    }
}

/// Collects every reason a target refuses, so one run names all of them.
struct Refusals {
    target: Target,
    reasons: Vec<String>,
}

impl Refusals {
    fn new(target: Target) -> Self {
        Refusals {
            target,
            reasons: Vec::new(),
        }
    }

    fn push(&mut self, reason: impl Into<String>) {
        self.reasons.push(reason.into());
    }

    fn check(self) -> Result<(), CannotExpress> {
        if self.reasons.is_empty() {
            Ok(())
        } else {
            Err(CannotExpress {
                target: self.target,
                reasons: self.reasons,
            })
        }
    }
}

/// The training workload: (sequence length, global batch).
fn train_shape(plan: &Plan) -> (u64, u64) {
    match &plan.workload {
        Workload::Train {
            seq_len,
            global_batch,
            ..
        } => (*seq_len, *global_batch),
        Workload::Inference { prompt_len, .. } => (*prompt_len, 1),
    }
}

/// The architecture, or the refusal every target that needs it gives.
fn transformer<'a>(plan: &'a Plan, r: &mut Refusals) -> Option<&'a TransformerSpec> {
    if plan.model.transformer.is_none() {
        r.push(format!(
            "the plan does not record the model's architecture (an explicit graph, or a plan written before `model.transformer` existed); re-plan model `{}` from its model file with this meshplan",
            plan.model.name
        ));
    }
    plan.model.transformer.as_ref()
}

/// The first line of every export: what plan it came from.
fn provenance(plan: &Plan, target: Target) -> String {
    format!(
        "meshplan export --to {target}: {} on {} x {} ({} GPUs), {}",
        plan.model.name,
        plan.cluster.nodes,
        plan.cluster.name,
        plan.cluster.nodes * plan.cluster.gpus_per_node,
        plan.strategy
    )
}

/// Whether every chunk holds the same number of layers.
fn even_split(plan: &Plan) -> bool {
    plan.layer_split.windows(2).all(|w| w[0] == w[1])
}

/// A predicted number from the plan's estimate, when present.
fn predicted(plan: &Plan, path: &[&str]) -> Option<f64> {
    let mut v = &plan.predicted;
    for k in path {
        v = v.get(*k)?;
    }
    v.as_f64()
}

/// The refusal when a framework needs `global_batch` to be a whole number of
/// micro-batches on every data-parallel replica and the plan's is not: the cost
/// model priced the rounded-up count, so the batch that count makes is named.
fn batch_refusal(plan: &Plan, framework: &str, global_batch: u64) -> Option<String> {
    let c = &plan.strategy;
    let per_step = c.mbs * c.dp;
    if global_batch.is_multiple_of(per_step) {
        return None;
    }
    let micro = global_batch.div_ceil(per_step);
    Some(format!(
        "{framework} needs the global batch ({global_batch}) to be a multiple of micro-batch x data-parallel size ({} x {} = {per_step}); the plan priced {micro} micro-batches per replica, which is a global batch of {} (or re-plan with a dp that divides {global_batch})",
        c.mbs,
        c.dp,
        micro * per_step
    ))
}

fn gib(bytes: f64) -> f64 {
    bytes / (1u64 << 30) as f64
}

/// A command line as one option per line, after `#` comment lines: readable,
/// diffable, and usable as `$(grep -v '^#' FILE)`.
struct ArgList {
    comments: Vec<String>,
    args: Vec<(String, Option<String>)>,
}

impl ArgList {
    fn new(plan: &Plan, target: Target) -> Self {
        ArgList {
            comments: vec![provenance(plan, target)],
            args: Vec::new(),
        }
    }

    fn comment(&mut self, c: impl Into<String>) {
        self.comments.push(c.into());
    }

    fn flag(&mut self, name: &str) {
        self.args.push((name.to_string(), None));
    }

    /// A bare word (a subcommand), on its own line.
    fn word(&mut self, word: &str) {
        self.args.push((word.to_string(), None));
    }

    fn opt(&mut self, name: &str, value: impl fmt::Display) {
        self.args.push((name.to_string(), Some(value.to_string())));
    }

    /// The value of option `name`, if given.
    fn value(&self, name: &str) -> Option<&str> {
        self.args
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    /// The options as words of one command line, each shell-quoted where needed.
    fn words(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (name, v) in &self.args {
            out.push(name.clone());
            if let Some(v) = v {
                out.push(shell_word(v));
            }
        }
        out
    }

    fn render(&self) -> String {
        let mut s = String::new();
        for c in &self.comments {
            s.push_str("# ");
            s.push_str(c);
            s.push('\n');
        }
        for (name, v) in &self.args {
            s.push_str(name);
            if let Some(v) = v {
                s.push(' ');
                s.push_str(v);
            }
            s.push('\n');
        }
        s
    }
}

/// `w` as one shell word: as it is when it holds nothing the shell reads, else in
/// single quotes.
fn shell_word(w: &str) -> String {
    let plain = !w.is_empty()
        && w.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:=,@%+".contains(c));
    if plain {
        w.to_string()
    } else {
        format!("'{}'", w.replace('\'', r"'\''"))
    }
}

/// One server launch the plan's strategy makes, as a serving exporter derives it:
/// its options, and how many copies of it on how many GPUs and nodes each.
struct Launch {
    /// The server's options (and the plan's provenance comment).
    args: ArgList,
    /// Servers to start: copies of this one.
    servers: u64,
    /// GPUs of one server.
    gpus: u64,
    /// Nodes of one server.
    nodes: u64,
    /// The plan's data-parallel replicas one server holds.
    replicas: u64,
}

/// The serving dtype name both SGLang and vLLM accept.
fn serve_dtype(d: DType) -> Option<&'static str> {
    match d {
        DType::Bf16 => Some("bfloat16"),
        DType::F16 => Some("float16"),
        DType::F32 => Some("float32"),
        _ => None,
    }
}

/// The inference workload: (prompt + output tokens, concurrent requests).
fn serve_shape(plan: &Plan) -> (u64, u64) {
    match &plan.workload {
        Workload::Inference {
            prompt_len,
            output_len,
            concurrency,
            ..
        } => (prompt_len + output_len, *concurrency),
        Workload::Train { seq_len, .. } => (*seq_len, 1),
    }
}
