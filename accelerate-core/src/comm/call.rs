//! What a collective call is, as every rank must agree on it, and the fixed-size header that
//! carries it with every message.

use std::fmt;

use accelerate_kernels::{DType, ReduceOp};

use crate::error::CommError;

/// The collective operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    /// `all_reduce`.
    AllReduce = 1,
    /// `broadcast`.
    Broadcast = 2,
    /// `all_gather`.
    AllGather = 3,
    /// `reduce_scatter`.
    ReduceScatter = 4,
    /// `barrier`.
    Barrier = 5,
    /// Not a collective: a rank failed and tells its peers why.
    Abort = 6,
    /// Group set-up (connections, shared memory mapping).
    Setup = 7,
    /// `shared_buffer`: every rank allocates a buffer its peers can read.
    CreateBuffer = 8,
    /// `all_reduce_shared`: an all-reduce in place on shared buffers.
    AllReduceShared = 9,
}

impl OpKind {
    /// The API name ("all_reduce", ...).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Barrier => "barrier",
            OpKind::Abort => "abort",
            OpKind::Setup => "setup",
            OpKind::CreateBuffer => "shared_buffer",
            OpKind::AllReduceShared => "all_reduce_shared",
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => OpKind::AllReduce,
            2 => OpKind::Broadcast,
            3 => OpKind::AllGather,
            4 => OpKind::ReduceScatter,
            5 => OpKind::Barrier,
            6 => OpKind::Abort,
            7 => OpKind::Setup,
            8 => OpKind::CreateBuffer,
            9 => OpKind::AllReduceShared,
            _ => return None,
        })
    }
}

/// One collective call, as every rank must make it: the operation, its sequence number in the
/// group, the element count, type, reduction and root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallDesc {
    /// The operation.
    pub op: OpKind,
    /// Calls made by this group before this one.
    pub seq: u64,
    /// Elements per rank (for all_gather: each rank's contribution; for reduce_scatter: the
    /// whole input).
    pub count: u64,
    /// Element type; `None` for raw bytes and barriers.
    pub dtype: Option<DType>,
    /// Reduction, for all_reduce and reduce_scatter.
    pub reduce: Option<ReduceOp>,
    /// Root rank, for broadcast; for a reduce-scatter onto chunks of unequal counts, a
    /// fingerprint of the counts (ranks that cut differently then disagree on the call).
    pub root: Option<u32>,
    /// Shared buffer id, for `shared_buffer` and `all_reduce_shared`.
    pub buffer: Option<u32>,
}

impl CallDesc {
    /// The element type and reduction of a reducing call (`all_reduce`, `reduce_scatter`,
    /// `all_reduce_shared`), which every engine reads from here: the process group sets both
    /// before any engine sees the call, so their absence is a bug, reported as a usage error
    /// of `rank`.
    pub fn reduction(&self, rank: usize) -> Result<(DType, ReduceOp), CommError> {
        match (self.dtype, self.reduce) {
            (Some(dtype), Some(op)) => Ok((dtype, op)),
            _ => Err(CommError::Usage {
                op: self.op.name(),
                rank,
                reason: format!("the call {self} names no element type or reduction"),
            }),
        }
    }

    /// A call of `op` with nothing else specified.
    pub fn new(op: OpKind, seq: u64) -> Self {
        Self {
            op,
            seq,
            count: 0,
            dtype: None,
            reduce: None,
            root: None,
            buffer: None,
        }
    }

    /// Packs the call into four words (for shared-memory publication).
    pub(crate) fn pack(&self) -> [u64; 4] {
        let dtype = self.dtype.map_or(0xFF, |d| d as u8);
        let reduce = self.reduce.map_or(0xFF, |r| r as u8);
        let root = self.root.map_or(u32::MAX, |r| r);
        [
            u64::from(self.op as u8)
                | u64::from(dtype) << 8
                | u64::from(reduce) << 16
                | u64::from(root) << 32,
            self.seq,
            self.count,
            self.buffer.map_or(u64::MAX, u64::from),
        ]
    }

