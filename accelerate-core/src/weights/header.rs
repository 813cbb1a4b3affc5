//! The safetensors header: 8 bytes of little-endian length, then JSON naming each tensor's
//! dtype, shape and byte range in the data that follows (and an optional `__metadata__` map of
//! strings). Read without the data; encoded for a file whose tensors we lay out ourselves.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use super::{WeightsError, io, malformed};

/// The largest header read (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100_000_000;
/// Bytes of the header's length prefix.
const LENGTH_PREFIX: u64 = 8;
/// Key of the metadata map among the tensors.
const METADATA_KEY: &str = "__metadata__";

/// One tensor as a header describes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TensorEntry {
    /// The dtype's name (`F32`, `BF16`, `I64`, ...).
    pub dtype: String,
    /// The dimensions.
    pub shape: Vec<u64>,
    /// Start and end of its bytes, relative to the end of the header.
    pub data_offsets: [u64; 2],
}

impl TensorEntry {
    /// Elements in the tensor (`None` when the product overflows).
    pub fn elements(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |n, d| n.checked_mul(*d))
    }

    /// Bytes of its data, as the offsets give them.
    pub fn byte_len(&self) -> u64 {
        self.data_offsets[1].saturating_sub(self.data_offsets[0])
    }
}

/// A safetensors file's header.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Header {
    /// The `__metadata__` map (empty when the file has none).
    pub metadata: BTreeMap<String, String>,
    /// The tensors by name.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Where the data starts in the file (length prefix and header).
    pub data_start: u64,
}

impl Header {
    /// True when accelerate-rs wrote the file ([`super::SAVED_BY`] in its metadata).
    pub fn is_ours(&self) -> bool {
        self.metadata.get(super::SAVED_BY_KEY).map(String::as_str) == Some(super::SAVED_BY)
    }
}

/// Bytes per element of the safetensors dtype `dtype`; `None` for a dtype smaller than a
/// byte (`F4`, `F6_*`: the header check knows their packed sizes) or one this version does
/// not know.
pub fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" | "C64" => 8,
        _ => return None,
    })
}

/// Bits per element of the safetensors dtype `dtype`, the sub-byte ones (`F4`, `F6_*`,
/// packed) included; `None` for a dtype this version does not know.
fn dtype_bits(dtype: &str) -> Option<u64> {
    match dtype {
        "F4" => Some(4),
        "F6_E2M3" | "F6_E3M2" => Some(6),
        _ => dtype_size(dtype).map(|bytes| bytes * 8),
    }
}

/// Reads the header of the safetensors file at `path`, never its data, and checks every
/// tensor's byte range: inside the file, and as long as its shape and dtype make it.
pub fn read_header(path: &Path) -> Result<Header, WeightsError> {
    let mut file = std::fs::File::open(path).map_err(io("opening", path))?;
    let file_len = file
        .metadata()
        .map_err(io("reading the size of", path))?
        .len();
    let mut prefix = [0u8; LENGTH_PREFIX as usize];
    file.read_exact(&mut prefix)
        .map_err(|e| malformed(path, format!("no safetensors header ({e})")))?;
    let length = u64::from_le_bytes(prefix);
    if length > MAX_HEADER {
        return Err(malformed(
            path,
            format!(
                "the header claims {length} bytes, more than safetensors allows: not a \
                 safetensors file?"
            ),
        ));
    }
    let mut json = Vec::new();
    file.take(length)
        .read_to_end(&mut json)
        .map_err(io("reading", path))?;
    if json.len() as u64 != length {
        return Err(malformed(
            path,
            format!("the header is cut short ({} of {length} bytes)", json.len()),
        ));
    }
    let entries: BTreeMap<String, serde_json::Value> = serde_json::from_slice(&json)
        .map_err(|e| malformed(path, format!("the header is not safetensors' JSON: {e}")))?;
    let data_start = LENGTH_PREFIX + length;
    let data_len = file_len.saturating_sub(data_start);
    let mut header = Header {
        data_start,
        ..Header::default()
    };
    for (name, value) in entries {
        if name == METADATA_KEY {
            header.metadata = serde_json::from_value(value)
                .map_err(|e| malformed(path, format!("__metadata__: {e}")))?;
            continue;
        }
        let entry: TensorEntry = serde_json::from_value(value)
            .map_err(|e| malformed(path, format!("tensor {name:?}: {e}")))?;
        check_entry(path, &name, &entry, data_len)?;
        header.tensors.insert(name, entry);
    }
    Ok(header)
}

