//! The pipeline schedule as a Gantt chart: one row per stage, the cost model's tasks
//! over time (forward, backward, their collectives, sends to the neighbour stage, the
//! step's tail) and the waits between them (the bubble).

use crate::axis::{fmt_dur, fmt_time, nice_step};
use crate::canvas::{text_width, Anchor, Canvas, Rgb};
use meshplan_cost_model::{Lane, Span, SpanKind, Timeline};

/// Width of the picture, px.
pub const WIDTH: f64 = 1400.0;
/// Left edge of the time axis, px.
pub const LEFT: f64 = 110.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 78.0;
const LANE: f64 = 22.0;
const P2P_LANE: f64 = 6.0;
const ROW: f64 = LANE + P2P_LANE + 10.0;
const COMM_STRIPE: f64 = 5.0;

/// Colour of each kind of span (chunks after the first in lighter shades).
fn color(kind: SpanKind, chunk: usize) -> Rgb {
    let odd = chunk % 2 == 1;
    match kind {
        SpanKind::Forward if odd => Rgb(0x9e, 0xca, 0xe9),
        SpanKind::Forward | SpanKind::Prefill => Rgb(0x4c, 0x78, 0xa8),
        SpanKind::Backward if odd => Rgb(0x98, 0xd5, 0x8b),
        SpanKind::Backward => Rgb(0x54, 0xa2, 0x4b),
        SpanKind::Decode => Rgb(0x72, 0xb7, 0xb2),
        SpanKind::SendAct | SpanKind::SendGrad => Rgb(0xe0, 0xb0, 0x20),
        SpanKind::DpComm => Rgb(0xf5, 0x85, 0x18),
        SpanKind::TpSync => Rgb(0xe4, 0x57, 0x56),
        SpanKind::Optimizer => Rgb(0xb2, 0x79, 0xa2),
        SpanKind::Bubble => Rgb(0xe8, 0xe8, 0xe8),
    }
}

const COMM_IN_TASK: Rgb = Rgb(0x33, 0x33, 0x33);

/// The SVG class of a span.
pub fn class(kind: SpanKind) -> &'static str {
    match kind {
        SpanKind::Forward => "fwd",
        SpanKind::Backward => "bwd",
        SpanKind::Prefill => "prefill",
        SpanKind::Decode => "decode",
        SpanKind::SendAct | SpanKind::SendGrad => "p2p",
        SpanKind::DpComm => "dp-comm",
        SpanKind::TpSync => "tp-sync",
        SpanKind::Optimizer => "optimizer",
        SpanKind::Bubble => "bubble",
    }
}

/// Horizontal px per second of the chart of `tl`.
pub fn px_per_s(tl: &Timeline) -> f64 {
    (WIDTH - LEFT - RIGHT) / tl.end_s().max(1e-12)
}

