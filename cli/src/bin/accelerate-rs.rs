//! `accelerate-rs`: configure, launch, check and inspect accelerate-rs training jobs.

use std::process::ExitCode;

fn main() -> ExitCode {
    accelerate_cli::run(accelerate_cli::Invocation::Standalone, std::env::args_os())
}
