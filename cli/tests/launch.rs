//! `accelerate-rs launch` supervising real worker processes (small shell scripts as workers).

#[path = "../../tests-support/built_example.rs"]
mod built_example;
#[path = "../../tests-support/mlflow.rs"]
mod mlflow;
#[path = "../../tests-support/tools.rs"]
mod tools;

use std::net::TcpListener;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn launch(args: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .arg("launch")
        .args(args)
        .output()
        .unwrap();
    (output, started.elapsed())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The pid a worker printed as "PID <n>".
fn printed_pid(stdout: &str, rank: usize) -> u32 {
    let prefix = format!("[rank {rank}] PID ");
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("rank {rank} printed no pid:\n{stdout}"))
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| !stat.contains(") Z"))
        .unwrap_or(false)
}

#[test]
fn workers_get_the_process_contract_and_their_lines_are_prefixed() {
    let script = r#"echo "hello from $RANK of $WORLD_SIZE local $LOCAL_RANK/$LOCAL_WORLD_SIZE at $MASTER_ADDR:$MASTER_PORT"; test -n "$ACCELERATE_JOB_TOKEN" && echo token >&2"#;
    let (out, _) = launch(&["-n", "2", "--", "sh", "-c", script]);
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..2 {
        let line = stdout
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "[rank {rank}] hello from {rank} of 2 local {rank}/2 at 127.0.0.1:"
                ))
            })
            .unwrap_or_else(|| panic!("{stdout}"));
        // Port 0 was replaced by a real free port.
        assert!(!line.ends_with(":0"), "{line}");
        assert!(stderr.contains(&format!("[rank {rank}] token")), "{stderr}");
    }
}

#[test]
fn a_failing_worker_stops_the_others_and_the_exit_names_its_rank() {
    let script = r#"echo "PID $$"; if [ "$RANK" = 1 ]; then sleep 0.3; exit 1; fi; sleep 60 & echo "PID $!"; wait"#;
    let (out, elapsed) = launch(&["-n", "2", "--grace-period", "2", "--", "sh", "-c", script]);
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    assert!(stderr.contains("error: rank 1 (pid "), "{stderr}");
    assert!(
        stderr.contains("exited with status 1; the other workers were stopped"),
        "{stderr}"
    );
    // Rank 0's shell and the sleep it started in the background are both gone.
    let shell = printed_pid(&stdout, 0);
    assert!(!alive(shell), "rank 0 (pid {shell}) outlived the launcher");
    let background = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0] PID "))
        .nth(1)
        .and_then(|p| p.trim().parse::<u32>().ok())
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        !alive(background),
        "a process rank 0 started (pid {background}) outlived it"
    );
}

