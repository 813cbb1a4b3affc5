//! `GroupOptions`: timeouts, transport and algorithm choices of a process group, from code or
//! from `ACCELERATE_*` variables.

use std::time::Duration;

use super::collective::AllReduceAlgorithm;
use super::transport::shm::DEFAULT_SLOT_BYTES;
use crate::env_vars::{EnvSource, ProcessEnv};
use crate::error::ConfigError;
use crate::setting_table::{self as table, GivenBy, Resolver};
pub use crate::settings::TransportChoice;

/// How a process group forms and behaves. Its `Debug` output never shows the token.
#[derive(Clone)]
pub struct GroupOptions {
    /// Longest wait of any collective (`ACCELERATE_TIMEOUT`, seconds; default 300).
    pub timeout: Duration,
    /// Longest wait for the group to form (`ACCELERATE_RENDEZVOUS_TIMEOUT`, seconds; default 300).
    pub rendezvous_timeout: Duration,
    /// How long a TCP peer may show no sign of life (its host vanished, the link was cut)
    /// before it is reported lost (`ACCELERATE_HEARTBEAT_TIMEOUT`, seconds; default 30). The
    /// kernel's keepalive probes answer for a peer that is merely busy, so a long step never
    /// trips it.
    pub heartbeat_timeout: Duration,
    /// Whether a group spanning hosts, with several ranks on some host, all-reduces through
    /// shared memory inside each host and TCP among one leader per host
    /// (`ACCELERATE_HIERARCHICAL`; default true, under `ACCELERATE_TRANSPORT=auto`).
    pub hierarchical: bool,
    /// Transport (`ACCELERATE_TRANSPORT`: auto, shm, tcp, mpi; default auto).
    pub transport: TransportChoice,
    /// All-reduce algorithm of the message transports (`ACCELERATE_ALL_REDUCE_ALGORITHM`:
    /// auto, ring, recursive_doubling; default auto).
    pub algorithm: AllReduceAlgorithm,
    /// Job secret every rank must prove it knows (`ACCELERATE_JOB_TOKEN`; default: drawn by
    /// rank 0 and shared through a private file on one host, required for jobs spanning
    /// hosts; see [`secret`](crate::comm::secret)).
    pub token: Option<String>,
    /// Bytes of each shared-memory slot (`ACCELERATE_SHM_SLOT_BYTES`; default 4 MiB).
    pub shm_slot_bytes: usize,
    /// Largest ring chunk of the message transports (`ACCELERATE_RING_SEGMENT_BYTES`;
    /// default 512 KiB: a chunk, its socket buffers and its reduction then stay in a core's
    /// cache; 4 MiB chunks halved the TCP bandwidth from 4 MiB messages on).
    pub segment_bytes: usize,
}

impl std::fmt::Debug for GroupOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupOptions")
            .field("timeout", &self.timeout)
            .field("rendezvous_timeout", &self.rendezvous_timeout)
            .field("heartbeat_timeout", &self.heartbeat_timeout)
            .field("hierarchical", &self.hierarchical)
            .field("transport", &self.transport)
            .field("algorithm", &self.algorithm)
            .field(
                "token",
                &self.token.as_ref().map(|_| crate::comm::secret::REDACTED),
            )
            .field("shm_slot_bytes", &self.shm_slot_bytes)
            .field("segment_bytes", &self.segment_bytes)
            .finish()
    }
}

impl Default for GroupOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            rendezvous_timeout: Duration::from_secs(300),
            heartbeat_timeout: Duration::from_secs(30),
            hierarchical: true,
            transport: TransportChoice::Auto,
            algorithm: AllReduceAlgorithm::Auto,
            token: None,
            shm_slot_bytes: DEFAULT_SLOT_BYTES,
            segment_bytes: 512 << 10,
        }
    }
}

impl GroupOptions {
    /// Defaults overridden by the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_source(&ProcessEnv)
    }

    /// Defaults overridden by `env` (the rows of [`crate::setting_table`]).
    pub fn from_source(env: &(impl EnvSource + ?Sized)) -> Result<Self, ConfigError> {
        let settings = Resolver::new(env, GivenBy::Code, None);
        let d = Self::default();
        Ok(Self {
            timeout: settings.get_or(&table::TIMEOUT, None, None, d.timeout)?,
            rendezvous_timeout: settings.get_or(
                &table::RENDEZVOUS_TIMEOUT,
                None,
                None,
                d.rendezvous_timeout,
            )?,
            heartbeat_timeout: settings.get_or(
                &table::HEARTBEAT_TIMEOUT,
                None,
                None,
                d.heartbeat_timeout,
            )?,
            hierarchical: settings.get_or(&table::HIERARCHICAL, None, None, d.hierarchical)?,
            transport: settings.get_or(&table::TRANSPORT, None, None, d.transport)?,
            algorithm: settings.get_or(&table::ALL_REDUCE_ALGORITHM, None, None, d.algorithm)?,
            token: settings.get(&table::JOB_TOKEN, None, None)?,
            shm_slot_bytes: settings.get_or(
                &table::SHM_SLOT_BYTES,
                None,
                None,
                d.shm_slot_bytes,
            )?,
            segment_bytes: settings.get_or(
                &table::RING_SEGMENT_BYTES,
                None,
                None,
                d.segment_bytes,
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_defaults_and_bad_values_name_the_variable() {
        let env = [
            ("ACCELERATE_TIMEOUT", "2.5"),
            ("ACCELERATE_TRANSPORT", "tcp"),
            ("ACCELERATE_ALL_REDUCE_ALGORITHM", "ring"),
            ("ACCELERATE_JOB_TOKEN", "t"),
            ("ACCELERATE_SHM_SLOT_BYTES", "65536"),
        ];
        let o = GroupOptions::from_source(&env[..]).unwrap();
        assert_eq!(o.timeout, Duration::from_millis(2500));
        assert_eq!(o.transport, TransportChoice::Tcp);
        assert_eq!(o.algorithm, AllReduceAlgorithm::Ring);
        assert_eq!(o.token.as_deref(), Some("t"));
        let shown = format!("{o:?}");
        assert!(shown.contains("token: Some(\"<redacted>\")"), "{shown}");
        assert_eq!(o.shm_slot_bytes, 65536);
        assert_eq!(o.rendezvous_timeout, Duration::from_secs(300));
        let err = GroupOptions::from_source(&[("ACCELERATE_TRANSPORT", "ib")][..])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "ACCELERATE_TRANSPORT (env) = ib: expected auto, shm, tcp or mpi"
        );
        let err = GroupOptions::from_source(&[("ACCELERATE_TIMEOUT", "0")][..])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("ACCELERATE_TIMEOUT (env) = 0"), "{err}");
        // Values no job needs, which would panic or wrap further on, are refused by name.
        for (key, value) in [
            ("ACCELERATE_TIMEOUT", "1e20"),
            ("ACCELERATE_HEARTBEAT_TIMEOUT", "inf"),
            ("ACCELERATE_SHM_SLOT_BYTES", "18446744073709551615"),
            ("ACCELERATE_RING_SEGMENT_BYTES", "4611686018427387904"),
        ] {
            let err = GroupOptions::from_source(&[(key, value)][..])
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(&format!("{key} (env) = {value}")), "{err}");
        }
    }
}
