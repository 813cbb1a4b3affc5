//! The errors of `accelerate-core`: one enum per concern, each message one line that names
//! the variable or key at fault and what would fix it.

use std::path::PathBuf;

use crate::state::Launcher;

/// The launcher environment could not describe this process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// A variable is set to a value that cannot be right.
    #[error("{var} = {value}: {why}")]
    Invalid {
        /// The environment variable.
        var: &'static str,
        /// Its value as found.
        value: String,
        /// What is wrong with it.
        why: String,
    },
    /// A variable the launcher should have set is missing.
    #[error("{var} is not set (launcher: {launcher}): {why}")]
    Missing {
        /// The environment variable (or the pair, for either-or variables).
        var: &'static str,
        /// The launcher whose other variables were found.
        launcher: Launcher,
        /// Why it is needed.
        why: &'static str,
    },
}

impl StateError {
    pub(crate) fn invalid(var: &'static str, value: impl ToString, why: impl Into<String>) -> Self {
        Self::Invalid {
            var,
            value: value.to_string(),
            why: why.into(),
        }
    }
}

/// A configuration value could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A value from some source (code, env, file) is out of range or unparsable.
    #[error("{key} ({source_name}) = {value}: expected {expected}")]
    Invalid {
        /// Name of the key or variable.
        key: &'static str,
        /// Where it came from: "code", "env", or a file path.
        source_name: String,
        /// The value as found.
        value: String,
        /// What would have been accepted.
        expected: &'static str,
    },
    /// The config file could not be read.
    #[error(transparent)]
    File(#[from] ConfigFileError),
}

/// A config file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("config file {}{}: {message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct ConfigFileError {
    /// The file.
    pub path: PathBuf,
    /// The 1-based line at fault, when known.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

/// What a rank waited for when the rendezvous timed out
/// ([`CommError::RendezvousTimeout`]); its message ends with a hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RendezvousWait {
    /// A rank other than 0: rank 0 never accepted it.
    Accepted {
        /// The last attempt's failure (connection refused, no address published yet, ...).
        last_error: String,
    },
    /// Rank 0: these ranks never arrived.
    Arrivals {
        /// Ranks that never completed their hello.
        missing: Vec<usize>,
        /// Ranks refused on the way, with the reason (a different world size, a duplicate).
        refused: Vec<String>,
        /// Connections that failed to authenticate (another job's token, not a rank).
        failed_auth: usize,
    },
}

impl std::fmt::Display for RendezvousWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Accepted { last_error } => write!(
                f,
                "rank 0 never accepted this rank (last error: {last_error}). hint: start rank \
                 0, check MASTER_ADDR/MASTER_PORT, the firewall and the job token, or raise \
                 ACCELERATE_RENDEZVOUS_TIMEOUT"
            ),
            Self::Arrivals {
                missing,
                refused,
                failed_auth,
            } => {
                let missing: Vec<String> = missing.iter().map(usize::to_string).collect();
                write!(f, "ranks {} never arrived", missing.join(", "))?;
                if !refused.is_empty() {
                    write!(f, "; refused: {}", refused.join("; "))?;
                }
                if *failed_auth > 0 {
                    write!(
                        f,
                        "; {failed_auth} connections failed to authenticate (a different {} or \
                         not an accelerate-rs rank)",
                        crate::env_vars::JOB_TOKEN
                    )?;
                }
                f.write_str(
                    ". hint: start every rank with the same MASTER_ADDR, MASTER_PORT, WORLD_SIZE \
                     and job token, or raise ACCELERATE_RENDEZVOUS_TIMEOUT",
                )
            }
        }
    }
}

