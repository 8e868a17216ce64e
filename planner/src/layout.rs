//! The placements a configuration runs under, found by the intra-op ILP and turned
//! back into a graph the cost model prices.
//!
//! The ILP ([`crate::intra`]) chooses a strategy per op of each distinct segment on
//! the tensor axis; [`crate::intra::apply_roles`] writes the choice into the graph's
//! op roles and tensor splits, and `PreparedGraph::new` prices that graph. One solve
//! per distinct submesh shape and micro-batch shape serves every configuration that
//! shares it, and every repeat of a block.

use crate::cost_model::compute::Roofline;
use crate::cost_model::{Cluster, CommModel, InferenceLoad, PreparedGraph};
use crate::intra::{apply_roles, solve_segment, solve_with, IntraExtras, IntraOptions};
use crate::mesh::Mesh;
use meshplan_ir::{DimEnv, Graph, OpKind, ParallelConfig, SegmentKind, TpRole};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The LP solver good_lp is built with.
pub const SOLVER: &str = if cfg!(feature = "highs") {
    "highs"
} else {
    "microlp"
};

/// What an intra-op problem depends on: the tensor axis and where it sits, sequence
/// parallelism and the micro-batch's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayoutKey {
    /// Tensor-parallel degree.
    pub tp: u64,
    /// GPUs per node (where the tensor axis sits).
    pub gpus_per_node: u64,
    /// Residual stream may be split along the sequence.
    pub sp: bool,
    /// Sequences per micro-batch.
    pub batch: u64,
    /// Query tokens per rank.
    pub seq: u64,
    /// Key tokens.
    pub kv: u64,
}

impl LayoutKey {
    /// The key of a training configuration.
    pub fn train(cfg: &ParallelConfig, seq_len: u64) -> LayoutKey {
        LayoutKey {
            tp: cfg.tp,
            gpus_per_node: 0,
            sp: cfg.sp && cfg.tp > 1,
            batch: cfg.mbs,
            seq: seq_len / cfg.cp.max(1),
            kv: seq_len,
        }
    }

    /// The key of an inference configuration (its prefill).
    pub fn inference(cfg: &ParallelConfig, load: &InferenceLoad) -> LayoutKey {
        LayoutKey {
            tp: cfg.tp,
            gpus_per_node: 0,
            sp: false,
            batch: 1,
            seq: load.prompt_len,
            kv: load.prompt_len,
        }
    }
}

/// A solved layout.
#[derive(Clone, Debug)]
pub struct Layout {
    /// The graph with the chosen roles, when they differ from the builder's.
    pub graph: Option<Graph>,
    /// `graph`, prepared for pricing.
    pub prepared: Option<PreparedGraph>,
    /// Tensor name -> placement per mesh axis (`tp`), sorted by name.
    pub placements: Vec<(String, Vec<String>)>,
    /// The ILP objective summed over segments (one copy of each), seconds.
    pub ilp_cost_s: f64,
    /// Op roles chosen: (segment, op, role).
    pub roles: Vec<(usize, usize, TpRole)>,
    /// The chosen roles equal the standard (Megatron) layout the builder wrote.
    pub standard: bool,
    /// Why the standard layout was used instead of the ILP's, if it was.
    pub fallback: Option<String>,
}

/// Solved layouts, shared by the threads of a search.
pub struct LayoutCache {
    roof: Roofline,
    comm: CommModel,
    gpus_per_node: u64,
    /// One cell per key: the first thread to ask solves it, the others wait for its
    /// answer, so each distinct layout is solved (and counted) exactly once whatever
    /// the thread timing.
    map: Mutex<HashMap<LayoutKey, Arc<SolvedCell>>>,
    solves: AtomicU64,
}

type SolvedCell = OnceLock<Result<Arc<Layout>, String>>;

impl LayoutCache {
    /// An empty cache for `cluster`.
    pub fn new(graph: &Graph, cluster: &Cluster) -> LayoutCache {
        let dtype = graph
            .tensors
            .iter()
            .find(|t| t.kind == meshplan_ir::TensorKind::Weight)
            .map(|t| t.dtype)
            .unwrap_or(meshplan_ir::DType::Bf16);
        LayoutCache {
            roof: Roofline::new(cluster, dtype),
            comm: CommModel::new(cluster),
            gpus_per_node: cluster.gpus_per_node,
            map: Mutex::new(HashMap::new()),
            solves: AtomicU64::new(0),
        }
    }

    /// ILP problems solved so far, one set per distinct layout asked for: the same
    /// for every run of the same search.
    pub fn solves(&self) -> u64 {
        self.solves.load(Ordering::Relaxed)
    }

    /// The layout for `key`, solving it on first use.
    pub fn get(
        &self,
        key: LayoutKey,
        graph: &Graph,
        pg: &PreparedGraph,
    ) -> Result<Arc<Layout>, String> {
        let key = LayoutKey {
            gpus_per_node: self.gpus_per_node,
            ..key
        };
        let cell = self
            .map
            .lock()
            .map_err(|e| e.to_string())?
            .entry(key)
            .or_default()
            .clone();
        // Outside the map's lock: other keys solve in parallel meanwhile.
        cell.get_or_init(|| self.solve(&key, graph, pg).map(Arc::new))
            .clone()
    }

