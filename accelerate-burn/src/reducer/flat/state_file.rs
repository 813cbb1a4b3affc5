//! The fused optimizer's state as a checkpoint stores it: one file per saving rank, a JSON
//! header line (optimizer, segments, counts, buffer lengths), then the buffers as
//! little-endian f32. Shards of any world size load into any other.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::fused::FusedOptimizer;

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
        for values in self.buffers.values() {
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    /// Reads what [`to_bytes`](Self::to_bytes) wrote.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let split = bytes
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("no header line")?;
        let header: FusedStateHeader =
            serde_json::from_slice(&bytes[..split]).map_err(|e| e.to_string())?;
        let mut data = bytes[split + 1..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        let mut buffers = BTreeMap::new();
        for (name, len) in header.buffers {
            let values: Vec<f32> = data.by_ref().take(len).collect();
            if values.len() != len {
                return Err(format!("buffer `{name}` is truncated"));
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
