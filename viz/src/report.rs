//! One self-contained HTML page of a plan (`meshplan report`, `--report` on `plan` and
//! `compare`): the summary from the plan's own keys, then the pictures the other
//! drawers make ([`crate::plan_figures`], [`compare_bars`], [`calibration_chart`])
//! inline as SVG, with a tooltip on hover, and the tables beside them. Nothing is
//! fetched: CSS, script and pictures are in the page, and the calibration points are
//! compiled in ([`published_calibration`]).
//!
//! The page is built from what the caller hands over ([`ReportInput`]): the plan, and
//! the comparison and explanation the binary computed (this crate knows nothing of
//! the planner), so the numbers are those `compare` and `explain` print.

use crate::axis::fmt_dur;
use crate::calibration::{calibration_chart, CalibrationRow};
use crate::canvas::{Canvas, Item};
use crate::compare::{compare_bars, CompareBar};
use crate::memory::PARTS as MEMORY_PARTS;
use crate::mesh::{axis_links, LinkKind};
use meshplan_cost_model::{SpanKind, Timeline};
use meshplan_ir::plan::Plan;
use meshplan_ir::Workload;
use serde_json::Value;
use std::fmt::Write as _;

/// One row of the comparison table (and one bar of its figure).
#[derive(Clone, Debug, PartialEq)]
pub struct CompareRow {
    /// The bar: name, configuration, time terms, fits, why it cannot run.
    pub bar: CompareBar,
    /// Step time (training) or TPOT (inference), s; `None` when it cannot run.
    pub time_s: Option<f64>,
    /// Tokens per second (output tokens for inference).
    pub tokens_per_s: Option<f64>,
    /// This row over the plan (step time ratio; inference: the plan's tokens/s over
    /// this row's).
    pub ratio: Option<f64>,
    /// Memory of the fullest GPU, GiB.
    pub memory_gib: Option<f64>,
    /// What differs from the plan and which time term it costs.
    pub differs: String,
}

/// The comparison: the plan first, then the other rows.
#[derive(Clone, Debug, PartialEq)]
pub struct CompareSection {
    /// What the rows are, in words (text between backticks is set as code).
    pub caption: String,
    /// Heading of the figure.
    pub title: String,
    /// What the bars measure (`one training step`, `one decode step (TPOT)`).
    pub what: String,
    /// Rows, the plan's first.
    pub rows: Vec<CompareRow>,
}

/// One re-priced neighbour of the plan (or a what-if).
#[derive(Clone, Debug, PartialEq)]
pub struct Neighbour {
    /// The change, e.g. `pp 20->10, dp 24->48`.
    pub change: String,
    /// Its configuration.
    pub strategy: String,
    /// Fits in memory (and the SLO).
    pub feasible: bool,
    /// Step time (training) or TPOT (inference), s.
    pub time_s: f64,
    /// Step time change against the plan, % (training).
    pub delta_pct: f64,
    /// Tokens per second (output tokens for inference).
    pub tokens_per_s: f64,
    /// Memory of the fullest GPU, GiB.
    pub memory_gib: f64,
    /// The term that decides it.
    pub deciding: String,
    /// Axes that would leave the node for InfiniBand.
    pub crosses_infiniband: Vec<String>,
}

/// The step time's sensitivity to one degree.
#[derive(Clone, Debug, PartialEq)]
pub struct Sensitivity {
    /// Degree (`tp`, `pp`, ...).
    pub key: String,
    /// The plan's value.
    pub value: u64,
    /// At twice the degree: the change in %, or why it does not fit.
    pub doubled: Result<Option<f64>, String>,
    /// At half the degree.
    pub halved: Result<Option<f64>, String>,
}

/// What `explain` says of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct ExplainSection {
    /// Model and cluster, in words.
    pub setting: String,
    /// Inference plan (ranked by tokens/s, TPOT shown).
    pub inference: bool,
    /// Neighbours, best first.
    pub neighbours: Vec<Neighbour>,
    /// Neighbours that cannot run: (change, why).
    pub cannot_run: Vec<(String, String)>,
    /// Per degree.
    pub sensitivity: Vec<Sensitivity>,
    /// Changes of the workload or cluster.
    pub what_if: Vec<Neighbour>,
}

/// Everything the page shows.
#[derive(Clone, Debug)]
pub struct ReportInput<'a> {
    /// The plan.
    pub plan: &'a Plan,
    /// Where it came from (the plan file, or the `compare` command).
    pub source: String,
    /// The program that wrote the page (`meshplan 0.1.0`).
    pub generator: String,
    /// The comparison, or why there is none.
    pub compare: Result<CompareSection, String>,
    /// The explanation, or why there is none.
    pub explain: Result<ExplainSection, String>,
}

/// The sections of a report, in order: (id, heading). Tests look for each id.
pub const SECTIONS: [(&str, &str); 7] = [
    ("summary", "Summary"),
    ("schedule", "Pipeline schedule"),
    ("memory", "Memory per GPU"),
    ("mesh", "Mesh on the nodes"),
    ("compare", "Comparison"),
    ("explain", "Why this plan"),
    ("calibration", "Calibration"),
];

const CALIBRATION_TSV: &str = include_str!("../data/calibration.tsv");

/// The cost model against published runs, as `tests/it/calibration.rs` last drew it
/// (`tests/data/golden/calibration.svg`), compiled in from `viz/data/calibration.tsv`.
pub fn published_calibration() -> Vec<CalibrationRow> {
    parse_calibration(CALIBRATION_TSV)
}

/// Rows of a calibration table: `id<TAB>ratio<TAB>loo ratio<TAB>yes|no` (fitted),
/// `#` comments; malformed lines are skipped (the test holds the file whole).
pub fn parse_calibration(text: &str) -> Vec<CalibrationRow> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            match f.as_slice() {
                [id, ratio, loo, fitted] => Some(CalibrationRow {
                    id: (*id).to_string(),
                    ratio: ratio.parse().ok()?,
                    loo_ratio: loo.parse().ok()?,
                    unfitted: *fitted == "no",
                }),
                _ => None,
            }
        })
        .collect()
}

