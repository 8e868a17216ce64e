//! The inference interpreter: every rank runs its stage's `prefill` and `decode`
//! programs from `plan.json` on the CPU kernels, ranks as threads, with a KV cache
//! per rank.
//!
//! Requests are spread over the data-parallel replicas (request `i` on replica
//! `i % dp`). A replica prefills its requests one at a time (the plan's prefill phase
//! is one request's prompt) and then decodes them together, one token per request
//! per step (the plan's decode phase), requests of different prompt lengths side by
//! side: everything but attention is row-wise, and attention runs per request
//! against that request's cache, queries placed at the end of its keys.
//!
//! The cache holds, per block layer and request, the keys and values of the rank's
//! own KV heads (`shard::local_heads`: split over `tp`, replicated when there are
//! fewer KV heads than tensor ranks) for the layers of its pipeline stage.
//!
//! The last stage gathers the last position's logits over `tp` (the head is split by
//! vocabulary: the plan's AllGather of the logits, priced by the cost model as
//! `LayoutCtx::sampling`), samples, and sends the new tokens to the first stage (a
//! few bytes per request the plan does not list).
//!
//! MoE layers run the training interpreter's experts (`moe::forward`): split over
//! `tp` like a dense MLP (the plan all-reduces their output) or by expert over `ep`
//! (All-to-All). Prefill holds each expert to its capacity over the prompt (a
//! capacity group is one prompt, as one rank prefills it); decoding routes dropless,
//! as the cost model prices it (`ExpertsShape::dispatched_rows`), so the sharded run
//! and its single-rank reference keep the same tokens. An expert group spanning
//! replicas runs every pass together: a replica without a request for a pass runs
//! only its experts, on what the others send them.
//!
//! A disaggregated deployment runs its prefill pool's ranks and its decode pool's
//! through these same passes, the caches moving between them (`disagg.rs`).

use crate::comm::{ByteCounts, Communicator, Group, RankError, ThreadComm};
use crate::device::{derr, Device, HostDevice};
use crate::init::init_full;
use crate::moe::Routing;
use crate::sample::{sample, Sampling};
use crate::shard::{local_heads, local_weight, weight_transposed, TpPos};
use crate::train::{
    build_groups, fail, fixed_shape, segment_input, segment_output, ExecError, NO_LAYER,
};
use crate::weights::{apply_spec, shard_spec, Checkpoint};
use meshplan_ir::graph::OpKind;
use meshplan_ir::plan::{Axis, CollectiveKind, Instr, Phase, PhaseKind, Plan, PlanKind, Target};
use meshplan_ir::{Graph, MlpKind, NormKind, Op, SegmentKind, TensorKind, TpRole};
use meshplan_kernels::cpu as k;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to generate.
#[derive(Clone, Debug)]
pub struct InferOptions {
    /// Prompt token ids, one list per request.
    pub requests: Vec<Vec<u32>>,
    /// Tokens generated per request (the first comes from the prefill).
    pub max_new_tokens: usize,
    /// Greedy or sampled.
    pub sampling: Sampling,
    /// Seed of the synthetic weights when no checkpoint is given.
    pub seed: u64,
    /// A collective that waits longer than this fails the run.
    pub timeout: Duration,
    /// A Hugging Face checkpoint to read the weights from.
    pub weights: Option<Arc<Checkpoint>>,
    /// Kernel threads of each rank (its own pool; 1: the rank's thread alone).
    pub threads_per_rank: usize,
    /// End-of-sequence tokens: a request's generation ends with the first of them
    /// (included), as transformers' `generate` does. Empty: every request generates
    /// `max_new_tokens`.
    pub eos: Vec<u32>,
    /// Keep the logits of every step of every request, not only the last.
    pub step_logits: bool,
}

impl Default for InferOptions {
    fn default() -> Self {
        InferOptions {
            requests: vec![vec![1, 2, 3]],
            max_new_tokens: 8,
            sampling: Sampling::GREEDY,
            seed: 1234,
            timeout: Duration::from_secs(60),
            weights: None,
            threads_per_rank: 1,
            eos: Vec::new(),
            step_logits: false,
        }
    }
}

/// One request's result.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Generated tokens (prompt excluded).
    pub tokens: Vec<u32>,
    /// The full-vocabulary fp32 logits the last token was chosen from.
    pub logits: Vec<f32>,
    /// The logits the first token was chosen from (the prefill's last position).
    pub first_logits: Vec<f32>,
    /// The logits of every generated token, in order (kept only with
    /// [`InferOptions::step_logits`]).
    pub step_logits: Vec<Vec<f32>>,
    /// Whether generation ended at an end-of-sequence token (else at the length).
    pub ended_at_eos: bool,
    /// Seconds from the start of generation to the first token.
    pub ttft_s: f64,
    /// Mean seconds per token after the first (0 when one token was generated).
    pub tpot_s: f64,
}

/// A whole run.
#[derive(Clone, Debug)]
pub struct InferReport {
    /// Per request, in the order given.
    pub requests: Vec<RequestOutput>,
    /// Seconds from the start of generation until the last rank finished.
    pub wall_s: f64,
    /// Generated tokens of all requests per wall second.
    pub output_tokens_per_s: f64,
    /// Mean time to first token over the requests.
    pub ttft_s: f64,
    /// Mean time per output token over the requests that generated more than one.
    pub tpot_s: f64,
    /// The fullest rank's KV cache at the end, bytes (in the device's compute
    /// precision: fp32 on the CPU, bf16 on a GPU).
    pub kv_cache_bytes: f64,
    /// The fullest rank's weights, bytes (as the KV cache; routed experts' in
    /// fp32 on the host).
    pub weight_bytes: f64,
    /// Bytes each rank sent, in rank order.
    pub counts: Vec<ByteCounts>,
    /// Per rank, the expert-parallel bytes of passes whose exchange follows the
    /// router (dropless routing, every decode step, expert groups whose members hold
    /// different numbers of tokens): (sent, what the plan lists for those passes,
    /// which assumes balanced routing). [`byte_mismatches`] leaves them out.
    pub routed_ep_bytes: Vec<(f64, f64)>,
}

/// What one rank hands back.
pub(crate) struct RankOut {
    /// The requests this rank recorded (the last stage's first tensor rank).
    pub(crate) outputs: Vec<(usize, RequestOutput)>,
    pub(crate) elapsed: f64,
    pub(crate) kv_bytes: f64,
    pub(crate) weight_bytes: f64,
    pub(crate) counts: ByteCounts,
    pub(crate) routed_ep: (f64, f64),
}

/// Checks the requests against the plan's model before any rank starts: the
/// message says which request or option is wrong.
pub fn check_inputs(plan: &Plan, opts: &InferOptions) -> Result<(), String> {
    if plan.kind != PlanKind::Inference {
        return Err("this plan is a training plan; generation needs an inference plan".into());
    }
    if opts.requests.is_empty() {
        return Err("no request: give prompt token ids or a prompt".into());
    }
    if opts.max_new_tokens == 0 {
        return Err("--max-new-tokens must be at least 1".into());
    }
    opts.sampling.validate()?;
    let graph = &plan.graph;
    let vocab =
        table_rows(graph, "embed.tokens.w").ok_or("the plan's model has no token embedding")?;
    for (i, r) in opts.requests.iter().enumerate() {
        if r.is_empty() {
            return Err(format!("request {i} has an empty prompt"));
        }
        if let Some(&t) = r.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!(
                "request {i}: token id {t} is outside the model's vocabulary of {vocab}"
            ));
        }
        if let Some(max) = table_rows(graph, "embed.positions.w") {
            let need = r.len() + opts.max_new_tokens;
            if need > max {
                return Err(format!(
                    "request {i}: {} prompt tokens + {} new ones exceed the model's {max} learned positions",
                    r.len(),
                    opts.max_new_tokens
                ));
            }
        }
    }
    // The last new token is sampled, never fed back through the model.
    let longest = opts.requests.iter().map(Vec::len).max().unwrap_or(0) + opts.max_new_tokens - 1;
    crate::check_executable(graph, longest)?;
    let s = &plan.strategy;
    if s.cp > 1 {
        return Err("inference with cp > 1 (ring attention over the prompt) is not run by the CPU executor yet; plan with cp=1".into());
    }
    if s.dp_attention {
        return Err(
            "dp_attention plans are not run by the CPU executor yet; plan with dp_attention=false"
                .into(),
        );
    }
    for op in graph.segments.iter().flat_map(|s| &s.ops) {
        match &op.kind {
            OpKind::Router { .. } => {
                return Err(format!(
                    "`{}`: a separate router op is not run by the executor (the experts read a router matmul's scores)",
                    op.name
                ))
            }
            OpKind::Attention(_) if op.inputs.len() != 1 => {
                return Err(format!(
                    "`{}`: latent (MLA) attention is not run by the inference executor yet",
                    op.name
                ))
            }
            _ => {}
        }
    }
    check_experts(plan, opts)?;
    for kind in [PhaseKind::Prefill, PhaseKind::Decode] {
        if plan
            .programs
            .iter()
            .any(|p| !p.phases.iter().any(|ph| ph.kind == kind))
        {
            return Err(format!("a program of the plan has no {kind:?} phase"));
        }
    }
    Ok(())
}

