use super::*;

/// Nearest value of a monotone table of non-negative finite values (indexed by bit pattern),
/// ties to the even pattern; `None` past the overflow threshold.
fn nearest(table: &[f64], overflow: f64, x: f64) -> Option<u16> {
    if x >= overflow {
        return None;
    }
    let i = table.partition_point(|&v| v <= x) - 1;
    if i + 1 == table.len() {
        return Some(i as u16);
    }
    let (lo, hi) = (x - table[i], table[i + 1] - x);
    Some(if lo < hi || (lo == hi && i % 2 == 0) {
        i as u16
    } else {
        i as u16 + 1
    })
}

fn check_narrowing(narrow: fn(f32) -> u16, widen: fn(u16) -> f32, max_bits: u16, inf: u16) {
    let table: Vec<f64> = (0..=max_bits).map(|b| f64::from(widen(b))).collect();
    let max = table[max_bits as usize];
    let ulp = max - table[max_bits as usize - 1];
    let overflow = max + ulp / 2.0;
    let mut rng = XorShift64::new(3);
    let mut samples: Vec<f32> = (0..200_000)
        .map(|_| f32::from_bits(rng.next_u64() as u32))
        .collect();
    // Every f32 near the half-type values, including exact ties and subnormal boundaries.
    for b in (0..=max_bits).step_by(7) {
        let v = widen(b);
        for d in [-2i32, -1, 0, 1, 2] {
            samples.push(f32::from_bits((v.to_bits() as i32 + d) as u32));
        }
        if b < max_bits {
            samples.push(((f64::from(v) + f64::from(widen(b + 1))) / 2.0) as f32);
        }
    }
    samples.extend([
        overflow as f32,
        max as f32,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-45,
    ]);
    for x in samples {
        if x.is_nan() {
            assert!(widen(narrow(x)).is_nan());
            continue;
        }
        let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
        let want = nearest(&table, overflow, f64::from(x.abs())).unwrap_or(inf) | sign;
        assert_eq!(narrow(x), want, "{x:e} ({:#010x})", x.to_bits());
    }
}

#[test]
fn f16_round_trip_and_rounding() {
    for h in 0..=u16::MAX {
        let f = f16_to_f32(h);
        if f.is_nan() {
            assert_eq!(h & 0x7c00, 0x7c00);
            assert!(f32_to_f16(f) & 0x3ff != 0);
        } else {
            assert_eq!(f32_to_f16(f), h, "{h:#06x}");
        }
    }
    assert_eq!(f32_to_f16(1.0), 0x3c00);
    assert_eq!(f32_to_f16(65504.0), 0x7bff);
    assert_eq!(f32_to_f16(65520.0), 0x7c00);
    assert_eq!(f32_to_f16(65519.99), 0x7bff);
    assert_eq!(f32_to_f16(2f32.powi(-24)), 0x0001);
    assert_eq!(f32_to_f16(2f32.powi(-25)), 0x0000);
    assert_eq!(f32_to_f16(1.5 * 2f32.powi(-25)), 0x0001);
    assert_eq!(f32_to_f16(-0.0), 0x8000);
    assert_eq!(f32_to_f16(f32::NEG_INFINITY), 0xfc00);
    assert_eq!(f32_to_f16(f32::NAN), 0x7e00);
    assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00, "tie to even");
    assert_eq!(
        f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)),
        0x3c02,
        "tie to even, up"
    );
    check_narrowing(f32_to_f16, f16_to_f32, 0x7bff, 0x7c00);
}

#[test]
fn bf16_round_trip_and_rounding() {
    for h in 0..=u16::MAX {
        let f = bf16_to_f32(h);
        if !f.is_nan() {
            assert_eq!(f32_to_bf16(f), h, "{h:#06x}");
        }
    }
    assert_eq!(f32_to_bf16(1.0), 0x3f80);
    assert_eq!(f32_to_bf16(f32::NAN), 0x7fc0);
    assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
    check_narrowing(f32_to_bf16, bf16_to_f32, 0x7f7f, 0x7f80);
}

