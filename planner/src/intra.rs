//! Intra-op planning: one strategy per op of a segment, chosen by an ILP.
//!
//! A problem is one Block segment, or the Embed and Head segments together (a tied
//! embedding is one tensor in both and gets one placement). Nodes are the ops, plus a
//! *boundary* node: the placement of the residual stream between blocks. A block's
//! input is read in the boundary placement and its output is redistributed to it, so
//! consecutive blocks chain; the Embed+Head problem writes the embedding's output in
//! it and reads the head's input from it, using the block's boundary placement (given
//! in [`IntraExtras::boundary`], or found by solving the graph's first block).
//!
//! The objective is the time of one micro-batch through one copy of the segment:
//! compute of each op's local shard, the op's own communication, weight-gradient
//! synchronisation amortised over `microbatches`, and on every producer-consumer edge
//! the redistribution forward plus its backward counterpart (the gradient flows from
//! consumer to producer: `R -> S` is free forward and an AllGather backward; a
//! partial input gradient is reduced on the edge, by AllReduce or ReduceScatter).
//! Memory (optional limit) is the activations kept for backward times
//! `activation_multiplier` plus weight state at `param_state_bytes` per element.

use crate::ilp::{self, Edge, IlpError, Node, Problem};
use crate::mesh::Mesh;
use crate::placement::{local_fraction, placement_strings, Placement};
use crate::redistribute::{redistribute, Step};
use crate::strategy::{self, CommItem, Phase, Strategy};
use meshplan_cost_model::compute::Roofline;
use meshplan_cost_model::{Collective, CommModel};
use meshplan_ir::{
    Dim, DimEnv, Graph, OpKind, SegmentKind, Tensor, TensorId, TensorKind, TpRole, TpSplit,
};
use std::collections::HashMap;
use std::fmt;

/// What an intra-op problem is priced with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IntraOptions {
    /// Micro-batch (sequences over the whole mesh) and sequence sizes.
    pub env: DimEnv,
    /// Compute throughput of one GPU.
    pub roof: Roofline,
    /// Links.
    pub comm: CommModel,
    /// Megatron sequence parallelism: sequence dims may be split on any axis (always
    /// on a `cp` or `ep` axis).
    pub allow_seq_split: bool,
    /// Per-rank memory limit for one copy of the segment (activations and weights).
    pub memory_limit_bytes: Option<f64>,
    /// Bytes per held weight element (parameter, gradient and optimizer state; e.g. 16
    /// for mixed-precision Adam, 2 for bf16 inference).
    pub param_state_bytes: f64,
    /// Factor on saved activation bytes (e.g. for allocator slack or several micro-
    /// batches in flight).
    pub activation_multiplier: f64,
    /// Micro-batches per optimizer step: per-step weight synchronisation is divided by it.
    pub microbatches: f64,
}

/// Options most callers leave at their defaults.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IntraExtras {
    /// ZeRO stage (0-3) for weights replicated on a `dp` axis.
    pub zero_stage: u8,
    /// The residual-stream placement (one per axis) to use instead of choosing it.
    pub boundary: Option<Vec<Placement>>,
    /// `(op name, strategy label)`: restrict those ops to that strategy (e.g. to price
    /// a hand-given layout through the same objective).
    pub fixed: Vec<(String, String)>,
}

/// Why a segment could not be planned.
#[derive(Clone, Debug, PartialEq)]
pub enum IntraError {
    /// The segment list is not one Block, or Embed/Head segments.
    BadSegments(String),
    /// An op has no strategy on this mesh (nothing divides, or a fixed label matches none).
    NoStrategy(String),
    /// No assignment satisfies the edges and the memory limit.
    Infeasible(String),
    /// The solver failed.
    Solver(String),
    /// The solver's answer failed verification.
    Verification(String),
    /// Too large to enumerate (brute force).
    TooLarge(f64),
}

impl fmt::Display for IntraError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IntraError::BadSegments(s) => write!(f, "bad segment list: {s}"),
            IntraError::NoStrategy(op) => write!(f, "op `{op}` has no strategy on this mesh"),
            IntraError::Infeasible(s) => write!(f, "no feasible placement: {s}"),
            IntraError::Solver(s) => write!(f, "ILP solver: {s}"),
            IntraError::Verification(s) => write!(f, "solution failed verification: {s}"),
            IntraError::TooLarge(n) => write!(f, "{n:e} assignments are too many to enumerate"),
        }
    }
}

impl std::error::Error for IntraError {}

impl From<IlpError> for IntraError {
    fn from(e: IlpError) -> IntraError {
        match e {
            IlpError::Infeasible => {
                IntraError::Infeasible("edges or the memory limit exclude every assignment".into())
            }
            IlpError::EmptyNode(n) => IntraError::NoStrategy(format!("node {n}")),
            IlpError::TooLarge(n) => IntraError::TooLarge(n),
            IlpError::Solver(s) | IlpError::Malformed(s) => IntraError::Solver(s),
        }
    }
}

/// The strategy chosen for one op.
#[derive(Clone, Debug, PartialEq)]
pub struct OpChoice {
    /// Segment index in the graph.
    pub segment: usize,
    /// Op index in the segment.
    pub op: usize,
    /// Op name.
    pub name: String,
    /// The strategy.
    pub strategy: Strategy,
}

/// One communication of the chosen plan, per micro-batch (or per step).
#[derive(Clone, Debug, PartialEq)]
pub struct CollectiveRecord {
    /// Axis name.
    pub axis: String,
    /// The collective.
    pub kind: Collective,
    /// Message size in `CommModel`'s convention.
    pub bytes: f64,
    /// Time of one occurrence.
    pub time_s: f64,
    /// Bytes one rank sends.
    pub sent_bytes: f64,
    /// When.
    pub phase: Phase,
    /// The tensor (or op, for an op's own communication) it moves.
    pub what: String,
}

/// An optimal (verified) choice for one problem.
#[derive(Clone, Debug, PartialEq)]
pub struct Solution {
    /// Objective: seconds per micro-batch through one copy of the segments.
    pub cost_s: f64,
    /// Of which local compute.
    pub compute_s: f64,
    /// Of which communication (edges, ops' own, amortised weight synchronisation).
    pub comm_s: f64,
    /// Per-rank memory (saved activations times the multiplier, weight state).
    pub memory_bytes: f64,
    /// One entry per op, in segment order.
    pub choice: Vec<OpChoice>,
    /// The residual-stream placement, per axis (empty if the problem has none).
    pub boundary: Vec<Placement>,
    /// Mesh axis names.
    pub axes: Vec<String>,
    /// Every communication of the plan.
    pub collectives: Vec<CollectiveRecord>,
    /// Placement of every tensor the problem touches (the producer's for activations).
    pub tensors: Vec<(TensorId, Vec<Placement>)>,
}

impl Solution {
    /// Per op, the `TpRole` that `graph_cost` would price like the chosen strategy on
    /// `axis_name` (`Replicated` for every op if the mesh has no such axis).
    pub fn roles(&self, _graph: &Graph, axis_name: &str) -> Vec<(usize, usize, TpRole)> {
        let ax = self.axes.iter().position(|a| a == axis_name);
        self.choice
            .iter()
            .map(|c| {
                let role = ax
                    .and_then(|a| c.strategy.axis_roles.get(a).copied())
                    .unwrap_or(TpRole::Replicated);
                (c.segment, c.op, role)
            })
            .collect()
    }

