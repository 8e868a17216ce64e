//! Sharding strategies, one file per op family.
//!
//! A [`Strategy`] is one way to run an op on a mesh: the placement of each input and
//! output on each axis, the placement its input gradients come out in, the compute
//! time of the local shard (forward and backward, priced as `graph_cost` prices the
//! standard layout), the op's own communication, the weight-gradient synchronisation
//! it implies, and what it keeps in memory.
//!
//! Each family proposes, per mesh axis, a list of one-axis choices (`AxisChoice`);
//! [`generate`] takes their cartesian product over the axes, drops the combinations
//! whose sharded dims do not divide, and prices the rest. Resharding between ops is
//! not part of a strategy: a partial output is resolved on the edge, by the placement
//! its consumer asks for (see [`crate::redistribute`]).

use crate::intra::IntraOptions;
use crate::mesh::Mesh;
use crate::placement::{local_fraction, Placement};
use meshplan_cost_model::collective::bytes_sent_per_rank;
use meshplan_cost_model::Collective;
use meshplan_ir::{Dim, Graph, Op, OpKind, Tensor, TensorId, TensorKind, TpRole};

pub mod attention;
pub mod embedding;
pub mod loss;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod pointwise;

/// When a communication happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// In every micro-batch's forward pass.
    Forward,
    /// In every micro-batch's backward pass.
    Backward,
    /// Once per optimizer step (weight-gradient synchronisation): amortised over
    /// `IntraOptions::microbatches` micro-batches.
    PerStep,
}

/// One communication an op (or its weights) needs.
#[derive(Clone, Debug, PartialEq)]
pub struct CommItem {
    /// Mesh axis index.
    pub axis: usize,
    /// The collective; `None` for ring attention's point-to-point passes.
    pub kind: Option<Collective>,
    /// Message size in `CommModel`'s convention.
    pub bytes: f64,
    /// Exposed time of one occurrence.
    pub time_s: f64,
    /// Bytes one rank sends.
    pub sent_bytes: f64,
    /// When it happens.
    pub phase: Phase,
}

impl CommItem {
    /// Time charged to one micro-batch (per-step items amortised).
    pub fn per_microbatch_s(&self, microbatches: f64) -> f64 {
        match self.phase {
            Phase::PerStep => self.time_s / microbatches.max(1.0),
            _ => self.time_s,
        }
    }
}

/// One way to run an op on a mesh.
#[derive(Clone, Debug, PartialEq)]
pub struct Strategy {
    /// Per axis, the family's name of the choice (`col`, `row`, `heads`, `R`, ...),
    /// joined by `,`.
    pub label: String,
    /// Per axis, the standard role this choice is priced like by `graph_cost`.
    pub axis_roles: Vec<TpRole>,
    /// Per op input, per axis.
    pub inputs: Vec<Vec<Placement>>,
    /// Per op input, per axis: the placement the input's gradient comes out in
    /// (`Partial` where each rank computes an addend).
    pub input_grads: Vec<Vec<Placement>>,
    /// Per op output, per axis.
    pub outputs: Vec<Vec<Placement>>,
    /// Forward compute of the local shard.
    pub fwd_s: f64,
    /// Backward compute of the local shard.
    pub bwd_s: f64,
    /// The op's own communication (ring attention, Ulysses, vocab loss reductions,
    /// expert dispatch), not counting redistribution on its edges.
    pub comm: Vec<CommItem>,
    /// Per op input (empty for non-weights): gradient synchronisation of the weight.
    pub weight_sync: Vec<Vec<CommItem>>,
    /// Per op input (0 for non-weights): bytes of weight state held per rank
    /// (parameters, gradients, optimizer state, ZeRO applied).
    pub weight_bytes: Vec<f64>,
    /// Activation bytes kept for backward on one rank (before the multiplier).
    pub saved_bytes: f64,
}

impl Strategy {
    /// Time of the op's own communication per micro-batch.
    pub fn own_comm_s(&self, microbatches: f64) -> f64 {
        self.comm
            .iter()
            .map(|c| c.per_microbatch_s(microbatches))
            .sum()
    }

    /// Weight synchronisation time per micro-batch of input `i`.
    pub fn weight_sync_s(&self, i: usize, microbatches: f64) -> f64 {
        self.weight_sync.get(i).map_or(0.0, |v| {
            v.iter().map(|c| c.per_microbatch_s(microbatches)).sum()
        })
    }
}

/// One family's choice on one axis.
#[derive(Clone, Debug)]
pub(crate) struct AxisChoice {
    pub label: String,
    pub role: TpRole,
    pub inputs: Vec<Placement>,
    pub grads: Vec<Placement>,
    pub outputs: Vec<Placement>,
}