fn elem(dtype: DataType, op: ReduceOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    let mut out = vec![0; dtype.size()];
    reduce_elem(dtype, op, a, b, &mut out);
    out
}

#[test]
fn element_semantics() {
    use DataType::*;
    use ReduceOp::*;
    let f = |v: f32| v.to_le_bytes().to_vec();
    let nan_payload = f32::from_bits(0x7fa0_0001);
    for (a, b) in [
        (nan_payload, 1.0),
        (1.0, nan_payload),
        (f32::NAN, -f32::NAN),
    ] {
        for op in [Min, Max, Sum, Prod] {
            assert_eq!(
                elem(F32, op, &f(a), &f(b)),
                f(f32::NAN),
                "{op} canonical NaN"
            );
        }
    }
    assert_eq!(elem(F32, Min, &f(0.0), &f(-0.0)), f(-0.0));
    assert_eq!(elem(F32, Min, &f(-0.0), &f(0.0)), f(-0.0));
    assert_eq!(elem(F32, Max, &f(0.0), &f(-0.0)), f(0.0));
    assert_eq!(elem(F32, Max, &f(-0.0), &f(0.0)), f(0.0));
    assert_eq!(
        elem(F32, Avg, &f(1.5), &f(2.0)),
        f(3.5),
        "avg sums before finalize"
    );
    assert_eq!(elem(U8, Sum, &[200], &[100]), vec![44]);
    assert_eq!(elem(U8, Prod, &[16], &[17]), vec![16]);
    let i = |v: i32| v.to_le_bytes().to_vec();
    assert_eq!(elem(I32, Sum, &i(i32::MAX), &i(1)), i(i32::MIN));
    assert_eq!(elem(I32, Prod, &i(1 << 16), &i(1 << 16)), i(0));
    assert_eq!(elem(I32, Min, &i(-3), &i(2)), i(-3));
    let h = |v: f32| f32_to_f16(v).to_le_bytes().to_vec();
    assert_eq!(
        elem(F16, Sum, &h(1.0), &h(2f32.powi(-11))),
        h(1.0),
        "rounded back to even"
    );
    assert_eq!(
        elem(F16, Sum, &h(60000.0), &h(60000.0)),
        0x7c00u16.to_le_bytes().to_vec()
    );
    let bf = |v: f32| f32_to_bf16(v).to_le_bytes().to_vec();
    assert_eq!(elem(Bf16, Prod, &bf(3.0), &bf(0.5)), bf(1.5));

    let mut buf = i(-7);
    finalize_avg(I32, &mut buf, 2);
    assert_eq!(buf, i(-3), "truncating");
    let mut buf = vec![255u8];
    finalize_avg(U8, &mut buf, 16);
    assert_eq!(buf, vec![15]);
    let mut buf = f(1.0);
    finalize_avg(F32, &mut buf, 3);
    assert_eq!(buf, f(1.0 / 3.0));
    let mut buf = h(1.0);
    finalize_avg(F16, &mut buf, 3);
    assert_eq!(buf, h(1.0 / 3.0));
}

#[test]
fn every_op_is_commutative_bit_for_bit() {
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
            let a = gen_input(dtype, op, InputKind::Bits, 4000, 1);
            let b = gen_input(dtype, op, InputKind::Bits, 4000, 2);
            let mut ab = vec![0; a.len()];
            let mut ba = vec![0; a.len()];
            reduce_slices(dtype, op, &mut ab, &a, &b);
            reduce_slices(dtype, op, &mut ba, &b, &a);
            assert_eq!(ab, ba, "{dtype} {op}");
            let mut acc = a.clone();
            reduce_assign(dtype, op, &mut acc, &b);
            assert_eq!(acc, ab, "{dtype} {op}");
        }
    }
}