/// The MoE layouts the inference executor runs: experts split over `tp` or over
/// `ep`, not both (an inference plan has no sequence parallelism, so each tensor
/// rank would dispatch a slice of replicated tokens and the plan lists no gather of
/// the experts' output), with synthetic weights.
fn check_experts(plan: &Plan, opts: &InferOptions) -> Result<(), String> {
    let Some(op) = plan
        .graph
        .segments
        .iter()
        .flat_map(|s| &s.ops)
        .find(|o| matches!(o.kind, OpKind::Experts(_)))
    else {
        return Ok(());
    };
    let s = &plan.strategy;
    if s.tp > 1 && s.ep > 1 {
        return Err(format!(
            "`{}`: experts with tp={} and ep={} are not run by the inference executor (without sequence parallelism each tensor rank would route a slice of the same tokens); plan with ep=1 (experts split over tp) or tp=1",
            op.name, s.tp, s.ep
        ));
    }
    if opts.weights.is_some() {
        return Err(format!(
            "`{}`: MoE expert weights are not read from Hugging Face checkpoints yet; run without --weights (synthetic weights)",
            op.name
        ));
    }
    Ok(())
}

/// Rows of a weight table in the graph, if it has it.
fn table_rows(graph: &Graph, name: &str) -> Option<usize> {
    graph
        .tensors
        .iter()
        .find(|t| t.name == name)
        .and_then(|t| fixed_shape(t).ok().and_then(|s| s.first().copied()))
}

/// A pool's groups with its ranks moved `base` up the world (a serving pool after
/// the other pool's ranks).
fn shifted(groups: BTreeMap<String, Group>, base: usize) -> BTreeMap<String, Group> {
    if base == 0 {
        return groups;
    }
    groups
        .into_iter()
        .map(|(name, g)| {
            let ranks: Vec<usize> = g.ranks.iter().map(|r| r + base).collect();
            let group = Group::new(format!("{name}:{ranks:?}"), ranks);
            (name, group)
        })
        .collect()
}

/// Generates with the plan's inference programs on the CPU kernels
/// ([`HostDevice`], fp32).
pub fn infer(plan: &Plan, opts: &InferOptions) -> Result<InferReport, ExecError> {
    infer_on(plan, opts, &|_| Ok(HostDevice))
}

/// Generates with the plan's inference programs, rank `r` on the device
/// `make(r)` (ranks as threads, the in-process communicator): weights,
/// activations and the KV cache in the device's buffers, the last position's
/// logits sampled on the host.
pub fn infer_on<D: Device>(
    plan: &Plan,
    opts: &InferOptions,
    make: &(dyn Fn(usize) -> crate::device::DResult<D> + Sync),
) -> Result<InferReport, ExecError> {
    check_inputs(plan, opts).map_err(ExecError::Plan)?;
    if let Some(ck) = &opts.weights {
        ck.check_config(&plan.graph)
            .and_then(|_| ck.validate(&plan.graph))
            .map_err(|e| ExecError::Checkpoint(e.message))?;
    }
    let world = plan.ranks.len();
    let results = crate::comm::run_ranks(world, opts.timeout, opts.threads_per_rank, |comm| {
        let dev = make(comm.rank()).map_err(|e| fail(format!("device: {e}")))?;
        let mut r = InferRank::new(dev, plan, comm, opts, 0)?;
        let everyone = Group::new("world", (0..world).collect());
        r.comm.barrier(&everyone)?;
        let t0 = Instant::now();
        let outputs = r.generate(t0)?;
        Ok(r.finish(outputs, t0))
    });
    let outs = rank_outs(results)?;
    let requests = recorded(&outs, opts.requests.len())?
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.ok_or_else(|| ExecError::Output(format!("request {i} was not generated by any rank")))
        })
        .collect::<Result<_, _>>()?;
    summarize(requests, outs)
}

/// Every rank's result, or the world's failure in one message.
pub(crate) fn rank_outs<T>(results: Vec<Result<T, RankError>>) -> Result<Vec<T>, ExecError> {
    if let Some(summary) = crate::comm::failure_summary(&results) {
        return Err(ExecError::Rank(summary));
    }
    results
        .into_iter()
        .map(|r| r.map_err(|e| ExecError::Rank(format!("{e:?}"))))
        .collect()
}

/// Each request's output as the rank that recorded it handed it back.
pub(crate) fn recorded(
    outs: &[RankOut],
    requests: usize,
) -> Result<Vec<Option<RequestOutput>>, ExecError> {
    let mut out: Vec<Option<RequestOutput>> = vec![None; requests];
    for o in outs {
        for (i, r) in &o.outputs {
            let slot = out.get_mut(*i).ok_or_else(|| {
                ExecError::Output(format!("a rank recorded request {i} of {requests}"))
            })?;
            *slot = Some(r.clone());
        }
    }
    Ok(out)
}

/// The run's report from its requests and every rank's figures; non-finite logits
/// fail it.
pub(crate) fn summarize(
    requests: Vec<RequestOutput>,
    outs: Vec<RankOut>,
) -> Result<InferReport, ExecError> {
    for (i, r) in requests.iter().enumerate() {
        if let Some(bad) = r
            .first_logits
            .iter()
            .chain(&r.logits)
            .find(|x| !x.is_finite())
        {
            return Err(ExecError::Output(format!(
                "request {i}: the logits hold {bad}: the model's arithmetic overflowed, its tokens mean nothing"
            )));
        }
    }
    let wall_s = outs.iter().map(|o| o.elapsed).fold(0.0, f64::max);
    let generated: usize = requests.iter().map(|r| r.tokens.len()).sum();
    let n = requests.len() as f64;
    let multi: Vec<f64> = requests
        .iter()
        .filter(|r| r.tokens.len() > 1)
        .map(|r| r.tpot_s)
        .collect();
    Ok(InferReport {
        wall_s,
        output_tokens_per_s: generated as f64 / wall_s.max(1e-12),
        ttft_s: requests.iter().map(|r| r.ttft_s).sum::<f64>() / n,
        tpot_s: if multi.is_empty() {
            0.0
        } else {
            multi.iter().sum::<f64>() / multi.len() as f64
        },
        kv_cache_bytes: outs.iter().map(|o| o.kv_bytes).fold(0.0, f64::max),
        weight_bytes: outs.iter().map(|o| o.weight_bytes).fold(0.0, f64::max),
        routed_ep_bytes: outs.iter().map(|o| o.routed_ep).collect(),
        counts: outs.into_iter().map(|o| o.counts).collect(),
        requests,
    })
}

/// Largest logit difference `--check` accepts, relative to the reference's largest
/// logit magnitude (at least 1): sharded sums round differently in fp32, by about
/// 1e-6 of the magnitude at these sizes.
pub const LOGIT_TOLERANCE: f64 = 1e-4;

/// How far a bf16 run's first logits (the prompt's last position, computed from
/// the same tokens) may lie from the fp32 reference's, relative to the largest
/// reference logit: bf16 keeps 8 bits of mantissa (a relative step of 2^-8 =
/// 3.9e-3 per rounding) and the error grows over the layers. Measured with
/// `Bf16Host` on the Llama test checkpoint: 6.4e-3 on one rank, 8.8e-3 over tp=2;
/// other weights give 1.5 (tests/it/infer.rs, `mixed_precision_inference_*`).
pub const MIXED_LOGIT_TOLERANCE: f64 = 0.05;

/// The largest difference between logits `x` and the reference's `y`, and the
/// scale it is judged against (the largest reference logit, at least 1).
fn logit_gap(x: &[f32], y: &[f32]) -> Result<(f64, f64), String> {
    if x.len() != y.len() {
        return Err(format!(
            "have {} values, the reference's {}",
            x.len(),
            y.len()
        ));
    }
    let scale = y.iter().fold(1.0f64, |m, v| m.max(v.abs() as f64));
    let d = x
        .iter()
        .zip(y)
        .map(|(p, q)| (p - q).abs() as f64)
        .fold(0.0, f64::max);
    Ok((d, scale))
}

