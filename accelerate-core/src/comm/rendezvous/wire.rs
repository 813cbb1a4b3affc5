//! The rendezvous protocol's messages: what a rank says (its hello and settings), what rank 0
//! answers (probe, welcome, refusal, mismatch), and their decoders, which never panic on a
//! peer's bytes (the fuzz tests drive them).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Hex digits of a line's tag.
pub(super) const TAG_HEX: usize = 64;
/// Longest line of the rendezvous protocol a rank accepts from a client (a hello is ~200 B).
pub const MAX_HELLO_BYTES: usize = 16 << 10;
/// Longest answer a rank accepts from rank 0 (the peer table: about 150 B per rank).
pub(super) const MAX_REPLY_BYTES: usize = 64 << 20;
/// The settings every rank of a group must share; compared at the rendezvous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSettings {
    /// `ACCELERATE_SHM_SLOT_BYTES`.
    pub shm_slot_bytes: u64,
    /// `ACCELERATE_RING_SEGMENT_BYTES`.
    pub segment_bytes: u64,
}

impl GroupSettings {
    /// The first setting that differs, as (ours, theirs).
    pub(super) fn difference(&self, theirs: &Self) -> Option<(String, String)> {
        let pair = |name: &str, a: u64, b: u64| {
            (
                format!("runs with {name}={a}"),
                format!("runs with {name}={b}"),
            )
        };
        if self.shm_slot_bytes != theirs.shm_slot_bytes {
            return Some(pair(
                crate::env_vars::SHM_SLOT_BYTES,
                self.shm_slot_bytes,
                theirs.shm_slot_bytes,
            ));
        }
        if self.segment_bytes != theirs.segment_bytes {
            return Some(pair(
                crate::env_vars::RING_SEGMENT_BYTES,
                self.segment_bytes,
                theirs.segment_bytes,
            ));
        }
        None
    }
}

/// What one rank tells rank 0 once authenticated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Its rank.
    pub rank: usize,
    /// The world size it expects.
    pub world_size: usize,
    /// Its host identity.
    pub host: String,
    /// Where it accepts peer connections.
    pub listen: SocketAddr,
    /// Its settings.
    pub settings: GroupSettings,
}

/// Rank 0's messages to a rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Open the shared-memory segment and check it holds this cookie (hex).
    Probe {
        /// Random bytes rank 0 wrote into the segment.
        cookie: String,
    },
    /// The group formed.
    Welcome {
        /// Every rank, in rank order.
        peers: Vec<PeerInfo>,
        /// Whether the group uses shared memory.
        shared_memory: bool,
    },
    /// The group will not form, or not with this rank.
    Refused {
        /// Why, with a hint.
        reason: String,
    },
    /// Ranks differ in a setting they must share.
    Mismatch {
        /// The rank whose setting differs from rank 0's.
        rank: usize,
        /// Rank 0's side.
        rank0: String,
        /// That rank's side.
        theirs: String,
    },
}

/// A rank's answer to [`Reply::Probe`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeResult {
    /// `None` when the segment is there and holds the cookie; else why not.
    pub failure: Option<String>,
}

/// Another member of the group, as the rendezvous reported it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// Its rank.
    pub rank: usize,
    /// Its host identity (host name and boot id): equal identities share a machine.
    pub host: String,
    /// Where it accepts peer connections.
    pub listen: SocketAddr,
}

/// Why a peer's rendezvous line was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A hello longer than [`MAX_HELLO_BYTES`].
    #[error("a hello of {0} bytes")]
    HelloTooLong(usize),
    /// Not the JSON of a hello.
    #[error("not a hello: {0}")]
    NotHello(String),
    /// Not the JSON of a reply.
    #[error("not a reply: {0}")]
    NotReply(String),
    /// A peer table whose length is not the world size.
    #[error("a peer table of {ranks} ranks for a group of {world_size}")]
    TableSize {
        /// Entries in the table.
        ranks: usize,
        /// The world size expected.
        world_size: usize,
    },
    /// A peer table out of rank order.
    #[error("entry {entry} of the peer table is rank {rank}")]
    TableOrder {
        /// The entry's index.
        entry: usize,
        /// The rank it names.
        rank: usize,
    },
}

/// Decodes a hello line from a client (what rank 0 accepts; never panics).
pub fn decode_hello(line: &[u8]) -> Result<Hello, WireError> {
    if line.len() > MAX_HELLO_BYTES {
        return Err(WireError::HelloTooLong(line.len()));
    }
    serde_json::from_slice(line).map_err(|e| WireError::NotHello(e.to_string()))
}

/// Decodes rank 0's reply and checks a peer table against the expected world size (what
/// other ranks accept; never panics).
pub fn decode_reply(line: &[u8], world_size: usize) -> Result<Reply, WireError> {
    let reply: Reply =
        serde_json::from_slice(line).map_err(|e| WireError::NotReply(e.to_string()))?;
    if let Reply::Welcome { peers, .. } = &reply {
        if peers.len() != world_size {
            return Err(WireError::TableSize {
                ranks: peers.len(),
                world_size,
            });
        }
        if let Some((i, p)) = peers.iter().enumerate().find(|(i, p)| p.rank != *i) {
            return Err(WireError::TableOrder {
                entry: i,
                rank: p.rank,
            });
        }
    }
    Ok(reply)
}

/// The shared-memory cookie of a [`Reply::Probe`] from its hex spelling.
pub(super) fn parse_cookie(hex: &str) -> Option<[u8; 16]> {
    super::secret::unhex(hex)?.try_into().ok()
}
