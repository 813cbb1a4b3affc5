//! A ZeRO-3 checkpoint's files: every rank writes its own shards (no gather to rank 0), of the
//! model (`zero3_model_<r>.bin`) and of the fused optimizer's state
//! (`zero3_optimizer_<r>.bin`), and a run of any number of processes reads them back cut for
//! itself: each parameter is put together from the saved ranks' shards and cut again, one
//! parameter at a time.
//!
//! A model file is a JSON header line (world size, rank, and per parameter: path, elements of
//! the whole parameter, whether it is sharded, values stored) and the values as little-endian
//! f32. Parameters left whole are stored by rank 0 only.

use std::path::Path;

use accelerate_core::checkpoint::{self, ManifestFile};
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use super::api::SavedFile;
use super::flat::{FusedStateError, FusedStateFile, Segment};
use crate::checkpoint::StageError;
use crate::params::{self, ParamLayout};

/// Prefix of the model shard files.
pub(crate) const MODEL_PREFIX: &str = "zero3_model_";
/// Prefix of the optimizer state shard files.
pub(crate) const STATE_PREFIX: &str = "zero3_optimizer_";
/// Prefix of the directories of each rank's Burn optimizer record.
const BURN_RECORD_PREFIX: &str = "zero3_burn_optimizer_";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Header {
    world: usize,
    rank: usize,
    entries: Vec<Entry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    path: String,
    /// Elements of the whole parameter.
    numel: usize,
    sharded: bool,
    /// Values stored in the file for it.
    len: usize,
}

/// Elements of each rank's shard of a parameter of `numel` elements over `world` ranks.
pub(crate) fn shard_len(numel: usize, world: usize) -> usize {
    numel.div_ceil(world.max(1)).max(1)
}

/// Writes this rank's model file (`<prefix><rank>.bin`: [`MODEL_PREFIX`] for the model,
/// [`module_prefix`] for a module saved beside it): `values` (layout order, flat: this rank's
/// shards and the whole parameters), `numels` saying which are shards (of how many elements).
/// Each stored value is read from the device in turn into the file's bytes; parameters left
/// whole are stored (and read) by rank 0 only.
pub(crate) fn write_model(
    dir: &Path,
    prefix: &str,
    (rank, world): (usize, usize),
    layout: &ParamLayout,
    values: Vec<Tensor<1>>,
    numels: &[Option<usize>],
) -> Result<SavedFile, StageError> {
    let stored: Vec<Option<Tensor<1>>> = values
        .into_iter()
        .zip(numels)
        .map(|(value, numel)| (numel.is_some() || rank == 0).then_some(value))
        .collect();
    let entries = layout
        .entries
        .iter()
        .zip(numels)
        .zip(&stored)
        .map(|((entry, numel), value)| Entry {
            path: entry.path.clone(),
            numel: numel.unwrap_or(entry.numel),
            sharded: numel.is_some(),
            len: value.as_ref().map_or(0, |v| v.shape().num_elements()),
        })
        .collect();
    let header = Header {
        world,
        rank,
        entries,
    };
    let mut bytes = serde_json::to_vec(&header).map_err(|e| StageError::Burn {
        what: "sharded model header".into(),
        detail: e.to_string(),
    })?;
    bytes.push(b'\n');
    for value in stored.into_iter().flatten() {
        bytes.extend(
            params::to_host_f32(value)
                .iter()
                .flat_map(|v| v.to_le_bytes()),
        );
    }
    let name = format!("{prefix}{rank}.bin");
    let written = checkpoint::write_synced(&dir.join(&name), &bytes)?;
    Ok(SavedFile {
        name,
        contents: "one rank's shards of a ZeRO-3 model (JSON header, f32 data)",
        rank: Some(rank),
        bytes: written,
    })
}

/// The prefix of the shard files of the module saved as `name` beside the model.
pub(crate) fn module_prefix(name: &str) -> String {
    format!("module_{name}.zero3_")
}

/// True when the checkpoint's `files` hold shard files of `prefix` (a ZeRO-3 checkpoint's
/// model: [`MODEL_PREFIX`]).
pub(crate) fn has_shards(files: &[ManifestFile], prefix: &str) -> bool {
    files.iter().any(|f| f.name.starts_with(prefix))
}

