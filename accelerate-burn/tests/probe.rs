//! Probing a backend's device never panics: on a machine without the backend's driver or
//! adapter, building an accelerator is a one-line error naming the backend and what to install.

#![cfg(any(feature = "cuda-backend", feature = "wgpu-backend"))]

use accelerate_burn::{Accelerator, ProcessState};

/// What the cuda backend looks for before touching a device.
#[cfg(feature = "cuda-backend")]
fn nvidia_driver_present() -> bool {
    ["/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg"]
        .iter()
        .any(|path| std::path::Path::new(path).exists())
}

#[cfg(feature = "cuda-backend")]
#[test]
fn cuda_without_a_driver_is_a_one_line_error_and_with_one_a_device() {
    let built = Accelerator::<accelerate_burn::Cuda>::builder()
        .process_state(ProcessState::single())
        .build();
    if nvidia_driver_present() {
        let acc = built.expect("a machine with an NVIDIA driver gets a cuda device");
        assert_eq!(acc.backend_name(), "cuda");
    } else {
        let err = built.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            err.starts_with("the cuda backend is unavailable: no NVIDIA driver"),
            "{err}"
        );
        assert!(err.contains("hint: "), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

/// wgpu with no adapter of the kind asked for (a 100th discrete GPU, through cubecl's
/// `CUBECL_WGPU_DEFAULT_DEVICE`; a machine without any Vulkan driver takes the same path): a
/// one-line error naming the backend, what wgpu said and what to install. The probe runs in a
/// child process, because a process chooses its wgpu device once.
#[cfg(feature = "wgpu-backend")]
#[test]
fn wgpu_without_an_adapter_is_a_one_line_error() {
    const CHILD: &str = "ACCELERATE_PROBE_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let built = Accelerator::<accelerate_burn::Wgpu>::builder()
            .process_state(ProcessState::single())
            .build();
        match built {
            Ok(_) => println!("PROBE ok"),
            Err(e) => println!("PROBE error {e}"),
        }
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = std::process::Command::new(exe)
        .args([
            "--exact",
            "wgpu_without_an_adapter_is_a_one_line_error",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("CUBECL_WGPU_DEFAULT_DEVICE", "DiscreteGpu(99)")
        .output()
        .expect("the child test runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("PROBE "))
        .unwrap_or_else(|| {
            panic!(
                "no probe result: {stdout}\n{}",
                String::from_utf8_lossy(&output.stderr)
            )
        });
    assert!(
        line.starts_with("error the wgpu backend is unavailable: "),
        "{line}"
    );
    assert!(line.contains("hint: install a Vulkan driver"), "{line}");
}