/// Fails unless `entry`'s bytes lie inside `data_len` bytes of data and are exactly what its
/// shape and dtype take: a dtype whose size is unknown cannot be checked, so it is refused
/// (counting its elements unchecked would let a header claim any number).
fn check_entry(
    path: &Path,
    name: &str,
    entry: &TensorEntry,
    data_len: u64,
) -> Result<(), WeightsError> {
    let [start, end] = entry.data_offsets;
    if start > end || end > data_len {
        return Err(malformed(
            path,
            format!(
                "tensor {name:?}: bytes {start}..{end} are not inside the file's {data_len} \
                 bytes of data (a truncated file?)"
            ),
        ));
    }
    let elements = entry.elements().ok_or_else(|| {
        malformed(
            path,
            format!("tensor {name:?}: its shape {:?} overflows", entry.shape),
        )
    })?;
    let Some(bits) = dtype_bits(&entry.dtype) else {
        return Err(malformed(
            path,
            format!(
                "tensor {name:?}: dtype {:?} is not one this version of accelerate-rs knows, so \
                 its size cannot be checked",
                entry.dtype
            ),
        ));
    };
    let bytes = elements.checked_mul(bits).map(|bits| bits.div_ceil(8));
    if bytes != Some(end - start) {
        return Err(malformed(
            path,
            format!(
                "tensor {name:?}: {elements} {} values take {}, not the {} bytes its offsets \
                 give",
                entry.dtype,
                bytes.map_or("more than 2^64 bytes".to_string(), |b| format!("{b} bytes")),
                end - start
            ),
        ));
    }
    Ok(())
}

/// The bytes that open a safetensors file holding `tensors` (offsets as given) and
/// `metadata`: the length prefix and the JSON, padded with spaces to a multiple of 8 so that
/// the data that follows starts aligned.
pub(super) fn encode(
    metadata: &BTreeMap<String, String>,
    tensors: &BTreeMap<String, TensorEntry>,
) -> Result<Vec<u8>, serde_json::Error> {
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert(METADATA_KEY.into(), serde_json::to_value(metadata)?);
    }
    for (name, entry) in tensors {
        map.insert(name.clone(), serde_json::to_value(entry)?);
    }
    let mut json = serde_json::to_vec(&map)?;
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    Ok(bytes)
}

/// Writes a safetensors file of the JSON `header` (as given) and `data` zero bytes, for tests.
#[cfg(test)]
pub(crate) fn write_test_file(path: &Path, header: &str, data: usize) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data, 0);
    std::fs::write(path, bytes).unwrap();
}

#[cfg(test)]
mod tests {
    use super::write_test_file as write;
    use super::*;

    #[test]
    fn a_header_is_read_and_its_ranges_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("m.safetensors");
        let ok = r#"{"__metadata__":{"format":"pt"},
            "w":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]},
            "b":{"dtype":"BF16","shape":[4],"data_offsets":[48,56]}}"#;
        write(&path, ok, 56);
        let header = read_header(&path).unwrap();
        assert_eq!(header.metadata["format"], "pt");
        assert_eq!(header.tensors["w"].byte_len(), 48);
        assert_eq!(header.data_start, 8 + ok.len() as u64);

        // Cut short: the last tensor's bytes are not in the file.
        write(&path, ok, 50);
        let err = read_header(&path).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
        // Offsets that disagree with the shape.
        write(
            &path,
            r#"{"w":{"dtype":"F32","shape":[3,4],"data_offsets":[0,40]}}"#,
            48,
        );
        let err = read_header(&path).unwrap_err().to_string();
        assert!(err.contains("not the 40"), "{err}");
        // A shape whose product overflows.
        write(
            &path,
            r#"{"w":{"dtype":"X9","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#,
            0,
        );
        assert!(
            read_header(&path)
                .unwrap_err()
                .to_string()
                .contains("overflows")
        );
        // A dtype of unknown size claiming 2^62 elements in 4 bytes: refused, not counted.
        write(
            &path,
            r#"{"w":{"dtype":"F9","shape":[4611686018427387904],"data_offsets":[0,4]}}"#,
            4,
        );
        let err = read_header(&path).unwrap_err().to_string();
        assert!(err.contains("\"F9\" is not one"), "{err}");
        // Packed 4-bit floats: 5 values in 3 bytes.
        write(
            &path,
            r#"{"w":{"dtype":"F4","shape":[5],"data_offsets":[0,3]}}"#,
            3,
        );
        assert_eq!(read_header(&path).unwrap().tensors["w"].byte_len(), 3);
        // Not a safetensors file at all.
        std::fs::write(&path, u64::MAX.to_le_bytes()).unwrap();
        assert!(
            read_header(&path)
                .unwrap_err()
                .to_string()
                .contains("not a safetensors")
        );
    }

    #[test]
    fn an_encoded_header_reads_back_and_leaves_the_data_aligned() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("m.safetensors");
        let mut tensors = BTreeMap::new();
        tensors.insert(
            "x".to_string(),
            TensorEntry {
                dtype: "F16".into(),
                shape: vec![3],
                data_offsets: [0, 6],
            },
        );
        let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let mut bytes = encode(&metadata, &tensors).unwrap();
        assert_eq!(bytes.len() % 8, 0);
        bytes.extend_from_slice(&[1, 2, 3, 4, 5, 6]);
        std::fs::write(&path, bytes).unwrap();
        let header = read_header(&path).unwrap();
        assert_eq!((header.metadata, header.tensors), (metadata, tensors));
    }
}
