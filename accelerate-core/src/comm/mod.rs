//! Collectives between the processes of a job: rendezvous, transports, algorithms, and the
//! [`ProcessGroup`] API on top.
//!
//! - `rendezvous`: rank 0's TCP store; world size, settings and rank checks. Under it:
//!   [`admission`] (how many connections are authenticated at once, and from one address),
//!   `auth` and [`secret`] (the job secret and the challenge-response every connection opens
//!   with), `torch_store` (torchrun's store, where a job torchrun spans over hosts finds
//!   rank 0).
//! - [`transport`]: `local` (threads), `tcp` (hosts), `shm` (one host, direct collectives).
//! - [`collective`]: ring, recursive-doubling, tree and dissemination algorithms over the
//!   message transports.
//! - [`hierarchical`]: groups spanning hosts with several ranks per host: shared memory inside
//!   each host, TCP among one leader per host.
//! - [`ProcessGroup`]: all_reduce (sum, mean, max, min), broadcast, all_gather,
//!   reduce_scatter, barrier, and broadcast/gather of small serde values; f32, f16, bf16.
//! - [`SharedBuffer`]: a buffer the peers of a shared-memory group read directly, all-reduced
//!   in place with no staging copy (what the flat gradient buffer should live in).
//!
//! ```
//! use accelerate_core::comm::{GroupOptions, ProcessGroup, Reduction};
//!
//! // Two ranks as two threads of this process (real jobs use `ProcessGroup::new`).
//! let groups = ProcessGroup::local(2, &GroupOptions::default());
//! let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
//!     let handles: Vec<_> = groups
//!         .into_iter()
//!         .map(|mut group| {
//!             s.spawn(move || {
//!                 let mut values = vec![group.rank() as f32 + 1.0; 3];
//!                 group.all_reduce(&mut values, Reduction::Sum).unwrap();
//!                 values
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! assert_eq!(sums, vec![vec![3.0; 3], vec![3.0; 3]]);
//! ```
//!
//! No call waits forever: every wait has a deadline ([`GroupOptions::timeout`]), a dead peer
//! is noticed within milliseconds (connection closed, or its process gone), and the error names
//! the call, this rank and the missing or failed ranks.

// The wire internals (call headers, the engine and link traits, the rendezvous and its
// handshake, torchrun's store) are public only so that the fuzz and process tests can drive
// them; they are hidden from the documentation and are not API: they change without notice.
#[doc(hidden)]
pub mod call;
pub mod collective;
#[doc(hidden)]
pub mod engine;
mod group;
pub mod hierarchical;
pub mod hybrid;
#[doc(hidden)]
pub mod link;
mod options;
#[doc(hidden)]
pub mod rendezvous;
mod shared_buffer;
#[doc(hidden)]
pub mod sub_link;
pub mod transport;

pub use call::{CallDesc, OpKind};
pub use collective::AllReduceAlgorithm;
pub use group::{MAX_GATHERED_OBJECT_BYTES, MAX_OBJECT_BYTES, ProcessGroup, Reduction};
pub use hybrid::{HybridError, HybridGroups};
pub use options::{GroupOptions, TransportChoice};
#[doc(no_inline)]
pub use rendezvous::{admission, secret};
#[doc(hidden)]
pub use rendezvous::{auth, torch_store};
pub use shared_buffer::SharedBuffer;