/// Compares a mixed-precision run with the fp32 single-rank reference: each
/// request's first logits within [`MIXED_LOGIT_TOLERANCE`]. Later tokens may differ
/// (a greedy choice between two near-equal logits can flip, and the runs then
/// diverge): the summary says how many requests kept the reference's tokens.
pub fn check_inference_mixed(
    run: &InferReport,
    reference: &InferReport,
) -> Result<(String, f64), String> {
    if run.requests.len() != reference.requests.len() {
        return Err(format!(
            "{} requests generated, the reference {}",
            run.requests.len(),
            reference.requests.len()
        ));
    }
    let mut problems = Vec::new();
    let mut worst_rel: f64 = 0.0;
    for (i, (a, b)) in run.requests.iter().zip(&reference.requests).enumerate() {
        let (d, scale) = match logit_gap(&a.first_logits, &b.first_logits) {
            Ok(gap) => gap,
            Err(why) => {
                problems.push(format!("request {i}: first logits {why}"));
                continue;
            }
        };
        worst_rel = worst_rel.max(d / scale);
        if d > MIXED_LOGIT_TOLERANCE * scale || !d.is_finite() {
            problems.push(format!(
                "request {i}: first logits differ by up to {d:.3e} ({:.3e} of the largest; tolerance {MIXED_LOGIT_TOLERANCE})",
                d / scale
            ));
        }
    }
    let same = run
        .requests
        .iter()
        .zip(&reference.requests)
        .filter(|(a, b)| a.tokens == b.tokens)
        .count();
    let summary = format!(
        "first logits within {worst_rel:.3e} of the largest reference logit (tolerance {MIXED_LOGIT_TOLERANCE}); {same} of {} requests generated the reference's tokens",
        run.requests.len()
    );
    if problems.is_empty() {
        Ok((summary, worst_rel))
    } else {
        problems.push(summary);
        Err(problems.join("\n"))
    }
}

/// Compares a run with its single-rank reference: every request's tokens must be
/// equal, its first and last logits within [`LOGIT_TOLERANCE`]. Returns the summary
/// line (and the worst difference) or every difference found.
pub fn check_inference(
    run: &InferReport,
    reference: &InferReport,
) -> Result<(String, f64), String> {
    let mut problems = Vec::new();
    let mut worst: f64 = 0.0;
    let mut worst_rel: f64 = 0.0;
    if run.requests.len() != reference.requests.len() {
        return Err(format!(
            "{} requests generated, the reference {}",
            run.requests.len(),
            reference.requests.len()
        ));
    }
    for (i, (a, b)) in run.requests.iter().zip(&reference.requests).enumerate() {
        if a.tokens != b.tokens {
            problems.push(format!(
                "request {i}: tokens {:?} differ from the reference's {:?}",
                a.tokens, b.tokens
            ));
        }
        for (x, y, what) in [
            (&a.first_logits, &b.first_logits, "first"),
            (&a.logits, &b.logits, "last"),
        ] {
            let (d, scale) = match logit_gap(x, y) {
                Ok(gap) => gap,
                Err(why) => {
                    problems.push(format!("request {i}: {what} logits {why}"));
                    continue;
                }
            };
            worst = worst.max(d);
            worst_rel = worst_rel.max(d / scale);
            if d > LOGIT_TOLERANCE * scale {
                problems.push(format!(
                    "request {i}: {what} logits differ by up to {d:.3e} (tolerance {:.1e})",
                    LOGIT_TOLERANCE * scale
                ));
            }
        }
    }
    let summary = format!(
        "tokens equal on {} requests; largest logit difference {worst:.3e} ({worst_rel:.3e} of the largest logit; tolerance {LOGIT_TOLERANCE:.0e})",
        run.requests.len()
    );
    if problems.is_empty() {
        Ok((summary, worst))
    } else {
        problems.push(summary);
        Err(problems.join("\n"))
    }
}

/// The rows one pass computes: `seq` query tokens of each request of `reqs`,
/// sequence-major (`row = s * reqs.len() + b`).
struct Batch {
    /// Local request slots.
    reqs: Vec<usize>,
    /// Query tokens per request.
    seq: usize,
    /// Position of each request's first query token.
    pos0: Vec<usize>,
    /// Token ids per row.
    tokens: Vec<u32>,
    /// How the experts hold this pass's tokens to capacity.
    routing: Routing,
}

impl Batch {
    fn rows(&self) -> usize {
        self.seq * self.reqs.len()
    }

    fn positions(&self) -> Vec<u32> {
        let b = self.reqs.len();
        (0..self.rows())
            .map(|r| (self.pos0[r % b] + r / b) as u32)
            .collect()
    }
}

/// One request's KV cache on a rank: per block layer of its stage, keys
/// `[len, hkv, d]` and values `[len, hkv, dv]` of the rank's own KV heads, in the
/// device's buffers (`A`, host vectors by default).
pub(crate) type RequestCache<A = Vec<f32>> = BTreeMap<u64, (A, A)>;

/// What prefilling one request leaves on a rank.
pub(crate) struct Prefilled<A = Vec<f32>> {
    /// The last position's full-vocabulary logits (last stage only).
    pub(crate) logits: Option<Vec<f32>>,
    /// Its KV cache entries.
    pub(crate) cache: RequestCache<A>,
}

/// A replica's requests while generating: what the recording rank (the last
/// stage's first tensor rank) reports, and the tokens fed to the next step.
pub(crate) struct Progress {
    /// Global request index per local slot.
    ids: Vec<usize>,
    pub(crate) outs: Vec<RequestOutput>,
    first_at: Vec<f64>,
    pub(crate) current: Vec<u32>,
    /// A request that produced an end-of-sequence token keeps its place in the
    /// batch (every rank runs the same steps, and the plan's bytes stay exact) but
    /// records nothing more.
    ended: Vec<bool>,
    eos: Vec<u32>,
    step_logits: bool,
}

impl Progress {
    pub(crate) fn new(ids: &[usize], opts: &InferOptions) -> Progress {
        let outs = ids
            .iter()
            .map(|&i| RequestOutput {
                prompt_len: opts.requests[i].len(),
                tokens: Vec::new(),
                logits: Vec::new(),
                first_logits: Vec::new(),
                step_logits: Vec::new(),
                ended_at_eos: false,
                ttft_s: 0.0,
                tpot_s: 0.0,
            })
            .collect();
        Progress {
            ids: ids.to_vec(),
            outs,
            first_at: vec![0.0; ids.len()],
            current: vec![0; ids.len()],
            ended: vec![false; ids.len()],
            eos: opts.eos.clone(),
            step_logits: opts.step_logits,
        }
    }

    /// Samples slot `j`'s first token from its prefill logits (`now`: recorded at
    /// this time since the start).
    pub(crate) fn first_token(
        &mut self,
        j: usize,
        rows: Vec<f32>,
        sampling: &Sampling,
        now: Option<Duration>,
    ) {
        let t = sample(&rows, sampling, self.ids[j] as u64, 0);
        self.current[j] = t;
        self.ended[j] = self.eos.contains(&t);
        let Some(now) = now else {
            return;
        };
        self.first_at[j] = now.as_secs_f64();
        let o = &mut self.outs[j];
        o.tokens.push(t);
        o.ended_at_eos = self.ended[j];
        o.ttft_s = self.first_at[j];
        if self.step_logits {
            o.step_logits.push(rows.clone());
        }
        o.first_logits = rows.clone();
        o.logits = rows;
    }

    /// Slot `j`'s first token `t`, sampled elsewhere (by the prefill pool): fed to
    /// the first decode step; `now` starts the slot's time per output token.
    pub(crate) fn handed_token(&mut self, j: usize, t: u32, now: Option<Duration>) {
        self.current[j] = t;
        self.ended[j] = self.eos.contains(&t);
        if let Some(now) = now {
            self.first_at[j] = now.as_secs_f64();
        }
    }

    /// Samples every slot's token of decode step `step` from `all`
    /// (`[slots, vocab]`).
    fn next_tokens(
        &mut self,
        all: &[f32],
        vocab: usize,
        step: usize,
        sampling: &Sampling,
        now: Option<Duration>,
    ) {
        for j in 0..self.ids.len() {
            let row = &all[j * vocab..(j + 1) * vocab];
            let t = sample(row, sampling, self.ids[j] as u64, step as u64);
            self.current[j] = t;
            if self.ended[j] {
                continue;
            }
            self.ended[j] = self.eos.contains(&t);
            let Some(now) = now else {
                continue;
            };
            let o = &mut self.outs[j];
            o.tokens.push(t);
            o.ended_at_eos = self.ended[j];
            if self.step_logits {
                o.step_logits.push(row.to_vec());
            }
            o.logits = row.to_vec();
            o.tpot_s = (now.as_secs_f64() - self.first_at[j]) / step as f64;
        }
    }
}

/// Weight key: op, tensor and block layer (`NO_LAYER` outside blocks). Keyed by op
/// because a tied table is sliced by vocabulary rows for the head but may be
/// replicated for the embedding.
type WKey = (String, String, u64);

