//! Slurm for real: a single-node cluster (munged, slurmctld, slurmd from Debian's packages,
//! started by `scripts/slurm-cluster.sh` in a directory of its own and stopped on drop, also when
//! a test fails) runs the digits example under `srun`, an `sbatch` script that uses
//! `accelerate-rs launch`, and a job that `scancel` ends. Needs root and the packages; skipped
//! with a message without them, except in CI, which installs them.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[path = "../../tests-support/built_example.rs"]
mod built_example;
#[path = "../../tests-support/slurm.rs"]
mod slurm_cluster;
#[path = "../../tests-support/tools.rs"]
mod tools;

use slurm_cluster::SlurmCluster;

/// One cluster at a time: the tests share the machine's 2 CPUs.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A single-node cluster, or `None` (skipped) without root and Slurm.
fn cluster() -> Option<SlurmCluster> {
    tools::slurm_ready().then(|| SlurmCluster::start(2, &[]))
}

/// The digits example, built beside this test by `cargo test --workspace`.
fn digits() -> PathBuf {
    built_example::built_example("digits")
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The accuracy in the example's last line: "test accuracy: 97.22 % (...)".
fn accuracy(log: &str) -> f64 {
    log.lines()
        .find_map(|l| l.split("test accuracy: ").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in:\n{log}"))
}

/// Processes whose command line contains `needle`, but not this test's.
fn processes_with(needle: &str) -> Vec<String> {
    let out = Command::new("pgrep")
        .args(["-af", needle])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.contains("pgrep"))
        .map(str::to_string)
        .collect()
}

#[test]
fn srun_trains_digits_with_ranks_from_slurms_own_environment() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(cluster) = cluster() else {
        return;
    };
    let out = cluster
        .run(&["srun", "-n", "2", "--time", "5"])
        .arg(digits())
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    // Printed by the main process only; the two ranks trained as one job.
    assert_eq!(log.matches("test accuracy").count(), 1, "{log}");
    assert!(accuracy(&log) >= 95.0, "{log}");
}

#[test]
fn an_sbatch_script_that_uses_accelerate_launch_works() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(cluster) = cluster() else {
        return;
    };
    let script = cluster.path("train.sbatch");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n#SBATCH --ntasks=1\n#SBATCH --cpus-per-task=2\n#SBATCH --time=5\n\
             exec {} launch -n 2 {}\n",
            env!("CARGO_BIN_EXE_accelerate-rs"),
            digits().display()
        ),
    )
    .unwrap();
    let log_file = cluster.path("train.log");
    let out = cluster
        .run(&["sbatch", "--wait", "--output"])
        .arg(&log_file)
        .arg(&script)
        .output()
        .unwrap();
    let log = std::fs::read_to_string(&log_file).unwrap_or_default();
    assert!(out.status.success(), "{}\n{log}", text(&out));
    assert_eq!(log.matches("test accuracy").count(), 1, "{log}");
    assert!(accuracy(&log) >= 95.0, "{log}");
}

#[test]
fn scancel_stops_every_worker_and_leaves_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(cluster) = cluster() else {
        return;
    };
    // A job that would run for minutes: digits for many epochs, two workers under our launcher.
    let marker = cluster.path("long-project");
    let script = cluster.path("long.sbatch");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n#SBATCH --ntasks=1\n#SBATCH --cpus-per-task=2\n\
             exec {} launch -n 2 {} --epochs 100000 --project-dir {}\n",
            env!("CARGO_BIN_EXE_accelerate-rs"),
            digits().display(),
            marker.display()
        ),
    )
    .unwrap();
    let out = cluster
        .run(&["sbatch"])
        .arg("--parsable")
        .arg(&script)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let job = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let needle = marker.display().to_string();
    // Both workers and the launcher running (three command lines name the project).
    let deadline = Instant::now() + Duration::from_secs(60);
    while processes_with(&needle).len() < 3 {
        assert!(
            Instant::now() < deadline,
            "the job never started: {:?}",
            processes_with(&needle)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let cancelled = Instant::now();
    let out = cluster.run(&["scancel"]).arg(&job).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !processes_with(&needle).is_empty() {
        assert!(
            Instant::now() < deadline,
            "still running 30 s after scancel: {:?}",
            processes_with(&needle)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "every process gone {:.1} s after scancel",
        cancelled.elapsed().as_secs_f64()
    );
}
