//! Merging a sharded model into one `model.safetensors`: every shard's header is read and
//! checked against the index, then each tensor's bytes are copied from its shard into the new
//! file, a buffer at a time, so a model of any size merges in a few kilobytes of memory.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::header::{self, TensorEntry, dtype_size, read_header};
use super::sharding::{INDEX_FILE, MODEL_FILE, SAVED_BY, SAVED_BY_KEY, ShardIndex};
use super::{WeightsError, io, malformed};

/// What [`merge_sharded`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeReport {
    /// The merged file.
    pub output: PathBuf,
    /// Shard files read.
    pub files: usize,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data written.
    pub bytes: u64,
}

/// Where one tensor's bytes come from.
struct Source {
    file: String,
    /// Offset of its first byte in the shard file.
    at: u64,
    entry: TensorEntry,
}

/// Merges the sharded model in `dir` (`model.safetensors.index.json` and its shards) into
/// `out_dir/model.safetensors`, which must not exist (the directory is created if missing).
/// Every tensor the index lists must be in the shard it names, and every shard tensor in the
/// index. The file is written under a temporary name and linked into place when complete, so
/// a file created at the output meanwhile is never replaced.
pub fn merge_sharded(dir: &Path, out_dir: &Path) -> Result<MergeReport, WeightsError> {
    // A sharded save killed while it published here is finished first.
    super::finish_interrupted(dir);
    if !dir.join(INDEX_FILE).is_file() {
        return Err(malformed(
            dir,
            format!(
                "no {INDEX_FILE} here: not a sharded model (a {MODEL_FILE} alone is already \
                 whole)"
            ),
        ));
    }
    let index = ShardIndex::read(dir)?;
    let output = out_dir.join(MODEL_FILE);
    if std::fs::symlink_metadata(&output).is_ok() {
        return Err(WeightsError::OutputExists { path: output });
    }
    let (sources, mut metadata) = gather_sources(dir, &index)?;
    // The merged file is ours, whoever wrote the shards.
    metadata.insert(SAVED_BY_KEY.to_string(), SAVED_BY.to_string());
    let (layout, bytes) = lay_out(&sources);
    let entries = layout
        .iter()
        .map(|placed| (placed.name.to_string(), placed.entry.clone()))
        .collect();
    let header = header::encode(&metadata, &entries)
        .map_err(|e| malformed(&output, format!("encoding the header: {e}")))?;
    std::fs::create_dir_all(out_dir).map_err(io("creating", out_dir))?;
    // Created, never renamed over: a file that appeared at `output` since the check above
    // is someone else's.
    crate::checkpoint::create_file(&output, |temporary| {
        write_merged(dir, temporary, &header, &layout)
    })
    .map_err(|e| match e {
        crate::checkpoint::CheckpointError::Io { source, .. }
            if source.kind() == std::io::ErrorKind::AlreadyExists =>
        {
            WeightsError::OutputExists {
                path: output.clone(),
            }
        }
        other => other.into(),
    })?;
    Ok(MergeReport {
        output,
        files: index.files().len(),
        tensors: layout.len(),
        bytes,
    })
}

/// Each tensor's source by name, and the metadata the merged file carries.
type Sources = (BTreeMap<String, Source>, BTreeMap<String, String>);

/// Every tensor's source, checked against the index, and the first shard's metadata.
fn gather_sources(dir: &Path, index: &ShardIndex) -> Result<Sources, WeightsError> {
    let mut sources = BTreeMap::new();
    let mut metadata = None;
    for file in index.files() {
        let path = dir.join(file);
        let shard = read_header(&path)?;
        metadata.get_or_insert_with(|| shard.metadata.clone());
        for (name, entry) in shard.tensors {
            match index.weight_map.get(&name) {
                Some(listed) if listed == file => {}
                Some(listed) => {
                    return Err(malformed(
                        &path,
                        format!("holds tensor {name:?}, which the index places in {listed}"),
                    ));
                }
                None => {
                    return Err(malformed(
                        &path,
                        format!("holds tensor {name:?}, which the index does not list"),
                    ));
                }
            }
            let at = shard.data_start.saturating_add(entry.data_offsets[0]);
            sources.insert(
                name,
                Source {
                    file: file.to_string(),
                    at,
                    entry,
                },
            );
        }
    }
    if let Some((name, file)) = index
        .weight_map
        .iter()
        .find(|(name, _)| !sources.contains_key(*name))
    {
        return Err(malformed(
            &dir.join(file),
            format!("the index lists tensor {name:?} in this file, which does not hold it"),
        ));
    }
    Ok((sources, metadata.unwrap_or_default()))
}

/// One tensor in the merged file: its name, where its bytes come from, and its entry there.
struct Placed<'a> {
    name: &'a str,
    source: &'a Source,
    entry: TensorEntry,
}

/// The merged file's tensors in the order of their bytes: the widest dtypes first, then by
/// name, so that every tensor starts at a multiple of its element size; and the bytes of data.
fn lay_out(sources: &BTreeMap<String, Source>) -> (Vec<Placed<'_>>, u64) {
    let mut order: Vec<(&String, &Source)> = sources.iter().collect();
    order.sort_by_key(|(name, s)| {
        (
            std::cmp::Reverse(dtype_size(&s.entry.dtype).unwrap_or(1)),
            *name,
        )
    });
    let mut at = 0u64;
    let mut layout = Vec::with_capacity(order.len());
    for (name, source) in order {
        let len = source.entry.byte_len();
        let mut entry = source.entry.clone();
        entry.data_offsets = [at, at.saturating_add(len)];
        at = at.saturating_add(len);
        layout.push(Placed {
            name,
            source,
            entry,
        });
    }
    (layout, at)
}

