//! The launchers and daemons that tests start for real (torchrun, Slurm, Open MPI, iproute2),
//! found on this machine or not. A test without its tools is skipped with a message, except
//! under `.ci/run`, which installs them all and sets `ACCELERATE_REQUIRE_TEST_TOOLS=1`: there a
//! missing tool fails the test instead of silently skipping it.
//! Included by the test crates of several packages (`#[path]`), hence no crate of its own.

#![allow(dead_code)]

use std::path::PathBuf;

/// `name`'s path on `PATH`, if it is there.
pub fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    })
}

/// Whether this process runs as root (namespaces, Slurm's daemons, mounts need it).
pub fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Whether every one of `tools` is on `PATH` (and root, with `root`); when not, says what is
/// missing, or fails under CI.
pub fn ready(tools: &[&str], root: bool, install: &str) -> bool {
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|t| on_path(t).is_none())
        .collect();
    if missing.is_empty() && (!root || is_root()) {
        return true;
    }
    let what = if missing.is_empty() {
        "root".to_string()
    } else {
        format!("{} ({install})", missing.join(", "))
    };
    skip(&what)
}

/// A test that cannot run here for lack of `what`: says so and returns false, or fails under
/// CI, which provides everything the tests need (installed, and run as root).
pub fn skip(what: &str) -> bool {
    assert!(
        std::env::var_os("ACCELERATE_REQUIRE_TEST_TOOLS").is_none(),
        "the tests need {what}: .ci/run installs it and runs as root"
    );
    eprintln!("skipped: needs {what}");
    false
}

/// A `python3` on `PATH` that imports `module`, when this machine has one (`.ci/run` puts
/// its virtual environment first on `PATH`).
pub fn python_with(module: &str) -> Option<PathBuf> {
    let python = on_path("python3")?;
    let imports = std::process::Command::new(&python)
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|out| out.status.success());
    match imports || skip(&format!("python3 with {module} (pip install {module})")) {
        true => Some(python),
        false => None,
    }
}

/// torchrun, when this machine has it.
pub fn torchrun() -> Option<PathBuf> {
    if ready(&["torchrun"], false, "pip install torch") {
        on_path("torchrun")
    } else {
        None
    }
}

/// Whether a Slurm cluster can be started here (root and Debian's packages).
pub fn slurm_ready() -> bool {
    ready(
        &["slurmctld", "slurmd", "srun", "sbatch", "munged", "ip"],
        true,
        "apt-get install slurmd slurmctld slurm-client munge iproute2",
    )
}

/// Open MPI's `mpirun` for `np` ranks on this host (allowed to run as root, more ranks than
/// cores), when this machine has it.
pub fn mpirun(np: usize) -> Option<std::process::Command> {
    if !ready(&["mpirun"], false, "apt-get install openmpi-bin") {
        return None;
    }
    let mut mpirun = std::process::Command::new("mpirun");
    if is_root() {
        mpirun.arg("--allow-run-as-root");
    }
    mpirun.args(["--oversubscribe", "-np", &np.to_string()]);
    Some(mpirun)
}

/// Runs `command` and returns its standard output; fails the test with `what` and the
/// command's standard error when it cannot start or does not succeed.
pub fn output_of(command: &mut std::process::Command, what: &str) -> Vec<u8> {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{what} could not start: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}
