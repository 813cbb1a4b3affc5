//! Where `cargo test --workspace` puts the examples it builds, for tests that start one as a
//! program (under `accelerate-rs launch`, `srun`, ...).
//! Included by the test crates of several packages (`#[path]`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The example `name`, built beside the running test.
pub fn built_example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let example = profile_dir.join("examples").join(name);
    assert!(
        example.is_file(),
        "{} is missing: run the workspace's tests (cargo test --workspace), or build it first \
         (cargo build --example {name})",
        example.display()
    );
    example
}
