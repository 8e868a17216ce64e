//! `export`: a plan as a framework's arguments or config file.

use crate::Failure;
use meshplan_export::Target;
use meshplan_ir::plan::{Plan, PlanError};
use std::path::Path;

/// Reads and checks a plan file ([`Plan::read_file`]): exit 2 naming the file and,
/// for a plan whose parts disagree, the field. Every command that takes a plan reads
/// it here.
pub(crate) fn read_plan(path: &Path) -> Result<Plan, Failure> {
    read_plan_bytes(path).map(|(plan, _)| plan)
}

/// [`read_plan`], also returning the file's bytes.
pub(crate) fn read_plan_bytes(path: &Path) -> Result<(Plan, Vec<u8>), Failure> {
    let file = path.display().to_string();
    Plan::read_file(path).map_err(|e| Failure {
        code: 2,
        message: match e {
            PlanError::Parse(why) => format!(
                "{file}: not a plan file written by `meshplan plan` ({why}); write one with `meshplan plan MODEL CLUSTER -o {file}`"
            ),
            other => format!("{file}: {other}"),
        },
    })
}

/// `meshplan export`: exit 2 for a bad file or target, 3 when the target cannot
/// express the plan (the plan is valid; the framework lacks what it chose).
pub(crate) fn export(
    plan_path: &Path,
    to: Option<&str>,
    output: Option<&Path>,
) -> Result<(), Failure> {
    let plan = read_plan(plan_path)?;
    // Without --to, the framework the plan was made for.
    let framework = plan.workload.framework();
    let to = match to.or(framework.export_target()) {
        Some(t) => t,
        None => {
            return Err(Failure {
                code: 2,
                message: format!(
                    "{}: the plan is for meshplan's own executor; give --to with one of {}, or plan with --framework",
                    plan_path.display(),
                    Target::ALL.map(Target::name).join(", ")
                ),
            })
        }
    };
    let target = Target::parse(to).ok_or_else(|| Failure {
        code: 2,
        message: format!(
            "--to {to}: unknown target; expected one of {}",
            Target::ALL.map(Target::name).join(", ")
        ),
    })?;
    tracing::debug!(
        "exporting {} ({}) to {target}",
        plan_path.display(),
        plan.strategy
    );
    let text = meshplan_export::export(&plan, target).map_err(|e| Failure {
        code: 3,
        message: e.to_string(),
    })?;
    match output {
        Some(path) => {
            crate::atomic::write_atomically(path, text.as_bytes(), "export")?;
            tracing::info!("{target} {} written to {}", kind(target), path.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}

fn kind(t: Target) -> &'static str {
    match t {
        Target::Torchtitan => "config (TOML)",
        Target::Deepspeed => "config (JSON)",
        _ => "arguments",
    }
}
