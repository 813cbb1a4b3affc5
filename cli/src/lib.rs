//! The command line of accelerate-rs: `accelerate-rs config`, `launch`, `env`, `test` and
//! `estimate-memory`, also reachable as `cargo accelerate ...`.
//!
//! The binary is named `accelerate-rs`, not `accelerate`, so that it never hides (or is
//! hidden by) Hugging Face Accelerate's `accelerate`, which most users of ours also have on
//! their `PATH`. `cargo install accelerate-cli` installs both `accelerate-rs` and
//! `cargo-accelerate`; the second makes the commands cargo subcommands. Both binaries are one
//! line over [`run`], which parses the arguments with clap and calls into `accelerate-core`,
//! where the logic lives; subcommands live one per file in `commands/`. The command does not
//! link Burn: what needs it (the training checks of `test`, the backend lines of `env`) runs
//! in `accelerate-selftest`, a binary of `accelerate-burn` built with the project's features.
//!
//! ```
//! use std::process::ExitCode;
//! use accelerate_cli::{Invocation, run};
//!
//! // What `accelerate-rs env` prints for a bug report: versions, backends, configuration.
//! assert_eq!(run(Invocation::Standalone, ["accelerate-rs", "env"]), ExitCode::SUCCESS);
//! // Cargo runs `cargo accelerate env` as `cargo-accelerate accelerate env`.
//! let as_cargo = ["cargo-accelerate", "accelerate", "env"];
//! assert_eq!(run(Invocation::CargoSubcommand, as_cargo), ExitCode::SUCCESS);
//! // A usage error is clap's exit code 2, with clap's message on stderr.
//! assert_eq!(run(Invocation::Standalone, ["accelerate-rs", "lunch"]), ExitCode::from(2));
//! ```

#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod cargo_build;
mod commands;
mod selftest;

/// The name users type for the standalone binary.
pub const BINARY: &str = "accelerate-rs";

/// How the command was started, which decides how its arguments begin and how help names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invocation {
    /// As `accelerate-rs ARGS`.
    Standalone,
    /// As `cargo accelerate ARGS`: cargo runs `cargo-accelerate accelerate ARGS`.
    CargoSubcommand,
}

/// Run one Burn training loop on a CPU, a GPU, or many processes.
#[derive(Debug, Parser)]
#[command(name = BINARY, version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write the config file that `launch` and `Accelerator::from_env` read.
    Config(commands::config::ConfigArgs),
    /// Print versions, backends, devices, the active config and the launcher environment,
    /// for bug reports.
    Env(commands::env::EnvArgs),
    /// Estimate what each process holds to train a model with a fused optimizer, at each
    /// ZeRO stage.
    EstimateMemory(commands::estimate_memory::EstimateMemoryArgs),
    /// Start the worker processes of a training job and supervise them.
    Launch(Box<commands::launch::LaunchArgs>),
    /// Consolidate a sharded model (model.safetensors.index.json and its shards) into one
    /// model.safetensors.
    MergeWeights(commands::merge_weights::MergeWeightsArgs),
    /// Check that distributed training works on this machine.
    Test(commands::test::TestArgs),
}

/// Shows the libraries' warnings (a restarted job, a fallback) on stderr, one plain line each;
/// `RUST_LOG` asks for more (or less). A program that set its own subscriber keeps it.
fn show_warnings() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .with_level(false)
        .try_init();
}

/// Runs the command line `args` (the program's name first, as [`std::env::args_os`] gives
/// them) and returns the exit code for the process: 0 on success, 2 for a usage error, the
/// failed worker's code from `launch`, 1 for any other error, whose causes are printed to
/// stderr one per line.
pub fn run<I, T>(invocation: Invocation, args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    let mut args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let mut command = Cli::command();
    if invocation == Invocation::CargoSubcommand {
        if args.get(1).is_some_and(|a| a == "accelerate") {
            args.remove(1);
        }
        command = command.bin_name("cargo accelerate");
    }
    let cli = match command
        .try_get_matches_from(args)
        .and_then(|matches| Cli::from_arg_matches(&matches))
    {
        Ok(cli) => cli,
        Err(err) => {
            // Help and version go to stdout with code 0, usage errors to stderr with code 2.
            let _ = err.print();
            return ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(2));
        }
    };
    show_warnings();
    let result = match cli.command {
        Command::Config(args) => commands::config::run(args),
        Command::Env(args) => commands::env::run(args),
        Command::EstimateMemory(args) => commands::estimate_memory::run(args),
        Command::Launch(args) => commands::launch::run(*args),
        Command::MergeWeights(args) => commands::merge_weights::run(args),
        Command::Test(args) => commands::test::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  Caused by: {cause}");
            }
            ExitCode::from(1)
        }
    }
}