#[test]
fn bitwise_semantics() {
    use DataType::*;
    use ReduceOp::*;
    let i = |v: i32| v.to_le_bytes().to_vec();
    let l = |v: i64| v.to_le_bytes().to_vec();
    assert_eq!(
        elem(U8, Band, &[0b1100_1010], &[0b1010_0110]),
        vec![0b1000_0010]
    );
    assert_eq!(
        elem(U8, Bor, &[0b1100_1010], &[0b1010_0110]),
        vec![0b1110_1110]
    );
    assert_eq!(
        elem(U8, Bxor, &[0b1100_1010], &[0b1010_0110]),
        vec![0b0110_1100]
    );
    assert_eq!(elem(I32, Band, &i(-1), &i(0x1234_5678)), i(0x1234_5678));
    assert_eq!(elem(I32, Bor, &i(i32::MIN), &i(1)), i(i32::MIN + 1));
    assert_eq!(elem(I32, Bxor, &i(-1), &i(0x0f0f_0f0f)), i(!0x0f0f_0f0f));
    assert_eq!(elem(I64, Band, &l(i64::MIN | 6), &l(-4)), l(i64::MIN | 4));
    assert_eq!(elem(I64, Bor, &l(1 << 62), &l(1)), l((1 << 62) | 1));
    assert_eq!(elem(I64, Bxor, &l(-1), &l(-1)), l(0));
    // Over several ranks: `0b0111 & 0b1110 & 0b1011 = 0b0010`, `| = 0b1111`,
    // `^ = 0b0010`.
    let inputs = vec![vec![0b0111u8, 0], vec![0b1110, 0xff], vec![0b1011, 0x0f]];
    let all = |op| expected(Collective::AllReduce, U8, op, 3, 0, &inputs)[0].clone();
    assert_eq!(all(Band), vec![0b0010, 0]);
    assert_eq!(all(Bor), vec![0b1111, 0xff]);
    assert_eq!(all(Bxor), vec![0b0010, 0xf0]);
    // Collectives that only move data take any operator.
    let f = vec![1.5f32.to_le_bytes().to_vec(); 2];
    assert_eq!(
        expected(Collective::AllGather, F32, Bxor, 2, 0, &f),
        vec![f.concat(); 2]
    );
}

#[test]
#[should_panic(
    expected = "reduction op band is bitwise and is not defined for the floating-point type double"
)]
fn bitwise_over_a_float_type_panics() {
    let x = 1.0f64.to_le_bytes();
    elem(DataType::F64, ReduceOp::Band, &x, &x);
}

#[test]
#[should_panic(expected = "reduction op bor is bitwise")]
fn bitwise_expected_over_a_float_type_panics() {
    // One rank: nothing is reduced, and still the operator is refused.
    let x = vec![vec![0u8; 2]; 1];
    expected(Collective::Reduce, DataType::Bf16, ReduceOp::Bor, 1, 0, &x);
}

/// Exact inputs for `Band` and `Bor` keep the reduction over eight ranks away from all zeros and
/// all ones: roughly half of the result bits are set either way (15/16 to the eighth power is
/// 0.6, one minus it 0.4), and different results on every element are common.
#[test]
fn exact_bitwise_inputs_give_mixed_results() {
    for dtype in [DataType::I32, DataType::I64, DataType::U8] {
        for op in [ReduceOp::Band, ReduceOp::Bor, ReduceOp::Bxor] {
            let world = 8;
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| gen_input(dtype, op, InputKind::Exact, 1000, r as u64 + 7))
                .collect();
            let out = &expected(Collective::AllReduce, dtype, op, world, 0, &inputs)[0];
            let ones: u32 = out.iter().map(|b| b.count_ones()).sum();
            let share = f64::from(ones) / (out.len() * 8) as f64;
            assert!((0.3..0.7).contains(&share), "{dtype} {op}: {share}");
        }
    }
}