/// One rank of an inference run on device `D`: its weights, activations and KV
/// cache live in the device's buffers; the sampled logits come to the host.
pub(crate) struct InferRank<'a, D: Device = HostDevice> {
    dev: D,
    plan: &'a Plan,
    graph: &'a Graph,
    /// The rank in the world (the communicator's).
    rank: usize,
    /// The world rank of the plan's rank 0: a serving pool's ranks follow the
    /// other pool's.
    base: usize,
    pub(crate) comm: ThreadComm,
    coords: Vec<u64>,
    pp_axis: usize,
    pub(crate) stage: u64,
    pub(crate) last_stage: u64,
    dp: usize,
    pub(crate) dp_index: usize,
    /// Mesh axis of `dp` in the rank coordinates.
    dp_axis: Option<usize>,
    pub(crate) tp: TpPos,
    ep: TpPos,
    /// The expert group, when the experts are split over ranks.
    ep_group: Option<Group>,
    /// Expert-parallel bytes of passes whose exchange follows the router: (sent,
    /// the plan's figure for those passes).
    routed_ep: (f64, f64),
    groups: BTreeMap<String, Group>,
    prefill: &'a Phase,
    decode: &'a Phase,
    opts: &'a InferOptions,
    weights: HashMap<WKey, D::Act>,
    /// The experts ops' weights, on the host: routed experts run on the host
    /// kernels (`moe::forward`).
    host_weights: HashMap<WKey, Vec<f32>>,
    /// (layer, local request) -> keys `[len, hkv, d]` and values `[len, hkv, dv]`.
    kv: HashMap<(u64, usize), (D::Act, D::Act)>,
    hidden: Option<D::Act>,
    hidden_width: usize,
    vocab: usize,
    acts: HashMap<String, D::Act>,
    logits: Option<D::Act>,
}

impl<'a, D: Device> InferRank<'a, D> {
    /// World rank `comm.rank()` as rank `comm.rank() - base` of `plan`, on `dev`.
    pub(crate) fn new(
        dev: D,
        plan: &'a Plan,
        comm: ThreadComm,
        opts: &'a InferOptions,
        base: usize,
    ) -> Result<Self, RankError> {
        let rank = comm.rank();
        let entry = rank
            .checked_sub(base)
            .and_then(|local| plan.ranks.get(local))
            .ok_or_else(|| fail(format!("rank {rank} is not in the plan's rank table")))?;
        let program = plan
            .programs
            .get(entry.program as usize)
            .ok_or_else(|| fail(format!("rank {rank}: program {} missing", entry.program)))?;
        let phase = |kind: PhaseKind| {
            program
                .phases
                .iter()
                .find(|p| p.kind == kind)
                .ok_or_else(|| fail(format!("program {} has no {kind:?} phase", program.id)))
        };
        let axis = |name: &str| plan.mesh.axes.iter().position(|a| a == name);
        let coord = |name: &str| axis(name).map(|i| entry.coords[i] as usize).unwrap_or(0);
        let size = |name: &str| axis(name).map(|i| plan.mesh.shape[i] as usize).unwrap_or(1);
        let graph = &plan.graph;
        let table = graph
            .tensors
            .iter()
            .find(|t| t.name == "embed.tokens.w")
            .ok_or_else(|| fail("the plan's model has no token embedding"))?;
        let shape = fixed_shape(table)?;
        let groups = shifted(build_groups(plan, rank - base)?, base);
        let ep_group = groups.get("ep").filter(|g| g.size() > 1).cloned();
        let ep = ep_group
            .as_ref()
            .and_then(|g| g.index_of(rank))
            .map(|i| TpPos {
                rank: i,
                size: ep_group.as_ref().map_or(1, Group::size),
            })
            .unwrap_or(TpPos::ONE);
        let mut st = InferRank {
            dev,
            plan,
            graph,
            rank,
            base,
            comm,
            coords: entry.coords.clone(),
            pp_axis: axis("pp").ok_or_else(|| fail("the mesh has no pp axis"))?,
            stage: program.stage,
            last_stage: size("pp") as u64 - 1,
            dp: size("dp"),
            dp_index: coord("dp"),
            dp_axis: axis("dp"),
            tp: TpPos {
                rank: coord("tp"),
                size: size("tp"),
            },
            ep,
            ep_group,
            routed_ep: (0.0, 0.0),
            groups,
            prefill: phase(PhaseKind::Prefill)?,
            decode: phase(PhaseKind::Decode)?,
            opts,
            weights: HashMap::new(),
            host_weights: HashMap::new(),
            kv: HashMap::new(),
            hidden: None,
            hidden_width: shape.get(1).copied().unwrap_or(1),
            vocab: shape[0],
            acts: HashMap::new(),
            logits: None,
        };
        st.load_weights()?;
        Ok(st)
    }

    /// (segment index, block layer) of every segment copy this stage runs.
    fn copies(&self) -> Result<Vec<(usize, Option<u64>)>, RankError> {
        crate::train::segment_copies(self.graph, self.prefill)
    }

    fn segment_index(&self, name: &str) -> Result<usize, RankError> {
        crate::train::segment_index(self.graph, name)
    }

    /// This rank's shard of every weight its stage uses: read from the checkpoint,
    /// or the deterministic initial values training starts from.
    fn load_weights(&mut self) -> Result<(), RankError> {
        for (s, layer) in self.copies()? {
            let seg = &self.graph.segments[s];
            for op in &seg.ops {
                for &w in &op.inputs {
                    let t = self.graph.tensor(w);
                    if t.kind != TensorKind::Weight {
                        continue;
                    }
                    let l = layer.unwrap_or(NO_LAYER);
                    let key = (op.name.clone(), t.name.clone(), l);
                    if self.weights.contains_key(&key) || self.host_weights.contains_key(&key) {
                        continue;
                    }
                    let shape = fixed_shape(t)?;
                    let spec = shard_spec(self.graph, op, op.role, w, &shape, self.tp);
                    let local = match &self.opts.weights {
                        Some(ck) => ck
                            .local(self.graph, op, w, layer, &spec)
                            .map_err(|e| fail(e.message))?,
                        None => {
                            let kind = crate::init::init_kind(op, w, &shape);
                            let elems = shape.iter().product();
                            let full = init_full(self.opts.seed, &t.name, l, elems, kind);
                            if matches!(op.kind, OpKind::Experts(_)) {
                                // Split by expert over `ep` or within each expert
                                // over `tp`, as training slices them.
                                local_weight(
                                    self.graph, op, op.role, w, &full, &shape, self.tp, self.ep,
                                )
                            } else {
                                apply_spec(&spec, &full, &shape)
                            }
                        }
                    };
                    if let Some(bad) = local.iter().find(|x| !x.is_finite()) {
                        // A checkpoint holding NaN or infinity generates garbage
                        // without a word; refuse it naming the tensor.
                        let layer = crate::train::layer_label(l);
                        return Err(fail(format!(
                            "weight `{}`{layer} holds {bad}: the weights are damaged or were saved from a diverged run",
                            t.name
                        )));
                    }
                    if matches!(op.kind, OpKind::Experts(_)) {
                        self.host_weights.insert(key, local);
                    } else {
                        let w = self.dev.act_from_host(local).map_err(derr("upload"))?;
                        self.weights.insert(key, w);
                    }
                }
            }
        }
        Ok(())
    }

    /// A compute buffer of `n` zeros.
    fn zeros(&self, n: usize) -> Result<D::Act, RankError> {
        self.dev.act_zeros(n).map_err(derr("allocation"))
    }

    /// An fp32 buffer of `n` zeros (kernel statistics).
    fn zeros_f32(&self, n: usize) -> Result<D::F32, RankError> {
        self.dev.f32_zeros(n).map_err(derr("allocation"))
    }

    fn weight(&self, op: &Op, i: usize, l: u64) -> Result<&D::Act, RankError> {
        let name = &self.graph.tensor(op.inputs[i]).name;
        self.weights
            .get(&(op.name.clone(), name.clone(), l))
            .ok_or_else(|| {
                fail(format!(
                    "weight `{name}` of `{}` (layer {l}) is not held by rank {}",
                    op.name, self.rank
                ))
            })
    }

    fn act(&self, op: &Op, i: usize) -> Result<&D::Act, RankError> {
        let name = &self.graph.tensor(op.inputs[i]).name;
        self.acts.get(name).ok_or_else(|| {
            fail(format!(
                "`{}` reads `{name}` before it is produced",
                op.name
            ))
        })
    }

    fn peer(&self, stage: u64) -> Result<usize, RankError> {
        let mut coords = self.coords.clone();
        coords[self.pp_axis] = stage;
        self.plan
            .ranks
            .iter()
            .find(|r| r.coords == coords)
            .map(|r| self.base + r.rank as usize)
            .ok_or_else(|| fail(format!("no rank at {coords:?}")))
    }

    fn group(&self, name: &str) -> Result<Group, RankError> {
        self.groups
            .get(name)
            .cloned()
            .ok_or_else(|| fail(format!("group `{name}` is not in the plan's mesh")))
    }

    /// Prefill every request of this replica, then decode them together.
    fn generate(&mut self, t0: Instant) -> Result<Vec<(usize, RequestOutput)>, RankError> {
        let mine = self.served_by(self.dp_index);
        if mine.is_empty() && !self.expert_lockstep() {
            return Ok(Vec::new());
        }
        let record = self.records();
        let mut p = Progress::new(&mine, self.opts);
        self.prefill_passes(&mine, |r, j, _, done| {
            r.put_cache(j, done.cache);
            if let Some(rows) = done.logits {
                let now = record.then(|| t0.elapsed());
                p.first_token(j, rows, &r.opts.sampling, now);
            }
            Ok(())
        })?;
        self.decode_passes(&mine, &mut p, t0)?;
        Ok(if record {
            mine.into_iter().zip(p.outs).collect()
        } else {
            Vec::new()
        })
    }

