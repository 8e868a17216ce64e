//! `calibrate`: measure this node's GPUs into a calibration overlay. The sweep and the
//! fits are `meshplan_cost_model::calibrate`; the timing needs the CUDA backend.

use crate::run::{bad, runtime};
use crate::Failure;
use meshplan_cost_model::calibrate::MeasurementPlan;
use std::path::Path;

/// GPUs per node the dry run describes (the real run uses the GPUs it finds).
const DRY_RUN_GPUS: u64 = 8;

/// `meshplan calibrate`.
pub(crate) fn calibrate(output: &Path, backend: &str, dry_run: bool) -> Result<(), Failure> {
    match backend {
        "cuda" => {}
        "cpu" => {
            return Err(bad(
                "calibrate measures GPUs; --backend cpu has none to measure: run `meshplan calibrate --backend cuda` on a node of the cluster".into(),
            ))
        }
        other => return Err(bad(format!("--backend {other}: expected cuda"))),
    }
    let plan = MeasurementPlan::standard(DRY_RUN_GPUS);
    if dry_run {
        println!(
            "meshplan calibrate measures, on a node of {DRY_RUN_GPUS} GPUs (the run uses the GPUs it finds):"
        );
        print!("{}", plan.describe());
        println!("and writes the fits to {}", output.display());
        return Ok(());
    }
    // The CUDA backend runs `plan`, hands back `calibrate::Measurements`, and
    // `calibrate::build_overlay(..).to_yaml()` is written to `output`.
    Err(runtime(format!(
        "calibrate: this build has no CUDA backend yet (it arrives with the CUDA issue), so nothing was measured and {} was not written; `meshplan calibrate --dry-run` lists what it will measure",
        output.display()
    )))
}