    /// The inverse of [`pack`](Self::pack); `None` for words that no call packs to.
    pub(crate) fn unpack(words: [u64; 4]) -> Option<Self> {
        // Bits 24..32 are unused: set, they are not a call this code packed.
        if (words[0] >> 24) as u8 != 0 {
            return None;
        }
        let op = OpKind::from_code(words[0] as u8)?;
        let dtype = match (words[0] >> 8) as u8 {
            0xFF => None,
            code => Some(DType::from_code(code)?),
        };
        let reduce = match (words[0] >> 16) as u8 {
            0xFF => None,
            0 => Some(ReduceOp::Sum),
            1 => Some(ReduceOp::Max),
            2 => Some(ReduceOp::Min),
            _ => return None,
        };
        let root = match (words[0] >> 32) as u32 {
            u32::MAX => None,
            r => Some(r),
        };
        let buffer = match words[3] {
            u64::MAX => None,
            id => Some(u32::try_from(id).ok()?),
        };
        Some(Self {
            op,
            seq: words[1],
            count: words[2],
            dtype,
            reduce,
            root,
            buffer,
        })
    }
}

impl fmt::Display for CallDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{}", self.op.name(), self.seq)?;
        if self.op == OpKind::Barrier {
            return Ok(());
        }
        write!(
            f,
            " ({} x {}",
            self.count,
            self.dtype.map_or("bytes", DType::name)
        )?;
        if let Some(r) = self.reduce {
            write!(f, ", {}", r.name())?;
        }
        match (self.op, self.root) {
            (OpKind::ReduceScatter, Some(fingerprint)) => {
                write!(f, ", counts {fingerprint:08x}")?;
            }
            (_, Some(root)) => write!(f, ", root {root}")?,
            _ => {}
        }
        if let Some(buffer) = self.buffer {
            write!(f, ", buffer {buffer}")?;
        }
        write!(f, ")")
    }
}

/// Bytes of a [`Header`] on the wire.
pub const HEADER_BYTES: usize = 48;
const MAGIC: u32 = 0x4143_4331; // "ACC1"

/// The header in front of every message of the message-passing transports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The call this message belongs to.
    pub call: CallDesc,
    /// Rank that sent it.
    pub sender: u32,
    /// Bytes of payload that follow.
    pub payload_len: u64,
}

impl Header {
    /// Encodes into the fixed wire form (little-endian).
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let words = self.call.pack();
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&self.sender.to_le_bytes());
        out[8..16].copy_from_slice(&words[0].to_le_bytes());
        out[16..24].copy_from_slice(&words[1].to_le_bytes());
        out[24..32].copy_from_slice(&words[2].to_le_bytes());
        out[32..40].copy_from_slice(&words[3].to_le_bytes());
        out[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        out
    }

    /// Decodes the wire form; `None` when it is not one of ours.
    pub fn decode(bytes: &[u8; HEADER_BYTES]) -> Option<Self> {
        let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().unwrap_or([0; 8]));
        if u32::from_le_bytes(bytes[0..4].try_into().ok()?) != MAGIC {
            return None;
        }
        Some(Self {
            sender: u32::from_le_bytes(bytes[4..8].try_into().ok()?),
            call: CallDesc::unpack([word(8), word(16), word(24), word(32)])?,
            payload_len: word(40),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_describe_the_call() {
        let call = CallDesc {
            op: OpKind::AllReduce,
            seq: 12,
            count: 100,
            dtype: Some(DType::BF16),
            reduce: Some(ReduceOp::Max),
            root: None,
            buffer: Some(3),
        };
        let h = Header {
            call,
            sender: 3,
            payload_len: 200,
        };
        assert_eq!(Header::decode(&h.encode()), Some(h));
        assert_eq!(
            call.to_string(),
            "all_reduce #12 (100 x bf16, max, buffer 3)"
        );
        let b = CallDesc {
            root: Some(2),
            ..CallDesc::new(OpKind::Broadcast, 1)
        };
        assert_eq!(CallDesc::unpack(b.pack()), Some(b));
        assert_eq!(b.to_string(), "broadcast #1 (0 x bytes, root 2)");
        assert_eq!(CallDesc::new(OpKind::Barrier, 4).to_string(), "barrier #4");
        assert_eq!(Header::decode(&[0u8; HEADER_BYTES]), None);
    }
}
