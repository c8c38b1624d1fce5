//! Naive scalar reference of the reductions and collectives, over little-endian bytes.
//!
//! This is the definition the simulator, the kernels of `gradsync-reduce` and the conformance
//! suites are checked against; it favours obviousness over speed.
//!
//! # Element semantics
//!
//! - `F16` and `Bf16` are widened to `f32`, combined in `f32`, and rounded back to nearest, ties
//!   to even (the conversions are written out here: [`f16_to_f32`], [`f32_to_f16`],
//!   [`bf16_to_f32`], [`f32_to_bf16`]).
//! - Integers wrap (two's complement; `U8` modulo 256).
//! - `Band`, `Bor`, `Bxor` are the bitwise and, or and exclusive or of the integer types. They
//!   are not defined for floating-point types: every function here that reduces panics when
//!   asked for one over a float type (callers check with [`ReduceOp::check`] first).
//! - `Min`/`Max` of floats: NaN if either operand is NaN, else the smaller/larger, with
//!   `-0.0 < +0.0`. Every NaN a float reduction produces is the canonical quiet NaN (positive,
//!   payload only the quiet bit), so every operator is commutative bit for bit.
//! - `Avg` is `Sum` element by element; [`finalize_avg`] then divides once by the world size:
//!   float division `x / world` (through `f32` for the half types), truncating division for
//!   integers (after the wrapping sum). Over a world of one, the average is the input unchanged.
//!
//! # Checking results
//!
//! Float sums and products are not associative, and each algorithm reduces in its own order, so
//! the reference cannot predict the bits of a float all-reduce in general. [`check`] therefore
//! verifies, for a run of any schedule:
//!
//! 1. ranks that must agree (all-reduce, all-gather, broadcast) hold bitwise identical results;
//! 2. the results equal [`expected`] bit for bit when the outcome is independent of the order of
//!    reduction: integer types, `Min`/`Max`, collectives that do not reduce, and float inputs made
//!    of small integers or powers of two whose partial results are all exact
//!    ([`InputKind::Exact`]);
//! 3. otherwise (random floats, [`InputKind::Random`]) they are within a relative tolerance of the
//!    reference, scaled by the sum of the magnitudes of the inputs ([`Tolerance::Relative`]).
//!
//! [`gen_input`] makes inputs of each kind, [`default_tolerance`] picks the matching check.

use std::fmt;

use crate::rng::XorShift64;
use crate::{Collective, DataType, ReduceOp, TypeError};

// ---- half-precision conversions ----------------------------------------------------------------

/// Widens an IEEE binary16 value (exact; NaN payloads are kept, signalling NaNs stay NaN).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let mant = u32::from(h & 0x3ff);
    let bits = match exp {
        0 if mant == 0 => sign,
        0 => {
            // Subnormal: mant * 2^-24. Normalise so that bit 10 is the implicit one.
            let shift = mant.leading_zeros() - 21;
            sign | ((113 - shift) << 23) | (((mant << shift) & 0x3ff) << 13)
        }
        0x1f => sign | 0x7f80_0000 | (mant << 13),
        _ => sign | ((exp + 112) << 23) | (mant << 13),
    };
    f32::from_bits(bits)
}

/// `m >> shift` rounded to nearest, ties to even (`1 <= shift <= 31`).
fn round_shift(m: u32, shift: u32) -> u32 {
    let q = m >> shift;
    let rem = m & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    }
}

/// Rounds an `f32` to IEEE binary16, to nearest with ties to even; overflow gives infinity,
/// NaNs stay NaN (quieted, the top payload bits kept).
pub fn f32_to_f16(f: f32) -> u16 {
    let x = f.to_bits();
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = ((x >> 23) & 0xff) as i32;
    let mant = x & 0x7f_ffff;
    if exp == 0xff {
        return if mant == 0 {
            sign | 0x7c00
        } else {
            sign | 0x7e00 | (mant >> 13) as u16
        };
    }
    let e = exp - 127;
    if e > 15 {
        return sign | 0x7c00;
    }
    if e >= -14 {
        // Normal: a carry out of the mantissa correctly bumps the exponent (up to infinity).
        let bits = (((e + 15) as u32) << 10) + round_shift(mant, 13);
        return sign | bits as u16;
    }
    // Subnormal or zero; f32 zeros and subnormals are far below half the smallest f16 step.
    let shift = (-e - 1) as u32;
    if exp == 0 || shift > 24 {
        return sign;
    }
    sign | round_shift(mant | 0x80_0000, shift) as u16
}

