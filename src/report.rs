//! `report`, and the `--report` output of `plan` and `compare`: one self-contained
//! HTML page of a plan (`meshplan_viz::report`), with `compare`'s rows or, for a plan
//! alone, the neighbours `explain` prices, and `explain`'s tables.

use crate::Failure;
use meshplan_cost_model::estimate::gib;
use meshplan_ir::plan::Plan;
use meshplan_planner::compare::Row;
use meshplan_planner::explain::{explain, Alternative, Explanation, Inputs};
use meshplan_viz::compare::CompareBar;
use meshplan_viz::report::{
    report_html, CompareRow, CompareSection, ExplainSection, Neighbour, ReportInput, Sensitivity,
};
use std::path::Path;

fn generator() -> String {
    format!("meshplan {}", env!("CARGO_PKG_VERSION"))
}

/// `what` of the comparison figure (`compare --figures` and the report's).
pub(crate) fn what(inference: bool) -> &'static str {
    if inference {
        "one decode step (TPOT)"
    } else {
        "one training step"
    }
}

/// Heading of `compare`'s figure (`compare --figures` and `compare --report`).
pub(crate) fn compare_title(model: &str, gpus: u64, nodes: u64, cluster: &str) -> String {
    format!("{model} on {gpus} GPUs ({nodes} x {cluster}): planner's best and hand-given configurations")
}

/// The bar of one of `compare`'s rows (`compare --figures` and `compare --report`).
pub(crate) fn compare_bar(r: &Row) -> CompareBar {
    CompareBar::priced(
        &r.name,
        &r.strategy,
        r.predicted.as_ref(),
        r.error.as_deref(),
    )
}

fn world(plan: &Plan) -> u64 {
    plan.mesh.shape.iter().product()
}

/// `explain` of the plan, or why there is none (an older plan without its cluster).
fn explanation(plan: &Plan) -> Result<Explanation, String> {
    let inputs = Inputs::from_plan(plan)?;
    let bar = crate::log::spinner("re-pricing the plan's neighbours".into());
    let x = explain(plan, &inputs);
    bar.finish_and_clear();
    x
}

fn neighbour(a: &Alternative, inference: bool) -> Neighbour {
    Neighbour {
        change: a.change.clone(),
        strategy: a.strategy.clone(),
        feasible: a.feasible,
        time_s: if inference {
            a.tpot_s.unwrap_or(0.0)
        } else {
            a.step_time_s
        },
        delta_pct: a.delta_pct,
        tokens_per_s: a.tokens_per_s,
        memory_gib: a.memory_gib,
        deciding: a.deciding.clone(),
        crosses_infiniband: a.crosses_infiniband.clone(),
    }
}

fn explain_section(x: &Explanation) -> ExplainSection {
    let inference = x.kind == "inference";
    let pick = |pct: Option<f64>, why: &Option<String>| match (pct, why) {
        (Some(p), _) => Ok(Some(p)),
        (None, Some(w)) => Err(w.clone()),
        (None, None) => Ok(None),
    };
    ExplainSection {
        setting: x.setting.clone(),
        inference,
        neighbours: x
            .alternatives
            .iter()
            .map(|a| neighbour(a, inference))
            .collect(),
        cannot_run: x
            .cannot_run
            .iter()
            .map(|r| (r.change.clone(), r.reason.clone()))
            .collect(),
        sensitivity: x
            .sensitivity
            .iter()
            .map(|s| Sensitivity {
                key: s.key.clone(),
                value: s.value,
                doubled: pick(s.doubled_pct, &s.doubled_infeasible),
                halved: pick(s.halved_pct, &s.halved_infeasible),
            })
            .collect(),
        what_if: x.what_if.iter().map(|a| neighbour(a, inference)).collect(),
    }
}

