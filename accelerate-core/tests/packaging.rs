//! The workspace as crates.io would receive it: every published crate carries complete
//! metadata, both licence files and a README; the others are marked `publish = false`; Burn
//! and the GPU stack are required with caret ranges (never `=`, which would hold a user's
//! Burn back); and the README's feature table names every feature a user can enable.
//! `.ci/run` then packages the crates and builds a new project from the archives alone.

use std::path::{Path, PathBuf};

use toml::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn manifest(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    toml::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// Every member's directory and parsed manifest.
fn members() -> Vec<(PathBuf, Value)> {
    let workspace = manifest(&root().join("Cargo.toml"));
    let members = workspace["workspace"]["members"].as_array().unwrap();
    assert!(!members.is_empty());
    members
        .iter()
        .map(|m| {
            let dir = root().join(m.as_str().unwrap());
            let toml = manifest(&dir.join("Cargo.toml"));
            (dir, toml)
        })
        .collect()
}

fn is_published(package: &Value) -> bool {
    package.get("publish").and_then(Value::as_bool) != Some(false)
}

#[test]
fn published_crates_have_what_crates_io_and_docs_rs_show() {
    let mut published = Vec::new();
    for (dir, toml) in members() {
        let package = &toml["package"];
        let name = package["name"].as_str().unwrap().to_string();
        if !is_published(package) {
            assert!(
                name == "accelerate-examples" || name == "accelerate-benches",
                "{name} is marked publish = false: only the examples and benches are"
            );
            continue;
        }
        let description = package["description"].as_str().unwrap_or_default();
        assert!(
            description.len() > 20,
            "{name}: description {description:?}"
        );
        for key in ["license", "rust-version", "edition", "version"] {
            assert_eq!(
                package[key].get("workspace").and_then(Value::as_bool),
                Some(true),
                "{name}: `{key}` is not the workspace's"
            );
        }
        assert_eq!(
            package["documentation"].as_str(),
            Some(format!("https://docs.rs/{name}").as_str())
        );
        let readme = package["readme"].as_str().unwrap();
        let readme = std::fs::read_to_string(dir.join(readme)).unwrap();
        assert!(
            readme.starts_with(&format!("# {name}\n")),
            "{name}'s README"
        );
        let keywords = package["keywords"].as_array().unwrap();
        assert!(
            (1..=5).contains(&keywords.len()),
            "{name}: crates.io takes 5 keywords"
        );
        for keyword in keywords {
            let keyword = keyword.as_str().unwrap();
            assert!(
                keyword.len() <= 20,
                "{name}: keyword {keyword:?} is too long"
            );
        }
        assert!(!package["categories"].as_array().unwrap().is_empty());
        for licence in ["LICENSE-MIT", "LICENSE-APACHE"] {
            assert_eq!(
                std::fs::read(dir.join(licence)).unwrap_or_default(),
                std::fs::read(root().join(licence)).unwrap(),
                "{name} does not carry {licence}"
            );
        }
        assert!(
            toml["package"]["metadata"]["docs"]["rs"]["targets"].is_array(),
            "{name}: no docs.rs metadata"
        );
        published.push(name);
    }
    published.sort();
    assert_eq!(
        published,
        [
            "accelerate-burn",
            "accelerate-cli",
            "accelerate-core",
            "accelerate-data",
            "accelerate-kernels"
        ]
    );
    let licence = manifest(&root().join("Cargo.toml"))["workspace"]["package"]["license"].clone();
    assert_eq!(licence.as_str(), Some("MIT OR Apache-2.0"));
}

#[test]
fn burn_and_the_gpu_stack_are_caret_ranges() {
    let workspace = manifest(&root().join("Cargo.toml"));
    let dependencies = workspace["workspace"]["dependencies"].as_table().unwrap();
    for (name, spec) in dependencies {
        let version = match spec {
            Value::String(v) => v.as_str(),
            other => other.get("version").and_then(Value::as_str).unwrap_or(""),
        };
        assert!(
            !version.starts_with('='),
            "{name} = {version:?}: an exact pin forces every user onto that one release"
        );
    }
    for name in ["burn", "burn-cubecl"] {
        assert_eq!(dependencies[name]["version"].as_str(), Some("0.22.1"));
    }
}

#[test]
fn the_readme_table_names_every_backend_feature() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let start = readme.find("## Use it in your project").unwrap();
    let end = start
        + readme[start..]
            .find("\n## ")
            .unwrap_or(readme.len() - start);
    let section = &readme[start..end];
    let burn = manifest(&root().join("accelerate-burn/Cargo.toml"));
    let features = burn["features"].as_table().unwrap();
    for feature in features.keys() {
        // `device-kernels` is internal (implied by the GPU backends), `default` not a backend.
        if feature == "default" || feature == "device-kernels" {
            continue;
        }
        assert!(
            section.contains(&format!("| `{feature}`")),
            "the README's \"Use it in your project\" table does not name feature `{feature}`"
        );
    }
}