/// Widens a bfloat16 value (exact).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Rounds an `f32` to bfloat16, to nearest with ties to even; NaNs stay NaN (quieted).
pub fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    if f.is_nan() {
        return (x >> 16) as u16 | 0x0040;
    }
    ((x + 0x7fff + ((x >> 16) & 1)) >> 16) as u16
}

// ---- element operations ------------------------------------------------------------------------

/// One element type of the reference: decode, combine, encode.
trait Elem: Copy {
    const N: usize;
    fn load(b: &[u8]) -> Self;
    fn store(self, b: &mut [u8]);
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    fn div(self, world: usize) -> Self;
}

macro_rules! float_elem {
    ($t:ty, $n:literal) => {
        impl Elem for $t {
            const N: usize = $n;
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b[..$n].try_into().expect("element size"))
            }
            fn store(self, b: &mut [u8]) {
                b[..$n].copy_from_slice(&self.to_le_bytes());
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                let r = match op {
                    ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => {
                        unreachable!("bitwise {op} over a float type passed check_op")
                    }
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Prod => a * b,
                    ReduceOp::Min | ReduceOp::Max if a.is_nan() || b.is_nan() => <$t>::NAN,
                    ReduceOp::Min if a == b => {
                        if a.is_sign_negative() {
                            a
                        } else {
                            b
                        }
                    }
                    ReduceOp::Max if a == b => {
                        if a.is_sign_negative() {
                            b
                        } else {
                            a
                        }
                    }
                    ReduceOp::Min => {
                        if a < b {
                            a
                        } else {
                            b
                        }
                    }
                    ReduceOp::Max => {
                        if a > b {
                            a
                        } else {
                            b
                        }
                    }
                };
                if r.is_nan() { <$t>::NAN } else { r }
            }
            fn div(self, world: usize) -> Self {
                let r = self / world as $t;
                if r.is_nan() { <$t>::NAN } else { r }
            }
        }
    };
}
float_elem!(f32, 4);
float_elem!(f64, 8);

/// A binary16 element, computed through `f32`.
#[derive(Clone, Copy)]
struct F16(u16);
/// A bfloat16 element, computed through `f32`.
#[derive(Clone, Copy)]
struct Bf16(u16);

macro_rules! half_elem {
    ($t:ident, $widen:ident, $narrow:ident) => {
        impl Elem for $t {
            const N: usize = 2;
            fn load(b: &[u8]) -> Self {
                $t(u16::from_le_bytes([b[0], b[1]]))
            }
            fn store(self, b: &mut [u8]) {
                b[..2].copy_from_slice(&self.0.to_le_bytes());
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                $t($narrow(f32::combine(op, $widen(a.0), $widen(b.0))))
            }
            fn div(self, world: usize) -> Self {
                $t($narrow($widen(self.0).div(world)))
            }
        }
    };
}
half_elem!(F16, f16_to_f32, f32_to_f16);
half_elem!(Bf16, bf16_to_f32, f32_to_bf16);

macro_rules! int_elem {
    ($t:ty, $n:literal) => {
        impl Elem for $t {
            const N: usize = $n;
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b[..$n].try_into().expect("element size"))
            }
            fn store(self, b: &mut [u8]) {
                b[..$n].copy_from_slice(&self.to_le_bytes());
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Band => a & b,
                    ReduceOp::Bor => a | b,
                    ReduceOp::Bxor => a ^ b,
                }
            }
            fn div(self, world: usize) -> Self {
                (i128::from(self) / world as i128) as $t
            }
        }
    };
}
int_elem!(i32, 4);
int_elem!(i64, 8);
int_elem!(u8, 1);

