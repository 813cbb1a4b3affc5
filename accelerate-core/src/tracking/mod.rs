//! Trackers: where a run's configuration, metrics and text go. Each is a [`GeneralTracker`]
//! (the built-in CSV, TensorBoard and MLflow ones, or a user's own); [`Trackers`] starts a run
//! on all of them, hands each value to each, and decides what a tracker's failure does (a
//! warning by default, an error when asked: metrics never stop training unless the user says
//! so).
//!
//! ```
//! use accelerate_core::tracking::{RunInfo, RunStatus, Tracker, Trackers};
//!
//! let dir = tempfile::tempdir()?;
//! let mut trackers = Trackers::new(false);
//! trackers.add(Tracker::Csv.open(Some(dir.path()))?);
//! let mut run = RunInfo::new("demo");
//! run.set_config(&serde_json::json!({ "lr": 3e-4, "model": { "layers": 4 } }));
//! trackers.start(&run)?;
//! trackers.log(1, &[("loss", 2.5)])?;
//! trackers.finish(RunStatus::Finished)?;
//! let csv = std::fs::read_to_string(dir.path().join("metrics.csv"))?;
//! assert!(csv.lines().nth(1).unwrap().starts_with("1,loss,2.5,"));
//! assert_eq!(run.config["model.layers"], accelerate_core::tracking::ConfigValue::Int(4));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod csv_tracker;
mod event_file;
pub mod mlflow;
mod tensorboard;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use csv_tracker::{CSV_FILE, CsvTracker};
pub use mlflow::MlflowTracker;
pub use tensorboard::TensorBoardTracker;

/// A built-in tracker, chosen by name (`log_with`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tracker {
    /// `metrics.csv` in the log directory.
    Csv,
    /// TensorBoard event files in the log directory (scalars, text, and the run's
    /// configuration in the hparams dashboard).
    TensorBoard,
    /// An MLflow tracking server, at `MLFLOW_TRACKING_URI` (see [`MlflowTracker`]).
    #[serde(rename = "mlflow")]
    MLflow,
}

impl Tracker {
    /// Whether this tracker writes into the log directory (and so needs one).
    pub fn needs_log_dir(self) -> bool {
        matches!(self, Tracker::Csv | Tracker::TensorBoard)
    }

    /// Whether this tracker can be opened without more settings: the file ones always (given
    /// a log directory), MLflow when `MLFLOW_TRACKING_URI` is set. Scripts use it to log to
    /// MLflow exactly when the user pointed them at a server.
    pub fn is_configured(self) -> bool {
        match self {
            Tracker::Csv | Tracker::TensorBoard => true,
            Tracker::MLflow => {
                std::env::var_os("MLFLOW_TRACKING_URI").is_some_and(|u| !u.is_empty())
            }
        }
    }

    /// Opens the tracker: the file ones in `log_dir`, MLflow from its environment variables.
    pub fn open(self, log_dir: Option<&Path>) -> Result<Box<dyn GeneralTracker>, TrackerError> {
        let dir = || {
            log_dir.ok_or_else(|| TrackerError::Config {
                tracker: self.to_string(),
                what: "this tracker writes files and was given no log directory".into(),
                hint: "set a project directory (its logs/ folder holds them)",
            })
        };
        Ok(match self {
            Tracker::Csv => Box::new(CsvTracker::create(dir()?)?),
            Tracker::TensorBoard => Box::new(TensorBoardTracker::new(dir()?)),
            Tracker::MLflow => Box::new(MlflowTracker::from_env()?),
        })
    }
}

impl fmt::Display for Tracker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tracker::Csv => "csv",
            Tracker::TensorBoard => "tensorboard",
            Tracker::MLflow => "mlflow",
        })
    }
}

/// One value of a run's configuration (hyperparameters and the accelerator's settings).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ConfigValue {
    /// A flag.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A real number.
    Float(f64),
    /// Anything else, as text (lists and nulls as JSON).
    Text(String),
}

impl fmt::Display for ConfigValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigValue::Bool(b) => write!(f, "{b}"),
            ConfigValue::Int(i) => write!(f, "{i}"),
            ConfigValue::Float(x) => write!(f, "{x}"),
            ConfigValue::Text(s) => f.write_str(s),
        }
    }
}

/// What a tracker is told when a run starts.
#[derive(Debug, Clone, PartialEq)]
pub struct RunInfo {
    /// The project (MLflow's experiment, TensorBoard's hparams group).
    pub project: String,
    /// The run's own name, if the user gave one.
    pub run_name: Option<String>,
    /// Hyperparameters and settings, flattened to dotted keys (`model.layers`).
    pub config: BTreeMap<String, ConfigValue>,
    /// This process's rank (trackers that run on every rank tell their runs apart by it).
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
}

