//! `accelerate-rs merge-weights` and `estimate-memory` on a sharded model, as real commands.

use std::path::Path;
use std::process::{Command, Output};

use accelerate_core::weights::{self, INDEX_FILE, MODEL_FILE, ShardIndex};

fn accelerate(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A safetensors file holding one F32 tensor `name` of `values`.
fn shard(path: &Path, name: &str, values: &[f32]) {
    let header = format!(
        r#"{{"{name}":{{"dtype":"F32","shape":[{}],"data_offsets":[0,{}]}}}}"#,
        values.len(),
        values.len() * 4
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    for v in values {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn merge_weights_makes_one_file_of_a_sharded_model_and_never_replaces_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sharded");
    std::fs::create_dir(&dir).unwrap();
    let names = [
        weights::shard_file_name(0, 2),
        weights::shard_file_name(1, 2),
    ];
    shard(&dir.join(&names[0]), "layer.weight", &[1.0, 2.0, 3.0]);
    shard(&dir.join(&names[1]), "layer.bias", &[-0.5]);
    ShardIndex::new(
        16,
        [
            ("layer.weight".to_string(), names[0].clone()),
            ("layer.bias".to_string(), names[1].clone()),
        ],
    )
    .write(&dir)
    .unwrap();

    let estimate = accelerate(&[Path::new("estimate-memory"), &dir]);
    assert!(estimate.status.success(), "{}", text(&estimate.stderr));
    assert!(
        text(&estimate.stdout).contains("2 tensors, 4 floating-point values"),
        "{}",
        text(&estimate.stdout)
    );

    let out = tmp.path().join("merged");
    let merged = accelerate(&[Path::new("merge-weights"), &dir, &out]);
    assert!(merged.status.success(), "{}", text(&merged.stderr));
    assert!(
        text(&merged.stdout).contains("merged 2 tensors (16 bytes) from 2 shard files"),
        "{}",
        text(&merged.stdout)
    );
    let file = out.join(MODEL_FILE);
    let header = weights::read_header(&file).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    let values = |name: &str| -> Vec<f32> {
        let entry = &header.tensors[name];
        let start = (header.data_start + entry.data_offsets[0]) as usize;
        bytes[start..start + entry.byte_len() as usize]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    assert_eq!(values("layer.weight"), [1.0, 2.0, 3.0]);
    assert_eq!(values("layer.bias"), [-0.5]);
    assert_eq!(header.tensors.len(), 2);

    // Again: the merged file exists and is not replaced; the command says what to do.
    let again = accelerate(&[Path::new("merge-weights"), &dir, &out]);
    assert!(!again.status.success());
    assert!(
        text(&again.stderr).contains("is not replaced"),
        "{}",
        text(&again.stderr)
    );
    assert_eq!(std::fs::read(&file).unwrap(), bytes);

    // A directory without an index is not a sharded model.
    let none = accelerate(&[Path::new("merge-weights"), &out, &tmp.path().join("x")]);
    assert!(!none.status.success());
    assert!(
        text(&none.stderr).contains(INDEX_FILE),
        "{}",
        text(&none.stderr)
    );
}
