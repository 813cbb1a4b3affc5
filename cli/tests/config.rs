//! `accelerate-rs config`, `accelerate-rs test` and the precedence of settings as real commands:
//! CLI flag > ACCELERATE_* variable > config file > default, for the launcher and, through
//! it, for the workers (which run `accelerate-rs env` here to show what they resolved).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn accelerate(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"));
    cmd.args(args).env_remove("ACCELERATE_MIXED_PRECISION");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Launches `accelerate-rs env` on one worker with `args` before it and returns rank 0's
/// resolved configuration line.
fn resolved(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut all = vec!["launch"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", env!("CARGO_BIN_EXE_accelerate-rs"), "env"]);
    let out = accelerate(&all, env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("[rank 0] resolved configuration: "))
        .unwrap_or_else(|| panic!("{}", text(&out.stdout)))
        .to_string()
}

/// Launches a shell worker printing its world size and returns rank 0's line.
fn world_size(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut all = vec!["launch"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "sh", "-c", "echo world $WORLD_SIZE"]);
    accelerate(&all, env)
}

fn write(path: &Path, text: &str) -> String {
    std::fs::write(path, text).unwrap();
    path.display().to_string()
}

#[test]
fn flags_beat_variables_beat_the_file_beat_defaults() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(
        &tmp.path().join("c.toml"),
        "num_processes = 3\nmixed_precision = \"bf16\"\ngradient_accumulation_steps = 4\n",
    );
    let stdout = |o: Output| text(&o.stdout);
    // The file alone.
    assert!(stdout(world_size(&["--config-file", &file], &[])).contains("[rank 0] world 3"));
    // A variable beats the file; a flag beats both.
    let env = [("ACCELERATE_NUM_PROCESSES", "1")];
    assert!(stdout(world_size(&["--config-file", &file], &env)).contains("[rank 0] world 1"));
    assert!(
        stdout(world_size(&["--config-file", &file, "-n", "2"], &env)).contains("[rank 0] world 2")
    );

    // The workers resolve the same order for their own settings.
    let one = ["--config-file", &file, "-n", "1"];
    let from_file = resolved(&one, &[]);
    assert!(from_file.contains("mixed_precision: Bf16"), "{from_file}");
    assert!(
        from_file.contains("gradient_accumulation_steps: 4"),
        "{from_file}"
    );
    let from_env = resolved(&one, &[("ACCELERATE_MIXED_PRECISION", "no")]);
    assert!(from_env.contains("mixed_precision: No"), "{from_env}");
    let mut flag = one.to_vec();
    flag.extend_from_slice(&["--mixed-precision", "fp16"]);
    let from_flag = resolved(&flag, &[("ACCELERATE_MIXED_PRECISION", "no")]);
    assert!(from_flag.contains("mixed_precision: Fp16"), "{from_flag}");
    // No file: the defaults.
    let none = resolved(&["-n", "1"], &[("ACCELERATE_CONFIG_FILE", "none")]);
    assert!(none.contains("mixed_precision: No, "), "{none}");
    assert!(none.contains("gradient_accumulation_steps: 1,"), "{none}");
}

#[test]
fn accelerate_yaml_is_read_and_its_foreign_keys_named() {
    let tmp = tempfile::tempdir().unwrap();
    let yaml = write(
        &tmp.path().join("default_config.yaml"),
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n\
         mixed_precision: 'no'\nuse_cpu: true\n",
    );
    let out = world_size(&["--config-file", &yaml], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("[rank 1] world 2"));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("ignored keys that have no meaning in accelerate-rs: compute_environment, distributed_type"),
        "{stderr}"
    );

    // Found at Accelerate's default location when we have no file of our own.
    let home = tmp.path().display().to_string();
    let hf = tmp.path().join(".cache/huggingface/accelerate");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::copy(&yaml, hf.join("default_config.yaml")).unwrap();
    let found = world_size(&[], &[("HOME", &home), ("XDG_CONFIG_HOME", &home)]);
    assert!(
        text(&found.stdout).contains("[rank 0] world 2"),
        "{}",
        text(&found.stderr)
    );
}

#[test]
fn malformed_files_fail_in_one_line_naming_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let yaml = write(
        &tmp.path().join("bad.yaml"),
        "num_processes: 2\nmixed_precision: fp8\n",
    );
    let out = world_size(&["--config-file", &yaml], &[]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!("config file {yaml}:2: mixed_precision")),
        "{stderr}"
    );

    let toml = write(
        &tmp.path().join("bad.toml"),
        "num_processes = 2\nnum_procs = 3\n",
    );
    let out = world_size(&["--config-file", &toml], &[]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!("config file {toml}:2: unknown field `num_procs`")),
        "{stderr}"
    );
}

#[test]
fn config_writes_the_file_from_answers_defaults_or_accelerate_yaml() {
    let tmp = tempfile::tempdir().unwrap();
    let xdg = tmp.path().display().to_string();
    let ours = tmp.path().join("accelerate-rs/config.toml");

    let out = accelerate(&["config", "--default"], &[("XDG_CONFIG_HOME", &xdg)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains(&ours.display().to_string()));
    let written = std::fs::read_to_string(&ours).unwrap();
    assert!(written.contains("num_processes = 1"), "{written}");

    // Interactive: answers on stdin (1 machine, 2 processes, CPU only, bf16, 2 steps).
    let mut child = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .args(["config"])
        .env("XDG_CONFIG_HOME", &xdg)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"\n2\nyes\nbf16\n2\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let written = std::fs::read_to_string(&ours).unwrap();
    for line in [
        "num_processes = 2",
        "use_cpu = true",
        "mixed_precision = \"bf16\"",
        "gradient_accumulation_steps = 2",
    ] {
        assert!(written.contains(line), "{line} in\n{written}");
    }

    let yaml = write(
        &tmp.path().join("hf.yaml"),
        "num_processes: 4\ndowncast_bf16: 'no'\n",
    );
    let out = accelerate(
        &["config", "--from-accelerate", &yaml],
        &[("XDG_CONFIG_HOME", &xdg)],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("downcast_bf16"));
    assert!(
        std::fs::read_to_string(&ours)
            .unwrap()
            .contains("num_processes = 4")
    );
}

#[test]
fn accelerate_test_passes_on_two_processes() {
    let out = accelerate(&["test", "-n", "2"], &[("ACCELERATE_CONFIG_FILE", "none")]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("accelerate-rs test: PASS"), "{stdout}");
    assert_eq!(stdout.matches("[rank 0] ok ").count(), 3, "{stdout}");
}