/// The calibration figure's heading for `n` runs.
pub fn calibration_title(n: usize) -> String {
    format!("meshplan against {n} published training runs (1x: exact; right: too optimistic)")
}

/// Text as HTML, with `backticked` words set as code.
fn prose(s: &str) -> String {
    esc(s)
        .split('`')
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 1 {
                format!("<code>{part}</code>")
            } else {
                part.to_string()
            }
        })
        .collect()
}

/// HTML text (also safe inside a double-quoted attribute): the figures' escaping,
/// and the apostrophe as well.
pub fn esc(s: &str) -> String {
    crate::canvas::escape(s).replace('\'', "&#39;")
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

/// `1234567` as `1,234,567`.
fn grouped(v: f64) -> String {
    let s = format!("{:.0}", v.abs());
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    if v < 0.0 {
        format!("-{out}")
    } else {
        out
    }
}

/// Parameters in words: `174.6 B`.
fn count(v: f64) -> String {
    if v >= 1e12 {
        format!("{:.2} T", v / 1e12)
    } else if v >= 1e9 {
        format!("{:.1} B", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.1} M", v / 1e6)
    } else {
        grouped(v)
    }
}

/// Seconds with six significant digits, short: the schedule's `data-t0`/`data-dur`.
fn secs(v: f64) -> String {
    format!("{v:.5e}")
}

/// Adds the time of every span to the schedule's bars (`data-t0`, `data-dur`,
/// `data-comm`, and `data-op` on p2p sends), in the order [`crate::gantt::gantt`] drew
/// them: its rectangles that carry a stage (`data-s`) are the spans, one each.
fn annotate_schedule(canvas: &mut Canvas, tl: &Timeline) -> Result<(), String> {
    let spans = tl.spans();
    let mut it = spans.iter();
    for item in canvas.items.iter_mut() {
        if item.data("s").is_none() {
            continue;
        }
        let s = it
            .next()
            .ok_or("the schedule has more bars than the timeline has spans")?;
        item.with("t0", secs(s.start_s))
            .with("dur", secs(s.dur_s()));
        if s.comm_s > 0.0 {
            item.with("comm", secs(s.comm_s));
        }
        match s.kind {
            SpanKind::SendAct => {
                item.with("op", "a");
            }
            SpanKind::SendGrad => {
                item.with("op", "g");
            }
            _ => {}
        }
    }
    if it.next().is_some() {
        return Err("the schedule has fewer bars than the timeline has spans".into());
    }
    Ok(())
}

/// Tooltips of the memory bars: stage, part, GiB, the stage's total.
fn annotate_memory(canvas: &mut Canvas, tl: &Timeline) {
    let stages = tl.stage_memory();
    for item in canvas.items.iter_mut() {
        let Item::Rect { class, .. } = item else {
            continue;
        };
        let Some(label) = MEMORY_PARTS
            .iter()
            .find(|(c, _, _)| c == class)
            .map(|(_, l, _)| *l)
        else {
            continue;
        };
        let (Some(s), Some(bytes)) = (
            item.data("s").and_then(|s| s.parse::<usize>().ok()),
            item.data("bytes").and_then(|b| b.parse::<f64>().ok()),
        ) else {
            continue;
        };
        let total = stages.get(s).map_or(0.0, |m| m.total);
        let tip = format!(
            "stage {s}: {label}\n{:.2} GiB of the stage's {:.2} GiB per GPU\ncapacity {:.1} GiB",
            bytes / GIB,
            total / GIB,
            tl.memory_capacity_bytes() / GIB
        );
        item.with("tip", tip);
    }
}

/// Tooltips of the mesh's nodes: node, its GPUs, its pipeline stage.
fn annotate_mesh(canvas: &mut Canvas, gpus_per_node: u64) {
    for item in canvas.items.iter_mut() {
        let (Some(n), Some(s)) = (
            item.data("n").and_then(|n| n.parse::<u64>().ok()),
            item.data("s").map(str::to_string),
        ) else {
            continue;
        };
        let first = n * gpus_per_node;
        let tip = format!(
            "node {n}: GPUs {first}-{}\npipeline stage {s}",
            first + gpus_per_node.saturating_sub(1)
        );
        item.with("tip", tip);
    }
}

/// Tooltips of the comparison's bars: row, term, seconds.
fn annotate_compare(canvas: &mut Canvas, rows: &[CompareRow]) {
    for item in canvas.items.iter_mut() {
        let Item::Rect { class, .. } = item else {
            continue;
        };
        let Some(label) = crate::compare::PARTS
            .iter()
            .find(|(c, _, _)| c == class)
            .map(|(_, l, _)| *l)
        else {
            continue;
        };
        let Some(row) = item
            .data("row")
            .and_then(|r| r.parse::<usize>().ok())
            .and_then(|r| rows.get(r))
        else {
            continue;
        };
        let b = &row.bar;
        let part = match label {
            "compute" => b.compute_s.unwrap_or(0.0),
            "bubble" => b.bubble_s,
            _ => b.exposed_comm_s,
        };
        let tip = format!(
            "{}: {label} {}\n{}{}",
            b.name,
            fmt_dur(part),
            b.strategy,
            row.ratio
                .map(|r| format!("\n{r:.3}x the plan"))
                .unwrap_or_default()
        );
        item.with("tip", tip);
    }
}

/// Tooltips of the calibration markers.
fn annotate_calibration(canvas: &mut Canvas, rows: &[CalibrationRow]) {
    for item in canvas.items.iter_mut() {
        let Item::Rect { class, .. } = item else {
            continue;
        };
        let what = match class.as_str() {
            "cal-predicted" => "predicted / published",
            "cal-loo" => "leave-one-out / published",
            _ => continue,
        };
        let Some(row) = item
            .data("row")
            .and_then(|r| r.parse::<usize>().ok())
            .and_then(|r| rows.get(r))
        else {
            continue;
        };
        let ratio = item.data("ratio").unwrap_or_default().to_string();
        let fitted = if row.unfitted {
            "\nnot fitted: no mechanism explains it"
        } else {
            ""
        };
        item.with("tip", format!("{}\n{what}: {ratio}x{fitted}", row.id));
    }
}

/// The page. Errors name what the plan lacks (a plan without `predicted.timeline`).
pub fn report_html(r: &ReportInput<'_>) -> Result<String, String> {
    let plan = r.plan;
    let tl = crate::timeline_of(plan)?;
    let figures = crate::plan_figures(plan)?;
    let take = |name: &str| {
        figures
            .iter()
            .find(|f| f.name == name)
            .map(|f| f.canvas.clone())
            .ok_or_else(|| format!("no {name} figure"))
    };
    let mut gantt = take("pipeline")?;
    let mut memory = take("memory")?;
    let mut mesh = take("mesh")?;
    annotate_schedule(&mut gantt, &tl)?;
    annotate_memory(&mut memory, &tl);
    annotate_mesh(&mut mesh, plan.cluster.gpus_per_node);

    let mut h = String::with_capacity(2 << 20);
    let world: u64 = plan.mesh.shape.iter().product();
    let title = format!("{} on {} GPUs", plan.model.name, world);
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<meta name=\"generator\" content=\"{}\">\n<title>meshplan report: {}</title>\n<style>{CSS}</style>\n</head>\n<body>\n",
        esc(&r.generator),
        esc(&title)
    );
    let inference = matches!(plan.workload, Workload::Inference { .. });
    let _ = write!(
        h,
        "<header class=\"top\"><div class=\"wrap\"><div class=\"brand\">meshplan report</div><h1>{}</h1><p class=\"sub\">{} x {} {} ({}) &middot; {} &middot; <code>{}</code></p></div></header>\n<nav class=\"bar\"><div class=\"wrap\">",
        esc(&title),
        plan.cluster.nodes,
        plan.cluster.gpus_per_node,
        esc(&plan.cluster.gpu),
        esc(&plan.cluster.name),
        if inference { "inference" } else { "training" },
        esc(&plan.strategy.to_string())
    );
    for (id, name) in SECTIONS {
        let _ = write!(h, "<a href=\"#{id}\">{name}</a>");
    }
    h.push_str("</div></nav>\n<main class=\"wrap\">\n");

    summary(&mut h, plan, inference);

    // Schedule.
    let vpp = match &tl {
        Timeline::Train(t) => t.vpp,
        Timeline::Inference(_) => 1,
    };
    open(
        &mut h,
        "schedule",
        &format!(
            " data-vpp=\"{vpp}\" data-bars=\"{}\"",
            gantt.items.iter().filter(|i| i.data("t0").is_some()).count()
        ),
        "Pipeline schedule",
        "The cost model's own simulation of one step (the plan's <code>predicted.timeline</code>), one row per pipeline stage: every GPU of a stage runs the same program. Hover a bar for its stage, micro-batch, operation and time.",
    );
    figure(&mut h, &gantt);
    h.push_str("</section>\n");

    // Memory.
    open(
        &mut h,
        "memory",
        "",
        "Memory per GPU",
        "The memory ledger of each pipeline stage against the GPU's capacity (the dashed line).",
    );
    figure(&mut h, &memory);
    memory_table(&mut h, &tl);
    h.push_str("</section>\n");

    // Mesh.
    open(
        &mut h,
        "mesh",
        "",
        "Mesh on the nodes",
        "Each mesh axis with the link its groups use (NVLink inside a node, InfiniBand across nodes); nodes coloured by pipeline stage.",
    );
    figure(&mut h, &mesh);
    mesh_table(&mut h, plan);
    h.push_str("</section>\n");

    // Comparison.
    match &r.compare {
        Ok(c) => {
            open(&mut h, "compare", "", "Comparison", &prose(&c.caption));
            let bars: Vec<CompareBar> = c.rows.iter().map(|r| r.bar.clone()).collect();
            let mut canvas = compare_bars(&bars, &c.title, &c.what);
            annotate_compare(&mut canvas, &c.rows);
            figure(&mut h, &canvas);
            compare_table(&mut h, c, inference);
        }
        Err(why) => {
            open(&mut h, "compare", "", "Comparison", "");
            let _ = write!(h, "<p class=\"note\">{}</p>", esc(why));
        }
    }
    h.push_str("</section>\n");

    // Explain.
    match &r.explain {
        Ok(x) => {
            open(
                &mut h,
                "explain",
                "",
                "Why this plan",
                &format!(
                    "Its neighbours, one change each, re-priced with the same cost model on {} (<code>meshplan explain</code>), {}.",
                    esc(&x.setting),
                    if x.inference { "most tokens/s first" } else { "fastest first" }
                ),
            );
            explain_tables(&mut h, x);
        }
        Err(why) => {
            open(&mut h, "explain", "", "Why this plan", "");
            let _ = write!(h, "<p class=\"note\">{}</p>", esc(why));
        }
    }
    h.push_str("</section>\n");

    // Calibration.
    let rows = published_calibration();
    let mut cal = calibration_chart(&rows, &calibration_title(rows.len()));
    annotate_calibration(&mut cal, &rows);
    open(
        &mut h,
        "calibration",
        "",
        "Calibration",
        "How far the cost model that priced this plan is from published training runs: predicted over published speed per run (blue), and the same with the constants refitted without that run (orange). 1x is exact; right of it the model is too optimistic.",
    );
    figure(&mut h, &cal);
    h.push_str("</section>\n");

    let _ = write!(
        h,
        "</main>\n<footer>Written by {} from <code>{}</code>. One file: no network, no external resources.</footer>\n<div id=\"tip\" role=\"tooltip\" hidden></div>\n<script>{JS}</script>\n</body>\n</html>\n",
        esc(&r.generator),
        esc(&r.source)
    );
    Ok(h)
}

