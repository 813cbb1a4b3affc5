//! Building a cargo target of the project in the current directory and finding its
//! executable, with a progress line while cargo compiles: `launch --example/--bin` builds the
//! user's program, `test` builds the check's worker (`accelerate-selftest`) with the project's
//! own features.

use std::io::{BufRead, BufReader, IsTerminal};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};

/// A target to build: `kind` is cargo's word for it (`example`, `bin`).
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// `example` or `bin`.
    pub kind: &'a str,
    /// The target's name.
    pub name: &'a str,
    /// Which packages cargo builds it among.
    pub among: Among<'a>,
    /// Build with `--release`.
    pub release: bool,
    /// Cargo features to build with (`--features`).
    pub features: Option<&'a str>,
}

/// The packages a build selects, which decide the features cargo resolves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Among<'a> {
    /// The member that owns the target, looked up (else cargo's own search applies).
    Owner,
    /// This package: for a dependency, cargo takes its features from the members that
    /// depend on it.
    Package(&'a str),
    /// Every member of the workspace (`--workspace`), so features are unified as in a build
    /// of the whole project.
    Workspace,
}

/// The program cargo is, as cargo sets it for its subcommands, else `cargo` on PATH.
pub fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Builds `target` in the project of the current directory and returns the path of its
/// executable. Cargo runs quietly (its warnings and errors still show) and
/// its JSON messages drive our own progress line: a spinner on a terminal, else a line every
/// 15 s, so a first build that compiles Burn for minutes never looks stuck.
pub fn build(target: &Target) -> anyhow::Result<PathBuf> {
    let Target { kind, name, .. } = *target;
    let cargo = cargo();
    let mut cmd = Command::new(&cargo);
    cmd.args([
        "build",
        "--quiet",
        "--message-format=json-render-diagnostics",
    ])
    .arg(format!("--{kind}"))
    .arg(name)
    .stdout(Stdio::piped());
    // Without a package, cargo resolves features over every member of the workspace (benches
    // and their dev-dependencies too), which differ from what `cargo run -p accelerate-cli`
    // resolved, so the first launch compiled Burn a second time (40 crates, 6 minutes here).
    match target.among {
        Among::Owner => {
            if let Some(package) = package_of(&cargo, kind, name, Scope::Members) {
                cmd.args(["--package", &package]);
            }
        }
        Among::Package(package) => {
            cmd.args(["--package", package]);
        }
        Among::Workspace => {
            cmd.arg("--workspace");
        }
    }
    if target.release {
        cmd.arg("--release");
    }
    if let Some(features) = target.features {
        cmd.args(["--features", features]);
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("running `{cargo} build --{kind} {name}`"))?;
    let messages = child
        .stdout
        .take()
        .context("reading cargo's messages (its standard output)")?;
    let mut progress = BuildProgress::new(kind, name);
    let mut executable = None;
    for line in BufReader::new(messages).lines() {
        let line = line.context("reading cargo's messages (its standard output)")?;
        let Ok(message) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" {
            continue;
        }
        if message["fresh"] == false {
            progress.compiled(message["target"]["name"].as_str().unwrap_or("?"));
        }
        if is_target(&message["target"], kind, name) {
            executable = message["executable"].as_str().map(PathBuf::from);
        }
    }
    let status = child
        .wait()
        .with_context(|| format!("waiting for `{cargo} build --{kind} {name}`"))?;
    progress.finish();
    if !status.success() {
        bail!("`cargo build --{kind} {name}` failed (its errors are above)");
    }
    executable.with_context(|| format!("cargo built no executable for the {kind} `{name}`"))
}

/// Which packages [`package_of`] searches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The workspace's own members (cargo's `metadata --no-deps`: no resolution).
    Members,
    /// The members and every package they depend on.
    Dependencies,
}