    /// Tensor name -> per-axis placement strings, sorted by name.
    pub fn placements(&self, graph: &Graph) -> Vec<(String, Vec<String>)> {
        let mut v: Vec<(String, Vec<String>)> = self
            .tensors
            .iter()
            .filter_map(|(id, p)| {
                graph
                    .tensors
                    .get(id.0 as usize)
                    .map(|t| (t.name.clone(), placement_strings(p)))
            })
            .collect();
        v.sort();
        v.dedup_by(|a, b| a.0 == b.0);
        v
    }

    fn of_phase(&self, phase: Phase) -> Vec<(String, Collective, f64)> {
        self.collectives
            .iter()
            .filter(|c| c.phase == phase)
            .map(|c| (c.axis.clone(), c.kind, c.bytes))
            .collect()
    }

    /// Collectives of one micro-batch's forward pass: (axis, kind, bytes).
    pub fn forward_collectives(&self) -> Vec<(String, Collective, f64)> {
        self.of_phase(Phase::Forward)
    }

    /// Collectives of one micro-batch's backward pass.
    pub fn backward_collectives(&self) -> Vec<(String, Collective, f64)> {
        self.of_phase(Phase::Backward)
    }

    /// Collectives once per optimizer step (weight-gradient synchronisation).
    pub fn step_collectives(&self) -> Vec<(String, Collective, f64)> {
        self.of_phase(Phase::PerStep)
    }

    /// The strategy label chosen for the op called `name`.
    pub fn label_of(&self, name: &str) -> Option<&str> {
        self.choice
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.strategy.label.as_str())
    }
}

/// Where an edge end sits.
#[derive(Clone, Copy, Debug, PartialEq)]
enum End {
    Out(usize),
    In(usize),
    Boundary,
}

#[derive(Clone, Debug)]
struct EdgeMeta {
    tensor: TensorId,
    a: usize,
    a_end: End,
    b: usize,
    b_end: End,
    tie: bool,
}

struct Built {
    problem: Problem,
    ops: Vec<(usize, usize)>,
    strategies: Vec<Vec<Strategy>>,
    /// Weight inputs each op owns (counts memory and synchronisation for).
    owned: Vec<Vec<bool>>,
    boundary: Vec<Vec<Placement>>,
    boundary_node: Option<usize>,
    edges: Vec<EdgeMeta>,
    boundary_in: Vec<TensorId>,
}

fn tensor(graph: &Graph, id: TensorId) -> Option<&Tensor> {
    graph.tensors.get(id.0 as usize)
}

fn dim_value(env: &DimEnv, d: Dim) -> f64 {
    match d {
        Dim::Batch => env.batch,
        Dim::Seq => env.seq,
        Dim::Kv => env.kv,
        Dim::Fixed(n) => n as f64,
    }
}

/// Residual-stream placements: per axis `R` or a split token dim, where it divides.
fn boundary_candidates(t: &Tensor, mesh: &Mesh, opts: &IntraOptions) -> Vec<Vec<Placement>> {
    let mut out: Vec<Vec<Placement>> = vec![Vec::new()];
    for axis in &mesh.axes {
        let mut opts_axis = vec![Placement::Replicate];
        for (d, &dim) in t
            .shape
            .iter()
            .enumerate()
            .take(t.shape.len().saturating_sub(1))
        {
            let ok = match dim {
                Dim::Seq | Dim::Kv => {
                    opts.allow_seq_split || axis.name == "cp" || axis.name == "ep"
                }
                _ => true,
            };
            if ok {
                opts_axis.push(Placement::Shard(d as u8));
            }
        }
        out = out
            .into_iter()
            .flat_map(|p| {
                opts_axis.iter().map(move |&x| {
                    let mut q = p.clone();
                    q.push(x);
                    q
                })
            })
            .collect();
    }
    out.retain(|p| {
        t.shape.iter().enumerate().all(|(d, &dim)| {
            let n: u64 = p
                .iter()
                .zip(&mesh.axes)
                .filter(|(x, _)| **x == Placement::Shard(d as u8))
                .map(|(_, a)| a.size)
                .product();
            let v = dim_value(&opts.env, dim);
            let q = v / n as f64;
            n == 1 || (v >= n as f64 && (q - q.round()).abs() < 1e-9)
        })
    });
    out
}

type EdgeKey = (Vec<Placement>, Vec<Placement>, Vec<Placement>, u64);

/// Forward and backward steps of an edge, `None` if infeasible.
fn edge_steps(
    src: &[Placement],
    dst: &[Placement],
    dst_grad: &[Placement],
    mesh: &Mesh,
    comm: &CommModel,
    bytes: f64,
) -> Option<(Vec<Step>, Vec<Step>)> {
    let fwd = redistribute(src, dst, mesh, comm, bytes).ok()?;
    let src_grad: Vec<Placement> = src.iter().map(|p| p.grad()).collect();
    let bwd = redistribute(dst_grad, &src_grad, mesh, comm, bytes).ok()?;
    Some((fwd, bwd))
}

fn steps_time(s: &[Step]) -> f64 {
    s.iter().map(|x| x.time_s).sum()
}

fn op_cost(s: &Strategy, owned: &[bool], opts: &IntraOptions) -> (f64, f64) {
    let mb = opts.microbatches;
    let mut cost = s.fwd_s + s.bwd_s + s.own_comm_s(mb);
    let mut mem = s.saved_bytes * opts.activation_multiplier;
    for (i, &o) in owned.iter().enumerate() {
        if o {
            cost += s.weight_sync_s(i, mb);
            mem += s.weight_bytes.get(i).copied().unwrap_or(0.0);
        }
    }
    (cost, mem)
}

