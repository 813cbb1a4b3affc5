//! f32 <-> f16/bf16 on the device, packed two halves to a `u32` word (low half first), in
//! integer arithmetic: round to nearest, ties to even; NaN becomes a quiet NaN; overflow becomes
//! infinity. Every result equals [`crate::convert`]'s, which equals the `half` crate's.

use cubecl::prelude::*;

use super::{Client, Handle, buffer, grid};

/// Which 16-bit float a packed buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Half {
    /// IEEE binary16.
    F16,
    /// bfloat16 (the upper half of an f32).
    Bf16,
}

#[cube]
fn f32_to_f16_bits(value: f32) -> u32 {
    let bits = u32::reinterpret(value);
    let sign = bits & 0x8000_0000u32;
    let magnitude = bits ^ sign;
    let mut result = 0u32;
    if magnitude >= 0x4780_0000u32 {
        // 2^16 and beyond (and infinity, NaN): too large for f16.
        if magnitude > 0x7f80_0000u32 {
            result = 0x7e00u32;
        } else {
            result = 0x7c00u32;
        }
    } else if magnitude < 0x3880_0000u32 {
        // Below f16's smallest normal (2^-14): a subnormal or zero. The value in units of
        // 2^-24 is the 24-bit significand shifted right by 126 - exponent, rounded to even.
        let exponent = magnitude >> 23u32;
        if exponent >= 102u32 {
            let significand = (magnitude & 0x007f_ffffu32) | 0x0080_0000u32;
            let shift = 126u32 - exponent;
            let quotient = significand >> shift;
            let remainder = significand & ((1u32 << shift) - 1u32);
            let halfway = 1u32 << (shift - 1u32);
            let mut round = 0u32;
            if remainder > halfway || (remainder == halfway && (quotient & 1u32) == 1u32) {
                round = 1u32;
            }
            result = quotient + round;
        }
    } else {
        // Normal: rebias the exponent from 127 to 15 and round the 13 dropped bits to even
        // (a carry may reach the exponent, up to infinity, which is right).
        let odd = (magnitude >> 13u32) & 1u32;
        result = (magnitude - 0x3800_0000u32 + 0x0fffu32 + odd) >> 13u32;
    }
    result | (sign >> 16u32)
}

#[cube]
fn f16_bits_to_f32(half: u32) -> f32 {
    let sign = (half & 0x8000u32) << 16u32;
    let exponent = (half >> 10u32) & 0x1fu32;
    let mantissa = half & 0x03ffu32;
    let bits = if exponent == 0x1fu32 {
        0x7f80_0000u32 | (mantissa << 13u32)
    } else if exponent == 0u32 {
        // Zero or subnormal: mantissa * 2^-24, exact in f32 (a product of a small integer and
        // a power of two), with no reliance on the device's handling of f32 subnormals.
        u32::reinterpret(f32::cast_from(mantissa) * f32::reinterpret(0x3380_0000u32))
    } else {
        ((half & 0x7fffu32) << 13u32) + 0x3800_0000u32
    };
    f32::reinterpret(bits | sign)
}

#[cube]
fn f32_to_bf16_bits(value: f32) -> u32 {
    let bits = u32::reinterpret(value);
    let result = if (bits & 0x7fff_ffffu32) > 0x7f80_0000u32 {
        (bits >> 16u32) | 0x40u32
    } else {
        (bits + 0x7fffu32 + ((bits >> 16u32) & 1u32)) >> 16u32
    };
    result & 0xffffu32
}

#[cube]
fn narrow(value: f32, #[comptime] bf16: bool) -> u32 {
    if comptime!(bf16) {
        f32_to_bf16_bits(value)
    } else {
        f32_to_f16_bits(value)
    }
}

#[cube(launch)]
fn narrow_kernel(input: &[f32], output: &mut [u32], scale: f32, #[comptime] bf16: bool) {
    let word = ABSOLUTE_POS;
    if word < output.len() {
        let first = word * 2;
        let mut x = input[first];
        if scale != 1.0f32 {
            x *= scale;
        }
        let low = narrow(x, bf16);
        let mut high = 0u32;
        if first + 1 < input.len() {
            let mut y = input[first + 1];
            if scale != 1.0f32 {
                y *= scale;
            }
            high = narrow(y, bf16);
        }
        output[word] = low | (high << 16u32);
    }
}

#[cube]
fn widen(half: u32, #[comptime] bf16: bool) -> f32 {
    if comptime!(bf16) {
        f32::reinterpret(half << 16u32)
    } else {
        f16_bits_to_f32(half)
    }
}

#[cube(launch)]
fn widen_kernel(input: &[u32], output: &mut [f32], #[comptime] bf16: bool) {
    let word = ABSOLUTE_POS;
    if word < input.len() {
        let packed = input[word];
        let first = word * 2;
        output[first] = widen(packed & 0xffffu32, bf16);
        if first + 1 < output.len() {
            output[first + 1] = widen(packed >> 16u32, bf16);
        }
    }
}

/// Narrows the `len` f32 values of `values`, each first multiplied by `scale` (skipped when it
/// is 1), into a new buffer of `len.div_ceil(2)` packed words. Queued, not waited for.
pub fn narrow_to_half(
    client: &Client,
    values: Handle,
    len: usize,
    half: Half,
    scale: f32,
) -> Handle {
    let words = len.div_ceil(2);
    let output = client.empty(words.max(1) * 4);
    if len == 0 {
        return output;
    }
    let (count, dim) = grid(client, words);
    // `buffer` checks each handle against its length; the kernel stays below them.
    narrow_kernel::launch(
        client,
        count,
        dim,
        buffer(values, len, "narrow_to_half values"),
        buffer(output.clone(), words, "narrow_to_half output"),
        scale,
        half == Half::Bf16,
    );
    output
}

/// Widens `len` packed halves (`len.div_ceil(2)` words) into a new buffer of `len` f32 values,
/// exactly. Queued, not waited for.
pub fn widen_from_half(client: &Client, packed: Handle, len: usize, half: Half) -> Handle {
    let words = len.div_ceil(2);
    let output = client.empty(len.max(1) * 4);
    if len == 0 {
        return output;
    }
    let (count, dim) = grid(client, words);
    // `buffer` checks each handle against its length; the kernel stays below them.
    widen_kernel::launch(
        client,
        count,
        dim,
        buffer(packed, words, "widen_from_half packed halves"),
        buffer(output.clone(), len, "widen_from_half output"),
        half == Half::Bf16,
    );
    output
}