/// Calls `$f::<T>($args)` with `T` the element type of `$dtype`.
macro_rules! dispatch {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DataType::F32 => $f::<f32>($($arg),*),
            DataType::F64 => $f::<f64>($($arg),*),
            DataType::F16 => $f::<F16>($($arg),*),
            DataType::Bf16 => $f::<Bf16>($($arg),*),
            DataType::I32 => $f::<i32>($($arg),*),
            DataType::I64 => $f::<i64>($($arg),*),
            DataType::U8 => $f::<u8>($($arg),*),
        }
    };
}

fn reduce_t<T: Elem>(op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    for ((d, x), y) in dst
        .chunks_exact_mut(T::N)
        .zip(a.chunks_exact(T::N))
        .zip(b.chunks_exact(T::N))
    {
        T::combine(op, T::load(x), T::load(y)).store(d);
    }
}

fn reduce_assign_t<T: Elem>(op: ReduceOp, acc: &mut [u8], b: &[u8]) {
    for (d, y) in acc.chunks_exact_mut(T::N).zip(b.chunks_exact(T::N)) {
        T::combine(op, T::load(d), T::load(y)).store(d);
    }
}

fn finalize_t<T: Elem>(buf: &mut [u8], world: usize) {
    for d in buf.chunks_exact_mut(T::N) {
        T::load(d).div(world).store(d);
    }
}

/// Panics with [`ReduceOp::check`]'s message if `op` is not defined for `dtype`.
#[track_caller]
fn check_op(dtype: DataType, op: ReduceOp) {
    if let Err(e) = op.check(dtype) {
        panic!("{e}");
    }
}

fn check_lens(dtype: DataType, lens: &[usize]) {
    let n = lens[0];
    assert!(
        n.is_multiple_of(dtype.size()) && lens.iter().all(|&l| l == n),
        "byte lengths {lens:?} are not equal multiples of the {dtype} element size"
    );
}

/// `out = a op b` for one element of `dtype` (each slice exactly one element). For `Avg` this is
/// the sum; see [`finalize_avg`].
///
/// # Panics
///
/// If a slice is not exactly one element long, or `op` is bitwise and `dtype` a float type.
pub fn reduce_elem(dtype: DataType, op: ReduceOp, a: &[u8], b: &[u8], out: &mut [u8]) {
    check_op(dtype, op);
    let n = dtype.size();
    assert!(
        a.len() == n && b.len() == n && out.len() == n,
        "not one {dtype} element"
    );
    dispatch!(dtype, reduce_t(op, out, a, b));
}

/// `dst[i] = a[i] op b[i]` element by element.
///
/// # Panics
///
/// If the slices differ in length or are not a whole number of elements, or `op` is bitwise and
/// `dtype` a float type.
pub fn reduce_slices(dtype: DataType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    check_op(dtype, op);
    check_lens(dtype, &[dst.len(), a.len(), b.len()]);
    dispatch!(dtype, reduce_t(op, dst, a, b));
}

/// `acc[i] = acc[i] op b[i]` element by element: [`reduce_slices`] with `dst` and `a` the same.
///
/// # Panics
///
/// If the slices differ in length or are not a whole number of elements, or `op` is bitwise and
/// `dtype` a float type.
pub fn reduce_assign(dtype: DataType, op: ReduceOp, acc: &mut [u8], b: &[u8]) {
    check_op(dtype, op);
    check_lens(dtype, &[acc.len(), b.len()]);
    dispatch!(dtype, reduce_assign_t(op, acc, b));
}

/// Divides every element of `buf` by `world` (the last step of `Avg`).
///
/// # Panics
///
/// If `buf` is not a whole number of elements or `world == 0`.
pub fn finalize_avg(dtype: DataType, buf: &mut [u8], world: usize) {
    assert!(world > 0, "average over an empty world");
    check_lens(dtype, &[buf.len()]);
    dispatch!(dtype, finalize_t(buf, world));
}

