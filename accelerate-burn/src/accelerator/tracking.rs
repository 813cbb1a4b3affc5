//! The run's trackers: [`init_trackers`](Accelerator::init_trackers) starts the run with its
//! configuration, [`log`](Accelerator::log) and [`log_text`](Accelerator::log_text) record
//! values, [`end_training`](Accelerator::end_training) (or the accelerator's end) finishes it.
//! Main-process-only trackers exist on the main process alone; a tracker's failure is a
//! warning unless the builder's `tracker_errors_fatal(true)` makes it an error.

use std::sync::{Mutex, MutexGuard, PoisonError};

use accelerate_core::launch::progress::{self, Progress};
use accelerate_core::tracking::{GeneralTracker, RunInfo, RunStatus, Tracker, Trackers};
use serde::Serialize;

use super::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;

/// The trackers of this process (none on other ranks for main-process-only ones), and what
/// the main process reports to `accelerate-rs launch`'s progress line.
pub(super) struct Metrics {
    trackers: Mutex<Trackers>,
    progress: Mutex<Progress>,
}

impl Metrics {
    /// Opens the built-in `kinds` (in `<project_dir>/logs` for the file ones) and keeps the
    /// user's `custom` trackers, those that run on this rank only.
    pub(super) fn open(
        kinds: &[Tracker],
        custom: Vec<Box<dyn GeneralTracker>>,
        errors_are_fatal: bool,
        project_dir: Option<&std::path::Path>,
        main_process: bool,
    ) -> Result<Self, accelerate_core::TrackerError> {
        let mut trackers = Trackers::new(errors_are_fatal);
        if main_process {
            let logs = project_dir.map(|dir| dir.join("logs"));
            for kind in kinds {
                trackers.add(kind.open(logs.as_deref())?);
            }
        }
        for tracker in custom {
            if main_process || !tracker.main_process_only() {
                trackers.add(tracker);
            }
        }
        Ok(Self {
            trackers: Mutex::new(trackers),
            progress: Mutex::new(Progress {
                step: 0,
                total: None,
                metrics: Default::default(),
            }),
        })
    }
}

impl<B: AcceleratorBackend> Accelerator<B> {
    /// The number of updates the run trains for, for `accelerate-rs launch`'s progress line
    /// (its percentage and time left).
    pub fn set_total_steps(&self, total: u64) {
        self.lock_progress().total = Some(total);
    }

    fn lock_progress(&self) -> MutexGuard<'_, Progress> {
        self.metrics
            .progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn trackers(&self) -> MutexGuard<'_, Trackers> {
        self.metrics
            .trackers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn tracker_error(&self, source: accelerate_core::TrackerError) -> AccelerateError {
        AccelerateError::Tracker {
            rank: self.state.rank,
            source,
        }
    }

    /// Starts the run on every tracker with `project` (MLflow's experiment unless
    /// `MLFLOW_EXPERIMENT_NAME` says otherwise) and `config`: any serialisable value, such as
    /// the script's own arguments struct or `serde_json::json!({...})`, flattened to dotted
    /// keys, beside the accelerator's settings (`accelerate.*`: processes, backend,
    /// precision, accumulation, ZeRO stage, ...). TensorBoard shows them in its hparams
    /// dashboard, MLflow as the run's params. Without this call, the first
    /// [`log`](Self::log) starts a run named after the project directory with the
    /// accelerator's settings alone. A second call does nothing.
    pub fn init_trackers(
        &self,
        project: &str,
        config: &impl Serialize,
    ) -> Result<(), AccelerateError> {
        let config = serde_json::to_value(config).map_err(|e| AccelerateError::Misuse {
            rank: self.state.rank,
            what: format!("init_trackers: the configuration is not serialisable: {e}"),
            hint: "pass a struct deriving Serialize, or serde_json::json!({...})",
        })?;
        let mut trackers = self.trackers();
        if trackers.is_empty() || trackers.is_started() {
            return Ok(());
        }
        let run = self.run_info(project, &config);
        trackers.start(&run).map_err(|e| self.tracker_error(e))
    }

