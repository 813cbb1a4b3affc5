//! Keeping freed memory inside the process, so that a training step does not fault its
//! buffers in again every time.
//!
//! glibc's malloc gives the top of its heap back to the kernel as soon as more than twice its
//! (adaptive) mmap threshold is free there. A training step frees and reallocates buffers of
//! megabytes (activations, gradients, optimizer temporaries), so with the defaults every step
//! returns them and the next step takes a minor page fault per 4 KiB to get them back:
//! thousands of faults per step, 10-20 % of a CPU step (see `benches/RESULTS.md`).
//! [`keep_freed_memory`] sets glibc's thresholds once per process so that freed memory stays
//! for reuse: allocations below 32 MiB come from the heap and the heap is not trimmed below
//! 2 GiB. The process's resident memory then stays at its peak instead of falling between
//! steps, as with mimalloc or jemalloc. The thresholds govern the main arena, which serves the
//! main thread (where a training loop usually runs); a loop on another thread allocates from
//! that thread's arena, whose extra 64 MiB heaps glibc still unmaps when they empty (measured:
//! about 400 faults per step there against 3,400 with the defaults).
//!
//! It is on by default; `ACCELERATE_MALLOC_TUNING=false` (or the accelerator builder) turns it
//! off, and malloc settings in `GLIBC_TUNABLES` are left as the user set them. Other C
//! libraries and allocators are not touched (a program with its own global allocator, such as
//! mimalloc, does not use glibc's malloc for Rust's allocations anyway).
//!
//! ```
//! use accelerate_core::malloc_tuning::{keep_freed_memory, MallocTuning};
//!
//! let done = keep_freed_memory(true, &accelerate_core::state::ProcessEnv);
//! assert_ne!(done, MallocTuning::Disabled);
//! ```

use std::sync::atomic::{AtomicBool, Ordering};

use crate::env_vars::{self, EnvSource};

/// Environment variable that turns the tuning off (`false`, `0`, `no`).
pub const ENV_MALLOC_TUNING: &str = env_vars::MALLOC_TUNING;

/// Allocations below this come from the heap, where a freed buffer is reused (glibc's largest
/// accepted value on 64-bit targets).
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// The heap is not given back to the kernel while less than this is free at its top.
pub const TRIM_THRESHOLD: usize = i32::MAX as usize;

/// What [`keep_freed_memory`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MallocTuning {
    /// glibc's thresholds are now [`MMAP_THRESHOLD`] and [`TRIM_THRESHOLD`].
    Applied,
    /// An earlier call in this process applied them.
    AlreadyApplied,
    /// Turned off (`ACCELERATE_MALLOC_TUNING=false`, or in code).
    Disabled,
    /// `GLIBC_TUNABLES` sets malloc tunables: the user's choice stands.
    UserTunables,
    /// Not glibc: nothing to do.
    Unsupported,
    /// glibc refused a value (a future glibc with other limits); nothing was changed after it.
    Refused,
}

static APPLIED: AtomicBool = AtomicBool::new(false);

/// Sets glibc's malloc thresholds once per process unless `wanted` is false,
/// `ACCELERATE_MALLOC_TUNING` in `env` says false, or `GLIBC_TUNABLES` in `env` sets malloc
/// tunables. An unreadable `ACCELERATE_MALLOC_TUNING` counts as on (the variable only ever
/// turns something off) and is reported at debug level.
pub fn keep_freed_memory(wanted: bool, env: &(impl EnvSource + ?Sized)) -> MallocTuning {
    let from_env = env.var(ENV_MALLOC_TUNING).map(|v| {
        env_vars::parse_bool(&v).unwrap_or_else(|| {
            tracing::debug!("{ENV_MALLOC_TUNING}={v} is not true or false; tuning stays on");
            true
        })
    });
    if !wanted || from_env == Some(false) {
        return MallocTuning::Disabled;
    }
    if env
        .var("GLIBC_TUNABLES")
        .is_some_and(|t| t.contains("glibc.malloc."))
    {
        return MallocTuning::UserTunables;
    }
    if APPLIED.swap(true, Ordering::AcqRel) {
        return MallocTuning::AlreadyApplied;
    }
    let done = apply();
    if done != MallocTuning::Applied {
        APPLIED.store(false, Ordering::Release);
    }
    tracing::debug!(?done, "malloc thresholds");
    done
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)] // One FFI call, documented below.
fn apply() -> MallocTuning {
    let set = |param, value: usize| {
        let value = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt only reads its two integer arguments and updates malloc's own
        // parameters under malloc's lock; it is safe to call at any time from any thread.
        unsafe { libc::mallopt(param, value) == 1 }
    };
    if set(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) && set(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) {
        MallocTuning::Applied
    } else {
        MallocTuning::Refused
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() -> MallocTuning {
    MallocTuning::Unsupported
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_when_asked_and_when_the_user_tuned_glibc() {
        assert_eq!(keep_freed_memory(false, &[][..]), MallocTuning::Disabled);
        assert_eq!(
            keep_freed_memory(true, &[(ENV_MALLOC_TUNING, "no")][..]),
            MallocTuning::Disabled
        );
        let tunables = [("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")];
        assert_eq!(
            keep_freed_memory(true, &tunables[..]),
            MallocTuning::UserTunables
        );
    }
}
