//! Conversions between f32 and the half-precision types, written branch-free so that the
//! compiler vectorises the slice loops (the `half` crate converts one element at a time, with a
//! run-time CPU check per element unless the whole build targets F16C).
//!
//! Both narrowing conversions round to nearest, ties to even, like `half` and like hardware;
//! NaN stays NaN (quieted) and overflow becomes infinity. The tests compare every f16 and bf16
//! value, and a few million f32 values, with `half`'s results. [`crate::cast`] converts whole
//! tensors with them.

use half::{bf16, f16};

/// f16 bits to f32 (exact).
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let magnitude = (h & 0x7fff) << 13;
    let exponent = magnitude & (0x7c00 << 13);
    // Normal numbers: rebias the exponent from 15 to 127.
    let normal = magnitude + ((127 - 15) << 23);
    // Infinity and NaN: exponent all ones in both formats.
    let special = normal + ((128 - 16) << 23);
    // Subnormals: let the FPU normalise them with a magic subtraction.
    let subnormal = (f32::from_bits(normal + (1 << 23)) - f32::from_bits(113 << 23)).to_bits();
    let bits = if exponent == 0x7c00 << 13 {
        special
    } else if exponent == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// f32 to f16 bits, rounding to nearest, ties to even.
#[inline(always)]
pub fn f32_to_f16_bits(value: f32) -> u16 {
    let bits = value.to_bits();
    let sign = bits & 0x8000_0000;
    let magnitude = bits ^ sign;
    const F16_OVERFLOW: u32 = (127 + 16) << 23;
    const F32_INFINITY: u32 = 255 << 23;
    const SUBNORMAL_LIMIT: u32 = 113 << 23;
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23;
    // Too large for f16: infinity, or a quiet NaN.
    let overflow = if magnitude > F32_INFINITY {
        0x7e00
    } else {
        0x7c00
    };
    // Subnormal results: adding a magic number makes the FPU round at the right bit.
    let subnormal = (f32::from_bits(magnitude) + f32::from_bits(DENORM_MAGIC))
        .to_bits()
        .wrapping_sub(DENORM_MAGIC);
    // Normal results: rebias the exponent and round the 13 dropped bits to nearest even.
    let odd = (magnitude >> 13) & 1;
    let normal = magnitude
        .wrapping_add((15u32.wrapping_sub(127) << 23).wrapping_add(0xfff))
        .wrapping_add(odd)
        >> 13;
    let result = if magnitude >= F16_OVERFLOW {
        overflow
    } else if magnitude < SUBNORMAL_LIMIT {
        subnormal
    } else {
        normal
    };
    (result | (sign >> 16)) as u16
}

/// bf16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 to bf16 bits, rounding to nearest, ties to even; NaN becomes a quiet NaN.
#[inline(always)]
pub fn f32_to_bf16_bits(value: f32) -> u16 {
    let bits = value.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x40;
    (if value.is_nan() { nan } else { rounded }) as u16
}

/// The inputs that test a narrowing conversion: every f32 near each f16 and bf16 value and
/// halfway point (where rounding decides), then a stride of `stride` through all bit patterns.
/// For the tests of this crate's host and device conversions.
#[doc(hidden)]
pub fn narrowing_probes(stride: u32) -> impl Iterator<Item = f32> {
    let near = (0..=u16::MAX).flat_map(|h| {
        let f = f16::from_bits(h).to_f32().to_bits();
        let b = u32::from(h) << 16;
        [
            f,
            f.wrapping_add(1),
            f.wrapping_sub(1),
            f | 0xfff,
            f | 0x1000,
            b | 0x8000,
            b | 0x7fff,
            b | 0x8001,
        ]
    });
    let strided = (0..u32::MAX / stride).map(move |i| i * stride);
    near.chain(strided).map(f32::from_bits)
}

/// Widens `src` into `dst` (same length).
#[inline(always)]
pub fn f16_to_f32_slice(src: &[f16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f16_bits_to_f32(s.to_bits());
    }
}

/// Narrows `src` into `dst` (same length), rounding to nearest even.
#[inline(always)]
pub fn f32_to_f16_slice(src: &[f32], dst: &mut [f16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16::from_bits(f32_to_f16_bits(s));
    }
}

/// Widens `src` into `dst` (same length).
#[inline(always)]
pub fn bf16_to_f32_slice(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16_bits_to_f32(s.to_bits());
    }
}

/// Narrows `src` into `dst` (same length), rounding to nearest even.
#[inline(always)]
pub fn f32_to_bf16_slice(src: &[f32], dst: &mut [bf16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16::from_bits(f32_to_bf16_bits(s));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn every_f16_widens_like_half() {
        for bits in 0..=u16::MAX {
            let ours = f16_bits_to_f32(bits);
            let theirs = f16::from_bits(bits).to_f32();
            assert!(same(ours, theirs), "f16 {bits:#06x}: {ours} vs {theirs}");
        }
    }

    #[test]
    fn every_bf16_widens_like_half() {
        for bits in 0..=u16::MAX {
            let ours = bf16_bits_to_f32(bits);
            let theirs = bf16::from_bits(bits).to_f32();
            assert!(same(ours, theirs), "bf16 {bits:#06x}");
        }
    }

    fn probes() -> impl Iterator<Item = f32> {
        narrowing_probes(1999)
    }

    #[test]
    fn narrowing_rounds_like_half() {
        for x in probes() {
            let ours = f16::from_bits(f32_to_f16_bits(x));
            let theirs = f16::from_f32(x);
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "f16 from {x:e} ({:#010x}): {:#06x} vs {:#06x}",
                x.to_bits(),
                ours.to_bits(),
                theirs.to_bits()
            );
            let ours = bf16::from_bits(f32_to_bf16_bits(x));
            let theirs = bf16::from_f32(x);
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "bf16 from {x:e} ({:#010x}): {:#06x} vs {:#06x}",
                x.to_bits(),
                ours.to_bits(),
                theirs.to_bits()
            );
        }
    }
}