fn build(
    graph: &Graph,
    segments: &[usize],
    mesh: &Mesh,
    opts: &IntraOptions,
    extras: &IntraExtras,
) -> Result<Built, IntraError> {
    if segments.is_empty() {
        return Err(IntraError::BadSegments("empty".into()));
    }
    let mut kinds = Vec::new();
    for &s in segments {
        let seg = graph
            .segments
            .get(s)
            .ok_or_else(|| IntraError::BadSegments(format!("no segment {s}")))?;
        if seg.ops.is_empty() {
            return Err(IntraError::BadSegments(format!("segment {s} has no ops")));
        }
        kinds.push(seg.kind);
    }
    let block = kinds.contains(&SegmentKind::Block);
    if block && segments.len() != 1 {
        return Err(IntraError::BadSegments(
            "a Block segment is solved alone".into(),
        ));
    }
    let mut ops = Vec::new();
    for &s in segments {
        for o in 0..graph.segments[s].ops.len() {
            ops.push((s, o));
        }
    }
    // Strategies.
    let mut strategies = Vec::with_capacity(ops.len());
    for &(s, o) in &ops {
        let op = &graph.segments[s].ops[o];
        let mut st = strategy::generate(graph, op, mesh, opts, extras.zero_stage);
        let fixed: Vec<&String> = extras
            .fixed
            .iter()
            .filter(|(n, _)| *n == op.name)
            .map(|(_, l)| l)
            .collect();
        if !fixed.is_empty() {
            st.retain(|x| fixed.contains(&&x.label));
        }
        if st.is_empty() {
            return Err(IntraError::NoStrategy(op.name.clone()));
        }
        strategies.push(st);
    }
    // Boundary tensors: consumed in the boundary placement (block input, head input)
    // and produced into it (block output, embedding output).
    let mut boundary_in = Vec::new();
    let mut boundary_out: Vec<(usize, TensorId)> = Vec::new();
    for &s in segments {
        let seg = &graph.segments[s];
        let first = ops.iter().position(|&(ss, _)| ss == s).unwrap_or(0);
        let last = first + seg.ops.len() - 1;
        match seg.kind {
            SegmentKind::Block => {
                if let Some(&t) = seg.ops[0].inputs.first() {
                    boundary_in.push(t);
                }
                if let Some(&t) = seg.ops[seg.ops.len() - 1].outputs.first() {
                    boundary_out.push((last, t));
                }
            }
            SegmentKind::Head => {
                if let Some(&t) = seg.ops[0].inputs.first() {
                    boundary_in.push(t);
                }
            }
            SegmentKind::Embed => {
                if let Some(&t) = seg.ops[seg.ops.len() - 1].outputs.first() {
                    boundary_out.push((last, t));
                }
            }
        }
    }
    let boundary_tensor = boundary_in
        .first()
        .or(boundary_out.first().map(|(_, t)| t))
        .and_then(|&t| tensor(graph, t));
    let boundary: Vec<Vec<Placement>> = match (&extras.boundary, boundary_tensor) {
        (_, None) => Vec::new(),
        (Some(b), Some(_)) => vec![b.clone()],
        (None, Some(t)) if !block => match graph
            .segments
            .iter()
            .position(|s| s.kind == SegmentKind::Block)
        {
            // The blocks' boundary decides.
            Some(bi) => {
                let sol = solve_with(graph, &[bi], mesh, opts, extras)?;
                vec![sol.boundary]
            }
            None => boundary_candidates(t, mesh, opts),
        },
        (None, Some(t)) => boundary_candidates(t, mesh, opts),
    };
    if boundary_tensor.is_some() && boundary.is_empty() {
        return Err(IntraError::Infeasible(
            "no residual-stream placement divides".into(),
        ));
    }
    let n_ops = ops.len();
    let boundary_node = if boundary.is_empty() {
        None
    } else {
        Some(n_ops)
    };

    // Producers and weight owners.
    let mut producer: HashMap<TensorId, (usize, usize)> = HashMap::new();
    for (v, &(s, o)) in ops.iter().enumerate() {
        for (i, &t) in graph.segments[s].ops[o].outputs.iter().enumerate() {
            producer.entry(t).or_insert((v, i));
        }
    }
    let mut weight_owner: HashMap<TensorId, (usize, usize)> = HashMap::new();
    let mut owned: Vec<Vec<bool>> = Vec::with_capacity(n_ops);
    let mut edges = Vec::new();
    for (v, &(s, o)) in ops.iter().enumerate() {
        let op = &graph.segments[s].ops[o];
        let mut own = vec![false; op.inputs.len()];
        for (j, &t) in op.inputs.iter().enumerate() {
            let Some(tt) = tensor(graph, t) else {
                return Err(IntraError::NoStrategy(op.name.clone()));
            };
            match tt.kind {
                TensorKind::Weight => match weight_owner.get(&t) {
                    Some(&(u, i)) => edges.push(EdgeMeta {
                        tensor: t,
                        a: u,
                        a_end: End::In(i),
                        b: v,
                        b_end: End::In(j),
                        tie: true,
                    }),
                    None => {
                        weight_owner.insert(t, (v, j));
                        own[j] = true;
                    }
                },
                TensorKind::Index => {}
                _ => {
                    if let Some(&(u, i)) = producer.get(&t).filter(|(u, _)| *u < v) {
                        edges.push(EdgeMeta {
                            tensor: t,
                            a: u,
                            a_end: End::Out(i),
                            b: v,
                            b_end: End::In(j),
                            tie: false,
                        });
                    } else if let (Some(bn), true) = (boundary_node, boundary_in.contains(&t)) {
                        edges.push(EdgeMeta {
                            tensor: t,
                            a: bn,
                            a_end: End::Boundary,
                            b: v,
                            b_end: End::In(j),
                            tie: false,
                        });
                    }
                }
            }
        }
        owned.push(own);
    }
    if let Some(bn) = boundary_node {
        for &(v, t) in &boundary_out {
            let slot = graph.segments[ops[v].0].ops[ops[v].1]
                .outputs
                .iter()
                .position(|&x| x == t)
                .unwrap_or(0);
            edges.push(EdgeMeta {
                tensor: t,
                a: v,
                a_end: End::Out(slot),
                b: bn,
                b_end: End::Boundary,
                tie: false,
            });
        }
    }
    // The ILP problem.
    let mut nodes: Vec<Node> = strategies
        .iter()
        .zip(&owned)
        .map(|(st, own)| {
            let (cost, mem) = st.iter().map(|s| op_cost(s, own, opts)).unzip();
            Node { cost, mem }
        })
        .collect();
    if boundary_node.is_some() {
        nodes.push(Node {
            cost: vec![0.0; boundary.len()],
            mem: vec![0.0; boundary.len()],
        });
    }
    let mut cache: HashMap<EdgeKey, Option<f64>> = HashMap::new();
    let mut ilp_edges = Vec::with_capacity(edges.len());
    for e in &edges {
        let bytes = tensor(graph, e.tensor).map_or(0.0, |t| t.bytes().eval(&opts.env));
        let placements = |v: usize, end: End, grad: bool| -> Vec<Vec<Placement>> {
            match end {
                End::Boundary => boundary.clone(),
                End::Out(i) => strategies[v]
                    .iter()
                    .map(|s| s.outputs.get(i).cloned().unwrap_or_default())
                    .collect(),
                End::In(i) => strategies[v]
                    .iter()
                    .map(|s| {
                        let src = if grad { &s.input_grads } else { &s.inputs };
                        src.get(i).cloned().unwrap_or_default()
                    })
                    .collect(),
            }
        };
        let pa = placements(e.a, e.a_end, false);
        let pb = placements(e.b, e.b_end, false);
        let gb = placements(e.b, e.b_end, true);
        let cost: Vec<Vec<Option<f64>>> = pa
            .iter()
            .map(|a| {
                pb.iter()
                    .zip(&gb)
                    .map(|(b, g)| {
                        if e.tie {
                            return if a == b { Some(0.0) } else { None };
                        }
                        let key = (a.clone(), b.clone(), g.clone(), bytes.to_bits());
                        *cache.entry(key).or_insert_with(|| {
                            edge_steps(a, b, g, mesh, &opts.comm, bytes)
                                .map(|(f, bw)| steps_time(&f) + steps_time(&bw))
                        })
                    })
                    .collect()
            })
            .collect();
        ilp_edges.push(Edge {
            a: e.a,
            b: e.b,
            cost,
        });
    }
    Ok(Built {
        problem: Problem {
            nodes,
            edges: ilp_edges,
            memory_limit: opts.memory_limit_bytes,
        },
        ops,
        strategies,
        owned,
        boundary,
        boundary_node,
        edges,
        boundary_in,
    })
}

