//! `accelerate`: the command-line companion of accelerate-rs.
//!
//! Subcommands live one per file in `commands/`; each parses its arguments with clap and calls
//! into `accelerate-core` or `accelerate-burn`, where the logic lives.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod commands;

/// Run one Burn training loop on a CPU, a GPU, or many processes.
#[derive(Debug, Parser)]
#[command(name = "accelerate", version, about)]
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
    /// Start the worker processes of a training job and supervise them.
    Launch(Box<commands::launch::LaunchArgs>),
    /// Check that distributed training works on this machine.
    Test(commands::test::TestArgs),
    /// One process of `accelerate test` (started by it).
    #[command(name = "test-worker", hide = true)]
    TestWorker,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Config(args) => commands::config::run(args),
        Command::Env(args) => commands::env::run(args),
        Command::Launch(args) => commands::launch::run(*args),
        Command::Test(args) => commands::test::run(args),
        Command::TestWorker => commands::test::worker(),
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