impl RunInfo {
    /// A run of `project` on rank 0 of 1 with no configuration.
    pub fn new(project: impl Into<String>) -> Self {
        Self {
            project: project.into(),
            run_name: None,
            config: BTreeMap::new(),
            rank: 0,
            world_size: 1,
        }
    }

    /// Adds `config` (any JSON value; objects are flattened to dotted keys, a bare value is
    /// stored under `value`) to the configuration; later keys win.
    pub fn set_config(&mut self, config: &serde_json::Value) {
        flatten(String::new(), config, &mut self.config);
    }
}

fn flatten(prefix: String, value: &serde_json::Value, out: &mut BTreeMap<String, ConfigValue>) {
    use serde_json::Value;
    let key = |name: &str| {
        if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        }
    };
    let leaf = match value {
        Value::Object(map) => {
            for (name, inner) in map {
                flatten(key(name), inner, out);
            }
            return;
        }
        Value::Bool(b) => ConfigValue::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => ConfigValue::Int(i),
            None => ConfigValue::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => ConfigValue::Text(s.clone()),
        Value::Null | Value::Array(_) => ConfigValue::Text(value.to_string()),
    };
    out.insert(
        if prefix.is_empty() {
            "value".into()
        } else {
            prefix
        },
        leaf,
    );
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    /// The training ended normally.
    Finished,
    /// The training failed (an error or a panic).
    Failed,
    /// The training was stopped from outside (a signal).
    Killed,
}

/// A tracker failed.
#[derive(Debug, thiserror::Error)]
pub enum TrackerError {
    /// A file could not be written.
    #[error("{tracker} tracker: {}: {source}", path.display())]
    Io {
        /// The tracker.
        tracker: String,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A server refused a request or could not be reached.
    #[error("{tracker} tracker: {request}: {detail}")]
    Server {
        /// The tracker.
        tracker: String,
        /// The request (method and path).
        request: String,
        /// What the server (or the network) answered.
        detail: String,
    },
    /// The tracker is not configured as it needs.
    #[error("{tracker} tracker: {what} ({hint})")]
    Config {
        /// The tracker.
        tracker: String,
        /// What is wrong.
        what: String,
        /// What to do.
        hint: &'static str,
    },
    /// A user's tracker failed (its own words).
    #[error("{tracker} tracker: {message}")]
    Other {
        /// The tracker.
        tracker: String,
        /// What happened.
        message: String,
    },
}

/// Somewhere a run's configuration, metrics and text go: implement it for a tracker of your
/// own and register it with the accelerator builder's `add_tracker`. Calls come from the
/// training thread in order: `start` once, then `log` and `log_text`, then `finish` once.
/// A tracker that talks to a server should queue and send from a thread of its own (as
/// [`MlflowTracker`] does): a slow tracker slows every step.
pub trait GeneralTracker: Send {
    /// A short name for messages ("csv", "mlflow", ...).
    fn name(&self) -> &str;

    /// Whether only the main process logs to this tracker (the default); `false` opens it on
    /// every rank, with [`RunInfo::rank`] telling them apart.
    fn main_process_only(&self) -> bool {
        true
    }

    /// Starts the run: its project, name and configuration.
    fn start(&mut self, run: &RunInfo) -> Result<(), TrackerError>;

    /// Records `metrics` (name, value) at `step`.
    fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), TrackerError>;

    /// Records a text (a sample generation, a note) under `name` at `step`. Trackers without
    /// text keep nothing (the default).
    fn log_text(&mut self, step: u64, name: &str, text: &str) -> Result<(), TrackerError> {
        let _ = (step, name, text);
        Ok(())
    }

    /// Ends the run (sends what is queued, within the tracker's own time limit).
    fn finish(&mut self, status: RunStatus) -> Result<(), TrackerError>;
}

/// Several trackers as one: what the accelerator logs through.
pub struct Trackers {
    list: Vec<Box<dyn GeneralTracker>>,
    /// Whether a tracker's failure is returned (else it is a warning).
    errors_are_fatal: bool,
    started: bool,
    finished: bool,
    /// Trackers that failed once already: later failures are logged at debug level only.
    warned: BTreeSet<usize>,
}

impl fmt::Debug for Trackers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.list.iter().map(|t| t.name()).collect();
        f.debug_struct("Trackers")
            .field("trackers", &names)
            .field("started", &self.started)
            .finish()
    }
}

impl Trackers {
    /// No trackers yet; `errors_are_fatal` makes every tracker failure an error of the call
    /// that met it (by default a failure is a warning and training goes on).
    pub fn new(errors_are_fatal: bool) -> Self {
        Self {
            list: Vec::new(),
            errors_are_fatal,
            started: false,
            finished: false,
            warned: BTreeSet::new(),
        }
    }

