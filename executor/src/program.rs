//! Reading a rank's program from the plan: its groups and place on the mesh, its
//! pipeline peers, and the graph's ops, shapes, segments and weights, as both
//! interpreters (training and inference) and the checkpoints need them.

use crate::comm::{Group, RankError};
use crate::shard::{local_weight, TpPos};
use crate::train::{fail, NO_LAYER};
use meshplan_ir::plan::{Instr, Plan};
use meshplan_ir::{Graph, Op, OpKind, SegmentKind, TensorKind};
use std::collections::BTreeMap;

/// The plan's group `name`.
pub(crate) fn group_named(
    groups: &BTreeMap<String, Group>,
    name: &str,
) -> Result<Group, RankError> {
    let g = groups.get(name).cloned();
    g.ok_or_else(|| fail(format!("group `{name}` is not in the plan's mesh")))
}

/// The place on the plan's mesh axis `axis` of the rank at mesh coordinates
/// `coords` (none: coordinate 0): its coordinate and the axis size, [`TpPos::ONE`]
/// where the mesh has no such axis.
pub(crate) fn mesh_place(plan: &Plan, coords: &[u64], axis: &str) -> TpPos {
    let i = plan.mesh.axes.iter().position(|a| a == axis);
    i.map_or(TpPos::ONE, |i| TpPos {
        rank: coords.get(i).map_or(0, |&c| c as usize),
        size: plan.mesh.shape[i] as usize,
    })
}

/// `rank`'s place in its group `name` (no split when the plan has no such group).
pub(crate) fn place_in(groups: &BTreeMap<String, Group>, name: &str, rank: usize) -> TpPos {
    groups
        .get(name)
        .and_then(|g| {
            g.index_of(rank).map(|i| TpPos {
                rank: i,
                size: g.size(),
            })
        })
        .unwrap_or(TpPos::ONE)
}

/// The block layer a copy of a segment of `kind` runs as, counting `layer` on
/// (forward order) for blocks; [`NO_LAYER`] outside them.
pub(crate) fn next_layer(kind: SegmentKind, layer: &mut u64) -> u64 {
    if kind == SegmentKind::Block {
        *layer += 1;
        *layer - 1
    } else {
        NO_LAYER
    }
}

/// The block layer a copy of a segment of `kind` runs as in a backward list,
/// counting `layer` down (the copies run last first); [`NO_LAYER`] outside
/// the blocks.
pub(crate) fn prev_layer(kind: SegmentKind, layer: &mut u64) -> u64 {
    if kind == SegmentKind::Block {
        *layer -= 1;
        *layer
    } else {
        NO_LAYER
    }
}

/// The plan's rank at `coords` but on pipeline stage `stage`: a stage
/// boundary's peer.
pub(crate) fn peer_on_stage(plan: &Plan, coords: &[u64], stage: u64) -> Result<usize, RankError> {
    let pp = plan
        .mesh
        .axes
        .iter()
        .position(|a| a == "pp")
        .ok_or_else(|| fail("the mesh has no pp axis"))?;
    let mut coords = coords.to_vec();
    coords[pp] = stage;
    plan.ranks
        .iter()
        .find(|r| r.coords == coords)
        .map(|r| r.rank as usize)
        .ok_or_else(|| fail(format!("no rank at {coords:?}")))
}

/// The op named `name` in segment `seg` of the plan's graph, or anywhere in it for
/// an instruction outside any segment. A name alone is ambiguous: a model whose
/// first layers are dense and the rest MoE (DeepSeek's `first_dense_layers`) names
/// the ops of both blocks alike.
pub(crate) fn find_op<'g>(
    graph: &'g Graph,
    seg: Option<usize>,
    name: &str,
) -> Result<&'g Op, RankError> {
    let found = match seg {
        Some(s) => graph
            .segments
            .get(s)
            .and_then(|g| g.ops.iter().find(|o| o.name == name)),
        None => graph.ops().find(|o| o.name == name),
    };
    found.ok_or_else(|| fail(format!("op `{name}` is not in the plan's graph")))
}

/// The full shape of a weight (its dims are fixed).
pub(crate) fn fixed_shape(t: &meshplan_ir::Tensor) -> Result<Vec<usize>, RankError> {
    t.shape
        .iter()
        .map(|d| match d {
            meshplan_ir::Dim::Fixed(n) => Ok(*n as usize),
            other => Err(fail(format!("`{}` has a symbolic dim {other:?}", t.name))),
        })
        .collect()
}

