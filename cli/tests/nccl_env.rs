//! `accelerate-rs env` reports the libnccl a worker would load: here the `nvidia-nccl-cu13` wheel
//! of the torch environment on PATH (which .ci/run installs), found without any setting.

#[path = "../../tests-support/tools.rs"]
mod tools;

use std::process::Command;

#[test]
fn env_reports_the_nccl_wheel_of_the_python_environment_on_path() {
    if !tools::ready(
        &["torchrun"],
        false,
        "pip install torch (its wheels bring libnccl)",
    ) {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .arg("env")
        .env_remove("ACCELERATE_NCCL_LIBRARY")
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("VIRTUAL_ENV")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("NCCL: "))
        .unwrap_or_else(|| panic!("no NCCL line: {stdout}"));
    assert!(
        line.starts_with("NCCL: 2.") && line.contains("nvidia/nccl/lib/libnccl.so.2"),
        "{line}"
    );
    assert!(
        line.contains("pip wheel nvidia-nccl (python on PATH"),
        "{line}"
    );
}