/// Decodes one element to `f64` (exact for every type but `I64` beyond 2^53).
pub fn to_f64(dtype: DataType, elem: &[u8]) -> f64 {
    match dtype {
        DataType::F32 => f64::from(f32::load(elem)),
        DataType::F64 => f64::load(elem),
        DataType::F16 => f64::from(f16_to_f32(F16::load(elem).0)),
        DataType::Bf16 => f64::from(bf16_to_f32(Bf16::load(elem).0)),
        DataType::I32 => f64::from(i32::load(elem)),
        DataType::I64 => i64::load(elem) as f64,
        DataType::U8 => f64::from(elem[0]),
    }
}

/// Encodes `v` as one element (rounded to nearest for floats, saturating for integers).
pub fn from_f64(dtype: DataType, v: f64) -> Vec<u8> {
    let mut out = Vec::with_capacity(dtype.size());
    push_f64(dtype, v, &mut out);
    out
}

/// Appends [`from_f64`]`(dtype, v)` to `out`.
fn push_f64(dtype: DataType, v: f64, out: &mut Vec<u8>) {
    match dtype {
        DataType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
        DataType::F64 => out.extend_from_slice(&v.to_le_bytes()),
        DataType::F16 => out.extend_from_slice(&f32_to_f16(v as f32).to_le_bytes()),
        DataType::Bf16 => out.extend_from_slice(&f32_to_bf16(v as f32).to_le_bytes()),
        DataType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
        DataType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
        DataType::U8 => out.push(v as u8),
    }
}

// ---- expected results --------------------------------------------------------------------------

/// The reduction of all inputs in rank order, `((in_0 op in_1) op in_2) ...`, finalised for `Avg`.
fn reduce_all(dtype: DataType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut acc = inputs.first().cloned().unwrap_or_default();
    for x in &inputs[1.min(inputs.len())..] {
        reduce_assign(dtype, op, &mut acc, x);
    }
    if op == ReduceOp::Avg && inputs.len() > 1 {
        finalize_avg(dtype, &mut acc, inputs.len());
    }
    acc
}

/// The result every rank should hold, given each rank's logical input (`inputs[r]` is rank r's
/// `Input` as laid out in [`crate::schedule::plan`]; its length fixes `count`). Results are what
/// [`Params::result_range`](crate::schedule::Params::result_range) selects: empty for non-root
/// ranks of a reduce and for barrier and send/recv.
///
/// Reductions are folded in rank order. For float sums and products that is one valid order
/// among many; see the [module docs](self) for how to compare.
///
/// # Panics
///
/// If `inputs.len() != world`, the inputs differ in length, (reduce-scatter) their length is
/// not a multiple of `world` elements, or the collective reduces and `op` is bitwise and `dtype`
/// a float type.
pub fn expected(
    coll: Collective,
    dtype: DataType,
    op: ReduceOp,
    world: usize,
    root: usize,
    inputs: &[Vec<u8>],
) -> Vec<Vec<u8>> {
    assert_eq!(inputs.len(), world, "one input per rank");
    if matches!(
        coll,
        Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
    ) {
        check_op(dtype, op);
    }
    if world == 0 {
        return Vec::new();
    }
    if coll == Collective::Scatter {
        // Only the root has an input.
        check_lens(dtype, &[inputs[root].len()]);
    } else {
        check_lens(dtype, &inputs.iter().map(Vec::len).collect::<Vec<_>>());
    }
    match coll {
        Collective::AllReduce => vec![reduce_all(dtype, op, inputs); world],
        Collective::ReduceScatter => {
            let all = reduce_all(dtype, op, inputs);
            assert!(
                all.len().is_multiple_of(world * dtype.size()),
                "input not divisible into slices"
            );
            let slice = all.len() / world;
            (0..world)
                .map(|r| all[r * slice..(r + 1) * slice].to_vec())
                .collect()
        }
        Collective::AllGather => vec![inputs.concat(); world],
        Collective::Broadcast => vec![inputs[root].clone(); world],
        Collective::Reduce => {
            let mut out = vec![Vec::new(); world];
            out[root] = reduce_all(dtype, op, inputs);
            out
        }
        Collective::AllToAll | Collective::AllToAllV => {
            let block = inputs[0].len() / world;
            assert!(
                inputs[0].len().is_multiple_of(world * dtype.size()),
                "input not divisible into blocks"
            );
            (0..world)
                .map(|r| {
                    inputs
                        .iter()
                        .flat_map(|x| x[r * block..(r + 1) * block].iter().copied())
                        .collect()
                })
                .collect()
        }
        Collective::Gather => {
            let mut out = vec![Vec::new(); world];
            out[root] = inputs.concat();
            out
        }
        Collective::Scatter => {
            let block = inputs[root].len() / world;
            (0..world)
                .map(|r| inputs[root][r * block..(r + 1) * block].to_vec())
                .collect()
        }
        Collective::Barrier | Collective::SendRecv => vec![Vec::new(); world],
    }
}

