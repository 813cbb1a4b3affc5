//! What the collectives move and how two values combine: the element types ([`DType`],
//! [`Element`]) and the reduction operators ([`ReduceOp`]). A leaf: the portable loops of
//! [`reduce`](crate::reduce) and their AVX2 builds both read it.

use half::{bf16, f16};

/// Element types that collectives move and reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// IEEE binary32.
    F32 = 0,
    /// IEEE binary16.
    F16 = 1,
    /// bfloat16.
    BF16 = 2,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The dtype with wire code `code`, if any.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            2 => Some(DType::BF16),
            _ => None,
        }
    }

    /// Lower-case name ("f32", "f16", "bf16").
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }
}

/// How two values combine. A mean is a sum followed by [`scale`](crate::scale).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// `a + b`.
    Sum = 0,
    /// The larger value.
    Max = 1,
    /// The smaller value.
    Min = 2,
}

impl ReduceOp {
    /// Lower-case name ("sum", "max", "min").
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }

    #[inline(always)]
    pub(crate) fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            ReduceOp::Sum => a + b,
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
        }
    }
}

/// An element type of the collectives and of the casts: plain old data with a conversion
/// through f32 (widening is exact; narrowing rounds to nearest, ties to even, as
/// [`convert`](crate::convert)).
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// Its [`DType`].
    const DTYPE: DType;
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// `value` rounded once to this type.
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        value
    }
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::convert::f16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        f16::from_bits(crate::convert::f32_to_f16_bits(value))
    }
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        crate::convert::bf16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        bf16::from_bits(crate::convert::f32_to_bf16_bits(value))
    }
}
