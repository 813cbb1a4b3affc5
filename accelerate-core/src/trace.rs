//! Per-rank timelines: a `tracing` layer that turns every closed span (ours: `step`,
//! `data_wait`, `forward`, `backward`, each collective with its bytes, `optimizer`,
//! `checkpoint`; and a user's own) into a Chrome/Perfetto trace event, keeps those of a
//! bounded window of steps, and writes `trace_rank_<r>.json` into a directory (beside an
//! earlier run's, as `trace_rank_<r>_<k>.json`) (open it in
//! <https://ui.perfetto.dev> or `chrome://tracing`; several ranks' files load side by side).
//!
//! `ACCELERATE_TRACE=<dir>` or the accelerator builder's `trace(dir, window)` turns it on (the
//! accelerator installs the layer at build, unless the program has its own subscriber: then
//! add [`TraceLayer`] to it);
//! `ACCELERATE_TRACE_STEPS` chooses the window: `N` (the last N steps, default 20) or `K..M`
//! (steps K to M, counted from 1).
//!
//! ```
//! use tracing_subscriber::layer::SubscriberExt;
//! use accelerate_core::trace::{StepWindow, TraceLayer};
//!
//! let dir = tempfile::tempdir()?;
//! let layer = TraceLayer::new(dir.path(), 0, StepWindow::Last(2));
//! let timeline = layer.timeline();
//! let subscriber = tracing_subscriber::registry().with(layer);
//! tracing::subscriber::with_default(subscriber, || {
//!     for _ in 0..3 {
//!         let _step = tracing::info_span!("step").entered();
//!         let _work = tracing::info_span!("backward").entered();
//!     }
//! });
//! let path = timeline.write()?;
//! let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)?;
//! let steps = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["name"] == "step");
//! assert_eq!(steps.count(), 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use serde_json::{Value, json};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// Which steps a timeline keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepWindow {
    /// The last N steps (and what follows the last of them).
    Last(u64),
    /// Steps K to M, counted from 1 (what runs between them included).
    Range(u64, u64),
}

impl StepWindow {
    /// Parses `ACCELERATE_TRACE_STEPS`' value: `N` or `K..M`.
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        match text.split_once("..") {
            Some((k, m)) => {
                let (k, m) = (k.trim().parse().ok()?, m.trim().parse().ok()?);
                (1 <= k && k <= m).then_some(StepWindow::Range(k, m))
            }
            None => text.parse().ok().filter(|n| *n > 0).map(StepWindow::Last),
        }
    }
}

/// `ACCELERATE_TRACE` and `ACCELERATE_TRACE_STEPS`, read: the directory and the window, or
/// `None` when tracing is off.
pub fn settings_from_env() -> Result<Option<(PathBuf, StepWindow)>, crate::ConfigError> {
    let Some(dir) = std::env::var_os(crate::env_vars::TRACE).filter(|d| !d.is_empty()) else {
        return Ok(None);
    };
    let window = match std::env::var(crate::env_vars::TRACE_STEPS) {
        Ok(text) => StepWindow::parse(&text).ok_or_else(|| crate::ConfigError::Invalid {
            key: "ACCELERATE_TRACE_STEPS",
            source_name: "env".into(),
            value: text.clone(),
            expected: "N (the last N steps) or K..M (steps K to M, from 1)",
        })?,
        Err(_) => StepWindow::Last(DEFAULT_STEPS),
    };
    Ok(Some((PathBuf::from(dir), window)))
}

/// Steps kept by default.
pub const DEFAULT_STEPS: u64 = 20;
/// Events kept at most whatever the window (a program without `step` spans stays bounded).
const MOST_EVENTS: usize = 1_000_000;

/// One complete ("X") event.
struct Complete {
    name: String,
    start_us: f64,
    dur_us: f64,
    tid: u64,
    args: serde_json::Map<String, Value>,
}

/// The events kept so far, and where they go.
pub struct Timeline {
    dir: PathBuf,
    rank: usize,
    window: StepWindow,
    origin: Instant,
    state: Mutex<Kept>,
    /// The file this timeline writes, chosen at its first write (see [`Timeline::write`]).
    path: Mutex<Option<PathBuf>>,
}

#[derive(Default)]
struct Kept {
    events: VecDeque<Complete>,
    /// Start times (µs) of the kept steps.
    step_starts: VecDeque<f64>,
    steps_closed: u64,
    /// A `K..M` window is complete: nothing more is kept.
    frozen: bool,
    threads: Vec<(u64, String)>,
}

