//! Gradients averaged while the backward pass goes on (issue 61's overlap). A model marks its
//! units ([`Accelerator::unit`](crate::Accelerator::unit), or ZeRO-3's sharded units); each
//! parameter of a unit passes through a tap (`sharded::WholeUnit::whole_for`), an operation
//! anchored after the unit's input whose backward receives the parameter's gradient as soon as
//! backward has left the unit, and hands it to the [`pipe`]. The pipe averages the window's
//! gradients bucket by bucket on a communication thread, in a fixed order on every process;
//! `backward` hands it the gradients no tap delivered and waits for the last bucket.
//!
//! One seam: without overlap (or without units) the same pipe runs on the caller's thread
//! after backward, with the same buckets, order and additions, so results are the same bits
//! either way. At ZeRO-2 the pipe reduce-scatters each bucket into the reducer's shard of the
//! window's sum instead (`reducer::ShardSink`), the taps let their gradients go, and each
//! unit's anchor holds backward on the [`throttle`] until the unit's gradients are sent, so
//! that one unit's gradients exist at a time.

pub(crate) mod hub;
pub(crate) mod pipe;
pub(crate) mod throttle;

pub(crate) use hub::{TapClaim, TapHub, TapReadError, TapSpec};
