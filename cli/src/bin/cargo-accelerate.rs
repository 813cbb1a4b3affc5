//! `cargo accelerate`: the `accelerate-rs` commands as a cargo subcommand.

use std::process::ExitCode;

fn main() -> ExitCode {
    accelerate_cli::run(
        accelerate_cli::Invocation::CargoSubcommand,
        std::env::args_os(),
    )
}