fn open(h: &mut String, id: &str, attrs: &str, heading: &str, lead: &str) {
    let _ = write!(
        h,
        "<section id=\"{id}\" class=\"card\"{attrs}>\n<h2>{heading}</h2>\n"
    );
    if !lead.is_empty() {
        let _ = writeln!(h, "<p class=\"lead\">{lead}</p>");
    }
}

fn figure(h: &mut String, c: &Canvas) {
    let svg = c.to_svg();
    // The drawer's SVG as it writes files, inline; `--w` caps it at its own width.
    let _ = write!(
        h,
        "<div class=\"fig\" style=\"--w:{:.0}px\">\n{svg}</div>\n",
        c.width
    );
}

fn metric(h: &mut String, key: &str, value: &str, detail: &str, meter: Option<f64>) {
    let _ = write!(
        h,
        "<div class=\"metric\"><div class=\"k\">{key}</div><div class=\"v\">{value}</div>"
    );
    if let Some(f) = meter {
        let f = f.clamp(0.0, 1.0);
        let _ = write!(
            h,
            "<div class=\"meter{}\"><span style=\"width:{:.1}%\"></span></div>",
            if f > 0.95 { " hot" } else { "" },
            100.0 * f
        );
    }
    let _ = write!(h, "<div class=\"d\">{detail}</div></div>");
}