    fn run_info(&self, project: &str, config: &serde_json::Value) -> RunInfo {
        let mut run = RunInfo::new(project);
        run.rank = self.state.rank;
        run.world_size = self.state.world_size;
        let settings = serde_json::json!({ "accelerate": {
            "num_processes": self.state.world_size,
            "backend": B::NAME,
            "compute_dtype": format!("{:?}", self.compute_dtype),
            "config": self.config,
        }});
        run.set_config(&settings);
        if !config.is_null() {
            run.set_config(config);
        }
        run
    }

    /// Records `metrics` (name, value) at `step` in the trackers chosen with
    /// [`log_with`](crate::AcceleratorBuilder::log_with) and
    /// [`add_tracker`](crate::AcceleratorBuilder::add_tracker) (main-process-only trackers
    /// on the main process; other ranks return at once). File trackers flush at every call,
    /// so `tensorboard --logdir <project>/logs` shows the run as it trains; MLflow's values
    /// are sent from a thread of the tracker's own, never waited for here.
    ///
    /// Under `accelerate-rs launch`, the main process's values also feed the launcher's
    /// progress line (with [`set_total_steps`](Self::set_total_steps) for the time left).
    pub fn log(&self, metrics: &[(&str, f64)], step: u64) -> Result<(), AccelerateError> {
        if self.is_main_process() {
            let mut shown = self.lock_progress();
            shown.step = step;
            for (name, value) in metrics {
                shown.metrics.insert((*name).to_string(), *value);
            }
            progress::report(&shown);
        }
        let mut trackers = self.trackers();
        if trackers.is_empty() {
            return Ok(());
        }
        self.start_if_needed(&mut trackers)?;
        trackers
            .log(step, metrics)
            .map_err(|e| self.tracker_error(e))
    }

    /// Records a text (a sample generation, a note) under `name` at `step`: TensorBoard's
    /// text dashboard, an MLflow artifact `<name>/step_<step>.txt`; the CSV keeps no text.
    pub fn log_text(&self, name: &str, text: &str, step: u64) -> Result<(), AccelerateError> {
        let mut trackers = self.trackers();
        if trackers.is_empty() {
            return Ok(());
        }
        self.start_if_needed(&mut trackers)?;
        trackers
            .log_text(step, name, text)
            .map_err(|e| self.tracker_error(e))
    }

    fn start_if_needed(&self, trackers: &mut Trackers) -> Result<(), AccelerateError> {
        if trackers.is_started() {
            return Ok(());
        }
        let project = self
            .checkpoints
            .project_dir
            .as_ref()
            .and_then(|dir| dir.file_name())
            .map_or_else(
                || "accelerate-rs".into(),
                |n| n.to_string_lossy().into_owned(),
            );
        let run = self.run_info(&project, &serde_json::Value::Null);
        trackers.start(&run).map_err(|e| self.tracker_error(e))
    }

    /// What the device's allocator holds, as tracker metrics (`memory/device_bytes_in_use`,
    /// `memory/device_bytes_reserved`), on backends whose Burn reports it (the GPU ones);
    /// empty on the CPU backends (see `accelerate_core::throughput` for host memory).
    pub fn device_memory_metrics(&self) -> Vec<(&'static str, f64)> {
        match self.device.memory_pool_usage() {
            Some(usage) => vec![
                ("memory/device_bytes_in_use", usage.bytes_in_use as f64),
                ("memory/device_bytes_reserved", usage.bytes_reserved as f64),
            ],
            None => Vec::new(),
        }
    }

    /// Ends the run on every tracker (MLflow's status FINISHED, after its queue is sent;
    /// TensorBoard's hparams session status). The accelerator's end does it too (FAILED
    /// while a panic unwinds); calling it lets a script see a tracker's last error.
    pub fn end_training(&self) -> Result<(), AccelerateError> {
        self.trackers()
            .finish(RunStatus::Finished)
            .map_err(|e| self.tracker_error(e))
    }

    /// The run's end when the accelerator goes away without [`end_training`](Self::end_training).
    pub(super) fn finish_trackers_at_exit(&self) {
        let status = if std::thread::panicking() {
            RunStatus::Failed
        } else {
            RunStatus::Finished
        };
        if let Err(err) = self.trackers().finish(status) {
            tracing::warn!(rank = self.state.rank, "{err}");
        }
    }
}
