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
}

/// Spans collected over steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    /// Every span, in the order recorded.
    pub spans: Vec<Span>,
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
                args: serde_json::json!({"component": s.component}),
            };
            events.push(serde_json::to_value(e).unwrap_or_default());
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
