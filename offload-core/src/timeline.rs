//! A timeline of the copy and compute streams, written as a Chrome trace event
//! file that Perfetto (ui.perfetto.dev) and chrome://tracing open.

use serde::Serialize;
use std::path::Path;

/// One interval on one stream.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Span {
    /// What ran (`copy double_blocks.3`, `compute single_blocks.0`, `wait double_blocks.1`).
    pub name: String,
    /// `copy` or `compute`.
    pub stream: &'static str,
    /// Component name.
    pub component: String,
    /// Start, seconds since the timeline's origin.
    pub start_s: f64,
    /// Duration, seconds.
    pub dur_s: f64,
    /// The ring's step it was recorded in (0 for the first).
    pub step: u64,
    /// Bytes copied (copy spans; 0 otherwise).
    pub bytes: u64,
    /// A copy's order: the block whose release (the end of its compute) the copy
    /// was ordered after, the last block in its slot. `None` for a free slot.
    pub after: Option<String>,
    /// Recorded in a backward pass ([`Ring::set_backward`](crate::Ring::set_backward)).
    pub backward: bool,
}

/// A moment on the host: when the ring's thread asked for a block or issued a
/// copy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostMark {
    /// What happened (`acquire double_blocks.3`, `issue copy single_blocks.0`).
    pub name: String,
    /// Seconds since the host's clock read when the timeline was enabled. The
    /// device's origin is an event recorded at that moment, so the two clocks
    /// agree where the device was idle then (a bench synchronises first); a
    /// mark is then later than the span it caused by how far the host ran ahead.
    pub at_s: f64,
    /// The ring's step it was recorded in.
    pub step: u64,
}

/// Spans collected over steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    /// Every span, in the order recorded.
    pub spans: Vec<Span>,
    /// Host marks, in the order recorded.
    pub host: Vec<HostMark>,
}

#[derive(Serialize)]
struct TraceEvent<'a> {
    name: &'a str,
    cat: &'a str,
    ph: &'static str,
    ts: f64,
    dur: f64,
    pid: u32,
    tid: u32,
    args: serde_json::Value,
}

impl Timeline {
    /// The Chrome trace event JSON (`{"traceEvents": [...]}`, complete events,
    /// microseconds; one thread per stream).
    pub fn to_chrome_trace(&self) -> String {
        let mut events: Vec<serde_json::Value> = vec![
            serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "copy stream"}}),
            serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "compute stream"}}),
            serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": 3, "args": {"name": "host (ring thread)"}}),
        ];
        for s in &self.spans {
            let e = TraceEvent {
                name: &s.name,
                cat: s.stream,
                ph: "X",
                ts: s.start_s * 1e6,
                dur: s.dur_s * 1e6,
                pid: 1,
                tid: if s.stream == "copy" { 1 } else { 2 },
                args: serde_json::json!({"component": s.component, "step": s.step, "bytes": s.bytes, "after": s.after}),
            };
            events.push(serde_json::to_value(e).unwrap_or_default());
        }
        for m in &self.host {
            events.push(serde_json::json!({"name": m.name, "cat": "host", "ph": "i", "s": "t", "ts": m.at_s * 1e6, "pid": 1, "tid": 3}));
        }
        serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"}).to_string()
    }

    /// Write the Chrome trace to `path`.
    pub fn write_chrome_trace(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        std::fs::write(path, self.to_chrome_trace())
    }

    /// Total duration of spans on `stream` whose name starts with `prefix`.
    pub fn total_s(&self, stream: &str, prefix: &str) -> f64 {
        self.spans.iter().filter(|s| s.stream == stream && s.name.starts_with(prefix)).map(|s| s.dur_s).sum()
    }
}
