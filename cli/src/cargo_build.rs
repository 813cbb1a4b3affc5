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
    /// The packages cargo selects in the current directory, as `cargo build` and `cargo test`
    /// there do (the whole workspace at a virtual workspace's root), so the build shares
    /// their features and artifacts.
    Current,
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
    // No package for the user's program: cargo then resolves features as the project's own
    // `cargo build` and `cargo test` do, so neither rebuilds Burn after a launch (with
    // `-p <owner>` the features differ and the next `cargo test --workspace` recompiled
    // Burn, about 8 minutes here).
    match target.among {
        Among::Current => {}
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

/// A package of the current project's dependency graph that has a target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The package's name.
    pub name: String,
    /// Whether it is a member of the workspace (else a dependency).
    pub member: bool,
}

/// The one package in the current project's dependency graph, members or dependencies, that
/// has the `kind` target `name`; `None` outside a cargo project.
pub fn owner_in_graph(cargo: &str, kind: &str, name: &str) -> Option<Owner> {
    owner_in_metadata(&metadata(cargo, &[])?, kind, name)
}

/// The one package in cargo's full `metadata` with the `kind` target `name`, and whether it
/// is one of the `workspace_members`.
fn owner_in_metadata(metadata: &serde_json::Value, kind: &str, name: &str) -> Option<Owner> {
    let package = owner_with_target(metadata, kind, name)?;
    let member = metadata["workspace_members"]
        .as_array()
        .is_some_and(|members| members.iter().any(|id| *id == package["id"]));
    Some(Owner {
        name: package["name"].as_str()?.to_string(),
        member,
    })
}

/// Cargo's `metadata` of the current project, with `extra` arguments.
fn metadata(cargo: &str, extra: &[&str]) -> Option<serde_json::Value> {
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1"])
        .args(extra)
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    serde_json::from_slice(&output.stdout).ok()
}

/// The one package in cargo's `metadata` with the `kind` target `name`.
fn owner_with_target<'m>(
    metadata: &'m serde_json::Value,
    kind: &str,
    name: &str,
) -> Option<&'m serde_json::Value> {
    let mut owners = metadata["packages"].as_array()?.iter().filter(|package| {
        package["targets"]
            .as_array()
            .is_some_and(|targets| targets.iter().any(|t| is_target(t, kind, name)))
    });
    let owner = owners.next()?;
    if owners.next().is_some() {
        return None;
    }
    Some(owner)
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
    use super::{Owner, owner_in_metadata};

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
        let owner = |kind, name| owner_in_metadata(&metadata, kind, name).map(|o| o.name);
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
        assert_eq!(owner_in_metadata(&twice, "example", "x"), None);
    }

    #[test]
    fn the_owner_in_the_graph_says_whether_it_is_a_member() {
        let bin = |name: &str| serde_json::json!([{ "name": name, "kind": ["bin"] }]);
        let metadata = serde_json::json!({
            "packages": [
                { "id": "app 0.1", "name": "app", "targets": bin("app") },
                { "id": "burn-dep 0.1", "name": "accelerate-burn", "targets": bin("accelerate-selftest") },
            ],
            "workspace_members": ["app 0.1"],
        });
        let owner = |name| owner_in_metadata(&metadata, "bin", name);
        let dependency = Owner {
            name: "accelerate-burn".into(),
            member: false,
        };
        assert_eq!(owner("accelerate-selftest"), Some(dependency));
        let member = Owner {
            name: "app".into(),
            member: true,
        };
        assert_eq!(owner("app"), Some(member));
        assert_eq!(owner("absent"), None);
    }
}
