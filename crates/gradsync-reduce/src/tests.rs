//! Every dtype and operator against a naive per-element reference, on aligned and unaligned
//! buffers and on every instruction set the CPU has, plus commutativity, `finalize_avg` and the
//! panics.

use gradsync_core::{DataType, ReduceOp, reference};
use half::{bf16, f16};

use crate::dispatch::{self, Isa};
use crate::ops::{bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits};
use crate::{finalize_avg, reduce_in_place, reduce_into};

/// Element counts: empty, single, below one vector step, one step plus a tail, and counts that
/// cross staging blocks with a ragged end.
const LENS: [usize; 6] = [0, 1, 3, 17, 1000, 10007];

/// Byte offsets from an 8-aligned base: aligned for everything, aligned for nothing wider than a
/// byte, aligned for 4-byte but not 8-byte elements.
const OFFSETS: [usize; 3] = [0, 1, 4];

/// xorshift64*, enough randomness for test data and reproducible from its seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn sign(&mut self) -> f64 {
        if self.next() & 1 == 0 { 1.0 } else { -1.0 }
    }

    /// A finite "ordinary" value: a small multiple of 1/8, or a random mantissa at a random
    /// moderate exponent.
    fn ordinary(&mut self) -> f64 {
        if self.next() & 1 == 0 {
            (self.below(2001) as f64 - 1000.0) / 8.0
        } else {
            let m = 1.0 + (self.next() >> 11) as f64 / (1u64 << 53) as f64;
            self.sign() * m * 2f64.powi(self.below(41) as i32 - 20)
        }
    }
}

/// One random element of `dtype`, little-endian; floats include NaN, infinities, signed zeros,
/// extremes and subnormals, integers include their extremes.
fn element(rng: &mut Rng, dtype: DataType, allow_nan: bool) -> Vec<u8> {
    loop {
        let e = raw_element(rng, dtype);
        if allow_nan || !is_nan(dtype, &e) {
            return e;
        }
    }
}

fn raw_element(rng: &mut Rng, dtype: DataType) -> Vec<u8> {
    let kind = rng.below(16);
    let special = |rng: &mut Rng| -> f64 {
        match kind {
            0 => f64::NAN,
            1 => rng.sign() * f64::INFINITY,
            2 => rng.sign() * 0.0,
            _ => rng.ordinary(),
        }
    };
    match dtype {
        DataType::F32 => match kind {
            3 => (rng.next() as u32).to_le_bytes().to_vec(),
            4 => (rng.sign() as f32 * f32::MAX).to_le_bytes().to_vec(),
            5 => f32::from_bits(rng.below(0x80_0000) as u32)
                .to_le_bytes()
                .to_vec(),
            _ => (special(rng) as f32).to_le_bytes().to_vec(),
        },
        DataType::F64 => match kind {
            3 => rng.next().to_le_bytes().to_vec(),
            4 => (rng.sign() * f64::MAX).to_le_bytes().to_vec(),
            5 => f64::from_bits(rng.below(1 << 52)).to_le_bytes().to_vec(),
            _ => special(rng).to_le_bytes().to_vec(),
        },
        DataType::F16 => match kind {
            3..=6 => (rng.next() as u16).to_le_bytes().to_vec(),
            _ => f16::from_f64(special(rng)).to_le_bytes().to_vec(),
        },
        DataType::Bf16 => match kind {
            3..=6 => (rng.next() as u16).to_le_bytes().to_vec(),
            _ => bf16::from_f64(special(rng)).to_le_bytes().to_vec(),
        },
        DataType::I32 => {
            let v = match kind {
                0 => i32::MIN,
                1 => i32::MAX,
                2 => 0,
                3 => -1,
                4..=7 => rng.below(200) as i32 - 100,
                _ => rng.next() as i32,
            };
            v.to_le_bytes().to_vec()
        }
        DataType::I64 => {
            let v = match kind {
                0 => i64::MIN,
                1 => i64::MAX,
                2 => 0,
                3 => -1,
                4..=7 => rng.below(200) as i64 - 100,
                _ => rng.next() as i64,
            };
            v.to_le_bytes().to_vec()
        }
        DataType::U8 => vec![rng.next() as u8],
    }
}

/// `n` random elements.
fn values(rng: &mut Rng, dtype: DataType, n: usize, allow_nan: bool) -> Vec<u8> {
    (0..n)
        .flat_map(|_| element(rng, dtype, allow_nan))
        .collect()
}