fn summary(h: &mut String, plan: &Plan, inference: bool) {
    let p = &plan.predicted;
    let cfg = &plan.strategy;
    open(h, "summary", "", "Summary", "");
    h.push_str("<div class=\"metrics\">");
    let mem = p.get("memory_per_gpu_bytes").cloned().unwrap_or_default();
    let mem_total = num(&mem, "total").unwrap_or(0.0);
    let cap = num(p, "memory_capacity_bytes").unwrap_or(plan.cluster.gpu_memory_bytes);
    if inference {
        let ttft = num(p, "ttft_s").unwrap_or(0.0);
        let tpot = num(p, "tpot_s").unwrap_or(0.0);
        metric(
            h,
            "TTFT",
            &esc(&fmt_dur(ttft)),
            "time to the first token",
            None,
        );
        metric(
            h,
            "TPOT",
            &esc(&fmt_dur(tpot)),
            "time per output token",
            None,
        );
        metric(
            h,
            "Output tokens/s",
            &grouped(num(p, "output_tokens_per_s").unwrap_or(0.0)),
            &format!(
                "max concurrency {}",
                p.get("max_concurrency")
                    .and_then(Value::as_u64)
                    .map_or("-".into(), |c| c.to_string())
            ),
            None,
        );
        metric(
            h,
            "KV capacity",
            &format!("{:.3e}", num(p, "kv_capacity_tokens").unwrap_or(0.0)),
            "tokens",
            None,
        );
    } else {
        let step = num(p, "step_time_s").unwrap_or(0.0);
        let mbs = p.get("microbatches").and_then(Value::as_u64).unwrap_or(0);
        metric(
            h,
            "Step time",
            &esc(&fmt_dur(step)),
            &format!(
                "{mbs} micro-batches of {} sequence{} per pipeline",
                cfg.mbs,
                if cfg.mbs == 1 { "" } else { "s" }
            ),
            None,
        );
        let (seq, gb) = match &plan.workload {
            Workload::Train {
                seq_len,
                global_batch,
                ..
            } => (*seq_len, *global_batch),
            Workload::Inference { .. } => (0, 0),
        };
        metric(
            h,
            "Throughput",
            &format!(
                "{} <small>tokens/s</small>",
                grouped(num(p, "tokens_per_s").unwrap_or(0.0))
            ),
            &format!("{gb} sequences of {seq} tokens per step"),
            None,
        );
        let mfu = num(p, "mfu").unwrap_or(0.0);
        metric(
            h,
            "MFU",
            &format!("{:.1}%", 100.0 * mfu),
            &format!(
                "{:.1} model TFLOP/s per GPU &middot; HFU {:.1}% ({:.1} TFLOP/s)",
                num(p, "model_tflops_per_gpu").unwrap_or(0.0),
                100.0 * num(p, "hfu").unwrap_or(0.0),
                num(p, "hardware_tflops_per_gpu").unwrap_or(0.0)
            ),
            Some(mfu),
        );
        metric(
            h,
            "Bubble",
            &format!("{:.1}%", 100.0 * num(p, "bubble_fraction").unwrap_or(0.0)),
            "of the step, pipeline fill and drain",
            None,
        );
    }
    metric(
        h,
        "Memory per GPU",
        &format!("{:.1} <small>GiB</small>", mem_total / GIB),
        &format!(
            "fullest GPU, of {:.1} GiB ({:.0}%)",
            cap / GIB,
            100.0 * mem_total / cap.max(1.0)
        ),
        Some(mem_total / cap.max(1.0)),
    );
    h.push_str("</div>\n");

    // Step time split, as a bar.
    if let Some(t) = p.get("time_breakdown_s") {
        let parts = [
            ("compute", num(t, "compute").unwrap_or(0.0), "c0"),
            (
                "exposed communication",
                num(t, "exposed_comm").unwrap_or(0.0),
                "c1",
            ),
            ("bubble", num(t, "bubble").unwrap_or(0.0), "c2"),
        ];
        let total: f64 = parts.iter().map(|p| p.1).sum();
        if total > 0.0 {
            h.push_str("<div class=\"split\" aria-label=\"time breakdown\">");
            for (name, v, class) in parts {
                if v > 0.0 {
                    let _ = write!(
                        h,
                        "<span class=\"{class}\" style=\"width:{:.2}%\" data-tip=\"{name}: {}\"></span>",
                        100.0 * v / total,
                        esc(&fmt_dur(v))
                    );
                }
            }
            h.push_str("</div><div class=\"legend\">");
            let _ = write!(
                h,
                "<span class=\"what\">{}:</span>",
                if inference {
                    "one decode step (TPOT)"
                } else {
                    "one training step"
                }
            );
            for (name, v, class) in parts {
                let _ = write!(
                    h,
                    "<span><i class=\"{class}\"></i>{name} {} ({:.1}%)</span>",
                    esc(&fmt_dur(v)),
                    100.0 * v / total
                );
            }
            h.push_str("</div>\n");
        }
    }

    // Degrees.
    h.push_str("<div class=\"chips\">");
    for (k, v) in [
        ("dp", cfg.dp),
        ("tp", cfg.tp),
        ("pp", cfg.pp),
        ("cp", cfg.cp),
        ("ep", cfg.ep),
        ("vpp", cfg.vpp),
        ("mbs", cfg.mbs),
        ("zero", cfg.zero as u64),
    ] {
        let _ = write!(
            h,
            "<span class=\"{}\"><b>{k}</b> {v}</span>",
            if v > 1 && k != "mbs" && k != "zero" {
                "on"
            } else {
                ""
            }
        );
    }
    let rc = format!("{:?}", cfg.recompute).to_lowercase();
    let _ = write!(
        h,
        "<span><b>recompute</b> {rc}</span><span><b>sp</b> {}</span>",
        cfg.sp
    );
    h.push_str("</div>\n<div class=\"grid2\">");

    // Model, workload, cluster, search.
    let mut kv = |title: &str, rows: Vec<(&str, String)>| {
        let _ = write!(h, "<div><h3>{title}</h3><dl class=\"kv\">");
        for (k, v) in rows {
            let _ = write!(h, "<dt>{k}</dt><dd>{v}</dd>");
        }
        h.push_str("</dl></div>");
    };
    let m = &plan.model;
    kv(
        "Model",
        vec![
            ("name", esc(&m.name)),
            ("parameters", count(m.params)),
            ("block layers", m.layers.to_string()),
            ("dtype", m.dtype.to_string()),
        ],
    );
    let workload = match &plan.workload {
        Workload::Train {
            seq_len,
            global_batch,
            optimizer,
            framework,
        } => vec![
            ("kind", "training".to_string()),
            ("sequence", format!("{seq_len} tokens")),
            ("global batch", format!("{global_batch} sequences")),
            ("optimizer", esc(optimizer)),
            ("framework", esc(&framework.to_string())),
        ],
        Workload::Inference {
            prompt_len,
            output_len,
            concurrency,
            ..
        } => vec![
            ("kind", "inference".to_string()),
            ("prompt", format!("{prompt_len} tokens")),
            ("output", format!("{output_len} tokens")),
            ("concurrency", concurrency.to_string()),
        ],
    };
    kv("Workload", workload);
    let c = &plan.cluster;
    kv(
        "Cluster",
        vec![
            ("name", esc(&c.name)),
            (
                "GPUs",
                format!(
                    "{} nodes x {} = {}",
                    c.nodes,
                    c.gpus_per_node,
                    c.nodes * c.gpus_per_node
                ),
            ),
            ("GPU", esc(&c.gpu)),
            ("GPU memory", format!("{:.1} GiB", c.gpu_memory_bytes / GIB)),
        ],
    );
    let mut layout = vec![("layer split", format!("{:?}", plan.layer_split))];
    if let Some(b) = p.get("comm_bytes_per_gpu") {
        let mut parts = Vec::new();
        for axis in ["dp", "tp", "pp", "cp", "ep"] {
            let v = num(b, axis).unwrap_or(0.0);
            if v > 0.0 {
                parts.push(format!("{axis} {:.2}", v / 1e9));
            }
        }
        layout.push(("sent per GPU", format!("{} GB", parts.join(", "))));
    }
    let s = &plan.search;
    layout.push((
        "search",
        format!(
            "{} priced, {} pruned, {:.2} s ({}, {})",
            grouped(s.candidates_evaluated as f64),
            grouped(s.pruned as f64),
            s.wall_s,
            esc(&s.solver),
            esc(&s.stop_reason)
        ),
    ));
    kv("Layout", layout);
    h.push_str("</div>\n</section>\n");
}

