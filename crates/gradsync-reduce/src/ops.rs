//! Scalar definitions of the operators and of the element encodings.
//!
//! Everything here is `#[inline(always)]` and branch-free in the sense LLVM cares about: the
//! `if`s are selects, so a loop that applies one of these functions element by element
//! vectorizes.

use bytemuck::Pod;

/// An element as it is stored in a buffer: plain old data with a little-endian encoding.
pub(crate) trait Elem: Pod {
    /// Decodes one element from exactly `size_of::<Self>()` little-endian bytes.
    fn load_le(bytes: &[u8]) -> Self;
    /// Encodes one element into exactly `size_of::<Self>()` bytes, little-endian.
    fn store_le(self, bytes: &mut [u8]);
}

macro_rules! impl_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            #[inline(always)]
            fn load_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element-sized chunk"))
            }

            #[inline(always)]
            fn store_le(self, bytes: &mut [u8]) {
                bytes.copy_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}

impl_elem!(f32, f64, i32, i64, u8, u16);

/// The four arithmetic binary operators on one element type (`Avg` reduces with `sum`); the
/// integer types add the [`Bitwise`] ones.
pub(crate) trait Arith: Elem {
    /// `a + b` (wrapping for integers).
    fn sum(a: Self, b: Self) -> Self;
    /// `a * b` (wrapping for integers).
    fn prod(a: Self, b: Self) -> Self;
    /// The smaller operand (see [`min_f32`] for floats).
    fn min(a: Self, b: Self) -> Self;
    /// The larger operand (see [`max_f32`] for floats).
    fn max(a: Self, b: Self) -> Self;
}

macro_rules! impl_int {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }

            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }

            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Ord::min(a, b)
            }

            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Ord::max(a, b)
            }
        }
    )*};
}

impl_int!(i32, i64, u8);

/// The bitwise operators of the integer types. Each is one vector instruction per register of
/// elements (`vpand`, `vpor`, `vpxor`), the same whatever the element width.
pub(crate) trait Bitwise: Arith {
    /// `a & b`.
    fn band(a: Self, b: Self) -> Self;
    /// `a | b`.
    fn bor(a: Self, b: Self) -> Self;
    /// `a ^ b`.
    fn bxor(a: Self, b: Self) -> Self;
}

macro_rules! impl_bitwise {
    ($($t:ty),*) => {$(
        impl Bitwise for $t {
            #[inline(always)]
            fn band(a: Self, b: Self) -> Self {
                a & b
            }

            #[inline(always)]
            fn bor(a: Self, b: Self) -> Self {
                a | b
            }

            #[inline(always)]
            fn bxor(a: Self, b: Self) -> Self {
                a ^ b
            }
        }
    )*};
}

impl_bitwise!(i32, i64, u8);

macro_rules! impl_float {
    ($t:ty, $min:ident, $max:ident, $canonical:ident) => {
        /// `x`, or the canonical quiet NaN if `x` is any NaN: which NaN the FPU returns depends on
        /// operand order, and results must not.
        #[inline(always)]
        pub(crate) fn $canonical(x: $t) -> $t {
            if x.is_nan() { <$t>::NAN } else { x }
        }

        /// Minimum that is commutative to the bit: a NaN operand gives the canonical quiet NaN,
        /// and `-0.0` against `+0.0` gives `-0.0` (the tie takes the union of the sign bits).
        #[inline(always)]
        pub(crate) fn $min(a: $t, b: $t) -> $t {
            let lesser = if a < b { a } else { b };
            // Equal non-zero values have equal bits, so only the zeros are affected.
            let tie = <$t>::from_bits(a.to_bits() | b.to_bits());
            let r = if a == b { tie } else { lesser };
            if a.is_nan() | b.is_nan() {
                <$t>::NAN
            } else {
                r
            }
        }

        /// Maximum that is commutative to the bit: a NaN operand gives the canonical quiet NaN,
        /// and `-0.0` against `+0.0` gives `+0.0` (the tie takes the intersection of the sign
        /// bits).
        #[inline(always)]
        pub(crate) fn $max(a: $t, b: $t) -> $t {
            let greater = if a > b { a } else { b };
            let tie = <$t>::from_bits(a.to_bits() & b.to_bits());
            let r = if a == b { tie } else { greater };
            if a.is_nan() | b.is_nan() {
                <$t>::NAN
            } else {
                r
            }
        }

        impl Arith for $t {
            #[inline(always)]
            fn sum(a: Self, b: Self) -> Self {
                $canonical(a + b)
            }

            #[inline(always)]
            fn prod(a: Self, b: Self) -> Self {
                $canonical(a * b)
            }

            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                $min(a, b)
            }

            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                $max(a, b)
            }
        }
    };
}

impl_float!(f32, min_f32, max_f32, canonical_f32);
impl_float!(f64, min_f64, max_f64, canonical_f64);

