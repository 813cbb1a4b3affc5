//! Where `accelerate-rs test` and `env` find the check's worker (`accelerate-selftest`, a
//! binary of accelerate-burn; the CLI links no Burn): beside the command before PATH, and,
//! with none anywhere and no cargo project, an error that says how to get one. The real
//! worker runs in `config.rs` (`accelerate_test_passes_on_two_processes`) and, built in a new
//! user's project, in CI's packages step.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A copy of `accelerate-rs` in a directory of its own, so that nothing the workspace built
/// is beside it.
fn lone_command(dir: &Path) -> PathBuf {
    let copy = dir.join("accelerate-rs");
    std::fs::copy(env!("CARGO_BIN_EXE_accelerate-rs"), &copy).unwrap();
    copy
}

/// A stand-in worker: `--report` prints one line naming `who`, a check process its rank.
fn fake_worker(dir: &Path, who: &str) {
    let path = dir.join("accelerate-selftest");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nif [ \"$1\" = --report ]; then echo \"burn version: {who}\"; exit 0; fi\n\
             echo \"{who} rank $RANK of $WORLD_SIZE\"\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Runs the command in `cwd` with `path` as PATH (plus the system's directories). Retried
/// while the kernel answers "text file busy": a test on another thread that forks between our
/// writing the command and running it holds our write descriptor until its child execs (the
/// descriptor closes on exec), so the wait is short; CI hit it once.
fn run(command: &Path, args: &[&str], cwd: &Path, path: &Path) -> Output {
    for _ in 0..100 {
        let output = Command::new(command)
            .args(args)
            .current_dir(cwd)
            .env("PATH", format!("{}:/usr/bin:/bin", path.display()))
            .env("ACCELERATE_CONFIG_FILE", "none")
            .output();
        match output {
            Err(error) if error.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            output => return output.unwrap(),
        }
    }
    panic!("{} stayed busy (text file busy) for 2 s", command.display())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn the_worker_beside_the_command_wins_over_path() {
    let tmp = tempfile::tempdir().unwrap();
    let (home, elsewhere) = (tmp.path().join("bin"), tmp.path().join("path"));
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    let command = lone_command(&home);
    fake_worker(&home, "beside");
    fake_worker(&elsewhere, "on-path");

    let out = run(&command, &["test", "-n", "2"], tmp.path(), &elsewhere);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("[rank 1] beside rank 1 of 2"), "{stdout}");
    assert!(!stdout.contains("on-path"), "{stdout}");

    let out = run(&command, &["env"], tmp.path(), &elsewhere);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("burn version: beside"), "{stdout}");

    // Without one beside it, the one on PATH.
    std::fs::remove_file(home.join("accelerate-selftest")).unwrap();
    let out = run(&command, &["test", "-n", "2"], tmp.path(), &elsewhere);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("[rank 0] on-path rank 0 of 2"), "{stdout}");
}

#[test]
fn with_no_worker_and_no_project_the_error_says_how_to_get_one() {
    let tmp = tempfile::tempdir().unwrap();
    let command = lone_command(tmp.path());
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();

    let out = run(&command, &["test", "-n", "2"], &empty, &empty);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no `accelerate-selftest` to run the check with")
            && stderr.contains("cargo install accelerate-burn"),
        "{stderr}"
    );
    // `env` still reports everything else, and says the same.
    let out = run(&command, &["env"], &empty, &empty);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("burn: unknown: no `accelerate-selftest`"),
        "{stdout}"
    );
    assert!(stdout.contains("resolved configuration"), "{stdout}");
}

#[test]
fn a_named_worker_that_does_not_exist_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let command = lone_command(tmp.path());
    let missing = tmp.path().join("nowhere/accelerate-selftest");
    let out = run(
        &command,
        &["test", "--worker", missing.to_str().unwrap()],
        tmp.path(),
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no such file"),
        "{}",
        text(&out.stderr)
    );
}