fn memory_table(h: &mut String, tl: &Timeline) {
    let stages = tl.stage_memory();
    let cap = tl.memory_capacity_bytes();
    h.push_str("<details><summary>Ledger per stage (GiB per GPU)</summary><table class=\"t\"><thead><tr><th>stage</th>");
    for (_, label, _) in MEMORY_PARTS {
        let _ = write!(h, "<th class=\"n\">{label}</th>");
    }
    h.push_str("<th class=\"n\">total</th><th class=\"n\">of capacity</th></tr></thead><tbody>");
    for (i, m) in stages.iter().enumerate() {
        let _ = write!(h, "<tr><td>{i}</td>");
        for v in crate::memory::parts(m) {
            let _ = write!(h, "<td class=\"n\">{:.2}</td>", v / GIB);
        }
        let _ = write!(
            h,
            "<td class=\"n\"><b>{:.2}</b></td><td class=\"n\">{:.0}%</td></tr>",
            m.total / GIB,
            100.0 * m.total / cap.max(1.0)
        );
    }
    h.push_str("</tbody></table></details>\n");
}

fn mesh_table(h: &mut String, plan: &Plan) {
    let links = axis_links(
        &plan.mesh.axes,
        &plan.mesh.shape,
        plan.cluster.gpus_per_node,
    );
    h.push_str("<table class=\"t\"><thead><tr><th>axis</th><th class=\"n\">size</th><th class=\"n\">stride</th><th class=\"n\">ranks per node</th><th class=\"n\">nodes per group</th><th>link</th></tr></thead><tbody>");
    for l in links {
        let link = match l.link {
            LinkKind::NvLink => "<span class=\"badge ok\">NVLink</span>",
            LinkKind::InfiniBand => "<span class=\"badge ib\">InfiniBand</span>",
            LinkKind::Unused => "<span class=\"muted\">unused</span>",
        };
        let _ = write!(
            h,
            "<tr><td><code>{}</code></td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{link}</td></tr>",
            esc(&l.axis),
            l.size,
            l.stride,
            l.per_node,
            l.nodes
        );
    }
    h.push_str("</tbody></table>\n");
}

