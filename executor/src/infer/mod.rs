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
//! The last stage gathers the last position's logits over `tp` in fp32 on the device
//! (the head is split by vocabulary: the plan's AllGather of the logits, priced by
//! the cost model as `LayoutCtx::sampling`), picks the tokens there when decoding
//! greedily (only the tokens come back, and the logits the report keeps), and sends
//! the new tokens to the first stage (a few bytes per request the plan does not
//! list). A temperature samples on the host, from the downloaded logits.
//!
//! MoE layers run the training interpreter's experts (`moe::Exec::forward`): split over
//! `tp` like a dense MLP (the plan all-reduces their output), by expert over `ep`
//! (All-to-All), or over both: then every tensor rank, holding the same tokens,
//! routes its contiguous slice of them over `ep` and the slices' outputs are
//! gathered over `tp` (`sliced_expert_rows`; the plan's `Exchange::Gather`).
//! Prefill holds each expert to its capacity over the prompt (a capacity group is
//! one prompt, or a tensor rank's slice of it); decoding routes dropless, as the
//! cost model prices it (`ExpertsShape::dispatched_rows`), so the sharded run and
//! its single-rank reference (routing the same slices,
//! [`InferOptions::reference_of`]) keep the same tokens. An expert group spanning
//! replicas runs every pass together: a replica without a request for a pass runs
//! only its experts, on what the others send them.
//!
//! A disaggregated deployment runs its prefill pool's ranks and its decode pool's
//! through these same passes, the caches moving between them (`disagg.rs`).

use crate::comm::{ByteCounts, CommKind, Communicator, Group, RankError};
use crate::device::walk::{self, Coll, Forward};
use crate::device::{derr, AttnOut, DResult, Device, HostDevice};
use crate::moe::Routing;
use crate::program::{build_groups, fixed_shape, mesh_place, segment_input, segment_output};
use crate::sample::Sampling;
use crate::shard::TpPos;
use crate::train::{fail, rank_outs, ExecError, StepHook, NO_LAYER};
use crate::weights::Checkpoint;
use meshplan_ir::graph::OpKind;
use meshplan_ir::plan::{
    Axis, CollectiveKind, LocalTensor, Phase, PhaseKind, Plan, PlanKind, Target,
};
use meshplan_ir::{Graph, Op, TensorKind, TpRole};
use meshplan_kernels::cpu as k;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod check;
mod ops;
mod rank;

pub(crate) use check::PoolBytes;
pub use check::{
    byte_mismatches, check_inference, check_inference_mixed, routed_ep_summary, LOGIT_TOLERANCE,
    MIXED_LOGIT_TOLERANCE,
};

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
    /// A wait in the in-process world longer than this fails the run; `None`:
    /// no limit, since a rank may compute for minutes between two collectives
    /// (a deadlock fails at once either way).
    pub timeout: Option<Duration>,
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
    /// Told the tokens each request of the first replica holds so far: 1 once
    /// they are prefilled, then after each decode step (for a progress bar).
    pub on_token: Option<StepHook>,
    /// The experts route a pass's tokens as this many contiguous slices, one after
    /// the other, each prompt slice a capacity group: what a plan with experts over
    /// both `tp` and `ep` computes, its tensor ranks routing a slice each. Its
    /// single-rank reference takes the plan's `tp` ([`InferOptions::reference_of`]);
    /// 1 otherwise. A plan with experts over both axes slices by its `tp` whatever
    /// this says.
    pub moe_token_slices: usize,
}

impl InferOptions {
    /// These options for the single-rank reference of `plan` (a deployment's
    /// prefill pool, which holds prompts to expert capacity): the same token
    /// slices, since a capacity group is part of what the model computes.
    pub fn reference_of(&self, plan: &Plan) -> InferOptions {
        let prefill = crate::disagg::prefill_pool(plan).unwrap_or(plan);
        let s = &prefill.strategy;
        let has_experts = (prefill.graph.ops()).any(|o| matches!(o.kind, OpKind::Experts(_)));
        let slices = if has_experts && s.tp > 1 && s.ep > 1 {
            s.tp as usize
        } else {
            self.moe_token_slices
        };
        InferOptions {
            moe_token_slices: slices,
            on_token: None,
            ..self.clone()
        }
    }
}