    /// Whether this rank records its replica's outputs: the last stage's first
    /// tensor rank.
    pub(crate) fn records(&self) -> bool {
        self.stage == self.last_stage && self.tp.rank == 0
    }

    /// Prefills the requests `mine` (slot `j` request `mine[j]`) one at a time,
    /// handing each to `done`. An expert group runs its passes together: a replica
    /// out of requests still serves its experts to the others' tokens.
    pub(crate) fn prefill_passes(
        &mut self,
        mine: &[usize],
        mut done: impl FnMut(&mut Self, usize, usize, Prefilled<D::Act>) -> Result<(), RankError>,
    ) -> Result<(), RankError> {
        let passes = match &self.ep_group {
            Some(g) if self.expert_lockstep() => g
                .ranks
                .iter()
                .map(|&r| self.served_by(self.dp_of(r)).len())
                .max()
                .unwrap_or(0),
            _ => mine.len(),
        };
        for j in 0..passes {
            let Some(&i) = mine.get(j) else {
                self.idle_pass(self.prefill)?;
                continue;
            };
            let out = self.prefill_request(j, i)?;
            done(self, j, i, out)?;
        }
        Ok(())
    }

    /// Decodes the requests `mine`, whose caches are in place and whose first tokens
    /// `p` holds, until each has its tokens (a replica without requests whose expert
    /// group has some serves its experts at every step).
    pub(crate) fn decode_passes(
        &mut self,
        mine: &[usize],
        p: &mut Progress,
        t0: Instant,
    ) -> Result<(), RankError> {
        let record = self.records();
        for step in 1..self.opts.max_new_tokens {
            if mine.is_empty() {
                self.idle_pass(self.decode)?;
                continue;
            }
            self.hand_tokens_back(&mut p.current)?;
            if let Some(all) = self.decode_step(mine, step, &p.current)? {
                let now = record.then(|| t0.elapsed());
                p.next_tokens(&all, self.vocab, step, &self.opts.sampling, now);
            }
        }
        Ok(())
    }

    /// What this rank hands back once its work is done.
    pub(crate) fn finish(&self, outputs: Vec<(usize, RequestOutput)>, t0: Instant) -> RankOut {
        let elapsed = t0.elapsed().as_secs_f64();
        let act = self.dev.act_bytes() as f64;
        let kv_bytes = act
            * self
                .kv
                .values()
                .map(|(a, b)| (D::act_len(a) + D::act_len(b)) as f64)
                .sum::<f64>();
        let weight_bytes = act
            * self
                .weights
                .values()
                .map(|w| D::act_len(w) as f64)
                .sum::<f64>()
            + 4.0
                * self
                    .host_weights
                    .values()
                    .map(|w| w.len() as f64)
                    .sum::<f64>();
        RankOut {
            outputs,
            elapsed,
            kv_bytes,
            weight_bytes,
            counts: self.comm.counts(),
            routed_ep: self.routed_ep,
        }
    }

    /// Requests replica `dp_index` serves, in order (round robin over replicas).
    pub(crate) fn served_by(&self, dp_index: usize) -> Vec<usize> {
        let dp = self.dp.max(1);
        (0..self.opts.requests.len())
            .filter(|i| i % dp == dp_index)
            .collect()
    }

    fn dp_of(&self, rank: usize) -> usize {
        let entry = rank
            .checked_sub(self.base)
            .and_then(|r| self.plan.ranks.get(r));
        match (self.dp_axis, entry) {
            (Some(a), Some(e)) => e.coords[a] as usize,
            _ => 0,
        }
    }

    /// Whether this rank's expert group spans replicas one of which has requests:
    /// its members must then run every pass together.
    pub(crate) fn expert_lockstep(&self) -> bool {
        self.ep_group.as_ref().is_some_and(|g| {
            g.ranks
                .iter()
                .any(|&r| !self.served_by(self.dp_of(r)).is_empty())
        })
    }

    /// How the experts of prefill pass `j` (request `i`) hold tokens to capacity:
    /// groups of one prompt, padded counts known to every member when each member
    /// prefills a prompt of the same length in this pass.
    fn prefill_routing(&self, j: usize, i: usize) -> Routing {
        let len = self.opts.requests[i].len();
        let dp = self.dp.max(1);
        let even = self.ep_group.as_ref().is_none_or(|g| {
            g.ranks.iter().all(|&r| {
                let other = self.dp_of(r) + j * dp;
                self.opts.requests.get(other).map(Vec::len) == Some(len)
            })
        });
        let group = meshplan_ir::graph::capacity_group_tokens(
            len as u64,
            1,
            self.tp.size as u64,
            self.ep.size as u64,
        );
        Routing {
            group_tokens: Some(group as usize),
            even,
        }
    }

    /// Whether the pass's expert exchange follows the router rather than the plan's
    /// fixed sizes: expert parallelism without even capacity buffers.
    fn routed(&self, routing: Routing) -> bool {
        let padded = |o: &Op| matches!(&o.kind, OpKind::Experts(e) if e.capacity_factor.is_some());
        let ops = || self.graph.segments.iter().flat_map(|s| &s.ops);
        let even = routing.even && routing.group_tokens.is_some() && ops().any(padded);
        self.ep.size > 1 && !even && ops().any(|o| matches!(o.kind, OpKind::Experts(_)))
    }

    /// Runs `phase` on `batch`, keeping apart the expert-parallel bytes that follow
    /// the router, with the plan's figure for the pass.
    fn run_counted(&mut self, phase: &Phase, batch: &Batch) -> Result<(), RankError> {
        let routed = self.routed(batch.routing);
        let before = self.ep_bytes_sent(routed);
        self.run_phase(phase, batch)?;
        if routed {
            self.routed_ep.0 += self.ep_bytes_sent(true) - before;
            self.routed_ep.1 += phase.bytes_sent().get(Axis::Ep);
        }
        Ok(())
    }

    fn ep_bytes_sent(&self, routed: bool) -> f64 {
        if routed {
            self.comm.counts().axis_bytes_sent(Axis::Ep.name())
        } else {
            0.0
        }
    }

    /// Prefills request `i` into local slot `j`: its KV cache entries on this rank,
    /// and on the last stage the full-vocabulary logits of its last position.
    fn prefill_request(&mut self, j: usize, i: usize) -> Result<Prefilled<D::Act>, RankError> {
        let prompt = &self.opts.requests[i];
        let batch = Batch {
            reqs: vec![j],
            seq: prompt.len(),
            pos0: vec![0],
            tokens: prompt.clone(),
            routing: self.prefill_routing(j, i),
        };
        self.run_counted(self.prefill, &batch)?;
        let logits = if self.stage == self.last_stage {
            Some(self.last_logits(&batch)?)
        } else {
            None
        };
        Ok(Prefilled {
            logits,
            cache: self.take_cache(j),
        })
    }

    /// Decode step `step` of the requests `mine` (local slots `0..`), from their
    /// caches, fed the tokens `current`: on the last stage the logits
    /// `[requests, vocab]`.
    fn decode_step(
        &mut self,
        mine: &[usize],
        step: usize,
        current: &[u32],
    ) -> Result<Option<Vec<f32>>, RankError> {
        let batch = Batch {
            reqs: (0..mine.len()).collect(),
            seq: 1,
            pos0: mine
                .iter()
                .map(|&i| self.opts.requests[i].len() + step - 1)
                .collect(),
            tokens: current.to_vec(),
            // One token per request: capacity groups of one token would pad every
            // expert for every token, so decoding routes dropless
            // (`ExpertsShape::dispatched_rows`).
            routing: Routing {
                group_tokens: None,
                even: false,
            },
        };
        self.run_counted(self.decode, &batch)?;
        if self.stage == self.last_stage {
            Ok(Some(self.last_logits(&batch)?))
        } else {
            Ok(None)
        }
    }

    /// A pass of `phase` without tokens of this replica: only its experts run, on
    /// what the rest of the expert group sends them.
    fn idle_pass(&mut self, phase: &Phase) -> Result<(), RankError> {
        let idle = Routing {
            group_tokens: None,
            even: false,
        };
        let before = self.ep_bytes_sent(true);
        for ch in &phase.chunks {
            let mut layer = ch.layer_start;
            for instr in &ch.forward {
                let Instr::Segment {
                    kind, repeat, body, ..
                } = instr
                else {
                    continue;
                };
                for _ in 0..*repeat {
                    let l = if *kind == SegmentKind::Block {
                        layer += 1;
                        layer - 1
                    } else {
                        NO_LAYER
                    };
                    for name in body.iter().filter_map(|i| match i {
                        Instr::Compute { name, .. } => Some(name),
                        _ => None,
                    }) {
                        let op = self.find_op(name)?;
                        if let OpKind::Experts(e) = &op.kind {
                            self.experts(op, e, l, idle, true)?;
                        }
                    }
                }
            }
        }
        // The plan counts no pass for a replica without requests.
        self.routed_ep.0 += self.ep_bytes_sent(true) - before;
        Ok(())
    }

