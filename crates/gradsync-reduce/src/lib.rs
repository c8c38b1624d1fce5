//! Element-wise reduction kernels over byte buffers.
//!
//! The engine moves gradients as registered byte regions, so every kernel here takes `&[u8]`
//! holding a little-endian array of one [`DataType`] and combines two such arrays with one
//! [`ReduceOp`]:
//!
//! - [`reduce_in_place`]: `acc[i] = acc[i] op incoming[i]`, the step of a ring reduce-scatter
//!   where a received chunk is folded into the local one;
//! - [`reduce_into`]: `dst[i] = a[i] op b[i]`, for when the result must land in a third buffer
//!   (the first step of a tree, or a send buffer that must stay intact);
//! - [`finalize_avg`]: the single division by the world size that finishes [`ReduceOp::Avg`].
//!
//! ```
//! use gradsync_core::{DataType, ReduceOp};
//!
//! let bytes = |xs: &[f32]| xs.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
//! let mut acc = bytes(&[1.0, 2.0, -0.0]);
//! let incoming = bytes(&[0.5, -4.0, 0.0]);
//! gradsync_reduce::reduce_in_place(DataType::F32, ReduceOp::Avg, &mut acc, &incoming);
//! gradsync_reduce::finalize_avg(DataType::F32, &mut acc, 2);
//! assert_eq!(acc, bytes(&[0.75, -1.0, 0.0]));
//! ```
//!
//! # Semantics
//!
//! - `Avg` reduces exactly as `Sum`; the owner of each slice divides once at the end, so every
//!   rank ends with the same bits.
//! - Integers wrap on `Sum` and `Prod`; `finalize_avg` divides with truncation toward zero.
//! - `Band`, `Bor` and `Bxor` are the bitwise and, or and exclusive or of the integer types
//!   (`i32`, `i64`, `u8`), in the same vectorized loops as the other integer operators. They
//!   are not defined for float types: asking for one panics like a size mismatch (the engine
//!   refuses such a call before it reaches a kernel).
//! - Float `Min`/`Max` are NaN when either operand is NaN. Otherwise they return the
//!   smaller/larger operand, and the signed-zero tie is settled by the sign bit
//!   (`min(-0.0, +0.0) = -0.0`, `max(-0.0, +0.0) = +0.0`) rather than by operand order.
//! - Every NaN a float kernel produces is the canonical quiet NaN (positive, payload only the
//!   quiet bit): which NaN the FPU returns for `NaN + NaN` depends on operand order.
//!
//! Together with IEEE addition and multiplication being commutative, this makes `a op b` and
//! `b op a` bit-identical for every operator, dtype and input, NaNs included. That matters
//! because different ranks fold contributions in different orders: ring and tree schedules only
//! agree to the bit if the kernel never depends on operand order. These are the semantics of
//! `gradsync_core::reference`, which the tests check the kernels against bit for bit.
//!
//! # Why `f16` and `bf16` go through `f32`
//!
//! CPUs have no 16-bit float arithmetic worth the name, but they convert to and from `f32` cheaply
//! (`F16C` on x86, a shift for bfloat16). Each element is therefore widened, combined in `f32`,
//! and rounded back to nearest-even. That is not a compromise on accuracy: `f32` carries at least
//! `2p + 2` bits of significand for both formats (`p` = 11 for `f16`, 8 for `bf16`), so rounding
//! a sum, product or quotient first to `f32` and then to the half format gives the correctly
//! rounded half result (double rounding is innocuous at that precision), identical to what native
//! half arithmetic would produce. Min and max are exact.
//!
//! The conversions are written here rather than called per element from `half`: as branch-free
//! integer code they inline into the reduction loop and vectorize, so widening, combining and
//! rounding happen in registers in one pass over memory. They are bit-identical to
//! `gradsync_core::reference` and to `half` (which also sets the quiet bit of a widened NaN),
//! as the tests check for every 16-bit pattern and for every rounding boundary.
//!
//! # How vectorization is ensured
//!
//! The kernels rely on LLVM's auto-vectorizer and are written so that it always succeeds:
//!
//! - **Typed views.** When the host is little-endian and a byte slice is aligned for its element
//!   type, it is viewed in place as `&[f32]`, `&[i64]`, ... with `bytemuck` (a checked,
//!   zero-cost cast). The loops then see plain typed slices with no per-element decoding.
//! - **Plain zipped loops.** Each kernel is one `for` over zipped slice iterators: no indexing,
//!   so no bounds checks, and a shape LLVM's loop vectorizer handles for every operator. (Nesting
//!   the loop in fixed 16-element steps looked like a help but made LLVM vectorize the outer
//!   loop with per-lane gathers for min/max, a quarter of the speed.)
//! - **Selects, not branches.** The operators and conversions are written so that every `if` is
//!   a select (float min/max compute both the ordered and the tie result and pick one), and they
//!   are `#[inline(always)]` into generic loops that are monomorphized per dtype and operator,
//!   so the dispatch on `(dtype, op)` happens once per call and never per element.
//!
//! Unaligned slices (a region at an odd offset) are read element by element with
//! `from_le_bytes` over `chunks_exact`, which LLVM compiles to the same vector loop with
//! unaligned loads; it is also the path that keeps big-endian hosts correct.
//!
//! # Instruction sets
//!
//! The loops are compiled twice. The portable copy uses the target's baseline (SSE2 on x86-64)
//! and runs everywhere. On x86-64 a second copy is compiled with AVX2 and F16C enabled and
//! chosen at run time when the CPU has both ([`isa`] says which is in use); its binary16 kernels
//! convert eight values per instruction (`vcvtph2ps`/`vcvtps2ph`), several times faster than
//! the integer conversions, which SSE2 can only run four lanes wide. Both copies give the same
//! bits. The only `unsafe` in the crate is the call into the AVX2 copy, made through a token that
//! exists only once the features have been detected.
//!
//! The micro-benchmark `benches/kernels.rs` (`cargo bench -p gradsync-reduce`) checks the result:
//! it times the kernels against `memcpy` of the same size and against an `f32` loop kept scalar
//! with `std::hint::black_box`, in the same run. Set `GRADSYNC_REDUCE_BENCH_LARGE=1` to add
//! 256 MiB buffers.
//!
//! # Panics
//!
//! The engine validates sizes before it calls a kernel, so a size mismatch here is a broken
//! internal invariant, not a peer's fault: every function panics when its slices differ in length
//! or a length is not a multiple of [`DataType::size`], and [`reduce_in_place`] and
//! [`reduce_into`] panic when asked for a bitwise operator over a float type.