/// The package of the current project that has the `kind` target `name`, when exactly one
/// has it; `None` outside a cargo project too (then cargo's own search and errors apply).
pub fn package_of(cargo: &str, kind: &str, name: &str, scope: Scope) -> Option<String> {
    let mut cmd = Command::new(cargo);
    cmd.args(["metadata", "--format-version", "1"]);
    if scope == Scope::Members {
        cmd.arg("--no-deps");
    }
    let output = cmd
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
    package_with_target(&metadata, kind, name)
}

/// The one package in cargo's `metadata` with the `kind` target `name`.
fn package_with_target(metadata: &serde_json::Value, kind: &str, name: &str) -> Option<String> {
    let mut owners = metadata["packages"].as_array()?.iter().filter(|package| {
        package["targets"]
            .as_array()
            .is_some_and(|targets| targets.iter().any(|t| is_target(t, kind, name)))
    });
    let owner = owners.next()?;
    if owners.next().is_some() {
        return None;
    }
    owner["name"].as_str().map(str::to_string)
}

/// True when cargo's JSON description of a `target` is the `kind` target `name`.
fn is_target(target: &serde_json::Value, kind: &str, name: &str) -> bool {
    target["name"] == name
        && target["kind"]
            .as_array()
            .is_some_and(|kinds| kinds.iter().any(|k| k == kind))
}

/// What the user sees while cargo builds: a spinner with the crates compiled so far on a
/// terminal, a line every 15 s otherwise, and one line at the end when anything was compiled.
struct BuildProgress {
    what: String,
    bar: Option<ProgressBar>,
    started: Instant,
    last_line: Instant,
    crates: u64,
}

impl BuildProgress {
    fn new(kind: &str, name: &str) -> Self {
        let what = format!("the {kind} `{name}`");
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new_spinner();
            if let Ok(style) = ProgressStyle::with_template(&format!(
                "{{spinner}} building {what}: {{pos}} crates compiled [{{elapsed}}] {{msg}}"
            )) {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        let now = Instant::now();
        Self {
            what,
            bar,
            started: now,
            last_line: now,
            crates: 0,
        }
    }

    fn compiled(&mut self, target: &str) {
        self.crates += 1;
        match &self.bar {
            Some(bar) => {
                bar.inc(1);
                bar.set_message(target.to_string());
            }
            None if self.last_line.elapsed() >= Duration::from_secs(15) => {
                self.last_line = Instant::now();
                eprintln!(
                    "building {}: {} crates compiled in {}s (latest: {target})",
                    self.what,
                    self.crates,
                    self.started.elapsed().as_secs()
                );
            }
            None => {}
        }
    }

    fn finish(self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        if self.crates > 0 {
            eprintln!(
                "built {} ({} crate{} compiled in {}s)",
                self.what,
                self.crates,
                if self.crates == 1 { "" } else { "s" },
                self.started.elapsed().as_secs()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::package_with_target;

    #[test]
    fn the_package_that_owns_an_example_is_found_and_an_ambiguous_name_is_left_to_cargo() {
        let metadata = serde_json::json!({ "packages": [
            { "name": "accelerate-cli", "targets": [{ "name": "accelerate-rs", "kind": ["bin"] }] },
            { "name": "accelerate-examples", "targets": [
                { "name": "digits", "kind": ["example"] },
                { "name": "accelerate_examples", "kind": ["lib"] },
            ]},
            { "name": "other", "targets": [{ "name": "digits", "kind": ["bin"] }] },
        ]});
        let owner = |kind, name| package_with_target(&metadata, kind, name);
        assert_eq!(
            owner("example", "digits").as_deref(),
            Some("accelerate-examples")
        );
        assert_eq!(owner("bin", "digits").as_deref(), Some("other"));
        assert_eq!(owner("example", "absent"), None);
        let twice = serde_json::json!({ "packages": [
            { "name": "a", "targets": [{ "name": "x", "kind": ["example"] }] },
            { "name": "b", "targets": [{ "name": "x", "kind": ["example"] }] },
        ]});
        assert_eq!(package_with_target(&twice, "example", "x"), None);
    }
}
