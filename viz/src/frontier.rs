//! The serving frontier: every deployment `deploy` priced as tokens/s per user
//! (x) against tokens/s per GPU (y), both on log axes, the Pareto frontier as a
//! line, the TPOT bound as a vertical line, the chosen deployment ringed.

use crate::canvas::{Anchor, Canvas, Rgb};

/// One priced deployment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// Output tokens/s each user sees (1 / TPOT).
    pub per_user: f64,
    /// Output tokens/s per GPU.
    pub per_gpu: f64,
    /// Prefill and decode pools (else aggregated).
    pub disaggregated: bool,
    /// Within every SLO.
    pub meets: bool,
}

/// What the figure shows.
#[derive(Clone, Debug, PartialEq)]
pub struct Frontier {
    /// Title line.
    pub title: String,
    /// Every deployment.
    pub points: Vec<Point>,
    /// Indices of the frontier, in increasing per-user speed.
    pub frontier: Vec<usize>,
    /// The chosen deployment.
    pub best: Option<usize>,
    /// The slowest per-user speed the SLOs allow (1 / TPOT bound).
    pub min_user_tps: Option<f64>,
}

const LEFT: f64 = 80.0;
const TOP: f64 = 60.0;
const W: f64 = 600.0;
const H: f64 = 380.0;
const AGG: Rgb = Rgb(0x4c, 0x78, 0xa8);
const DIS: Rgb = Rgb(0xf5, 0x85, 0x18);
const LINE: Rgb = Rgb(0x22, 0x22, 0x22);
const GRID: Rgb = Rgb(0xcc, 0xcc, 0xcc);
const SLO: Rgb = Rgb(0xd6, 0x27, 0x28);

/// A log axis over `[lo, hi]` mapped to `[0, len]`, its bounds powers of ten.
#[derive(Clone, Copy)]
struct LogAxis {
    lo: f64,
    hi: f64,
    len: f64,
}

impl LogAxis {
    fn new(values: impl Iterator<Item = f64>, len: f64) -> LogAxis {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.filter(|v| v.is_finite() && *v > 0.0) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            (lo, hi) = (1.0, 10.0);
        }
        let lo = 10f64.powf(lo.log10().floor());
        let hi = 10f64.powf(hi.log10().ceil()).max(lo * 10.0);
        LogAxis { lo, hi, len }
    }

    fn at(&self, v: f64) -> f64 {
        let v = v.clamp(self.lo, self.hi);
        self.len * (v / self.lo).log10() / (self.hi / self.lo).log10()
    }

    fn decades(&self) -> Vec<f64> {
        let mut out = Vec::new();
        let mut v = self.lo;
        while v <= self.hi * 1.0001 {
            out.push(v);
            v *= 10.0;
        }
        out
    }
}

fn label(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// Draws the frontier figure.
pub fn frontier_svg(f: &Frontier) -> Canvas {
    let mut c = Canvas::new(LEFT + W + 200.0, TOP + H + 60.0);
    c.text(10.0, 22.0, 15.0, Anchor::Start, &f.title, "title");
    let xa = LogAxis::new(f.points.iter().map(|p| p.per_user).chain(f.min_user_tps), W);
    let ya = LogAxis::new(f.points.iter().map(|p| p.per_gpu), H);
    let x = |v: f64| LEFT + xa.at(v);
    let y = |v: f64| TOP + H - ya.at(v);
    for d in xa.decades() {
        c.line(x(d), TOP, x(d), TOP + H, GRID, 0.6, true, "grid");
        c.text(
            x(d),
            TOP + H + 16.0,
            11.0,
            Anchor::Middle,
            &label(d),
            "tick",
        );
    }
    for d in ya.decades() {
        c.line(LEFT, y(d), LEFT + W, y(d), GRID, 0.6, true, "grid");
        c.text(LEFT - 6.0, y(d) + 4.0, 11.0, Anchor::End, &label(d), "tick");
    }
    c.text(
        LEFT + W / 2.0,
        TOP + H + 40.0,
        12.0,
        Anchor::Middle,
        "output tokens/s per user (1 / TPOT)",
        "axis",
    );
    c.text(
        10.0,
        TOP - 12.0,
        12.0,
        Anchor::Start,
        "output tokens/s per GPU",
        "axis",
    );
    if let Some(u) = f.min_user_tps {
        c.line(x(u), TOP, x(u), TOP + H, SLO, 1.5, true, "slo");
        c.text(x(u) + 4.0, TOP + 12.0, 11.0, Anchor::Start, "SLO", "slo");
    }
    for (i, p) in f.points.iter().enumerate() {
        let fill = if p.disaggregated { DIS } else { AGG };
        let s = if p.meets { 5.0 } else { 3.0 };
        c.rect(
            x(p.per_user) - s / 2.0,
            y(p.per_gpu) - s / 2.0,
            s,
            s,
            fill,
            "point",
        )
        .with("i", i)
        .with("meets", p.meets);
    }
    for w in f.frontier.windows(2) {
        let (a, b) = (&f.points[w[0]], &f.points[w[1]]);
        c.line(
            x(a.per_user),
            y(a.per_gpu),
            x(b.per_user),
            y(b.per_gpu),
            LINE,
            1.5,
            false,
            "frontier",
        );
    }
    if let Some(b) = f.best.and_then(|b| f.points.get(b)) {
        c.outline(
            x(b.per_user) - 7.0,
            y(b.per_gpu) - 7.0,
            14.0,
            14.0,
            SLO,
            2.0,
            "best",
        );
    }
    let lx = LEFT + W + 20.0;
    for (k, (name, fill)) in [("aggregated", AGG), ("disaggregated", DIS)]
        .into_iter()
        .enumerate()
    {
        let ly = TOP + 20.0 * k as f64;
        c.rect(lx, ly, 10.0, 10.0, fill, "legend");
        c.text(lx + 16.0, ly + 9.0, 12.0, Anchor::Start, name, "legend");
    }
    c.text(
        lx,
        TOP + 50.0,
        11.0,
        Anchor::Start,
        "large: within the SLOs",
        "legend",
    );
    c.text(
        lx,
        TOP + 66.0,
        11.0,
        Anchor::Start,
        "ringed: chosen",
        "legend",
    );
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decades_bound_the_values() {
        let a = LogAxis::new([3.0, 420.0].into_iter(), 100.0);
        assert_eq!((a.lo, a.hi), (1.0, 1000.0));
        assert_eq!(a.decades(), vec![1.0, 10.0, 100.0, 1000.0]);
        // 10 is a third of the way along 1..1000.
        assert!((a.at(10.0) - 100.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn every_point_is_drawn_and_the_best_ringed() {
        let p = |u: f64, g: f64, d: bool| Point {
            per_user: u,
            per_gpu: g,
            disaggregated: d,
            meets: true,
        };
        let f = Frontier {
            title: "t".into(),
            points: vec![
                p(10.0, 500.0, false),
                p(40.0, 200.0, true),
                p(20.0, 100.0, false),
            ],
            frontier: vec![0, 1],
            best: Some(0),
            min_user_tps: Some(20.0),
        };
        let c = frontier_svg(&f);
        assert_eq!(c.rects("point").count(), 3);
        assert!(c.to_svg().contains("SLO"));
    }
}