/// Draws the schedule of `tl` (validated) under the heading `title`.
pub fn gantt(tl: &Timeline, title: &str) -> Canvas {
    let pp = tl.pp();
    let end = tl.end_s();
    let k = px_per_s(tl);
    let height = TOP + pp as f64 * ROW + 64.0;
    let mut c = Canvas::new(WIDTH, height);
    c.text(10.0, 22.0, 15.0, Anchor::Start, title, "title");
    let spans = tl.spans();

    // Legend: only the kinds this timeline has.
    let mut kinds: Vec<SpanKind> = Vec::new();
    for s in &spans {
        if !kinds.contains(&s.kind) && s.kind != SpanKind::SendGrad {
            kinds.push(s.kind);
        }
    }
    let order = [
        SpanKind::Forward,
        SpanKind::Backward,
        SpanKind::Prefill,
        SpanKind::Decode,
        SpanKind::SendAct,
        SpanKind::DpComm,
        SpanKind::TpSync,
        SpanKind::Optimizer,
        SpanKind::Bubble,
    ];
    let mut lx = 10.0;
    let ly = 44.0;
    let mut legend = |c: &mut Canvas, fill: Rgb, label: &str| {
        c.rect(lx, ly - 10.0, 12.0, 12.0, fill, "legend");
        c.text(lx + 16.0, ly, 12.0, Anchor::Start, label, "legend");
        lx += 16.0 + text_width(label, 12.0) + 18.0;
    };
    for kind in order.iter().filter(|k| kinds.contains(k)) {
        let label = match kind {
            SpanKind::Forward => "forward",
            SpanKind::Backward => "backward",
            SpanKind::Prefill => "prefill",
            SpanKind::Decode => "decode step",
            SpanKind::SendAct => "p2p send",
            SpanKind::DpComm => "dp gradient reduction (exposed)",
            SpanKind::TpSync => "tp gradient sync",
            SpanKind::Optimizer => "optimizer",
            SpanKind::Bubble => "bubble (idle)",
            SpanKind::SendGrad => "p2p send",
        };
        legend(&mut c, color(*kind, 0), label);
    }
    if spans
        .iter()
        .any(|s| s.lane == Lane::Compute && s.comm_s > 0.0)
    {
        legend(&mut c, COMM_IN_TASK, "collectives inside a task");
    }

    for stage in 0..pp {
        let y = TOP + stage as f64 * ROW;
        c.text(
            LEFT - 8.0,
            y + LANE / 2.0 + 4.0,
            12.0,
            Anchor::End,
            &format!("stage {stage}"),
            "row",
        );
    }
    for s in &spans {
        draw_span(&mut c, s, k);
    }

    // Time axis.
    let axis_y = TOP + pp as f64 * ROW + 2.0;
    c.line(
        LEFT,
        axis_y,
        LEFT + end * k,
        axis_y,
        Rgb(0, 0, 0),
        1.0,
        false,
        "axis",
    );
    let step = nice_step(end / 8.0);
    let mut t = 0.0;
    while t <= end * (1.0 + 1e-9) {
        let x = LEFT + t * k;
        c.line(x, axis_y, x, axis_y + 5.0, Rgb(0, 0, 0), 1.0, false, "tick");
        c.text(
            x,
            axis_y + 18.0,
            11.0,
            Anchor::Middle,
            &fmt_time(t, step),
            "tick",
        );
        t += step;
    }
    if let Timeline::Inference(inf) = tl {
        let x = LEFT + inf.ttft_s * k;
        c.line(
            x,
            TOP - 6.0,
            x,
            axis_y,
            Rgb(0xc0, 0x39, 0x2b),
            1.0,
            true,
            "ttft",
        );
        c.text(x + 4.0, TOP - 8.0, 11.0, Anchor::Start, "TTFT", "ttft");
    }
    let note = match tl {
        Timeline::Train(t) => {
            let idle: f64 = spans
                .iter()
                .filter(|s| s.stage == t.critical_stage && s.kind == SpanKind::Bubble)
                .map(Span::dur_s)
                .sum();
            format!(
                "time -> ({} micro-batches, {}; stage {} is the estimate's critical stage: idle {})",
                t.microbatches,
                schedule_name(t),
                t.critical_stage,
                fmt_dur(idle)
            )
        }
        Timeline::Inference(i) => format!(
            "time -> (one request's prefill, then one decode step of the replica's batch: TTFT {}, TPOT {})",
            fmt_dur(i.ttft_s),
            fmt_dur(i.tpot_s)
        ),
    };
    c.text(LEFT, axis_y + 40.0, 12.0, Anchor::Start, &note, "note");
    c
}

fn schedule_name(t: &meshplan_cost_model::timeline::TrainTimeline) -> String {
    match t.schedule {
        meshplan_ir::Schedule::Gpipe => "GPipe".into(),
        meshplan_ir::Schedule::OneFOneB if t.vpp == 1 => "1F1B".into(),
        _ => format!("interleaved 1F1B, {} chunks per stage", t.vpp),
    }
}

fn draw_span(c: &mut Canvas, s: &Span, k: f64) {
    let row = TOP + s.stage as f64 * ROW;
    let x = LEFT + s.start_s * k;
    let w = s.dur_s() * k;
    let fill = color(s.kind, s.chunk);
    if s.lane == Lane::P2p {
        c.rect(x, row + LANE + 1.0, w, P2P_LANE - 1.0, fill, "p2p")
            .with("s", s.stage);
        return;
    }
    let item = c.rect(x, row, w, LANE, fill, class(s.kind));
    item.with("s", s.stage);
    if let Some(mb) = s.mb {
        item.with("mb", mb).with("c", s.chunk);
    }
    let in_task = matches!(
        s.kind,
        SpanKind::Forward | SpanKind::Backward | SpanKind::Prefill | SpanKind::Decode
    );
    if in_task && s.comm_s > 0.0 {
        // Collectives run inside the task; the stripe shows their share, not when.
        let cw = s.comm_s * k;
        c.rect(
            x + w - cw,
            row + LANE - COMM_STRIPE,
            cw,
            COMM_STRIPE,
            COMM_IN_TASK,
            "comm",
        );
    }
    let label = match s.kind {
        SpanKind::Forward | SpanKind::Backward => s.mb.map(|m| m.to_string()),
        SpanKind::Prefill => Some("prefill".into()),
        SpanKind::Decode => Some("decode".into()),
        SpanKind::DpComm => Some("dp".into()),
        SpanKind::Optimizer => Some("opt".into()),
        _ => None,
    };
    if let Some(l) = label {
        if w >= text_width(&l, 10.0) + 3.0 {
            c.text(
                x + w / 2.0,
                row + LANE / 2.0 + 2.0,
                10.0,
                Anchor::Middle,
                &l,
                "label",
            );
        }
    }
}
