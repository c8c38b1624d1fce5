//! From `(dtype, op)` to one monomorphized loop, on the best instruction set of this CPU.

use gradsync_core::{DataType, ReduceOp};

use crate::kernel::{Backend, Portable};
use crate::ops::{Arith, Bf16, Bitwise, F16, Half, canonical_f32, canonical_f64};

/// Buffers shorter than this (in bytes) are reduced by the baseline kernels.
pub(crate) const VECTOR_MIN: usize = 64;

/// The instruction set the kernels run on.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Isa {
    /// The target's baseline (SSE2 on x86-64): every CPU.
    Portable,
    /// AVX2 and F16C, found at run time.
    #[cfg(target_arch = "x86_64")]
    Avx2(crate::x86::Avx2),
}

impl Isa {
    /// The instruction set for a buffer of `bytes`: the best this CPU supports, or the
    /// baseline below [`VECTOR_MIN`] bytes, where the vector kernels' setup costs more than
    /// they save (the results are the same bits on every instruction set).
    #[inline]
    pub(crate) fn for_len(bytes: usize) -> Isa {
        if bytes < VECTOR_MIN {
            return Isa::Portable;
        }
        Isa::best()
    }

    /// The best instruction set this CPU supports.
    #[inline]
    pub(crate) fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if let Some(avx2) = crate::x86::Avx2::detect() {
            return Isa::Avx2(avx2);
        }
        Isa::Portable
    }

    /// Every instruction set this CPU supports, baseline first.
    #[cfg(test)]
    pub(crate) fn all() -> Vec<Isa> {
        let mut all = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        all.extend(crate::x86::Avx2::detect().map(Isa::Avx2));
        all
    }

    /// A short name (`portable`, `avx2+f16c`).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2(_) => "avx2+f16c",
        }
    }
}

/// `acc[i] = acc[i] op inc[i]` on `isa`; lengths already checked.
pub(crate) fn in_place(isa: Isa, dtype: DataType, op: ReduceOp, acc: &mut [u8], inc: &[u8]) {
    match isa {
        Isa::Portable => in_place_on(Portable, dtype, op, acc, inc),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2(b) => in_place_on(b, dtype, op, acc, inc),
    }
}

/// `dst[i] = a[i] op b[i]` on `isa`; lengths already checked.
pub(crate) fn into(isa: Isa, dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    match isa {
        Isa::Portable => into_on(Portable, dtype, op, dst, a, b),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2(be) => into_on(be, dtype, op, dst, a, b),
    }
}

/// `buf[i] /= world` on `isa`; length already checked, `world >= 1`.
pub(crate) fn divide(isa: Isa, dtype: DataType, buf: &mut [u8], world: usize) {
    match isa {
        Isa::Portable => divide_on(Portable, dtype, buf, world),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2(b) => divide_on(b, dtype, buf, world),
    }
}

fn in_place_on<B: Backend>(b: B, dtype: DataType, op: ReduceOp, acc: &mut [u8], inc: &[u8]) {
    match dtype {
        DataType::F32 => arith_in_place::<B, f32>(b, op, acc, inc),
        DataType::F64 => arith_in_place::<B, f64>(b, op, acc, inc),
        DataType::F16 => half_in_place::<B, F16>(b, op, acc, inc),
        DataType::Bf16 => half_in_place::<B, Bf16>(b, op, acc, inc),
        DataType::I32 => int_in_place::<B, i32>(b, op, acc, inc),
        DataType::I64 => int_in_place::<B, i64>(b, op, acc, inc),
        DataType::U8 => int_in_place::<B, u8>(b, op, acc, inc),
    }
}

fn into_on<B: Backend>(be: B, dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    match dtype {
        DataType::F32 => arith_into::<B, f32>(be, op, dst, a, b),
        DataType::F64 => arith_into::<B, f64>(be, op, dst, a, b),
        DataType::F16 => half_into::<B, F16>(be, op, dst, a, b),
        DataType::Bf16 => half_into::<B, Bf16>(be, op, dst, a, b),
        DataType::I32 => int_into::<B, i32>(be, op, dst, a, b),
        DataType::I64 => int_into::<B, i64>(be, op, dst, a, b),
        DataType::U8 => int_into::<B, u8>(be, op, dst, a, b),
    }
}

/// The message of a bitwise operator that reached a float kernel: the public functions check
/// the pair first, so this is a broken invariant of the crate.
const BITWISE_FLOAT: &str = "gradsync-reduce: bitwise operator dispatched to a float kernel";

