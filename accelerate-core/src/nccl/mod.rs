//! NCCL from the host's side: finding and loading libnccl at run time ([`NcclLibrary`]),
//! agreeing across the processes whether a job reduces its gradients with NCCL or on the host
//! ([`agree`]), the communicator id that rank 0 makes and hands to the others over the process
//! group (whose links proved the job token), and communicators that cannot hang
//! ([`NcclCommunicator`]). Nothing here needs a GPU; the reducer that runs NCCL on CUDA
//! memory is accelerate-burn's, behind its `nccl` feature.
//!
//! ```
//! use accelerate_core::nccl::{Decision, NcclMode, RankStatus};
//!
//! // Rank 1 has no libnccl: under `auto` the whole job takes the host path, with a warning.
//! let statuses = [
//!     RankStatus { mode: NcclMode::Auto, unavailable: None, version: Some("2.21.5".into()) },
//!     RankStatus { mode: NcclMode::Auto, unavailable: Some("libnccl not found".into()), version: None },
//! ];
//! assert!(matches!(accelerate_core::nccl::decide(&statuses), Decision::Host { warn: true, .. }));
//! ```

mod communicator;
mod library;
mod search;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::comm::ProcessGroup;
use crate::error::CommError;

pub use crate::config::NcclMode;
pub use communicator::{NcclCommunicator, NcclDataType, NcclOp};
pub use library::{Candidate, NcclLibrary, NcclVersion, UNIQUE_ID_BYTES, UniqueId, candidates};

/// What went wrong with NCCL, with what to do.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    /// No libnccl loaded from any place searched.
    #[error(
        "libnccl was not found; tried:\n  {}\nhint: `pip install nvidia-nccl-cu12` (or -cu13) in \
         the Python environment on PATH, install the system package (libnccl2), or name the \
         file with ACCELERATE_NCCL_LIBRARY",
        tried.join("\n  ")
    )]
    NotFound {
        /// Every candidate with why it failed.
        tried: Vec<String>,
    },
    /// A candidate exists but is not a usable libnccl.
    #[error("{}: {reason}", path.display())]
    Load {
        /// The file.
        path: PathBuf,
        /// The loader's or our reason.
        reason: String,
    },
    /// An NCCL function returned an error.
    #[error("{function} failed: {message} (NCCL error {code})")]
    Call {
        /// The function.
        function: &'static str,
        /// Its `ncclResult_t`.
        code: i32,
        /// NCCL's words for it.
        message: String,
    },
    /// A communicator failed; it was aborted.
    #[error(
        "rank {rank}: NCCL failed while {what}: {reason}; the communicator was aborted (set \
         NCCL_DEBUG=WARN for NCCL's own account)"
    )]
    Failed {
        /// This process's rank.
        rank: usize,
        /// What it was doing.
        what: &'static str,
        /// NCCL's or CUDA's error.
        reason: String,
    },
    /// A communicator did not finish within the collective timeout; it was aborted.
    #[error(
        "rank {rank}: NCCL did not finish {what} within {seconds:.0} s, so the communicator was \
         aborted; a peer rank has probably died or stopped calling (see the other ranks' \
         errors), or raise ACCELERATE_TIMEOUT"
    )]
    Timeout {
        /// This process's rank.
        rank: usize,
        /// What it was waiting for.
        what: &'static str,
        /// The timeout.
        seconds: f64,
    },
    /// NCCL is required (`ACCELERATE_NCCL=require`) and some rank cannot use it.
    #[error(
        "NCCL is required (ACCELERATE_NCCL=require or strict_nccl) but {}; unset it to fall \
         back to the host path",
        describe_ranks(ranks)
    )]
    Unavailable {
        /// (rank, reason) of every rank that cannot.
        ranks: Vec<(usize, String)>,
    },
    /// Ranks run with different `ACCELERATE_NCCL` settings.
    #[error(
        "rank {rank} runs with ACCELERATE_NCCL={theirs} but rank 0 with {rank0}: every rank must \
         take the same path; set it alike for the whole job"
    )]
    ModeMismatch {
        /// The rank that differs.
        rank: usize,
        /// Rank 0's mode.
        rank0: NcclMode,
        /// That rank's.
        theirs: NcclMode,
    },
    /// The process group failed while the ranks agreed.
    #[error(transparent)]
    Comm(#[from] CommError),
}

