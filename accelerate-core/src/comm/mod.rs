//! Collectives between the processes of a job: rendezvous, transports, algorithms, and the
//! [`ProcessGroup`] API on top.
//!
//! - [`rendezvous`]: rank 0's TCP store; job token, world size and rank checks.
//! - [`transport`]: `local` (threads), `tcp` (hosts), `shm` (one host, direct collectives).
//! - [`collective`]: ring, recursive-doubling, tree and dissemination algorithms over the
//!   message transports.
//! - [`ProcessGroup`]: all_reduce (sum, mean, max, min), broadcast, all_gather,
//!   reduce_scatter, barrier, and broadcast/gather of small serde values; f32, f16, bf16.
//!
//! No call waits forever: every wait has a deadline ([`GroupOptions::timeout`]), a dead peer
//! is noticed within milliseconds (connection closed, or its process gone), and the error names
//! the call, this rank and the missing or failed ranks.

pub mod call;
pub mod collective;
pub mod engine;
mod group;
pub mod link;
mod options;
pub mod rendezvous;
pub mod transport;

pub use call::{CallDesc, OpKind};
pub use collective::AllReduceAlgorithm;
pub use group::{ProcessGroup, Reduction};
pub use options::{GroupOptions, TransportChoice};
