//! Chrome trace format (the JSON that `chrome://tracing` and Perfetto open), shared by
//! the predicted schedule the planner draws and the measured timeline the executor
//! records, so both files open side by side with the same tracks and names.

use serde::{Deserialize, Serialize};

/// One complete span (`"ph": "X"`) or metadata record (`"ph": "M"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// Span label, e.g. `fwd mb3 c0` or `AllReduce tp`.
    pub name: String,
    /// Category: `compute`, `comm`, `p2p`, `bubble`, `optimizer`, or `__metadata`.
    pub cat: String,
    /// Phase: `X` for a complete span, `M` for metadata (process/thread names).
    pub ph: String,
    /// Start, microseconds.
    pub ts: f64,
    /// Duration, microseconds (0 for metadata).
    #[serde(default)]
    pub dur: f64,
    /// Process id: one per pipeline stage or rank group.
    pub pid: u64,
    /// Thread id: one per rank (or stream).
    pub tid: u64,
    /// Free-form details shown on click: bytes, axis, micro-batch.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub args: serde_json::Value,
}

/// A whole trace file: `{"traceEvents": [...], "displayTimeUnit": "ms"}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// The spans and metadata records.
    #[serde(rename = "traceEvents")]
    pub trace_events: Vec<TraceEvent>,
    /// How the viewer labels time.
    #[serde(rename = "displayTimeUnit")]
    pub display_time_unit: String,
}

impl Trace {
    /// An empty trace shown in milliseconds.
    pub fn new() -> Self {
        Trace {
            trace_events: Vec::new(),
            display_time_unit: "ms".into(),
        }
    }

    /// Adds a complete span; times in seconds, stored in microseconds.
    #[allow(clippy::too_many_arguments)]
    pub fn span(
        &mut self,
        name: impl Into<String>,
        cat: &str,
        pid: u64,
        tid: u64,
        start_s: f64,
        dur_s: f64,
        args: serde_json::Value,
    ) {
        self.trace_events.push(TraceEvent {
            name: name.into(),
            cat: cat.into(),
            ph: "X".into(),
            ts: start_s * 1e6,
            dur: dur_s * 1e6,
            pid,
            tid,
            args,
        });
    }

    /// Names a process track (e.g. `stage 0`).
    pub fn name_process(&mut self, pid: u64, name: &str) {
        self.metadata("process_name", pid, 0, name);
    }

    /// Names a thread track (e.g. `rank 5`).
    pub fn name_thread(&mut self, pid: u64, tid: u64, name: &str) {
        self.metadata("thread_name", pid, tid, name);
    }

    fn metadata(&mut self, kind: &str, pid: u64, tid: u64, name: &str) {
        self.trace_events.push(TraceEvent {
            name: kind.into(),
            cat: "__metadata".into(),
            ph: "M".into(),
            ts: 0.0,
            dur: 0.0,
            pid,
            tid,
            args: serde_json::json!({ "name": name }),
        });
    }

    /// Pretty JSON text of the trace.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a trace is plain data")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_written_in_microseconds_with_chrome_field_names() {
        let mut t = Trace::new();
        t.name_process(0, "stage 0");
        t.span(
            "fwd mb0",
            "compute",
            0,
            1,
            0.5e-3,
            2e-3,
            serde_json::json!({"bytes": 64}),
        );
        let v: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
        let ev = &v["traceEvents"][1];
        assert_eq!(ev["ph"], "X");
        assert_eq!(ev["ts"].as_f64().unwrap(), 500.0);
        assert_eq!(ev["dur"].as_f64().unwrap(), 2000.0);
        assert_eq!(ev["args"]["bytes"], 64);
        assert_eq!(v["traceEvents"][0]["args"]["name"], "stage 0");
        assert_eq!(v["displayTimeUnit"], "ms");
    }
}