/// Every saved rank's file of `prefix`, in rank order.
fn read_models(
    dir: &Path,
    prefix: &str,
    files: &[ManifestFile],
) -> Result<Vec<(Header, Vec<f32>)>, StageError> {
    let mut models = Vec::new();
    for file in files.iter().filter(|f| f.name.starts_with(prefix)) {
        let path = dir.join(&file.name);
        let bytes = std::fs::read(&path).map_err(|source| StageError::Io { path, source })?;
        let damaged = |detail: String| StageError::Burn {
            what: file.name.clone(),
            detail,
        };
        let split = bytes
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| damaged("no header line".into()))?;
        let header: Header =
            serde_json::from_slice(&bytes[..split]).map_err(|e| damaged(e.to_string()))?;
        let values: Vec<f32> = bytes[split + 1..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let stored: usize = header.entries.iter().map(|e| e.len).sum();
        if stored != values.len() {
            return Err(damaged(format!(
                "{} values stored, its header says {stored}",
                values.len()
            )));
        }
        models.push((header, values));
    }
    models.sort_by_key(|(header, _)| header.rank);
    let world = models.len();
    if models
        .iter()
        .enumerate()
        .any(|(rank, (h, _))| h.rank != rank || h.world != world)
    {
        return Err(StageError::Burn {
            what: format!("{prefix}*.bin"),
            detail: format!("{world} rank files that are not the ranks of one save of {world}"),
        });
    }
    Ok(models)
}

/// This rank's values of every parameter of `layout` (layout order) from a ZeRO-3
/// checkpoint saved by any number of processes: its shard (over `world` processes) of a
/// parameter `numels` marks as sharded, the whole value of the others.
pub(crate) fn read_model(
    dir: &Path,
    prefix: &str,
    files: &[ManifestFile],
    layout: &ParamLayout,
    numels: &[Option<usize>],
    (rank, world): (usize, usize),
) -> Result<Vec<Vec<f32>>, StageError> {
    let models = read_models(dir, prefix, files)?;
    let Some((first, _)) = models.first() else {
        return Err(StageError::Burn {
            what: format!("{prefix}*.bin"),
            detail: "none in the checkpoint".into(),
        });
    };
    if first.entries.len() != layout.entries.len() {
        return Err(StageError::DoesNotFit {
            file: format!("{prefix}0.bin"),
            detail: format!(
                "{} parameters saved, this model has {}",
                first.entries.len(),
                layout.entries.len()
            ),
        });
    }
    let mut offsets = vec![0usize; models.len()];
    let mut out = Vec::with_capacity(layout.entries.len());
    for (i, (entry, numel)) in layout.entries.iter().zip(numels).enumerate() {
        let saved = &first.entries[i];
        let whole_numel = numel.unwrap_or(entry.numel);
        if saved.path != entry.path || saved.numel != whole_numel {
            return Err(StageError::DoesNotFit {
                file: format!("{prefix}0.bin"),
                detail: format!(
                    "parameter #{i} was saved as {} of {} elements, this model has {} of {}",
                    saved.path, saved.numel, entry.path, whole_numel
                ),
            });
        }
        let mut whole = Vec::with_capacity(saved.numel);
        for ((header, values), offset) in models.iter().zip(offsets.iter_mut()) {
            let len = header.entries[i].len;
            whole.extend_from_slice(&values[*offset..*offset + len]);
            *offset += len;
        }
        whole.truncate(saved.numel);
        if whole.len() != saved.numel {
            return Err(StageError::DoesNotFit {
                file: format!("{prefix}*.bin"),
                detail: format!("{}: the saved shards do not cover it", saved.path),
            });
        }
        out.push(match numel {
            Some(numel) => cut(&whole, *numel, rank, world),
            None => whole,
        });
    }
    Ok(out)
}

