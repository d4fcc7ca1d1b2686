//! The ring's timeline: device-timed spans of both streams and the host's marks
//! on one clock, read back at each step's end, and the diagnosis of a traced step.

use super::Ring;
use crate::backend::{OffloadBackend, StreamKind};
use crate::error::Result;
use crate::timeline::{Span, Timeline};
use std::time::Instant;

pub(super) struct PendingSpan<B: OffloadBackend> {
    pub(super) name: String,
    pub(super) stream: &'static str,
    pub(super) start: B::Event,
    pub(super) end: B::Event,
    pub(super) bytes: u64,
    pub(super) after: Option<String>,
    pub(super) step: u64,
    pub(super) backward: bool,
}

pub(super) struct TimelineState<B: OffloadBackend> {
    pub(super) origin: B::Event,
    /// The host's clock when `origin` was recorded.
    pub(super) host_origin: Instant,
    pub(super) pending: Vec<PendingSpan<B>>,
    pub(super) block_start: Option<B::Event>,
    pub(super) collected: Timeline,
    /// The step being recorded (the ring's closed steps so far).
    pub(super) step: u64,
}

impl<B: OffloadBackend> Ring<B> {
    /// With the timeline on, note the host's time now (`name` is made only then).
    pub(super) fn host_mark(&mut self, name: impl FnOnce() -> String) {
        if let Some(tl) = &mut self.timeline {
            let at_s = tl.host_origin.elapsed().as_secs_f64();
            tl.collected.host.push(crate::timeline::HostMark { name: name(), at_s, step: tl.step });
        }
    }

    pub(super) fn timing(&self, on: StreamKind) -> Result<Option<B::Event>> {
        if self.timeline.is_none() {
            return Ok(None);
        }
        self.backend.record_timing(on)
    }

    pub(super) fn push_span(&mut self, name: String, stream: &'static str, start: B::Event, on: StreamKind) -> Result<()> {
        let end = self.backend.record_timing(on)?;
        if let (Some(tl), Some(end)) = (&mut self.timeline, end) {
            let step = tl.step;
            tl.pending.push(PendingSpan { name, stream, start, end, bytes: 0, after: None, step, backward: self.backward });
        }
        Ok(())
    }

    /// Record a timeline of both streams from now on, and the exposed stall and
    /// copy-busy metrics. Costs a few timing events per block and, at each
    /// [`end_step`](Self::end_step), a wait for them: leave it off when timing
    /// the steady state. Synchronises once, so that the device's clock starts
    /// with the host's (the host marks and the spans then share a clock, which
    /// [`diagnose`](Self::diagnose) reads). A no-op on backends that cannot time,
    /// and where the timeline is on already.
    pub fn enable_timeline(&mut self) -> Result<()> {
        if self.timeline.is_some() {
            return Ok(());
        }
        self.backend.synchronize()?;
        if let Some(origin) = self.backend.record_timing(StreamKind::Compute)? {
            self.timeline = Some(TimelineState {
                origin,
                host_origin: Instant::now(),
                pending: Vec::new(),
                block_start: None,
                collected: Timeline::default(),
                step: 0,
            });
        }
        Ok(())
    }

    /// Stop recording the timeline (what was recorded is dropped with it).
    pub fn disable_timeline(&mut self) {
        self.timeline = None;
    }

    /// Why the last traced step was slower than its bound ([`crate::diagnose::diagnose`]),
    /// against the link's rate `link_bytes_per_s` where given (else the step's
    /// fastest copy). `None` without a timeline or before a traced step closed.
    pub fn diagnose(&self, link_bytes_per_s: Option<f64>) -> Option<crate::diagnose::Diagnosis> {
        let tl = self.timeline.as_ref()?;
        let step = tl.step.checked_sub(1)?;
        let input = crate::diagnose::DiagnoseInput {
            component: self.store.component(),
            step,
            link_bytes_per_s,
            compute_on_host: self.backend.compute_on_host(),
            depth: self.depth,
        };
        crate::diagnose::diagnose(&tl.collected, &input)
    }

    /// The timeline recorded so far (closed steps), if enabled.
    pub fn timeline(&self) -> Option<&Timeline> {
        self.timeline.as_ref().map(|t| &t.collected)
    }

    /// The open step's timeline spans read from their events, with its exposed
    /// stall and copy-busy seconds.
    pub(super) fn collect_spans(&mut self) -> Result<()> {
        let Some(tl) = &mut self.timeline else { return Ok(()) };
        let (mut stall, mut busy) = (0.0, 0.0);
        for p in std::mem::take(&mut tl.pending) {
            let (Some(start_s), Some(dur_s)) = (self.backend.elapsed_s(&tl.origin, &p.start)?, self.backend.elapsed_s(&p.start, &p.end)?)
            else {
                // Not done yet (a prefetch still in flight on a backend whose
                // events say so): read at the next step's end, under its own step.
                tl.pending.push(p);
                continue;
            };
            if p.stream == "copy" {
                busy += dur_s;
            } else if p.name.starts_with("wait ") {
                stall += dur_s;
            }
            let component = self.step.component.clone();
            let (step, bytes, after, backward) = (p.step, p.bytes, p.after, p.backward);
            tl.collected.spans.push(Span { name: p.name, stream: p.stream, component, start_s, dur_s, step, bytes, after, backward });
        }
        tl.step += 1;
        self.step.exposed_stall_s = Some(stall);
        self.step.copy_busy_s = Some(busy);
        Ok(())
    }
}
