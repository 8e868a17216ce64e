//! Pictures of a plan (SVG text, or PNG) and its predicted schedule as a Chrome trace.
//!
//! - [`gantt`]: the pipeline schedule per stage over time, replayed from the cost
//!   model's own simulation ([`meshplan_cost_model::Timeline`], which a plan carries
//!   under `predicted.timeline`);
//! - [`memory`]: the memory ledger per GPU (one bar per stage) against capacity;
//! - [`mesh`]: the device mesh on the nodes, NVLink and InfiniBand axes;
//! - [`compare`]: candidates side by side (compute, exposed communication, bubble);
//! - [`trace`]: the predicted Chrome trace, laid out as the executor's measured one;
//! - [`report`]: all of them in one self-contained HTML page, with the summary, the
//!   comparison, the explanation and the calibration figure.
//!
//! Every function is pure and returns a [`Canvas`]; output is deterministic, so
//! golden files compare as text. Files are written by the binary.
#![warn(missing_docs)]

pub mod axis;
pub mod calibration;
pub mod canvas;
pub mod compare;
pub mod frontier;
pub mod gantt;
pub mod memory;
pub mod mesh;
pub mod raster;
pub mod report;
pub mod trace;

pub use canvas::Canvas;
use meshplan_cost_model::Timeline;
use meshplan_ir::plan::Plan;
use meshplan_ir::trace::Trace;

/// A picture and the file stem it is written under.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    /// File stem: `pipeline`, `memory`, `mesh` or `compare`.
    pub name: &'static str,
    /// The picture.
    pub canvas: Canvas,
}

/// The schedule a plan's prediction came from (`predicted.timeline`), checked.
pub fn timeline_of(plan: &Plan) -> Result<Timeline, String> {
    let v = plan.predicted.get("timeline").ok_or_else(|| {
        "field `predicted.timeline` is missing (a plan written before pictures existed): re-run `meshplan plan` to write it".to_string()
    })?;
    let tl: Timeline = serde_json::from_value(v.clone())
        .map_err(|e| format!("field `predicted.timeline`: {e}"))?;
    tl.validate()
        .map_err(|e| format!("field `predicted.timeline`: {e}"))?;
    let stages = plan
        .mesh
        .axes
        .iter()
        .position(|a| a == "pp")
        .map(|i| plan.mesh.shape[i]);
    if stages != Some(tl.pp() as u64) {
        return Err(format!(
            "field `predicted.timeline`: {} stages, but the mesh's pp axis is {stages:?}",
            tl.pp()
        ));
    }
    Ok(tl)
}

fn world(plan: &Plan) -> u64 {
    plan.mesh.shape.iter().product()
}

fn heading(plan: &Plan) -> String {
    format!(
        "{}: {} on {} GPUs ({} x {} {})",
        plan.model.name,
        plan.strategy,
        world(plan),
        plan.cluster.nodes,
        plan.cluster.gpus_per_node,
        plan.cluster.gpu
    )
}

/// The pictures of a plan: pipeline schedule, memory per GPU, device mesh.
pub fn plan_figures(plan: &Plan) -> Result<Vec<Figure>, String> {
    let tl = timeline_of(plan)?;
    let world = world(plan);
    let per_stage = world / tl.pp().max(1) as u64;
    let mesh = mesh::MeshDesc {
        axes: plan.mesh.axes.clone(),
        shape: plan.mesh.shape.clone(),
        gpus_per_node: plan.cluster.gpus_per_node,
        nodes: plan.cluster.nodes,
        title: format!("{}: device mesh", heading(plan)),
    };
    if plan.mesh.axes.len() != plan.mesh.shape.len() || plan.mesh.shape.contains(&0) {
        return Err(
            "field `mesh`: `axes` and `shape` must have the same length and sizes >= 1".into(),
        );
    }
    Ok(vec![
        Figure {
            name: "pipeline",
            canvas: gantt::gantt(&tl, &heading(plan)),
        },
        Figure {
            name: "memory",
            canvas: memory::memory_bars(
                &tl.stage_memory(),
                tl.memory_capacity_bytes(),
                per_stage,
                &format!("{}: memory", heading(plan)),
            ),
        },
        Figure {
            name: "mesh",
            canvas: mesh::mesh_map(&mesh),
        },
    ])
}

/// The plan's predicted schedule as a Chrome trace.
pub fn plan_trace(plan: &Plan) -> Result<Trace, String> {
    let tl = timeline_of(plan)?;
    Ok(trace::predicted_trace(&tl, world(plan)))
}

/// A picture's bytes: SVG text, or PNG at twice the size (`png`).
pub fn render(canvas: &Canvas, png: bool) -> Result<Vec<u8>, String> {
    if png {
        raster::to_png(canvas, 2.0)
    } else {
        Ok(canvas.to_svg().into_bytes())
    }
}
