//! The two names of the command: `accelerate-rs` on its own, and `cargo accelerate` run by
//! the real cargo, which finds `cargo-accelerate` on `PATH` and passes it the word `accelerate`.

use std::path::Path;
use std::process::{Command, Output};

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `cargo accelerate ARGS`, with the built `cargo-accelerate` first on `PATH`.
fn cargo_accelerate(args: &[&str]) -> Output {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_cargo-accelerate"))
        .parent()
        .unwrap()
        .to_path_buf();
    let path = std::env::join_paths(std::iter::once(bin_dir).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .unwrap();
    Command::new(env!("CARGO"))
        .arg("accelerate")
        .args(args)
        .env("PATH", path)
        .output()
        .unwrap()
}

#[test]
fn help_names_the_command_as_it_was_typed() {
    let out = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        text(&out.stdout).contains("Usage: accelerate-rs <COMMAND>"),
        "{}",
        text(&out.stdout)
    );

    let out = cargo_accelerate(&["--help"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("Usage: cargo accelerate <COMMAND>"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn cargo_accelerate_launches_workers() {
    let out = cargo_accelerate(&["launch", "-n", "2", "--", "sh", "-c", "echo worker $RANK"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("[rank 0] worker 0"), "{stdout}");
    assert!(stdout.contains("[rank 1] worker 1"), "{stdout}");
}

#[test]
fn a_usage_error_exits_2_and_names_the_command() {
    let out = cargo_accelerate(&["lunch"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("cargo accelerate"),
        "{}",
        text(&out.stderr)
    );
}