    /// Removes one local request's KV cache entries from this rank.
    fn take_cache(&mut self, slot: usize) -> RequestCache<D::Act> {
        let keys: Vec<(u64, usize)> = self.kv.keys().filter(|k| k.1 == slot).copied().collect();
        keys.into_iter()
            .filter_map(|k| self.kv.remove(&k).map(|v| (k.0, v)))
            .collect()
    }

    /// Installs one local request's KV cache entries.
    pub(crate) fn put_cache(&mut self, slot: usize, cache: RequestCache<D::Act>) {
        for (layer, kv) in cache {
            self.kv.insert((layer, slot), kv);
        }
    }

    fn find_op(&self, name: &str) -> Result<&'a Op, RankError> {
        self.graph
            .segments
            .iter()
            .flat_map(|s| &s.ops)
            .find(|o| o.name == name)
            .ok_or_else(|| fail(format!("op `{name}` is not in the plan's graph")))
    }

    /// The last stage sends the tokens it sampled to the first, which embeds them.
    fn hand_tokens_back(&mut self, current: &mut [u32]) -> Result<(), RankError> {
        if self.last_stage == 0 {
            return Ok(());
        }
        if self.stage == self.last_stage {
            let peer = self.peer(0)?;
            let buf: Vec<f32> = current.iter().map(|&t| t as f32).collect();
            self.comm.send(peer, "pp", &buf)?;
        } else if self.stage == 0 {
            let peer = self.peer(self.last_stage)?;
            let mut buf = vec![0.0f32; current.len()];
            self.comm.recv(peer, "pp", &mut buf)?;
            for (c, b) in current.iter_mut().zip(&buf) {
                *c = *b as u32;
            }
        }
        Ok(())
    }

    /// The full-vocabulary logits of each request's last row, `[requests, vocab]`.
    fn last_logits(&mut self, batch: &Batch) -> Result<Vec<f32>, RankError> {
        let b = batch.reqs.len();
        let rows = batch.rows();
        let logits = self
            .logits
            .as_ref()
            .ok_or_else(|| fail("the head produced no logits"))?;
        let v_local = D::act_len(logits) / rows.max(1);
        let first = (batch.seq - 1) * b;
        // Only the last position's rows leave the device.
        let err = derr("logits");
        let local = if first == 0 {
            self.dev.act_download(logits).map_err(&err)?
        } else {
            let n = (rows - first) * v_local;
            let mut last = self.zeros(n)?;
            self.dev
                .act_copy(logits, first * v_local, &mut last, 0, n)
                .map_err(&err)?;
            self.dev.act_download(&last).map_err(&err)?
        };
        if v_local == self.vocab {
            return Ok(local.to_vec());
        }
        let g = self.group("tp")?;
        if v_local * g.size() != self.vocab {
            return Err(fail(format!(
                "logits of {v_local} columns per rank do not make a vocabulary of {} over {} ranks",
                self.vocab,
                g.size()
            )));
        }
        let mut gathered = vec![0.0f32; local.len() * g.size()];
        self.comm.all_gather(&g, "tp", &local, &mut gathered)?;
        let mut full = vec![0.0f32; b * self.vocab];
        for t in 0..g.size() {
            for r in 0..b {
                let src = &gathered[(t * b + r) * v_local..(t * b + r + 1) * v_local];
                full[r * self.vocab + t * v_local..r * self.vocab + (t + 1) * v_local]
                    .copy_from_slice(src);
            }
        }
        Ok(full)
    }

    fn run_phase(&mut self, phase: &Phase, batch: &Batch) -> Result<(), RankError> {
        for ch in &phase.chunks {
            let mut layer = ch.layer_start;
            self.hidden = None;
            self.run(&ch.forward, batch, &mut layer)?;
        }
        Ok(())
    }

    fn run(&mut self, instrs: &[Instr], batch: &Batch, layer: &mut u64) -> Result<(), RankError> {
        for instr in instrs {
            match instr {
                Instr::Segment {
                    name,
                    kind,
                    repeat,
                    body,
                } => {
                    let s = self.segment_index(name)?;
                    for _ in 0..*repeat {
                        let l = if *kind == SegmentKind::Block {
                            *layer += 1;
                            *layer - 1
                        } else {
                            NO_LAYER
                        };
                        self.acts.clear();
                        if let (Some(input), Some(h)) =
                            (segment_input(self.graph, s), self.hidden.take())
                        {
                            self.acts.insert(input, h);
                        }
                        self.run_body(body, batch, l)?;
                        match segment_output(self.graph, s) {
                            Some(out) => {
                                self.hidden = Some(self.acts.remove(&out).ok_or_else(|| {
                                    fail(format!("segment `{name}` did not produce `{out}`"))
                                })?);
                            }
                            None => self.logits = Some(self.head_logits(s)?),
                        }
                    }
                }
                Instr::Send { peer_stage, .. } => {
                    let peer = self.peer(*peer_stage)?;
                    let h = self
                        .hidden
                        .as_ref()
                        .ok_or_else(|| fail("no hidden states to send"))?;
                    let n = D::act_len(h);
                    self.dev.send_act(&mut self.comm, peer, "pp", h, (0, n))?;
                }
                Instr::Recv { peer_stage, .. } => {
                    let peer = self.peer(*peer_stage)?;
                    let mut buf = self.zeros(batch.rows() * self.hidden_width)?;
                    self.dev.recv_act(&mut self.comm, peer, "pp", &mut buf)?;
                    self.hidden = Some(buf);
                }
                Instr::Collective {
                    target: Target::HiddenStates,
                    ..
                } => self.collective(instr)?,
                other => {
                    return Err(fail(format!(
                    "unexpected instruction outside a segment of an inference program: {other:?}"
                )))
                }
            }
        }
        Ok(())
    }

    /// The logits the head segment produced: the loss's input, or its last matmul's
    /// output.
    fn head_logits(&mut self, s: usize) -> Result<D::Act, RankError> {
        let seg = &self.graph.segments[s];
        let name = seg
            .ops
            .iter()
            .find(|o| matches!(o.kind, OpKind::CrossEntropy { .. }))
            .map(|o| o.inputs[0])
            .or_else(|| {
                seg.ops
                    .iter()
                    .rev()
                    .find(|o| matches!(o.kind, OpKind::Matmul { .. }))
                    .and_then(|o| o.outputs.first().copied())
            })
            .map(|t| self.graph.tensor(t).name.clone())
            .ok_or_else(|| fail("the head segment produces no logits"))?;
        self.acts
            .remove(&name)
            .ok_or_else(|| fail(format!("the head did not produce `{name}`")))
    }

    fn run_body(&mut self, body: &[Instr], batch: &Batch, l: u64) -> Result<(), RankError> {
        for instr in body {
            match instr {
                Instr::Compute { name, .. } => {
                    let op = self.find_op(name)?;
                    self.forward_op(op, batch, l)?;
                }
                Instr::Collective { .. } => self.collective(instr)?,
                Instr::Recompute { body } => self.run_body(body, batch, l)?,
                other => {
                    return Err(fail(format!(
                        "unexpected instruction in an inference segment: {other:?}"
                    )))
                }
            }
        }
        Ok(())
    }

    fn collective(&mut self, instr: &Instr) -> Result<(), RankError> {
        let Instr::Collective {
            kind,
            group,
            axis,
            target,
            ..
        } = instr
        else {
            return Ok(());
        };
        let tensor = match target {
            // Plans lowered before sampling was planned hold the training loss's
            // statistics instead: nothing to reduce when generating.
            Target::LossStat { .. } => return Ok(()),
            // The experts op moves its tokens itself (counts follow the routing).
            Target::Experts { .. } => return Ok(()),
            Target::HiddenStates => {
                let g = self.group(group)?;
                let h = self
                    .hidden
                    .as_ref()
                    .ok_or_else(|| fail("no hidden states to gather"))?;
                let mut out = self.zeros(D::act_len(h) * g.size())?;
                self.dev
                    .all_gather_act(&mut self.comm, &g, axis.name(), h, &mut out)?;
                self.hidden = Some(out);
                return Ok(());
            }
            Target::Activation { tensor } => tensor.as_str(),
            Target::ActivationGrad { .. }
            | Target::HiddenStatesGrad
            | Target::SegmentParams { .. }
            | Target::SegmentGrads { .. }
            | Target::SegmentSeqPartialGrads { .. }
            | Target::TiedGrads
            | Target::SeqPartialGrads
            | Target::GradBucket { .. }
            | Target::ParamBucket { .. } => {
                return Err(fail(format!(
                    "`{target}` is a training collective; inference plans do not hold it"
                )))
            }
        };
        // The head's logits: `last_logits` gathers the last positions, the rows this
        // collective's bytes count.
        let is_logits = self.graph.segments.iter().flat_map(|s| &s.ops).any(|o| {
            matches!(o.kind, OpKind::CrossEntropy { .. })
                && o.inputs
                    .first()
                    .map(|&t| self.graph.tensor(t).name.as_str())
                    == Some(tensor)
        });
        if is_logits && *kind == CollectiveKind::AllGather {
            return Ok(());
        }
        let g = self.group(group)?;
        let n = g.size();
        let ax = axis.name();
        let buf = self
            .acts
            .get_mut(tensor)
            .ok_or_else(|| fail(format!("no tensor `{tensor}` to communicate")))?;
        let alloc = derr("allocation");
        match kind {
            CollectiveKind::AllReduce => self.dev.all_reduce_act(&mut self.comm, &g, ax, buf)?,
            CollectiveKind::AllGather => {
                let mut out = self.dev.act_zeros(D::act_len(buf) * n).map_err(&alloc)?;
                self.dev
                    .all_gather_act(&mut self.comm, &g, ax, buf, &mut out)?;
                self.acts.insert(format!("{tensor}@g"), out);
            }
            CollectiveKind::ReduceScatter => {
                let mut out = self.dev.act_zeros(D::act_len(buf) / n).map_err(&alloc)?;
                self.dev
                    .reduce_scatter_act(&mut self.comm, &g, ax, buf, &mut out)?;
                *buf = out;
            }
            other => {
                return Err(fail(format!(
                    "{other:?} on `{tensor}` is not run by the inference executor"
                )))
            }
        }
        Ok(())
    }

    /// Local (query heads, kv heads) of an attention op.
    fn heads(&self, att: &Op) -> Result<(usize, usize, usize, usize), RankError> {
        let OpKind::Attention(a) = &att.kind else {
            return Err(fail(format!("`{}` is not attention", att.name)));
        };
        let (hq, hkv, _) = if att.role == TpRole::Replicated {
            (a.heads as usize, a.kv_heads as usize, 0)
        } else {
            local_heads(a.heads, a.kv_heads, self.tp)
        };
        Ok((hq, hkv, a.qk_dim as usize, a.v_dim as usize))
    }

    fn forward_op(&mut self, op: &Op, batch: &Batch, l: u64) -> Result<(), RankError> {
        let out = op
            .outputs
            .first()
            .map(|&t| self.graph.tensor(t).name.clone())
            .unwrap_or_default();
        let rows = batch.rows();
        let eps = self.graph.constants.norm_eps as f32;
        let err = derr(&op.name);
        let y = match &op.kind {
            OpKind::Embedding => {
                let table_name = &self.graph.tensor(op.inputs[1]).name;
                let ids: Vec<u32> = if table_name == "embed.positions.w" {
                    batch.positions()
                } else {
                    batch.tokens.clone()
                };
                let table = self.weight(op, 1, l)?;
                let dim = self.hidden_width;
                let vocab_start = if op.role == TpRole::VocabEmbedding {
                    let full = fixed_shape(self.graph.tensor(op.inputs[1]))?[0];
                    self.tp.rank * (full / self.tp.size.max(1))
                } else {
                    0
                };
                let mut y = self.zeros(ids.len() * dim)?;
                let ids = self.dev.ids_upload(&ids).map_err(&err)?;
                self.dev
                    .embedding_fwd(&ids, table, vocab_start, dim, &mut y)
                    .map_err(&err)?;
                y
            }
            OpKind::Norm(kind) => {
                let x = self.act(op, 0)?;
                let w = self.weight(op, 1, l)?;
                let dim = D::act_len(w);
                let n = D::act_len(x) / dim.max(1);
                let mut y = self.zeros(D::act_len(x))?;
                let mut rstd = self.zeros_f32(n)?;
                match kind {
                    NormKind::Rmsnorm => self.dev.rmsnorm_fwd(x, w, n, dim, eps, &mut y, &mut rstd),
                    NormKind::Layernorm => {
                        let zeros;
                        let b = match op.inputs.get(2) {
                            Some(_) => self.weight(op, 2, l)?,
                            None => {
                                zeros = self.zeros(dim)?;
                                &zeros
                            }
                        };
                        let mut mean = self.zeros_f32(n)?;
                        self.dev
                            .layernorm_fwd(x, w, b, n, dim, eps, &mut y, &mut mean, &mut rstd)
                    }
                }
                .map_err(&err)?;
                y
            }
            OpKind::Matmul { .. } => {
                let in_name = &self.graph.tensor(op.inputs[0]).name;
                let x = match self.acts.get(&format!("{in_name}@g")) {
                    Some(g) if matches!(op.role, TpRole::ColumnParallel | TpRole::VocabHead) => g,
                    _ => self.act(op, 0)?,
                };
                let w = self.weight(op, 1, l)?;
                let kk = D::act_len(x) / rows.max(1);
                let n = D::act_len(w) / kk.max(1);
                let mut y = self.zeros(rows * n)?;
                let tb = if weight_transposed(op) {
                    k::Transpose::Yes
                } else {
                    k::Transpose::No
                };
                self.dev
                    .matmul(k::Transpose::No, tb, rows, kk, n, x, w, &mut y)
                    .map_err(&err)?;
                // A row-parallel bias is added once, before the partial sums meet.
                if op.inputs.get(2).is_some()
                    && (op.role != TpRole::RowParallel || self.tp.rank == 0)
                {
                    let b = self.weight(op, 2, l)?;
                    self.dev.bias_add(&mut y, b, rows, n).map_err(&err)?;
                }
                y
            }
            OpKind::Rope => {
                let att = self.consumer_attention(op)?;
                let (hq, hkv, d, dv) = self.heads(att)?;
                let x = self.act(op, 0)?;
                let width = hq * d + hkv * d + hkv * dv;
                let positions = self.dev.ids_upload(&batch.positions()).map_err(&err)?;
                let rope = crate::rope_of(&self.graph.constants);
                let mut y = self.zeros(D::act_len(x))?;
                self.dev
                    .rope_qkv(x, &positions, rows, hq, hkv, d, width, rope, false, &mut y)
                    .map_err(&err)?;
                y
            }
            OpKind::Attention(a) => self.attention(op, a.causal, batch, l)?,
            OpKind::Activation(MlpKind::Swiglu) => {
                let x = self.act(op, 0)?;
                let f = D::act_len(x) / (2 * rows.max(1));
                let mut y = self.zeros(rows * f)?;
                self.dev.swiglu_fwd(x, rows, f, &mut y).map_err(&err)?;
                y
            }
            OpKind::Activation(MlpKind::Gelu) => {
                let x = self.act(op, 0)?;
                let mut y = self.zeros(D::act_len(x))?;
                self.dev.gelu_fwd(x, &mut y).map_err(&err)?;
                y
            }
            OpKind::Add => {
                let (a, b) = (self.act(op, 0)?, self.act(op, 1)?);
                let mut y = self.zeros(D::act_len(a))?;
                self.dev.add(a, b, &mut y).map_err(&err)?;
                y
            }
            // Dropout is the identity at inference.
            OpKind::Dropout => {
                let x = self.act(op, 0)?;
                let n = D::act_len(x);
                let mut y = self.zeros(n)?;
                self.dev.act_copy(x, 0, &mut y, 0, n).map_err(&err)?;
                y
            }
            // Generation samples from the logits; the loss is not computed.
            OpKind::CrossEntropy { .. } => return Ok(()),
            OpKind::Experts(e) => self.experts(op, e, l, batch.routing, false)?,
            OpKind::Router { .. } => {
                return Err(fail(format!(
                    "`{}`: a separate router op is not run by the executor",
                    op.name
                )))
            }
        };
        self.acts.insert(out, y);
        Ok(())
    }

    /// Routed experts on this pass's tokens (`idle`: none, the rank serving only
    /// its experts to the rest of its expert group), on the host kernels: the
    /// tokens and router scores come down from the device and the output goes
    /// back.
    fn experts(
        &mut self,
        op: &Op,
        e: &meshplan_ir::graph::ExpertsShape,
        l: u64,
        routing: Routing,
        idle: bool,
    ) -> Result<D::Act, RankError> {
        let name = |i: usize| self.graph.tensor(op.inputs[i]).name.as_str();
        let err = derr(&op.name);
        let host = |i: usize| {
            let a = self.acts.get(name(i)).ok_or_else(|| {
                fail(format!(
                    "`{}` reads `{}` before it is produced",
                    op.name,
                    name(i)
                ))
            })?;
            self.dev.act_download(a).map_err(&err)
        };
        let weight = |i: usize| {
            let key = (op.name.clone(), name(i).to_string(), l);
            self.host_weights.get(&key).ok_or_else(|| {
                fail(format!(
                    "weight `{}` of `{}` (layer {l}) is not held by rank {}",
                    name(i),
                    op.name,
                    self.rank
                ))
            })
        };
        let (x, logits) = if idle {
            (Vec::new(), Vec::new())
        } else {
            (host(0)?, host(1)?)
        };
        let inputs = crate::moe::Inputs {
            x: &x,
            logits: &logits,
            w_up: weight(2)?,
            w_down: weight(3)?,
        };
        let place = crate::moe::Place {
            tp: self.tp,
            ep: self.ep,
            group: self.ep_group.as_ref(),
        };
        let out = crate::moe::forward(
            &HostDevice,
            &mut self.comm,
            &place,
            &op.name,
            e,
            &inputs,
            routing,
        )?;
        self.dev.act_from_host(out).map_err(&err)
    }

    fn consumer_attention(&self, op: &Op) -> Result<&'a Op, RankError> {
        self.graph
            .attention_fed_by(op)
            .ok_or_else(|| fail("rope feeds no attention op"))
    }

    /// Appends each request's new keys and values to its cache and attends its
    /// queries (at positions `pos0..pos0 + seq`) to everything cached.
    fn attention(
        &mut self,
        op: &Op,
        causal: bool,
        batch: &Batch,
        l: u64,
    ) -> Result<D::Act, RankError> {
        let (hq, hkv, d, dv) = self.heads(op)?;
        let b = batch.reqs.len();
        let seq = batch.seq;
        let scale = 1.0 / (d as f32).sqrt();
        let err = derr(&op.name);
        let x = self
            .acts
            .get(&self.graph.tensor(op.inputs[0]).name)
            .ok_or_else(|| fail(format!("`{}` has no input", op.name)))?;
        // `[s, b, q | k | v]` rows into `[b, s, heads, d]` blocks, one per request.
        let all = k::AttnDims {
            batch: b,
            sq: seq,
            sk: seq,
            hq,
            hkv,
            d,
            dv,
        };
        let (nq, nk, nv, no) = (seq * hq * d, seq * hkv * d, seq * hkv * dv, seq * hq * dv);
        let (mut q, mut kn, mut vn) = (
            self.zeros(b * nq)?,
            self.zeros(b * nk)?,
            self.zeros(b * nv)?,
        );
        self.dev
            .split_qkv(x, &all, &mut q, &mut kn, &mut vn)
            .map_err(&err)?;
        let mut o_all = self.zeros(b * no)?;
        for (bi, &req) in batch.reqs.iter().enumerate() {
            // The cache grows by this pass's keys and values.
            let (kc, vc) = match self.kv.remove(&(l, req)) {
                Some((mut kc, mut vc)) => {
                    self.dev
                        .act_append(&mut kc, &kn, bi * nk, nk)
                        .map_err(&err)?;
                    self.dev
                        .act_append(&mut vc, &vn, bi * nv, nv)
                        .map_err(&err)?;
                    (kc, vc)
                }
                None => {
                    let (mut kc, mut vc) = (self.zeros(nk)?, self.zeros(nv)?);
                    self.dev
                        .act_copy(&kn, bi * nk, &mut kc, 0, nk)
                        .map_err(&err)?;
                    self.dev
                        .act_copy(&vn, bi * nv, &mut vc, 0, nv)
                        .map_err(&err)?;
                    (kc, vc)
                }
            };
            let sk = D::act_len(&kc) / (hkv * d).max(1);
            if sk != batch.pos0[bi] + seq {
                return Err(fail(format!(
                    "`{}` layer {l}: the cache holds {sk} positions, expected {}",
                    op.name,
                    batch.pos0[bi] + seq
                )));
            }
            let qb = if b == 1 {
                None
            } else {
                let mut qb = self.zeros(nq)?;
                self.dev
                    .act_copy(&q, bi * nq, &mut qb, 0, nq)
                    .map_err(&err)?;
                Some(qb)
            };
            let dims = k::AttnDims {
                batch: 1,
                sq: seq,
                sk,
                hq,
                hkv,
                d,
                dv,
            };
            let mut o = self.zeros(no)?;
            let mut lse = self.zeros_f32(hq * seq)?;
            self.dev
                .attention_fwd(
                    &dims,
                    qb.as_ref().unwrap_or(&q),
                    &kc,
                    &vc,
                    (batch.pos0[bi], 0),
                    causal,
                    scale,
                    // Inference runs in eval mode: no dropout.
                    None,
                    &mut o,
                    &mut lse,
                )
                .map_err(&err)?;
            self.dev
                .act_copy(&o, 0, &mut o_all, bi * no, no)
                .map_err(&err)?;
            self.kv.insert((l, req), (kc, vc));
        }
        // `[b, s, hq dv]` back to sequence-major rows.
        let mut y = self.zeros(b * no)?;
        self.dev
            .transpose_bs(&o_all, b, seq, hq * dv, true, &mut y)
            .map_err(&err)?;
        Ok(y)
    }
}