/// Two arrays of `n` elements where some positions tie (equal values, or `+0.0` against
/// `-0.0` for floats) so that the tie rules are exercised.
fn pair(rng: &mut Rng, dtype: DataType, n: usize, allow_nan: bool) -> (Vec<u8>, Vec<u8>) {
    let s = dtype.size();
    let mut a = values(rng, dtype, n, allow_nan);
    let mut b = values(rng, dtype, n, allow_nan);
    for i in 0..n {
        let (ea, eb) = (&mut a[i * s..(i + 1) * s], &mut b[i * s..(i + 1) * s]);
        match rng.below(16) {
            0 | 1 => eb.copy_from_slice(ea),
            2 if dtype.is_float() => {
                ea.fill(0);
                eb.fill(0);
                let neg = if rng.next() & 1 == 0 { ea } else { eb };
                neg[s - 1] = 0x80;
            }
            _ => {}
        }
    }
    (a, b)
}

fn is_nan(dtype: DataType, e: &[u8]) -> bool {
    match dtype {
        DataType::F32 => f32::from_le_bytes(e.try_into().unwrap()).is_nan(),
        DataType::F64 => f64::from_le_bytes(e.try_into().unwrap()).is_nan(),
        DataType::F16 => f16::from_le_bytes(e.try_into().unwrap()).is_nan(),
        DataType::Bf16 => bf16::from_le_bytes(e.try_into().unwrap()).is_nan(),
        _ => false,
    }
}

macro_rules! ref_float {
    ($name:ident, $t:ty) => {
        /// The operator on one pair, written independently of the kernels.
        fn $name(op: ReduceOp, a: $t, b: $t) -> $t {
            let is_min = op == ReduceOp::Min;
            let r = match op {
                ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => {
                    unreachable!("no bitwise {op} for floats")
                }
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Min | ReduceOp::Max => {
                    if a.is_nan() || b.is_nan() {
                        <$t>::NAN
                    } else if a == 0.0 && b == 0.0 {
                        let negative = if is_min {
                            a.is_sign_negative() || b.is_sign_negative()
                        } else {
                            a.is_sign_negative() && b.is_sign_negative()
                        };
                        if negative { -0.0 } else { 0.0 }
                    } else if (a < b) == is_min {
                        a
                    } else {
                        b
                    }
                }
            };
            // One NaN for every NaN result.
            if r.is_nan() { <$t>::NAN } else { r }
        }
    };
}

ref_float!(ref_f32, f32);
ref_float!(ref_f64, f64);

/// The integer operators through `i128`, truncated back: wrapping by construction. The bitwise
/// operators commute with the sign (or zero) extension to `i128` and the truncation back.
fn ref_int(op: ReduceOp, a: i128, b: i128) -> i128 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
        ReduceOp::Band => a & b,
        ReduceOp::Bor => a | b,
        ReduceOp::Bxor => a ^ b,
    }
}

/// `a op b` element by element: decode, compute, encode.
fn reference(dtype: DataType, op: ReduceOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    let s = dtype.size();
    let mut out = Vec::with_capacity(a.len());
    for (x, y) in a.chunks_exact(s).zip(b.chunks_exact(s)) {
        let e: Vec<u8> = match dtype {
            DataType::F32 => {
                let (x, y) = (
                    f32::from_le_bytes(x.try_into().unwrap()),
                    f32::from_le_bytes(y.try_into().unwrap()),
                );
                ref_f32(op, x, y).to_le_bytes().to_vec()
            }
            DataType::F64 => {
                let (x, y) = (
                    f64::from_le_bytes(x.try_into().unwrap()),
                    f64::from_le_bytes(y.try_into().unwrap()),
                );
                ref_f64(op, x, y).to_le_bytes().to_vec()
            }
            DataType::F16 => {
                let x = f16::from_le_bytes(x.try_into().unwrap()).to_f32();
                let y = f16::from_le_bytes(y.try_into().unwrap()).to_f32();
                f16::from_f32(ref_f32(op, x, y)).to_le_bytes().to_vec()
            }
            DataType::Bf16 => {
                let x = bf16::from_le_bytes(x.try_into().unwrap()).to_f32();
                let y = bf16::from_le_bytes(y.try_into().unwrap()).to_f32();
                bf16::from_f32(ref_f32(op, x, y)).to_le_bytes().to_vec()
            }
            DataType::I32 => {
                let (x, y) = (
                    i32::from_le_bytes(x.try_into().unwrap()),
                    i32::from_le_bytes(y.try_into().unwrap()),
                );
                (ref_int(op, x.into(), y.into()) as i32)
                    .to_le_bytes()
                    .to_vec()
            }
            DataType::I64 => {
                let (x, y) = (
                    i64::from_le_bytes(x.try_into().unwrap()),
                    i64::from_le_bytes(y.try_into().unwrap()),
                );
                (ref_int(op, x.into(), y.into()) as i64)
                    .to_le_bytes()
                    .to_vec()
            }
            DataType::U8 => vec![ref_int(op, x[0].into(), y[0].into()) as u8],
        };
        out.extend_from_slice(&e);
    }
    out
}