fn fits(ok: bool) -> &'static str {
    if ok {
        "<span class=\"badge ok\">fits</span>"
    } else {
        "<span class=\"badge no\">does not fit</span>"
    }
}

fn compare_table(h: &mut String, c: &CompareSection, inference: bool) {
    let time = if inference { "TPOT" } else { "step time" };
    let speed = if inference {
        "output tok/s"
    } else {
        "tokens/s"
    };
    let _ = write!(
        h,
        "<table class=\"t\" id=\"compare-table\"><thead><tr><th>name and configuration</th><th class=\"n\">{time}</th><th class=\"n\">{speed}</th><th class=\"n\">ratio</th><th class=\"n\">memory GiB</th><th></th><th>what differs</th></tr></thead><tbody>"
    );
    for (i, r) in c.rows.iter().enumerate() {
        let b = &r.bar;
        let _ = write!(
            h,
            "<tr{}><td><b>{}</b><div class=\"cfg muted\">{}</div></td>",
            if i == 0 { " class=\"me\"" } else { "" },
            esc(&b.name),
            esc(&b.strategy)
        );
        match r.time_s {
            Some(t) => {
                let _ = write!(
                    h,
                    "<td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td>",
                    esc(&fmt_dur(t)),
                    r.tokens_per_s.map(grouped).unwrap_or_default(),
                    r.ratio.map(|x| format!("{x:.3}x")).unwrap_or_default(),
                    r.memory_gib.map(|m| format!("{m:.1}")).unwrap_or_default(),
                    fits(b.feasible)
                );
            }
            None => {
                h.push_str("<td class=\"n\" colspan=\"4\">-</td><td><span class=\"badge no\">cannot run</span></td>");
            }
        }
        let _ = write!(h, "<td>{}</td></tr>", esc(&r.differs));
    }
    h.push_str("</tbody></table>\n");
}

fn pct_cell(v: &Result<Option<f64>, String>) -> String {
    match v {
        Ok(Some(p)) => format!("<td class=\"n\">{p:+.1}%</td>"),
        Ok(None) => "<td class=\"n muted\">-</td>".into(),
        Err(why) => format!(
            "<td class=\"n\"><span class=\"badge no\" data-tip=\"{}\">does not fit</span></td>",
            esc(why)
        ),
    }
}

fn neighbour_rows(h: &mut String, rows: &[Neighbour], inference: bool, numbered: bool) {
    for (i, a) in rows.iter().enumerate() {
        let first = if numbered {
            format!("<td class=\"n\">{}</td>", i + 1)
        } else {
            String::new()
        };
        let time = if inference {
            format!(
                "<td class=\"n\">{}</td><td class=\"n\">{}</td>",
                grouped(a.tokens_per_s),
                esc(&fmt_dur(a.time_s))
            )
        } else {
            format!(
                "<td class=\"n\">{}</td><td class=\"n {}\">{:+.1}%</td>",
                esc(&fmt_dur(a.time_s)),
                if a.delta_pct > 1e-9 {
                    "worse"
                } else if a.delta_pct < -1e-9 {
                    "better"
                } else {
                    ""
                },
                a.delta_pct
            )
        };
        let ib: String = a
            .crosses_infiniband
            .iter()
            .map(|x| {
                format!(
                    "<span class=\"badge ib\">{} over InfiniBand</span> ",
                    esc(x)
                )
            })
            .collect();
        let _ = write!(
            h,
            "<tr>{first}<td><b>{}</b><div class=\"cfg muted\">{}</div></td>{time}<td class=\"n\">{:.1}</td><td>{}</td><td>{ib}{}</td></tr>",
            esc(&a.change),
            esc(&a.strategy),
            a.memory_gib,
            fits(a.feasible),
            esc(&a.deciding)
        );
    }
}

fn explain_tables(h: &mut String, x: &ExplainSection) {
    let cols = if x.inference {
        "<th class=\"n\">output tok/s</th><th class=\"n\">TPOT</th>"
    } else {
        "<th class=\"n\">step time</th><th class=\"n\">vs plan</th>"
    };
    let _ = write!(
        h,
        "<h3>Neighbours</h3><table class=\"t\" id=\"neighbours\"><thead><tr><th class=\"n\">#</th><th>change</th>{cols}<th class=\"n\">memory GiB</th><th></th><th>deciding term</th></tr></thead><tbody>"
    );
    neighbour_rows(h, &x.neighbours, x.inference, true);
    h.push_str("</tbody></table>\n");
    if !x.cannot_run.is_empty() {
        h.push_str("<h3>Cannot run</h3><ul class=\"plain\">");
        for (change, why) in &x.cannot_run {
            let _ = write!(h, "<li><b>{}</b>: {}</li>", esc(change), esc(why));
        }
        h.push_str("</ul>\n");
    }
    if !x.sensitivity.is_empty() {
        h.push_str("<h3>Sensitivity of the step time to each degree</h3><p class=\"lead\">Twice and half the degree, the data-parallel degree taking up the rest.</p><table class=\"t narrow\"><thead><tr><th>degree</th><th class=\"n\">value</th><th class=\"n\">x2</th><th class=\"n\">/2</th></tr></thead><tbody>");
        for s in &x.sensitivity {
            let _ = write!(
                h,
                "<tr><td><code>{}</code></td><td class=\"n\">{}</td>{}{}</tr>",
                esc(&s.key),
                s.value,
                pct_cell(&s.doubled),
                pct_cell(&s.halved)
            );
        }
        h.push_str("</tbody></table>\n");
    }
    if !x.what_if.is_empty() {
        let _ = write!(
            h,
            "<h3>What if</h3><table class=\"t\"><thead><tr><th>change</th>{cols}<th class=\"n\">memory GiB</th><th></th><th>deciding term</th></tr></thead><tbody>"
        );
        neighbour_rows(h, &x.what_if, x.inference, false);
        h.push_str("</tbody></table>\n");
    }
}