/// Rank `rank`'s shard of `whole` (`numel` elements) over `world` ranks, padded with zeros.
fn cut(whole: &[f32], numel: usize, rank: usize, world: usize) -> Vec<f32> {
    let len = shard_len(numel, world);
    let start = rank.saturating_mul(len).min(whole.len());
    let end = start.saturating_add(len).min(whole.len());
    let mut shard = whole[start..end].to_vec();
    shard.resize(len, 0.0);
    shard
}

/// The directory of one rank's Burn optimizer record in a ZeRO-3 checkpoint.
pub(crate) fn burn_record_dir(rank: usize) -> String {
    format!("{BURN_RECORD_PREFIX}{rank}")
}

/// Ranks whose Burn optimizer record the checkpoint's `files` hold.
pub(crate) fn burn_record_ranks(files: &[ManifestFile]) -> usize {
    files
        .iter()
        .filter(|f| f.name.starts_with(BURN_RECORD_PREFIX))
        .count()
}

/// Names this rank's fused state file as a ZeRO-3 checkpoint keeps it.
pub(crate) fn state_file_name(rank: usize) -> String {
    format!("{STATE_PREFIX}{rank}.bin")
}

/// The fused optimizer state for this rank's new `segments` (the one-process buffers over its
/// shards), put together from every saved rank's state file and cut again; `numel_of` gives
/// the whole parameter's elements for a segment that is a shard.
pub(crate) fn reshard_state(
    dir: &Path,
    files: &[ManifestFile],
    segments: &[Segment],
    numel_of: &dyn Fn(&Segment) -> Option<usize>,
    (rank, world): (usize, usize),
) -> Result<FusedStateFile, StageError> {
    let mut saved = Vec::new();
    for file in files.iter().filter(|f| f.name.starts_with(STATE_PREFIX)) {
        let rank: usize = file.name[STATE_PREFIX.len()..]
            .trim_end_matches(".bin")
            .parse()
            .map_err(|_| StageError::Burn {
                what: file.name.clone(),
                detail: "not a rank's file name".into(),
            })?;
        let path = dir.join(&file.name);
        let bytes = std::fs::read(&path).map_err(|source| StageError::Io { path, source })?;
        let state =
            FusedStateFile::from_bytes(&bytes).map_err(|source| StageError::FusedStateFile {
                file: file.name.clone(),
                source,
            })?;
        saved.push((rank, state));
    }
    saved.sort_by_key(|(rank, _)| *rank);
    let saved: Vec<FusedStateFile> = saved.into_iter().map(|(_, state)| state).collect();
    let Some(first) = saved.first() else {
        return Err(StageError::FusedState(FusedStateError::NoBuffer(
            "ZeRO-3 optimizer state".into(),
        )));
    };
    if saved.iter().any(|s| s.segments.len() != segments.len()) {
        return Err(FusedStateError::OtherParameters.into());
    }
    let len = segments.iter().map(|s| s.len).sum();
    let mut buffers = std::collections::BTreeMap::new();
    for name in first.buffers.keys() {
        let mut buffer = Vec::with_capacity(len);
        for (j, segment) in segments.iter().enumerate() {
            let mut whole = Vec::new();
            let parts = match numel_of(segment) {
                Some(_) => &saved[..],
                None => &saved[..1],
            };
            for state in parts {
                let values = state
                    .buffers
                    .get(name)
                    .ok_or_else(|| FusedStateError::NoBuffer(name.clone()))?;
                let old = &state.segments[j];
                let part = values
                    .get(old.offset..old.offset + old.len)
                    .ok_or_else(|| FusedStateError::Uncovered {
                        len: old.len,
                        name: name.clone(),
                    })?;
                whole.extend_from_slice(part);
            }
            match numel_of(segment) {
                Some(numel) => {
                    whole.truncate(numel);
                    buffer.extend(cut(&whole, numel, rank, world));
                }
                None => buffer.extend(whole),
            }
        }
        if buffer.len() != len {
            return Err(FusedStateError::OtherParameters.into());
        }
        buffers.insert(name.clone(), buffer);
    }
    Ok(FusedStateFile {
        optimizer: first.optimizer.clone(),
        segments: segments.to_vec(),
        len,
        shard_start: 0,
        times: first.times.clone(),
        buffers,
    })
}