/// Writes the header, then each tensor's bytes from its shard, in the order of `layout`.
fn write_merged(
    dir: &Path,
    target: &Path,
    header: &[u8],
    layout: &[Placed<'_>],
) -> Result<(), WeightsError> {
    let mut out = BufWriter::with_capacity(
        1 << 20,
        File::create(target).map_err(io("creating", target))?,
    );
    out.write_all(header).map_err(io("writing", target))?;
    let mut open: HashMap<&str, File> = HashMap::new();
    for Placed {
        name,
        source,
        entry,
    } in layout
    {
        let path = dir.join(&source.file);
        let file = match open.entry(source.file.as_str()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(File::open(&path).map_err(io("opening", &path))?)
            }
        };
        file.seek(SeekFrom::Start(source.at))
            .map_err(io("reading", &path))?;
        let len = entry.byte_len();
        let copied = std::io::copy(&mut Read::take(&mut *file, len), &mut out)
            .map_err(io("copying from", &path))?;
        if copied != len {
            return Err(malformed(
                &path,
                format!(
                    "tensor {name:?} ends after {copied} of its {len} bytes: the file shrank while it was read"
                ),
            ));
        }
    }
    out.flush().map_err(io("writing", target))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of `tensors` (name, dtype, shape, bytes), laid out in the order given.
    fn shard(path: &Path, tensors: &[(&str, &str, Vec<u64>, Vec<u8>)]) {
        let mut entries = BTreeMap::new();
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let start = data.len() as u64;
            data.extend_from_slice(bytes);
            entries.insert(
                name.to_string(),
                TensorEntry {
                    dtype: dtype.to_string(),
                    shape: shape.clone(),
                    data_offsets: [start, data.len() as u64],
                },
            );
        }
        let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let mut bytes = header::encode(&metadata, &entries).unwrap();
        bytes.extend_from_slice(&data);
        std::fs::write(path, bytes).unwrap();
    }

    fn two_shards(dir: &Path) {
        shard(
            &dir.join("model-00001-of-00002.safetensors"),
            &[
                ("b", "F16", vec![2], vec![1, 2, 3, 4]),
                ("a", "F32", vec![2], (0..8).collect()),
            ],
        );
        shard(
            &dir.join("model-00002-of-00002.safetensors"),
            &[("c", "I64", vec![1], (10..18).collect())],
        );
        ShardIndex::new(
            20,
            [("a", 1), ("b", 1), ("c", 2)]
                .map(|(t, f)| (t.to_string(), format!("model-0000{f}-of-00002.safetensors"))),
        )
        .write(dir)
        .unwrap();
    }

    /// The bytes of tensor `name` in the safetensors file at `path`.
    fn tensor_bytes(path: &Path, name: &str) -> Vec<u8> {
        let header = read_header(path).unwrap();
        let entry = &header.tensors[name];
        let all = std::fs::read(path).unwrap();
        let start = (header.data_start + entry.data_offsets[0]) as usize;
        all[start..start + entry.byte_len() as usize].to_vec()
    }

    #[test]
    fn shards_merge_into_one_file_with_every_tensor_byte_for_byte() {
        let tmp = tempfile::tempdir().unwrap();
        two_shards(tmp.path());
        let out = tmp.path().join("merged");
        let report = merge_sharded(tmp.path(), &out).unwrap();
        assert_eq!((report.files, report.tensors, report.bytes), (2, 3, 20));
        let merged = out.join(MODEL_FILE);
        let header = read_header(&merged).unwrap();
        assert_eq!(header.metadata["format"], "pt");
        assert_eq!(tensor_bytes(&merged, "a"), (0..8).collect::<Vec<u8>>());
        assert_eq!(tensor_bytes(&merged, "b"), vec![1, 2, 3, 4]);
        assert_eq!(tensor_bytes(&merged, "c"), (10..18).collect::<Vec<u8>>());
        // Widest first: each tensor starts at a multiple of its element size.
        assert_eq!(header.data_start % 8, 0);
        for entry in header.tensors.values() {
            assert_eq!(entry.data_offsets[0] % dtype_size(&entry.dtype).unwrap(), 0);
        }
        // A second merge does not replace the first.
        let err = merge_sharded(tmp.path(), &out).unwrap_err();
        assert!(matches!(err, WeightsError::OutputExists { .. }), "{err}");
    }

    #[test]
    fn a_shard_that_disagrees_with_the_index_is_refused_and_nothing_is_written() {
        let tmp = tempfile::tempdir().unwrap();
        two_shards(tmp.path());
        // The index lists a tensor no shard holds.
        let mut index = ShardIndex::read(tmp.path()).unwrap();
        index
            .weight_map
            .insert("d".into(), "model-00002-of-00002.safetensors".into());
        index.write(tmp.path()).unwrap();
        let out = tmp.path().join("merged");
        let err = merge_sharded(tmp.path(), &out).unwrap_err().to_string();
        assert!(err.contains("does not hold it"), "{err}");
        // A shard holds a tensor the index places elsewhere.
        index.weight_map.remove("d");
        index
            .weight_map
            .insert("a".into(), "model-00002-of-00002.safetensors".into());
        index.write(tmp.path()).unwrap();
        let err = merge_sharded(tmp.path(), &out).unwrap_err().to_string();
        assert!(err.contains("places in"), "{err}");
        assert!(!out.join(MODEL_FILE).exists());
        // Not a sharded model.
        let err = merge_sharded(&out, &tmp.path().join("x"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a sharded model"), "{err}");
    }
}
