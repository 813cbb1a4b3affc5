//! Transports: how bytes move between ranks.
//!
//! - [`local`]: threads of one process, over channels (tests; several devices in one process).
//! - [`tcp`]: a connection per pair of ranks, for ranks on different hosts.
//! - [`shm`]: one shared-memory segment per group, for ranks on one host; collectives on it
//!   are direct (each rank reduces its part straight from every peer's slot).
//! - `mpi` (feature `mpi`): the MPI library the job was started with, for clusters whose fast
//!   network only MPI reaches.

pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod shm;
pub mod tcp;
mod tcp_info;
