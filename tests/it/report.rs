//! `meshplan report` and `--report` on `plan` and `compare`: one self-contained HTML
//! page holding every section, small for GPT-3 on 3840 GPUs, and bad input exits 2
//! naming the file. The page in a browser (tooltips, console, load time) is
//! `tests/python/report/`.

use crate::cli::{meshplan, temp_file};
use meshplan_ir::plan::Plan;
use meshplan_viz::report::{parse_calibration, SECTIONS};
use std::path::{Path, PathBuf};
use std::time::Instant;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
/// The report of GPT-3 175B on 3840 GPUs stays under this (measured 1.49 MB).
const GPT3_MAX_BYTES: usize = 2_000_000;

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meshplan-report-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&d).expect("dir");
    d
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Every section, the tooltip and its script, and nothing fetched from elsewhere.
#[track_caller]
fn check_page(html: &str) {
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(html.trim_end().ends_with("</html>"));
    for (id, heading) in SECTIONS {
        assert!(
            html.contains(&format!("<section id=\"{id}\"")),
            "section {id} is missing"
        );
        assert!(html.contains(&format!("<h2>{heading}</h2>")), "{heading}");
        assert!(html.contains(&format!("<a href=\"#{id}\">")), "nav to {id}");
    }
    assert!(html.contains("<div id=\"tip\" role=\"tooltip\" hidden></div>"));
    assert!(html.contains("<script>") && html.contains("<style>"));
    // Self-contained: no external script, style, image, font or link.
    let lower = html.to_ascii_lowercase();
    for attr in ["src=", "href="] {
        for (i, _) in lower.match_indices(attr) {
            let value = lower[i + attr.len()..].trim_start_matches(['"', '\'']);
            assert!(
                value.starts_with('#'),
                "{attr} pointing outside the page: {}",
                &html[i..(i + 80).min(html.len())]
            );
        }
    }
    for banned in [
        "<link",
        "@import",
        "url(",
        "<iframe",
        "<img",
        "fetch(",
        "xmlhttprequest",
    ] {
        assert!(!lower.contains(banned), "the page holds `{banned}`");
    }
}