#![deny(unsafe_code)]

mod dispatch;
mod kernel;
mod ops;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86;

use gradsync_core::{DataType, ReduceOp};

use crate::dispatch::Isa;

/// Folds `incoming` into `acc`: `acc[i] = acc[i] op incoming[i]` for every element.
///
/// Both slices hold little-endian elements of `dtype` and may have any alignment (aligned
/// slices are viewed in place; others are read element by element). [`ReduceOp::Avg`] adds;
/// finish with [`finalize_avg`].
///
/// # Panics
///
/// If `acc` and `incoming` differ in length, the length is not a multiple of `dtype.size()`, or
/// `op` is bitwise and `dtype` a float type.
#[track_caller]
pub fn reduce_in_place(dtype: DataType, op: ReduceOp, acc: &mut [u8], incoming: &[u8]) {
    check_op(dtype, op);
    check_multiple(dtype, "acc", acc.len());
    check_same("acc", acc.len(), "incoming", incoming.len());
    dispatch::in_place(Isa::for_len(acc.len()), dtype, op, acc, incoming);
}

/// Combines `a` and `b` into `dst`: `dst[i] = a[i] op b[i]` for every element.
///
/// All three slices hold little-endian elements of `dtype` and may have any alignment (the
/// in-place view needs all three aligned). [`ReduceOp::Avg`] adds; finish with
/// [`finalize_avg`].
///
/// # Panics
///
/// If the three slices differ in length, the length is not a multiple of `dtype.size()`, or
/// `op` is bitwise and `dtype` a float type.
#[track_caller]
pub fn reduce_into(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    check_op(dtype, op);
    check_multiple(dtype, "dst", dst.len());
    check_same("dst", dst.len(), "a", a.len());
    check_same("dst", dst.len(), "b", b.len());
    dispatch::into(Isa::for_len(dst.len()), dtype, op, dst, a, b);
}

/// Copies `src` into `dst` (equal lengths) for data that the caller will not read again soon:
/// on x86-64 the bulk of it goes out with non-temporal stores, which skip the read that an
/// ordinary store makes of each destination cache line and leave the caches to the data still
/// in use. Visible to other threads like an ordinary copy once it returns. Elsewhere, and for
/// copies under 64 KiB, it is `copy_from_slice`.
///
/// # Panics
///
/// If the lengths differ.
#[track_caller]
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    check_same("dst", dst.len(), "src", src.len());
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= STREAMING_MIN {
        return x86::copy_streaming(dst, src);
    }
    dst.copy_from_slice(src);
}

/// Copies shorter than this stay in the cache: their destination is likely read again soon.
pub const STREAMING_MIN: usize = 64 << 10;

/// Divides every element of `buf` by `world`, the finishing step of [`ReduceOp::Avg`].
///
/// Floats divide by `world` converted to the float type (`f16` and `bf16` through `f32`, then
/// rounded to nearest-even). It is a true division, not a multiplication by the reciprocal,
/// which would be off by one ulp for some inputs. Integers (`u8` included) divide with
/// truncation toward zero, exactly, for any `world`. A NaN result is the canonical NaN, so
/// `world == 1` leaves `buf` unchanged except for NaN payloads.
///
/// # Panics
///
/// If `world` is zero, or `buf.len()` is not a multiple of `dtype.size()`.
#[track_caller]
pub fn finalize_avg(dtype: DataType, buf: &mut [u8], world: usize) {
    assert!(
        world > 0,
        "gradsync-reduce: finalize_avg with a world size of zero"
    );
    check_multiple(dtype, "buf", buf.len());
    if world > 1 || dtype.is_float() {
        dispatch::divide(Isa::best(), dtype, buf, world);
    }
}

/// The instruction set the kernels use on this CPU: `"avx2+f16c"` (x86-64 with AVX2 and F16C,
/// detected at run time) or `"portable"` (the target's baseline, SSE2 on x86-64). For logs and
/// benchmark reports; results are bit-identical either way.
pub fn isa() -> &'static str {
    Isa::best().name()
}

/// Panics unless `op` is defined for `dtype` (a bitwise operator over a float type is not).
#[track_caller]
fn check_op(dtype: DataType, op: ReduceOp) {
    if let Err(e) = op.check(dtype) {
        panic!("gradsync-reduce: {e}");
    }
}

/// Panics unless `len` is a whole number of `dtype` elements.
#[track_caller]
fn check_multiple(dtype: DataType, what: &str, len: usize) {
    assert!(
        len.is_multiple_of(dtype.size()),
        "gradsync-reduce: {what} is {len} bytes, not a multiple of the {dtype} element size {}",
        dtype.size()
    );
}

/// Panics unless two buffers have the same length.
#[track_caller]
fn check_same(what: &str, len: usize, other: &str, other_len: usize) {
    assert!(
        len == other_len,
        "gradsync-reduce: length mismatch: {what} is {len} bytes, {other} is {other_len} bytes"
    );
}
