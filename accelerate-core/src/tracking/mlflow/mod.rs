//! The MLflow tracker, over MLflow's REST API (no Python): the experiment (found or created),
//! a run with the configuration as params, metrics in batches, texts as artifacts, the run's
//! end status. It reads the variables MLflow's own clients read:
//!
//! - `MLFLOW_TRACKING_URI`: the server, `http://` or `https://` (required);
//! - `MLFLOW_EXPERIMENT_NAME` or `MLFLOW_EXPERIMENT_ID`: the experiment (else the project
//!   name the run starts with);
//! - `MLFLOW_RUN_ID`: continue that run instead of creating one;
//! - `MLFLOW_TRACKING_TOKEN` (bearer) or `MLFLOW_TRACKING_USERNAME`/`MLFLOW_TRACKING_PASSWORD`
//!   (basic authentication);
//! - `MLFLOW_TAGS`: a JSON object of extra run tags.
//!
//! Nothing waits on the server in the training thread: calls queue what they log and a thread
//! of the tracker's own sends it, retrying with backoff (0.5 s doubling to 30 s) while the
//! server is away. Up to [`MlflowConfig::DEFAULT_BUFFER`] metrics wait (then the oldest are
//! dropped, and counted in the next warning), so a server that restarts mid-run ends with
//! every metric logged. [`finish`](GeneralTracker::finish) waits for the queue to drain, at
//! most `ACCELERATE_MLFLOW_FLUSH_TIMEOUT` seconds (default 60), then sets the run's status.

mod config;
mod sender;

use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};

pub use config::MlflowConfig;
use sender::{Message, Metric, SenderState, now_ms};

use crate::tracking::{GeneralTracker, RunInfo, RunStatus, TrackerError};

/// Logs to an MLflow tracking server from a thread of its own.
pub struct MlflowTracker {
    config: MlflowConfig,
    sender: Option<mpsc::Sender<Message>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// What the sending thread met since the last call (reported once, at the next call).
    state: Arc<Mutex<SenderState>>,
}

impl MlflowTracker {
    /// A tracker configured from the environment (see the module's documentation).
    pub fn from_env() -> Result<Self, TrackerError> {
        Ok(Self::new(MlflowConfig::from_env()?))
    }

    /// A tracker for `config`; nothing is sent before the run starts.
    pub fn new(config: MlflowConfig) -> Self {
        Self {
            config,
            sender: None,
            thread: None,
            state: Arc::new(Mutex::new(SenderState::default())),
        }
    }

    /// The id of the run, once the server gave it (or `MLFLOW_RUN_ID`'s).
    pub fn run_id(&self) -> Option<String> {
        self.lock_state().run_id.clone()
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, SenderState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `message`; reports what the sending thread met since the last call.
    fn send(&mut self, message: Message) -> Result<(), TrackerError> {
        let Some(sender) = &self.sender else {
            return Err(TrackerError::Config {
                tracker: "mlflow".into(),
                what: "a value was logged before the run started".into(),
                hint: "start the run first",
            });
        };
        if sender.send(message).is_err() {
            return Err(self
                .lock_state()
                .take_news()
                .unwrap_or(TrackerError::Other {
                    tracker: "mlflow".into(),
                    message: "the sending thread has stopped".into(),
                }));
        }
        match self.lock_state().take_news() {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}

impl GeneralTracker for MlflowTracker {
    fn name(&self) -> &str {
        "mlflow"
    }

    fn start(&mut self, run: &RunInfo) -> Result<(), TrackerError> {
        let (sender, receiver) = mpsc::channel();
        let thread = sender::spawn(
            self.config.clone(),
            run.clone(),
            receiver,
            self.state.clone(),
        )
        .map_err(|e| TrackerError::Other {
            tracker: "mlflow".into(),
            message: format!("could not start its sending thread: {e}"),
        })?;
        self.sender = Some(sender);
        self.thread = Some(thread);
        Ok(())
    }

    fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), TrackerError> {
        let timestamp = now_ms();
        let step = i64::try_from(step).unwrap_or(i64::MAX);
        let metrics = metrics
            .iter()
            .map(|(key, value)| Metric {
                key: (*key).to_string(),
                value: *value,
                timestamp,
                step,
            })
            .collect();
        self.send(Message::Metrics(metrics))
    }

    fn log_text(&mut self, step: u64, name: &str, text: &str) -> Result<(), TrackerError> {
        self.send(Message::Text {
            path: format!("{name}/step_{step}.txt"),
            text: text.to_string(),
        })
    }

    fn finish(&mut self, status: RunStatus) -> Result<(), TrackerError> {
        let sent = self.send(Message::Finish(status));
        let Some(thread) = self.thread.take() else {
            return sent;
        };
        // The thread ends after its own flush deadline; joining cannot outlast it by much.
        self.sender = None;
        let _ = thread.join();
        match self.lock_state().take_news() {
            Some(err) => Err(err),
            None => sent,
        }
    }
}

impl Drop for MlflowTracker {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let status = if std::thread::panicking() {
                RunStatus::Failed
            } else {
                RunStatus::Finished
            };
            if let Err(err) = self.finish(status) {
                tracing::warn!("{err}");
            }
        }
    }
}
