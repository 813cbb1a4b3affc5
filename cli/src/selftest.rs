//! Where the check's worker comes from. `accelerate-rs` does not link Burn, so the training
//! checks of `test` and the backend lines of `env` run in `accelerate-selftest`, a binary of
//! `accelerate-burn`. It is taken, in order: from `--worker`; beside this executable (where
//! `cargo install` and a workspace build put both); from PATH; else built by cargo in the
//! project of the current directory, with that project's features, as `launch --example`
//! builds an example.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::cargo_build::{self, Among, Target};

/// The worker's executable name.
pub const BINARY: &str = "accelerate-selftest";

/// The package that owns the worker.
const PACKAGE: &str = "accelerate-burn";

/// What to do when no worker is found.
const HINT: &str = "run this in a project that depends on accelerate-burn (its features pick \
                    the backend checked), or `cargo install accelerate-burn` (with `--features \
                    wgpu` or `cuda` for a GPU), or give --worker PATH";

/// A worker that is already built: beside this executable, else on PATH.
pub fn installed() -> Option<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(BINARY)));
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .map(|dir| dir.join(BINARY));
    beside.into_iter().chain(on_path).find(|p| is_file(p))
}

/// The worker for `accelerate-rs test`: `explicit`, else [`installed`], else built in the
/// current project (cargo's progress and errors show on stderr).
pub fn locate(explicit: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit {
        if !is_file(&path) {
            bail!("--worker {}: no such file", path.display());
        }
        return Ok(path);
    }
    if let Some(path) = installed() {
        return Ok(path);
    }
    let Some(owner) = cargo_build::owner_in_graph(&cargo_build::cargo(), "bin", BINARY) else {
        bail!(
            "no `{BINARY}` to run the check with: none beside this executable or on PATH, and no cargo project here depends on {PACKAGE}; {HINT}"
        );
    };
    // A dependency takes its features from the members that depend on it; a member (as in
    // this repository, or a project that vendors accelerate-burn) selected alone would take
    // only its own defaults, so then the whole workspace is selected, as its build does.
    let among = if owner.member {
        Among::Workspace
    } else {
        Among::Package(PACKAGE)
    };
    cargo_build::build(&Target {
        kind: "bin",
        name: BINARY,
        among,
        release: false,
        features: None,
    })
    .with_context(|| format!("building the check's worker `{BINARY}` of {PACKAGE}"))
}

/// The lines of `accelerate-rs env` that need Burn, from an installed worker's `--report`;
/// a line saying how to get one when there is none or it fails.
pub fn report() -> String {
    let Some(worker) = installed() else {
        return format!("burn: unknown: no `{BINARY}` beside accelerate-rs or on PATH; {HINT}\n");
    };
    match Command::new(&worker).arg("--report").output() {
        Ok(out) if out.status.success() => format!(
            "backend report of {}:\n{}",
            worker.display(),
            String::from_utf8_lossy(&out.stdout)
        ),
        Ok(out) => format!(
            "burn: unknown: `{} --report` failed ({}): {}\n",
            worker.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => format!("burn: unknown: could not run {}: {e}\n", worker.display()),
    }
}

/// True for a regular file (or a link to one).
fn is_file(path: &Path) -> bool {
    path.metadata().is_ok_and(|m| m.is_file())
}