/// The last dim (the row width) of a tensor, which must be fixed.
pub(crate) fn fixed_width(t: &meshplan_ir::Tensor) -> Result<usize, RankError> {
    match t.shape.last() {
        Some(meshplan_ir::Dim::Fixed(w)) => Ok(*w as usize),
        _ => Err(fail(format!(
            "`{}`: the width (last dim) is not fixed",
            t.name
        ))),
    }
}

/// What both interpreters need of a plan's graph, checked before any rank starts
/// (a hand-written graph may lack it): the first segment starts from token ids
/// (they are all the interpreter feeds), a norm has a one-dim scale weight, an
/// experts op its four operands, attention one fused `q | k | v` input, and the
/// tensor and expert axes split every weight whole ([`crate::shard::check_split`]).
pub(crate) fn runnable(plan: &Plan) -> Result<(), String> {
    let graph = &plan.graph;
    let size = |axis: &str| mesh_place(plan, &[], axis).size;
    crate::shard::check_split(graph, size("tp"), size("ep"))?;
    if let Some(x) = segment_input(graph, 0) {
        return Err(format!(
            "`{x}` enters the model's graph from outside it, but the executor feeds \
             token ids only: it runs models that begin with an embedding of token ids \
             (a `transformer:` model or a Hugging Face config.json); this one can be \
             planned, estimated and compared, not run"
        ));
    }
    for op in graph.ops() {
        let scale = op.inputs.get(1).map(|&t| graph.tensor(t));
        match op.kind {
            OpKind::Norm(_)
                if !scale.is_some_and(|w| w.kind == TensorKind::Weight && w.shape.len() == 1) =>
            {
                return Err(format!(
                    "norm `{}` has no one-dim scale weight as its second input; the \
                     executor's norms take a scale (and optionally a shift)",
                    op.name
                ))
            }
            // Latent attention (DeepSeek's MLA) reads its queries and its
            // compressed keys and values apart, and the graph does not carry the
            // decoupled RoPE key it concatenates: the kernels would read the wrong
            // rows.
            OpKind::Attention(_) if meshplan_ir::graph::latent_attention(op) => {
                return Err(format!(
                    "`{}`: latent attention (`mla`) is not run by the executor yet: its \
                     kernels take one fused q|k|v input; plan, estimate and compare \
                     price it, and `run` takes the model without `mla`",
                    op.name
                ))
            }
            OpKind::Experts(_) if op.inputs.len() < 4 => {
                return Err(format!(
                    "experts op `{}` has {} inputs; it takes x, the router's logits, \
                     w_up and w_down",
                    op.name,
                    op.inputs.len()
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// A segment's input activation (what the previous segment produced).
pub(crate) fn segment_input(graph: &Graph, s: usize) -> Option<String> {
    let seg = graph.segments.get(s)?;
    let produced: Vec<_> = seg
        .ops
        .iter()
        .flat_map(|o| o.outputs.iter().copied())
        .collect();
    seg.ops
        .iter()
        .flat_map(|o| o.inputs.iter().copied())
        .find(|t| {
            let tensor = graph.tensor(*t);
            tensor.kind == TensorKind::Activation && !produced.contains(t)
        })
        .map(|t| graph.tensor(t).name.clone())
}

/// A segment's output activation (the residual stream it hands on).
pub(crate) fn segment_output(graph: &Graph, s: usize) -> Option<String> {
    let seg = &graph.segments[s];
    if seg.kind == SegmentKind::Head {
        return None;
    }
    seg.ops
        .last()
        .and_then(|o| o.outputs.first())
        .map(|&t| graph.tensor(t).name.clone())
}

/// Every copy of a segment a phase's chunks run, in order: (segment index, block
/// layer or `None` outside the blocks). Both interpreters hold weights per copy.
pub(crate) fn segment_copies(
    graph: &Graph,
    phase: &meshplan_ir::plan::Phase,
) -> Result<Vec<(usize, Option<u64>)>, RankError> {
    let mut out = Vec::new();
    for ch in &phase.chunks {
        let mut layer = ch.layer_start;
        for instr in &ch.forward {
            if let Instr::Segment {
                name, kind, repeat, ..
            } = instr
            {
                let s = segment_index(graph, name)?;
                for _ in 0..*repeat {
                    let l = next_layer(*kind, &mut layer);
                    out.push((s, (l != NO_LAYER).then_some(l)));
                }
            }
        }
    }
    Ok(out)
}

/// The index of segment `name` in the plan's graph.
pub(crate) fn segment_index(graph: &Graph, name: &str) -> Result<usize, RankError> {
    graph
        .segments
        .iter()
        .position(|s| s.name == name)
        .ok_or_else(|| fail(format!("segment `{name}` is not in the plan's graph")))
}

/// The communication groups of the plan's `rank`, by name (see the plan format's
/// rule), their members numbered from world rank `first` (a serving pool placed
/// after the other pool's ranks; 0 otherwise).
pub(crate) fn build_groups(
    plan: &Plan,
    rank: usize,
    first: usize,
) -> Result<BTreeMap<String, Group>, RankError> {
    let axes = &plan.mesh.axes;
    let shape = &plan.mesh.shape;
    let me = plan
        .ranks
        .get(rank)
        .ok_or_else(|| fail(format!("rank {rank} missing")))?;
    let mut out = BTreeMap::new();
    for g in &plan.mesh.groups {
        let over: Vec<usize> = g
            .over
            .iter()
            .filter_map(|a| axes.iter().position(|x| x == a))
            .collect();
        let flat_of = |coords: &[u64]| -> u64 {
            over.iter().fold(0u64, |acc, &i| acc * shape[i] + coords[i])
        };
        let x = flat_of(&me.coords);
        let (size, stride) = (g.size.max(1), g.stride.max(1));
        let digit = (x / stride) % size;
        let base = x - digit * stride;
        let mut members: Vec<(u64, usize)> = Vec::new();
        for r in &plan.ranks {
            let same_elsewhere = (0..axes.len())
                .filter(|i| !over.contains(i))
                .all(|i| r.coords[i] == me.coords[i]);
            if !same_elsewhere {
                continue;
            }
            let y = flat_of(&r.coords);
            let d = (y / stride) % size;
            if y == base + d * stride {
                members.push((d, first + r.rank as usize));
            }
        }
        members.sort();
        let ranks: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        out.insert(
            g.name.clone(),
            Group::new(format!("{}:{:?}", g.name, ranks), ranks),
        );
    }
    Ok(out)
}

/// ` layer L` for a weight of a repeated block, nothing for one outside them.
pub(crate) fn layer_label(layer: u64) -> String {
    if layer == NO_LAYER {
        String::new()
    } else {
        format!(" layer {layer}")
    }
}

/// The name of `op`'s first output, the key its activation and gradient are held
/// under (empty for an op with no output).
pub(crate) fn output_name(graph: &Graph, op: &Op) -> String {
    op.outputs
        .first()
        .map(|&o| graph.tensor(o).name.clone())
        .unwrap_or_default()
}

/// The first op reading weight `name` (whose role decides how it is sliced and
/// initialised), the weight's tensor and its full shape.
pub(crate) fn weight_site<'g>(
    graph: &'g Graph,
    name: &str,
) -> Result<(&'g Op, meshplan_ir::TensorId, Vec<usize>), String> {
    let (op, id) = graph
        .ops()
        .find_map(|o| {
            o.inputs
                .iter()
                .find(|&&t| graph.tensor(t).name == name)
                .map(|&t| (o, t))
        })
        .ok_or_else(|| format!("`{name}` used by no op"))?;
    let shape = fixed_shape(graph.tensor(id)).map_err(|e| e.to_string())?;
    Ok((op, id, shape))
}

/// The part of weight `name` (whole values `full`) that `rank` of `plan` holds.
pub(crate) fn rank_slice(
    plan: &Plan,
    rank: usize,
    name: &str,
    full: &[f32],
) -> Result<Vec<f32>, String> {
    let graph = &plan.graph;
    let entry = plan
        .ranks
        .get(rank)
        .ok_or_else(|| format!("rank {rank} is not in the plan"))?;
    let tp = mesh_place(plan, &entry.coords, "tp");
    let (op, id, shape) = weight_site(graph, name)?;
    let ep = build_groups(plan, rank, 0).map_or(TpPos::ONE, |gs| place_in(&gs, "ep", rank));
    Ok(local_weight(graph, op, op.role, id, full, &shape, tp, ep))
}
