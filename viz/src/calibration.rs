//! The cost model against published runs: per run, the prediction and the
//! leave-one-out prediction as ratios to the published number, on a log axis
//! (1 is exact; right of it the model is too optimistic).

use crate::canvas::{text_width, Anchor, Canvas, Rgb};

/// One published run.
#[derive(Clone, Debug, PartialEq)]
pub struct CalibrationRow {
    /// Run id.
    pub id: String,
    /// Predicted over published (a speed; for a time, published over predicted).
    pub ratio: f64,
    /// The same with the constants refitted without this run.
    pub loo_ratio: f64,
    /// Kept out of the fit.
    pub unfitted: bool,
}

const TOP: f64 = 70.0;
const ROW: f64 = 22.0;
const AXIS_W: f64 = 640.0;
/// The axis spans ratios `LO..=HI`.
const LO: f64 = 0.5;
const HI: f64 = 4.0;

const PREDICTED: Rgb = Rgb(0x4c, 0x78, 0xa8);
const LOO: Rgb = Rgb(0xf5, 0x85, 0x18);
const GRID: Rgb = Rgb(0xbb, 0xbb, 0xbb);

/// X position of `ratio` on an axis starting at `left`, clamped to the axis.
pub fn x_of(left: f64, ratio: f64) -> f64 {
    let r = ratio.clamp(LO, HI);
    left + AXIS_W * (r / LO).log2() / (HI / LO).log2()
}

/// A row's label: the run id, marked when the run is kept out of the fit.
fn label(r: &CalibrationRow) -> String {
    if r.unfitted {
        format!("{} (not fitted)", r.id)
    } else {
        r.id.clone()
    }
}

/// Draws every run as a row with two markers: predicted (blue) and leave-one-out
/// (orange), with grid lines at 0.5x, 0.8x, 1x, 1.25x, 2x and 4x.
pub fn calibration_chart(rows: &[CalibrationRow], title: &str) -> Canvas {
    // The label column is sized from the labels as drawn, suffix included.
    let labels: Vec<String> = rows.iter().map(label).collect();
    let widest = labels
        .iter()
        .map(|l| text_width(l, 11.0))
        .fold(0.0, f64::max);
    let left = widest + 24.0;
    let height = TOP + rows.len() as f64 * ROW + 40.0;
    let mut c = Canvas::new(left + AXIS_W + 120.0, height);
    c.text(10.0, 22.0, 15.0, Anchor::Start, title, "title");
    let mut lx = 10.0;
    for (label, fill) in [("predicted / published", PREDICTED), ("leave-one-out", LOO)] {
        c.rect(lx, 34.0, 12.0, 12.0, fill, "legend");
        c.text(lx + 16.0, 44.0, 12.0, Anchor::Start, label, "legend");
        lx += 16.0 + text_width(label, 12.0) + 18.0;
    }
    let bottom = TOP + rows.len() as f64 * ROW;
    for g in [0.5, 0.8, 1.0, 1.25, 2.0, 4.0] {
        let x = x_of(left, g);
        c.line(
            x,
            TOP - 6.0,
            x,
            bottom,
            GRID,
            if g == 1.0 { 1.5 } else { 0.6 },
            g != 1.0,
            "grid",
        );
        c.text(
            x,
            bottom + 16.0,
            10.0,
            Anchor::Middle,
            &format!("{g}x"),
            "tick",
        );
    }
    for (i, (r, label)) in rows.iter().zip(&labels).enumerate() {
        let y = TOP + i as f64 * ROW;
        c.text(left - 8.0, y + 12.0, 11.0, Anchor::End, label, "row");
        for (v, fill, class, dy) in [
            (r.ratio, PREDICTED, "cal-predicted", 2.0),
            (r.loo_ratio, LOO, "cal-loo", 9.0),
        ] {
            c.rect(x_of(left, v) - 3.5, y + dy, 7.0, 7.0, fill, class)
                .with("ratio", format!("{v:.3}"))
                .with("row", i);
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_sit_at_their_ratio_on_a_log_axis() {
        // 0.5x at the left edge, 4x at the right, 1x one third along (log2 2 / log2 8).
        assert_eq!(x_of(100.0, 0.5), 100.0);
        assert_eq!(x_of(100.0, 4.0), 100.0 + AXIS_W);
        assert!((x_of(100.0, 1.0) - (100.0 + AXIS_W / 3.0)).abs() < 1e-9);
        assert_eq!(x_of(100.0, 9.0), 100.0 + AXIS_W, "clamped");
        let rows = vec![CalibrationRow {
            id: "a".into(),
            ratio: 1.0,
            loo_ratio: 2.0,
            unfitted: false,
        }];
        let c = calibration_chart(&rows, "t");
        assert_eq!(c.rects("cal-predicted").count(), 1);
        assert_eq!(c.rects("cal-loo").count(), 1);
        assert!(c.to_svg().contains("leave-one-out"));
    }

    #[test]
    fn unfitted_labels_are_drawn_whole() {
        let rows = vec![
            CalibrationRow {
                id: "short".into(),
                ratio: 1.0,
                loo_ratio: 1.0,
                unfitted: false,
            },
            CalibrationRow {
                id: "a-rather-long-run-id-of-a-published-run".into(),
                ratio: 1.0,
                loo_ratio: 1.0,
                unfitted: true,
            },
        ];
        let svg = calibration_chart(&rows, "t").to_svg();
        // Right-aligned at `x`: the label starts at x minus its width.
        let line = svg
            .lines()
            .find(|l| l.contains("(not fitted)"))
            .expect("the unfitted row's label");
        let x: f64 = line
            .split(" x=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .and_then(|x| x.parse().ok())
            .expect("its x");
        let label = "a-rather-long-run-id-of-a-published-run (not fitted)";
        assert!(x - text_width(label, 11.0) >= 0.0, "{line}");
    }
}
