//! Progress events. The library reports, the caller draws: vmctl turns events into a progress
//! bar or JSON lines, the daemon into IPC notifications. Events are plain serializable values
//! passed to a callback on the pulling thread, throttled here so a fast download does not spend
//! its time reporting, yet a slow one still reports several times a second.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Fetching and checking `manifest.json`.
    Manifest,
    /// Another pull of the same version holds its lock; this one waits and then reuses its work.
    Waiting,
    /// Compressed bytes are arriving (and being decompressed and verified on the way).
    Download,
    /// A network error or 5xx: waiting `message`'s delay before resuming.
    Retry,
    /// Every artifact verified: renaming into place and switching `current`.
    Install,
    /// A warm bundle is being renamed into place instead of downloaded.
    Promote,
    Done,
}

#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub phase: Phase,
    pub version: String,
    /// The artifact being downloaded, in `download` and `retry`.
    pub artifact: Option<String>,
    /// Compressed bytes received or found already on disk, over all artifacts.
    pub done: u64,
    /// Compressed bytes of all artifacts.
    pub total: u64,
    /// Bytes per second over the last few seconds.
    pub rate: f64,
    pub eta_secs: Option<f64>,
    /// What went wrong before a retry, or other detail.
    pub message: Option<String>,
}

/// Minimum spacing of `download` events.
const EVERY: Duration = Duration::from_millis(100);
/// The rate is measured over this window: recent enough to show a stall, long enough to be steady.
const WINDOW: Duration = Duration::from_secs(3);

/// Accumulates byte counts and emits throttled events through the caller's callback.
pub(crate) struct Meter<'a> {
    sink: &'a mut dyn FnMut(&Progress),
    version: String,
    artifact: Option<String>,
    done: u64,
    received: u64,
    total: u64,
    samples: VecDeque<(Instant, u64)>,
    last: Option<Instant>,
}

impl<'a> Meter<'a> {
    pub fn new(sink: &'a mut dyn FnMut(&Progress), version: &str) -> Self {
        Self {
            sink,
            version: version.to_string(),
            artifact: None,
            done: 0,
            received: 0,
            total: 0,
            samples: VecDeque::new(),
            last: None,
        }
    }

    pub fn set_version(&mut self, version: &str) {
        self.version = version.to_string();
    }

    pub fn set_total(&mut self, total: u64) {
        self.total = total;
    }

    pub fn set_artifact(&mut self, name: Option<&str>) {
        self.artifact = name.map(str::to_string);
    }

    pub fn done(&self) -> u64 {
        self.done
    }

    /// Bytes received over the network so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// Bytes that count as done without being transferred now (found on disk); they do not
    /// inflate the rate.
    pub fn skip(&mut self, n: u64) {
        self.done += n;
        for s in &mut self.samples {
            s.1 += n;
        }
    }

    /// Takes back bytes counted as done that will be transferred again.
    pub fn skip_back(&mut self, n: u64) {
        self.done = self.done.saturating_sub(n);
        for s in &mut self.samples {
            s.1 = s.1.saturating_sub(n);
        }
    }

    /// Bytes just received.
    pub fn add(&mut self, n: u64) {
        self.done += n;
        self.received += n;
        let now = Instant::now();
        if self.last.is_none_or(|t| now.duration_since(t) >= EVERY) {
            self.emit(Phase::Download, None);
        }
    }

    fn rate(&mut self, now: Instant) -> f64 {
        self.samples.push_back((now, self.done));
        while self.samples.len() > 2 && now.duration_since(self.samples[0].0) > WINDOW {
            self.samples.pop_front();
        }
        let (t0, b0) = self.samples[0];
        let dt = now.duration_since(t0).as_secs_f64();
        if dt > 0.0 {
            (self.done - b0) as f64 / dt
        } else {
            0.0
        }
    }

    pub fn emit(&mut self, phase: Phase, message: Option<String>) {
        if phase == Phase::Done {
            self.done = self.done.max(self.total);
        }
        let now = Instant::now();
        self.last = Some(now);
        let rate = self.rate(now);
        let left = self.total.saturating_sub(self.done);
        let eta_secs = (rate > 0.0).then(|| left as f64 / rate);
        let artifact = matches!(phase, Phase::Download | Phase::Retry).then(|| self.artifact.clone()).flatten();
        let p = Progress {
            phase,
            version: self.version.clone(),
            artifact,
            done: self.done,
            total: self.total,
            rate,
            eta_secs,
            message,
        };
        (self.sink)(&p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttles_and_measures() {
        let mut events = Vec::new();
        let mut sink = |p: &Progress| events.push(p.clone());
        let mut m = Meter::new(&mut sink, "v");
        m.set_total(1000);
        m.emit(Phase::Download, None);
        for _ in 0..100 {
            m.add(1);
        }
        std::thread::sleep(EVERY);
        m.add(100);
        drop(m);
        assert_eq!(events.len(), 2, "bursts are throttled: {events:?}");
        let last = events.last().unwrap();
        assert_eq!((last.done, last.total), (200, 1000));
        assert!(last.rate > 0.0 && last.eta_secs.unwrap() > 0.0, "{last:?}");
    }
}
