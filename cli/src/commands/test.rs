//! `accelerate-rs test`: launch the built-in checks on N processes of this machine and say
//! whether the job works here (collectives, data order, training steps).

use std::process::ExitCode;
use std::sync::atomic::AtomicUsize;

use accelerate_burn::selftest::run_checks;
use accelerate_burn::{Accelerator, DefaultBackend};
use accelerate_core::config_file;
use accelerate_core::launch::{LaunchConfig, launch};
use accelerate_core::state::ProcessEnv;
use anyhow::Context;
use clap::Args;

/// Check that distributed training works on this machine: start N processes of the built-in
/// check (collectives against local references, the same data order on every rank, a few
/// training steps equal across ranks) and print pass or fail with details.
#[derive(Debug, Args)]
pub struct TestArgs {
    /// Processes to check with [default: the config file's num_processes, else 2].
    #[arg(short = 'n', long)]
    num_processes: Option<usize>,
}

/// The hidden subcommand each process of the check runs.
pub const WORKER: &str = "test-worker";

/// Launches the check and reports.
pub fn run(args: TestArgs) -> anyhow::Result<ExitCode> {
    let file = config_file::discover(&ProcessEnv)?.map(|l| l.file);
    let num_processes = args
        .num_processes
        .or(file.and_then(|f| f.num_processes))
        .unwrap_or(2);
    let program = std::env::current_exe().context("finding the accelerate-rs executable")?;
    let config = LaunchConfig {
        program,
        args: vec![WORKER.to_string()],
        num_processes,
        main_process_port: 0,
        ..LaunchConfig::default()
    };
    println!("accelerate-rs test: checking {num_processes} process(es) on this machine");
    match launch(&config, &AtomicUsize::new(0)) {
        Ok(()) => {
            println!("accelerate-rs test: PASS");
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            println!("accelerate-rs test: FAIL ({e})");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// One process of the check: runs every check, prints each outcome (the main process prints
/// the passes, every process its failures), and fails if any check failed on this process.
pub fn worker() -> anyhow::Result<ExitCode> {
    let acc = Accelerator::<DefaultBackend>::from_env()?;
    acc.print(format!(
        "backend {} on {} process(es), device {:?}",
        acc.backend_name(),
        acc.num_processes(),
        acc.device()
    ));
    let mut failed = false;
    for check in run_checks(&acc)? {
        match check.result {
            Ok(summary) => acc.print(format!("ok    {}: {summary}", check.name)),
            Err(detail) => {
                failed = true;
                println!("FAIL  {}: {detail}", check.name);
            }
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