impl Timeline {
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn keep(&self, event: Complete) {
        let mut kept = self.lock();
        if kept.frozen {
            return;
        }
        let is_step = event.name == "step";
        let start = event.start_us;
        kept.events.push_back(event);
        if kept.events.len() > MOST_EVENTS {
            kept.events.pop_front();
        }
        if !is_step {
            return;
        }
        kept.steps_closed += 1;
        kept.step_starts.push_back(start);
        let closed = kept.steps_closed;
        let cutoff = match self.window {
            StepWindow::Last(n) => {
                while kept.step_starts.len() as u64 > n {
                    kept.step_starts.pop_front();
                }
                kept.step_starts.front().copied()
            }
            StepWindow::Range(k, m) => {
                if closed >= m {
                    kept.frozen = true;
                }
                if closed < k {
                    kept.step_starts.clear();
                    Some(f64::INFINITY)
                } else {
                    kept.step_starts.front().copied()
                }
            }
        };
        if let Some(cutoff) = cutoff {
            // Events that ended before the first kept step began.
            kept.events.retain(|e| e.start_us + e.dur_us >= cutoff);
        }
    }

    /// Writes `trace_rank_<r>.json` (`trace_rank_<r>_<k>.json` when that name is taken; only
    /// the file this timeline wrote before is ever replaced) and
    /// returns its path.
    pub fn write(&self) -> std::io::Result<PathBuf> {
        let kept = self.lock();
        let pid = self.rank;
        let mut events = vec![json!({
            "name": "process_name", "ph": "M", "pid": pid,
            "args": {"name": format!("rank {pid}")},
        })];
        for (tid, name) in &kept.threads {
            events.push(json!({
                "name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name},
            }));
        }
        for e in &kept.events {
            events.push(json!({
                "name": e.name, "cat": "accelerate", "ph": "X", "pid": pid, "tid": e.tid,
                "ts": e.start_us, "dur": e.dur_us, "args": e.args,
            }));
        }
        drop(kept);
        std::fs::create_dir_all(&self.dir)?;
        let mut chosen = self.path.lock().unwrap_or_else(PoisonError::into_inner);
        let path = match &*chosen {
            Some(path) => path.clone(),
            None => self.free_path()?,
        };
        // A temporary file of this process's own name, created new (never one found there).
        let tmp = self.dir.join(format!(
            ".trace_rank_{}.{}.tmp",
            self.rank,
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        let body = json!({"traceEvents": events, "displayTimeUnit": "ms"});
        let written = serde_json::to_writer(std::io::BufWriter::new(file), &body)
            .map_err(std::io::Error::from)
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(err) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(err);
        }
        *chosen = Some(path.clone());
        Ok(path)
    }

    /// `trace_rank_<r>.json`, or when a file of that name is there already (an earlier run's,
    /// or anybody's), `trace_rank_<r>_<k>.json` with the first free `k`: a timeline replaces
    /// only the file it wrote itself.
    fn free_path(&self) -> std::io::Result<PathBuf> {
        let first = self.dir.join(format!("trace_rank_{}.json", self.rank));
        if !first.exists() {
            return Ok(first);
        }
        (1..=10_000u32)
            .map(|k| self.dir.join(format!("trace_rank_{}_{k}.json", self.rank)))
            .find(|p| !p.exists())
            .ok_or_else(|| {
                std::io::Error::other(format!(
                    "{} holds 10,000 traces of rank {} already: give ACCELERATE_TRACE another \
                     directory",
                    self.dir.display(),
                    self.rank
                ))
            })
    }
}

/// The `tracing` layer that feeds a [`Timeline`].
pub struct TraceLayer {
    timeline: Arc<Timeline>,
}

impl TraceLayer {
    /// A layer keeping `window` of rank `rank`'s steps, to be written into `dir`.
    pub fn new(dir: &Path, rank: usize, window: StepWindow) -> Self {
        Self {
            timeline: Arc::new(Timeline {
                dir: dir.to_path_buf(),
                rank,
                window,
                origin: Instant::now(),
                state: Mutex::new(Kept::default()),
                path: Mutex::new(None),
            }),
        }
    }

    /// The timeline, to [`write`](Timeline::write) it.
    pub fn timeline(&self) -> Arc<Timeline> {
        self.timeline.clone()
    }
}

/// What a span carries while open.
struct Open {
    start: Instant,
    args: serde_json::Map<String, Value>,
}

struct Fields<'a>(&'a mut serde_json::Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let mut text = String::new();
        let _ = write!(text, "{value:?}");
        self.0.insert(field.name().into(), json!(text));
    }
}