/// Asserts equal bits element by element (NaNs included: results are canonical).
fn assert_same(dtype: DataType, got: &[u8], want: &[u8], ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: length");
    let s = dtype.size();
    for (i, (g, w)) in got.chunks_exact(s).zip(want.chunks_exact(s)).enumerate() {
        assert_eq!(
            g, w,
            "{ctx}: element {i} differs (got {g:02x?}, want {w:02x?})"
        );
    }
}

/// A copy of `bytes` at `off` bytes past an 8-aligned address.
struct Placed {
    store: Vec<u64>,
    off: usize,
    len: usize,
}

impl Placed {
    fn new(bytes: &[u8], off: usize) -> Self {
        let mut p = Placed {
            store: vec![0; (bytes.len() + off).div_ceil(8) + 1],
            off,
            len: bytes.len(),
        };
        p.bytes_mut().copy_from_slice(bytes);
        p
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.store)[self.off..self.off + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.store)[self.off..self.off + self.len]
    }
}

#[test]
fn reduce_in_place_matches_reference() {
    let mut rng = Rng::new(1);
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
            for n in LENS {
                let (a, b) = pair(&mut rng, dtype, n, true);
                let want = reference(dtype, op, &a, &b);
                let offsets = OFFSETS.into_iter().flat_map(|x| OFFSETS.map(|y| (x, y)));
                for ((oa, ob), isa) in
                    offsets.flat_map(|o| Isa::all().into_iter().map(move |i| (o, i)))
                {
                    let mut acc = Placed::new(&a, oa);
                    let inc = Placed::new(&b, ob);
                    dispatch::in_place(isa, dtype, op, acc.bytes_mut(), inc.bytes());
                    let ctx = format!("in place {isa:?} {dtype} {op:?} n={n} offsets=({oa},{ob})");
                    assert_same(dtype, acc.bytes(), &want, &ctx);
                    assert_eq!(inc.bytes(), &b[..], "{ctx}: incoming modified");
                }
            }
        }
    }
}

#[test]
fn reduce_into_matches_reference() {
    let mut rng = Rng::new(2);
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
            for n in LENS {
                let (a, b) = pair(&mut rng, dtype, n, true);
                let want = reference(dtype, op, &a, &b);
                for (od, isa) in OFFSETS
                    .into_iter()
                    .flat_map(|o| Isa::all().into_iter().map(move |i| (o, i)))
                {
                    for (oa, ob) in OFFSETS.into_iter().flat_map(|x| OFFSETS.map(|y| (x, y))) {
                        let mut dst = Placed::new(&vec![0xA5; a.len()], od);
                        let (pa, pb) = (Placed::new(&a, oa), Placed::new(&b, ob));
                        dispatch::into(isa, dtype, op, dst.bytes_mut(), pa.bytes(), pb.bytes());
                        let ctx =
                            format!("into {isa:?} {dtype} {op:?} n={n} offsets=({od},{oa},{ob})");
                        assert_same(dtype, dst.bytes(), &want, &ctx);
                        assert_eq!(
                            (pa.bytes(), pb.bytes()),
                            (&a[..], &b[..]),
                            "{ctx}: input modified"
                        );
                    }
                }
            }
        }
    }
}

