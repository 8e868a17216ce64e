//! Checking a plan file for consistency, not only format: every command that reads a
//! `plan.json` goes through [`Plan::validate`] (called by [`Plan::from_json`]), so a
//! tampered or stale plan exits with the field that is wrong instead of dividing by
//! zero, indexing out of range or allocating without bound deep inside `run`,
//! `explain`, `export` or `draw`.
//!
//! The checks go from the outside in: the rank table and the configuration, the mesh
//! against both, the communication groups, the model and its graph (every tensor id in
//! range, every shape within [`DIM_MAX`]; a transformer plan's graph must be the one its
//! `model.transformer` builds), then each stage's program (phases, dims, schedule and
//! every instruction's names, groups, peers and shapes). Each failure names the field
//! by its JSON path (`programs[1].phases[0].chunks[0].forward[3].body[2].inputs[1]`).

use crate::config::Schedule;
use crate::graph::{einsum_output_shape, Dim, Graph, Op, OpKind, Segment};
use crate::plan::{
    CollectiveKind, GroupSpec, Instr, MeshInfo, Pass, Phase, PhaseKind, Plan, PlanKind, Program,
    PLAN_FORMAT,
};
use crate::spec::{RawTransformer, TransformerSpec, Workload, DIM_MAX};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

/// Most ranks a plan may describe: the planner's own bound
/// (`meshplan_planner::lower::RANKS_MAX`), so every plan it writes reads back, and
/// small enough that a rank table and per-rank state stay allocatable.
pub const RANKS_MAX: u64 = 1 << 20;

/// Most (pass, chunk, micro-batch) tasks all of a plan's schedules may hold, and so
/// the bound on micro-batches times chunks: the planner's
/// `meshplan_planner::lower::SCHEDULE_TASKS_MAX`, which keeps a schedule in memory.
pub const SCHEDULE_TASKS_MAX: u64 = 1 << 22;

/// Longest sequence (`seq_len`, `prompt_len`, `output_len`) and largest batch
/// (`global_batch`, `concurrency`, `mbs`) a plan may name: the bound the model loader
/// puts on every size ([`DIM_MAX`]), so that products of a few of them stay exact in
/// `f64` and cannot overflow `u64` (`seq_len * global_batch` tokens per step).
pub const SIZE_MAX: u64 = DIM_MAX;

/// Most dims a tensor may have: the builder's widest is four (`[batch, seq, heads,
/// head_dim]`); a few more leave room for explicit graphs, and a bound keeps shape
/// products from overflowing.
pub const TENSOR_RANK_MAX: usize = 8;

/// Most elements one rank's local tensor may hold (2^40, 4 TiB of f32): far above
/// what fits a GPU, so no real plan is refused, while a product of [`DIM_MAX`]-sized
/// dims beyond it (a forged shape) is refused before anything sizes a buffer by it.
pub const LOCAL_ELEMS_MAX: u64 = 1 << 40;

/// Most tensors and ops a graph may hold: a transformer graph has a few hundred (a
/// repeated block is described once), explicit graphs a few thousand.
pub const GRAPH_ITEMS_MAX: usize = 1 << 20;

/// Deepest nesting of instruction bodies (`segment` holding `recompute` holding
/// compute ops is two): the lowering never goes deeper, and a bound keeps the
/// interpreters' recursion shallow.
pub const INSTR_DEPTH_MAX: usize = 4;

/// Mesh axes in the order every plan writes them (`tp` innermost).
pub const MESH_AXES: [&str; 4] = ["pp", "dp", "cp", "tp"];

/// Axes a placement string lists.
pub const PLACEMENT_AXES: [&str; 3] = ["dp", "cp", "tp"];

const _: () = assert!(RANKS_MAX <= SCHEDULE_TASKS_MAX);
const _: () = assert!(SIZE_MAX <= DIM_MAX);

/// Why a plan file cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// Not JSON, or not the plan format's shape.
    #[error("{0}")]
    Parse(String),
    /// A format version this build does not read.
    #[error("plan format {found} is not supported (this build reads format {PLAN_FORMAT}); re-run `meshplan plan` to write it again")]
    Format {
        /// The version the file states.
        found: u32,
    },
    /// A field whose value is out of range or disagrees with the rest of the plan.
    #[error("field `{field}`: {message}; the plan was edited or written by another meshplan: re-run `meshplan plan` to write it again")]
    Invalid {
        /// JSON path of the field, e.g. `strategy.mbs` or
        /// `programs[0].phases[0].chunks[0].forward[2].inputs[1]`.
        field: String,
        /// What is wrong, with the values involved.
        message: String,
    },
}

impl PlanError {
    /// The JSON path of the offending field, for [`PlanError::Invalid`].
    pub fn field(&self) -> Option<&str> {
        match self {
            PlanError::Invalid { field, .. } => Some(field),
            _ => None,
        }
    }
}

type Check = Result<(), PlanError>;

fn bad(field: impl fmt::Display, message: impl Into<String>) -> PlanError {
    PlanError::Invalid {
        field: field.to_string(),
        message: message.into(),
    }
}

/// `1 <= v <= max`.
fn within(field: impl fmt::Display, v: u64, max: u64) -> Check {
    if v == 0 {
        return Err(bad(field, "must be at least 1, got 0"));
    }
    if v > max {
        return Err(bad(field, format!("{v} is more than the limit {max}")));
    }
    Ok(())
}

/// A finite, non-negative number (bytes, FLOPs, elements).
fn amount(field: impl fmt::Display, v: f64) -> Check {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(bad(field, format!("must be a finite number >= 0, got {v}")))
    }
}

/// `got == want`, where `want` is what the rest of the plan (`what`) implies.
fn same<T: PartialEq + fmt::Display>(
    field: impl fmt::Display,
    got: T,
    want: T,
    what: &str,
) -> Check {
    if got == want {
        Ok(())
    } else {
        Err(bad(field, format!("is {got}, but {what} is {want}")))
    }
}

