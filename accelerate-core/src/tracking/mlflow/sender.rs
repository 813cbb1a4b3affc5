//! The MLflow tracker's sending thread: it owns the queue and the HTTP client, creates the
//! run when it first reaches the server, sends params, metrics (in MLflow's batch sizes) and
//! texts, retries what the network or the server's 5xx refused with backoff, and drops (and
//! reports) what the server rejected as invalid.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::MlflowConfig;
use crate::tracking::{RunInfo, RunStatus, TrackerError};

/// Milliseconds since the epoch (MLflow's timestamps).
pub(super) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// What the tracker hands the thread.
pub(super) enum Message {
    /// Metrics to send.
    Metrics(Vec<Metric>),
    /// A text, as an artifact at `path` in the run.
    Text { path: String, text: String },
    /// The end of the run.
    Finish(RunStatus),
}

/// One metric value, as MLflow's `log-batch` takes it.
pub(super) struct Metric {
    pub key: String,
    pub value: f64,
    pub timestamp: i64,
    pub step: i64,
}

/// What the thread tells the tracker.
#[derive(Default)]
pub(super) struct SenderState {
    /// The run, once created (or given).
    pub run_id: Option<String>,
    /// A failure not yet reported.
    news: Option<TrackerError>,
}

impl SenderState {
    /// The failure met since the last call, if any.
    pub fn take_news(&mut self) -> Option<TrackerError> {
        self.news.take()
    }
}

/// MLflow's limits per `log-batch` request.
const METRICS_PER_BATCH: usize = 1000;
const PARAMS_PER_BATCH: usize = 100;
/// MLflow's longest param value (since 2.x) and tag value.
const PARAM_VALUE_CHARS: usize = 6000;
const FIRST_RETRY: Duration = Duration::from_millis(500);
const LONGEST_RETRY: Duration = Duration::from_secs(30);

/// Starts the thread for `run`.
pub(super) fn spawn(
    config: MlflowConfig,
    run: RunInfo,
    receiver: Receiver<Message>,
    state: Arc<Mutex<SenderState>>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("accelerate-mlflow".into())
        .spawn(move || Sender::new(config, run, state).run(receiver))
}

/// A request that did not succeed.
enum Failure {
    /// The network or the server (5xx, 429): try again later.
    Retry(String),
    /// The server refused the request itself (4xx): sending it again cannot help.
    Reject(String),
}

struct Sender {
    agent: ureq::Agent,
    config: MlflowConfig,
    run: RunInfo,
    state: Arc<Mutex<SenderState>>,
    run_id: Option<String>,
    /// The run's artifact location on a server that proxies artifacts (`mlflow-artifacts:`).
    artifact_path: Option<String>,
    params: VecDeque<(String, String)>,
    metrics: VecDeque<Metric>,
    texts: VecDeque<(String, String)>,
    /// Metrics dropped from a full buffer since the last report.
    dropped: u64,
    retry_at: Instant,
    backoff: Duration,
}