/// The kernels agree bit for bit with `gradsync_core::reference`, the definition the simulator
/// and the conformance suites use, on every instruction set.
#[test]
fn agrees_with_core_reference() {
    let mut rng = Rng::new(9);
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
            let (a, b) = pair(&mut rng, dtype, 10007, true);
            let mut want = vec![0; a.len()];
            reference::reduce_slices(dtype, op, &mut want, &a, &b);
            for isa in Isa::all() {
                let mut got = vec![0; a.len()];
                dispatch::into(isa, dtype, op, &mut got, &a, &b);
                assert_same(dtype, &got, &want, &format!("into {isa:?} {dtype} {op:?}"));
                let mut acc = a.clone();
                dispatch::in_place(isa, dtype, op, &mut acc, &b);
                assert_same(
                    dtype,
                    &acc,
                    &want,
                    &format!("in place {isa:?} {dtype} {op:?}"),
                );
            }
        }
        let v = values(&mut rng, dtype, 10007, true);
        for world in [1, 3, 8, 1000, 1 << 40] {
            let mut want = v.clone();
            reference::finalize_avg(dtype, &mut want, world);
            let mut got = v.clone();
            finalize_avg(dtype, &mut got, world);
            assert_same(dtype, &got, &want, &format!("avg {dtype} world={world}"));
        }
    }
}

#[test]
fn avg_reduces_as_sum() {
    let mut rng = Rng::new(3);
    for dtype in DataType::ALL {
        let (a, b) = pair(&mut rng, dtype, 1000, false);
        let mut sum = a.clone();
        let mut avg = a.clone();
        reduce_in_place(dtype, ReduceOp::Sum, &mut sum, &b);
        reduce_in_place(dtype, ReduceOp::Avg, &mut avg, &b);
        assert_eq!(sum, avg, "{dtype}");
    }
}

/// `a op b` and `b op a` give the same bits for every operator and input, NaNs included, and
/// so do in-place and three-buffer forms and every instruction set.
#[test]
fn operators_are_commutative_to_the_bit() {
    let mut rng = Rng::new(4);
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
            for n in [17, 10007] {
                let (a, b) = pair(&mut rng, dtype, n, true);
                let mut results = Vec::new();
                for isa in Isa::all() {
                    let (mut ab, mut ba) = (vec![0; a.len()], vec![0; a.len()]);
                    dispatch::into(isa, dtype, op, &mut ab, &a, &b);
                    dispatch::into(isa, dtype, op, &mut ba, &b, &a);
                    assert_eq!(ab, ba, "into {isa:?} {dtype} {op:?} n={n}");
                    let (mut acc_a, mut acc_b) = (a.clone(), b.clone());
                    dispatch::in_place(isa, dtype, op, &mut acc_a, &b);
                    dispatch::in_place(isa, dtype, op, &mut acc_b, &a);
                    assert_eq!(acc_a, acc_b, "in place {isa:?} {dtype} {op:?} n={n}");
                    assert_eq!(acc_a, ab, "in place vs into {isa:?} {dtype} {op:?} n={n}");
                    results.push(ab);
                }
                let mut public = vec![0; a.len()];
                reduce_into(dtype, op, &mut public, &a, &b);
                results.push(public);
                // Every instruction set gives the same bits.
                assert!(
                    results.windows(2).all(|w| w[0] == w[1]),
                    "{dtype} {op:?} n={n}"
                );
            }
        }
    }
}

/// `-0.0` and `+0.0` in both orders, for every float type: the sign-bit rule, not the order.
#[test]
fn signed_zero_ties() {
    for dtype in [DataType::F32, DataType::F64, DataType::F16, DataType::Bf16] {
        let s = dtype.size();
        let pos = vec![0u8; s];
        let mut neg = vec![0u8; s];
        neg[s - 1] = 0x80;
        let a = [pos.clone(), neg.clone()].concat();
        let b = [neg.clone(), pos.clone()].concat();
        let mut out = vec![0; 2 * s];
        reduce_into(dtype, ReduceOp::Min, &mut out, &a, &b);
        assert_eq!(out, [neg.clone(), neg.clone()].concat(), "{dtype} min");
        reduce_into(dtype, ReduceOp::Max, &mut out, &a, &b);
        assert_eq!(out, [pos.clone(), pos.clone()].concat(), "{dtype} max");
        reduce_into(dtype, ReduceOp::Sum, &mut out, &a, &b);
        assert_eq!(out, [pos.clone(), pos.clone()].concat(), "{dtype} sum");
    }
}

