//! The device-side kernels, as cubecl kernels over flat buffers on any cubecl runtime (CUDA,
//! wgpu, the CPU runtime): the same operations as [`crate::amp`] and [`crate::convert`], with
//! the same results bit for bit, so that a GPU backend checks and compresses gradients where
//! they are instead of copying them to the host first; and the fused optimizer updates of
//! [`crate::optim`], so that a fused optimizer keeps its state on the GPU.
//!
//! A buffer is a cubecl [`Handle`] and its length in elements; the caller owns the client and
//! the handles (Burn's `CubeTensor` has both). Launches are queued, not waited for: only the
//! functions that return a host value ([`NonFiniteFlag::read`], [`unscale_and_check`]) wait.
//!
//! Half-precision values travel packed, two per `u32` word, low half first: the bytes of a
//! packed buffer are exactly those of a `[f16]` or `[bf16]` slice on a little-endian host, and
//! the conversions are integer arithmetic, so they need no f16 or bf16 support on the device
//! (lavapipe has f16 but not bf16) and round exactly like [`crate::convert`].
//!
//! ```no_run
//! # #[cfg(feature = "cubecl-wgpu")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use accelerate_kernels::cube::{self, Half};
//!
//! let client = cubecl::Device::default().client();
//! let grads = client.create_from_slice(bytemuck::cast_slice(&[65536.0_f32, -2.0, 8.0]));
//! assert!(!cube::unscale_and_check(&client, grads.clone(), 3, 1.0 / 65536.0)?);
//! let packed = cube::narrow_to_half(&client, grads, 3, Half::F16, 1.0);
//! let bytes = client.read_one(packed)?;
//! let halves: &[half::f16] = bytemuck::cast_slice(&bytes[..6]);
//! assert_eq!(halves[0].to_f32(), 1.0);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "cubecl-wgpu"))]
//! # fn main() {}
//! ```

mod amp;
mod convert;
mod optim;

pub use amp::{NonFiniteFlag, unscale_and_check, unscale_and_flag};
pub use convert::{Half, narrow_to_half, widen_from_half};
pub use optim::{FlatBuffers, adam_step, copy_params, sgd_step};

pub use cubecl::client::Client;
pub use cubecl::server::{Handle, ServerError};

use cubecl::prelude::*;

/// `handle` as a kernel argument of `len` 4-byte elements (f32 or u32 words), after checking
/// that the buffer really holds that many: a wrong length is the caller's bug, and it stops
/// here with a panic naming the buffer instead of letting a kernel read or write past it.
fn buffer(handle: Handle, len: usize, what: &str) -> BufferArg {
    let needed = (len as u64).saturating_mul(4);
    assert!(
        handle.size_in_used() >= needed,
        "{what}: a buffer of {} bytes passed for {len} elements ({needed} bytes)",
        handle.size_in_used()
    );
    // SAFETY: the handle holds at least `len` 4-byte elements (checked above), and every
    // kernel of this module indexes its buffers below the lengths they are bound with.
    #[allow(unsafe_code)]
    unsafe {
        BufferArg::from_raw_parts(handle, len)
    }
}

/// The launch grid for `work` independent units, one per thread.
fn grid(client: &Client, work: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(client, work);
    (
        cubecl::calculate_cube_count_elemwise(client, work, dim),
        dim,
    )
}
