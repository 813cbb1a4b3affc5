//! The Hugging Face hub's layout of a model too large for one file: shards named
//! `model-00001-of-00003.safetensors` ..., and `model.safetensors.index.json`, which maps
//! every tensor to its shard (`weight_map`) and gives the total of their bytes
//! (`metadata.total_size`). A model that fits one shard is a single `model.safetensors`.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::Path;

use super::{WeightsError, io, malformed};
use crate::checkpoint::{MAX_JSON_BYTES, replace_file, write_json};

/// The file of a model saved whole.
pub const MODEL_FILE: &str = "model.safetensors";
/// The index of a sharded model.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The metadata key (in a safetensors header and in an index) that marks files accelerate-rs
/// wrote, the only ones a later save of another layout may remove.
pub const SAVED_BY_KEY: &str = "saved_by";
/// Its value.
pub const SAVED_BY: &str = "accelerate-rs";

/// The name of shard `index` (from 0) of `count`, as the hub numbers them (from 1).
pub fn shard_file_name(index: usize, count: usize) -> String {
    format!(
        "model-{:05}-of-{:05}.safetensors",
        index.saturating_add(1),
        count
    )
}

/// True for a name [`shard_file_name`] gives (the files a sharded save of ours may replace).
pub fn is_shard_file_name(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let mut parts = rest.split("-of-");
    let digits =
        |p: Option<&str>| p.is_some_and(|p| p.len() >= 5 && p.bytes().all(|b| b.is_ascii_digit()));
    digits(parts.next()) && digits(parts.next()) && parts.next().is_none()
}

/// Splits tensors of `sizes` bytes, in order, into shards of at most `max_shard_size` bytes
/// each, as the hub does: a shard closes when the next tensor would overflow it, and a tensor
/// larger than the limit gets a shard of its own. Every shard holds at least one tensor.
pub fn plan_shards(sizes: &[u64], max_shard_size: u64) -> Vec<Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, size) in sizes.iter().enumerate() {
        if i > start && bytes.saturating_add(*size) > max_shard_size {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes = bytes.saturating_add(*size);
    }
    if start < sizes.len() {
        shards.push(start..sizes.len());
    }
    shards
}

/// `model.safetensors.index.json`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardIndex {
    /// The index's metadata.
    #[serde(default)]
    pub metadata: IndexMetadata,
    /// Each tensor's shard file.
    pub weight_map: BTreeMap<String, String>,
}

/// The metadata of an index.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IndexMetadata {
    /// Bytes of every tensor together.
    #[serde(default)]
    pub total_size: u64,
    /// [`SAVED_BY`] in an index accelerate-rs wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_by: Option<String>,
}

impl ShardIndex {
    /// An index of `total_size` bytes mapping each tensor name to its file, marked as ours.
    pub fn new(total_size: u64, weight_map: impl IntoIterator<Item = (String, String)>) -> Self {
        Self {
            metadata: IndexMetadata {
                total_size,
                saved_by: Some(SAVED_BY.to_string()),
            },
            weight_map: weight_map.into_iter().collect(),
        }
    }

    /// True when accelerate-rs wrote this index.
    pub fn is_ours(&self) -> bool {
        self.metadata.saved_by.as_deref() == Some(SAVED_BY)
    }

    /// The shard files, each once, in name order.
    pub fn files(&self) -> BTreeSet<&str> {
        self.weight_map.values().map(String::as_str).collect()
    }

    /// Writes `dir/model.safetensors.index.json`: to a temporary file, synced, then renamed
    /// over the previous index.
    pub fn write(&self, dir: &Path) -> Result<(), WeightsError> {
        let path = dir.join(INDEX_FILE);
        replace_file(&path, |temporary| write_json(temporary, self).map(|_| ()))?;
        Ok(())
    }

    /// Reads `dir/model.safetensors.index.json` and checks that every file it names is a
    /// plain file name, so that it lies in `dir`.
    pub fn read(dir: &Path) -> Result<Self, WeightsError> {
        let path = dir.join(INDEX_FILE);
        let bytes =
            crate::input_file::read_at_most(&path, MAX_JSON_BYTES).map_err(io("reading", &path))?;
        let index: Self = serde_json::from_slice(&bytes)
            .map_err(|e| malformed(&path, format!("not a sharded model's index: {e}")))?;
        if let Some(bad) = index.files().into_iter().find(|f| !is_plain_file_name(f)) {
            return Err(malformed(
                &path,
                format!("it names the file {bad:?}, which is not a file in its own directory"),
            ));
        }
        Ok(index)
    }
}

/// A single path component that is neither `.`, `..` nor hidden: joined to a directory, it
/// stays inside it.
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && name.len() <= 255
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_close_before_they_overflow_and_a_large_tensor_stands_alone() {
        assert_eq!(plan_shards(&[], 10), Vec::<Range<usize>>::new());
        assert_eq!(plan_shards(&[4, 4, 4], 10), vec![0..2, 2..3]);
        assert_eq!(plan_shards(&[4, 30, 4], 10), vec![0..1, 1..2, 2..3]);
        assert_eq!(plan_shards(&[5, 5, 5, 5], 10), vec![0..2, 2..4]);
        assert_eq!(plan_shards(&[5, 5], u64::MAX), vec![0..2]);
    }

    #[test]
    fn shard_names_are_the_hubs_and_only_they_are_recognised() {
        assert_eq!(shard_file_name(2, 12), "model-00003-of-00012.safetensors");
        assert!(is_shard_file_name("model-00003-of-00012.safetensors"));
        for other in [
            "model.safetensors",
            "model-1-of-2.safetensors",
            "model-00001-of-00002.safetensors.bak",
            "mine-00001-of-00002.safetensors",
            "model-00001-of-00002-of-00003.safetensors",
        ] {
            assert!(!is_shard_file_name(other), "{other}");
        }
    }

    #[test]
    fn an_index_that_points_outside_its_directory_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        for bad in ["../secret.safetensors", "/etc/passwd", "..", "a/b"] {
            std::fs::write(
                tmp.path().join(INDEX_FILE),
                format!(r#"{{"metadata":{{"total_size":1}},"weight_map":{{"w":"{bad}"}}}}"#),
            )
            .unwrap();
            let err = ShardIndex::read(tmp.path()).unwrap_err().to_string();
            assert!(
                err.contains("not a file in its own directory"),
                "{bad}: {err}"
            );
        }
        // The hub's own files carry more metadata, and some none: both read.
        std::fs::write(
            tmp.path().join(INDEX_FILE),
            r#"{"metadata":{"total_size":8,"total_parameters":2},"weight_map":{"w":"a.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(ShardIndex::read(tmp.path()).unwrap().metadata.total_size, 8);
        std::fs::write(
            tmp.path().join(INDEX_FILE),
            r#"{"weight_map":{"w":"a.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(ShardIndex::read(tmp.path()).unwrap().files().len(), 1);
    }
}
