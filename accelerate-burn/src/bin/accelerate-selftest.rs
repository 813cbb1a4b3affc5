//! `accelerate-selftest`: one process of `accelerate-rs test`, which starts it on every process
//! of its check with the launcher's variables set; with `--report`, the lines of
//! `accelerate-rs env` that need Burn (its version, the backends compiled in, the device).
//!
//! It lives here, not in the CLI, so that installing the launcher does not compile Burn. A
//! user's project builds it with its own features (`accelerate-rs test` runs `cargo build -p
//! accelerate-burn --bin accelerate-selftest` there); `cargo install accelerate-burn` installs
//! it beside `accelerate-rs`.

use std::process::ExitCode;

/// How to run this program, printed for an unknown argument.
const USAGE: &str = "usage: accelerate-selftest [--report]
  (no argument)  one process of `accelerate-rs test`: run every check on this rank
  --report       print this build's Burn version, backends and device, for `accelerate-rs env`";

#[cfg(any(
    feature = "flex",
    feature = "ndarray",
    feature = "wgpu-backend",
    feature = "cuda-backend"
))]
fn main() -> ExitCode {
    use accelerate_burn::DefaultBackend;
    use accelerate_burn::selftest::report::build_report;

    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] => check::<DefaultBackend>(),
        ["--report"] => {
            print!("{}", build_report::<DefaultBackend>());
            ExitCode::SUCCESS
        }
        ["--version"] => {
            println!("accelerate-selftest {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// One process of the check: runs every check, prints each outcome (the main process prints
/// the passes, every process its failures), and fails if any check failed on this process.
#[cfg(any(
    feature = "flex",
    feature = "ndarray",
    feature = "wgpu-backend",
    feature = "cuda-backend"
))]
fn check<B: accelerate_burn::AcceleratorBackend>() -> ExitCode {
    use accelerate_burn::Accelerator;
    use accelerate_burn::selftest::run_checks;

    let acc = match Accelerator::<B>::from_env() {
        Ok(acc) => acc,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    acc.print(format!(
        "backend {} on {} process(es), device {:?}",
        acc.backend_name(),
        acc.num_processes(),
        acc.device()
    ));
    let checks = match run_checks(&acc) {
        Ok(checks) => checks,
        Err(e) => {
            eprintln!("error: rank {}: {e}", acc.process_index());
            return ExitCode::FAILURE;
        }
    };
    let mut failed = false;
    for check in checks {
        match check.result {
            Ok(summary) => acc.print(format!("ok    {}: {summary}", check.name)),
            Err(detail) => {
                failed = true;
                println!("FAIL  {}: {detail}", check.name);
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(not(any(
    feature = "flex",
    feature = "ndarray",
    feature = "wgpu-backend",
    feature = "cuda-backend"
)))]
fn main() -> ExitCode {
    eprintln!(
        "accelerate-selftest was built without a backend: build accelerate-burn with one of the \
         features flex, ndarray, wgpu, cuda\n{USAGE}"
    );
    ExitCode::FAILURE
}