/// Turns an assignment into a [`Solution`], re-deriving every cost from the strategies
/// and redistributions (not from the ILP's matrices) and checking it.
fn finish(
    graph: &Graph,
    mesh: &Mesh,
    opts: &IntraOptions,
    b: &Built,
    assign: &[usize],
) -> Result<Solution, IntraError> {
    let bad = |s: String| IntraError::Verification(s);
    if assign.len() != b.problem.nodes.len() {
        return Err(bad(format!(
            "{} choices for {} nodes",
            assign.len(),
            b.problem.nodes.len()
        )));
    }
    let axes: Vec<String> = mesh.axes.iter().map(|a| a.name.clone()).collect();
    let axis_name = |a: usize| axes.get(a).cloned().unwrap_or_default();
    let mut choice = Vec::new();
    let (mut compute, mut comm, mut mem) = (0.0, 0.0, 0.0);
    let mut collectives = Vec::new();
    let mut tensors: Vec<(TensorId, Vec<Placement>)> = Vec::new();
    let record = |items: &[CommItem], what: &str, out: &mut Vec<CollectiveRecord>| {
        for it in items {
            if let Some(kind) = it.kind {
                out.push(CollectiveRecord {
                    axis: axis_name(it.axis),
                    kind,
                    bytes: it.bytes,
                    time_s: it.time_s,
                    sent_bytes: it.sent_bytes,
                    phase: it.phase,
                    what: what.to_string(),
                });
            }
        }
    };
    let mut chosen: Vec<&Strategy> = Vec::new();
    for (v, &(s, o)) in b.ops.iter().enumerate() {
        let st = b.strategies[v]
            .get(assign[v])
            .ok_or_else(|| bad(format!("op {v}: strategy out of range")))?;
        chosen.push(st);
        let op = &graph.segments[s].ops[o];
        let mb = opts.microbatches;
        compute += st.fwd_s + st.bwd_s;
        comm += st.own_comm_s(mb);
        record(&st.comm, &op.name, &mut collectives);
        mem += st.saved_bytes * opts.activation_multiplier;
        for (i, &own) in b.owned[v].iter().enumerate() {
            if own {
                comm += st.weight_sync_s(i, mb);
                mem += st.weight_bytes.get(i).copied().unwrap_or(0.0);
                let name = op
                    .inputs
                    .get(i)
                    .and_then(|&t| tensor(graph, t))
                    .map_or("", |t| &t.name);
                if let Some(items) = st.weight_sync.get(i) {
                    record(items, name, &mut collectives);
                }
            }
        }
        for (i, &t) in op.outputs.iter().enumerate() {
            if let Some(p) = st.outputs.get(i) {
                tensors.push((t, p.clone()));
            }
        }
        for (i, &t) in op.inputs.iter().enumerate() {
            let external = tensor(graph, t)
                .is_some_and(|x| matches!(x.kind, TensorKind::Weight | TensorKind::Index))
                || b.boundary_in.contains(&t);
            if external && !tensors.iter().any(|(x, _)| *x == t) {
                let p = if b.boundary_in.contains(&t) {
                    b.boundary_node
                        .and_then(|bn| b.boundary.get(assign[bn]).cloned())
                        .unwrap_or_default()
                } else {
                    st.inputs.get(i).cloned().unwrap_or_default()
                };
                tensors.push((t, p));
            }
        }
        choice.push(OpChoice {
            segment: s,
            op: o,
            name: op.name.clone(),
            strategy: st.clone(),
        });
    }
    let boundary = match b.boundary_node {
        Some(bn) => b
            .boundary
            .get(assign[bn])
            .cloned()
            .ok_or_else(|| bad("boundary choice out of range".into()))?,
        None => Vec::new(),
    };
    for e in &b.edges {
        let get = |v: usize, end: End, grad: bool| -> Option<Vec<Placement>> {
            match end {
                End::Boundary => Some(boundary.clone()),
                End::Out(i) => chosen.get(v)?.outputs.get(i).cloned(),
                End::In(i) => {
                    let s = chosen.get(v)?;
                    if grad { &s.input_grads } else { &s.inputs }
                        .get(i)
                        .cloned()
                }
            }
        };
        let (Some(pa), Some(pb), Some(gb)) = (
            get(e.a, e.a_end, false),
            get(e.b, e.b_end, false),
            get(e.b, e.b_end, true),
        ) else {
            return Err(bad("edge end missing".into()));
        };
        let name = tensor(graph, e.tensor).map_or(String::new(), |t| t.name.clone());
        if e.tie {
            if pa != pb {
                return Err(bad(format!("tied weight `{name}` placed two ways")));
            }
            continue;
        }
        let bytes = tensor(graph, e.tensor).map_or(0.0, |t| t.bytes().eval(&opts.env));
        let (f, bw) = edge_steps(&pa, &pb, &gb, mesh, &opts.comm, bytes).ok_or_else(|| {
            bad(format!(
                "edge of `{name}`: no redistribution between its placements"
            ))
        })?;
        for (steps, phase) in [(f, Phase::Forward), (bw, Phase::Backward)] {
            for st in steps {
                comm += st.time_s;
                collectives.push(CollectiveRecord {
                    axis: axis_name(st.axis),
                    kind: st.kind,
                    bytes: st.bytes,
                    time_s: st.time_s,
                    sent_bytes: st.sent_bytes,
                    phase,
                    what: name.clone(),
                });
            }
        }
    }
    let (cost, ilp_mem) = ilp::evaluate(&b.problem, assign).map_err(bad)?;
    let total = compute + comm;
    if (total - cost).abs() > 1e-9 * cost.abs().max(1e-12) {
        return Err(bad(format!("objective {cost} but parts sum to {total}")));
    }
    if (mem - ilp_mem).abs() > 1e-9 * mem.abs().max(1.0) {
        return Err(bad(format!("memory {ilp_mem} but parts sum to {mem}")));
    }
    if let Some(lim) = opts.memory_limit_bytes {
        if mem > lim * (1.0 + 1e-9) {
            return Err(bad(format!("memory {mem:.4e} over the limit {lim:.4e}")));
        }
    }
    Ok(Solution {
        cost_s: cost,
        compute_s: compute,
        comm_s: comm,
        memory_bytes: mem,
        choice,
        boundary,
        axes,
        collectives,
        tensors,
    })
}

/// [`solve_segment`] with [`IntraExtras`].
pub fn solve_with(
    graph: &Graph,
    segments: &[usize],
    mesh: &Mesh,
    opts: &IntraOptions,
    extras: &IntraExtras,
) -> Result<Solution, IntraError> {
    let b = build(graph, segments, mesh, opts, extras)?;
    let assign = ilp::solve(&b.problem)?;
    finish(graph, mesh, opts, &b, &assign)
}

/// The optimal strategy per op of `segments` (one Block index, or the Embed and Head
/// indices together) on `mesh`, verified.
pub fn solve_segment(
    graph: &Graph,
    segments: &[usize],
    mesh: &Mesh,
    opts: &IntraOptions,
) -> Result<Solution, IntraError> {
    solve_with(graph, segments, mesh, opts, &IntraExtras::default())
}