thread_local! {
    /// This thread's id in the trace (0 until first seen).
    static THREAD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

impl TraceLayer {
    fn thread_id(&self) -> u64 {
        THREAD.with(|id| {
            if id.get() == 0 {
                let mut kept = self.timeline.lock();
                let next = kept.threads.len() as u64 + 1;
                let name = std::thread::current()
                    .name()
                    .map_or_else(|| format!("thread {next}"), str::to_string);
                kept.threads.push((next, name));
                id.set(next);
            }
            id.get()
        })
    }
}

impl<S> tracing_subscriber::Layer<S> for TraceLayer
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut args = serde_json::Map::new();
        attrs.record(&mut Fields(&mut args));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Open {
                start: Instant::now(),
                args,
            });
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(open) = span.extensions_mut().get_mut::<Open>()
        {
            values.record(&mut Fields(&mut open.args));
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else {
            return;
        };
        let Some(open) = span.extensions_mut().remove::<Open>() else {
            return;
        };
        let end = Instant::now();
        let start_us = open
            .start
            .saturating_duration_since(self.timeline.origin)
            .as_secs_f64()
            * 1e6;
        let dur_us = end.saturating_duration_since(open.start).as_secs_f64() * 1e6;
        // A collective is named by its operation ("all_reduce"), with its bytes in `args`.
        let name = match open.args.get("op").and_then(Value::as_str) {
            Some(op) if span.name() == "collective" => op.to_string(),
            _ => span.name().to_string(),
        };
        let tid = self.thread_id();
        self.timeline.keep(Complete {
            name,
            start_us,
            dur_us,
            tid,
            args: open.args,
        });
    }
}

/// The timeline installed by [`install_from_env`], written by [`write_installed`].
static INSTALLED: Mutex<Option<Arc<Timeline>>> = Mutex::new(None);

/// With `ACCELERATE_TRACE` set, installs the trace layer for rank `rank` (see [`install`]).
pub fn install_from_env(rank: usize) -> Result<(), crate::ConfigError> {
    if let Some((dir, window)) = settings_from_env()? {
        install(&dir, window, rank);
    }
    Ok(())
}

/// Installs a subscriber with the trace layer for rank `rank` (writing into `dir`, keeping
/// `window`) and warnings to stderr (as `RUST_LOG` says) as the process's default. A program
/// that has a subscriber of its own keeps it, and is told to add [`TraceLayer`] to it. A
/// second call does nothing.
pub fn install(dir: &Path, window: StepWindow, rank: usize) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::{EnvFilter, Layer};
    let mut installed = INSTALLED.lock().unwrap_or_else(PoisonError::into_inner);
    if installed.is_some() {
        return;
    }
    let layer = TraceLayer::new(dir, rank, window);
    let timeline = layer.timeline();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let subscriber = tracing_subscriber::registry()
        .with(layer.with_filter(tracing_subscriber::filter::LevelFilter::INFO))
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(filter),
        );
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        eprintln!(
            "accelerate-rs: a trace was asked for but this program installed a tracing \
             subscriber of its own: add accelerate_core::trace::TraceLayer to it to get a trace"
        );
        return;
    }
    *installed = Some(timeline);
}

/// Writes the installed timeline's file, if one is installed (the accelerator does at its
/// end); returns its path.
pub fn write_installed() -> Option<std::io::Result<PathBuf>> {
    let installed = INSTALLED.lock().unwrap_or_else(PoisonError::into_inner);
    installed.as_ref().map(|timeline| timeline.write())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_parse_and_a_range_keeps_its_steps_only() {
        assert_eq!(StepWindow::parse("5"), Some(StepWindow::Last(5)));
        assert_eq!(StepWindow::parse("3..4"), Some(StepWindow::Range(3, 4)));
        for bad in ["0", "4..3", "0..2", "x", "1..", ""] {
            assert_eq!(StepWindow::parse(bad), None, "{bad}");
        }
        use tracing_subscriber::layer::SubscriberExt;
        let dir = tempfile::tempdir().unwrap();
        let layer = TraceLayer::new(dir.path(), 3, StepWindow::Range(2, 3));
        let timeline = layer.timeline();
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
            for i in 1..=5u64 {
                let _step = tracing::info_span!("step", i).entered();
                let _c =
                    tracing::info_span!("collective", op = "all_reduce", bytes = 64 * i).entered();
            }
        });
        // A file of that name that this timeline did not write stays as it is.
        std::fs::write(dir.path().join("trace_rank_3.json"), "mine").unwrap();
        let path = timeline.write().unwrap();
        assert_eq!(path.file_name().unwrap(), "trace_rank_3_1.json");
        assert_eq!(timeline.write().unwrap(), path, "its own file, replaced");
        let kept = std::fs::read_to_string(dir.path().join("trace_rank_3.json")).unwrap();
        assert_eq!(kept, "mine");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "no temporary file left: {names:?}");
        let trace: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        let named =
            |name: &str| -> Vec<&Value> { events.iter().filter(|e| e["name"] == name).collect() };
        let steps: Vec<u64> = named("step")
            .iter()
            .map(|e| e["args"]["i"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, [2, 3]);
        let bytes: Vec<u64> = named("all_reduce")
            .iter()
            .map(|e| e["args"]["bytes"].as_u64().unwrap())
            .collect();
        assert_eq!(bytes, [128, 192]);
        assert!(events.iter().all(|e| e["ph"] == "M" || e["pid"] == 3));
    }
}