    fn solve(&self, key: &LayoutKey, graph: &Graph, pg: &PreparedGraph) -> Result<Layout, String> {
        let mesh = Mesh::one_d("tp", key.tp, self.gpus_per_node);
        let opts = IntraOptions {
            env: DimEnv {
                batch: key.batch as f64,
                seq: key.seq as f64,
                kv: key.kv as f64,
            },
            roof: self.roof,
            comm: self.comm,
            allow_seq_split: key.sp,
            memory_limit_bytes: None,
            param_state_bytes: 16.0,
            activation_multiplier: 1.0,
            microbatches: 1.0,
        };
        let mut problems: Vec<Vec<usize>> = Vec::new();
        let ends: Vec<usize> = graph
            .segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind != SegmentKind::Block)
            .map(|(i, _)| i)
            .collect();
        if !ends.is_empty() {
            problems.push(ends);
        }
        for (i, s) in graph.segments.iter().enumerate() {
            if s.kind == SegmentKind::Block {
                problems.push(vec![i]);
            }
        }
        let mut roles = Vec::new();
        let mut placements = Vec::new();
        let mut cost = 0.0;
        let mut fallback = None;
        for segs in &problems {
            let err = |e: crate::intra::IntraError| {
                format!("intra-op ILP on tp={} for segments {segs:?}: {e}", key.tp)
            };
            let mut sol = solve_segment(graph, segs, &mesh, &opts).map_err(err)?;
            self.solves.fetch_add(1, Ordering::Relaxed);
            if !expressible(graph, &sol, key.sp) {
                // The cheapest way to a small vocabulary's loss can be to gather the
                // logits, which the role-based pricing and the programs do not
                // express: keep the loss vocabulary-parallel instead.
                let extras = IntraExtras {
                    fixed: loss_ops(graph, segs)
                        .into_iter()
                        .map(|name| (name, "vocab".to_string()))
                        .collect(),
                    ..IntraExtras::default()
                };
                if !extras.fixed.is_empty() {
                    if let Ok(s) = solve_with(graph, segs, &mesh, &opts, &extras) {
                        self.solves.fetch_add(1, Ordering::Relaxed);
                        if expressible(graph, &s, key.sp) {
                            sol = s;
                        }
                    }
                }
            }
            if !expressible(graph, &sol, key.sp) {
                fallback = Some(format!(
                    "the ILP's layout of segments {segs:?} moves tensors the standard roles do not; the standard layout is used"
                ));
                break;
            }
            cost += sol.cost_s;
            roles.extend(sol.roles(graph, "tp"));
            placements.extend(sol.placements(graph));
        }
        if let Some(reason) = fallback {
            return Ok(Layout {
                graph: None,
                prepared: None,
                placements: Vec::new(),
                ilp_cost_s: f64::NAN,
                roles: graph
                    .segments
                    .iter()
                    .enumerate()
                    .flat_map(|(s, seg)| {
                        seg.ops
                            .iter()
                            .enumerate()
                            .map(move |(o, op)| (s, o, op.role))
                    })
                    .collect(),
                standard: true,
                fallback: Some(reason),
            });
        }
        roles.sort_by_key(|(s, o, _)| (*s, *o));
        placements.sort();
        placements.dedup_by(|a, b| a.0 == b.0);
        let standard = roles
            .iter()
            .all(|&(s, o, r)| graph.segments[s].ops[o].role == r);
        let (graph_out, prepared) = if standard || key.tp <= 1 {
            (None, None)
        } else {
            let g = apply_roles(graph, &roles);
            let mut p = PreparedGraph::new(&g);
            // The KV cache's size comes from the model spec, not the graph.
            p.set_kv_bytes_per_token_layer(pg.kv_bytes_per_token_layer);
            (Some(g), Some(p))
        };
        Ok(Layout {
            graph: graph_out,
            prepared,
            placements,
            ilp_cost_s: cost,
            roles,
            standard,
            fallback: None,
        })
    }
}

/// Names of the cross-entropy ops in `segments`.
fn loss_ops(graph: &Graph, segments: &[usize]) -> Vec<String> {
    segments
        .iter()
        .filter_map(|&s| graph.segments.get(s))
        .flat_map(|seg| &seg.ops)
        .filter(|op| matches!(op.kind, OpKind::CrossEntropy { .. }))
        .map(|op| op.name.clone())
        .collect()
}

/// Whether a solution's forward collectives are those its roles imply (what the
/// cost model prices and the lowering emits): per row-parallel or vocabulary-parallel
/// embedding output one AllReduce (ReduceScatter under sequence parallelism), per
/// column-parallel input one AllGather under sequence parallelism (ops sharing an
/// input share the gather), three AllReduces per vocabulary-parallel loss.
pub fn expressible(graph: &Graph, sol: &crate::intra::Solution, sp: bool) -> bool {
    use crate::cost_model::Collective;
    let (mut ar, mut rs, mut ag) = (0usize, 0usize, 0usize);
    for (_, _, r) in sol.roles(graph, "tp") {
        match r {
            TpRole::RowParallel | TpRole::VocabEmbedding if sp => rs += 1,
            TpRole::RowParallel | TpRole::VocabEmbedding => ar += 1,
            TpRole::ColumnParallel | TpRole::VocabHead if sp => ag += 1,
            TpRole::VocabLoss => ar += 3,
            _ => {}
        }
    }
    let mut got = (0usize, 0usize, 0usize);
    for (axis, kind, _) in sol.forward_collectives() {
        if axis != "tp" {
            continue;
        }
        match kind {
            Collective::AllReduce => got.0 += 1,
            Collective::ReduceScatter => got.1 += 1,
            Collective::AllGather => got.2 += 1,
            _ => return false,
        }
    }
    got.0 == ar && got.1 == rs && got.2 <= ag && (ag == 0) == (got.2 == 0)
}
