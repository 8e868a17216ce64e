//! `export`: a plan as a framework's arguments or config file.

use crate::Failure;
use meshplan_export::Target;
use meshplan_ir::plan::Plan;
use std::path::Path;

/// Reads a plan file: exit 2 naming the file when it is missing or not a plan.
pub(crate) fn read_plan(path: &Path) -> Result<Plan, Failure> {
    let file = path.display().to_string();
    let bad = |message: String| Failure { code: 2, message };
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("{file}: {e}")))?;
    Plan::from_json(&text).map_err(|e| {
        bad(format!(
            "{file}: not a plan written by `meshplan plan`: {e}; write one with `meshplan plan MODEL CLUSTER -o {file}`"
        ))
    })
}

/// `meshplan export`: exit 2 for a bad file or target, 3 when the target cannot
/// express the plan (the plan is valid; the framework lacks what it chose).
pub(crate) fn export(plan_path: &Path, to: &str, output: Option<&Path>) -> Result<(), Failure> {
    let target = Target::parse(to).ok_or_else(|| Failure {
        code: 2,
        message: format!(
            "--to {to}: unknown target; expected one of {}",
            Target::ALL.map(Target::name).join(", ")
        ),
    })?;
    let plan = read_plan(plan_path)?;
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
            std::fs::write(path, &text).map_err(|e| Failure {
                code: 1,
                message: format!("{}: cannot write: {e}", path.display()),
            })?;
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