/// A NaN on either side of min/max gives the canonical quiet NaN, whatever its payload.
#[test]
fn nan_wins_min_and_max() {
    let odd_nan = f32::from_bits(0xFF80_0001); // negative, signalling, payload 1
    let a = [odd_nan, 1.0, f32::NAN, f32::NEG_INFINITY];
    let b = [2.0, odd_nan, f32::INFINITY, f32::NAN];
    for op in [ReduceOp::Min, ReduceOp::Max] {
        let mut out = [0f32; 4];
        reduce_into(
            DataType::F32,
            op,
            bytemuck::cast_slice_mut(&mut out),
            bytemuck::cast_slice(&a),
            bytemuck::cast_slice(&b),
        );
        for x in out {
            assert_eq!(x.to_bits(), f32::NAN.to_bits(), "{op:?}");
        }
    }
    let mut acc = [f16::from_f32(1.0), f16::NAN]
        .map(f16::to_le_bytes)
        .concat();
    let inc = [f16::from_bits(0x7D01), f16::from_f32(-3.0)]
        .map(f16::to_le_bytes)
        .concat();
    reduce_in_place(DataType::F16, ReduceOp::Max, &mut acc, &inc);
    assert_eq!(acc, [f16::NAN, f16::NAN].map(f16::to_le_bytes).concat());
}

/// The bitwise operators against the integers' own `&`, `|` and `^`, bit for bit, over every
/// bit position: `a` and `b` cover the four combinations of two bits at every position.
#[test]
fn bitwise_operators_on_every_bit() {
    let a32 = [
        0x0000_0000_i32,
        -1,
        0x5555_5555,
        0x3333_3333,
        i32::MIN,
        0x0f0f_0f0f,
    ];
    let b32 = [-1, 0x1234_5678, 0x3333_3333, 0x5555_5555, 1, -0x0f0f_0f10];
    for (op, f) in [
        (ReduceOp::Band, (|x, y| x & y) as fn(i32, i32) -> i32),
        (ReduceOp::Bor, |x, y| x | y),
        (ReduceOp::Bxor, |x, y| x ^ y),
    ] {
        let want: Vec<i32> = a32.iter().zip(&b32).map(|(&x, &y)| f(x, y)).collect();
        let mut got = [0i32; 6];
        reduce_into(
            DataType::I32,
            op,
            bytemuck::cast_slice_mut(&mut got),
            bytemuck::cast_slice(&a32),
            bytemuck::cast_slice(&b32),
        );
        assert_eq!(got[..], want[..], "i32 {op}");
    }
    let a64 = [
        0x5555_5555_5555_5555_i64,
        i64::MIN,
        -1,
        0x00ff_00ff_00ff_00ff,
    ];
    let b64 = [
        0x3333_3333_3333_3333_i64,
        -1,
        i64::MAX,
        -0x0100_0000_0000_0001,
    ];
    for (op, f) in [
        (ReduceOp::Band, (|x, y| x & y) as fn(i64, i64) -> i64),
        (ReduceOp::Bor, |x, y| x | y),
        (ReduceOp::Bxor, |x, y| x ^ y),
    ] {
        let want: Vec<i64> = a64.iter().zip(&b64).map(|(&x, &y)| f(x, y)).collect();
        let mut acc = a64;
        reduce_in_place(
            DataType::I64,
            op,
            bytemuck::cast_slice_mut(&mut acc),
            bytemuck::cast_slice(&b64),
        );
        assert_eq!(acc[..], want[..], "i64 {op}");
    }
    // u8: every pair of bytes.
    let a: Vec<u8> = (0..=255u8).flat_map(|x| [x; 256]).collect();
    let b: Vec<u8> = (0..256).flat_map(|_| 0..=255u8).collect();
    for (op, f) in [
        (ReduceOp::Band, (|x, y| x & y) as fn(u8, u8) -> u8),
        (ReduceOp::Bor, |x, y| x | y),
        (ReduceOp::Bxor, |x, y| x ^ y),
    ] {
        let want: Vec<u8> = a.iter().zip(&b).map(|(&x, &y)| f(x, y)).collect();
        for isa in Isa::all() {
            let mut acc = a.clone();
            dispatch::in_place(isa, DataType::U8, op, &mut acc, &b);
            assert_eq!(acc, want, "u8 {op} {isa:?}");
        }
    }
}

#[test]
#[should_panic(
    expected = "gradsync-reduce: reduction op bxor is bitwise and is not defined for the \
                floating-point type float"
)]
fn bitwise_in_place_over_float_panics() {
    reduce_in_place(DataType::F32, ReduceOp::Bxor, &mut [0; 8], &[0; 8]);
}

#[test]
#[should_panic(expected = "gradsync-reduce: reduction op band is bitwise")]
fn bitwise_into_over_half_panics() {
    reduce_into(
        DataType::Bf16,
        ReduceOp::Band,
        &mut [0; 4],
        &[0; 4],
        &[0; 4],
    );
}

