//! `accelerate launch`: start the workers of a job on this machine and supervise them.

use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use accelerate_core::config_file::{self, ENV_CONFIG_FILE, LoadedConfig};
use accelerate_core::launch::{LaunchConfig, launch};
use accelerate_core::state::{EnvSource, ProcessEnv};
use anyhow::{Context, bail};
use clap::Args;

/// Start worker processes with the process contract set (RANK, WORLD_SIZE, LOCAL_RANK,
/// MASTER_ADDR, MASTER_PORT, a job token, ...), prefix their output with their rank, and stop
/// them all if one fails.
///
/// Each setting comes from, highest first: the flag here, its ACCELERATE_* variable
/// (ACCELERATE_NUM_PROCESSES, ACCELERATE_MIXED_PRECISION, ...), the config file (see
/// `accelerate config`), the default.
///
/// Examples:
///   accelerate launch -n 2 ./target/release/train --epochs 3
///   accelerate launch -n 2 --example digits
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Worker processes on this machine [default: 1].
    #[arg(short = 'n', long)]
    num_processes: Option<usize>,

    /// Machines in the job; each runs `accelerate launch` with its own --machine-rank
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

    /// Mixed precision for the workers (passed as ACCELERATE_MIXED_PRECISION).
    #[arg(long, value_parser = ["no", "fp16", "bf16"])]
    mixed_precision: Option<String>,

    /// Hide every GPU from the workers (CUDA_VISIBLE_DEVICES="").
    #[arg(long, conflicts_with = "gpu_ids")]
    cpu: bool,

    /// GPUs the workers may use, e.g. "0,1" (CUDA_VISIBLE_DEVICES).
    #[arg(long)]
    gpu_ids: Option<String>,

    /// Restart every worker up to this many times after a failure [default: 0].
    #[arg(long)]
    max_restarts: Option<usize>,

    /// Read settings from this config file instead of the default one (`accelerate config`
    /// writes it; Accelerate's `.yaml` files are read too); the workers read it as well.
    #[arg(long, value_name = "FILE")]
    config_file: Option<PathBuf>,

    /// Also write each rank's output to DIR/rank_N.log.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,

    /// Seconds stopped workers get between SIGTERM and SIGKILL.
    #[arg(long, default_value_t = 5.0)]
    grace_period: f64,

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

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Runs the launch; the exit code is the first failing worker's.
pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    let (program, program_args) = match (&args.example, &args.bin) {
        (Some(name), _) => (build("example", name, &args)?, args.command.clone()),
        (_, Some(name)) => (build("bin", name, &args)?, args.command.clone()),
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
    let file = loaded.as_ref().map(|l| l.file.clone()).unwrap_or_default();
    let from_env = |key: &str| -> anyhow::Result<Option<usize>> {
        ProcessEnv
            .var(key)
            .map(|v| {
                v.trim()
                    .parse::<usize>()
                    .with_context(|| format!("{key} = {v:?}: expected a non-negative integer"))
            })
            .transpose()
    };
    let num_machines = args
        .num_machines
        .or(from_env("ACCELERATE_NUM_MACHINES")?)
        .or(file.num_machines)
        .unwrap_or(1);
    // The workers read the same file, below their environment.
    let mut env = vec![(
        ENV_CONFIG_FILE.to_string(),
        loaded
            .as_ref()
            .map_or("none".to_string(), |l| l.path.display().to_string()),
    )];
    if let Some(mp) = args.mixed_precision {
        env.push(("ACCELERATE_MIXED_PRECISION".to_string(), mp));
    }
    let gpu_ids = args
        .gpu_ids
        .or(ProcessEnv.var("ACCELERATE_GPU_IDS"))
        .or(file.gpu_ids);
    let use_cpu = match ProcessEnv.var("ACCELERATE_USE_CPU") {
        Some(v) => matches!(v.trim(), "1" | "true" | "yes"),
        None => file.use_cpu == Some(true),
    };
    let cpu = args.cpu || (gpu_ids.is_none() && use_cpu);
    if cpu {
        env.push(("CUDA_VISIBLE_DEVICES".to_string(), String::new()));
        env.push(("ACCELERATE_USE_CPU".to_string(), "1".to_string()));
    } else if let Some(ids) = gpu_ids {
        env.push(("CUDA_VISIBLE_DEVICES".to_string(), ids));
    }
    let port = match args.main_process_port {
        Some(port) => Some(port),
        None => from_env("ACCELERATE_MAIN_PROCESS_PORT")?
            .map(|p| u16::try_from(p).context("ACCELERATE_MAIN_PROCESS_PORT: not a port"))
            .transpose()?,
    }
    .or(file.main_process_port)
    .unwrap_or(if num_machines == 1 { 0 } else { 29500 });
    if !(args.grace_period.is_finite() && args.grace_period >= 0.0) {
        bail!(
            "--grace-period {} is not a number of seconds",
            args.grace_period
        );
    }
    let config = LaunchConfig {
        program,
        args: program_args,
        num_processes: args
            .num_processes
            .or(from_env("ACCELERATE_NUM_PROCESSES")?)
            .or(file.num_processes)
            .unwrap_or(1),
        num_machines,
        machine_rank: args
            .machine_rank
            .or(from_env("ACCELERATE_MACHINE_RANK")?)
            .or(file.machine_rank)
            .unwrap_or(0),
        main_process_ip: args
            .main_process_ip
            .or(ProcessEnv.var("ACCELERATE_MAIN_PROCESS_IP"))
            .or(file.main_process_ip)
            .unwrap_or_else(|| "127.0.0.1".into()),
        main_process_port: port,
        max_restarts: args
            .max_restarts
            .or(from_env("ACCELERATE_MAX_RESTARTS")?)
            .or(file.max_restarts)
            .unwrap_or(0),
        log_dir: args.log_dir,
        env,
        grace: Duration::from_secs_f64(args.grace_period),
    };
    ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::Relaxed))
        .context("installing the Ctrl-C handler")?;
    match launch(&config, &INTERRUPTED) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(1)))
        }
    }
}

/// Builds a cargo example or binary of the workspace in the current directory and returns
/// the path of its executable.
fn build(kind: &str, name: &str, args: &LaunchArgs) -> anyhow::Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.args(["build", "--message-format=json-render-diagnostics"])
        .arg(format!("--{kind}"))
        .arg(name)
        .stdout(Stdio::piped());
    if args.release {
        cmd.arg("--release");
    }
    if let Some(features) = &args.features {
        cmd.args(["--features", features]);
    }
    let output = cmd
        .output()
        .with_context(|| format!("running `{cargo} build --{kind} {name}`"))?;
    if !output.status.success() {
        bail!("`cargo build --{kind} {name}` failed (its errors are above)");
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .filter(|m| {
            m["target"]["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|k| k == kind))
        })
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .with_context(|| format!("cargo built no executable for the {kind} `{name}`"))
}