/// A 16-bit float format, held as its bit pattern and computed through `f32`.
pub(crate) trait Half {
    /// Whether this is IEEE binary16 (which has hardware conversions on x86, F16C).
    const BINARY16: bool;
    /// The exact `f32` value of a bit pattern (a NaN stays a NaN, payload kept).
    fn widen(h: u16) -> f32;
    /// The bit pattern nearest to an `f32`, ties to even (a NaN stays a quiet NaN).
    fn narrow(x: f32) -> u16;
}

/// IEEE 754 binary16.
pub(crate) struct F16;

/// bfloat16.
pub(crate) struct Bf16;

impl Half for F16 {
    const BINARY16: bool = true;

    #[inline(always)]
    fn widen(h: u16) -> f32 {
        f16_bits_to_f32(h)
    }

    #[inline(always)]
    fn narrow(x: f32) -> u16 {
        f32_to_f16_bits(x)
    }
}

impl Half for Bf16 {
    const BINARY16: bool = false;

    #[inline(always)]
    fn widen(h: u16) -> f32 {
        bf16_bits_to_f32(h)
    }

    #[inline(always)]
    fn narrow(x: f32) -> u16 {
        f32_to_bf16_bits(x)
    }
}

/// Lifts an `f32` operator to 16-bit bit patterns: widen both operands, apply, round back.
#[inline(always)]
pub(crate) fn through_f32<H: Half>(
    f: impl Fn(f32, f32) -> f32 + Copy,
) -> impl Fn(u16, u16) -> u16 + Copy {
    move |a, b| H::narrow(f(H::widen(a), H::widen(b)))
}

/// Widens a binary16 bit pattern to `f32`, exactly (NaN payloads kept, as
/// `gradsync_core::reference::f16_to_f32` does; every NaN result is made canonical later),
/// without branches.
///
/// The exponent and mantissa are shifted into `f32` position and rebiased; the three exponent
/// classes are then handled as selects. All-ones (infinity, NaN) gets the rest of the exponent
/// range. Zero and subnormals are rebuilt with one float subtraction: `2^-14 * (1 + m/1024)`
/// minus `2^-14` is exactly `m * 2^-24`.
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    const EXP: u32 = 0x7C00 << 13;
    const MAGIC: u32 = 113 << 23; // 2^-14, the smallest normal binary16
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let shifted = (h & 0x7FFF) << 13;
    let normal = shifted + ((127 - 15) << 23);
    let special = normal + ((128 - 16) << 23);
    let tiny = (f32::from_bits(normal + (1 << 23)) - f32::from_bits(MAGIC)).to_bits();
    let exp = shifted & EXP;
    let bits = if exp == EXP {
        special
    } else if exp == 0 {
        tiny
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// Rounds an `f32` to the nearest binary16, ties to even, bit-identical to `half::f16::from_f32`
/// (a NaN keeps the top of its payload and is made quiet), without branches.
///
/// Normal results rebias the exponent and add `0xFFF` plus the lowest kept bit before dropping
/// 13 bits, which rounds to nearest-even and carries into the exponent (up to infinity) where it
/// must. Subnormal results let the FPU round: adding `0.5` puts the binary16 subnormal unit,
/// `2^-24`, at the last place of the sum, so the hardware's round-to-nearest-even does the work
/// and the mantissa bits of the sum are the result.
#[inline(always)]
pub(crate) fn f32_to_f16_bits(x: f32) -> u16 {
    const INF: u32 = 0x7F80_0000;
    const OVERFLOW: u32 = (127 + 16) << 23; // 2^16: at or above it, infinity
    const SMALLEST_NORMAL: u32 = 113 << 23; // 2^-14
    const MAGIC: u32 = 126 << 23; // 0.5
    let bits = x.to_bits();
    let sign = (bits >> 16) & 0x8000;
    let abs = bits & 0x7FFF_FFFF;
    let nan = 0x7E00 | ((abs >> 13) & 0x03FF);
    let tiny = (f32::from_bits(abs) + f32::from_bits(MAGIC))
        .to_bits()
        .wrapping_sub(MAGIC);
    let odd = (abs >> 13) & 1;
    let normal = abs
        .wrapping_sub((127 - 15) << 23)
        .wrapping_add(0x0FFF + odd)
        >> 13;
    let h = if abs > INF {
        nan
    } else if abs >= OVERFLOW {
        0x7C00
    } else if abs < SMALLEST_NORMAL {
        tiny
    } else {
        normal
    };
    (h | sign) as u16
}

/// Widens a bfloat16 bit pattern to `f32`: bfloat16 is the top half of an `f32`, so this is
/// exact, NaN payloads and signalling NaNs included (every NaN result is made canonical later).
#[inline(always)]
pub(crate) fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Rounds an `f32` to the nearest bfloat16, ties to even, bit-identical to
/// `half::bf16::from_f32`, written without branches so that slices of it vectorize.
///
/// Adding `0x7FFF` plus the lowest kept bit carries into the kept half exactly when the dropped
/// half is above the midpoint, or at the midpoint with an odd kept half. Finite values that
/// round past the largest bfloat16 carry into the exponent and become infinity, as they must.
#[inline(always)]
pub(crate) fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) | 0x0040) as u16;
    if x.is_nan() { nan } else { rounded }
}