/// The same problem and objective as [`solve_segment`], by enumeration (for tests on
/// small graphs).
pub fn brute_force(
    graph: &Graph,
    segments: &[usize],
    mesh: &Mesh,
    opts: &IntraOptions,
) -> Result<Solution, IntraError> {
    brute_force_with(graph, segments, mesh, opts, &IntraExtras::default())
}

/// [`brute_force`] with [`IntraExtras`].
pub fn brute_force_with(
    graph: &Graph,
    segments: &[usize],
    mesh: &Mesh,
    opts: &IntraOptions,
    extras: &IntraExtras,
) -> Result<Solution, IntraError> {
    let b = build(graph, segments, mesh, opts, extras)?;
    let assign = ilp::brute_force(&b.problem)?;
    finish(graph, mesh, opts, &b, &assign)
}

/// A copy of `graph` with the given op roles, and every tensor's `TpSplit` set as the
/// builder sets it for that role, so that `graph_cost::PreparedGraph` prices the chosen
/// layout. Entries naming unknown ops are skipped.
pub fn apply_roles(graph: &Graph, roles: &[(usize, usize, TpRole)]) -> Graph {
    let mut g = graph.clone();
    let mut set: Vec<(TensorId, TpSplit)> = Vec::new();
    for &(s, o, role) in roles {
        let Some(op) = g.segments.get_mut(s).and_then(|seg| seg.ops.get_mut(o)) else {
            continue;
        };
        op.role = role;
        let sharded_if = |c: bool| {
            if c {
                TpSplit::Sharded
            } else {
                TpSplit::Replicated
            }
        };
        let ins = op.inputs.clone();
        let outs = op.outputs.clone();
        let mut put = |ids: &[TensorId], split: TpSplit| {
            for &t in ids {
                set.push((t, split));
            }
        };
        match &op.kind {
            OpKind::Matmul { .. } => {
                let col = matches!(role, TpRole::ColumnParallel | TpRole::VocabHead);
                let row = role == TpRole::RowParallel;
                put(
                    &ins[1.min(ins.len())..ins.len().min(2)],
                    sharded_if(col || row),
                );
                if ins.len() > 2 {
                    put(&ins[2..], sharded_if(col));
                }
                put(&outs, sharded_if(col));
            }
            OpKind::Norm(_) => {
                put(&ins[1.min(ins.len())..], TpSplit::Replicated);
                put(&outs, sharded_if(role == TpRole::Local));
            }
            OpKind::Embedding => {
                put(
                    &ins[1.min(ins.len())..ins.len().min(2)],
                    sharded_if(role == TpRole::VocabEmbedding),
                );
                put(&outs, TpSplit::Replicated);
            }
            OpKind::CrossEntropy { .. } => put(&outs, TpSplit::Replicated),
            OpKind::Experts(_) => {
                let e = role == TpRole::Experts;
                put(
                    &ins[2.min(ins.len())..],
                    if e {
                        TpSplit::Experts
                    } else {
                        TpSplit::Replicated
                    },
                );
                put(&outs[..1.min(outs.len())], TpSplit::Replicated);
                put(&outs[1.min(outs.len())..], sharded_if(e));
            }
            _ => put(&outs, sharded_if(role == TpRole::Local)),
        }
    }
    for (t, split) in set {
        if let Some(x) = g.tensors.get_mut(t.0 as usize) {
            if x.kind != TensorKind::Index {
                x.split = split;
            }
        }
    }
    g
}

