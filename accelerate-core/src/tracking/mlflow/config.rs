//! The MLflow tracker's settings, read from the variables MLflow's own clients read.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::tracking::TrackerError;

/// Where and how to reach the MLflow server.
/// Its `Debug` output hides the `Authorization` value (a token or a password).
#[derive(Clone, PartialEq)]
pub struct MlflowConfig {
    /// The server's base URL (`http://127.0.0.1:5000`), without a trailing slash.
    pub tracking_uri: String,
    /// The experiment's name (`MLFLOW_EXPERIMENT_NAME`); `None`: the run's project.
    pub experiment_name: Option<String>,
    /// The experiment's id (`MLFLOW_EXPERIMENT_ID`), which wins over a name.
    pub experiment_id: Option<String>,
    /// A run to continue (`MLFLOW_RUN_ID`).
    pub run_id: Option<String>,
    /// The `Authorization` header's value, if any.
    pub authorization: Option<String>,
    /// Extra run tags (`MLFLOW_TAGS`).
    pub tags: BTreeMap<String, String>,
    /// Metrics kept while the server is away; beyond it the oldest are dropped.
    pub buffer: usize,
    /// How long `finish` waits for queued values to reach the server.
    pub flush_timeout: Duration,
}

impl std::fmt::Debug for MlflowConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let authorization = self
            .authorization
            .as_ref()
            .map(|_| crate::comm::secret::REDACTED);
        f.debug_struct("MlflowConfig")
            .field("tracking_uri", &self.tracking_uri)
            .field("experiment_name", &self.experiment_name)
            .field("experiment_id", &self.experiment_id)
            .field("run_id", &self.run_id)
            .field("authorization", &authorization)
            .field("tags", &self.tags)
            .field("buffer", &self.buffer)
            .field("flush_timeout", &self.flush_timeout)
            .finish()
    }
}

impl MlflowConfig {
    /// Metrics kept by default while the server is away (about 8 MB).
    pub const DEFAULT_BUFFER: usize = 100_000;

    /// The configuration MLflow's clients would use, from the environment.
    pub fn from_env() -> Result<Self, TrackerError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The configuration from `var` (an environment).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, TrackerError> {
        let config = |what: String, hint| TrackerError::Config {
            tracker: "mlflow".into(),
            what,
            hint,
        };
        let Some(uri) = var("MLFLOW_TRACKING_URI").filter(|u| !u.is_empty()) else {
            return Err(config(
                "MLFLOW_TRACKING_URI is not set".into(),
                "set it to your tracking server, e.g. http://127.0.0.1:5000",
            ));
        };
        if !(uri.starts_with("http://") || uri.starts_with("https://")) {
            return Err(config(
                format!(
                    "MLFLOW_TRACKING_URI={uri}: only http:// and https:// servers are spoken to"
                ),
                "start `mlflow server` over your store and give its URL",
            ));
        }
        let authorization = match (
            var("MLFLOW_TRACKING_TOKEN"),
            var("MLFLOW_TRACKING_USERNAME"),
            var("MLFLOW_TRACKING_PASSWORD"),
        ) {
            (Some(token), _, _) => Some(format!("Bearer {token}")),
            (None, Some(user), Some(password)) => {
                use base64::Engine;
                let pair = format!("{user}:{password}");
                Some(format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(pair)
                ))
            }
            _ => None,
        };
        let tags = match var("MLFLOW_TAGS") {
            Some(json) => {
                let map: BTreeMap<String, serde_json::Value> = serde_json::from_str(&json)
                    .map_err(|e| {
                        config(
                            format!("MLFLOW_TAGS is not a JSON object: {e}"),
                            "write it as {\"team\": \"nlp\"}",
                        )
                    })?;
                map.into_iter()
                    .map(|(k, v)| match v {
                        serde_json::Value::String(s) => (k, s),
                        other => (k, other.to_string()),
                    })
                    .collect()
            }
            None => BTreeMap::new(),
        };
        let flush_timeout = match var("ACCELERATE_MLFLOW_FLUSH_TIMEOUT") {
            Some(secs) => secs
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| {
                    config(
                        format!(
                            "ACCELERATE_MLFLOW_FLUSH_TIMEOUT={secs} is not a number of seconds"
                        ),
                        "give seconds, e.g. 60",
                    )
                })?,
            None => Duration::from_secs(60),
        };
        Ok(Self {
            tracking_uri: uri.trim_end_matches('/').to_string(),
            experiment_name: var("MLFLOW_EXPERIMENT_NAME").filter(|s| !s.is_empty()),
            experiment_id: var("MLFLOW_EXPERIMENT_ID").filter(|s| !s.is_empty()),
            run_id: var("MLFLOW_RUN_ID").filter(|s| !s.is_empty()),
            authorization,
            tags,
            buffer: Self::DEFAULT_BUFFER,
            flush_timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = list
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn the_configuration_is_read_as_mlflow_clients_read_it() {
        let config = MlflowConfig::from_vars(vars(&[
            ("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000/"),
            ("MLFLOW_EXPERIMENT_NAME", "lm"),
            ("MLFLOW_TRACKING_USERNAME", "Aladdin"),
            ("MLFLOW_TRACKING_PASSWORD", "open sesame"),
            ("MLFLOW_TAGS", r#"{"team": "nlp", "n": 3}"#),
        ]))
        .unwrap();
        assert_eq!(config.tracking_uri, "http://127.0.0.1:5000");
        assert_eq!(config.experiment_name.as_deref(), Some("lm"));
        // RFC 7617's example.
        assert_eq!(
            config.authorization.as_deref(),
            Some("Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==")
        );
        assert_eq!(config.tags["team"], "nlp");
        assert_eq!(config.tags["n"], "3");
        assert_eq!(config.flush_timeout, Duration::from_secs(60));

        let token = MlflowConfig::from_vars(vars(&[
            ("MLFLOW_TRACKING_URI", "https://mlflow.example"),
            ("MLFLOW_TRACKING_TOKEN", "t0k"),
        ]))
        .unwrap();
        assert_eq!(token.authorization.as_deref(), Some("Bearer t0k"));
        assert!(!format!("{token:?}").contains("t0k"));

        for (bad, says) in [
            (vec![], "MLFLOW_TRACKING_URI is not set"),
            (
                vec![("MLFLOW_TRACKING_URI", "file:///tmp/mlruns")],
                "only http://",
            ),
            (
                vec![("MLFLOW_TRACKING_URI", "http://h"), ("MLFLOW_TAGS", "[1]")],
                "MLFLOW_TAGS",
            ),
        ] {
            let err = MlflowConfig::from_vars(vars(&bad)).unwrap_err();
            assert!(err.to_string().contains(says), "{err}");
        }
    }
}
