//! The fused unscale-and-check pass of dynamic loss scaling, on the device: one read and one
//! write of each gradient, and a flag in device memory that only an overflow writes.

use cubecl::prelude::*;

use super::{Client, Handle, ServerError, buffer, grid};

const EXPONENT: u32 = 0x7f80_0000;

#[cube(launch)]
fn unscale_and_flag_kernel(values: &mut [f32], inv_scale: f32, flag: &[Atomic<u32>]) {
    let i = ABSOLUTE_POS;
    if i < values.len() {
        let x = values[i] * inv_scale;
        values[i] = x;
        // Exponent all ones: an infinity or a NaN, as in `crate::amp`.
        if u32::reinterpret(x) & EXPONENT == EXPONENT {
            flag[0].fetch_or(1u32);
        }
    }
}

/// A device word that [`unscale_and_flag`] sets when it meets a value that is not finite. One
/// flag can collect any number of launches and is read once, at the end.
#[derive(Debug, Clone)]
pub struct NonFiniteFlag {
    handle: Handle,
}

impl NonFiniteFlag {
    /// A cleared flag on `client`'s device.
    pub fn new(client: &Client) -> Self {
        Self {
            handle: client.create_from_slice(bytemuck::bytes_of(&0u32)),
        }
    }

    /// A flag over an existing buffer of at least 4 zeroed bytes (a Burn integer tensor of one
    /// zero, say); only its first 4 bytes are written.
    pub fn from_handle(handle: Handle) -> Self {
        Self { handle }
    }

    /// Waits for the launches that write the flag and says whether any value was not finite.
    pub fn read(self, client: &Client) -> Result<bool, ServerError> {
        let bytes = client.read_one(self.handle)?;
        Ok(bytes.iter().any(|&b| b != 0))
    }
}

/// Multiplies the `len` f32 values of `values` by `inv_scale` in place and sets `flag` if any
/// result is not finite (the step must be skipped). Queued, not waited for.
pub fn unscale_and_flag(
    client: &Client,
    values: Handle,
    len: usize,
    inv_scale: f32,
    flag: &NonFiniteFlag,
) {
    if len == 0 {
        return;
    }
    let (count, dim) = grid(client, len);
    // `buffer` checks each handle against its length; the kernel stays below them.
    unscale_and_flag_kernel::launch(
        client,
        count,
        dim,
        buffer(values, len, "unscale_and_flag values"),
        inv_scale,
        buffer(flag.handle.clone(), 1, "non-finite flag"),
    );
}

/// [`unscale_and_flag`] over one buffer, waiting for the answer: true when any value is not
/// finite. The same results as [`crate::amp::unscale_and_check`], bit for bit.
pub fn unscale_and_check(
    client: &Client,
    values: Handle,
    len: usize,
    inv_scale: f32,
) -> Result<bool, ServerError> {
    let flag = NonFiniteFlag::new(client);
    unscale_and_flag(client, values, len, inv_scale, &flag);
    flag.read(client)
}