impl AxisChoice {
    /// Everything replicated: the op runs redundantly on the axis.
    pub fn replicate(n_in: usize, n_out: usize) -> AxisChoice {
        AxisChoice {
            label: "R".into(),
            role: TpRole::Replicated,
            inputs: vec![Placement::Replicate; n_in],
            grads: vec![Placement::Replicate; n_in],
            outputs: vec![Placement::Replicate; n_out],
        }
    }
}

/// What a family sees while generating.
pub(crate) struct Ctx<'a> {
    pub graph: &'a Graph,
    pub op: &'a Op,
    pub mesh: &'a Mesh,
    pub opts: &'a IntraOptions,
    pub zero_stage: u8,
}

impl<'a> Ctx<'a> {
    pub fn tensor(&self, id: TensorId) -> Option<&'a Tensor> {
        self.graph.tensors.get(id.0 as usize)
    }

    pub fn input(&self, i: usize) -> Option<&'a Tensor> {
        self.op.inputs.get(i).and_then(|&id| self.tensor(id))
    }

    pub fn output(&self, i: usize) -> Option<&'a Tensor> {
        self.op.outputs.get(i).and_then(|&id| self.tensor(id))
    }

    pub fn dim_value(&self, d: Dim) -> f64 {
        match d {
            Dim::Batch => self.opts.env.batch,
            Dim::Seq => self.opts.env.seq,
            Dim::Kv => self.opts.env.kv,
            Dim::Fixed(n) => n as f64,
        }
    }

    pub fn bytes(&self, t: &Tensor) -> f64 {
        t.bytes().eval(&self.opts.env)
    }

    pub fn local_bytes(&self, t: &Tensor, p: &[Placement]) -> f64 {
        self.bytes(t) * local_fraction(p, &self.mesh.sizes())
    }

    /// May a dim of this kind be split on `axis` at all? Sequence (and key) dims only
    /// on a `cp` axis, or anywhere under sequence parallelism; `ep` splits tokens too.
    pub fn splittable(&self, d: Dim, axis: usize) -> bool {
        let name = self.mesh.axes.get(axis).map_or("", |a| a.name.as_str());
        match d {
            Dim::Seq | Dim::Kv => self.opts.allow_seq_split || name == "cp" || name == "ep",
            _ => true,
        }
    }

    pub fn axis_name(&self, axis: usize) -> &str {
        self.mesh.axes.get(axis).map_or("", |a| a.name.as_str())
    }

    pub fn axis_size(&self, axis: usize) -> u64 {
        self.mesh.axes.get(axis).map_or(1, |a| a.size)
    }

    /// Product of the sizes of the axes whose choice `pick` accepts.
    pub fn split_product(&self, combo: &[&AxisChoice], pick: impl Fn(&AxisChoice) -> bool) -> f64 {
        combo
            .iter()
            .enumerate()
            .filter(|(_, c)| pick(c))
            .map(|(a, _)| self.axis_size(a) as f64)
            .product()
    }

    /// Memory-bound compute: bytes of the activations read and written (inputs and
    /// outputs that are not weights or indices, `out_times` for outputs), forward and
    /// `bwd_factor` times as much backward, as `graph_cost` prices them.
    pub fn memory_bound(&self, s: &Strategy, bwd_factor: f64, out_times: f64) -> (f64, f64) {
        let mut bytes = 0.0;
        let acts = |t: &Tensor| t.kind != TensorKind::Weight && t.kind != TensorKind::Index;
        for (i, &id) in self.op.inputs.iter().enumerate() {
            if let (Some(t), Some(p)) = (self.tensor(id), s.inputs.get(i)) {
                if acts(t) {
                    bytes += self.local_bytes(t, p);
                }
            }
        }
        for (i, &id) in self.op.outputs.iter().enumerate() {
            if let (Some(t), Some(p)) = (self.tensor(id), s.outputs.get(i)) {
                if acts(t) {
                    bytes += out_times * self.local_bytes(t, p);
                }
            }
        }
        let roof = &self.opts.roof;
        (roof.memory_s(bytes), roof.memory_s(bytes * bwd_factor))
    }
}

/// A family: its per-axis choices, how many outputs must divide evenly, and its
/// pricing of one combination (false rejects it).
pub(crate) trait Family {
    fn choices(&self, ctx: &Ctx, axis: usize) -> Vec<AxisChoice>;
    fn checked_outputs(&self, ctx: &Ctx) -> usize {
        ctx.op.outputs.len()
    }
    fn finish(&self, ctx: &Ctx, combo: &[&AxisChoice], s: &mut Strategy) -> bool;
}