/// Bytes one rank holds of a tensor under a placement (for reports).
pub fn local_bytes(graph: &Graph, t: TensorId, p: &[Placement], mesh: &Mesh, env: &DimEnv) -> f64 {
    tensor(graph, t).map_or(0.0, |x| {
        x.bytes().eval(env) * local_fraction(p, &mesh.sizes())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshplan_cost_model::{load_cluster, Cluster};
    use meshplan_ir::{DType, Op, Segment};
    use std::path::PathBuf;

    fn cluster() -> Cluster {
        let p = PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../topologies/dgx-a100-80g.yaml"
        ));
        load_cluster(&p, None).expect("dgx cluster loads")
    }

    fn opts(c: &Cluster, batch: f64, seq: f64, sp: bool) -> IntraOptions {
        IntraOptions {
            env: DimEnv {
                batch,
                seq,
                kv: seq,
            },
            roof: Roofline::new(c, DType::Bf16),
            comm: CommModel::new(c),
            allow_seq_split: sp,
            memory_limit_bytes: None,
            param_state_bytes: 16.0,
            activation_multiplier: 1.0,
            microbatches: 1.0,
        }
    }

    const GPT: &str = "\
name: gpt-8k
transformer:
  layers: 4
  hidden: 8192
  heads: 64
  ffn_hidden: 32768
  mlp: gelu
  norm: layernorm
  vocab: 51200
  tie_embeddings: true
  bias: true
  position: learned
  max_positions: 2048
  dropout: true
dtype: bf16
workload:
  kind: train
  seq_len: 2048
  global_batch: 8
  optimizer: adamw
";

    fn model(yaml: &str) -> Graph {
        let spec = meshplan_ir::parse_model_yaml(yaml, "test.yaml").expect("model parses");
        meshplan_ir::model_graph(&spec).expect("graph builds")
    }

    fn block_index(g: &Graph) -> usize {
        g.segments
            .iter()
            .position(|s| s.kind == SegmentKind::Block)
            .expect("a block")
    }

    fn role_of(sol: &Solution, g: &Graph, name: &str) -> TpRole {
        sol.roles(g, "tp")
            .into_iter()
            .find(|&(s, o, _)| g.segments[s].ops[o].name == name)
            .map(|x| x.2)
            .unwrap_or_else(|| panic!("no op {name}"))
    }

    fn count(v: &[(String, Collective, f64)], axis: &str, k: Collective) -> usize {
        v.iter().filter(|(a, kk, _)| a == axis && *kk == k).count()
    }

    #[test]
    fn megatron_rediscovered_on_one_node() {
        let c = cluster();
        let g = model(GPT);
        let mesh = Mesh::one_d("tp", 8, c.gpus_per_node);
        let o = opts(&c, 1.0, 2048.0, false);
        let sol = solve_segment(&g, &[block_index(&g)], &mesh, &o).expect("solves");
        for n in ["block.attn.qkv", "block.mlp.up"] {
            assert_eq!(role_of(&sol, &g, n), TpRole::ColumnParallel, "{n}");
        }
        for n in ["block.attn.proj", "block.mlp.down"] {
            assert_eq!(role_of(&sol, &g, n), TpRole::RowParallel, "{n}");
        }
        assert_eq!(sol.label_of("block.attn.core"), Some("heads"));
        assert_eq!(role_of(&sol, &g, "block.mlp.act"), TpRole::Local);
        let fwd = sol.forward_collectives();
        assert_eq!(fwd.len(), 2, "{fwd:?}");
        assert_eq!(count(&fwd, "tp", Collective::AllReduce), 2);
        // b s h bf16 = 2048 * 8192 * 2 bytes each.
        assert!(fwd
            .iter()
            .all(|(_, _, b)| (*b - 2048.0 * 8192.0 * 2.0).abs() < 1.0));
        let bwd = sol.backward_collectives();
        assert_eq!(count(&bwd, "tp", Collective::AllReduce), 2, "{bwd:?}");
        assert_eq!(bwd.len(), 2);
        assert_eq!(sol.boundary, vec![Placement::Replicate]);
        assert!((sol.compute_s + sol.comm_s - sol.cost_s).abs() < 1e-12);
        // The column-parallel weight is split along its output columns.
        let names = sol.placements(&g);
        let qkv_w = names
            .iter()
            .find(|(n, _)| n == "block.attn.qkv.w")
            .expect("qkv.w");
        assert_eq!(qkv_w.1, vec!["S(1)".to_string()]);
    }

    #[test]
    fn reversed_pairing_costs_more() {
        let c = cluster();
        let g = model(GPT);
        let mesh = Mesh::one_d("tp", 8, c.gpus_per_node);
        let o = opts(&c, 1.0, 2048.0, false);
        let b = block_index(&g);
        let best = solve_segment(&g, &[b], &mesh, &o).expect("solves");
        let fixed = [
            ("block.attn.qkv", "row"),
            ("block.mlp.up", "row"),
            ("block.attn.proj", "col"),
            ("block.mlp.down", "col"),
        ];
        let extras = IntraExtras {
            fixed: fixed
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            ..Default::default()
        };
        let rev = solve_with(&g, &[b], &mesh, &o, &extras).expect("reversed solves");
        assert_eq!(role_of(&rev, &g, "block.attn.qkv"), TpRole::RowParallel);
        assert_eq!(role_of(&rev, &g, "block.mlp.down"), TpRole::ColumnParallel);
        assert!(
            rev.comm_s > best.comm_s * 1.5,
            "{} vs {}",
            rev.comm_s,
            best.comm_s
        );
        assert!(rev.cost_s > best.cost_s);
    }

    #[test]
    fn sequence_parallel_pattern() {
        let c = cluster();
        let g = model(GPT);
        let mesh = Mesh::one_d("tp", 8, c.gpus_per_node);
        let o = opts(&c, 1.0, 2048.0, true);
        let sol = solve_segment(&g, &[block_index(&g)], &mesh, &o).expect("solves");
        let fwd = sol.forward_collectives();
        assert_eq!(count(&fwd, "tp", Collective::ReduceScatter), 2, "{fwd:?}");
        assert_eq!(count(&fwd, "tp", Collective::AllGather), 2, "{fwd:?}");
        assert_eq!(fwd.len(), 4);
        assert_eq!(sol.boundary, vec![Placement::Shard(1)]);
        assert_eq!(role_of(&sol, &g, "block.attn.qkv"), TpRole::ColumnParallel);
        assert_eq!(role_of(&sol, &g, "block.mlp.down"), TpRole::RowParallel);
        // Cheaper than the layout without sequence splits (norms, dropout and adds run
        // on a shard).
        let plain = solve_segment(&g, &[block_index(&g)], &mesh, &opts(&c, 1.0, 2048.0, false))
            .expect("solves");
        assert!(sol.cost_s < plain.cost_s);
    }

    #[test]
    fn apply_roles_reproduces_the_standard_layout() {
        let c = cluster();
        let g = model(GPT);
        let mesh = Mesh::one_d("tp", 8, c.gpus_per_node);
        let o = opts(&c, 1.0, 2048.0, false);
        let ends: Vec<usize> = g
            .segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind != SegmentKind::Block)
            .map(|(i, _)| i)
            .collect();
        let mut roles = solve_segment(&g, &ends, &mesh, &o)
            .expect("ends solve")
            .roles(&g, "tp");
        roles.extend(
            solve_segment(&g, &[block_index(&g)], &mesh, &o)
                .expect("block")
                .roles(&g, "tp"),
        );
        let n_ops: usize = g.segments.iter().map(|s| s.ops.len()).sum();
        assert_eq!(roles.len(), n_ops);
        for &(s, o, r) in &roles {
            let op = &g.segments[s].ops[o];
            assert_eq!(op.role, r, "{}", op.name);
        }
        let applied = apply_roles(&g, &roles);
        assert_eq!(applied, g);
        // And a changed role changes the splits consistently.
        let flipped: Vec<_> = roles
            .iter()
            .map(|&(s, o, r)| {
                let n = &g.segments[s].ops[o].name;
                (
                    s,
                    o,
                    if n == "block.attn.qkv" {
                        TpRole::Replicated
                    } else {
                        r
                    },
                )
            })
            .collect();
        let g2 = apply_roles(&g, &flipped);
        let w = g2
            .tensors
            .iter()
            .find(|t| t.name == "block.attn.qkv.w")
            .expect("w");
        assert_eq!(w.split, TpSplit::Replicated);
    }

    // ---- tiny graphs: ILP against brute force ----

    fn tt(name: &str, shape: Vec<Dim>, kind: TensorKind) -> Tensor {
        Tensor {
            name: name.into(),
            shape,
            dtype: DType::Bf16,
            kind,
            split: TpSplit::Replicated,
        }
    }

    struct Tiny {
        tensors: Vec<Tensor>,
        ops: Vec<Op>,
    }

    impl Tiny {
        fn new() -> Tiny {
            Tiny {
                tensors: Vec::new(),
                ops: Vec::new(),
            }
        }
        fn t(&mut self, name: &str, shape: Vec<Dim>, kind: TensorKind) -> TensorId {
            self.tensors.push(tt(name, shape, kind));
            TensorId(self.tensors.len() as u32 - 1)
        }
        fn act(&mut self, name: &str, w: u64) -> TensorId {
            self.t(
                name,
                vec![Dim::Batch, Dim::Seq, Dim::Fixed(w)],
                TensorKind::Activation,
            )
        }
        fn op(&mut self, name: &str, kind: OpKind, inputs: Vec<TensorId>, outputs: Vec<TensorId>) {
            let saves = inputs
                .iter()
                .copied()
                .filter(|&i| self.tensors[i.0 as usize].kind == TensorKind::Activation)
                .collect();
            self.ops.push(Op {
                name: name.into(),
                kind,
                inputs,
                outputs,
                saves,
                role: TpRole::Replicated,
            });
        }
        fn linear(&mut self, name: &str, x: TensorId, win: u64, wout: u64) -> TensorId {
            let w = self.t(
                &format!("{name}.w"),
                vec![Dim::Fixed(win), Dim::Fixed(wout)],
                TensorKind::Weight,
            );
            let y = self.act(&format!("{name}.out"), wout);
            self.op(
                name,
                OpKind::Matmul {
                    einsum: "bsh,hn->bsn".into(),
                },
                vec![x, w],
                vec![y],
            );
            y
        }
        fn graph(self) -> Graph {
            Graph {
                name: "tiny".into(),
                tensors: self.tensors,
                segments: vec![Segment {
                    name: "block".into(),
                    kind: SegmentKind::Block,
                    repeat: 1,
                    ops: self.ops,
                }],
                constants: Default::default(),
            }
        }
    }

    fn two_matmuls(h: u64, f: u64) -> Graph {
        let mut b = Tiny::new();
        let x = b.act("x", h);
        let y = b.linear("up", x, h, f);
        b.linear("down", y, f, h);
        b.graph()
    }

    fn mm_norm_mm() -> Graph {
        let mut b = Tiny::new();
        let x = b.act("x", 64);
        let y = b.linear("a", x, 64, 256);
        let w = b.t("n.w", vec![Dim::Fixed(256)], TensorKind::Weight);
        let n = b.act("n.out", 256);
        b.op(
            "n",
            OpKind::Norm(meshplan_ir::NormKind::Rmsnorm),
            vec![y, w],
            vec![n],
        );
        b.linear("b", n, 256, 64);
        b.graph()
    }

    fn attention_like() -> Graph {
        let mut b = Tiny::new();
        let x = b.act("x", 128);
        let q = b.linear("q", x, 128, 64);
        let k = b.linear("k", x, 128, 64);
        let s = b.t(
            "s",
            vec![Dim::Batch, Dim::Seq, Dim::Seq],
            TensorKind::Activation,
        );
        b.op(
            "scores",
            OpKind::Matmul {
                einsum: "bsd,btd->bst".into(),
            },
            vec![q, k],
            vec![s],
        );
        let o = b.act("o", 64);
        b.op(
            "mix",
            OpKind::Matmul {
                einsum: "bst,btd->bsd".into(),
            },
            vec![s, k],
            vec![o],
        );
        b.graph()
    }

    /// xorshift64*, seeded: random einsum chains without a crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn pick<T: Copy>(&mut self, v: &[T]) -> T {
            v[(self.next() % v.len() as u64) as usize]
        }
    }

    fn random_chain(rng: &mut Rng) -> Graph {
        let mut b = Tiny::new();
        let widths = [32u64, 64, 128, 512, 2048];
        let mut w = rng.pick(&widths);
        let mut x = b.act("x", w);
        let n_ops = 2 + (rng.next() % 3) as usize;
        for i in 0..n_ops {
            match rng.next() % 4 {
                0 if i > 0 => {
                    let y = b.act(&format!("g{i}"), w);
                    b.op(
                        &format!("act{i}"),
                        OpKind::Activation(meshplan_ir::MlpKind::Gelu),
                        vec![x],
                        vec![y],
                    );
                    x = y;
                }
                1 => {
                    // Transposed weight, as a tied head stores it.
                    let nw = rng.pick(&widths);
                    let wt = b.t(
                        &format!("m{i}.w"),
                        vec![Dim::Fixed(nw), Dim::Fixed(w)],
                        TensorKind::Weight,
                    );
                    let y = b.act(&format!("m{i}.out"), nw);
                    b.op(
                        &format!("m{i}"),
                        OpKind::Matmul {
                            einsum: "bsh,vh->bsv".into(),
                        },
                        vec![x, wt],
                        vec![y],
                    );
                    x = y;
                    w = nw;
                }
                _ => {
                    let nw = rng.pick(&widths);
                    x = b.linear(&format!("m{i}"), x, w, nw);
                    w = nw;
                }
            }
        }
        b.graph()
    }

    fn meshes() -> Vec<Mesh> {
        vec![
            Mesh::one_d("tp", 2, 8),
            Mesh::one_d("tp", 4, 8),
            Mesh::two_d(("dp", 2), ("tp", 2), 2),
        ]
    }

    fn agree(g: &Graph, mesh: &Mesh, o: &IntraOptions) -> Result<(Solution, Solution), IntraError> {
        let a = solve_segment(g, &[0], mesh, o);
        let b = brute_force(g, &[0], mesh, o);
        match (a, b) {
            (Ok(a), Ok(b)) => {
                let rel = (a.cost_s - b.cost_s).abs() / b.cost_s.abs().max(1e-300);
                assert!(rel < 1e-9, "ILP {} vs brute force {}", a.cost_s, b.cost_s);
                Ok((a, b))
            }
            (Err(a), Err(b)) => {
                assert_eq!(a, b);
                Err(a)
            }
            (a, b) => panic!("ILP {a:?} but brute force {b:?}"),
        }
    }

    #[test]
    fn ilp_matches_brute_force_on_tiny_graphs() {
        let c = cluster();
        let graphs = vec![two_matmuls(1024, 4096), mm_norm_mm(), attention_like()];
        let mut solved = 0;
        for g in &graphs {
            for mesh in meshes() {
                for (batch, seq) in [(4.0, 256.0), (1.0, 4096.0)] {
                    let o = opts(&c, batch, seq, true);
                    if agree(g, &mesh, &o).is_ok() {
                        solved += 1;
                    }
                }
            }
        }
        assert_eq!(solved, graphs.len() * 3 * 2);
    }

    #[test]
    fn ilp_matches_brute_force_on_random_chains() {
        let c = cluster();
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for case in 0..12 {
            let g = random_chain(&mut rng);
            let mesh = meshes().swap_remove(case % 3);
            let sp = case % 2 == 0;
            let o = opts(&c, rng.pick(&[2.0, 8.0]), rng.pick(&[64.0, 1024.0]), sp);
            let (a, _) = agree(&g, &mesh, &o).expect("random chain solves");
            // A memory limit just under the free optimum's memory.
            let lim = IntraOptions {
                memory_limit_bytes: Some(a.memory_bytes * 0.8),
                ..o
            };
            if let Ok((s, _)) = agree(&g, &mesh, &lim) {
                assert!(s.memory_bytes <= a.memory_bytes * 0.8 * (1.0 + 1e-9));
                assert!(s.cost_s >= a.cost_s * (1.0 - 1e-12));
            }
        }
    }

    #[test]
    fn memory_limit_binds_and_changes_the_choice() {
        let c = cluster();
        // Small weights, many tokens: replicated compute beats the AllReduces, and
        // holds four times the weights.
        let g = two_matmuls(256, 1024);
        let mesh = Mesh::one_d("tp", 4, 8);
        let o = opts(&c, 1.0, 2048.0, false);
        let (free, _) = agree(&g, &mesh, &o).expect("solves");
        assert_eq!(free.label_of("up"), Some("R"));
        let mut changed = None;
        for f in [0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2] {
            let lim = IntraOptions {
                memory_limit_bytes: Some(free.memory_bytes * f),
                ..o
            };
            if let Ok((s, _)) = agree(&g, &mesh, &lim) {
                let labels = |x: &Solution| {
                    x.choice
                        .iter()
                        .map(|c| c.strategy.label.clone())
                        .collect::<Vec<_>>()
                };
                if labels(&s) != labels(&free) {
                    assert!(s.memory_bytes <= free.memory_bytes * f * (1.0 + 1e-9));
                    assert!(s.cost_s > free.cost_s);
                    changed = Some(s);
                    break;
                }
            }
        }
        assert!(changed.is_some(), "no limit changed the choice");
        // Nothing fits in one byte: a clean error from both.
        let none = IntraOptions {
            memory_limit_bytes: Some(1.0),
            ..o
        };
        assert!(matches!(
            agree(&g, &mesh, &none),
            Err(IntraError::Infeasible(_))
        ));
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let c = cluster();
        let g = two_matmuls(64, 64);
        let mesh = Mesh::one_d("tp", 2, 8);
        let o = opts(&c, 2.0, 16.0, false);
        assert!(matches!(
            solve_segment(&g, &[3], &mesh, &o),
            Err(IntraError::BadSegments(_))
        ));
        assert!(matches!(
            solve_segment(&g, &[], &mesh, &o),
            Err(IntraError::BadSegments(_))
        ));
        let extras = IntraExtras {
            fixed: vec![("up".into(), "nonsense".into())],
            ..Default::default()
        };
        assert!(matches!(
            solve_with(&g, &[0], &mesh, &o, &extras),
            Err(IntraError::NoStrategy(_))
        ));
        let mut broken = g.clone();
        broken.segments[0].ops[0].inputs[1] = TensorId(999);
        assert!(matches!(
            solve_segment(&broken, &[0], &mesh, &o),
            Err(IntraError::NoStrategy(_))
        ));
    }

    // ---- other axes: experts, ZeRO, context parallelism ----

    const MOE: &str = "\
name: moe-test
transformer:
  layers: 2
  hidden: 4096
  heads: 32
  kv_heads: 8
  ffn_hidden: 14336
  mlp: swiglu
  norm: rmsnorm
  vocab: 32000
  position: rope
  moe:
    experts: 8
    top_k: 2
    expert_ffn_hidden: 14336