/// The plan beside the neighbours `explain` priced: the comparison of a plan alone.
fn neighbours_compare(plan: &Plan, x: &Explanation) -> CompareSection {
    let inference = x.kind == "inference";
    let b = &x.baseline;
    let t = b.time_breakdown_s;
    let mut rows = vec![CompareRow {
        bar: CompareBar {
            name: "plan".into(),
            strategy: x.strategy.clone(),
            compute_s: Some(t.compute),
            exposed_comm_s: t.exposed_comm,
            bubble_s: t.bubble,
            feasible: b.feasible,
            error: None,
        },
        time_s: Some(if inference {
            b.tpot_s.unwrap_or(0.0)
        } else {
            b.step_time_s
        }),
        tokens_per_s: Some(b.output_tokens_per_s.unwrap_or(b.tokens_per_s)),
        ratio: Some(1.0),
        memory_gib: Some(gib(b.memory_per_gpu_bytes.total)),
        differs: "the plan".into(),
    }];
    for a in &x.alternatives {
        let d = &a.term_deltas_s;
        let ratio = if inference {
            b.output_tokens_per_s
                .filter(|_| a.tokens_per_s > 0.0)
                .map(|p| p / a.tokens_per_s)
        } else {
            Some(a.step_time_s / b.step_time_s)
        };
        rows.push(CompareRow {
            bar: CompareBar {
                name: a.change.clone(),
                strategy: a.strategy.clone(),
                compute_s: Some(t.compute + d.compute),
                exposed_comm_s: t.exposed_comm + d.exposed_comm,
                bubble_s: t.bubble + d.bubble,
                feasible: a.feasible,
                error: None,
            },
            time_s: Some(if inference {
                a.tpot_s.unwrap_or(0.0)
            } else {
                a.step_time_s
            }),
            tokens_per_s: Some(a.tokens_per_s),
            ratio,
            memory_gib: Some(a.memory_gib),
            differs: a.account.clone(),
        });
    }
    CompareSection {
        caption: "The plan beside its neighbours, one change each, priced by the same cost model (the neighbours `meshplan explain` ranks below); ratio is the row's step time over the plan's (inference: the plan's tokens/s over the row's). For hand-given configurations, use `meshplan compare --report`.".into(),
        title: format!(
            "{} on {} GPUs ({} x {}): the plan and its neighbours",
            plan.model.name,
            world(plan),
            plan.cluster.nodes,
            plan.cluster.name
        ),
        what: what(inference).into(),
        rows,
    }
}

/// `compare`'s rows (the planner's best first) as the report's comparison.
fn rows_compare(plan: &Plan, rows: &[Row]) -> CompareSection {
    let inference = rows
        .first()
        .and_then(|r| r.predicted.as_ref())
        .is_some_and(|e| e.tpot_s.is_some());
    let rows = rows
        .iter()
        .map(|r| {
            let e = r.predicted.as_ref();
            CompareRow {
                bar: compare_bar(r),
                time_s: e.map(|e| {
                    if inference {
                        e.tpot_s.unwrap_or(0.0)
                    } else {
                        e.step_time_s
                    }
                }),
                tokens_per_s: e.map(|e| e.output_tokens_per_s.unwrap_or(e.tokens_per_s)),
                ratio: r.ratio_to_planner,
                memory_gib: e.map(|e| gib(e.memory_per_gpu_bytes.total)),
                differs: r.account.clone(),
            }
        })
        .collect();
    CompareSection {
        caption: "The planner's best (the plan this page shows) beside the hand-given configurations of `meshplan compare`, each priced as `plan --config` prices it; ratio is the row's step time over the planner's (inference: the planner's tokens/s over the row's).".into(),
        title: compare_title(
            &plan.model.name,
            world(plan),
            plan.cluster.nodes,
            &plan.cluster.name,
        ),
        what: what(inference).into(),
        rows,
    }
}

/// Writes the page of `plan` (read from `source`) to `out`; `rows` are `compare`'s,
/// or `None` to compare the plan with its neighbours.
fn write(plan: &Plan, source: &str, out: &Path, rows: Option<&[Row]>) -> Result<(), Failure> {
    let bad = |e: String| Failure {
        code: 2,
        message: format!("{source}: {e}"),
    };
    // A plan without its schedule is refused before its neighbours are priced.
    meshplan_viz::timeline_of(plan).map_err(bad)?;
    let x = explanation(plan);
    let compare = match (rows, &x) {
        (Some(rows), _) => Ok(rows_compare(plan, rows)),
        (None, Ok(x)) => Ok(neighbours_compare(plan, x)),
        (None, Err(why)) => Err(format!("no neighbours to compare with: {why}")),
    };
    let explain = x
        .as_ref()
        .map(explain_section)
        .map_err(|why| format!("no explanation: {why}"));
    let html = report_html(&ReportInput {
        plan,
        source: source.to_string(),
        generator: generator(),
        compare,
        explain,
    })
    .map_err(bad)?;
    crate::atomic::write_atomically(out, html.as_bytes(), "report")?;
    eprintln!("report written to {} ({} bytes)", out.display(), html.len());
    Ok(())
}

/// Rejects a `--report` path that cannot be written (before any search runs).
pub(crate) fn check(out: Option<&Path>) -> Result<(), Failure> {
    out.map_or(Ok(()), |p| crate::draw::check_file("--report", p))
}

/// `meshplan report PLAN [-o FILE]`, and `plan --report FILE` on the plan it wrote
/// (`flag` names the output in messages).
pub(crate) fn report(plan_path: &Path, out: &Path, flag: &str) -> Result<(), Failure> {
    crate::draw::check_file(flag, out)?;
    let plan = crate::export::read_plan(plan_path)?;
    write(&plan, &plan_path.display().to_string(), out, None)
}

/// `compare --report FILE`: the planner's best plan with `compare`'s rows.
pub(crate) fn compare_report(out: &Path, plan: &Plan, rows: &[Row]) -> Result<(), Failure> {
    write(plan, "meshplan compare", out, Some(rows))
}