/// Bytes each rank sent against the plan's programs, when the run has the plan's
/// shapes (every prompt `prompt_len` tokens, each replica decoding the plan's batch):
/// `None` otherwise. Per rank: its prefill phase once per request it served, its
/// decode phase once per step after the first token; the last stage also sends the
/// sampled tokens back to the first (4 bytes per request and step), which the plan
/// does not list. Expert-parallel bytes that follow the router
/// ([`InferReport::routed_ep_bytes`]) are left out, as training reports rather than
/// compares those of dropless experts ([`routed_ep_summary`] says what they were).
pub fn byte_mismatches(plan: &Plan, opts: &InferOptions, run: &InferReport) -> Option<Vec<String>> {
    let pool = PoolBytes {
        plan,
        counts: &run.counts,
        routed_ep: &run.routed_ep_bytes,
        prefill: true,
        decode: true,
        name: "",
        base: 0,
    };
    pool.mismatches(opts)
}

/// One pool's ranks of a run, for comparing their bytes with its plan's.
pub(crate) struct PoolBytes<'a> {
    pub(crate) plan: &'a Plan,
    /// Per rank of the plan, what it sent.
    pub(crate) counts: &'a [ByteCounts],
    /// Per rank of the plan, [`InferReport::routed_ep_bytes`].
    pub(crate) routed_ep: &'a [(f64, f64)],
    /// Whether its ranks prefilled their requests.
    pub(crate) prefill: bool,
    /// Whether its ranks decoded them.
    pub(crate) decode: bool,
    /// The pool's name in messages (`"prefill pool "`, or empty).
    pub(crate) name: &'a str,
    /// World rank of the plan's rank 0.
    pub(crate) base: usize,
}