#[test]
fn gpt3_on_3840_gpus_report_has_every_section_and_stays_small() {
    let d = dir("gpt3");
    let plan = d.join("gpt3.json");
    let by_plan = d.join("plan-report.html");
    meshplan(&[
        "plan",
        "models/gpt3-175b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--nodes",
        "480",
        "-o",
        &s(&plan),
        "--report",
        &s(&by_plan),
        "-q",
    ])
    .expect_code(0);
    let page = d.join("report.html");
    let t = Instant::now();
    meshplan(&["report", &s(&plan), "-o", &s(&page)])
        .expect_code(0)
        .stderr_has(&["report written to", "report.html"]);
    let took = t.elapsed().as_secs_f64();
    let html = std::fs::read_to_string(&page).expect("report");
    eprintln!(
        "GPT-3 175B on 3840 GPUs: report of {} bytes written in {took:.3} s",
        html.len()
    );
    assert!(html.len() < GPT3_MAX_BYTES, "{} bytes", html.len());
    check_page(&html);
    assert_eq!(
        std::fs::read(&by_plan).expect("plan --report"),
        html.as_bytes(),
        "plan --report writes the page `report` writes"
    );

    // One bar with its time per span of the plan's schedule.
    let (p, _) = Plan::read_file(&plan).expect("plan");
    let tl = meshplan_viz::timeline_of(&p).expect("timeline");
    let spans = tl.spans();
    assert_eq!(html.matches(" data-t0=\"").count(), spans.len());
    assert!(html.contains(&format!("data-bars=\"{}\"", spans.len())));
    // The summary uses the plan's keys.
    let step = p.predicted["step_time_s"].as_f64().expect("step time");
    assert!(html.contains(&format!("{step:.3} s")), "step time {step}");
    let mfu = p.predicted["mfu"].as_f64().expect("mfu");
    assert!(html.contains(&format!("{:.1}%", 100.0 * mfu)));
    assert!(html.contains(&p.strategy.to_string()));
    // Compared with explain's neighbours, the plan first at 1.000x.
    assert!(html.contains("the plan and its neighbours"));
    assert!(html.contains("1.000x"));
    assert!(html.contains("id=\"neighbours\""));
    assert!(html.contains("pp 20-&gt;10, dp 24-&gt;48"), "a neighbour");
    // The calibration figure, from the compiled-in points.
    assert_eq!(html.matches("class=\"cal-predicted\"").count(), 22);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn compare_report_shows_the_rows_and_inference_plans_report_too() {
    let d = dir("compare");
    let page = d.join("compare.html");
    meshplan(&[
        "compare",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "dp=2,tp=2,pp=2",
        "--config",
        "dp=8,tp=1,pp=1",
        "--report",
        &s(&page),
    ])
    .expect_code(0);
    let html = std::fs::read_to_string(&page).expect("report");
    check_page(&html);
    assert!(html.contains("best and hand-given configurations"));
    let table = html
        .split("id=\"compare-table\"")
        .nth(1)
        .and_then(|t| t.split("</table>").next())
        .expect("the compare table");
    assert_eq!(table.matches("<tr").count(), 4, "header, planner, two rows");
    assert!(table.contains("<b>dp=2,tp=2,pp=2</b>"));
    assert!(table.contains("<b>dp=8,tp=1,pp=1</b>"));
    assert!(table.contains("1.000x"));

    // An inference plan: TTFT and TPOT instead of the step.
    let plan = d.join("inf.json");
    let inf = d.join("inf.html");
    meshplan(&[
        "plan",
        "models/tiny-llama-inference.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "tp=2,pp=2",
        "-o",
        &s(&plan),
        "--report",
        &s(&inf),
    ])
    .expect_code(0);
    let html = std::fs::read_to_string(&inf).expect("report");
    check_page(&html);
    assert!(html.contains(">TTFT<") && html.contains(">TPOT<"));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_input_to_report_exits_2_naming_the_file() {
    let d = dir("bad");
    let out = s(&d.join("r.html"));
    meshplan(&["report", "no/such/plan.json", "-o", &out])
        .expect_code(2)
        .stderr_has(&["no/such/plan.json"]);
    let not_plan = temp_file("report-not-a-plan.json", "{\"hello\": 1}");
    meshplan(&["report", &s(&not_plan), "-o", &out])
        .expect_code(2)
        .stderr_has(&["report-not-a-plan.json", "not a plan file", "meshplan plan"]);
    assert!(!Path::new(&out).exists(), "nothing written");

    // A plan without its timeline (an older file): names the field and the fix.
    let plan = d.join("tiny.json");
    meshplan(&[
        "plan",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "dp=2,tp=2,pp=2",
        "-o",
        &s(&plan),
        "-q",
    ])
    .expect_code(0);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    let full = v.clone();
    v["predicted"]
        .as_object_mut()
        .expect("predicted")
        .remove("timeline");
    let old = temp_file("report-old-plan.json", &v.to_string());
    meshplan(&["report", &s(&old), "-o", &out])
        .expect_code(2)
        .stderr_has(&[
            "report-old-plan.json",
            "predicted.timeline",
            "meshplan plan",
        ]);

    // Without the cluster's links there is no explanation: the page says why.
    let mut v = full;
    v["cluster"]
        .as_object_mut()
        .expect("cluster")
        .remove("spec");
    let older = temp_file("report-no-spec.json", &v.to_string());
    meshplan(&["report", &s(&older), "-o", &out]).expect_code(0);
    let html = std::fs::read_to_string(&out).expect("report");
    check_page(&html);
    assert!(html.contains("no explanation") && html.contains("re-plan"));

    // Output paths that cannot be written, before any work.
    meshplan(&["report", &s(&plan), "-o", "/no/such/dir/r.html"])
        .expect_code(2)
        .stderr_has(&["-o", "/no/such/dir"]);
    meshplan(&["report", &s(&plan), "-o", &s(&d)])
        .expect_code(2)
        .stderr_has(&["is a directory"]);
    let unwritten = d.join("unwritten.json");
    meshplan(&[
        "plan",
        "models/gpt3-175b.yaml",
        "topologies/dgx-a100-80g.yaml",
        "--nodes",
        "480",
        "-o",
        &s(&unwritten),
        "--report",
        "/no/such/dir/r.html",
    ])
    .expect_code(2)
    .stderr_has(&["--report", "/no/such/dir"]);
    assert!(!unwritten.exists(), "refused before the search");
    meshplan(&[
        "compare",
        "models/tiny-gpt.yaml",
        "topologies/cpu-test-mesh.yaml",
        "--config",
        "dp=8",
        "--report",
        &s(&d),
    ])
    .expect_code(2)
    .stderr_has(&["--report", "is a directory"]);
    let _ = std::fs::remove_dir_all(&d);
}

/// The points `meshplan report` compiles in (`viz/data/calibration.tsv`) are the
/// golden calibration figure's, which `tests/it/calibration.rs` regenerates:
/// `UPDATE_GOLDEN=1` rewrites the copy from it.
#[test]
fn compiled_calibration_points_are_the_golden_figures() {
    let golden = std::fs::read_to_string(format!("{ROOT}/tests/data/golden/calibration.svg"))
        .expect("golden calibration.svg");
    let attr = |line: &str, key: &str| -> String {
        line.split(&format!(" {key}=\""))
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or_default()
            .to_string()
    };
    let mut labels = Vec::new();
    let mut predicted = Vec::new();
    let mut loo = Vec::new();
    for line in golden.lines() {
        if line.starts_with("<text class=\"row\"") {
            let text = line.split('>').nth(1).and_then(|t| t.split('<').next());
            labels.push(text.unwrap_or_default().replace("&amp;", "&"));
        } else if line.starts_with("<rect class=\"cal-predicted\"") {
            predicted.push(attr(line, "data-ratio"));
        } else if line.starts_with("<rect class=\"cal-loo\"") {
            loo.push(attr(line, "data-ratio"));
        }
    }
    assert!(labels.len() >= 20 && labels.len() == predicted.len() && labels.len() == loo.len());
    let path = format!("{ROOT}/viz/data/calibration.tsv");
    let now = std::fs::read_to_string(&path).expect("viz/data/calibration.tsv");
    let mut want: String = now
        .lines()
        .take_while(|l| l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    for ((label, p), l) in labels.iter().zip(&predicted).zip(&loo) {
        let (id, fitted) = match label.strip_suffix(" (not fitted)") {
            Some(id) => (id, "no"),
            None => (label.as_str(), "yes"),
        };
        want.push_str(&format!("{id}\t{p}\t{l}\t{fitted}\n"));
    }
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &want).expect("write viz/data/calibration.tsv");
        return;
    }
    assert_eq!(
        now, want,
        "{path} differs from tests/data/golden/calibration.svg: regenerate it with UPDATE_GOLDEN=1 cargo test --release -p meshplan-tests --test it report"
    );
    // The report draws them with the same drawer and title as the golden figure.
    let rows = parse_calibration(&now);
    assert_eq!(rows.len(), labels.len());
    let svg = meshplan_viz::calibration::calibration_chart(
        &rows,
        &meshplan_viz::report::calibration_title(rows.len()),
    )
    .to_svg();
    assert_eq!(svg.lines().nth(2), golden.lines().nth(2), "the title line");
}