#[test]
fn integer_sum_and_prod_wrap() {
    let a = [i32::MAX, i32::MIN, 1 << 20, -7];
    let b = [1, -1, 1 << 12, 3];
    let mut sum = [0i32; 4];
    let mut prod = [0i32; 4];
    let (a8, b8): (&[u8], &[u8]) = (bytemuck::cast_slice(&a), bytemuck::cast_slice(&b));
    reduce_into(
        DataType::I32,
        ReduceOp::Sum,
        bytemuck::cast_slice_mut(&mut sum),
        a8,
        b8,
    );
    reduce_into(
        DataType::I32,
        ReduceOp::Prod,
        bytemuck::cast_slice_mut(&mut prod),
        a8,
        b8,
    );
    assert_eq!(sum, [i32::MIN, i32::MAX, (1 << 20) + (1 << 12), -4]);
    assert_eq!(prod, [i32::MAX, i32::MIN, 0, -21]);
    let mut acc = vec![250u8, 16, 0, 255];
    reduce_in_place(DataType::U8, ReduceOp::Sum, &mut acc, &[10, 16, 0, 255]);
    assert_eq!(acc, [4, 32, 0, 254]);
    reduce_in_place(DataType::U8, ReduceOp::Prod, &mut acc, &[64, 8, 9, 255]);
    assert_eq!(acc, [0, 0, 0, 2]);
}

/// Half sums round once, to nearest-even, exactly like native half arithmetic would.
#[test]
fn half_rounding() {
    // 2048 + 1 is a tie in f16 (spacing 2 above 2048): stays 2048; 2050 + 1 rounds to 2052.
    let a = [2048.0f32, 2050.0, 65504.0]
        .map(|x| f16::from_f32(x).to_le_bytes())
        .concat();
    let b = [1.0f32, 1.0, 8.0]
        .map(|x| f16::from_f32(x).to_le_bytes())
        .concat();
    let mut out = vec![0; a.len()];
    reduce_into(DataType::F16, ReduceOp::Sum, &mut out, &a, &b);
    let got: Vec<f32> = out
        .chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(got, [2048.0, 2052.0, 65504.0]);
    // bf16: 256 + 1 is a tie (spacing 2): stays 256; 258 + 1 rounds to 260.
    let a = [256.0f32, 258.0]
        .map(|x| bf16::from_f32(x).to_le_bytes())
        .concat();
    let b = [1.0f32, 1.0]
        .map(|x| bf16::from_f32(x).to_le_bytes())
        .concat();
    let mut out = vec![0; a.len()];
    reduce_into(DataType::Bf16, ReduceOp::Sum, &mut out, &a, &b);
    let got: Vec<f32> = out
        .chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(got, [256.0, 260.0]);
}

/// The branch-free bfloat16 conversions agree with the core reference and with `half`: every
/// bf16 widened (bit for bit; `half` quiets NaNs, which the kernels never need), and rounding of
/// edge cases and of random f32 bit patterns.
#[test]
fn bf16_conversions_match_half() {
    for h in 0..=u16::MAX {
        let got = bf16_bits_to_f32(h);
        assert_eq!(
            got.to_bits(),
            reference::bf16_to_f32(h).to_bits(),
            "widen {h:#06x}"
        );
        let want = bf16::from_bits(h).to_f32();
        assert!(
            got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan(),
            "widen {h:#06x}"
        );
    }
    let mut rng = Rng::new(5);
    let edges = [
        0x0000_0000u32,
        0x8000_0000,
        0x3F80_8000, // tie, even: down
        0x3F81_8000, // tie, odd: up
        0x3F80_8001,
        0x3F80_7FFF,
        0x7F7F_FFFF, // rounds to infinity
        0xFF7F_FFFF,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001, // signalling NaN with a payload only in the low half
        0x7FC0_0000,
        0xFFFF_FFFF,
        0x0000_8000,
        0x0001_8000,
    ];
    let randoms = (0..1 << 20).map(|_| rng.next() as u32);
    for bits in edges.into_iter().chain(randoms) {
        let x = f32::from_bits(bits);
        assert_eq!(
            f32_to_bf16_bits(x),
            bf16::from_f32(x).to_bits(),
            "narrow {bits:#010x}"
        );
    }
}

