//! `accelerate-rs launch`: start the workers of a job on this machine and supervise them.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicUsize;

use accelerate_core::config_file::{self, LoadedConfig};
use accelerate_core::env_vars;
use accelerate_core::launch::{LaunchConfig, launch};
use accelerate_core::state::ProcessEnv;
use accelerate_core::{LaunchFlags, MixedPrecision, ShardGroupSize};
use anyhow::{Context, bail};
use clap::Args;

use crate::cargo_build;
use signal_hook::consts::signal::{SIGHUP, SIGINT, SIGTERM};

/// Start worker processes with the process contract set (RANK, WORLD_SIZE, LOCAL_RANK,
/// MASTER_ADDR, MASTER_PORT, a job token, ...), prefix their output with their rank, and stop
/// them all if one fails.
///
/// Each setting comes from, highest first: the flag here, its ACCELERATE_* variable
/// (ACCELERATE_NUM_PROCESSES, ACCELERATE_MIXED_PRECISION, ...), the config file (see
/// `accelerate-rs config`), the default.
///
/// Examples:
///   accelerate-rs launch -n 2 ./target/release/train --epochs 3
///   accelerate-rs launch -n 2 --example digits
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Worker processes on this machine [default: 1].
    #[arg(short = 'n', long)]
    num_processes: Option<usize>,

    /// Machines in the job; each runs `accelerate-rs launch` with its own --machine-rank
    /// [default: 1].
    #[arg(long)]
    num_machines: Option<usize>,

    /// This machine's index, from 0 (the machine of rank 0) [default: 0].
    #[arg(long)]
    machine_rank: Option<usize>,

    /// Address of rank 0's machine, where the rendezvous is served [default: 127.0.0.1].
    #[arg(long)]
    main_process_ip: Option<String>,

    /// Rank 0's rendezvous port; 0 picks a free one (the default on one machine; 29500 on
    /// several, where every machine must name the same port).
    #[arg(long)]
    main_process_port: Option<u16>,

    /// Mixed precision for the workers: no, fp16 or bf16 (passed as
    /// ACCELERATE_MIXED_PRECISION).
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,

    /// ZeRO stage of the workers: 0, 1 (optimizer state sharded), 2 (gradients too) or 3
    /// (the parameters of the units a model shards too) (passed as ACCELERATE_ZERO_STAGE).
    #[arg(long)]
    zero_stage: Option<u8>,

    /// Processes each ZeRO shard is split across: job (default), host (hybrid sharding:
    /// shard within each machine, replicate across machines) or a number that divides the
    /// job's processes (passed as ACCELERATE_SHARD_GROUP_SIZE).
    #[arg(long)]
    shard_group_size: Option<ShardGroupSize>,

    /// Hide every GPU from the workers (CUDA_VISIBLE_DEVICES="").
    #[arg(long, conflicts_with = "gpu_ids")]
    cpu: bool,

    /// GPUs the workers may use, e.g. "0,1" (CUDA_VISIBLE_DEVICES).
    #[arg(long)]
    gpu_ids: Option<String>,

    /// Restart every worker up to this many times after a failure [default: 0].
    #[arg(long)]
    max_restarts: Option<usize>,

    /// Read settings from this config file instead of the default one (`accelerate-rs config`
    /// writes it; Accelerate's `.yaml` files are read too); the workers read it as well.
    #[arg(long, value_name = "FILE")]
    config_file: Option<PathBuf>,

    /// Also write each rank's output to DIR/rank_N.log.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,

    /// Seconds stopped workers get between SIGTERM and SIGKILL.
    #[arg(long, default_value_t = 5.0)]
    grace_period: f64,

    /// Do not show the run's progress (by default the main process's updates, loss, tokens/s
    /// and time left: a bar on a terminal, else a line every ACCELERATE_PROGRESS_EVERY
    /// seconds, default 30).
    #[arg(long)]
    no_progress: bool,

    /// Build this cargo example of the current workspace and launch it.
    #[arg(long, conflicts_with = "bin")]
    example: Option<String>,

    /// Build this cargo binary of the current workspace and launch it.
    #[arg(long)]
    bin: Option<String>,

    /// With --example or --bin: build with --release.
    #[arg(long)]
    release: bool,

    /// With --example or --bin: cargo features to build with.
    #[arg(long)]
    features: Option<String>,

    /// The program and its arguments; with --example or --bin, the arguments only.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM [ARGS]"
    )]
    command: Vec<String>,
}

/// The signal that stops the job (0: none yet), set by the handlers.
static INTERRUPTED: AtomicUsize = AtomicUsize::new(0);

/// Runs the launch; the exit code is the first failing worker's.
pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    let target = |kind, name| cargo_build::Target {
        kind,
        name,
        among: cargo_build::Among::Current,
        release: args.release,
        features: args.features.as_deref(),
    };
    let (program, program_args) = match (&args.example, &args.bin) {
        (Some(name), _) => (
            cargo_build::build(&target("example", name))?,
            args.command.clone(),
        ),
        (_, Some(name)) => (
            cargo_build::build(&target("bin", name))?,
            args.command.clone(),
        ),
        (None, None) => match args.command.split_first() {
            Some((program, rest)) => (PathBuf::from(program), rest.to_vec()),
            None => bail!("nothing to launch: give a program, --example NAME or --bin NAME"),
        },
    };
    let loaded = match &args.config_file {
        Some(path) => Some(config_file::read(path)?),
        None => config_file::discover(&ProcessEnv)?,
    };
    if let Some(note) = loaded.as_ref().and_then(LoadedConfig::ignored_note) {
        eprintln!("note: {note}");
    }
    let flags = LaunchFlags {
        num_processes: args.num_processes,
        num_machines: args.num_machines,
        machine_rank: args.machine_rank,
        main_process_ip: args.main_process_ip,
        main_process_port: args.main_process_port,
        mixed_precision: args.mixed_precision,
        zero_stage: args.zero_stage,
        shard_group_size: args.shard_group_size,
        cpu: args.cpu,
        gpu_ids: args.gpu_ids,
        max_restarts: args.max_restarts,
    };
    let settings = flags.resolve_from(
        &ProcessEnv,
        loaded.as_ref().map(|l| &l.file),
        loaded.as_ref().map(|l| l.path.as_path()),
    )?;
    // The workers read the same file, below their environment.
    let env = vec![(
        env_vars::CONFIG_FILE.to_string(),
        loaded
            .as_ref()
            .map_or("none".to_string(), |l| l.path.display().to_string()),
    )];
    let Some(grace) = accelerate_core::wait::seconds_f64(args.grace_period) else {
        bail!(
            "--grace-period {} is not a number of seconds from 0 to 2592000 (30 days)",
            args.grace_period
        );
    };
    let config = LaunchConfig {
        program,
        args: program_args,
        settings,
        log_dir: args.log_dir,
        env,
        grace,
        progress: !args.no_progress,
    };
    // Ctrl-C, and what `timeout`, systemd, Slurm's scancel, Kubernetes (SIGTERM) and a closed
    // terminal (SIGHUP) send: each stops the workers with the same signal.
    for signal in [SIGINT, SIGTERM, SIGHUP] {
        signal_hook::flag::register_usize(signal, &INTERRUPTED, signal as usize)
            .context("installing the signal handlers")?;
    }
    match launch(&config, &INTERRUPTED) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(1)))
        }
    }
}
