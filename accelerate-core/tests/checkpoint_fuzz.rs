//! Property tests of the checkpoint decoders that read files a crash, a disk or a person may
//! have damaged: random and mutated manifests never panic, and a manifest that decodes names
//! only files inside its checkpoint. `cargo test` runs a few hundred cases each; the long run
//! is
//!
//! ```text
//! PROPTEST_CASES=1000000 cargo test --release -p accelerate-core --test checkpoint_fuzz
//! ```

use std::path::Path;

use accelerate_core::checkpoint::{
    FORMAT_VERSION, Manifest, ManifestFile, decode_manifest, is_safe_file_name,
};
use proptest::prelude::*;

fn valid_manifest(names: &[String]) -> Vec<u8> {
    serde_json::to_vec(&Manifest {
        format_version: FORMAT_VERSION,
        library_version: "0.1.0".into(),
        world_size: 2,
        updates: 7,
        sequence: 3,
        files: names
            .iter()
            .map(|name| ManifestFile {
                name: name.clone(),
                contents: "x".into(),
                rank: Some(1),
                bytes: 10,
            })
            .collect(),
    })
    .unwrap()
}

/// A decoded manifest's names, joined to the checkpoint, stay inside it.
fn stays_inside(manifest: &Manifest) -> bool {
    manifest.files.iter().all(|file| {
        let joined = Path::new("/ckpt").join(&file.name);
        is_safe_file_name(&file.name)
            && joined.starts_with("/ckpt")
            && joined
                .components()
                .all(|c| !matches!(c, std::path::Component::ParentDir))
    })
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(manifest) = decode_manifest(Path::new("/ckpt"), &bytes) {
            prop_assert!(stays_inside(&manifest));
        }
    }

    #[test]
    fn mutated_manifests_never_panic_nor_escape(
        names in proptest::collection::vec("[a-z./_\\\\-]{0,12}", 0..4),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
    ) {
        let mut bytes = valid_manifest(&names);
        let n = bytes.len();
        for (i, x) in flips {
            bytes[i % n] ^= x;
        }
        if let Ok(manifest) = decode_manifest(Path::new("/ckpt"), &bytes) {
            prop_assert!(stays_inside(&manifest));
        }
    }

    #[test]
    fn names_that_decode_are_plain_relative_paths(
        names in proptest::collection::vec("(\\.\\./|/|[a-z]{1,3}/){0,3}[a-z.]{0,4}", 1..3),
    ) {
        let bytes = valid_manifest(&names);
        match decode_manifest(Path::new("/ckpt"), &bytes) {
            Ok(manifest) => prop_assert!(stays_inside(&manifest)),
            Err(_) => prop_assert!(names.iter().any(|n| !is_safe_file_name(n))),
        }
    }
}