/// Every strategy of `op` on `mesh` (empty if the op references unknown tensors or
/// nothing divides). `zero_stage` (0-3) shards weight state on a `dp` axis.
pub fn generate(
    graph: &Graph,
    op: &Op,
    mesh: &Mesh,
    opts: &IntraOptions,
    zero_stage: u8,
) -> Vec<Strategy> {
    let ctx = Ctx {
        graph,
        op,
        mesh,
        opts,
        zero_stage,
    };
    if op
        .inputs
        .iter()
        .chain(&op.outputs)
        .any(|&id| ctx.tensor(id).is_none())
    {
        return Vec::new();
    }
    match &op.kind {
        OpKind::Matmul { .. } => combine(&ctx, &matmul::Matmul),
        OpKind::Norm(_) => combine(&ctx, &norm::Norm),
        OpKind::Attention(_) => combine(&ctx, &attention::Attention),
        OpKind::Embedding => combine(&ctx, &embedding::Embedding),
        OpKind::CrossEntropy { .. } => combine(&ctx, &loss::CrossEntropy),
        OpKind::Experts(_) => combine(&ctx, &moe::Experts),
        OpKind::Add
        | OpKind::Dropout
        | OpKind::Activation(_)
        | OpKind::Rope
        | OpKind::Router { .. } => combine(&ctx, &pointwise::Pointwise),
    }
}

/// Whether every sharded dim of `t` under `p` divides by the axes sharding it.
fn divides(ctx: &Ctx, t: &Tensor, p: &[Placement]) -> bool {
    let mut prod = vec![1u64; t.shape.len()];
    for (a, pl) in p.iter().enumerate() {
        if let Placement::Shard(d) = pl {
            match prod.get_mut(*d as usize) {
                Some(x) => *x = x.saturating_mul(ctx.axis_size(a)),
                None => return false,
            }
        }
    }
    t.shape.iter().zip(&prod).all(|(&d, &n)| {
        let v = ctx.dim_value(d);
        let q = v / n as f64;
        n == 1 || (v >= n as f64 && (q - q.round()).abs() < 1e-9)
    })
}

/// Splits `param_state_bytes` per element into (parameter, gradient, optimizer) bytes.
fn state_split(total: f64, elem: f64) -> (f64, f64, f64) {
    let p = total.min(elem);
    let g = (total - p).min(elem);
    (p, g, (total - p - g).max(0.0))
}

fn weight_terms(ctx: &Ctx, t: &Tensor, p: &[Placement], g: &[Placement]) -> (f64, Vec<CommItem>) {
    let sizes = ctx.mesh.sizes();
    let elems = t.elems().eval(&ctx.opts.env) * local_fraction(p, &sizes);
    let elem = t.dtype.size_bytes() as f64;
    let full = ctx.bytes(t);
    let zero = ctx.zero_stage;
    let mut zero_div = 1.0;
    let mut items = Vec::new();
    for (a, axis) in ctx.mesh.axes.iter().enumerate() {
        if g.get(a) != Some(&Placement::Partial) || axis.size <= 1 {
            continue;
        }
        let mut buf = full;
        for (j, other) in ctx.mesh.axes.iter().enumerate() {
            if j != a && p.get(j).is_some_and(|x| x.is_shard()) {
                buf /= other.size as f64;
            }
        }
        let mut push = |kind: Collective, phase: Phase| {
            items.push(CommItem {
                axis: a,
                kind: Some(kind),
                bytes: buf,
                time_s: ctx.opts.comm.time_s(kind, axis.group, buf),
                sent_bytes: bytes_sent_per_rank(kind, axis.size, buf),
                phase,
            })
        };
        let dp = axis.name == "dp" && p.get(a) == Some(&Placement::Replicate);
        if dp && zero >= 3 {
            // ZeRO-3: parameters gathered before each use, gradients scattered after.
            push(Collective::AllGather, Phase::Forward);
            push(Collective::AllGather, Phase::Backward);
            push(Collective::ReduceScatter, Phase::Backward);
        } else if dp && zero >= 1 {
            // ZeRO-1: gradients reduce-scattered once per step; ZeRO-2: in every
            // micro-batch. Both gather the updated shards once per step.
            let scatter = if zero == 2 {
                Phase::Backward
            } else {
                Phase::PerStep
            };
            push(Collective::ReduceScatter, scatter);
            push(Collective::AllGather, Phase::PerStep);
        } else {
            push(Collective::AllReduce, Phase::PerStep);
        }
        if dp {
            zero_div *= axis.size as f64;
        }
    }
    let (pb, gb, ob) = state_split(ctx.opts.param_state_bytes, elem);
    let f = |stage: u8| if zero >= stage { 1.0 / zero_div } else { 1.0 };
    let bytes = elems * (pb * f(3) + gb * f(2) + ob * f(1));
    (bytes, items)
}