fn int_in_place<B: Backend, T: Bitwise>(b: B, op: ReduceOp, acc: &mut [u8], inc: &[u8]) {
    match op {
        ReduceOp::Band => b.fold(acc, inc, T::band),
        ReduceOp::Bor => b.fold(acc, inc, T::bor),
        ReduceOp::Bxor => b.fold(acc, inc, T::bxor),
        _ => arith_in_place::<B, T>(b, op, acc, inc),
    }
}

fn int_into<B: Backend, T: Bitwise>(be: B, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    match op {
        ReduceOp::Band => be.combine(dst, a, b, T::band),
        ReduceOp::Bor => be.combine(dst, a, b, T::bor),
        ReduceOp::Bxor => be.combine(dst, a, b, T::bxor),
        _ => arith_into::<B, T>(be, op, dst, a, b),
    }
}

fn arith_in_place<B: Backend, T: Arith>(b: B, op: ReduceOp, acc: &mut [u8], inc: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => b.fold(acc, inc, T::sum),
        ReduceOp::Prod => b.fold(acc, inc, T::prod),
        ReduceOp::Min => b.fold(acc, inc, T::min),
        ReduceOp::Max => b.fold(acc, inc, T::max),
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => unreachable!("{BITWISE_FLOAT}"),
    }
}

fn arith_into<B: Backend, T: Arith>(be: B, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => be.combine(dst, a, b, T::sum),
        ReduceOp::Prod => be.combine(dst, a, b, T::prod),
        ReduceOp::Min => be.combine(dst, a, b, T::min),
        ReduceOp::Max => be.combine(dst, a, b, T::max),
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => unreachable!("{BITWISE_FLOAT}"),
    }
}

fn half_in_place<B: Backend, H: Half>(b: B, op: ReduceOp, acc: &mut [u8], inc: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => b.half_fold::<H>(acc, inc, <f32 as Arith>::sum),
        ReduceOp::Prod => b.half_fold::<H>(acc, inc, <f32 as Arith>::prod),
        ReduceOp::Min => b.half_fold::<H>(acc, inc, <f32 as Arith>::min),
        ReduceOp::Max => b.half_fold::<H>(acc, inc, <f32 as Arith>::max),
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => unreachable!("{BITWISE_FLOAT}"),
    }
}

fn half_into<B: Backend, H: Half>(be: B, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => be.half_combine::<H>(dst, a, b, <f32 as Arith>::sum),
        ReduceOp::Prod => be.half_combine::<H>(dst, a, b, <f32 as Arith>::prod),
        ReduceOp::Min => be.half_combine::<H>(dst, a, b, <f32 as Arith>::min),
        ReduceOp::Max => be.half_combine::<H>(dst, a, b, <f32 as Arith>::max),
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => unreachable!("{BITWISE_FLOAT}"),
    }
}

/// Floats divide by `world` as a float, a true division (no reciprocal), NaN made canonical;
/// integers truncate, exactly for any `world`.
fn divide_on<B: Backend>(b: B, dtype: DataType, buf: &mut [u8], world: usize) {
    match dtype {
        DataType::F32 => {
            let w = world as f32;
            b.map(buf, move |x: f32| canonical_f32(x / w));
        }
        DataType::F64 => {
            let w = world as f64;
            b.map(buf, move |x: f64| canonical_f64(x / w));
        }
        DataType::F16 => {
            let w = world as f32;
            b.half_map::<F16>(buf, move |x| canonical_f32(x / w));
        }
        DataType::Bf16 => {
            let w = world as f32;
            b.half_map::<Bf16>(buf, move |x| canonical_f32(x / w));
        }
        DataType::I32 => match i32::try_from(world) {
            Ok(w) => b.map(buf, move |x: i32| x / w),
            Err(_) => {
                // |x| <= 2^31 <= world: the quotient is 0, or -1 for i32::MIN / 2^31.
                let w = i64::try_from(world).unwrap_or(i64::MAX);
                b.map(buf, move |x: i32| (i64::from(x) / w) as i32);
            }
        },
        DataType::I64 => match i64::try_from(world) {
            Ok(w) => b.map(buf, move |x: i64| x / w),
            Err(_) => {
                let w = world as i128;
                b.map(buf, move |x: i64| (i128::from(x) / w) as i64);
            }
        },
        DataType::U8 => match u8::try_from(world) {
            Ok(w) => b.map(buf, move |x: u8| x / w),
            Err(_) => buf.fill(0),
        },
    }
}