impl Default for InferOptions {
    fn default() -> Self {
        InferOptions {
            requests: vec![vec![1, 2, 3]],
            max_new_tokens: 8,
            sampling: Sampling::GREEDY,
            seed: 1234,
            timeout: None,
            weights: None,
            threads_per_rank: 1,
            eos: Vec::new(),
            step_logits: false,
            on_token: None,
            moe_token_slices: 1,
        }
    }
}

/// One request's result.
#[derive(Clone, Debug, Default, PartialEq)]
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
    /// The fullest rank's weights, bytes (as the KV cache).
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
    // The layouts not run yet first: their weights split otherwise (DP-attention
    // keeps attention whole on every tensor rank), so the split check would name a
    // weight instead of the layout.
    if let Some(why) = layout_not_run(plan) {
        return Err(why);
    }
    crate::program::runnable(plan)?;
    // The tokens, not the table's rows: padded rows are no token.
    let vocab = graph
        .vocab()
        .ok_or("the plan's model has no token embedding")? as usize;
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
            // The last new token is sampled, never fed back: it takes no position.
            let need = (r.len() + opts.max_new_tokens).saturating_sub(1);
            if need > max {
                return Err(format!(
                    "request {i}: {} prompt tokens and {} new ({need} positions: every token but the last new one) exceed the model's {max} learned positions; shorten the prompt or ask for at most {} new tokens",
                    r.len(),
                    opts.max_new_tokens,
                    (max + 1).saturating_sub(r.len())
                ));
            }
        }
    }
    // The last new token is sampled, never fed back through the model.
    let longest = (opts.requests.iter().map(Vec::len).max().unwrap_or(0))
        .saturating_add(opts.max_new_tokens - 1);
    crate::check_executable(graph, longest)?;
    if let Some(op) = (graph.ops()).find(|o| matches!(o.kind, OpKind::Router { .. })) {
        return Err(format!(
            "`{}`: a separate router op is not run by the executor (the experts read a router matmul's scores)",
            op.name
        ));
    }
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

/// Why the executor does not run inference plan `plan`'s layout yet, if it does
/// not: context parallelism over the prompt, or DP-attention (each tensor rank
/// attending its own requests with whole attention weights). `plan` and `deploy`
/// say so when they write such a plan; `run` refuses it.
pub fn layout_not_run(plan: &Plan) -> Option<String> {
    let s = &plan.strategy;
    if s.cp > 1 {
        return Some(format!(
            "inference with cp={} (ring attention over the prompt) is not run by meshplan's executor yet; plan with cp=1",
            s.cp
        ));
    }
    s.dp_attention.then(|| {
        "dp_attention plans are not run by meshplan's executor yet; plan with dp_attention=false"
            .to_string()
    })
}

/// Rows of a weight table in the graph, if it has it.
fn table_rows(graph: &Graph, name: &str) -> Option<usize> {
    graph
        .tensors
        .iter()
        .find(|t| t.name == name)
        .and_then(|t| fixed_shape(t).ok().and_then(|s| s.first().copied()))
}

/// Checks that the Hugging Face weights to load, if any, are `plan`'s model's.
pub(crate) fn check_weights(plan: &Plan, opts: &InferOptions) -> Result<(), ExecError> {
    let Some(ck) = &opts.weights else {
        return Ok(());
    };
    ck.check_config(&plan.graph)?;
    ck.validate(&plan.graph)
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
    infer_on_with(plan, opts, make, None)
}