dtype: bf16
workload:
  kind: train
  seq_len: 4096
  global_batch: 8
  optimizer: adamw
";

    #[test]
    fn experts_split_on_ep_with_all_to_all() {
        let c = cluster();
        let g = model(MOE);
        let mesh = Mesh::one_d("ep", 8, 8);
        let o = opts(&c, 1.0, 4096.0, false);
        let b = block_index(&g);
        let op = g.segments[b]
            .ops
            .iter()
            .find(|o| matches!(o.kind, OpKind::Experts(_)))
            .expect("experts op");
        let st = strategy::generate(&g, op, &mesh, &o, 0);
        let ep = st
            .iter()
            .find(|s| s.label == "ep(1)")
            .expect("expert parallel strategy");
        let a2a = |p: Phase| {
            ep.comm
                .iter()
                .filter(|c| c.phase == p && c.kind == Some(Collective::AllToAll))
                .count()
        };
        assert_eq!((a2a(Phase::Forward), a2a(Phase::Backward)), (2, 2));
        // 4096/8 tokens, top 2, hidden 4096, bf16.
        assert!((ep.comm[0].bytes - 512.0 * 2.0 * 4096.0 * 2.0).abs() < 1.0);
        // Expert weights are split 8 ways by expert: 1/8 of the replicated state.
        let rep = st.iter().find(|s| s.label == "R").expect("replicated");
        assert!((rep.weight_bytes[2] / ep.weight_bytes[2] - 8.0).abs() < 1e-9);
        assert!(st.iter().any(|s| s.label == "etp"));
        let sol = solve_segment(&g, &[b], &mesh, &o).expect("moe block solves");
        let label = sol.label_of("block.moe.experts").expect("chosen");
        assert_ne!(label, "R");
        assert_eq!(
            role_of_axis(&sol, &g, "block.moe.experts", "ep"),
            TpRole::Experts
        );
    }

    fn role_of_axis(sol: &Solution, g: &Graph, name: &str, axis: &str) -> TpRole {
        sol.roles(g, axis)
            .into_iter()
            .find(|&(s, o, _)| g.segments[s].ops[o].name == name)
            .map(|x| x.2)
            .unwrap_or(TpRole::Replicated)
    }

    #[test]
    fn zero_stages_trade_memory_for_communication() {
        let c = cluster();
        let g = two_matmuls(1024, 4096);
        let mesh = Mesh::one_d("dp", 4, 1);
        let mut o = opts(&c, 8.0, 1024.0, false);
        o.microbatches = 4.0;
        let run = |z: u8| {
            // Data parallel throughout, to compare storage choices alone.
            let x = IntraExtras {
                zero_stage: z,
                fixed: vec![
                    ("up".into(), "split(b)".into()),
                    ("down".into(), "split(b)".into()),
                ],
                ..Default::default()
            };
            solve_with(&g, &[0], &mesh, &o, &x).expect("solves")
        };
        let (z0, z1, z2, z3) = (run(0), run(1), run(2), run(3));
        // Unforced, the planner picks data parallel too.
        let free = solve_segment(&g, &[0], &mesh, &o).expect("solves");
        assert_eq!(free.label_of("up"), Some("split(b)"));
        let steps = z0.step_collectives();
        assert_eq!(count(&steps, "dp", Collective::AllReduce), 2, "{steps:?}");
        let s1 = z1.step_collectives();
        assert_eq!(count(&s1, "dp", Collective::ReduceScatter), 2);
        assert_eq!(count(&s1, "dp", Collective::AllGather), 2);
        assert!(z3.step_collectives().is_empty());
        assert_eq!(
            count(&z3.forward_collectives(), "dp", Collective::AllGather),
            2
        );
        // Memory: 16 bytes/element replicated; ZeRO-1 keeps 2+2+12/4, ZeRO-2 2+(2+12)/4,
        // ZeRO-3 16/4 (activations identical).
        let w = 2.0 * 1024.0 * 4096.0;
        let act = z0.memory_bytes - 16.0 * w;
        for (z, per) in [(&z1, 4.0 + 3.0), (&z2, 2.0 + 3.5), (&z3, 4.0)] {
            assert!(
                (z.memory_bytes - act - per * w).abs() < 1e-3 * w,
                "{}",
                z.memory_bytes
            );
        }
        assert!(z3.cost_s > z0.cost_s);
    }

    #[test]
    fn context_parallel_attention_ring_or_ulysses() {
        let c = cluster();
        let g = model(GPT);
        let mesh = Mesh::one_d("cp", 4, 8);
        let o = opts(&c, 1.0, 16384.0, false);
        let b = block_index(&g);
        let op = g.segments[b]
            .ops
            .iter()
            .find(|o| matches!(o.kind, OpKind::Attention(_)))
            .expect("attention");
        let st = strategy::generate(&g, op, &mesh, &o, 0);
        let ring = st.iter().find(|s| s.label == "ring").expect("ring");
        assert!(ring.comm.iter().all(|c| c.kind.is_none()));
        assert_eq!(ring.inputs[0], vec![Placement::Shard(1)]);
        let uly = st.iter().find(|s| s.label == "ulysses").expect("ulysses");
        assert_eq!(
            uly.comm
                .iter()
                .filter(|c| c.kind == Some(Collective::AllToAll))
                .count(),
            4
        );
        // Same local work: a quarter of the queries or a quarter of the heads.
        assert!((ring.fwd_s - uly.fwd_s).abs() < 0.05 * uly.fwd_s);
        // With the projections split by sequence (context parallel), the attention
        // runs as a ring or as Ulysses, whichever is cheaper.
        let extras = IntraExtras {
            fixed: [
                "block.attn.qkv",
                "block.attn.proj",
                "block.mlp.up",
                "block.mlp.down",
            ]
            .iter()
            .map(|n| (n.to_string(), "split(s)".to_string()))
            .collect(),
            ..Default::default()
        };
        let sol = solve_with(&g, &[b], &mesh, &o, &extras).expect("solves");
        assert_eq!(sol.boundary, vec![Placement::Shard(1)]);
        let l = sol.label_of("block.attn.core").expect("chosen");
        assert!(l == "ring" || l == "ulysses", "{l}");
    }
}