    /// Adds a tracker.
    pub fn add(&mut self, tracker: Box<dyn GeneralTracker>) {
        self.list.push(tracker);
    }

    /// Whether there is no tracker.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Whether [`start`](Self::start) ran.
    pub fn is_started(&self) -> bool {
        self.started
    }

    /// Starts the run on every tracker.
    pub fn start(&mut self, run: &RunInfo) -> Result<(), TrackerError> {
        self.started = true;
        self.each(|t| t.start(run))
    }

    /// Records `metrics` at `step` on every tracker.
    pub fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), TrackerError> {
        self.each(|t| t.log(step, metrics))
    }

    /// Records a text on every tracker.
    pub fn log_text(&mut self, step: u64, name: &str, text: &str) -> Result<(), TrackerError> {
        self.each(|t| t.log_text(step, name, text))
    }

    /// Ends the run on every tracker (once; later calls do nothing).
    pub fn finish(&mut self, status: RunStatus) -> Result<(), TrackerError> {
        if !self.started || self.finished {
            return Ok(());
        }
        self.finished = true;
        self.each(|t| t.finish(status))
    }

    /// Calls `f` on every tracker, even after one failed; the first failure is returned when
    /// failures are fatal, else each is a warning (once per tracker, later ones at debug).
    fn each(
        &mut self,
        mut f: impl FnMut(&mut dyn GeneralTracker) -> Result<(), TrackerError>,
    ) -> Result<(), TrackerError> {
        let mut first = None;
        for (i, tracker) in self.list.iter_mut().enumerate() {
            let Err(err) = f(tracker.as_mut()) else {
                continue;
            };
            if self.errors_are_fatal {
                first.get_or_insert(err);
            } else if self.warned.insert(i) {
                tracing::warn!(
                    "{err}; training goes on (later failures of this tracker are logged at \
                     debug level; make them errors with tracker_errors_fatal(true))"
                );
            } else {
                tracing::debug!("{err}");
            }
        }
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Records calls; fails every `log` when asked.
    struct Recorder {
        calls: Arc<Mutex<Vec<String>>>,
        fail: bool,
    }

    impl GeneralTracker for Recorder {
        fn name(&self) -> &str {
            "recorder"
        }
        fn start(&mut self, run: &RunInfo) -> Result<(), TrackerError> {
            let mut calls = self.calls.lock().unwrap();
            calls.push(format!("start {} {:?}", run.project, run.config));
            Ok(())
        }
        fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), TrackerError> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("log {step} {metrics:?}"));
            if self.fail {
                return Err(TrackerError::Other {
                    tracker: "recorder".into(),
                    message: "refused".into(),
                });
            }
            Ok(())
        }
        fn finish(&mut self, status: RunStatus) -> Result<(), TrackerError> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("finish {status:?}"));
            Ok(())
        }
    }

    #[test]
    fn every_tracker_gets_every_call_and_a_failure_is_fatal_only_when_asked() {
        for fatal in [false, true] {
            let calls = Arc::new(Mutex::new(Vec::new()));
            let mut trackers = Trackers::new(fatal);
            for fail in [true, false] {
                let calls = calls.clone();
                trackers.add(Box::new(Recorder { calls, fail }));
            }
            let mut run = RunInfo::new("p");
            run.set_config(&serde_json::json!({"lr": 0.5, "dims": [1, 2], "deep": {"x": true}}));
            trackers.start(&run).unwrap();
            let logged = trackers.log(3, &[("loss", 1.0)]);
            assert_eq!(logged.is_err(), fatal);
            trackers.finish(RunStatus::Finished).unwrap();
            trackers.finish(RunStatus::Failed).unwrap();
            let calls = calls.lock().unwrap();
            // The second tracker was called although the first failed; finish ran once each.
            assert_eq!(calls.len(), 6, "{calls:?}");
            assert_eq!(calls[2], "log 3 [(\"loss\", 1.0)]");
            assert_eq!(calls[3], calls[2]);
            assert!(calls[0].contains("\"deep.x\": Bool(true)"), "{}", calls[0]);
            assert!(
                calls[0].contains("\"dims\": Text(\"[1,2]\")"),
                "{}",
                calls[0]
            );
            assert_eq!(calls[5], "finish Finished");
        }
    }

    #[test]
    fn file_trackers_say_they_need_a_directory() {
        let err = Tracker::Csv.open(None).err().unwrap();
        assert!(err.to_string().contains("project directory"), "{err}");
        assert!(Tracker::TensorBoard.needs_log_dir() && !Tracker::MLflow.needs_log_dir());
    }
}
