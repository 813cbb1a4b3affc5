//! `accelerate-rs launch`: start the workers of a job on this machine and supervise them.

use std::io::{BufRead, BufReader, IsTerminal};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use accelerate_core::config_file::{self, LoadedConfig};
use accelerate_core::env_vars;
use accelerate_core::launch::{LaunchConfig, launch};
use accelerate_core::settings::ParseSettingError;
use accelerate_core::state::ProcessEnv;
use accelerate_core::{LaunchFlags, MixedPrecision};
use anyhow::{Context, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
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
    #[arg(long, value_parser = parse_precision)]
    mixed_precision: Option<MixedPrecision>,

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
    let flags = LaunchFlags {
        num_processes: args.num_processes,
        num_machines: args.num_machines,
        machine_rank: args.machine_rank,
        main_process_ip: args.main_process_ip,
        main_process_port: args.main_process_port,
        mixed_precision: args.mixed_precision,
        cpu: args.cpu,
        gpu_ids: args.gpu_ids,
        max_restarts: args.max_restarts,
    };
    let settings = flags.resolve(&ProcessEnv, loaded.as_ref().map(|l| &l.file))?;
    // The workers read the same file, below their environment.
    let mut env = vec![(
        env_vars::CONFIG_FILE.to_string(),
        loaded
            .as_ref()
            .map_or("none".to_string(), |l| l.path.display().to_string()),
    )];
    env.extend(settings.worker_env());
    let Some(grace) = accelerate_core::wait::seconds_f64(args.grace_period) else {
        bail!(
            "--grace-period {} is not a number of seconds from 0 to 2592000 (30 days)",
            args.grace_period
        );
    };
    let config = LaunchConfig {
        program,
        args: program_args,
        num_processes: settings.num_processes,
        num_machines: settings.num_machines,
        machine_rank: settings.machine_rank,
        main_process_ip: settings.main_process_ip,
        main_process_port: settings.main_process_port,
        max_restarts: settings.max_restarts,
        log_dir: args.log_dir,
        env,
        grace,
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

/// Builds a cargo example or binary of the workspace in the current directory and returns
/// the path of its executable. Cargo runs quietly (its warnings and errors still show) and
/// its JSON messages drive our own progress line: a spinner on a terminal, else a line every
/// 15 s, so a first build that compiles Burn for minutes never looks stuck.
fn build(kind: &str, name: &str, args: &LaunchArgs) -> anyhow::Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.args([
        "build",
        "--quiet",
        "--message-format=json-render-diagnostics",
    ])
    .arg(format!("--{kind}"))
    .arg(name)
    .stdout(Stdio::piped());
    // Without a package, cargo resolves features over every member of the workspace (benches
    // and their dev-dependencies too), which differ from what `cargo run -p accelerate-cli`
    // resolved, so the first launch compiled Burn a second time (40 crates, 6 minutes here).
    if let Some(package) = package_of(&cargo, kind, name) {
        cmd.args(["--package", &package]);
    }
    if args.release {
        cmd.arg("--release");
    }
    if let Some(features) = &args.features {
        cmd.args(["--features", features]);
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("running `{cargo} build --{kind} {name}`"))?;
    let messages = child
        .stdout
        .take()
        .context("reading cargo's messages (its standard output)")?;
    let mut progress = BuildProgress::new(kind, name);
    let mut executable = None;
    for line in BufReader::new(messages).lines() {
        let line = line.context("reading cargo's messages (its standard output)")?;
        let Ok(message) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        if message["fresh"] == false {
            progress.compiled(message["target"]["name"].as_str().unwrap_or("?"));
        }
        if is_target(&message["target"], kind, name) {
            executable = message["executable"].as_str().map(PathBuf::from);
        }
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for `{cargo} build --{kind} {name}`"))?;
    progress.finish();
    if !status.success() {
        bail!("`cargo build --{kind} {name}` failed (its errors are above)");
    }
    executable.with_context(|| format!("cargo built no executable for the {kind} `{name}`"))
}

/// The workspace package that has the `kind` target `name`, when exactly one has it (else
/// cargo's own search and error messages apply).
fn package_of(cargo: &str, kind: &str, name: &str) -> Option<String> {
    let output = Command::new(cargo)
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
    package_with_target(&metadata, kind, name)
}

/// The one package in cargo's `metadata` with the `kind` target `name`.
fn package_with_target(metadata: &serde_json::Value, kind: &str, name: &str) -> Option<String> {
    let mut owners = metadata["packages"].as_array()?.iter().filter(|package| {
        package["targets"]
            .as_array()
            .is_some_and(|targets| targets.iter().any(|t| is_target(t, kind, name)))
    });
    let owner = owners.next()?;
    if owners.next().is_some() {
        return None;
    }
    owner["name"].as_str().map(str::to_string)
}

/// True when cargo's JSON description of a `target` is the `kind` target `name`.
fn is_target(target: &serde_json::Value, kind: &str, name: &str) -> bool {
    target["name"] == name
        && target["kind"]
            .as_array()
            .is_some_and(|kinds| kinds.iter().any(|k| k == kind))
}

/// What the user sees while cargo builds: a spinner with the crates compiled so far on a
/// terminal, a line every 15 s otherwise, and one line at the end when anything was compiled.
struct BuildProgress {
    what: String,
    bar: Option<ProgressBar>,
    started: Instant,
    last_line: Instant,
    crates: u64,
}

impl BuildProgress {
    fn new(kind: &str, name: &str) -> Self {
        let what = format!("the {kind} `{name}`");
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new_spinner();
            if let Ok(style) = ProgressStyle::with_template(&format!(
                "{{spinner}} building {what}: {{pos}} crates compiled [{{elapsed}}] {{msg}}"
            )) {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        let now = Instant::now();
        Self {
            what,
            bar,
            started: now,
            last_line: now,
            crates: 0,
        }
    }

    fn compiled(&mut self, target: &str) {
        self.crates += 1;
        match &self.bar {
            Some(bar) => {
                bar.inc(1);
                bar.set_message(target.to_string());
            }
            None if self.last_line.elapsed() >= Duration::from_secs(15) => {
                self.last_line = Instant::now();
                eprintln!(
                    "building {}: {} crates compiled in {}s (latest: {target})",
                    self.what,
                    self.crates,
                    self.started.elapsed().as_secs()
                );
            }
            None => {}
        }
    }

    fn finish(self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        if self.crates > 0 {
            eprintln!(
                "built {} ({} crate{} compiled in {}s)",
                self.what,
                self.crates,
                if self.crates == 1 { "" } else { "s" },
                self.started.elapsed().as_secs()
            );
        }
    }
}

/// Reads `--mixed-precision`.
fn parse_precision(value: &str) -> Result<MixedPrecision, ParseSettingError> {
    value
        .parse()
        .map_err(|()| ParseSettingError::new(value, MixedPrecision::EXPECTED))
}

#[cfg(test)]
mod tests {
    use super::package_with_target;

    #[test]
    fn the_package_that_owns_an_example_is_found_and_an_ambiguous_name_is_left_to_cargo() {
        let metadata = serde_json::json!({ "packages": [
            { "name": "accelerate-cli", "targets": [{ "name": "accelerate-rs", "kind": ["bin"] }] },
            { "name": "accelerate-examples", "targets": [
                { "name": "digits", "kind": ["example"] },
                { "name": "accelerate_examples", "kind": ["lib"] },
            ]},
            { "name": "other", "targets": [{ "name": "digits", "kind": ["bin"] }] },
        ]});
        let owner = |kind, name| package_with_target(&metadata, kind, name);
        assert_eq!(
            owner("example", "digits").as_deref(),
            Some("accelerate-examples")
        );
        assert_eq!(owner("bin", "digits").as_deref(), Some("other"));
        assert_eq!(owner("example", "absent"), None);
        let twice = serde_json::json!({ "packages": [
            { "name": "a", "targets": [{ "name": "x", "kind": ["example"] }] },
            { "name": "b", "targets": [{ "name": "x", "kind": ["example"] }] },
        ]});
        assert_eq!(package_with_target(&twice, "example", "x"), None);
    }
}
