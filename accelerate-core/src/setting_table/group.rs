//! The process group's settings (`GroupOptions`): timeouts, transport, algorithms and the
//! transports' chunk sizes.

use std::time::Duration;

use super::{Setting, any, chunk_bytes, parse_from, parse_string, positive_duration};
use crate::env_vars;
use crate::settings::{AllReduceAlgorithm, TransportChoice};

const SECONDS: &str = "a positive number of seconds, at most 2592000 (30 days)";

/// Longest wait of any collective.
pub const TIMEOUT: Setting<Duration> = Setting {
    key: "timeout",
    flag: None,
    env: env_vars::TIMEOUT,
    expected: SECONDS,
    parse: crate::wait::seconds,
    valid: positive_duration,
};

/// Longest wait for the group to form.
pub const RENDEZVOUS_TIMEOUT: Setting<Duration> = Setting {
    key: "rendezvous_timeout",
    flag: None,
    env: env_vars::RENDEZVOUS_TIMEOUT,
    expected: SECONDS,
    parse: crate::wait::seconds,
    valid: positive_duration,
};

/// How long a TCP peer may show no sign of life.
pub const HEARTBEAT_TIMEOUT: Setting<Duration> = Setting {
    key: "heartbeat_timeout",
    flag: None,
    env: env_vars::HEARTBEAT_TIMEOUT,
    expected: SECONDS,
    parse: crate::wait::seconds,
    valid: positive_duration,
};

/// Shared memory inside hosts and TCP between them, for groups spanning hosts.
pub const HIERARCHICAL: Setting<bool> = Setting {
    key: "hierarchical",
    flag: None,
    env: env_vars::HIERARCHICAL,
    expected: "true or false",
    parse: env_vars::parse_bool,
    valid: any,
};

/// The transport.
pub const TRANSPORT: Setting<TransportChoice> = Setting {
    key: "transport",
    flag: None,
    env: env_vars::TRANSPORT,
    expected: TransportChoice::EXPECTED,
    parse: parse_from,
    valid: any,
};

/// The all-reduce algorithm of the message transports.
pub const ALL_REDUCE_ALGORITHM: Setting<AllReduceAlgorithm> = Setting {
    key: "all_reduce_algorithm",
    flag: None,
    env: env_vars::ALL_REDUCE_ALGORITHM,
    expected: AllReduceAlgorithm::EXPECTED,
    parse: parse_from,
    valid: any,
};

/// The job secret.
pub const JOB_TOKEN: Setting<String> = Setting {
    key: "job_token",
    flag: None,
    env: env_vars::JOB_TOKEN,
    expected: "a secret",
    parse: parse_string,
    valid: any,
};

const CHUNK: &str = "a number of bytes from 4096 to 1073741824 (1 GiB)";

/// Bytes of each shared-memory slot.
pub const SHM_SLOT_BYTES: Setting<usize> = Setting {
    key: "shm_slot_bytes",
    flag: None,
    env: env_vars::SHM_SLOT_BYTES,
    expected: CHUNK,
    parse: parse_from,
    valid: chunk_bytes,
};

/// Largest ring chunk of the message transports.
pub const RING_SEGMENT_BYTES: Setting<usize> = Setting {
    key: "ring_segment_bytes",
    flag: None,
    env: env_vars::RING_SEGMENT_BYTES,
    expected: CHUNK,
    parse: parse_from,
    valid: chunk_bytes,
};