/// A collective, the rendezvous or a transport failed. Every variant names the operation or
/// stage, this rank, the peer or peers at fault, and what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// Peers did not arrive before the deadline.
    #[error(
        "{call} timed out on rank {rank} of {world_size} after {elapsed_s:.1} s: {} never arrived. \
         hint: every rank must make the same collective calls in the same order \
         (e.g. call backward() equally often); raise ACCELERATE_TIMEOUT for slow steps",
        ranks(missing)
    )]
    Timeout {
        /// The call that waited.
        call: String,
        /// This rank.
        rank: usize,
        /// Ranks in the group.
        world_size: usize,
        /// Ranks that never arrived.
        missing: Vec<usize>,
        /// Seconds waited.
        elapsed_s: f64,
    },

    /// A peer process exited or its connection broke.
    #[error(
        "{call} failed on rank {rank}: rank {peer} is gone ({detail}). \
         hint: rank {peer}'s own output says why it stopped"
    )]
    PeerLost {
        /// The call in progress.
        call: String,
        /// This rank.
        rank: usize,
        /// The lost rank.
        peer: usize,
        /// How the loss showed (connection reset, process exited, ...).
        detail: String,
    },

    /// A peer failed and told the group why.
    #[error("{call} failed on rank {rank} because rank {peer} failed: {reason}")]
    PeerFailed {
        /// The call in progress.
        call: String,
        /// This rank.
        rank: usize,
        /// The rank that told this one.
        peer: usize,
        /// The first failure's words, passed on unchanged from rank to rank.
        reason: String,
    },

    /// Ranks called different collectives, or the same one with different sizes, or run with
    /// settings that must agree (compared when the group forms).
    #[error(
        "mismatch on rank {rank}: this rank {ours}, rank {peer} {theirs}. hint: every rank must \
         make the same collective calls, with the same sizes, in the same order, and run with the \
         same ACCELERATE_* settings"
    )]
    Mismatch {
        /// This rank.
        rank: usize,
        /// This rank's side ("called all_reduce #3 (...)", "runs with ...").
        ours: String,
        /// The other rank.
        peer: usize,
        /// The other rank's side.
        theirs: String,
    },

    /// The call itself is malformed (buffer sizes, root out of range).
    #[error("{op} on rank {rank}: {reason}")]
    Usage {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// What is wrong.
        reason: String,
    },

    /// The group could not form.
    #[error("rendezvous at {addr} failed on rank {rank} of {world_size}: {reason}")]
    Rendezvous {
        /// The rendezvous address tried.
        addr: String,
        /// This rank.
        rank: usize,
        /// Expected ranks.
        world_size: usize,
        /// What went wrong, with a hint.
        reason: String,
    },

    /// The group did not form within the rendezvous timeout
    /// (`ACCELERATE_RENDEZVOUS_TIMEOUT`): what this rank waited for is in `wait`.
    #[error(
        "rendezvous at {addr} failed on rank {rank} of {world_size}: timed out after \
         {waited_s:.1} s: {wait}"
    )]
    RendezvousTimeout {
        /// The rendezvous address.
        addr: String,
        /// This rank.
        rank: usize,
        /// Expected ranks.
        world_size: usize,
        /// Seconds waited.
        waited_s: f64,
        /// What never came.
        wait: RendezvousWait,
    },

    /// The MPI library returned an error (the MPI engine).
    #[error("{call} failed on rank {rank} in MPI: {detail}")]
    Mpi {
        /// The call in progress ("setup" while the group forms).
        call: String,
        /// This rank.
        rank: usize,
        /// MPI's own description, with a hint where one helps.
        detail: String,
    },

    /// The operating system refused something (socket, file, mapping).
    #[error("rank {rank}: {context}: {detail}")]
    Io {
        /// This rank.
        rank: usize,
        /// What was being done.
        context: String,
        /// The system's error.
        detail: String,
    },
}

/// "rank 3" or "ranks 1, 2".
fn ranks(list: &[usize]) -> String {
    let names: Vec<String> = list.iter().map(usize::to_string).collect();
    match list.len() {
        1 => format!("rank {}", names[0]),
        _ => format!("ranks {}", names.join(", ")),
    }
}

impl CommError {
    /// What this rank tells its peers when this error ends its part of the job: its own
    /// words, or, for a failure passed on from a peer, that first failure's words unchanged
    /// (a chain of ranks does not nest them, and the cause fits the room transports keep).
    pub(crate) fn reason_for_peers(&self) -> String {
        match self {
            Self::PeerFailed { reason, .. } => reason.clone(),
            other => other.to_string(),
        }
    }

    /// This error of a group split from the job, with its ranks named as the job numbers them
    /// (`members[r]` is the group's rank `r`), and the call said to be the group's: a user
    /// reads the job's ranks in every log line.
    pub(crate) fn in_job(self, members: &[usize]) -> Self {
        let job = |rank: usize| members.get(rank).copied().unwrap_or(rank);
        let call = |call: String| format!("{call} of the group of ranks {members:?}");
        match self {
            Self::Timeout {
                call: c,
                rank,
                world_size,
                missing,
                elapsed_s,
            } => Self::Timeout {
                call: call(c),
                rank: job(rank),
                world_size,
                missing: missing.into_iter().map(job).collect(),
                elapsed_s,
            },
            Self::PeerLost {
                call: c,
                rank,
                peer,
                detail,
            } => Self::PeerLost {
                call: call(c),
                rank: job(rank),
                peer: job(peer),
                detail,
            },
            Self::PeerFailed {
                call: c,
                rank,
                peer,
                reason,
            } => Self::PeerFailed {
                call: call(c),
                rank: job(rank),
                peer: job(peer),
                reason,
            },
            Self::Mismatch {
                rank,
                ours,
                peer,
                theirs,
            } => Self::Mismatch {
                rank: job(rank),
                ours,
                peer: job(peer),
                theirs,
            },
            Self::Usage { op, rank, reason } => Self::Usage {
                op,
                rank: job(rank),
                reason,
            },
            Self::Mpi {
                call: c,
                rank,
                detail,
            } => Self::Mpi {
                call: call(c),
                rank: job(rank),
                detail,
            },
            Self::Io {
                rank,
                context,
                detail,
            } => Self::Io {
                rank: job(rank),
                context,
                detail,
            },
            rendezvous => rendezvous,
        }
    }

    pub(crate) fn io(rank: usize, context: impl Into<String>, err: std::io::Error) -> Self {
        Self::Io {
            rank,
            context: context.into(),
            detail: err.to_string(),
        }
    }
}
