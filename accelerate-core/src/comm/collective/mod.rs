//! Collective algorithms over a message [`Link`](super::link::Link), one per file, plus the
//! engine that holds the link and turns its failures into errors with context.
//!
//! The schedules (who sends which chunk to whom) come from `accelerate_kernels::schedule`;
//! these files only move bytes along them.

mod all_gather_ring;
mod all_reduce_recursive_doubling;
mod all_reduce_ring;
mod barrier_dissemination;
mod broadcast_tree;
mod engine;
mod reduce_scatter_ring;

pub use engine::{AllReduceAlgorithm, MessageEngine};
