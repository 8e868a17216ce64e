//! `draw`, and the `--figures` / `--trace` outputs of `plan` and `compare`: file
//! wiring around `meshplan_viz`.

use crate::Failure;
use meshplan_ir::plan::Plan;
use meshplan_viz::Figure;
use std::path::{Path, PathBuf};

fn bad(message: String) -> Failure {
    Failure { code: 2, message }
}

fn io_fail(path: &Path, what: &str, e: std::io::Error) -> Failure {
    Failure {
        code: 1,
        message: format!("{}: cannot write {what}: {e}", path.display()),
    }
}

/// Rejects a figures directory that is an existing file (before any search runs).
pub(crate) fn check_dir(flag: &str, dir: &Path) -> Result<(), Failure> {
    if dir.exists() && !dir.is_dir() {
        return Err(bad(format!(
            "{flag} {}: is a file, not a directory; give a directory (it is created if missing)",
            dir.display()
        )));
    }
    Ok(())
}

/// Rejects an output path (`flag`'s) that is a directory, a device or another
/// file that is not regular, or whose parent does not exist: before the work whose
/// result it would hold, not after.
pub(crate) fn check_file(flag: &str, file: &Path) -> Result<(), Failure> {
    if file.is_dir() {
        return Err(bad(format!(
            "{flag} {}: is a directory; give a file name such as trace.json",
            file.display()
        )));
    }
    match file.parent() {
        Some(p) if !p.as_os_str().is_empty() && !p.is_dir() => Err(bad(format!(
            "{flag} {}: directory {} does not exist; create it or give another path",
            file.display(),
            p.display()
        ))),
        _ => crate::atomic::destination(file, flag.trim_start_matches('-')).map(|_| ()),
    }
}

/// Writes each figure as `DIR/NAME.svg` (or `.png`), printing what it wrote.
pub(crate) fn write_figures(dir: &Path, figures: &[Figure], png: bool) -> Result<(), Failure> {
    std::fs::create_dir_all(dir).map_err(|e| io_fail(dir, "the figures directory", e))?;
    for f in figures {
        let bytes = meshplan_viz::render(&f.canvas, png).map_err(|message| Failure {
            code: 1,
            message: format!("cannot render {}: {message}", f.name),
        })?;
        let path: PathBuf = dir.join(format!("{}.{}", f.name, if png { "png" } else { "svg" }));
        crate::atomic::write_atomically(&path, &bytes, "figure")?;
        eprintln!(
            "figure written to {} ({} bytes)",
            path.display(),
            bytes.len()
        );
    }
    Ok(())
}

/// Writes the plan's predicted schedule as a Chrome trace.
pub(crate) fn write_trace(plan: &Plan, path: &Path, source: &str) -> Result<(), Failure> {
    let trace = meshplan_viz::plan_trace(plan).map_err(|e| bad(format!("{source}: {e}")))?;
    let text = trace.to_json();
    crate::atomic::write_atomically(path, text.as_bytes(), "trace")?;
    eprintln!(
        "predicted trace written to {} ({} spans, {} bytes)",
        path.display(),
        trace.trace_events.iter().filter(|e| e.ph == "X").count(),
        text.len()
    );
    Ok(())
}

/// The pictures of a plan, as `plan --figures` and `draw` write them.
pub(crate) fn plan_figures(plan: &Plan, source: &str) -> Result<Vec<Figure>, Failure> {
    meshplan_viz::plan_figures(plan).map_err(|e| bad(format!("{source}: {e}")))
}

/// `meshplan draw PLAN [-o DIR] [--png] [--trace FILE]`.
pub(crate) fn draw(
    plan_path: &Path,
    out: &Path,
    png: bool,
    trace: Option<&Path>,
) -> Result<(), Failure> {
    check_dir("-o", out)?;
    if let Some(t) = trace {
        check_file("--trace", t)?;
    }
    let source = plan_path.display().to_string();
    let plan = crate::export::read_plan(plan_path)?;
    let figures = plan_figures(&plan, &source)?;
    write_figures(out, &figures, png)?;
    if let Some(t) = trace {
        write_trace(&plan, t, &source)?;
    }
    Ok(())
}