impl Sender {
    fn new(config: MlflowConfig, run: RunInfo, state: Arc<Mutex<SenderState>>) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        let params = run
            .config
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.to_string().chars().take(PARAM_VALUE_CHARS).collect(),
                )
            })
            .collect();
        Self {
            agent,
            run_id: config.run_id.clone(),
            config,
            run,
            state,
            artifact_path: None,
            params,
            metrics: VecDeque::new(),
            texts: VecDeque::new(),
            dropped: 0,
            retry_at: Instant::now(),
            backoff: FIRST_RETRY,
        }
    }

    fn has_work(&self) -> bool {
        self.run_id.is_none()
            || !self.params.is_empty()
            || !self.metrics.is_empty()
            || !self.texts.is_empty()
    }

    fn run(mut self, receiver: Receiver<Message>) {
        let mut finish: Option<(RunStatus, Instant)> = None;
        loop {
            let now = Instant::now();
            let wait = if self.has_work() {
                self.retry_at.saturating_duration_since(now)
            } else {
                Duration::from_secs(3600)
            };
            match finish {
                None => match receiver.recv_timeout(wait) {
                    Ok(message) => {
                        self.take(message, &mut finish);
                        while let Ok(message) = receiver.try_recv() {
                            self.take(message, &mut finish);
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    // The tracker went away without finishing (it always finishes on drop).
                    Err(RecvTimeoutError::Disconnected) => {
                        finish = Some((RunStatus::Failed, now + self.config.flush_timeout));
                    }
                },
                Some((_, deadline)) => {
                    std::thread::sleep(wait.min(deadline.saturating_duration_since(now)));
                }
            }
            if self.has_work() && Instant::now() >= self.retry_at {
                self.push();
            }
            if let Some((status, deadline)) = finish
                && (!self.has_work() || Instant::now() >= deadline)
            {
                self.end(status);
                return;
            }
        }
    }

    fn take(&mut self, message: Message, finish: &mut Option<(RunStatus, Instant)>) {
        match message {
            Message::Metrics(metrics) => {
                self.metrics.extend(metrics);
                while self.metrics.len() > self.config.buffer {
                    self.metrics.pop_front();
                    self.dropped += 1;
                }
            }
            Message::Text { path, text } => self.texts.push_back((path, text)),
            Message::Finish(status) => {
                *finish = Some((status, Instant::now() + self.config.flush_timeout));
            }
        }
    }

    /// Sends what is queued, in order; stops at the first failure to retry later.
    fn push(&mut self) {
        let outcome = self.push_all();
        match outcome {
            Ok(()) => self.backoff = FIRST_RETRY,
            Err(Failure::Retry(detail)) => {
                self.retry_at = Instant::now() + self.backoff;
                let queued = self.metrics.len();
                self.report(format!(
                    "{detail}; retrying in {:.1} s, {queued} metrics queued",
                    self.backoff.as_secs_f64()
                ));
                self.backoff = (self.backoff * 2).min(LONGEST_RETRY);
            }
            // A refused batch was dropped: the rest goes on at once. A refused run leaves
            // nothing to send to: ask again later (the server's settings may change), never
            // in a tight loop.
            Err(Failure::Reject(detail)) if self.run_id.is_some() => self.report(detail),
            Err(Failure::Reject(detail)) => {
                self.retry_at = Instant::now() + self.backoff;
                self.report(detail);
                self.backoff = (self.backoff * 2).min(LONGEST_RETRY);
            }
        }
        if self.dropped > 0 {
            let dropped = std::mem::take(&mut self.dropped);
            self.report(format!(
                "the server was away too long: the {dropped} oldest metrics were dropped (a \
                 buffer of {} metrics)",
                self.config.buffer
            ));
        }
    }

    fn push_all(&mut self) -> Result<(), Failure> {
        if self.run_id.is_none() {
            self.create_run()?;
        }
        let run_id = self.run_id.clone().unwrap_or_default();
        while !self.params.is_empty() {
            let n = self.params.len().min(PARAMS_PER_BATCH);
            let params: Vec<Value> = self
                .params
                .iter()
                .take(n)
                .map(|(k, v)| json!({"key": k, "value": v}))
                .collect();
            let sent = self.post(
                "runs/log-batch",
                &json!({"run_id": run_id, "params": params}),
            );
            self.drop_if_rejected(sent, n, |s, n| drop(s.params.drain(..n)))?;
        }
        while !self.metrics.is_empty() {
            let n = self.metrics.len().min(METRICS_PER_BATCH);
            let metrics: Vec<Value> = self.metrics.iter().take(n).map(metric_json).collect();
            let sent = self.post(
                "runs/log-batch",
                &json!({"run_id": run_id, "metrics": metrics}),
            );
            self.drop_if_rejected(sent, n, |s, n| drop(s.metrics.drain(..n)))?;
        }
        while let Some((path, text)) = self.texts.front().cloned() {
            let sent = self.send_text(&run_id, &path, &text);
            self.drop_if_rejected(sent, 1, |s, n| drop(s.texts.drain(..n)))?;
        }
        Ok(())
    }

    /// After a request for the first `n` queued items: on success or rejection they leave the
    /// queue (a rejection is returned, to be reported); a failure to retry keeps them.
    fn drop_if_rejected(
        &mut self,
        sent: Result<Value, Failure>,
        n: usize,
        remove: impl Fn(&mut Self, usize),
    ) -> Result<(), Failure> {
        match sent {
            Ok(_) => {
                remove(self, n);
                Ok(())
            }
            Err(Failure::Reject(detail)) => {
                remove(self, n);
                Err(Failure::Reject(format!("{detail} ({n} values dropped)")))
            }
            Err(retry) => Err(retry),
        }
    }

    fn create_run(&mut self) -> Result<(), Failure> {
        let experiment_id = match &self.config.experiment_id {
            Some(id) => id.clone(),
            None => self.experiment()?,
        };
        let mut tags: Vec<Value> = vec![
            json!({"key": "accelerate.rank", "value": self.run.rank.to_string()}),
            json!({"key": "accelerate.world_size", "value": self.run.world_size.to_string()}),
        ];
        if let Some(program) = std::env::args().next() {
            tags.push(json!({"key": "mlflow.source.name", "value": program}));
        }
        if let Ok(user) = std::env::var("USER") {
            tags.push(json!({"key": "mlflow.user", "value": user}));
        }
        for (k, v) in &self.config.tags {
            tags.push(json!({"key": k, "value": v}));
        }
        let mut body = json!({
            "experiment_id": experiment_id,
            "start_time": now_ms(),
            "tags": tags,
        });
        if let Some(name) = &self.run.run_name {
            body["run_name"] = json!(name);
        }
        let created = self.post("runs/create", &body).map_err(|f| match f {
            Failure::Reject(d) => Failure::Reject(format!("the run could not be created: {d}")),
            retry => retry,
        })?;
        let info = &created["run"]["info"];
        let Some(run_id) = info["run_id"].as_str() else {
            return Err(Failure::Reject(format!(
                "runs/create answered without a run id: {created}"
            )));
        };
        self.artifact_path = info["artifact_uri"]
            .as_str()
            .and_then(|uri| uri.strip_prefix("mlflow-artifacts:"))
            .map(|path| path.trim_start_matches('/').to_string());
        self.run_id = Some(run_id.to_string());
        self.lock_state().run_id = Some(run_id.to_string());
        Ok(())
    }

    /// The experiment named by the configuration or the project, created if absent.
    fn experiment(&mut self) -> Result<String, Failure> {
        let name = self
            .config
            .experiment_name
            .clone()
            .unwrap_or_else(|| self.run.project.clone());
        let url = format!(
            "{}/api/2.0/mlflow/experiments/get-by-name",
            self.config.tracking_uri
        );
        let mut request = self.agent.get(&url).query("experiment_name", &name);
        if let Some(auth) = &self.config.authorization {
            request = request.header("Authorization", auth);
        }
        match answer("GET experiments/get-by-name", request.call()) {
            Ok(found) => match found["experiment"]["experiment_id"].as_str() {
                Some(id) => return Ok(id.to_string()),
                None => {
                    return Err(Failure::Reject(format!("get-by-name answered {found}")));
                }
            },
            // RESOURCE_DOES_NOT_EXIST is a 404: create it below.
            Err(Failure::Reject(detail)) if detail.contains("RESOURCE_DOES_NOT_EXIST") => {}
            Err(other) => return Err(other),
        }
        let created = self.post("experiments/create", &json!({"name": name}))?;
        created["experiment_id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| Failure::Reject(format!("experiments/create answered {created}")))
    }

    /// A text as an artifact (on a server that proxies artifacts), else as a run tag.
    fn send_text(&self, run_id: &str, path: &str, text: &str) -> Result<Value, Failure> {
        let Some(root) = &self.artifact_path else {
            let tag: String = text.chars().take(PARAM_VALUE_CHARS).collect();
            let body = json!({"run_id": run_id, "key": path, "value": tag});
            return self.post("runs/set-tag", &body);
        };
        let url = format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{root}/{path}",
            self.config.tracking_uri
        );
        let mut request = self.agent.put(&url).header("Content-Type", "text/plain");
        if let Some(auth) = &self.config.authorization {
            request = request.header("Authorization", auth);
        }
        answer(
            &format!("PUT artifact {path}"),
            request.send(text.as_bytes()),
        )
    }

    fn post(&self, endpoint: &str, body: &Value) -> Result<Value, Failure> {
        let url = format!("{}/api/2.0/mlflow/{endpoint}", self.config.tracking_uri);
        let mut request = self.agent.post(&url);
        if let Some(auth) = &self.config.authorization {
            request = request.header("Authorization", auth);
        }
        answer(&format!("POST {endpoint}"), request.send_json(body))
    }

    /// Sets the run's end status (one try: the queue's deadline has passed or it is empty).
    fn end(&mut self, status: RunStatus) {
        let lost = self.metrics.len() + self.params.len() + self.texts.len();
        if lost > 0 {
            // What is lost matters most at the end: it replaces an unreported failure, whose
            // words it keeps.
            let last = match self.lock_state().take_news() {
                Some(TrackerError::Server { detail, .. }) => {
                    format!("; the last failure: {detail}")
                }
                Some(other) => format!("; the last failure: {other}"),
                None => String::new(),
            };
            self.report(format!(
                "{lost} values were still queued when the flush timeout ran out (raise \
                 ACCELERATE_MLFLOW_FLUSH_TIMEOUT, or check that the server is up){last}"
            ));
        }
        let Some(run_id) = self.run_id.clone() else {
            return;
        };
        let status = match status {
            RunStatus::Finished => "FINISHED",
            RunStatus::Failed => "FAILED",
            RunStatus::Killed => "KILLED",
        };
        let body = json!({"run_id": run_id, "status": status, "end_time": now_ms()});
        if let Err(Failure::Retry(d) | Failure::Reject(d)) = self.post("runs/update", &body) {
            self.report(format!("the run's status could not be set: {d}"));
        }
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, SenderState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `detail` for the tracker's next call (the first one not yet reported wins).
    fn report(&self, detail: String) {
        let mut state = self.lock_state();
        if state.news.is_none() {
            state.news = Some(TrackerError::Server {
                tracker: "mlflow".into(),
                request: self.config.tracking_uri.clone(),
                detail,
            });
        } else {
            tracing::debug!("mlflow tracker: {detail}");
        }
    }
}

/// MLflow encodes non-finite values as the strings protobuf's JSON mapping uses.
fn metric_json(metric: &Metric) -> Value {
    let value = if metric.value.is_finite() {
        json!(metric.value)
    } else if metric.value.is_nan() {
        json!("NaN")
    } else if metric.value > 0.0 {
        json!("Infinity")
    } else {
        json!("-Infinity")
    };
    json!({"key": metric.key, "value": value, "timestamp": metric.timestamp, "step": metric.step})
}

/// Reads a response: JSON on 2xx, a failure to retry on network errors, 5xx and 429, a
/// rejection on other 4xx.
fn answer(
    request: &str,
    response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Result<Value, Failure> {
    let mut response = match response {
        Ok(response) => response,
        Err(e) => return Err(Failure::Retry(format!("{request}: {e}"))),
    };
    let status = response.status().as_u16();
    let text = response.body_mut().read_to_string().unwrap_or_default();
    match status {
        200..=299 => Ok(serde_json::from_str(&text).unwrap_or(Value::Null)),
        429 | 500..=599 => Err(Failure::Retry(format!("{request}: HTTP {status}: {text}"))),
        _ => Err(Failure::Reject(format!("{request}: HTTP {status}: {text}"))),
    }
}