#[test]
fn a_killed_worker_fails_the_launch_with_its_signal() {
    let script = r#"if [ "$RANK" = 1 ]; then sleep 0.3; kill -9 $$; fi; exec sleep 60"#;
    let (out, elapsed) = launch(&["-n", "2", "--grace-period", "2", "--", "sh", "-c", script]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(137), "{stderr}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    assert!(stderr.contains("rank 1 (pid "), "{stderr}");
    assert!(
        stderr.contains("was killed by signal 9 (SIGKILL)"),
        "{stderr}"
    );
}

#[test]
fn a_busy_port_is_a_clear_error() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let (out, _) = launch(&["-n", "2", "--main-process-port", &port, "--", "true"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("port {port} on 127.0.0.1 is already in use")),
        "{stderr}"
    );
    assert!(stderr.contains("--main-process-port 0"), "{stderr}");
}

#[test]
fn failed_groups_are_restarted_and_logs_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("failed-once");
    let script = format!(
        r#"echo "attempt of $RANK"; if [ "$RANK" = 1 ] && [ ! -f {m} ]; then touch {m}; exit 3; fi"#,
        m = marker.display()
    );
    let logs = dir.path().join("logs");
    let logs_arg = logs.display().to_string();
    let (out, _) = launch(&[
        "-n",
        "2",
        "--max-restarts",
        "1",
        "--log-dir",
        &logs_arg,
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("rank 1 exited with status 3; restarting every worker (restart 1 of 1)"),
        "{stderr}"
    );
    let log = std::fs::read_to_string(logs.join("rank_1.log")).unwrap();
    assert_eq!(log, "attempt of 1\n", "the log holds the last attempt");
}

#[test]
fn nothing_to_launch_is_a_user_error() {
    let (out, _) = launch(&["-n", "2"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("nothing to launch"));
}

/// Starts `accelerate-rs launch -n 2` over workers that print their pid and sleep; returns the
/// launcher and the workers' pids once both have started.
fn sleeping_job() -> (std::process::Child, Vec<u32>) {
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .args([
            "launch",
            "-n",
            "2",
            "--grace-period",
            "2",
            "--",
            "sh",
            "-c",
            r#"echo "PID $$"; exec sleep 60"#,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(launcher.stdout.take().unwrap());
    let mut pids = Vec::new();
    let mut line = String::new();
    while pids.len() < 2 {
        line.clear();
        use std::io::BufRead;
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "the workers never started"
        );
        if let Some((_, pid)) = line.trim().split_once("PID ") {
            pids.push(pid.parse::<u32>().unwrap());
        }
    }
    (launcher, pids)
}

/// Ctrl-C (SIGINT), SIGTERM (`timeout`, systemd, Slurm's scancel, Kubernetes) and SIGHUP (a
/// closed terminal) each stop every worker within the grace period, and the launcher exits
/// with 128 + the signal, naming it.
#[test]
fn a_stopping_signal_stops_the_workers() {
    for (signal, number) in [("INT", 2), ("TERM", 15), ("HUP", 1)] {
        let (mut launcher, pids) = sleeping_job();
        let started = Instant::now();
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &launcher.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let status = launcher.wait().unwrap();
        let mut stderr = String::new();
        use std::io::Read;
        launcher
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        assert_eq!(status.code(), Some(128 + number), "SIG{signal}: {stderr}");
        assert!(
            stderr.contains(&format!("interrupted by SIG{signal}")),
            "SIG{signal}: {stderr}"
        );
        assert!(started.elapsed() < Duration::from_secs(10));
        for pid in pids {
            assert!(
                !alive(pid),
                "SIG{signal}: worker {pid} outlived the launcher"
            );
        }
    }
}

/// `timeout 2 accelerate-rs launch ...` (SIGTERM when time is up) leaves no worker behind.
#[test]
fn a_launch_under_timeout_leaves_no_worker_behind() {
    let out = Command::new("timeout")
        .args([
            "2",
            env!("CARGO_BIN_EXE_accelerate-rs"),
            "launch",
            "-n",
            "2",
        ])
        .args(["--grace-period", "2", "--", "sh", "-c"])
        .arg(r#"echo "PID $$"; exec sleep 60"#)
        .output()
        .unwrap();
    // timeout's own status when it had to stop the command.
    assert_eq!(out.status.code(), Some(124), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for rank in 0..2 {
        let pid = printed_pid(&stdout, rank);
        assert!(!alive(pid), "worker {pid} outlived the launcher");
    }
}

/// One of our workers: reading its process state ties it to its launcher; then it prints its
/// pid and sleeps. Does nothing unless started by `workers_end_when_the_launcher_is_killed`.
#[test]
fn sleeping_worker() {
    if std::env::var("ACCELERATE_TEST_SLEEPER").is_err() {
        return;
    }
    accelerate_core::ProcessState::from_env().unwrap();
    println!("PID {}", std::process::id());
    std::thread::sleep(Duration::from_secs(60));
}

/// SIGKILL of the launcher (no chance to forward anything): the kernel ends its workers.
#[test]
fn workers_end_when_the_launcher_is_killed() {
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .args(["launch", "-n", "2", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "sleeping_worker",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ACCELERATE_TEST_SLEEPER", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(launcher.stdout.take().unwrap());
    let mut pids = Vec::new();
    let mut line = String::new();
    while pids.len() < 2 {
        line.clear();
        use std::io::BufRead;
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "the workers never started"
        );
        if let Some((_, pid)) = line.trim().split_once("PID ") {
            pids.push(pid.parse::<u32>().unwrap());
        }
    }
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&pid| alive(pid)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    for pid in pids {
        assert!(!alive(pid), "worker {pid} outlived its SIGKILLed launcher");
    }
}

/// A process a worker starts (it inherits the worker's environment) reads the process state
/// as any program would, and is neither tied to the launcher nor ended for not being its
/// child. Runs only as that grandchild.
#[test]
fn grandchild() {
    if std::env::var_os("ACCELERATE_TEST_GRANDCHILD").is_none() {
        return;
    }
    let state = accelerate_core::ProcessState::from_env().unwrap();
    println!("GRANDCHILD of rank {}", state.rank);
}

#[test]
fn a_process_started_by_a_worker_runs_as_any_program() {
    let exe = std::env::current_exe().unwrap();
    // `; echo`: the shell forks the test binary instead of replacing itself with it.
    let script = r#""$EXE" grandchild --exact --nocapture --test-threads=1; echo "exit $?""#;
    let out = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .args(["launch", "-n", "2", "--", "sh", "-c", script])
        .env("EXE", exe)
        .env("ACCELERATE_TEST_GRANDCHILD", "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..2 {
        // The test harness prints its "test grandchild ... " on the same line.
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("[rank {rank}] "))
                    && l.ends_with(&format!("GRANDCHILD of rank {rank}"))),
            "{stdout}\n{stderr}"
        );
        assert!(
            stdout.contains(&format!("[rank {rank}] exit 0")),
            "{stdout}\n{stderr}"
        );
    }
}

/// The transformer example's arguments for a model that trains 6 updates in a moment, logging
/// every `log_every` and evaluating at `eval_every`.
fn tiny_transformer<'a>(log_every: &'a str, eval_every: &'a str) -> Vec<&'a str> {
    vec![
        "--steps",
        "6",
        "--log-every",
        log_every,
        "--eval-every",
        eval_every,
        "--batch",
        "4",
        "--context",
        "16",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--mlp",
        "32",
        "--eval-sequences",
        "8",
        "--sample-bytes",
        "0",
    ]
}

/// Out of a terminal, the launcher prints the main process's progress as lines (here at
/// every change): the update of the total, the loss and tokens/s; the last one at the end,
/// with the validation loss; and the progress file is gone afterwards.
#[test]
fn the_launcher_prints_the_main_process_progress() {
    let example = built_example::built_example("transformer_lm");
    let tiny = tiny_transformer("2", "100");
    let output = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .args(["launch", "-n", "2"])
        .arg(&example)
        .args(&tiny)
        .env("ACCELERATE_PROGRESS_EVERY", "0")
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let progress: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("[progress] "))
        .collect();
    let last = progress
        .last()
        .unwrap_or_else(|| panic!("no progress line: {stderr}"));
    assert!(
        last.starts_with("[progress] step 6/6 (100 %): train/loss ")
            && last.contains(", validation/loss ")
            && last.contains(" tokens/s"),
        "{last}"
    );
    assert!(progress.iter().all(|l| l.contains("/6 (")), "{progress:?}");
    // With --no-progress, nothing is shown.
    let quiet = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .args(["launch", "--no-progress", "-n", "2"])
        .arg(&example)
        .args(&tiny)
        .env("ACCELERATE_PROGRESS_EVERY", "0")
        .output()
        .unwrap();
    assert!(quiet.status.success());
    assert!(!text(&quiet.stderr).contains("[progress]"));
}

/// With `MLFLOW_TRACKING_URI` set, both examples log to a real MLflow server under
/// `accelerate-rs launch -n 2`: one run each (the main process's), with the script's
/// arguments and the accelerator's settings as params, the logged metrics, status FINISHED.
#[test]
fn the_examples_log_to_a_real_mlflow_server_under_launch() {
    let dir = tempfile::tempdir().unwrap();
    let Some(server) = mlflow::MlflowServer::start(dir.path()) else {
        return;
    };
    for (example, args, experiment) in [
        (
            "transformer_lm",
            &tiny_transformer("3", "6")[..],
            "transformer",
        ),
        ("digits", &["--epochs", "2"][..], "digits"),
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
            .args(["launch", "--no-progress", "-n", "2"])
            .arg(built_example::built_example(example))
            .args(args)
            .env("MLFLOW_TRACKING_URI", server.uri())
            .env("MLFLOW_EXPERIMENT_NAME", experiment)
            .env("RAYON_NUM_THREADS", "1")
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output.stderr));
    }
    let seen: serde_json::Value = serde_json::from_str(&server.python(
        r#"
import json
from mlflow.tracking import MlflowClient
c = MlflowClient()
out = {}
for name, metric in [("transformer", "train/loss"), ("digits", "train/loss")]:
    e = c.get_experiment_by_name(name)
    out[name] = [{
        "params": r.data.params, "status": r.info.status, "metrics": sorted(r.data.metrics),
        "steps": [m.step for m in c.get_metric_history(r.info.run_id, metric)],
    } for r in c.search_runs([e.experiment_id])]
print(json.dumps(out))
"#,
    ))
    .unwrap();
    let lm = seen["transformer"].as_array().unwrap();
    assert_eq!(lm.len(), 1, "one run, the main process's: {seen}");
    assert_eq!(lm[0]["status"], "FINISHED");
    assert_eq!(lm[0]["params"]["accelerate.num_processes"], "2");
    assert_eq!(lm[0]["params"]["steps"], "6");
    assert_eq!(lm[0]["params"]["d_model"], "16");
    assert_eq!(lm[0]["steps"], serde_json::json!([3, 6]));
    let metrics = lm[0]["metrics"].as_array().unwrap();
    for metric in [
        "perf/tokens_per_s",
        "perf/model_flops_per_s",
        "memory/peak_resident_bytes",
        "validation/loss",
    ] {
        assert!(metrics.iter().any(|m| m == metric), "{metric}: {seen}");
    }
    let digits = seen["digits"].as_array().unwrap();
    assert_eq!(digits.len(), 1, "{seen}");
    assert_eq!(digits[0]["status"], "FINISHED");
    assert_eq!(digits[0]["params"]["epochs"], "2");
    assert_eq!(digits[0]["steps"], serde_json::json!([1, 2]));
}
