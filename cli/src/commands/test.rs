//! `accelerate-rs test`: launch the built-in checks on N processes of this machine and say
//! whether the job works here (collectives, data order, training steps). Each process runs
//! `accelerate-selftest` (see `crate::selftest` for where it comes from).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicUsize;

use accelerate_core::LaunchSettings;
use accelerate_core::config_file;
use accelerate_core::launch::{LaunchConfig, launch};
use accelerate_core::setting_table::{self, GivenBy, Resolver};
use accelerate_core::state::ProcessEnv;
use clap::Args;

use crate::selftest;

/// Check that distributed training works on this machine: start N processes of the built-in
/// check (collectives against local references, the same data order on every rank, a few
/// training steps equal across ranks) and print pass or fail with details.
///
/// The check is `accelerate-selftest`, a binary of accelerate-burn: the one beside this
/// executable or on PATH, else built in the cargo project of the current directory with its
/// features (so the backend checked is the project's).
#[derive(Debug, Args)]
pub struct TestArgs {
    /// Processes to check with [default: ACCELERATE_NUM_PROCESSES, else the config file's
    /// num_processes, else 2].
    #[arg(short = 'n', long)]
    num_processes: Option<usize>,

    /// The `accelerate-selftest` executable to run instead of searching for one.
    #[arg(long, value_name = "PATH")]
    worker: Option<PathBuf>,
}

/// Launches the check and reports.
pub fn run(args: TestArgs) -> anyhow::Result<ExitCode> {
    let loaded = config_file::discover(&ProcessEnv)?;
    let settings = Resolver::new(
        &ProcessEnv,
        GivenBy::Flag,
        loaded.as_ref().map(|l| l.path.as_path()),
    );
    // Two processes by default: the smallest job that checks communication.
    let num_processes = settings.get_or(
        &setting_table::NUM_PROCESSES,
        args.num_processes,
        loaded.as_ref().and_then(|l| l.file.num_processes),
        2,
    )?;
    let program = selftest::locate(args.worker)?;
    let config = LaunchConfig {
        program: program.clone(),
        settings: LaunchSettings {
            num_processes,
            ..LaunchSettings::default()
        },
        // The check logs no progress.
        progress: false,
        ..LaunchConfig::default()
    };
    println!(
        "accelerate-rs test: checking {num_processes} process(es) on this machine with {}",
        program.display()
    );
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