const CSS: &str = r#"
:root{--ink:#1d2633;--muted:#5d6b7c;--line:#e2e7ee;--bg:#f3f5f8;--card:#fff;--accent:#4c78a8;--c1:#f58518;--c2:#b9c0c9}
*{box-sizing:border-box}
html{scroll-behavior:smooth}
body{margin:0;font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;color:var(--ink);background:var(--bg)}
code,.cfg{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;font-size:12px}
.wrap{max-width:1500px;margin:0 auto;padding:0 28px}
header.top{background:linear-gradient(180deg,#1b2636,#223247);color:#fff;padding:20px 0 4px}
.brand{font-size:11px;letter-spacing:.14em;text-transform:uppercase;color:#8fa6bf;font-weight:600}
h1{margin:2px 0 2px;font-size:23px;font-weight:600;letter-spacing:-.01em}
.sub{color:#c3cfdc;margin:0 0 10px;font-size:13px}
.sub code{color:#e3ebf3;background:rgba(255,255,255,.08);padding:1px 6px;border-radius:4px}
nav.bar{background:#223247;position:sticky;top:0;z-index:5;box-shadow:0 2px 6px rgba(0,0,0,.16)}
nav.bar .wrap{display:flex;flex-wrap:wrap}
nav a{color:#b8c6d6;text-decoration:none;padding:7px 14px 9px;border-bottom:3px solid transparent;font-size:13px}
nav a:hover{color:#fff;border-bottom-color:var(--accent)}
main.wrap{padding-top:22px;padding-bottom:10px}
section.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:18px 22px 20px;margin:0 0 20px;box-shadow:0 1px 2px rgba(16,24,40,.05);scroll-margin-top:56px}
h2{font-size:17px;margin:0 0 4px;font-weight:600}
h3{font-size:13px;margin:16px 0 6px;color:var(--muted);text-transform:uppercase;letter-spacing:.05em;font-weight:600}
p.lead{color:var(--muted);margin:0 0 12px;max-width:1060px}
p.note{color:var(--muted);font-style:italic}
.metrics{display:grid;grid-template-columns:repeat(auto-fit,minmax(210px,1fr));gap:12px;margin:8px 0 16px}
.metric{border:1px solid var(--line);border-radius:8px;padding:11px 14px 12px;background:#fafbfc}
.metric .k{font-size:11.5px;color:var(--muted);text-transform:uppercase;letter-spacing:.06em;font-weight:600}
.metric .v{font-size:25px;font-weight:600;font-variant-numeric:tabular-nums;margin:1px 0 2px;letter-spacing:-.01em}
.metric .v small{font-size:13px;color:var(--muted);font-weight:500}
.metric .d{font-size:12px;color:var(--muted)}
.meter{height:5px;background:#e6eaf0;border-radius:3px;overflow:hidden;margin:4px 0 5px}
.meter>span{display:block;height:100%;background:var(--accent)}
.meter.hot>span{background:#c0392b}
.split{display:flex;height:14px;border-radius:4px;overflow:hidden;margin:2px 0 6px;background:#eef1f5}
.split span{display:block;height:100%}
.c0{background:var(--accent)}.c1{background:var(--c1)}.c2{background:var(--c2)}
.legend{display:flex;flex-wrap:wrap;gap:4px 18px;font-size:12px;color:var(--muted);margin-bottom:12px}
.legend .what{font-weight:600;color:var(--ink)}
.legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px;vertical-align:-1px}
.chips{margin:4px 0 8px}
.chips span{display:inline-block;font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;background:#f1f4f8;border:1px solid #dde3ea;color:#44505e;border-radius:12px;padding:2px 10px;margin:0 6px 6px 0}
.chips span.on{background:#e8f0f9;border-color:#b9cde3;color:#1f4f7f}
.chips b{font-weight:600}
.grid2{display:grid;grid-template-columns:repeat(auto-fit,minmax(300px,1fr));gap:4px 30px}
dl.kv{display:grid;grid-template-columns:max-content 1fr;gap:3px 14px;margin:0}
dl.kv dt{color:var(--muted)}
dl.kv dd{margin:0;font-variant-numeric:tabular-nums;overflow-wrap:anywhere}
.fig{overflow-x:auto;border:1px solid var(--line);border-radius:8px;padding:4px;background:#fff;margin:4px 0 12px}
.fig svg{display:block;width:100%;max-width:var(--w);height:auto;min-width:min(720px,var(--w))}
svg text,svg line{pointer-events:none}
svg rect.comm,svg rect.legend{pointer-events:none}
svg rect[data-t0]:hover,svg rect[data-tip]:hover{stroke:#111;stroke-width:1.2px}
table.t{border-collapse:collapse;width:100%;font-size:13px;margin:4px 0 6px}
table.t.narrow{width:auto;min-width:420px}
table.t th{text-align:left;font-weight:600;color:var(--muted);border-bottom:2px solid var(--line);padding:6px 9px;white-space:nowrap;font-size:11.5px;text-transform:uppercase;letter-spacing:.04em}
table.t td{border-bottom:1px solid var(--line);padding:6px 9px;vertical-align:top}
table.t tbody tr:hover td{background:#f7f9fc}
table.t tr.me td{background:#eef4fb}
.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
th.n{text-align:right}
.muted{color:var(--muted)}
.worse{color:#a8281b}.better{color:#1e6b3a}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:11.5px;font-weight:600;white-space:nowrap}
.badge.ok{background:#e5f4ea;color:#1e6b3a}.badge.no{background:#fdeceb;color:#a8281b}.badge.ib{background:#fff2df;color:#935400}
details{margin:6px 0 4px}
summary{cursor:pointer;color:var(--accent);font-weight:600;font-size:13px;margin-bottom:6px}
ul.plain{margin:4px 0;padding-left:18px}
footer{color:var(--muted);font-size:12px;text-align:center;padding:6px 0 28px}
#tip{position:fixed;left:0;top:0;z-index:20;pointer-events:none;background:#18222f;color:#e9eef4;font-size:12.5px;line-height:1.5;padding:8px 11px;border-radius:6px;box-shadow:0 6px 18px rgba(0,0,0,.28);max-width:380px}
#tip[hidden]{display:none}
#tip strong{display:block;color:#fff;font-weight:600;margin-bottom:1px}
"#;

// The tooltip script. Its `dur` is `crate::axis::fmt_dur` again, and must be: the
// schedule's bars carry only `data-t0`/`data-dur`/`data-comm` (seconds) and the
// script formats start, end (t0 + dur) and duration on hover. Formatting those lines
// in Rust instead, as a `data-tip` per bar, would multiply the page's size by the
// spans of a large plan (GPT-3's page must stay under 2 MB). The other tooltips are
// formatted in Rust (`data-tip`). `js_dur_is_fmt_dur` holds the two alike.
const JS: &str = r#"
(function(){
"use strict";
var tip=document.getElementById("tip");
var OPS={fwd:"forward",bwd:"backward",prefill:"prefill",decode:"decode step",p2p:"p2p send","dp-comm":"data-parallel gradient reduction (exposed)","tp-sync":"tensor-parallel gradient sync",optimizer:"optimizer step",bubble:"bubble (idle)"};
var P2P={a:"activation to the next stage",g:"gradient to the previous stage"};
var sched=document.getElementById("schedule");
var vpp=sched?+sched.getAttribute("data-vpp"):1;
function dur(t){return t>=1?t.toFixed(3)+" s":t>=1e-3?(t*1e3).toFixed(2)+" ms":(t*1e6).toFixed(1)+" us";}
function lines(r){
  var d=r.dataset;
  if(d.tip!==undefined)return d.tip.split("\n");
  var cls=r.getAttribute("class");
  var out=["stage "+d.s+": "+(OPS[cls]||cls)];
  if(d.op)out.push(P2P[d.op]||d.op);
  if(d.mb!==undefined)out.push("micro-batch "+d.mb+(vpp>1?", chunk "+d.c:""));
  var t0=+d.t0,du=+d.dur;
  out.push("start "+dur(t0)+", end "+dur(t0+du));
  out.push("duration "+dur(du)+(d.comm?" (collectives inside: "+dur(+d.comm)+")":""));
  return out;
}
var cur=null;
function place(e){
  var pad=14,x=e.clientX+pad,y=e.clientY+pad,w=tip.offsetWidth,h=tip.offsetHeight;
  if(x+w>window.innerWidth-4)x=Math.max(4,e.clientX-w-pad);
  if(y+h>window.innerHeight-4)y=Math.max(4,e.clientY-h-pad);
  tip.style.left=x+"px";tip.style.top=y+"px";
}
function hide(){cur=null;tip.hidden=true;}
function over(e){
  var t=e.target,r=t&&t.closest?t.closest("[data-tip],rect[data-t0]"):null;
  if(!r){hide();return;}
  if(r!==cur){
    cur=r;
    var ls=lines(r);
    while(tip.firstChild)tip.removeChild(tip.firstChild);
    ls.forEach(function(l,i){var n=document.createElement(i?"div":"strong");n.textContent=l;tip.appendChild(n);});
    tip.hidden=false;
  }
  place(e);
}
document.addEventListener("mouseover",over);
document.addEventListener("mousemove",function(e){if(cur)place(e);});
document.addEventListener("mouseleave",hide);
})();
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibration_rows_are_compiled_in() {
        let rows = published_calibration();
        assert_eq!(rows.len(), 22);
        assert_eq!(rows.iter().filter(|r| r.unfitted).count(), 3);
        assert!(rows.iter().all(|r| r.ratio > 0.0 && r.loo_ratio > 0.0));
    }

    #[test]
    fn js_dur_is_fmt_dur() {
        // Same thresholds, units and decimals as `fmt_dur`.
        assert!(JS.contains(
            r#"function dur(t){return t>=1?t.toFixed(3)+" s":t>=1e-3?(t*1e3).toFixed(2)+" ms":(t*1e6).toFixed(1)+" us";}"#
        ));
        assert_eq!(fmt_dur(1.0), "1.000 s");
        assert_eq!(fmt_dur(1e-3), "1.00 ms");
        assert_eq!(fmt_dur(9.99e-4), "999.0 us");
    }

    #[test]
    fn numbers_and_escapes() {
        assert_eq!(grouped(475181.7), "475,182");
        assert_eq!(grouped(999.0), "999");
        assert_eq!(grouped(1000.0), "1,000");
        assert_eq!(count(174_615_846_912.0), "174.6 B");
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
        assert_eq!(secs(6.620052786861222), "6.62005e0");
    }
}
