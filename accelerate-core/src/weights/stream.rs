//! Writing a safetensors file whose tensors arrive one at a time: the header is laid out first
//! from the names, dtypes and shapes, then each tensor's bytes are written as they are made,
//! so a writer holds one tensor at a time (a ZeRO-3 model gathers each parameter in turn).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use super::header::{self, TensorEntry, dtype_size};
use super::{WeightsError, io, malformed};

/// One tensor of a file written by [`write_streamed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamedTensor {
    /// Its name in the file (a module path, `layers.0.weight`).
    pub name: String,
    /// The safetensors dtype (`F32`, `BF16`, ...).
    pub dtype: String,
    /// The dimensions.
    pub shape: Vec<u64>,
}

impl StreamedTensor {
    /// Bytes of its data; `None` for a dtype this version does not know, or a size that
    /// overflows.
    pub fn byte_len(&self) -> Option<u64> {
        let elements = self.shape.iter().try_fold(1u64, |n, d| n.checked_mul(*d))?;
        elements.checked_mul(dtype_size(&self.dtype)?)
    }
}

/// Writes a safetensors file at `path` holding `tensors` in this order with `metadata`;
/// `next(i)` makes tensor `i`'s bytes when they are due. Bytes of another length than the
/// tensor's are an error. `path` must be the caller's own (a temporary file of
/// [`replace_file`](crate::checkpoint::replace_file), a staging directory's): what is there
/// is written over. Returns the bytes of data.
pub fn write_streamed(
    path: &Path,
    tensors: &[StreamedTensor],
    metadata: &BTreeMap<String, String>,
    mut next: impl FnMut(usize) -> Result<Vec<u8>, WeightsError>,
) -> Result<u64, WeightsError> {
    let mut entries = BTreeMap::new();
    let mut offset = 0u64;
    for tensor in tensors {
        let len = tensor.byte_len().ok_or_else(|| {
            malformed(
                path,
                format!(
                    "tensor {:?}: no size for {} of shape {:?}",
                    tensor.name, tensor.dtype, tensor.shape
                ),
            )
        })?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| malformed(path, "the tensors' bytes overflow"))?;
        let entry = TensorEntry {
            dtype: tensor.dtype.clone(),
            shape: tensor.shape.clone(),
            data_offsets: [offset, end],
        };
        if entries.insert(tensor.name.clone(), entry).is_some() {
            return Err(malformed(
                path,
                format!("tensor {:?} is named twice", tensor.name),
            ));
        }
        offset = end;
    }
    let header = header::encode(metadata, &entries)
        .map_err(|e| malformed(path, format!("encoding the header: {e}")))?;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(io("creating", path))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    out.write_all(&header).map_err(io("writing", path))?;
    for (i, tensor) in tensors.iter().enumerate() {
        let bytes = next(i)?;
        let expected = entries.get(&tensor.name).map_or(0, TensorEntry::byte_len);
        if bytes.len() as u64 != expected {
            return Err(malformed(
                path,
                format!(
                    "tensor {:?}: {} bytes made, its shape takes {expected}",
                    tensor.name,
                    bytes.len()
                ),
            ));
        }
        out.write_all(&bytes).map_err(io("writing", path))?;
    }
    out.flush().map_err(io("writing", path))?;
    Ok(offset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::read_header;

    #[test]
    fn a_streamed_file_reads_back_with_each_tensor_where_its_header_says() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("m.safetensors");
        let tensors = [
            StreamedTensor {
                name: "b.weight".into(),
                dtype: "F32".into(),
                shape: vec![2, 3],
            },
            StreamedTensor {
                name: "a.bias".into(),
                dtype: "F32".into(),
                shape: vec![3],
            },
        ];
        let values = |i: usize| -> Vec<f32> {
            let n = if i == 0 { 6 } else { 3 };
            (0..n).map(|v| (10 * i + v) as f32).collect()
        };
        let metadata = BTreeMap::from([("saved_by".to_string(), "test".to_string())]);
        let written = write_streamed(&path, &tensors, &metadata, |i| {
            Ok(values(i).iter().flat_map(|v| v.to_le_bytes()).collect())
        })
        .unwrap();
        assert_eq!(written, 36);
        let header = read_header(&path).unwrap();
        assert_eq!(header.metadata, metadata);
        let bytes = std::fs::read(&path).unwrap();
        for (i, tensor) in tensors.iter().enumerate() {
            let entry = &header.tensors[&tensor.name];
            let start = (header.data_start + entry.data_offsets[0]) as usize;
            let end = (header.data_start + entry.data_offsets[1]) as usize;
            let read: Vec<f32> = bytes[start..end]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(read, values(i));
        }
        // A tensor made with the wrong size is an error.
        let short = tmp.path().join("short.safetensors");
        let err = write_streamed(&short, &tensors, &metadata, |_| Ok(vec![0; 4])).unwrap_err();
        assert!(err.to_string().contains("4 bytes made"), "{err}");
    }
}
