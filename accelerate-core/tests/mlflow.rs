//! The MLflow tracker against a real `mlflow server` (on 127.0.0.1), read back through
//! MLflow's own Python client: params, metrics, texts and the run's status arrive; a server
//! killed and restarted mid-run ends with every metric the run logged.

#[path = "../../tests-support/mlflow.rs"]
mod mlflow;
#[path = "../../tests-support/tools.rs"]
mod tools;

use std::time::{Duration, Instant};

use accelerate_core::tracking::mlflow::{MlflowConfig, MlflowTracker};
use accelerate_core::tracking::{GeneralTracker, RunInfo, RunStatus};

fn tracker(uri: &str, experiment: &str) -> MlflowTracker {
    let vars = |name: &str| match name {
        "MLFLOW_TRACKING_URI" => Some(uri.to_string()),
        "MLFLOW_EXPERIMENT_NAME" => Some(experiment.to_string()),
        "MLFLOW_TAGS" => Some(r#"{"suite": "accelerate-rs"}"#.to_string()),
        _ => None,
    };
    MlflowTracker::new(MlflowConfig::from_vars(vars).unwrap())
}

/// The run's params, tags, status and the history of `metric`, as MLflow's client reads them.
fn read_run(server: &mlflow::MlflowServer, run_id: &str, metric: &str) -> serde_json::Value {
    let script = format!(
        r#"
import json
from mlflow.tracking import MlflowClient
c = MlflowClient()
r = c.get_run("{run_id}")
h = c.get_metric_history("{run_id}", "{metric}")
print(json.dumps({{
    "params": r.data.params, "tags": r.data.tags, "status": r.info.status,
    "experiment": c.get_experiment(r.info.experiment_id).name,
    "history": sorted([m.step, None if m.value != m.value else m.value] for m in h),
}}))
"#
    );
    serde_json::from_str(&server.python(&script)).unwrap()
}

fn run_id(tracker: &MlflowTracker) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(id) = tracker.run_id() {
            return id;
        }
        assert!(Instant::now() < deadline, "no run was created");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn params_metrics_texts_and_status_reach_a_real_server() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = mlflow::MlflowServer::start(dir.path()) else {
        return;
    };
    let mut mlflow = tracker(&server.uri(), "accelerate-rs tests");
    let mut run = RunInfo::new("ignored: the experiment variable wins");
    run.run_name = Some("tiny".into());
    run.set_config(&serde_json::json!({"lr": 3e-4, "model": {"layers": 4}, "fused": true}));
    mlflow.start(&run).unwrap();
    for step in 1..=3u64 {
        mlflow
            .log(step, &[("loss", 1.0 / step as f64), ("lr", 3e-4)])
            .unwrap();
    }
    mlflow.log(4, &[("loss", f64::NAN)]).unwrap();
    mlflow.log_text(3, "sample", "to be or not to be").unwrap();
    mlflow.finish(RunStatus::Finished).unwrap();
    let id = run_id(&mlflow);

    let seen = read_run(&server, &id, "loss");
    assert_eq!(seen["experiment"], "accelerate-rs tests");
    assert_eq!(seen["status"], "FINISHED");
    assert_eq!(seen["params"]["lr"], "0.0003");
    assert_eq!(seen["params"]["model.layers"], "4");
    assert_eq!(seen["params"]["fused"], "true");
    assert_eq!(seen["tags"]["mlflow.runName"], "tiny");
    assert_eq!(seen["tags"]["suite"], "accelerate-rs");
    assert_eq!(seen["tags"]["accelerate.world_size"], "1");
    let history = seen["history"].as_array().unwrap();
    assert_eq!(history.len(), 4, "{history:?}");
    assert_eq!(history[1], serde_json::json!([2, 0.5]));
    // NaN arrives as NaN (the script prints it as null).
    assert!(history[3][1].is_null(), "{history:?}");

    let text = server.python(&format!(
        "import mlflow; print(mlflow.artifacts.load_text('runs:/{id}/sample/step_3.txt'))"
    ));
    assert_eq!(text.trim_end(), "to be or not to be");

    // An experiment the server does not have: the run cannot be created. The failure reaches
    // the training thread as an error naming the request (a warning through the accelerator),
    // and finishing waits no longer than the flush timeout.
    let vars = |name: &str| match name {
        "MLFLOW_TRACKING_URI" => Some(server.uri()),
        "MLFLOW_EXPERIMENT_ID" => Some("987654321".to_string()),
        "ACCELERATE_MLFLOW_FLUSH_TIMEOUT" => Some("2".to_string()),
        _ => None,
    };
    let mut refused = MlflowTracker::new(MlflowConfig::from_vars(vars).unwrap());
    refused.start(&RunInfo::new("nowhere")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let err = loop {
        if let Err(err) = refused.log(1, &[("loss", 1.0)]) {
            break err;
        }
        assert!(Instant::now() < deadline, "no failure was reported");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        err.to_string().contains("the run could not be created"),
        "{err}"
    );
    let started = Instant::now();
    let finished = refused.finish(RunStatus::Finished);
    assert!(started.elapsed() < Duration::from_secs(10));
    let err = finished.unwrap_err().to_string();
    assert!(
        err.contains("still queued when the flush timeout ran out"),
        "{err}"
    );
}

#[test]
fn a_server_killed_and_restarted_mid_run_ends_with_every_metric() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut server) = mlflow::MlflowServer::start(dir.path()) else {
        return;
    };
    let mut mlflow = tracker(&server.uri(), "restarts");
    mlflow.start(&RunInfo::new("restarts")).unwrap();
    let log = |mlflow: &mut MlflowTracker, steps: std::ops::RangeInclusive<u64>| {
        for step in steps {
            let started = Instant::now();
            // Failures while the server is away are warnings for later calls, never a wait.
            let _ = mlflow.log(step, &[("loss", step as f64)]);
            assert!(
                started.elapsed() < Duration::from_millis(100),
                "a log call waited"
            );
        }
    };
    log(&mut mlflow, 1..=5);
    let id = run_id(&mlflow);
    server.kill();
    log(&mut mlflow, 6..=40);
    std::thread::sleep(Duration::from_secs(2));
    log(&mut mlflow, 41..=60);
    server.restart();
    log(&mut mlflow, 61..=80);
    mlflow.finish(RunStatus::Finished).unwrap();

    let seen = read_run(&server, &id, "loss");
    assert_eq!(seen["status"], "FINISHED");
    let steps: Vec<u64> = seen["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m[0].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=80).collect::<Vec<_>>());
}