impl PoolBytes<'_> {
    /// Every rank's difference from the plan's bytes on each axis (see
    /// [`byte_mismatches`]); `None` when the run does not have the plan's shapes.
    pub(crate) fn mismatches(&self, opts: &InferOptions) -> Option<Vec<String>> {
        let plan = self.plan;
        let meshplan_ir::Workload::Inference { prompt_len, .. } = plan.workload else {
            return None;
        };
        if opts.requests.iter().any(|r| r.len() as u64 != prompt_len) {
            return None;
        }
        let axis = |name: &str| plan.mesh.axes.iter().position(|a| a == name);
        let size = |name: &str| axis(name).map(|i| plan.mesh.shape[i] as usize).unwrap_or(1);
        let (dp, pp) = (size("dp").max(1), size("pp"));
        let mut out = Vec::new();
        for (rank, counts) in self.counts.iter().enumerate() {
            let entry = plan.ranks.get(rank)?;
            let program = plan.programs.get(entry.program as usize)?;
            let dp_index = axis("dp").map(|i| entry.coords[i] as usize).unwrap_or(0);
            let served = (0..opts.requests.len())
                .filter(|i| i % dp == dp_index)
                .count();
            let phase = |k: PhaseKind| program.phases.iter().find(|p| p.kind == k);
            let (pre, dec) = (phase(PhaseKind::Prefill)?, phase(PhaseKind::Decode)?);
            if self.decode && served > 0 && dec.dims.batch as usize != served {
                return None;
            }
            let passes = if self.prefill { served as f64 } else { 0.0 };
            let steps = if self.decode && served > 0 {
                opts.max_new_tokens as f64 - 1.0
            } else {
                0.0
            };
            let (p, d) = (pre.bytes_sent(), dec.bytes_sent());
            for ax in Axis::ALL {
                let mut want = passes * p.get(ax) + steps * d.get(ax);
                if ax == Axis::Pp && pp > 1 && program.stage + 1 == pp as u64 {
                    want += steps * served as f64 * 4.0;
                }
                let mut got = counts.axis_bytes_sent(ax.name());
                if ax == Axis::Ep {
                    let (sent, planned) = self.routed_ep.get(rank).copied().unwrap_or_default();
                    got -= sent;
                    want -= planned;
                }
                if (got - want).abs() > 1e-6 * want.max(1.0) {
                    out.push(format!(
                        "{}rank {} {}: measured {got} bytes, plan {want}",
                        self.name,
                        self.base + rank,
                        ax.name()
                    ));
                }
            }
        }
        Some(out)
    }
}

/// One line on the expert-parallel bytes that followed the router (left out of
/// [`byte_mismatches`]): the busiest rank's bytes beside the plan's figure for the
/// same passes under balanced routing; `None` when there were none.
pub fn routed_ep_summary(run: &InferReport) -> Option<String> {
    let (rank, &(sent, planned)) = run
        .routed_ep_bytes
        .iter()
        .enumerate()
        .max_by(|a, b| a.1 .0.total_cmp(&b.1 .0))?;
    (sent > 0.0 || planned > 0.0).then(|| {
        format!(
            "expert-parallel bytes that follow the router (dropless routing, decode steps): rank {rank} sent {sent}, the plan's balanced routing {planned}; not compared"
        )
    })
}
