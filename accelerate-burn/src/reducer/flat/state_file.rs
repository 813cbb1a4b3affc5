//! The fused optimizer's state as a checkpoint stores it: one file per saving rank, a JSON
//! header line (optimizer, segments, counts, buffer lengths), then the buffers as
//! little-endian f32. Shards of any world size load into any other.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::fused::FusedOptimizer;
pub(crate) use crate::stage_error::FusedStateError;

/// One trainable float parameter's place in the flat buffers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Segment {
    /// Burn's parameter id.
    pub id: u64,
    /// Module path, for per-group learning rates.
    pub path: String,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// First element in the flat buffers.
    pub offset: usize,
    /// Elements.
    pub len: usize,
}

/// The optimizer state of one rank, as a checkpoint stores it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FusedStateFile {
    pub optimizer: FusedOptimizer,
    pub segments: Vec<Segment>,
    pub len: usize,
    pub shard_start: usize,
    pub times: Vec<i32>,
    /// Named state buffers over this rank's shard.
    pub buffers: BTreeMap<String, Vec<f32>>,
}

impl FusedStateFile {
    /// A JSON header line, then the buffers as little-endian f32.
    pub fn to_bytes(&self) -> Vec<u8> {
        let header = FusedStateHeader {
            optimizer: self.optimizer.clone(),
            segments: self.segments.clone(),
            len: self.len,
            shard_start: self.shard_start,
            times: self.times.clone(),
            buffers: self
                .buffers
                .iter()
                .map(|(k, v)| (k.clone(), v.len()))
                .collect(),
        };
        let mut out = serde_json::to_vec(&header).unwrap_or_default();
        out.push(b'\n');
        let values: usize = self.buffers.values().map(Vec::len).sum();
        out.reserve(values.saturating_mul(4));
        for values in self.buffers.values() {
            crate::params::extend_le_bytes(&mut out, values);
        }
        out
    }

    /// Reads what [`to_bytes`](Self::to_bytes) wrote.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, FusedStateError> {
        let split = bytes
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(FusedStateError::NoHeader)?;
        let header: FusedStateHeader = serde_json::from_slice(&bytes[..split])
            .map_err(|e| FusedStateError::Header(e.to_string()))?;
        let mut data = bytes[split + 1..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        let mut buffers = BTreeMap::new();
        for (name, len) in header.buffers {
            let values: Vec<f32> = data.by_ref().take(len).collect();
            if values.len() != len {
                return Err(FusedStateError::Truncated(name));
            }
            buffers.insert(name, values);
        }
        Ok(Self {
            optimizer: header.optimizer,
            segments: header.segments,
            len: header.len,
            shard_start: header.shard_start,
            times: header.times,
            buffers,
        })
    }
}

#[derive(Serialize, Deserialize)]
struct FusedStateHeader {
    optimizer: FusedOptimizer,
    segments: Vec<Segment>,
    len: usize,
    shard_start: usize,
    times: Vec<i32>,
    buffers: Vec<(String, usize)>,
}

#[cfg(test)]
mod tests {
    use burn::optim::AdamWConfig;
    use proptest::prelude::*;

    use super::*;

    fn valid() -> FusedStateFile {
        FusedStateFile {
            optimizer: FusedOptimizer::adamw(&AdamWConfig::new()).unwrap(),
            segments: vec![Segment {
                id: 7,
                path: "layer.weight".into(),
                shape: vec![2, 3],
                offset: 0,
                len: 6,
            }],
            len: 6,
            shard_start: 0,
            times: vec![3],
            buffers: [("m", 6), ("v", 6)]
                .into_iter()
                .map(|(name, n)| (name.to_string(), (0..n).map(|i| i as f32).collect()))
                .collect(),
        }
    }

    #[test]
    fn a_state_file_reads_back_as_written() {
        let file = valid();
        assert_eq!(FusedStateFile::from_bytes(&file.to_bytes()), Ok(file));
    }

    proptest! {
        /// A state file damaged on disk (or not one at all) is an error, never a panic.
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = FusedStateFile::from_bytes(&bytes);
        }

        #[test]
        fn damaged_state_files_never_panic(
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
            cut in any::<usize>(),
        ) {
            let mut bytes = valid().to_bytes();
            let n = bytes.len();
            for (i, x) in flips {
                bytes[i % n] ^= x;
            }
            bytes.truncate(cut % (n + 1));
            let _ = FusedStateFile::from_bytes(&bytes);
        }
    }
}