#[test]
fn expected_shapes() {
    use Collective::*;
    let d = DataType::I32;
    let enc = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let inputs = vec![enc(&[1, 2, 3, 4]), enc(&[10, 20, 30, 40])];
    let sum = enc(&[11, 22, 33, 44]);
    assert_eq!(
        expected(AllReduce, d, ReduceOp::Sum, 2, 0, &inputs),
        vec![sum.clone(); 2]
    );
    assert_eq!(
        expected(ReduceScatter, d, ReduceOp::Sum, 2, 0, &inputs),
        vec![enc(&[11, 22]), enc(&[33, 44])]
    );
    assert_eq!(
        expected(AllGather, d, ReduceOp::Sum, 2, 0, &inputs),
        vec![enc(&[1, 2, 3, 4, 10, 20, 30, 40]); 2]
    );
    assert_eq!(
        expected(Broadcast, d, ReduceOp::Sum, 2, 1, &inputs),
        vec![inputs[1].clone(); 2]
    );
    assert_eq!(
        expected(Reduce, d, ReduceOp::Avg, 2, 1, &inputs),
        vec![vec![], enc(&[5, 11, 16, 22])]
    );
    assert_eq!(
        expected(Barrier, d, ReduceOp::Sum, 2, 0, &[vec![], vec![]]),
        vec![vec![], vec![]]
    );
    let empty = vec![vec![]; 3];
    assert_eq!(
        expected(ReduceScatter, d, ReduceOp::Sum, 3, 0, &empty),
        vec![Vec::<u8>::new(); 3]
    );
}

#[test]
fn exact_inputs_are_exact_in_any_order() {
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
            let world = 16;
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| gen_input(dtype, op, InputKind::Exact, 500, r as u64))
                .collect();
            let mut reversed = inputs.clone();
            reversed.reverse();
            let a = expected(Collective::AllReduce, dtype, op, world, 0, &inputs);
            let b = expected(Collective::AllReduce, dtype, op, world, 0, &reversed);
            assert_eq!(a[0], b[0], "{dtype} {op}");
        }
    }
}

#[test]
fn check_accepts_reordering_within_tolerance_and_rejects_errors() {
    use Collective::AllReduce;
    for dtype in [DataType::F32, DataType::F16, DataType::Bf16, DataType::F64] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod] {
            let world = 8;
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| gen_input(dtype, op, InputKind::Random, 300, r as u64))
                .collect();
            let mut reversed = inputs.clone();
            reversed.reverse();
            let got = expected(AllReduce, dtype, op, world, 0, &reversed);
            let tol = default_tolerance(dtype, op, world, InputKind::Random);
            assert!(matches!(tol, Tolerance::Relative(_)));
            check(AllReduce, dtype, op, world, 0, &inputs, &got, tol).unwrap();
            // A missing contribution is far outside the tolerance.
            let partial = expected(AllReduce, dtype, op, world - 1, 0, &inputs[..world - 1]);
            let err = check(
                AllReduce,
                dtype,
                op,
                world,
                0,
                &inputs,
                &vec![partial[0].clone(); world],
                tol,
            );
            assert!(
                matches!(err, Err(Mismatch::Value { .. })),
                "{dtype} {op}: {err:?}"
            );
        }
    }
    let d = DataType::U8;
    let inputs = vec![vec![1, 2], vec![3, 4]];
    let ok = vec![vec![4, 6], vec![4, 6]];
    check(
        AllReduce,
        d,
        ReduceOp::Sum,
        2,
        0,
        &inputs,
        &ok,
        Tolerance::Exact,
    )
    .unwrap();
    let diverged = vec![vec![4, 6], vec![4, 7]];
    let err = check(
        AllReduce,
        d,
        ReduceOp::Sum,
        2,
        0,
        &inputs,
        &diverged,
        Tolerance::Exact,
    );
    assert!(
        matches!(
            err,
            Err(Mismatch::Divergent {
                rank: 1,
                index: 1,
                ..
            })
        ),
        "{err:?}"
    );
    let wrong = vec![vec![4, 7], vec![4, 7]];
    let err = check(
        AllReduce,
        d,
        ReduceOp::Sum,
        2,
        0,
        &inputs,
        &wrong,
        Tolerance::Exact,
    );
    assert_eq!(
        err.unwrap_err().to_string(),
        "rank 0 element 1: got 7 (0x07), expected 6 (0x06) (exact)"
    );
}