/// The branch-free binary16 conversions agree with the core reference and with `half`: every
/// f16 widened (bit for bit; `half` quiets NaNs, which the kernels never need); every f16 value,
/// the midpoints between neighbours and one f32 ulp either side of them rounded; edge cases and
/// random f32 bit patterns rounded.
#[test]
fn f16_conversions_match_half() {
    for h in 0..=u16::MAX {
        let got = f16_bits_to_f32(h);
        assert_eq!(
            got.to_bits(),
            reference::f16_to_f32(h).to_bits(),
            "widen {h:#06x}"
        );
        let want = f16::from_bits(h).to_f32();
        assert!(
            got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan(),
            "widen {h:#06x}"
        );
    }
    let check = |x: f32| {
        let want = f16::from_f32(x).to_bits();
        assert_eq!(
            f32_to_f16_bits(x),
            want,
            "narrow {:#010x} ({x:e})",
            x.to_bits()
        );
    };
    for h in 0..0x7C00u16 {
        for sign in [0, 0x8000] {
            let lo = f16::from_bits(h | sign).to_f32();
            let hi = if h == 0x7BFF {
                65536.0
            } else {
                f16::from_bits((h + 1) | sign).to_f32()
            };
            let hi = if sign == 0 { hi } else { -hi.abs() };
            let mid = (lo + hi) / 2.0;
            for x in [
                lo,
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                check(x);
            }
        }
    }
    let edges = [
        0x0000_0000u32,
        0x8000_0000,
        0x0000_0001, // smallest f32 subnormal
        0x3300_0000, // 2^-25: half the smallest f16 subnormal, tie to zero
        0x3300_0001,
        0x3380_0000,
        0x387F_FFFF, // just below 2^-14
        0x4780_0000, // 2^16
        0x477F_F000, // 65520: rounds to infinity
        0x477F_EFFF,
        0x7F7F_FFFF,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001,
        0x7FC0_0000,
        0xFFFF_FFFF,
    ];
    let mut rng = Rng::new(8);
    let randoms = (0..1 << 20).map(|_| rng.next() as u32);
    for bits in edges.into_iter().chain(randoms) {
        check(f32::from_bits(bits));
    }
}

/// The reference for `finalize_avg`: one true division per element.
fn reference_avg(dtype: DataType, buf: &[u8], world: usize) -> Vec<u8> {
    let s = dtype.size();
    let w = world as i128;
    buf.chunks_exact(s)
        .flat_map(|e| -> Vec<u8> {
            match dtype {
                DataType::F32 => {
                    let q = f32::from_le_bytes(e.try_into().unwrap()) / world as f32;
                    (if q.is_nan() { f32::NAN } else { q })
                        .to_le_bytes()
                        .to_vec()
                }
                DataType::F64 => {
                    let q = f64::from_le_bytes(e.try_into().unwrap()) / world as f64;
                    (if q.is_nan() { f64::NAN } else { q })
                        .to_le_bytes()
                        .to_vec()
                }
                DataType::F16 => {
                    let q = f16::from_le_bytes(e.try_into().unwrap()).to_f32() / world as f32;
                    f16::from_f32(if q.is_nan() { f32::NAN } else { q })
                        .to_le_bytes()
                        .to_vec()
                }
                DataType::Bf16 => {
                    let q = bf16::from_le_bytes(e.try_into().unwrap()).to_f32() / world as f32;
                    bf16::from_f32(if q.is_nan() { f32::NAN } else { q })
                        .to_le_bytes()
                        .to_vec()
                }
                DataType::I32 => ((i128::from(i32::from_le_bytes(e.try_into().unwrap())) / w)
                    as i32)
                    .to_le_bytes()
                    .to_vec(),
                DataType::I64 => ((i128::from(i64::from_le_bytes(e.try_into().unwrap())) / w)
                    as i64)
                    .to_le_bytes()
                    .to_vec(),
                DataType::U8 => vec![(i128::from(e[0]) / w) as u8],
            }
        })
        .collect()
}

#[test]
fn finalize_avg_matches_reference() {
    let mut rng = Rng::new(6);
    let worlds = [
        1,
        2,
        3,
        7,
        8,
        255,
        256,
        1000,
        1 << 31,
        (1 << 31) + 1,
        1 << 40,
        usize::MAX,
    ];
    for dtype in DataType::ALL {
        for n in LENS {
            let v = values(&mut rng, dtype, n, true);
            for world in worlds {
                let want = reference_avg(dtype, &v, world);
                for (off, isa) in OFFSETS
                    .into_iter()
                    .flat_map(|o| Isa::all().into_iter().map(move |i| (o, i)))
                {
                    let mut buf = Placed::new(&v, off);
                    dispatch::divide(isa, dtype, buf.bytes_mut(), world);
                    let ctx = format!("avg {isa:?} {dtype} n={n} world={world} offset={off}");
                    assert_same(dtype, buf.bytes(), &want, &ctx);
                }
            }
        }
    }
}

