//! The memory ledger per GPU as stacked bars against the GPU's capacity. GPUs of one
//! pipeline stage hold the same program and the same bytes, so a bar stands for all
//! GPUs of its stage.

use crate::canvas::{Anchor, Canvas, Rgb};
use meshplan_cost_model::MemoryLedger;

const TOP: f64 = 84.0;
const PLOT_H: f64 = 320.0;
const LEFT: f64 = 80.0;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The ledger's parts, bottom to top: SVG class, label, colour.
pub const PARTS: [(&str, &str, Rgb); 6] = [
    ("mem-params", "parameters", Rgb(0x4c, 0x78, 0xa8)),
    ("mem-grads", "gradients", Rgb(0xf5, 0x85, 0x18)),
    ("mem-optimizer", "optimizer", Rgb(0xe4, 0x57, 0x56)),
    ("mem-activations", "activations", Rgb(0x54, 0xa2, 0x4b)),
    ("mem-kv-cache", "KV cache", Rgb(0xb2, 0x79, 0xa2)),
    ("mem-workspace", "workspace", Rgb(0x9d, 0x9d, 0x9d)),
];

/// The ledger's bytes in the order of [`PARTS`].
pub(crate) fn parts(m: &MemoryLedger) -> [f64; 6] {
    [
        m.params,
        m.grads,
        m.optimizer,
        m.activations,
        m.kv_cache,
        m.workspace,
    ]
}

/// The vertical scale of a chart: px per byte and the baseline's y.
pub fn scale(stages: &[MemoryLedger], capacity: f64) -> (f64, f64) {
    let top = stages
        .iter()
        .map(|m| m.total)
        .fold(capacity, f64::max)
        .max(1.0);
    (PLOT_H / (top * 1.08), TOP + PLOT_H)
}

/// One bar per stage (`stages[i]`, each standing for `gpus_per_stage` GPUs), the
/// capacity as a dashed line.
pub fn memory_bars(
    stages: &[MemoryLedger],
    capacity: f64,
    gpus_per_stage: u64,
    title: &str,
) -> Canvas {
    let n = stages.len().max(1);
    let slot = if n > 32 { 28.0 } else { 64.0 };
    let width = (LEFT + n as f64 * slot + 190.0)
        .max(720.0)
        .max(crate::canvas::text_width(title, 15.0) + 20.0);
    let mut c = Canvas::new(width, TOP + PLOT_H + 70.0);
    c.text(10.0, 22.0, 15.0, Anchor::Start, title, "title");
    c.text(
        10.0,
        42.0,
        12.0,
        Anchor::Start,
        &format!(
            "memory per GPU; each bar is one pipeline stage ({gpus_per_stage} GPUs alike), the dashed line the GPU's capacity"
        ),
        "subtitle",
    );
    let (k, base) = scale(stages, capacity);

    // Y axis in GiB.
    let top_gib = (PLOT_H / k) / GIB;
    let step = crate::axis::nice_step(top_gib / 6.0);
    let mut g = 0.0;
    while g <= top_gib {
        let y = base - g * GIB * k;
        c.line(
            LEFT - 4.0,
            y,
            LEFT + n as f64 * slot,
            y,
            Rgb(0xdd, 0xdd, 0xdd),
            1.0,
            false,
            "grid",
        );
        c.text(
            LEFT - 8.0,
            y + 4.0,
            11.0,
            Anchor::End,
            &format!("{g}"),
            "tick",
        );
        g += step;
    }
    c.text(10.0, TOP - 10.0, 11.0, Anchor::Start, "GiB", "tick");

    let bar_w = slot * 0.62;
    for (i, m) in stages.iter().enumerate() {
        let x = LEFT + i as f64 * slot + (slot - bar_w) / 2.0;
        let mut y = base;
        for ((class, _, fill), v) in PARTS.iter().zip(parts(m)) {
            if v <= 0.0 {
                continue;
            }
            let h = v * k;
            y -= h;
            c.rect(x, y, bar_w, h, *fill, class)
                .with("s", i)
                .with("bytes", format!("{v:.0}"));
        }
        let label_every = n.div_ceil(32);
        if i % label_every == 0 {
            c.text(
                x + bar_w / 2.0,
                base + 16.0,
                11.0,
                Anchor::Middle,
                &format!("s{i}"),
                "bar",
            );
            if n <= 32 {
                c.text(
                    x + bar_w / 2.0,
                    y - 4.0,
                    10.0,
                    Anchor::Middle,
                    &format!("{:.1}", m.total / GIB),
                    "total",
                );
            }
        }
    }
    let cy = base - capacity * k;
    c.line(
        LEFT - 4.0,
        cy,
        LEFT + n as f64 * slot,
        cy,
        Rgb(0xc0, 0x39, 0x2b),
        1.5,
        true,
        "capacity",
    );
    c.text(
        LEFT + n as f64 * slot + 6.0,
        cy + 4.0,
        11.0,
        Anchor::Start,
        &format!("capacity {:.0} GiB", capacity / GIB),
        "capacity",
    );
    c.text(
        LEFT + n as f64 * slot / 2.0,
        base + 34.0,
        11.0,
        Anchor::Middle,
        "pipeline stage",
        "axis",
    );

    // Legend, top part first (as stacked).
    let lx = LEFT + n as f64 * slot + 40.0;
    for (j, (_, label, fill)) in PARTS.iter().rev().enumerate() {
        let y = TOP + 140.0 + j as f64 * 20.0;
        c.rect(lx, y - 10.0, 12.0, 12.0, *fill, "legend");
        c.text(lx + 18.0, y, 12.0, Anchor::Start, label, "legend");
    }
    c
}
