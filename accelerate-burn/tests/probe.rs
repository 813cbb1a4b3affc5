//! Probing a backend's device never panics: on a machine without the backend's driver or
//! adapter, building an accelerator is a one-line error naming the backend and what to install.

#![cfg(feature = "cuda")]

use accelerate_burn::{Accelerator, Cuda, ProcessState};

/// What the cuda backend looks for before touching a device.
fn nvidia_driver_present() -> bool {
    ["/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg"]
        .iter()
        .any(|path| std::path::Path::new(path).exists())
}

#[test]
fn cuda_without_a_driver_is_a_one_line_error_and_with_one_a_device() {
    let built = Accelerator::<Cuda>::builder()
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