#[test]
fn finalize_avg_integers_truncate() {
    let mut v = [-7i32, 7, -1, i32::MIN, i32::MAX];
    finalize_avg(DataType::I32, bytemuck::cast_slice_mut(&mut v), 2);
    assert_eq!(v, [-3, 3, 0, -(1 << 30), (1 << 30) - 1]);
    let mut v = [i32::MIN, i32::MAX, -5];
    finalize_avg(DataType::I32, bytemuck::cast_slice_mut(&mut v), 1 << 31);
    assert_eq!(v, [-1, 0, 0]);
    let mut v = [i64::MIN, -9, 9];
    finalize_avg(DataType::I64, bytemuck::cast_slice_mut(&mut v), 4);
    assert_eq!(v, [i64::MIN / 4, -2, 2]);
    let mut v = [i64::MIN, i64::MAX];
    finalize_avg(DataType::I64, bytemuck::cast_slice_mut(&mut v), 1 << 63);
    assert_eq!(v, [-1, 0]);
    let mut v = [255u8, 254, 3, 0];
    finalize_avg(DataType::U8, &mut v, 2);
    assert_eq!(v, [127, 127, 1, 0]);
    finalize_avg(DataType::U8, &mut v, 300);
    assert_eq!(v, [0, 0, 0, 0]);
}

/// The division is a true division: on inputs where multiplying by the reciprocal rounds
/// differently, the result is still the quotient.
#[test]
fn finalize_avg_divides_rather_than_multiplies() {
    let mut rng = Rng::new(7);
    let xs: Vec<f32> = (0..10_000).map(|_| rng.ordinary() as f32).collect();
    let world = 3usize;
    let differs = xs.iter().filter(|&&x| x / 3.0 != x * (1.0 / 3.0)).count();
    assert!(
        differs > 0,
        "no input tells division from reciprocal multiplication"
    );
    let mut buf = xs.clone();
    finalize_avg(DataType::F32, bytemuck::cast_slice_mut(&mut buf), world);
    for (x, got) in xs.iter().zip(&buf) {
        assert_eq!(got.to_bits(), (x / 3.0).to_bits(), "{x} / 3");
    }
}

#[test]
#[should_panic(expected = "length mismatch")]
fn mismatched_lengths_panic() {
    reduce_in_place(DataType::F32, ReduceOp::Sum, &mut [0; 8], &[0; 4]);
}

#[test]
#[should_panic(expected = "length mismatch")]
fn mismatched_into_lengths_panic() {
    reduce_into(DataType::U8, ReduceOp::Sum, &mut [0; 4], &[0; 4], &[0; 3]);
}

#[test]
#[should_panic(expected = "not a multiple of the float element size 4")]
fn ragged_length_panics() {
    reduce_in_place(DataType::F32, ReduceOp::Sum, &mut [0; 6], &[0; 6]);
}

#[test]
#[should_panic(expected = "world size of zero")]
fn zero_world_panics() {
    finalize_avg(DataType::F32, &mut [0; 4], 0);
}

#[test]
fn streaming_copy_equals_an_ordinary_copy_at_every_alignment_and_length() {
    let mut rng = Rng::new(7);
    let big = crate::STREAMING_MIN + 200;
    let src: Vec<u8> = (0..big + 64).map(|_| rng.next() as u8).collect();
    for len in [
        0,
        1,
        15,
        64,
        1000,
        crate::STREAMING_MIN - 1,
        crate::STREAMING_MIN,
        big,
    ] {
        for d_off in [0, 1, 8, 15] {
            for s_off in [0, 3] {
                let mut dst = vec![0xAAu8; len + 32];
                crate::copy_streaming(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                assert_eq!(
                    &dst[d_off..d_off + len],
                    &src[s_off..s_off + len],
                    "len {len} dst+{d_off} src+{s_off}"
                );
                assert!(
                    dst[..d_off].iter().all(|&b| b == 0xAA),
                    "wrote before the destination"
                );
                assert!(
                    dst[d_off + len..].iter().all(|&b| b == 0xAA),
                    "wrote past the destination"
                );
            }
        }
    }
}

#[test]
#[should_panic(expected = "length mismatch")]
fn streaming_copy_of_unequal_lengths_panics() {
    crate::copy_streaming(&mut [0u8; 4], &[0u8; 5]);
}