// ---- inputs ------------------------------------------------------------------------------------

/// Which values [`gen_input`] makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// Arbitrary bit patterns, NaNs included: for collectives that only move data.
    Bits,
    /// Values whose reduction is exact in any order: random integers for integer types (for
    /// `Band` mostly one bits, each bit set with probability 15/16, and for `Bor` mostly zero
    /// bits, 1/16, so that the reduction over a few ranks is neither all zeros nor all ones);
    /// for floats, integers in `-8..=8` (`Sum`, `Avg`), `±{1/2, 1, 2}` (`Prod`), and a mix of
    /// ordinary and special values (NaN, ±0, ±inf, subnormals) for `Min`/`Max`.
    Exact,
    /// Random floats: uniform in `[-1, 1]` (`Sum`, `Avg`), `±[0.75, 1.25]` (`Prod`); as `Exact`
    /// for `Min`/`Max` and integer types.
    Random,
}

/// A NaN with a payload (signalling where the type has one) of `dtype`.
fn odd_nan(dtype: DataType) -> Vec<u8> {
    match dtype {
        DataType::F32 => 0x7fa0_0001u32.to_le_bytes().to_vec(),
        DataType::F64 => 0x7ff0_0000_0000_0001u64.to_le_bytes().to_vec(),
        DataType::F16 => 0x7c01u16.to_le_bytes().to_vec(),
        _ => 0x7f81u16.to_le_bytes().to_vec(),
    }
}

/// The smallest positive subnormal of a float `dtype`.
fn tiny(dtype: DataType) -> Vec<u8> {
    match dtype {
        DataType::F32 => 1u32.to_le_bytes().to_vec(),
        DataType::F64 => 1u64.to_le_bytes().to_vec(),
        _ => 1u16.to_le_bytes().to_vec(),
    }
}

/// `elems` elements of `dtype` of the given kind for an `op` reduction, from `seed`.
///
/// # Panics
///
/// If `kind` is not [`InputKind::Bits`], `op` is bitwise and `dtype` a float type.
pub fn gen_input(
    dtype: DataType,
    op: ReduceOp,
    kind: InputKind,
    elems: usize,
    seed: u64,
) -> Vec<u8> {
    let mut rng = XorShift64::new(seed);
    let size = dtype.size();
    let mut out = Vec::with_capacity(elems * size);
    for _ in 0..elems {
        if kind == InputKind::Bits || !dtype.is_float() {
            for _ in 0..size {
                let byte = match (kind, op) {
                    (InputKind::Bits, _) => rng.next_u64() as u8,
                    (_, ReduceOp::Band) => (0..4).fold(0, |a, _| a | rng.next_u64() as u8),
                    (_, ReduceOp::Bor) => (0..4).fold(0xff, |a, _| a & rng.next_u64() as u8),
                    _ => rng.next_u64() as u8,
                };
                out.push(byte);
            }
            continue;
        }
        let sign = if rng.one_in(2) { -1.0 } else { 1.0 };
        let v: f64 = match (op, kind) {
            (ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor, _) => {
                panic!("{}", TypeError::OpNotForType { op, dtype })
            }
            (ReduceOp::Min | ReduceOp::Max, _) => match rng.below(16) {
                0 => {
                    out.extend_from_slice(&odd_nan(dtype));
                    continue;
                }
                1 => 0.0 * sign,
                2 => f64::INFINITY * sign,
                3 => {
                    let mut t = tiny(dtype);
                    if sign < 0.0 {
                        *t.last_mut().expect("non-empty") |= 0x80;
                    }
                    out.extend_from_slice(&t);
                    continue;
                }
                _ => (rng.next_f64() * 8.0 - 4.0) * 1.5f64.powi(rng.below(9) as i32),
            },
            (ReduceOp::Prod, InputKind::Exact) => sign * [0.5, 1.0, 1.0, 2.0][rng.below(4)],
            (ReduceOp::Prod, _) => sign * (0.75 + 0.5 * rng.next_f64()),
            (_, InputKind::Exact) => rng.below(17) as f64 - 8.0,
            _ => rng.next_f64() * 2.0 - 1.0,
        };
        push_f64(dtype, v, &mut out);
    }
    out
}

