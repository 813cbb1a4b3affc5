//! Output buffers that a kernel writes in full, allocated without being cleared first: a
//! transformer step's activations are hundreds of MiB, and clearing each with `vec![0.0; n]`
//! before the kernel overwrites it cost a single-threaded `memset` pass (about 1 % of a step).

#![allow(unsafe_code)]

use std::mem::MaybeUninit;

/// A vector of `len` values, every one written by `fill`, which receives them uninitialised.
///
/// # Safety
/// `fill` writes every element of the slice it is given (returning normally); a panic inside
/// it is safe (the vector is dropped empty).
pub(crate) unsafe fn written_by<T>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut values = Vec::with_capacity(len);
    fill(&mut values.spare_capacity_mut()[..len]);
    // SAFETY: the capacity is at least `len`, and the caller promises that `fill` initialised
    // all `len` values.
    unsafe { values.set_len(len) };
    values
}
