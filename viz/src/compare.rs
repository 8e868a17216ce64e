//! `compare`'s candidates side by side: each one's step time split into compute,
//! exposed communication and pipeline bubble (the estimate's `time_breakdown_s`).

use crate::axis::fmt_dur;
use crate::canvas::{text_width, Anchor, Canvas, Rgb};
use meshplan_cost_model::Estimate;

/// One candidate.
#[derive(Clone, Debug, PartialEq)]
pub struct CompareBar {
    /// Row name (`planner` for the search's best).
    pub name: String,
    /// Its configuration.
    pub strategy: String,
    /// Compute, s (`None` when the configuration cannot run).
    pub compute_s: Option<f64>,
    /// Exposed communication, s.
    pub exposed_comm_s: f64,
    /// Bubble, s.
    pub bubble_s: f64,
    /// Fits in memory (and the SLO).
    pub feasible: bool,
    /// Why it cannot run.
    pub error: Option<String>,
}

impl CompareBar {
    /// The bar of a configuration the cost model priced (`estimate`), or of one that
    /// cannot run (`None`, `error` saying why): one row of `compare`, as both
    /// `compare --figures` and the report draw it.
    pub fn priced(
        name: &str,
        strategy: &str,
        estimate: Option<&Estimate>,
        error: Option<&str>,
    ) -> CompareBar {
        let t = estimate.map(|e| e.time_breakdown_s);
        CompareBar {
            name: name.to_string(),
            strategy: strategy.to_string(),
            compute_s: t.map(|t| t.compute),
            exposed_comm_s: t.map_or(0.0, |t| t.exposed_comm),
            bubble_s: t.map_or(0.0, |t| t.bubble),
            feasible: estimate.is_some_and(|e| e.feasible),
            error: error.map(str::to_string),
        }
    }
}

/// The bar parts: SVG class, label, colour.
pub const PARTS: [(&str, &str, Rgb); 3] = [
    ("cmp-compute", "compute", Rgb(0x4c, 0x78, 0xa8)),
    ("cmp-comm", "exposed communication", Rgb(0xf5, 0x85, 0x18)),
    ("cmp-bubble", "bubble", Rgb(0xbb, 0xbb, 0xbb)),
];

const LEFT: f64 = 250.0;
const BAR_W: f64 = 760.0;
const TOP: f64 = 70.0;
const ROW: f64 = 46.0;

/// Horizontal px per second of a chart of `bars`.
pub fn px_per_s(bars: &[CompareBar]) -> f64 {
    let longest = bars
        .iter()
        .filter_map(|b| b.compute_s.map(|c| c + b.exposed_comm_s + b.bubble_s))
        .fold(0.0, f64::max);
    BAR_W / longest.max(1e-12)
}

/// Draws the candidates as stacked horizontal bars, `what` naming the time (e.g.
/// `step time` or `decode step`).
pub fn compare_bars(bars: &[CompareBar], title: &str, what: &str) -> Canvas {
    let k = px_per_s(bars);
    let height = TOP + bars.len() as f64 * ROW + 60.0;
    // Names and configurations are drawn whole: configurations that differ only at
    // the end (vpp, schedule) must not look alike. The label column grows to fit.
    let widest = bars
        .iter()
        .map(|b| text_width(&b.name, 12.0).max(text_width(&b.strategy, 9.0)))
        .fold(0.0, f64::max);
    let left = LEFT.max(widest + 16.0);
    let mut c = Canvas::new(left + BAR_W + 200.0, height);
    c.text(10.0, 22.0, 15.0, Anchor::Start, title, "title");
    let mut lx = 10.0;
    for (_, label, fill) in PARTS {
        c.rect(lx, 34.0, 12.0, 12.0, fill, "legend");
        c.text(lx + 16.0, 44.0, 12.0, Anchor::Start, label, "legend");
        lx += 16.0 + text_width(label, 12.0) + 18.0;
    }
    c.text(
        lx + 10.0,
        44.0,
        12.0,
        Anchor::Start,
        &format!("({what})"),
        "legend",
    );
    let planner = bars
        .first()
        .and_then(|b| b.compute_s.map(|c| c + b.exposed_comm_s + b.bubble_s));
    for (i, b) in bars.iter().enumerate() {
        let y = TOP + i as f64 * ROW;
        c.text(left - 8.0, y + 14.0, 12.0, Anchor::End, &b.name, "row");
        c.text(
            left - 8.0,
            y + 28.0,
            9.0,
            Anchor::End,
            &b.strategy,
            "strategy",
        );
        let Some(compute) = b.compute_s else {
            c.text(
                left + 4.0,
                y + 18.0,
                12.0,
                Anchor::Start,
                &format!("cannot run: {}", b.error.as_deref().unwrap_or("")),
                "error",
            );
            continue;
        };
        let mut x = left;
        for ((class, _, fill), v) in PARTS.iter().zip([compute, b.exposed_comm_s, b.bubble_s]) {
            if v > 0.0 {
                c.rect(x, y + 2.0, v * k, 26.0, *fill, class).with("row", i);
                x += v * k;
            }
        }
        let total = compute + b.exposed_comm_s + b.bubble_s;
        let mut note = fmt_dur(total);
        if let Some(p) = planner.filter(|p| *p > 0.0) {
            note.push_str(&format!("  x{:.2}", total / p));
        }
        if !b.feasible {
            note.push_str("  does not fit");
        }
        c.text(x + 6.0, y + 20.0, 12.0, Anchor::Start, &note, "total");
    }
    c
}
