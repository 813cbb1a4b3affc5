//! What only a build with Burn can tell about this machine: the lines `accelerate-selftest
//! --report` prints into `accelerate-rs env` (the CLI itself does not link Burn).

use std::fmt::Write as _;

use crate::backend::{AcceleratorBackend, enabled_backends, fusion};

/// The Burn release this build links. Our manifests accept any 0.22.x, so it is read from
/// Burn itself: the version burn-store writes into every file it saves (Burn's crates are
/// released together, under one version).
pub fn burn_version() -> String {
    burn::store::SafetensorsStore::default_metadata()
        .remove("version")
        .unwrap_or_else(|| "unknown".to_string())
}

/// The report of a build whose default backend is `B`, one `name: value` line each: Burn's
/// version, the backends compiled in, the device of local rank 0 and its float dtypes, whether
/// this build averages gradients with NCCL, and whether it has the MPI engine.
pub fn build_report<B: AcceleratorBackend>() -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "accelerate-burn version: {}",
        env!("CARGO_PKG_VERSION")
    );
    let _ = writeln!(out, "burn version: {}", burn_version());
    let _ = writeln!(
        out,
        "backends compiled in: {} (default: {})",
        enabled_backends().join(", "),
        B::NAME
    );
    match B::device(0) {
        Ok(device) => {
            let dtypes: Vec<String> = B::float_dtypes(&device)
                .iter()
                .map(|d| format!("{d:?}"))
                .collect();
            let _ = writeln!(
                out,
                "device of local rank 0: {device:?} (float dtypes: {})",
                dtypes.join(", ")
            );
        }
        Err(e) => {
            let _ = writeln!(out, "device of local rank 0: unavailable: {e}");
        }
    }
    let _ = writeln!(
        out,
        "fusion and autotune: {}",
        match (B::DEVICE_KERNELS, fusion::COMPILED) {
            (false, _) => "not applicable (a CPU backend)".to_string(),
            (true, false) => format!(
                "fusion off, autotune {} (built with `{}-backend`; `--features {}` gives \
                 Burn's defaults)",
                on_off(fusion::AUTOTUNE),
                B::NAME,
                B::NAME
            ),
            (true, true) => {
                // What an accelerator of this environment would choose (ACCELERATE_FUSION,
                // the config file).
                let chosen = accelerate_core::config::ConfigOverrides::default()
                    .resolve()
                    .map(|config| config.fusion);
                format!(
                    "fusion {} (compiled in; ACCELERATE_FUSION=false turns it off), autotune {}",
                    match chosen {
                        Ok(on) => on_off(on).to_string(),
                        Err(e) => format!("unknown ({e})"),
                    },
                    on_off(fusion::AUTOTUNE)
                )
            }
        }
    );
    let _ = writeln!(
        out,
        "NCCL use: {}",
        if cfg!(feature = "nccl") {
            "the cuda backend averages gradients with it (ACCELERATE_NCCL=auto|off|require)"
        } else {
            "this build does not use it (build accelerate-burn with --features nccl)"
        }
    );
    let _ = writeln!(
        out,
        "MPI engine: {}",
        if cfg!(feature = "mpi") {
            "compiled in (picked under mpirun / srun --mpi=pmix, or ACCELERATE_TRANSPORT=mpi)"
        } else {
            "not compiled in (build accelerate-burn with --features mpi)"
        }
    );
    out
}

fn on_off(on: bool) -> &'static str {
    if on { "on" } else { "off" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_burn_version_is_the_locked_one() {
        // The workspace's lock in a clone; the package's own in a published crate.
        let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let lock = std::fs::read_to_string(manifest.join("Cargo.lock"))
            .or_else(|_| std::fs::read_to_string(manifest.join("../Cargo.lock")))
            .unwrap();
        let locked = lock
            .split("[[package]]")
            .find(|p| p.contains("name = \"burn\"\n"))
            .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = ")))
            .unwrap();
        assert_eq!(locked.trim_matches('"'), burn_version());
    }

    #[cfg(any(
        feature = "flex",
        feature = "ndarray",
        feature = "wgpu-backend",
        feature = "cuda-backend"
    ))]
    #[test]
    fn the_report_names_backends_and_the_device() {
        use crate::DefaultBackend;
        let b = build_report::<DefaultBackend>();
        assert!(
            b.contains(&format!("default: {}", DefaultBackend::NAME)),
            "{b}"
        );
        assert!(b.contains("device of local rank 0"), "{b}");
    }
}