/// [`infer_on`] over given communicators, one per rank in rank order (one process
/// driving several GPUs: `NcclComm::in_process`), each rank a thread; `None`: the
/// in-process communicator.
pub fn infer_on_with<D: Device>(
    plan: &Plan,
    opts: &InferOptions,
    make: &(dyn Fn(usize) -> crate::device::DResult<D> + Sync),
    comms: Option<Vec<Box<D::Comm>>>,
) -> Result<InferReport, ExecError> {
    check_inputs(plan, opts).map_err(ExecError::Plan)?;
    check_weights(plan, opts)?;
    let world = plan.ranks.len();
    let rank = |comm: Box<D::Comm>| {
        let dev = make(comm.rank()).map_err(crate::device::derr("device"))?;
        let mut r = InferRank::new(dev, plan, comm, opts, 0)?;
        r.comm.barrier(&Group::world(world))?;
        let t0 = Instant::now();
        let outputs = r.generate(t0)?;
        Ok(r.finish(outputs, t0))
    };
    let results = match comms {
        Some(comms) => crate::comm::run_with(world, comms, &rank).map_err(ExecError::Plan)?,
        None => crate::comm::run_ranks(world, opts.timeout, opts.threads_per_rank, |c| {
            rank(D::host_comm(Box::new(c)))
        }),
    };
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
pub(crate) struct Prefilled<A = Vec<f32>, F = Vec<f32>> {
    /// The last position's full-vocabulary logits (last stage only).
    pub(crate) logits: Option<Last<F>>,
    /// Its KV cache entries.
    pub(crate) cache: RequestCache<A>,
}

/// A pass's last logits on the last stage: each request's last row, fp32, on the
/// device, its shards gathered over the tensor ranks as `picks` lays them out.
pub(crate) struct Last<F> {
    pub(crate) buf: F,
    pub(crate) picks: k::Picks,
}

impl<F> Last<F> {
    /// The logits on the host, `[rows, limit]`: each row's shards side by side, the
    /// padded columns left out.
    fn rows<D: Device<F32 = F>>(&self, dev: &D) -> DResult<Vec<f32>> {
        let x = dev.f32_download(&self.buf)?;
        let k::Picks {
            parts,
            rows,
            cols,
            limit,
        } = self.picks;
        let mut out = Vec::with_capacity(rows * limit);
        for r in 0..rows {
            for p in 0..parts {
                out.extend_from_slice(&x[(p * rows + r) * cols..(p * rows + r + 1) * cols]);
            }
            out.truncate((r + 1) * limit);
        }
        Ok(out)
    }
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
    /// The last step there is: the report keeps its logits.
    last_step: usize,
}

impl Progress {
    pub(crate) fn new(ids: &[usize], opts: &InferOptions) -> Progress {
        let outs = ids
            .iter()
            .map(|&i| RequestOutput {
                prompt_len: opts.requests[i].len(),
                ..RequestOutput::default()
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
            last_step: opts.max_new_tokens.saturating_sub(1),
        }
    }

    /// Chooses the tokens of slots `j0..` at step `step` from the pass's last logits
    /// `l` (step 0: the first token, from the prefill's) on the device, greedily or
    /// drawn, which hands back only the tokens. The
    /// recording rank (`now`, the time since the start, records the tokens) also
    /// downloads the logits when the report keeps a row of them: every first
    /// token's, a slot's last token's (at the last step or an end of sequence)
    /// and, with `step_logits`, every token's.
    pub(crate) fn take_tokens<D: Device>(
        &mut self,
        dev: &D,
        (j0, step): (usize, usize),
        l: &Last<D::F32>,
        sampling: &Sampling,
        now: Option<Duration>,
    ) -> DResult<()> {
        let width = l.picks.limit;
        // Greedy decoding needs no request indices.
        let nucleus = sampling.nucleus(step as u64);
        let requests: Vec<u32> = nucleus.map_or_else(Vec::new, |_| {
            let slots = &self.ids[j0..j0 + l.picks.rows];
            slots.iter().map(|&i| i as u32).collect()
        });
        let draw = nucleus.map(|s| (s, &requests[..]));
        let picked = dev.pick(&l.buf, l.picks, draw)?;
        let kept = |(i, &t): (usize, &u32)| {
            let j = j0 + i;
            !self.ended[j]
                && (step == 0
                    || step == self.last_step
                    || self.step_logits
                    || self.eos.contains(&t))
        };
        let keeps = now.is_some() && picked.iter().enumerate().any(kept);
        let rows = keeps.then(|| l.rows(dev)).transpose()?;
        for (i, &t) in picked.iter().enumerate() {
            let row = rows.as_deref().map(|r| &r[i * width..(i + 1) * width]);
            self.take_token((j0 + i, step), t, row, now);
        }
        Ok(())
    }

    /// Slot `j`'s token `t` of step `step`, chosen from `row` where the logits were
    /// downloaded; `now`, the time since the start, records it. An ended slot still
    /// feeds its token to the next step.
    fn take_token(
        &mut self,
        (j, step): (usize, usize),
        t: u32,
        row: Option<&[f32]>,
        now: Option<Duration>,
    ) {
        self.current[j] = t;
        if self.ended[j] {
            return;
        }
        self.ended[j] = self.eos.contains(&t);
        let Some(now) = now.map(|n| n.as_secs_f64()) else {
            return;
        };
        let o = &mut self.outs[j];
        o.tokens.push(t);
        o.ended_at_eos = self.ended[j];
        if let Some(row) = row {
            if self.step_logits {
                o.step_logits.push(row.to_vec());
            }
            o.logits = row.to_vec();
            if step == 0 {
                o.first_logits = row.to_vec();
            }
        }
        if step == 0 {
            self.first_at[j] = now;
            o.ttft_s = now;
        } else {
            o.tpot_s = (now - self.first_at[j]) / step as f64;
        }
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
}

/// Weight key: op, tensor and block layer (`NO_LAYER` outside blocks). Keyed by op
/// because a tied table is sliced by vocabulary rows for the head but may be
/// replicated for the embedding.
type WKey = (String, String, u64);

/// Where an inference rank sits on the mesh: its coordinates, its pipeline
/// stage, its data index, and its groups.
pub(crate) struct StagePos {
    coords: Vec<u64>,
    pub(crate) stage: u64,
    pub(crate) last_stage: u64,
    dp: usize,
    pub(crate) dp_index: usize,
    groups: BTreeMap<String, Group>,
}

/// One rank of an inference run on device `D`: its weights, activations and KV
/// cache live in the device's buffers; greedy decoding's tokens, and the logits the
/// report keeps, come to the host.
pub(crate) struct InferRank<'a, D: Device = HostDevice> {
    pub(crate) dev: D,
    plan: &'a Plan,
    graph: &'a Graph,
    /// The rank in the world (the communicator's).
    rank: usize,
    /// The world rank of the plan's rank 0: a serving pool's ranks follow the
    /// other pool's.
    base: usize,
    pub(crate) comm: Box<D::Comm>,
    /// Where this rank sits: its stage and data index.
    pub(crate) at: StagePos,
    pub(crate) tp: TpPos,
    ep: TpPos,
    /// The expert group, when the experts are split over ranks.
    ep_group: Option<Group>,
    /// Expert-parallel bytes of passes whose exchange follows the router: (sent,
    /// the plan's figure for those passes).
    routed_ep: (f64, f64),
    /// What of the communicator's counts the plan prices in fp32 whatever the
    /// model's dtype: the sampled positions' logits.
    f32_priced: ByteCounts,
    prefill: &'a Phase,
    decode: &'a Phase,
    opts: &'a InferOptions,
    /// Shared where ops read the same slice ([`InferRank::load_weights`]).
    weights: HashMap<WKey, Arc<D::Act>>,
    /// (layer, local request) -> keys `[len, hkv, d]` and values `[len, hkv, dv]`.
    kv: HashMap<(u64, usize), (D::Act, D::Act)>,
    hidden: Option<D::Act>,
    hidden_width: usize,
    /// The logits' columns, padding (`make_vocab_size_divisible_by`) included.
    vocab: usize,
    /// The tokens there are: the columns sampling and the report see.
    tokens: usize,
    acts: HashMap<String, D::Act>,
    /// Activations gathered over the tensor axis, beside `acts`, for the
    /// column-parallel ops that read them whole.
    gathered: HashMap<String, D::Act>,
    logits: Option<D::Act>,
}