// ---- checking ----------------------------------------------------------------------------------

/// How results are compared with the reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tolerance {
    /// Bit for bit.
    Exact,
    /// `|got - want| <= rel * scale + world * min_normal`, where `scale` is the sum of the
    /// inputs' magnitudes (divided by the world size for `Avg`) for sums and `|want|` for
    /// products. NaN must meet NaN.
    Relative(f64),
}

/// Unit roundoff of a float type (half the distance from 1 to the next value); 0 for integers.
pub fn unit_roundoff(dtype: DataType) -> f64 {
    match dtype {
        DataType::F32 => f64::from(f32::EPSILON) / 2.0,
        DataType::F64 => f64::EPSILON / 2.0,
        DataType::F16 => 2f64.powi(-11),
        DataType::Bf16 => 2f64.powi(-8),
        _ => 0.0,
    }
}

fn min_normal(dtype: DataType) -> f64 {
    match dtype {
        DataType::F64 => f64::MIN_POSITIVE,
        DataType::F16 => 2f64.powi(-14),
        _ => f64::from(f32::MIN_POSITIVE),
    }
}

/// Whether an `op` reduction over `dtype` gives the same bits in any order, for any inputs.
pub fn order_independent(dtype: DataType, op: ReduceOp) -> bool {
    !dtype.is_float() || matches!(op, ReduceOp::Min | ReduceOp::Max)
}

/// The comparison that fits inputs of `kind`: exact unless the reduction is a float sum or
/// product of random values, then a relative error of `2 (world + 1)` unit roundoffs, the
/// worst case of `world - 1` roundings in any order plus the final division of an average.
pub fn default_tolerance(
    dtype: DataType,
    op: ReduceOp,
    world: usize,
    kind: InputKind,
) -> Tolerance {
    if kind != InputKind::Random || order_independent(dtype, op) {
        Tolerance::Exact
    } else {
        Tolerance::Relative(2.0 * (world as f64 + 1.0) * unit_roundoff(dtype))
    }
}

/// A result that does not match the reference.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Mismatch {
    /// The number of results is not the world size.
    #[error("{got} results for a world of {want}")]
    Ranks {
        /// Results given.
        got: usize,
        /// World size.
        want: usize,
    },
    /// Wrong number of ranks or of bytes.
    #[error("rank {rank} has {got} result bytes, expected {want}")]
    Length {
        /// The rank.
        rank: usize,
        /// Bytes found.
        got: usize,
        /// Bytes expected.
        want: usize,
    },
    /// Two ranks that must hold the same bits differ.
    #[error("rank {rank} differs from rank 0 at element {index}: {got} vs {want}")]
    Divergent {
        /// The rank that differs from rank 0.
        rank: usize,
        /// Element index.
        index: usize,
        /// Its value.
        got: String,
        /// Rank 0's value.
        want: String,
    },
    /// A value is wrong.
    #[error("rank {rank} element {index}: got {got}, expected {want} ({tolerance})")]
    Value {
        /// The rank.
        rank: usize,
        /// Element index.
        index: usize,
        /// Value found.
        got: String,
        /// Value expected.
        want: String,
        /// The comparison that failed.
        tolerance: String,
    },
}

/// One element for messages: its value and its bits.
pub fn describe(dtype: DataType, elem: &[u8]) -> String {
    let bits: String = elem.iter().rev().map(|b| format!("{b:02x}")).collect();
    format!("{} (0x{bits})", to_f64(dtype, elem))
}

