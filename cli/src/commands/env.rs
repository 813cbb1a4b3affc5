//! `accelerate env`: what a bug report needs to know about this machine and process.

use std::fmt::Write as _;
use std::process::ExitCode;

use accelerate_core::ProcessState;
use clap::Args;

/// Variables that launchers set and that decide a process's place in a job.
const LAUNCHER_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "CUDA_VISIBLE_DEVICES",
];

/// Arguments of `accelerate env` (none yet).
#[derive(Debug, Args)]
pub struct EnvArgs {}

/// Prints the report on stdout.
pub fn run(_args: EnvArgs) -> anyhow::Result<ExitCode> {
    let vars: Vec<(String, String)> = std::env::vars().collect();
    print!("{}", report(&vars));
    Ok(ExitCode::SUCCESS)
}

/// The report for an environment given as `vars`. Secrets (the job token) are redacted.
fn report(vars: &[(String, String)]) -> String {
    let mut out = String::new();
    let lookup = |key: &str| vars.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    let _ = writeln!(out, "accelerate-rs version: {}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(
        out,
        "platform: {} {} ({} cpus)",
        std::env::consts::OS,
        std::env::consts::ARCH,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    match ProcessState::from_source(&pairs[..]) {
        Ok(state) => {
            let _ = writeln!(out, "process: {state}");
        }
        Err(err) => {
            let _ = writeln!(out, "process: invalid launcher environment: {err}");
        }
    }
    let _ = writeln!(out, "launcher variables:");
    let mut any = false;
    for key in LAUNCHER_VARS {
        if let Some(value) = lookup(key) {
            let _ = writeln!(out, "  {key}={value}");
            any = true;
        }
    }
    if !any {
        let _ = writeln!(out, "  (none: a single process)");
    }
    let _ = writeln!(out, "ACCELERATE_* variables:");
    let mut accelerate: Vec<_> = vars
        .iter()
        .filter(|(k, _)| k.starts_with("ACCELERATE_"))
        .collect();
    accelerate.sort();
    if accelerate.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for (key, value) in accelerate {
        let shown = if key.contains("TOKEN") {
            "<redacted>"
        } else {
            value
        };
        let _ = writeln!(out, "  {key}={shown}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn report_shows_state_and_redacts_the_token() {
        let r = report(&vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("ACCELERATE_JOB_TOKEN", "s3cret"),
            ("ACCELERATE_SEED", "3"),
        ]));
        assert!(r.contains("process: rank 1 of 2"), "{r}");
        assert!(r.contains("ACCELERATE_JOB_TOKEN=<redacted>"), "{r}");
        assert!(!r.contains("s3cret"));
        assert!(r.contains("ACCELERATE_SEED=3"));
    }

    #[test]
    fn report_names_a_broken_environment() {
        let r = report(&vars(&[("RANK", "0")]));
        assert!(
            r.contains("invalid launcher environment: WORLD_SIZE"),
            "{r}"
        );
        let single = report(&[]);
        assert!(single.contains("rank 0 of 1"));
        assert!(single.contains("(none: a single process)"));
    }
}