/// What the configuration makes of the mesh, checked once and shared by the
/// program checks.
struct Shape {
    pp: u64,
    vpp: u64,
    layers: u64,
}

impl Plan {
    /// Checks that the plan is internally consistent and within the limits above, so
    /// that every reader can index, divide and allocate by its numbers. The error
    /// names the field by its JSON path and says to re-run `meshplan plan`.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.format != PLAN_FORMAT {
            return Err(PlanError::Format { found: self.format });
        }
        let shape = self.check_strategy()?;
        // The mesh against the rank table, then each degree against the mesh, so that
        // a degree that disagrees is named rather than their product.
        self.check_mesh()?;
        self.check_workload()?;
        self.check_ranks()?;
        self.check_cluster()?;
        // The graph before the model summary, which counts the graph's parameters.
        check_graph(&self.graph)?;
        self.check_model(&shape)?;
        if let Some(t) = &self.model.transformer {
            self.check_transformer_graph(t)?;
        }
        self.check_placements()?;
        self.check_programs(&shape)
    }

    fn check_strategy(&self) -> Result<Shape, PlanError> {
        let s = &self.strategy;
        within("ranks", self.ranks.len() as u64, RANKS_MAX)?;
        for (name, v) in [
            ("dp", s.dp),
            ("tp", s.tp),
            ("pp", s.pp),
            ("cp", s.cp),
            ("ep", s.ep),
            ("vpp", s.vpp),
        ] {
            within(format!("strategy.{name}"), v, RANKS_MAX)?;
        }
        within("strategy.mbs", s.mbs, SIZE_MAX)?;
        if s.zero > 3 {
            return Err(bad(
                "strategy.zero",
                format!("ZeRO stages are 0 to 3, got {}", s.zero),
            ));
        }
        // Each degree is at most 2^20, so three of them multiply within u64.
        let stage = s.dp * s.cp * s.tp;
        if !stage.is_multiple_of(s.ep) {
            return Err(bad(
                "strategy.ep",
                format!(
                    "ep({}) must divide dp({}) * cp({}) * tp({}) = {stage}",
                    s.ep, s.dp, s.cp, s.tp
                ),
            ));
        }
        if s.vpp > 1 && (s.schedule != Schedule::Interleaved || s.pp == 1) {
            return Err(bad(
                "strategy.vpp",
                format!("vpp({}) > 1 needs schedule=interleaved and pp > 1", s.vpp),
            ));
        }
        if self.kind == PlanKind::Inference && s.vpp != 1 {
            return Err(bad(
                "strategy.vpp",
                "an inference plan has one chunk per stage",
            ));
        }
        within("model.layers", self.model.layers, DIM_MAX)?;
        Ok(Shape {
            pp: s.pp,
            vpp: s.vpp,
            layers: self.model.layers,
        })
    }

    fn check_workload(&self) -> Check {
        let cp = self.strategy.cp;
        match (&self.workload, self.kind) {
            (
                Workload::Train {
                    seq_len,
                    global_batch,
                    optimizer,
                    ..
                },
                PlanKind::Train,
            ) => {
                within("workload.seq_len", *seq_len, SIZE_MAX)?;
                within("workload.global_batch", *global_batch, SIZE_MAX)?;
                if !seq_len.is_multiple_of(cp) {
                    return Err(bad(
                        "workload.seq_len",
                        format!("seq_len({seq_len}) must be a multiple of cp({cp})"),
                    ));
                }
                if optimizer != "adamw" {
                    return Err(bad(
                        "workload.optimizer",
                        format!("`{optimizer}` is not modelled; plans use `adamw`"),
                    ));
                }
                // A plan made for a framework is one that framework runs; meshplan's
                // own older plans (a padded batch) still load.
                let fw = self.workload.framework();
                if fw != crate::Framework::Meshplan {
                    let needs =
                        crate::framework::Needs::of(&self.graph, self.model.layers, *global_batch);
                    let c = &self.strategy;
                    let why = fw.cannot_run(c, &needs);
                    if let Some(w) = why.first() {
                        return Err(bad("workload.framework", w.clone()));
                    }
                    if !fw.split_ok(&self.layer_split, c.pp, c.vpp) {
                        return Err(bad(
                            "layer_split",
                            format!("{fw} cannot split layers as {:?}", self.layer_split),
                        ));
                    }
                }
                Ok(())
            }
            (
                Workload::Inference {
                    prompt_len,
                    output_len,
                    concurrency,
                    ..
                },
                PlanKind::Inference,
            ) => {
                within("workload.prompt_len", *prompt_len, SIZE_MAX)?;
                within("workload.output_len", *output_len, SIZE_MAX)?;
                within("workload.concurrency", *concurrency, SIZE_MAX)?;
                if !prompt_len.is_multiple_of(cp) {
                    return Err(bad(
                        "workload.prompt_len",
                        format!("prompt_len({prompt_len}) must be a multiple of cp({cp})"),
                    ));
                }
                Ok(())
            }
            (w, kind) => Err(bad(
                "workload.kind",
                format!(
                    "a {} workload in a plan of kind `{}`",
                    match w {
                        Workload::Train { .. } => "training",
                        Workload::Inference { .. } => "inference",
                    },
                    match kind {
                        PlanKind::Train => "train",
                        PlanKind::Inference => "inference",
                    }
                ),
            )),
        }
    }

    fn check_mesh(&self) -> Check {
        let m = &self.mesh;
        if m.axes != MESH_AXES {
            return Err(bad(
                "mesh.axes",
                format!("must be {MESH_AXES:?}, got {:?}", m.axes),
            ));
        }
        if m.shape.len() != MESH_AXES.len() {
            return Err(bad(
                "mesh.shape",
                format!(
                    "{} sizes for the {} axes {MESH_AXES:?}",
                    m.shape.len(),
                    MESH_AXES.len()
                ),
            ));
        }
        let product = m.shape.iter().try_fold(1u64, |acc, &v| acc.checked_mul(v));
        if product != Some(self.ranks.len() as u64) {
            return Err(bad(
                "mesh.shape",
                format!(
                    "{:?} holds {} ranks, but the rank table has {}",
                    m.shape,
                    product.map_or("more than 2^64".to_string(), |p| p.to_string()),
                    self.ranks.len()
                ),
            ));
        }
        let s = &self.strategy;
        for (i, (name, want)) in [("pp", s.pp), ("dp", s.dp), ("cp", s.cp), ("tp", s.tp)]
            .into_iter()
            .enumerate()
        {
            if m.shape[i] != want {
                return Err(bad(
                    format!("strategy.{name}"),
                    format!(
                        "is {want}, but the mesh's {name} axis (mesh.shape[{i}]) is {}: the strategy does not describe the programs the ranks run",
                        m.shape[i]
                    ),
                ));
            }
        }
        if m.placement_axes != PLACEMENT_AXES {
            return Err(bad(
                "mesh.placement_axes",
                format!("must be {PLACEMENT_AXES:?}, got {:?}", m.placement_axes),
            ));
        }
        let mut names = BTreeSet::new();
        for (gi, g) in m.groups.iter().enumerate() {
            check_group(m, gi, g)?;
            if !names.insert(g.name.as_str()) {
                return Err(bad(
                    format!("mesh.groups[{gi}].name"),
                    format!("group `{}` is declared twice", g.name),
                ));
            }
        }
        Ok(())
    }

    fn check_ranks(&self) -> Check {
        let shape = &self.mesh.shape;
        let gpn = self.cluster.gpus_per_node;
        within("cluster.gpus_per_node", gpn, RANKS_MAX)?;
        for (i, r) in self.ranks.iter().enumerate() {
            let at = |f: &str| format!("ranks[{i}].{f}");
            same(at("rank"), r.rank, i as u64, "its position in the table")?;
            if r.coords.len() != shape.len() {
                return Err(bad(
                    at("coords"),
                    format!(
                        "{} coordinates for {} mesh axes",
                        r.coords.len(),
                        shape.len()
                    ),
                ));
            }
            // Row-major over the mesh, tp innermost: the only order the groups'
            // membership rule and the programs' peers are written for.
            let mut rest = i as u64;
            for a in (0..shape.len()).rev() {
                let want = rest % shape[a];
                rest /= shape[a];
                if r.coords[a] != want {
                    return Err(bad(
                        format!("ranks[{i}].coords[{a}]"),
                        format!(
                            "is {}, but rank {i} sits at {} on the {} axis (size {}) of a row-major mesh",
                            r.coords[a], want, MESH_AXES[a], shape[a]
                        ),
                    ));
                }
            }
            let program = self.programs.get(r.program as usize).ok_or_else(|| {
                bad(
                    at("program"),
                    format!(
                        "names program {}, but the plan has {}",
                        r.program,
                        self.programs.len()
                    ),
                )
            })?;
            if program.stage != r.coords[0] {
                return Err(bad(
                    at("program"),
                    format!(
                        "names program {} of stage {}, but the rank is on stage {}",
                        r.program, program.stage, r.coords[0]
                    ),
                ));
            }
            same(
                at("node"),
                r.node,
                i as u64 / gpn,
                "rank / cluster.gpus_per_node",
            )?;
            same(
                at("local_gpu"),
                r.local_gpu,
                i as u64 % gpn,
                "rank % cluster.gpus_per_node",
            )?;
        }
        Ok(())
    }

    fn check_cluster(&self) -> Check {
        let c = &self.cluster;
        within("cluster.nodes", c.nodes, RANKS_MAX)?;
        let gpus = c.nodes.saturating_mul(c.gpus_per_node);
        if gpus != self.ranks.len() as u64 {
            return Err(bad(
                "cluster.nodes",
                format!(
                    "nodes({}) * gpus_per_node({}) = {gpus} != ranks({})",
                    c.nodes,
                    c.gpus_per_node,
                    self.ranks.len()
                ),
            ));
        }
        amount("cluster.gpu_memory_bytes", c.gpu_memory_bytes)?;
        if c.spec.as_ref().is_some_and(|s| !s.is_object()) {
            return Err(bad(
                "cluster.spec",
                "must be an object (the validated cluster)",
            ));
        }
        Ok(())
    }

    fn check_model(&self, shape: &Shape) -> Check {
        let m = &self.model;
        amount("model.params", m.params)?;
        // `run` sizes its host-memory budget by this number, so it must be the graph's.
        let counted = self.graph.param_count(false);
        if (m.params - counted).abs() > 1e-9 * counted.max(1.0) {
            return Err(bad(
                "model.params",
                format!("is {}, but the graph holds {counted} parameters", m.params),
            ));
        }
        let blocks: u64 = self
            .graph
            .segments
            .iter()
            .filter(|s| s.kind == crate::graph::SegmentKind::Block)
            .try_fold(0u64, |acc, s| acc.checked_add(s.repeat))
            .unwrap_or(u64::MAX);
        same(
            "model.layers",
            m.layers,
            blocks,
            "the graph's block repeats summed",
        )?;
        if m.segments.len() != self.graph.segments.len() {
            return Err(bad(
                "model.segments",
                format!(
                    "{} segments, but the graph has {}",
                    m.segments.len(),
                    self.graph.segments.len()
                ),
            ));
        }
        for (i, (s, g)) in m.segments.iter().zip(&self.graph.segments).enumerate() {
            if s.name != g.name || s.kind != g.kind || s.repeat != g.repeat {
                return Err(bad(
                    format!("model.segments[{i}]"),
                    format!("does not match the graph's segment `{}`", g.name),
                ));
            }
        }
        let chunks = match self.kind {
            PlanKind::Train => shape.pp * shape.vpp,
            PlanKind::Inference => shape.pp,
        };
        if self.layer_split.len() as u64 != chunks {
            return Err(bad(
                "layer_split",
                format!(
                    "{} entries for {chunks} model chunks (pp * vpp)",
                    self.layer_split.len()
                ),
            ));
        }
        let total = self
            .layer_split
            .iter()
            .try_fold(0u64, |acc, &v| acc.checked_add(v));
        if total != Some(shape.layers) {
            return Err(bad(
                "layer_split",
                format!("does not add up to model.layers({})", shape.layers),
            ));
        }
        if let Some(t) = &m.transformer {
            check_transformer(t)?;
            same(
                "model.transformer.layers",
                t.layers,
                m.layers,
                "model.layers",
            )?;
        }
        Ok(())
    }

    /// A transformer plan's graph must be the one its architecture builds, up to the
    /// tensor-parallel roles and splits (the planner's choice): this catches any edit of a
    /// shape, op or id that the structural checks let through.
    fn check_transformer_graph(&self, t: &TransformerSpec) -> Check {
        let built = crate::builder::build_transformer(&self.graph.name, t, self.model.dtype);
        let g = &self.graph;
        let why = "does not match the graph model.transformer builds";
        if built.constants != g.constants {
            return Err(bad("graph.constants", why));
        }
        if built.tensors.len() != g.tensors.len() {
            return Err(bad("graph.tensors", why));
        }
        for (i, (a, b)) in g.tensors.iter().zip(&built.tensors).enumerate() {
            // `split` is the chosen layout's, like an op's role.
            if a.name != b.name || a.shape != b.shape || a.dtype != b.dtype || a.kind != b.kind {
                return Err(bad(format!("graph.tensors[{i}]"), why));
            }
        }
        if built.segments.len() != g.segments.len() {
            return Err(bad("graph.segments", why));
        }
        for (si, (a, b)) in g.segments.iter().zip(&built.segments).enumerate() {
            if a.name != b.name || a.kind != b.kind || a.ops.len() != b.ops.len() {
                return Err(bad(format!("graph.segments[{si}]"), why));
            }
            for (oi, (x, y)) in a.ops.iter().zip(&b.ops).enumerate() {
                if x.name != y.name
                    || x.kind != y.kind
                    || x.inputs != y.inputs
                    || x.outputs != y.outputs
                    || x.saves != y.saves
                {
                    return Err(bad(format!("graph.segments[{si}].ops[{oi}]"), why));
                }
            }
        }
        Ok(())
    }

    /// A collective on an activation agrees with the tensor's placement on the axis
    /// (the producer's partial sum `P`, or the rows `S(d)` a reduce-scatter leaves):
    /// a partial sum is never gathered, and rows are never all-reduced. Otherwise a
    /// run would compute another model with the plan's byte counts (an all-gather and
    /// an all-reduce of two ranks send the same bytes).
    fn activation_kind(&self, at: &str, kind: CollectiveKind, axis: &str, tensor: &str) -> Check {
        let Some(i) = PLACEMENT_AXES.iter().position(|a| *a == axis) else {
            return Ok(());
        };
        let Some(p) = self.placements.get(tensor).and_then(|p| p.get(i)) else {
            return Ok(());
        };
        let fits = match p.as_str() {
            "P" => kind != CollectiveKind::AllGather,
            "R" => true,
            _ => kind != CollectiveKind::AllReduce,
        };
        if fits {
            return Ok(());
        }
        Err(bad(
            at,
            format!(
                "{kind:?} of `{tensor}` over {axis}, which the plan places `{p}` there (placements.{tensor}): a partial sum is summed, never gathered, and rows are gathered, never all-reduced; re-plan rather than edit"
            ),
        ))
    }

    fn check_placements(&self) -> Check {
        for (name, p) in &self.placements {
            if p.len() != PLACEMENT_AXES.len() {
                return Err(bad(
                    format!("placements.{name}"),
                    format!(
                        "{} entries for the placement axes {PLACEMENT_AXES:?}",
                        p.len()
                    ),
                ));
            }
            for (i, s) in p.iter().enumerate() {
                let ok = s == "R"
                    || s == "P"
                    || s.strip_prefix("S(")
                        .and_then(|r| r.strip_suffix(')'))
                        .and_then(|d| d.parse::<usize>().ok())
                        .is_some_and(|d| d < TENSOR_RANK_MAX);
                if !ok {
                    return Err(bad(
                        format!("placements.{name}[{i}]"),
                        format!("`{s}` is not a placement (`R`, `P` or `S(dim)`)"),
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_programs(&self, shape: &Shape) -> Check {
        if self.programs.len() as u64 != shape.pp {
            return Err(bad(
                "programs",
                format!(
                    "{} programs for pp({}) stages (one per stage)",
                    self.programs.len(),
                    shape.pp
                ),
            ));
        }
        let ctx = Ctx::new(self, shape);
        let mut tasks = 0u64;
        for (pi, p) in self.programs.iter().enumerate() {
            let at = format!("programs[{pi}]");
            same(format!("{at}.id"), p.id as u64, pi as u64, "its position")?;
            same(format!("{at}.stage"), p.stage, pi as u64, "its position")?;
            let kinds: Vec<PhaseKind> = p.phases.iter().map(|ph| ph.kind).collect();
            let want: &[PhaseKind] = match self.kind {
                PlanKind::Train => &[PhaseKind::Train],
                PlanKind::Inference => &[PhaseKind::Prefill, PhaseKind::Decode],
            };
            if kinds != want {
                return Err(bad(
                    format!("{at}.phases"),
                    format!("phases {kinds:?}, but a {:?} plan has {want:?}", self.kind),
                ));
            }
            for (hi, ph) in p.phases.iter().enumerate() {
                tasks = tasks.saturating_add(ph.schedule.len() as u64);
                if tasks > SCHEDULE_TASKS_MAX {
                    return Err(bad(
                        format!("{at}.phases[{hi}].schedule"),
                        format!("more than the limit {SCHEDULE_TASKS_MAX} tasks in all"),
                    ));
                }
                ctx.check_phase(&format!("{at}.phases[{hi}]"), p, ph)?;
            }
        }
        Ok(())
    }
}

fn check_group(m: &MeshInfo, gi: usize, g: &GroupSpec) -> Check {
    let at = |f: &str| format!("mesh.groups[{gi}].{f}");
    if g.name.is_empty() {
        return Err(bad(at("name"), "must not be empty"));
    }
    let mut span = 1u64;
    let mut seen = BTreeSet::new();
    for (k, a) in g.over.iter().enumerate() {
        let i = m.axes.iter().position(|x| x == a).ok_or_else(|| {
            bad(
                format!("mesh.groups[{gi}].over[{k}]"),
                format!("`{a}` is not a mesh axis ({:?})", m.axes),
            )
        })?;
        if !seen.insert(i) {
            return Err(bad(
                format!("mesh.groups[{gi}].over[{k}]"),
                format!("axis `{a}` is listed twice"),
            ));
        }
        span = span.saturating_mul(m.shape[i]);
    }
    within(at("size"), g.size, span.max(1))?;
    within(at("stride"), g.stride, span.max(1))?;
    // The group of flattened index 0 holds `0, stride, ..., (size-1) * stride`: all
    // of them must be ranks of the axes it is laid over.
    let last = (g.size - 1).checked_mul(g.stride);
    if last.is_none_or(|l| l >= span) {
        return Err(bad(
            at("size"),
            format!(
                "size({}) * stride({}) reaches past the {span} ranks of the axes {:?}",
                g.size, g.stride, g.over
            ),
        ));
    }
    Ok(())
}

fn check_transformer(t: &TransformerSpec) -> Check {
    // The loader's own rules, so a plan holds no architecture a model file could
    // not: every width positive and within DIM_MAX, kv_heads dividing heads, top_k
    // at most experts.
    let raw = RawTransformer {
        layers: t.layers,
        hidden: t.hidden,
        heads: t.heads,
        kv_heads: Some(t.kv_heads),
        head_dim: Some(t.head_dim),
        ffn_hidden: Some(t.ffn_hidden),
        mlp: t.mlp,
        norm: t.norm,
        vocab: t.vocab,
        make_vocab_size_divisible_by: Some(t.make_vocab_size_divisible_by),
        tie_embeddings: t.tie_embeddings,
        bias: t.bias,
        qkv_bias: t.qkv_bias,
        attn_out_bias: t.attn_out_bias,
        mlp_bias: t.mlp_bias,
        position: t.position,
        max_positions: (t.position == crate::spec::PositionKind::Learned)
            .then_some(t.max_positions),
        dropout: t.dropout,
        rope_theta: Some(t.rope_theta),
        rope_scaling: Some(t.rope_scaling),
        sliding_window: t.sliding_window,
        norm_eps: Some(t.norm_eps),
        moe: t.moe.clone(),
        mla: t.mla.clone(),
    };
    match raw.validate("plan") {
        Ok(_) => Ok(()),
        Err(crate::error::IrError::Invalid { field, message, .. }) => {
            Err(bad(format!("model.{field}"), message))
        }
        Err(e) => Err(bad("model.transformer", e.to_string())),
    }
}

fn check_dim(field: impl fmt::Display, d: &Dim) -> Check {
    match d {
        Dim::Fixed(n) => within(field, *n, DIM_MAX),
        _ => Ok(()),
    }
}

/// Inputs and outputs each op kind reads by position (the interpreters index them).
fn arity(kind: &OpKind) -> (usize, usize) {
    match kind {
        OpKind::Embedding | OpKind::Matmul { .. } | OpKind::Add => (2, 1),
        OpKind::CrossEntropy { .. } => (2, 1),
        OpKind::Norm(_) | OpKind::Rope | OpKind::Activation(_) | OpKind::Attention(_) => (1, 1),
        OpKind::Dropout => (1, 2),
        OpKind::Router { .. } => (1, 1),
        OpKind::Experts(_) => (4, 1),
    }
}

fn check_op(g: &Graph, at: &str, op: &Op) -> Check {
    let n = g.tensors.len();
    for (list, ids) in [
        ("inputs", &op.inputs),
        ("outputs", &op.outputs),
        ("saves", &op.saves),
    ] {
        if ids.len() > GRAPH_ITEMS_MAX {
            return Err(bad(format!("{at}.{list}"), "too many tensors"));
        }
        for (k, id) in ids.iter().enumerate() {
            if id.0 as usize >= n {
                return Err(bad(
                    format!("{at}.{list}[{k}]"),
                    format!(
                        "tensor id {} is out of range (the graph has {n} tensors)",
                        id.0
                    ),
                ));
            }
        }
    }
    let (ins, outs) = arity(&op.kind);
    if op.inputs.len() < ins || op.outputs.len() < outs {
        return Err(bad(
            at,
            format!(
                "{} inputs and {} outputs, but the op needs at least {ins} and {outs}",
                op.inputs.len(),
                op.outputs.len()
            ),
        ));
    }
    // The JSON path of an op parameter: `kind` is `{"attention": {...}}`.
    let variant = match &op.kind {
        OpKind::Matmul { .. } => "matmul",
        OpKind::Attention(_) => "attention",
        OpKind::Router { .. } => "router",
        OpKind::Experts(_) => "experts",
        OpKind::CrossEntropy { .. } => "cross_entropy",
        _ => "",
    };
    let kind = |f: &str| format!("{at}.kind.{variant}.{f}");
    match &op.kind {
        OpKind::Matmul { einsum } => {
            let a = &g.tensors[op.inputs[0].0 as usize].shape;
            let b = &g.tensors[op.inputs[1].0 as usize].shape;
            let out = einsum_output_shape(einsum, a, b)
                .map_err(|e| bad(kind("einsum"), e.to_string()))?;
            if out.len() != g.tensors[op.outputs[0].0 as usize].shape.len() {
                return Err(bad(
                    kind("einsum"),
                    "the output's rank differs from the einsum's",
                ));
            }
        }
        OpKind::Attention(a) => {
            within(kind("heads"), a.heads, DIM_MAX)?;
            within(kind("kv_heads"), a.kv_heads, DIM_MAX)?;
            within(kind("qk_dim"), a.qk_dim, DIM_MAX)?;
            within(kind("v_dim"), a.v_dim, DIM_MAX)?;
            if !a.heads.is_multiple_of(a.kv_heads) {
                return Err(bad(
                    kind("kv_heads"),
                    format!("heads({}) % kv_heads({}) != 0", a.heads, a.kv_heads),
                ));
            }
        }
        OpKind::Router { experts, top_k } => {
            within(kind("experts"), *experts, DIM_MAX)?;
            within(kind("top_k"), *top_k, *experts)?;
        }
        OpKind::Experts(e) => {
            within(kind("experts"), e.experts, DIM_MAX)?;
            within(kind("top_k"), e.top_k, e.experts)?;
            within(kind("hidden"), e.hidden, DIM_MAX)?;
            within(kind("ffn"), e.ffn, DIM_MAX)?;
            if let Some(cf) = e.capacity_factor {
                if !(cf.is_finite() && cf > 0.0 && cf <= e.experts as f64) {
                    return Err(bad(
                        kind("capacity_factor"),
                        format!("must be in (0, experts({})], got {cf}", e.experts),
                    ));
                }
            }
        }
        OpKind::CrossEntropy { vocab } => within(kind("vocab"), *vocab, DIM_MAX)?,
        _ => {}
    }
    Ok(())
}

/// Structure of any graph (explicit graphs have no architecture to rebuild from):
/// ids in range, shapes within limits, op parameters usable.
fn check_graph(g: &Graph) -> Check {
    if g.tensors.len() > GRAPH_ITEMS_MAX {
        return Err(bad(
            "graph.tensors",
            format!("more than the limit {GRAPH_ITEMS_MAX}"),
        ));
    }
    for (i, t) in g.tensors.iter().enumerate() {
        if t.shape.len() > TENSOR_RANK_MAX {
            return Err(bad(
                format!("graph.tensors[{i}].shape"),
                format!(
                    "{} dims, more than the limit {TENSOR_RANK_MAX}",
                    t.shape.len()
                ),
            ));
        }
        for (k, d) in t.shape.iter().enumerate() {
            check_dim(format!("graph.tensors[{i}].shape[{k}]"), d)?;
        }
    }
    let c = &g.constants;
    for (name, v) in [("rope_theta", c.rope_theta), ("norm_eps", c.norm_eps)] {
        if !(v.is_finite() && v > 0.0) {
            return Err(bad(
                format!("graph.constants.{name}"),
                format!("must be a positive number, got {v}"),
            ));
        }
    }
    if let Err(crate::error::IrError::Invalid { field, message, .. }) = c
        .rope_scaling
        .validate("plan", "graph.constants.rope_scaling")
    {
        return Err(bad(field, message));
    }
    if c.sliding_window == Some(0) {
        return Err(bad(
            "graph.constants.sliding_window",
            "must be a positive number of keys, or absent",
        ));
    }
    if !(c.dropout_p.is_finite() && (0.0..1.0).contains(&c.dropout_p)) {
        return Err(bad(
            "graph.constants.dropout_p",
            format!("must be in [0, 1), got {}", c.dropout_p),
        ));
    }
    let mut segs = BTreeSet::new();
    let mut ops = 0usize;
    for (si, s) in g.segments.iter().enumerate() {
        if !segs.insert(s.name.as_str()) {
            return Err(bad(
                format!("graph.segments[{si}].name"),
                format!("segment `{}` is declared twice", s.name),
            ));
        }
        within(format!("graph.segments[{si}].repeat"), s.repeat, DIM_MAX)?;
        ops += s.ops.len();
        if ops > GRAPH_ITEMS_MAX {
            return Err(bad(
                "graph.segments",
                format!("more than {GRAPH_ITEMS_MAX} ops"),
            ));
        }
        for (oi, op) in s.ops.iter().enumerate() {
            check_op(g, &format!("graph.segments[{si}].ops[{oi}]"), op)?;
        }
    }
    if g.segments.is_empty() {
        return Err(bad("graph.segments", "the graph has no segments"));
    }
    Ok(())
}

/// Lookups the program checks share.
struct Ctx<'a> {
    plan: &'a Plan,
    shape: &'a Shape,
    segments: HashMap<&'a str, &'a Segment>,
    ops: HashMap<&'a str, &'a Op>,
    groups: BTreeMap<&'a str, &'a GroupSpec>,
}

impl<'a> Ctx<'a> {
    fn new(plan: &'a Plan, shape: &'a Shape) -> Ctx<'a> {
        let g = &plan.graph;
        Ctx {
            plan,
            shape,
            segments: g.segments.iter().map(|s| (s.name.as_str(), s)).collect(),
            ops: g.ops().map(|o| (o.name.as_str(), o)).collect(),
            groups: plan
                .mesh
                .groups
                .iter()
                .map(|g| (g.name.as_str(), g))
                .collect(),
        }
    }

    fn check_phase(&self, at: &str, p: &Program, ph: &Phase) -> Check {
        let s = &self.plan.strategy;
        let d = &ph.dims;
        for (name, v, max) in [
            ("batch", d.batch, SIZE_MAX),
            ("seq", d.seq, SIZE_MAX),
            ("kv", d.kv, 2 * SIZE_MAX),
        ] {
            if !(v.is_finite() && v >= 1.0 && v <= max as f64) {
                return Err(bad(
                    format!("{at}.dims.{name}"),
                    format!("must be a number in [1, {max}], got {v}"),
                ));
            }
        }
        within(
            format!("{at}.microbatches"),
            ph.microbatches,
            SCHEDULE_TASKS_MAX,
        )?;
        match (&self.plan.workload, ph.kind) {
            (
                Workload::Train {
                    seq_len,
                    global_batch,
                    ..
                },
                PhaseKind::Train,
            ) => {
                same(
                    format!("{at}.dims.batch"),
                    d.batch,
                    s.mbs as f64,
                    "strategy.mbs",
                )?;
                same(
                    format!("{at}.dims.seq"),
                    d.seq,
                    *seq_len as f64,
                    "workload.seq_len",
                )?;
                same(
                    format!("{at}.dims.kv"),
                    d.kv,
                    *seq_len as f64,
                    "workload.seq_len",
                )?;
                let mb = global_batch.div_ceil(s.dp.saturating_mul(s.mbs));
                same(
                    format!("{at}.microbatches"),
                    ph.microbatches,
                    mb,
                    "global_batch / (dp * mbs) rounded up",
                )?;
            }
            (Workload::Inference { prompt_len, .. }, PhaseKind::Prefill) => {
                same(
                    format!("{at}.dims.seq"),
                    d.seq,
                    *prompt_len as f64,
                    "workload.prompt_len",
                )?;
                same(
                    format!("{at}.microbatches"),
                    ph.microbatches,
                    1,
                    "one per inference phase",
                )?;
            }
            (Workload::Inference { .. }, PhaseKind::Decode) => {
                same(
                    format!("{at}.microbatches"),
                    ph.microbatches,
                    1,
                    "one per inference phase",
                )?;
            }
            _ => {
                return Err(bad(
                    format!("{at}.kind"),
                    "does not match the plan's workload",
                ))
            }
        }
        let chunks = match ph.kind {
            PhaseKind::Train => self.shape.vpp,
            _ => 1,
        };
        same(
            format!("{at}.chunks"),
            ph.chunks.len() as u64,
            chunks,
            "strategy.vpp",
        )?;
        for (ci, ch) in ph.chunks.iter().enumerate() {
            let cat = format!("{at}.chunks[{ci}]");
            same(format!("{cat}.chunk"), ch.chunk, ci as u64, "its position")?;
            same(
                format!("{cat}.virtual_stage"),
                ch.virtual_stage,
                ci as u64 * self.shape.pp + p.stage,
                "chunk * pp + stage",
            )?;
            if ch.layer_start > ch.layer_end || ch.layer_end > self.shape.layers {
                return Err(bad(
                    format!("{cat}.layer_end"),
                    format!(
                        "layers {}..{} are not a range of the model's {}",
                        ch.layer_start, ch.layer_end, self.shape.layers
                    ),
                ));
            }
            for (k, cs) in ch.segments.iter().enumerate() {
                let seg = self.segment(&format!("{cat}.segments[{k}].segment"), &cs.segment)?;
                if cs.repeat > seg.repeat {
                    return Err(bad(
                        format!("{cat}.segments[{k}].repeat"),
                        format!(
                            "{} copies of `{}`, which repeats {}",
                            cs.repeat, seg.name, seg.repeat
                        ),
                    ));
                }
            }
            self.check_instrs(&format!("{cat}.forward"), p, &ch.forward, None, 0)?;
            if ph.kind != PhaseKind::Train && !ch.backward.is_empty() {
                return Err(bad(
                    format!("{cat}.backward"),
                    "an inference phase has no backward pass",
                ));
            }
            self.check_instrs(&format!("{cat}.backward"), p, &ch.backward, None, 0)?;
        }
        self.check_schedule(at, ph)?;
        self.check_instrs(&format!("{at}.step"), p, &ph.step, None, 0)?;
        let b = &ph.comm_bytes_per_gpu;
        for (name, v) in [
            ("dp", b.dp),
            ("tp", b.tp),
            ("pp", b.pp),
            ("cp", b.cp),
            ("ep", b.ep),
        ] {
            amount(format!("{at}.comm_bytes_per_gpu.{name}"), v)?;
        }
        Ok(())
    }

    /// Each (pass, chunk, micro-batch) runs once (forward only for inference), and a
    /// backward after its forward: the interpreters keep a task's activations from
    /// its forward for its backward.
    fn check_schedule(&self, at: &str, ph: &Phase) -> Check {
        let chunks = ph.chunks.len() as u64;
        let cells = chunks
            .checked_mul(ph.microbatches)
            .filter(|&c| c <= SCHEDULE_TASKS_MAX)
            .ok_or_else(|| {
                bad(
                    format!("{at}.microbatches"),
                    format!("chunks * micro-batches is more than the limit {SCHEDULE_TASKS_MAX}"),
                )
            })? as usize;
        let mut done = [vec![false; cells], vec![false; cells]];
        let training = ph.kind == PhaseKind::Train;
        for (ti, t) in ph.schedule.iter().enumerate() {
            let tat = format!("{at}.schedule[{ti}]");
            if t.chunk >= chunks {
                return Err(bad(
                    format!("{tat}.chunk"),
                    format!("chunk {} of {chunks}", t.chunk),
                ));
            }
            if t.mb >= ph.microbatches {
                return Err(bad(
                    format!("{tat}.mb"),
                    format!("micro-batch {} of {}", t.mb, ph.microbatches),
                ));
            }
            let cell = (t.chunk * ph.microbatches + t.mb) as usize;
            let pass = match t.pass {
                Pass::F => 0,
                Pass::B if training => 1,
                Pass::B => {
                    return Err(bad(
                        format!("{tat}.pass"),
                        "an inference phase has no backward pass",
                    ))
                }
            };
            if done[pass][cell] {
                return Err(bad(tat, "the task is scheduled twice"));
            }
            if pass == 1 && !done[0][cell] {
                return Err(bad(tat, "a backward before its forward"));
            }
            done[pass][cell] = true;
        }
        let passes = if training { 2 } else { 1 };
        if done[..passes].iter().any(|d| d.iter().any(|x| !x)) {
            return Err(bad(
                format!("{at}.schedule"),
                "misses a task: every chunk must run every micro-batch",
            ));
        }
        Ok(())
    }

    fn segment(&self, at: &str, name: &str) -> Result<&'a Segment, PlanError> {
        self.segments
            .get(name)
            .copied()
            .ok_or_else(|| bad(at, format!("segment `{name}` is not in the graph")))
    }

    fn group(&self, at: &str, name: &str) -> Result<&'a GroupSpec, PlanError> {
        self.groups
            .get(name)
            .copied()
            .ok_or_else(|| bad(at, format!("group `{name}` is not declared in mesh.groups")))
    }

    /// `seg`: the graph segment whose body this is (op names are unique only inside
    /// a segment: a dense and a MoE block both have `block.mlp.residual`).
    fn check_instrs(
        &self,
        at: &str,
        p: &Program,
        list: &[Instr],
        seg: Option<&'a Segment>,
        depth: usize,
    ) -> Check {
        if depth > INSTR_DEPTH_MAX {
            return Err(bad(
                at,
                format!("nested deeper than the limit {INSTR_DEPTH_MAX}"),
            ));
        }
        for (i, instr) in list.iter().enumerate() {
            self.check_instr(&format!("{at}[{i}]"), p, instr, seg, depth)?;
        }
        Ok(())
    }

    fn check_instr(
        &self,
        at: &str,
        p: &Program,
        instr: &Instr,
        seg: Option<&'a Segment>,
        depth: usize,
    ) -> Check {
        let f = |name: &str| format!("{at}.{name}");
        match instr {
            Instr::Segment {
                name,
                kind,
                repeat,
                body,
            } => {
                let seg = self.segment(&f("name"), name)?;
                if *kind != seg.kind {
                    return Err(bad(
                        f("kind"),
                        format!("segment `{name}` is of another kind"),
                    ));
                }
                within(f("repeat"), *repeat, seg.repeat)?;
                self.check_instrs(&f("body"), p, body, Some(seg), depth + 1)
            }
            Instr::Recompute { body } => self.check_instrs(&f("body"), p, body, seg, depth + 1),
            Instr::Compute {
                name,
                inputs,
                outputs,
                flops,
                ..
            } => {
                let op = match seg {
                    Some(s) => s.ops.iter().find(|o| &o.name == name),
                    None => self.ops.get(name.as_str()).copied(),
                }
                .ok_or_else(|| bad(f("name"), format!("op `{name}` is not in the graph")))?;
                amount(f("flops"), *flops)?;
                for (list, locals, ids) in [
                    ("inputs", inputs, &op.inputs),
                    ("outputs", outputs, &op.outputs),
                ] {
                    if locals.len() != ids.len() {
                        return Err(bad(
                            f(list),
                            format!(
                                "{} tensors, but op `{name}` has {}",
                                locals.len(),
                                ids.len()
                            ),
                        ));
                    }
                    for (k, (lt, id)) in locals.iter().zip(ids.iter()).enumerate() {
                        let lat = format!("{at}.{list}[{k}]");
                        let t = &self.plan.graph.tensors[id.0 as usize];
                        if lt.tensor != t.name {
                            return Err(bad(
                                format!("{lat}.tensor"),
                                format!(
                                    "`{}`, but op `{name}` reads `{}` there",
                                    lt.tensor, t.name
                                ),
                            ));
                        }
                        if lt.shape.len() != t.shape.len() {
                            return Err(bad(
                                format!("{lat}.shape"),
                                format!(
                                    "{} dims, but `{}` has {}",
                                    lt.shape.len(),
                                    t.name,
                                    t.shape.len()
                                ),
                            ));
                        }
                        let mut elems = 1u64;
                        for (di, &d) in lt.shape.iter().enumerate() {
                            within(format!("{lat}.shape[{di}]"), d, DIM_MAX)?;
                            elems = elems.saturating_mul(d);
                        }
                        if elems > LOCAL_ELEMS_MAX {
                            return Err(bad(
                                format!("{lat}.shape"),
                                format!("{elems} elements, more than the limit {LOCAL_ELEMS_MAX}"),
                            ));
                        }
                    }
                }
                Ok(())
            }
            Instr::Collective {
                kind,
                group,
                axis,
                ranks,
                target,
                payload_bytes,
                bytes_sent,
            } => {
                let g = self.group(&f("group"), group)?;
                same(
                    f("ranks"),
                    *ranks,
                    g.size,
                    &format!("the size of group `{group}`"),
                )?;
                if let crate::target::Target::Activation { tensor } = target {
                    self.plan
                        .activation_kind(&f("kind"), *kind, axis.name(), tensor)?;
                }
                amount(f("payload_bytes"), *payload_bytes)?;
                amount(f("bytes_sent"), *bytes_sent)
            }
            Instr::RingPass {
                group,
                steps,
                bytes_per_step,
                bytes_sent,
                ..
            } => {
                let g = self.group(&f("group"), group)?;
                if *steps >= g.size.max(1) {
                    return Err(bad(
                        f("steps"),
                        format!("{steps} exchanges in a ring of {} ranks", g.size),
                    ));
                }
                amount(f("bytes_per_step"), *bytes_per_step)?;
                amount(f("bytes_sent"), *bytes_sent)
            }
            Instr::Send {
                peer_stage, bytes, ..
            }
            | Instr::Recv {
                peer_stage, bytes, ..
            } => {
                if *peer_stage >= self.shape.pp || *peer_stage == p.stage {
                    return Err(bad(
                        f("peer_stage"),
                        format!(
                            "stage {peer_stage} is not another of the {} stages (this is stage {})",
                            self.shape.pp, p.stage
                        ),
                    ));
                }
                amount(f("bytes"), *bytes)
            }
            // `params` is a `ParamSet`: serde refused anything else.
            Instr::Optimizer { name, elements, .. } => {
                if name != "adamw" {
                    return Err(bad(
                        f("name"),
                        format!("`{name}` is not an optimizer plans use (`adamw`)"),
                    ));
                }
                amount(f("elements"), *elements)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_agree_with_the_loader() {
        assert_eq!(SIZE_MAX, DIM_MAX);
        let e = bad("strategy.mbs", "must be at least 1, got 0").to_string();
        assert!(
            e.starts_with("field `strategy.mbs`: must be at least 1"),
            "{e}"
        );
        assert!(e.contains("re-run `meshplan plan`"), "{e}");
    }
}
