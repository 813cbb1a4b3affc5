//! `accelerate-rs env`: what a bug report needs to know about this machine and process.

use std::fmt::Write as _;
use std::process::ExitCode;

use accelerate_core::config_file::{self, ConfigFormat};
use accelerate_core::state::ProcessEnv;
use accelerate_core::{ConfigOverrides, ProcessState};
use clap::Args;

use crate::selftest;

/// Variables that launchers set and that decide a process's place in a job.
const LAUNCHER_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "CUDA_VISIBLE_DEVICES",
];

/// Arguments of `accelerate-rs env` (none yet).
#[derive(Debug, Args)]
pub struct EnvArgs {}

/// Prints the report on stdout.
pub fn run(_args: EnvArgs) -> anyhow::Result<ExitCode> {
    let vars: Vec<(String, String)> = std::env::vars().collect();
    print!("{}", report(&vars));
    println!("{}", cpu_kernels());
    print!("{}", backends());
    print!("{}", configuration());
    Ok(ExitCode::SUCCESS)
}

/// The instruction sets the CPU kernels use here and the path bf16 products take.
fn cpu_kernels() -> String {
    use accelerate_kernels::bf16_matmul::Bf16Path;
    use accelerate_kernels::isa;
    let (detected, current) = (isa::detected(), isa::current());
    let capped = if current == detected {
        String::new()
    } else {
        format!(", capped to {} by ACCELERATE_CPU_ISA", current.name())
    };
    let path = match Bf16Path::detect() {
        Bf16Path::Amx => "AMX tiles on bf16 pairs (AMX-BF16)",
        Bf16Path::Avx512Bf16 => "vdpbf16ps on bf16 pairs (AVX512_BF16)",
        Bf16Path::Avx512 => "AVX-512 FMAs on operands widened as they are packed",
        Bf16Path::Avx2 => "AVX2 FMAs on operands widened as they are packed",
        Bf16Path::Widened => "widened to f32, then the f32 product",
    };
    format!(
        "CPU kernels: {}{capped}; bf16 products: {path}",
        detected.name()
    )
}

/// What a build with Burn finds here (from `accelerate-selftest --report`), then the libnccl
/// a worker would load.
fn backends() -> String {
    format!("{}{}\n", selftest::report(), nccl_line(&ProcessEnv))
}

/// The libnccl a worker here would load (version, file, why there); whether a build uses it
/// is in the worker's report.
fn nccl_line(env: &(impl accelerate_core::state::EnvSource + ?Sized)) -> String {
    match accelerate_core::nccl::NcclLibrary::find(env) {
        Ok(library) => format!(
            "NCCL: {} at {} (found through {})",
            library.version(),
            library.path().display(),
            library.origin()
        ),
        Err(e) => {
            let tried = match &e {
                accelerate_core::nccl::NcclError::NotFound { tried } => tried.len(),
                _ => 0,
            };
            format!(
                "NCCL: not found (tried {tried} place{}; pip install nvidia-nccl-cu12, or \
                 ACCELERATE_NCCL_LIBRARY=/path/to/libnccl.so.2)",
                if tried == 1 { "" } else { "s" }
            )
        }
    }
}

/// The config file in effect and the configuration a process would resolve here.
fn configuration() -> String {
    let mut out = String::new();
    match config_file::discover(&ProcessEnv) {
        Ok(None) => {
            let ours = config_file::default_path(&ProcessEnv)
                .map_or("(HOME is not set)".into(), |p| p.display().to_string());
            let _ = writeln!(
                out,
                "config file: none (`accelerate-rs config` writes {ours})"
            );
        }
        Ok(Some(loaded)) => {
            let format = match loaded.format {
                ConfigFormat::Toml => "accelerate-rs",
                ConfigFormat::AccelerateYaml => "Hugging Face Accelerate YAML",
            };
            let _ = writeln!(out, "config file: {} ({format})", loaded.path.display());
            let _ = writeln!(out, "  {:?}", loaded.file);
            if let Some(note) = loaded.ignored_note() {
                let _ = writeln!(out, "  {note}");
            }
        }
        Err(e) => {
            let _ = writeln!(out, "config file: {e}");
        }
    }
    match ConfigOverrides::default().resolve() {
        Ok(config) => {
            let _ = writeln!(out, "resolved configuration: {config:?}");
        }
        Err(e) => {
            let _ = writeln!(out, "resolved configuration: invalid: {e}");
        }
    }
    out
}

/// The report for an environment given as `vars`. Secrets (the job token) are redacted.
fn report(vars: &[(String, String)]) -> String {
    let mut out = String::new();
    let lookup = |key: &str| vars.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    let _ = writeln!(out, "accelerate-rs version: {}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(
        out,
        "platform: {} {} ({} cpus)",
        std::env::consts::OS,
        std::env::consts::ARCH,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    match ProcessState::from_source(&pairs[..]) {
        Ok(state) => {
            let _ = writeln!(out, "process: {state}");
        }
        Err(err) => {
            let _ = writeln!(out, "process: invalid launcher environment: {err}");
        }
    }
    let _ = writeln!(out, "launcher variables:");
    let mut any = false;
    for key in LAUNCHER_VARS {
        if let Some(value) = lookup(key) {
            let _ = writeln!(out, "  {key}={value}");
            any = true;
        }
    }
    if !any {
        let _ = writeln!(out, "  (none: a single process)");
    }
    let _ = writeln!(out, "ACCELERATE_* variables:");
    let mut accelerate: Vec<_> = vars
        .iter()
        .filter(|(k, _)| k.starts_with("ACCELERATE_"))
        .collect();
    accelerate.sort();
    if accelerate.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for (key, value) in accelerate {
        let shown = if key.contains("TOKEN") {
            "<redacted>"
        } else {
            value
        };
        let _ = writeln!(out, "  {key}={shown}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn report_shows_state_and_redacts_the_token() {
        let r = report(&vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("ACCELERATE_JOB_TOKEN", "s3cret"),
            ("ACCELERATE_SEED", "3"),
        ]));
        assert!(r.contains("process: rank 1 of 2"), "{r}");
        assert!(r.contains("ACCELERATE_JOB_TOKEN=<redacted>"), "{r}");
        assert!(!r.contains("s3cret"));
        assert!(r.contains("ACCELERATE_SEED=3"));
    }

    #[test]
    fn the_runtime_sections_name_the_worker_report_and_configuration() {
        let b = backends();
        assert!(
            b.contains("burn: unknown: no `accelerate-selftest`")
                || b.contains("backend report of"),
            "{b}"
        );
        assert!(b.contains("NCCL: "), "{b}");
        assert!(configuration().contains("resolved configuration"));
    }

    #[test]
    fn the_nccl_line_says_what_was_found_or_how_to_get_it() {
        let missing = [("ACCELERATE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")];
        let line = nccl_line(&missing[..]);
        assert!(
            line.starts_with("NCCL: not found (tried 1 place;"),
            "{line}"
        );
        assert!(line.contains("nvidia-nccl-cu12"), "{line}");
    }

    #[test]
    fn report_names_a_broken_environment() {
        let r = report(&vars(&[("RANK", "0")]));
        assert!(
            r.contains("invalid launcher environment: WORLD_SIZE"),
            "{r}"
        );
        let single = report(&[]);
        assert!(single.contains("rank 0 of 1"));
        assert!(single.contains("(none: a single process)"));
    }
}