fn combine(ctx: &Ctx, fam: &dyn Family) -> Vec<Strategy> {
    let n_axes = ctx.mesh.axes.len();
    let per_axis: Vec<Vec<AxisChoice>> = (0..n_axes).map(|a| fam.choices(ctx, a)).collect();
    if per_axis.iter().any(|c| c.is_empty()) {
        return Vec::new();
    }
    let n_in = ctx.op.inputs.len();
    let n_out = ctx.op.outputs.len();
    let checked = fam.checked_outputs(ctx).min(n_out);
    let mut out = Vec::new();
    let mut idx = vec![0usize; n_axes];
    loop {
        let combo: Vec<&AxisChoice> = idx.iter().zip(&per_axis).map(|(&i, c)| &c[i]).collect();
        if let Some(s) = build(ctx, fam, &combo, n_in, n_out, checked) {
            out.push(s);
        }
        // Next combination (odometer).
        let mut a = 0;
        loop {
            if a == n_axes {
                return out;
            }
            idx[a] += 1;
            if idx[a] < per_axis[a].len() {
                break;
            }
            idx[a] = 0;
            a += 1;
        }
    }
}

fn build(
    ctx: &Ctx,
    fam: &dyn Family,
    combo: &[&AxisChoice],
    n_in: usize,
    n_out: usize,
    checked: usize,
) -> Option<Strategy> {
    let gather = |f: &dyn Fn(&AxisChoice) -> &Vec<Placement>, i: usize| -> Option<Vec<Placement>> {
        combo.iter().map(|c| f(c).get(i).copied()).collect()
    };
    let inputs: Vec<Vec<Placement>> = (0..n_in)
        .map(|i| gather(&|c| &c.inputs, i))
        .collect::<Option<_>>()?;
    let input_grads: Vec<Vec<Placement>> = (0..n_in)
        .map(|i| gather(&|c| &c.grads, i))
        .collect::<Option<_>>()?;
    let outputs: Vec<Vec<Placement>> = (0..n_out)
        .map(|i| gather(&|c| &c.outputs, i))
        .collect::<Option<_>>()?;
    for (i, p) in inputs.iter().enumerate() {
        if !divides(ctx, ctx.input(i)?, p) {
            return None;
        }
    }
    for (i, p) in outputs.iter().enumerate().take(checked) {
        if !divides(ctx, ctx.output(i)?, p) {
            return None;
        }
    }
    let mut weight_sync = vec![Vec::new(); n_in];
    let mut weight_bytes = vec![0.0; n_in];
    for i in 0..n_in {
        let t = ctx.input(i)?;
        if t.kind == TensorKind::Weight {
            let (b, items) = weight_terms(ctx, t, &inputs[i], &input_grads[i]);
            weight_bytes[i] = b;
            weight_sync[i] = items;
        }
    }
    let mut saved = 0.0;
    let mut seen: Vec<TensorId> = Vec::new();
    for &id in &ctx.op.saves {
        if seen.contains(&id) {
            continue;
        }
        seen.push(id);
        let p = if let Some(i) = ctx.op.inputs.iter().position(|&x| x == id) {
            &inputs[i]
        } else if let Some(i) = ctx.op.outputs.iter().position(|&x| x == id) {
            &outputs[i]
        } else {
            continue;
        };
        saved += ctx.local_bytes(ctx.tensor(id)?, p);
    }
    let mut s = Strategy {
        label: combo
            .iter()
            .map(|c| c.label.as_str())
            .collect::<Vec<_>>()
            .join(","),
        axis_roles: combo.iter().map(|c| c.role).collect(),
        inputs,
        input_grads,
        outputs,
        fwd_s: 0.0,
        bwd_s: 0.0,
        comm: Vec::new(),
        weight_sync,
        weight_bytes,
        saved_bytes: saved,
    };
    if fam.finish(ctx, combo, &mut s) {
        Some(s)
    } else {
        None
    }
}

/// Placement list helper: `Shard(d)` for tensors whose dims include `d`, else `R`.
pub(crate) fn shard_if(cond: bool, d: usize) -> Placement {
    if cond {
        Placement::Shard(d as u8)
    } else {
        Placement::Replicate
    }
}