fn describe_ranks(ranks: &[(usize, String)]) -> String {
    ranks
        .iter()
        .map(|(rank, reason)| format!("rank {rank} cannot use it: {reason}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// What one rank brings to the agreement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankStatus {
    /// Its mode.
    pub mode: NcclMode,
    /// Why it cannot use NCCL (`None`: it can).
    pub unavailable: Option<String>,
    /// The version of the libnccl it loaded: every rank must run the same one (NCCL's wire
    /// protocol may change between releases, and mixed versions hang or fail at run time).
    #[serde(default)]
    pub version: Option<String>,
}

/// The path the whole job takes, the same on every rank.
#[derive(Debug)]
pub enum Decision {
    /// Every rank uses NCCL.
    Nccl,
    /// Every rank reduces on the host.
    Host {
        /// Why, for the log.
        reason: String,
        /// Whether the main process warns (`auto` fell back; not for `off`).
        warn: bool,
    },
    /// The job cannot start as configured.
    Fail(NcclError),
}

/// The decision every rank reaches from every rank's status (rank order): modes must agree;
/// `off` is the host path; otherwise NCCL when all can, else the host path with a warning
/// (`auto`) or an error naming the ranks (`require`).
pub fn decide(statuses: &[RankStatus]) -> Decision {
    let Some(first) = statuses.first() else {
        return Decision::Host {
            reason: "no ranks".into(),
            warn: false,
        };
    };
    if let Some((rank, other)) = statuses
        .iter()
        .enumerate()
        .find(|(_, s)| s.mode != first.mode)
    {
        return Decision::Fail(NcclError::ModeMismatch {
            rank,
            rank0: first.mode,
            theirs: other.mode,
        });
    }
    if first.mode == NcclMode::Off {
        return Decision::Host {
            reason: "ACCELERATE_NCCL=off".into(),
            warn: false,
        };
    }
    let missing: Vec<(usize, String)> = statuses
        .iter()
        .enumerate()
        .filter_map(|(rank, s)| {
            if let Some(reason) = &s.unavailable {
                return Some((rank, reason.clone()));
            }
            // Rank 0's version is the job's.
            (s.version != first.version).then(|| {
                let name = |v: &Option<String>| v.clone().unwrap_or_else(|| "unknown".into());
                (
                    rank,
                    format!(
                        "it loaded libnccl {}, rank 0 loaded {}; hint: give every host the same \
                         NCCL (ACCELERATE_NCCL_LIBRARY names it)",
                        name(&s.version),
                        name(&first.version)
                    ),
                )
            })
        })
        .collect();
    if missing.is_empty() {
        return Decision::Nccl;
    }
    match first.mode {
        NcclMode::Require => Decision::Fail(NcclError::Unavailable { ranks: missing }),
        _ => Decision::Host {
            reason: describe_ranks(&missing),
            warn: true,
        },
    }
}

/// Agrees with every rank of `group` whether the job uses NCCL, and if so hands rank 0's new
/// communicator id to all: `Some(id)` on every rank, or `None` on every rank (the host path;
/// the main process has logged one warning when `auto` fell back). `local` is this rank's
/// library, or why it has none. A rank 0 that cannot make an id counts as a rank without NCCL.
///
/// The id travels over the group's own links, which were opened with the job token, so no
/// process outside the job learns it.
pub fn agree(
    group: &mut ProcessGroup,
    mode: NcclMode,
    local: Result<&NcclLibrary, impl std::fmt::Display>,
) -> Result<Option<UniqueId>, NcclError> {
    let status = RankStatus {
        mode,
        unavailable: local.as_ref().err().map(ToString::to_string),
        version: local.as_ref().ok().map(|l| l.version().to_string()),
    };
    let statuses: Vec<RankStatus> = group.all_gather_object(&status)?;
    match decide(&statuses) {
        Decision::Fail(error) => return Err(error),
        Decision::Host { reason, warn } => {
            host_path(group.rank(), &reason, warn);
            return Ok(None);
        }
        Decision::Nccl => {}
    }
    // Rank 0's id, or why it could not make one, so that no rank waits for an id that never
    // comes.
    let minted: Option<MintedId> = (group.rank() == 0).then(|| match &local {
        Ok(library) => match library.unique_id() {
            Ok(id) => MintedId::Id(id.0.to_vec()),
            Err(e) => MintedId::Failed(e.to_string()),
        },
        Err(reason) => MintedId::Failed(reason.to_string()),
    });
    let shared: MintedId = group.broadcast_object(minted.as_ref(), 0)?;
    match shared {
        MintedId::Id(bytes) => {
            let id: [u8; UNIQUE_ID_BYTES] =
                bytes.try_into().map_err(|b: Vec<u8>| NcclError::Failed {
                    rank: group.rank(),
                    what: "receiving the communicator id",
                    reason: format!("rank 0 sent {} bytes, not {UNIQUE_ID_BYTES}", b.len()),
                })?;
            Ok(Some(UniqueId(id)))
        }
        MintedId::Failed(reason) => {
            let ranks = vec![(0, format!("could not make a communicator id: {reason}"))];
            if mode == NcclMode::Require {
                return Err(NcclError::Unavailable { ranks });
            }
            host_path(group.rank(), &describe_ranks(&ranks), true);
            Ok(None)
        }
    }
}

/// What rank 0 sends every rank once they agreed on NCCL: the new communicator's id, or why
/// it could not make one.
#[derive(Serialize, Deserialize)]
enum MintedId {
    /// The id's bytes.
    Id(Vec<u8>),
    /// Why there is none.
    Failed(String),
}

/// Logs the host-path decision: one warning on the main process when `auto` fell back.
fn host_path(rank: usize, reason: &str, warn: bool) {
    if warn && rank == 0 {
        tracing::warn!(
            "gradients are averaged on the host, not with NCCL: {reason} (ACCELERATE_NCCL=off \
             silences this, ACCELERATE_NCCL=require makes it an error)"
        );
    } else {
        tracing::debug!("gradients are averaged on the host: {reason}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(mode: NcclMode, unavailable: Option<&str>) -> RankStatus {
        RankStatus {
            mode,
            unavailable: unavailable.map(String::from),
            version: unavailable.is_none().then(|| "2.21.5".into()),
        }
    }

    #[test]
    fn ranks_with_different_nccl_versions_do_not_use_nccl_together() {
        let mut other = status(NcclMode::Require, None);
        other.version = Some("2.19.3".into());
        match decide(&[status(NcclMode::Require, None), other.clone()]) {
            Decision::Fail(e @ NcclError::Unavailable { .. }) => {
                let text = e.to_string();
                assert!(text.contains("rank 1"), "{text}");
                assert!(
                    text.contains("libnccl 2.19.3, rank 0 loaded 2.21.5"),
                    "{text}"
                );
            }
            other => panic!("{other:?}"),
        }
        other.mode = NcclMode::Auto;
        let auto = [status(NcclMode::Auto, None), other];
        assert!(matches!(decide(&auto), Decision::Host { warn: true, .. }));
    }

    #[test]
    fn every_rank_able_means_nccl() {
        let all = vec![status(NcclMode::Auto, None); 3];
        assert!(matches!(decide(&all), Decision::Nccl));
        let all = vec![status(NcclMode::Require, None); 2];
        assert!(matches!(decide(&all), Decision::Nccl));
    }

    #[test]
    fn one_rank_unable_falls_back_under_auto_and_fails_under_require() {
        let auto = [
            status(NcclMode::Auto, None),
            status(NcclMode::Auto, Some("no libnccl")),
        ];
        match decide(&auto) {
            Decision::Host { reason, warn } => {
                assert!(warn);
                assert!(
                    reason.contains("rank 1") && reason.contains("no libnccl"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
        let strict = [
            status(NcclMode::Require, Some("no GPU")),
            status(NcclMode::Require, None),
        ];
        match decide(&strict) {
            Decision::Fail(e @ NcclError::Unavailable { .. }) => {
                let text = e.to_string();
                assert!(text.contains("rank 0 cannot use it: no GPU"), "{text}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn off_is_quiet_and_modes_must_agree() {
        let off = vec![status(NcclMode::Off, Some("whatever")); 2];
        assert!(matches!(decide(&off), Decision::Host { warn: false, .. }));
        let mixed = [status(NcclMode::Auto, None), status(NcclMode::Off, None)];
        match decide(&mixed) {
            Decision::Fail(e @ NcclError::ModeMismatch { rank: 1, .. }) => {
                assert!(e.to_string().contains("ACCELERATE_NCCL=off"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn modes_parse() {
        assert_eq!("auto".parse(), Ok(NcclMode::Auto));
        assert_eq!(" Require ".parse(), Ok(NcclMode::Require));
        assert_eq!("off".parse(), Ok(NcclMode::Off));
        assert_eq!(
            "maybe".parse::<NcclMode>(),
            Err(crate::settings::ParseSettingError::new(
                "maybe",
                NcclMode::EXPECTED
            ))
        );
    }

    #[test]
    fn threads_agree_and_share_rank_zeros_id() {
        // In-process ranks (the real-process version is tests/nccl.rs). Without a library
        // rank 0 cannot mint, so every rank takes the host path together.
        let groups = ProcessGroup::local(3, &Default::default());
        let outcomes: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|mut group| {
                    s.spawn(move || {
                        let local = Err(format!("rank {} has no GPU", group.rank()));
                        agree(&mut group, NcclMode::Auto, local).map(|id| id.is_some())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            outcomes.iter().all(|o| matches!(o, Ok(false))),
            "{outcomes:?}"
        );
    }
}