impl fmt::Display for Tolerance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tolerance::Exact => f.write_str("exact"),
            Tolerance::Relative(r) => write!(f, "relative tolerance {r:e}"),
        }
    }
}

/// Per element of the reduced buffer, the scale of the admissible error (see [`Tolerance`]).
fn error_scale(dtype: DataType, op: ReduceOp, inputs: &[Vec<u8>], want: &[u8]) -> Vec<f64> {
    let n = dtype.size();
    match op {
        ReduceOp::Prod => want
            .chunks_exact(n)
            .map(|e| to_f64(dtype, e).abs())
            .collect(),
        _ => {
            let mut s = vec![0.0; want.len() / n];
            for x in inputs {
                for (acc, e) in s.iter_mut().zip(x.chunks_exact(n)) {
                    *acc += to_f64(dtype, e).abs();
                }
            }
            if op == ReduceOp::Avg {
                s.iter_mut().for_each(|v| *v /= inputs.len() as f64);
            }
            s
        }
    }
}

/// Checks per-rank results of one collective call against the reference; see the
/// [module docs](self). `inputs` are the logical inputs as for [`expected`], `outputs` each
/// rank's result as [`Params::result_range`](crate::schedule::Params::result_range) selects.
#[allow(clippy::too_many_arguments)]
pub fn check(
    coll: Collective,
    dtype: DataType,
    op: ReduceOp,
    world: usize,
    root: usize,
    inputs: &[Vec<u8>],
    outputs: &[Vec<u8>],
    tolerance: Tolerance,
) -> Result<(), Mismatch> {
    let n = dtype.size();
    if outputs.len() != world {
        return Err(Mismatch::Ranks {
            got: outputs.len(),
            want: world,
        });
    }
    if matches!(
        coll,
        Collective::AllReduce | Collective::AllGather | Collective::Broadcast
    ) {
        for (rank, out) in outputs.iter().enumerate().skip(1) {
            if out.len() != outputs[0].len() {
                return Err(Mismatch::Length {
                    rank,
                    got: out.len(),
                    want: outputs[0].len(),
                });
            }
            if let Some(i) =
                (0..out.len() / n).find(|&i| out[i * n..][..n] != outputs[0][i * n..][..n])
            {
                return Err(Mismatch::Divergent {
                    rank,
                    index: i,
                    got: describe(dtype, &out[i * n..][..n]),
                    want: describe(dtype, &outputs[0][i * n..][..n]),
                });
            }
        }
    }
    let want = expected(coll, dtype, op, world, root, inputs);
    let reduces = matches!(
        coll,
        Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
    );
    let tolerance = if reduces { tolerance } else { Tolerance::Exact };
    let scale = match tolerance {
        Tolerance::Relative(_) => {
            let full = reduce_all(dtype, op, inputs);
            error_scale(dtype, op, inputs, &full)
        }
        Tolerance::Exact => Vec::new(),
    };
    for (rank, (got, want)) in outputs.iter().zip(&want).enumerate() {
        if got.len() != want.len() {
            return Err(Mismatch::Length {
                rank,
                got: got.len(),
                want: want.len(),
            });
        }
        // Index of this rank's first element in the full reduced buffer.
        let base = if coll == Collective::ReduceScatter {
            rank * want.len() / n
        } else {
            0
        };
        for (i, (g, w)) in got.chunks_exact(n).zip(want.chunks_exact(n)).enumerate() {
            let ok = match tolerance {
                Tolerance::Exact => g == w,
                Tolerance::Relative(rel) => {
                    let (gv, wv) = (to_f64(dtype, g), to_f64(dtype, w));
                    if wv.is_nan() || gv.is_nan() {
                        wv.is_nan() && gv.is_nan()
                    } else if wv.is_infinite() || gv.is_infinite() {
                        gv == wv
                    } else {
                        let bound = rel * scale[base + i] + world as f64 * min_normal(dtype);
                        (gv - wv).abs() <= bound
                    }
                }
            };
            if !ok {
                return Err(Mismatch::Value {
                    rank,
                    index: i,
                    got: describe(dtype, g),
                    want: describe(dtype, w),
                    tolerance: tolerance.to_string(),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
