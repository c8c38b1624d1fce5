//! Validation data of `gradsync bench -c 1`: deterministic inputs whose reductions are exact in
//! every data type, and the expected outputs, computed locally and compared bit for bit.
//!
//! Every input is a small positive integer, chosen per operator so that every partial result of
//! any reduction order is an integer of at most 255: exactly representable in `uint8`, `half`
//! and `bfloat16` (whose integers are exact up to 256), so the result cannot depend on the
//! algorithm, the chunking or the order of the ranks.
//!
//! | op | value of element `i` on rank `r` (`n` ranks) | exact up to |
//! |---|---|---|
//! | sum | `((7i + 3r) mod m) + 1`, `m = clamp(255 / n, 1, 5)` | 255 ranks |
//! | prod | 2 when `r < 7` and `i + r` is even, else 1 (product at most 16) | any |
//! | min, max, and data of all-gather and broadcast | `((7i + 3r) mod 97) + 1` | any |
//! | avg | `a(i) + d(r)`, `a(i) = (7i mod 5) + 3`, `d` = +1, -1, +2, -2, ... by pairs of ranks (0 for the last of an odd count), so the sum is `n a(i)` and the average `a(i)` exactly | 36 ranks (above, every value is 1) |
//!
//! Every expected value is at least 1, so outputs are cleared to 0 before the validated call:
//! an operation that leaves its output untouched is caught.

use gradsync::{Collective, Element, ReduceOp};

/// Largest world whose `avg` values vary (above it, `avg` inputs are all 1 to stay exact).
pub const AVG_VARIED_MAX_WORLD: usize = 36;

/// An element type the bench can fill and compare bit for bit.
pub trait CheckElem: Element + PartialEq {
    /// The element equal to the small integer `v` (exact for `0..=255`).
    fn from_small(v: i64) -> Self;
    /// The bits of the element, for bitwise comparison.
    fn bits(self) -> u64;
}

macro_rules! check_elem {
    ($($t:ty => |$v:ident| $from:expr, |$x:ident| $bits:expr;)*) => {$(
        impl CheckElem for $t {
            fn from_small($v: i64) -> Self {
                $from
            }
            fn bits(self) -> u64 {
                let $x = self;
                $bits
            }
        }
    )*};
}

check_elem! {
    f32 => |v| v as f32, |x| u64::from(x.to_bits());
    f64 => |v| v as f64, |x| x.to_bits();
    half::f16 => |v| half::f16::from_f64(v as f64), |x| u64::from(x.to_bits());
    half::bf16 => |v| half::bf16::from_f64(v as f64), |x| u64::from(x.to_bits());
    i32 => |v| v as i32, |x| x as u32 as u64;
    i64 => |v| v, |x| x as u64;
    u8 => |v| v as u8, |x| u64::from(x);
}

/// What the values of a row are generated for: a reduction operator, or plain data
/// (all-gather, broadcast).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Inputs of a reduction with this operator.
    Reduce(ReduceOp),
    /// Data that is only moved.
    Data,
}

impl Pattern {
    /// Values repeat with this period in the element index.
    pub fn period(self, world: usize) -> usize {
        match self {
            Pattern::Reduce(ReduceOp::Sum) => sum_modulus(world),
            Pattern::Reduce(ReduceOp::Prod) => 2,
            Pattern::Reduce(ReduceOp::Avg) => 5,
            Pattern::Reduce(ReduceOp::Min | ReduceOp::Max) | Pattern::Data => 97,
        }
    }
}

fn sum_modulus(world: usize) -> usize {
    (255 / world.max(1)).clamp(1, 5)
}

/// The input value of element `i` on `rank` of `world` ranks (see the module documentation).
pub fn value(pattern: Pattern, world: usize, rank: usize, i: usize) -> i64 {
    let i = i % pattern.period(world);
    let mixed = |m: usize| (((i * 7) % m + (rank % m) * 3) % m + 1) as i64;
    match pattern {
        Pattern::Reduce(ReduceOp::Sum) => mixed(sum_modulus(world)),
        Pattern::Reduce(ReduceOp::Prod) => i64::from(rank < 7 && (i + rank).is_multiple_of(2)) + 1,
        Pattern::Reduce(ReduceOp::Min | ReduceOp::Max) | Pattern::Data => mixed(97),
        Pattern::Reduce(ReduceOp::Avg) => {
            if world > AVG_VARIED_MAX_WORLD {
                return 1;
            }
            let base = ((i * 7) % 5) as i64 + 3;
            let paired = !(world % 2 == 1 && rank == world - 1);
            let magnitude = ((rank / 2) % 2) as i64 + 1;
            let delta = match (paired, rank % 2) {
                (false, _) => 0,
                (true, 0) => magnitude,
                (true, _) => -magnitude,
            };
            base + delta
        }
    }
}

/// The exact reduction with `op` over all ranks of element `i`.
pub fn reduced(op: ReduceOp, world: usize, i: usize) -> i64 {
    let vals = (0..world).map(|r| value(Pattern::Reduce(op), world, r, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Prod => vals.product(),
        ReduceOp::Min => vals.min().unwrap_or(0),
        ReduceOp::Max => vals.max().unwrap_or(0),
        ReduceOp::Avg => vals.sum::<i64>() / world.max(1) as i64,
    }
}

/// One period of values, as elements.
fn table<T: CheckElem>(period: usize, f: impl Fn(usize) -> i64) -> Vec<T> {
    (0..period).map(|i| T::from_small(f(i))).collect()
}

/// Fills `buf` with the values of `rank`, element `i` of `buf` being element `offset + i` of
/// the pattern.
pub fn fill<T: CheckElem>(
    buf: &mut [T],
    pattern: Pattern,
    world: usize,
    rank: usize,
    offset: usize,
) {
    let period = pattern.period(world);
    let t: Vec<T> = table(period, |i| value(pattern, world, rank, i));
    for (i, x) in buf.iter_mut().enumerate() {
        *x = t[(offset + i) % period];
    }
}

/// Counts the elements of `out` whose bits differ from `expected` at the same index.
fn count_mismatches<T: CheckElem>(out: &[T], period: usize, offset: usize, expected: &[T]) -> u64 {
    out.iter()
        .enumerate()
        .filter(|(i, x)| x.bits() != expected[(offset + i) % period].bits())
        .count() as u64
}

/// The input buffer of `rank` for a row of `coll` (its length decides how much is filled).
///
/// Broadcast inputs are the root's values on the root and zeros elsewhere.
pub fn fill_input<T: CheckElem>(
    buf: &mut [T],
    coll: Collective,
    op: ReduceOp,
    world: usize,
    rank: usize,
    root: usize,
) {
    match coll {
        Collective::AllGather => fill(buf, Pattern::Data, world, rank, 0),
        Collective::Broadcast if rank == root => fill(buf, Pattern::Data, world, root, 0),
        Collective::Broadcast => buf.fill(T::from_small(0)),
        _ => fill(buf, Pattern::Reduce(op), world, rank, 0),
    }
}

/// The number of wrong elements in the output `out` of `rank` after `coll`, where every rank
/// filled its input with [`fill_input`]. A reduce is checked on its root only.
pub fn count_wrong<T: CheckElem>(
    out: &[T],
    coll: Collective,
    op: ReduceOp,
    world: usize,
    rank: usize,
    root: usize,
) -> u64 {
    match coll {
        Collective::AllGather => {
            let period = Pattern::Data.period(world);
            let per_rank = out.len() / world.max(1);
            if per_rank == 0 {
                return 0;
            }
            out.chunks(per_rank)
                .enumerate()
                .map(|(src, chunk)| {
                    let expected: Vec<T> = table(period, |i| value(Pattern::Data, world, src, i));
                    count_mismatches(chunk, period, 0, &expected)
                })
                .sum()
        }
        Collective::Broadcast => {
            let period = Pattern::Data.period(world);
            let expected: Vec<T> = table(period, |i| value(Pattern::Data, world, root, i));
            count_mismatches(out, period, 0, &expected)
        }
        Collective::Reduce if rank != root => 0,
        _ => {
            let period = Pattern::Reduce(op).period(world);
            let expected: Vec<T> = table(period, |i| reduced(op, world, i));
            // Rank r of a reduce-scatter holds slice r of the reduced input.
            let offset = if coll == Collective::ReduceScatter {
                rank * out.len()
            } else {
                0
            };
            count_mismatches(out, period, offset, &expected)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every reduction of every operator is an integer in 1..=255 for these world sizes, so it
    /// is exact in every type.
    #[test]
    fn reductions_stay_exact() {
        for world in [1, 2, 3, 4, 7, 8, 16, 36, 37, 64, 255] {
            for op in ReduceOp::ALL {
                let pattern = Pattern::Reduce(op);
                for i in 0..2 * pattern.period(world) {
                    let vals: Vec<i64> = (0..world).map(|r| value(pattern, world, r, i)).collect();
                    assert!(
                        vals.iter().all(|&v| (1..=255).contains(&v)),
                        "{op} {world} {vals:?}"
                    );
                    let total: i64 = match op {
                        ReduceOp::Prod => vals.iter().product(),
                        ReduceOp::Min | ReduceOp::Max => *vals.iter().max().unwrap(),
                        _ => vals.iter().sum(),
                    };
                    assert!(
                        total <= 255,
                        "{op} world {world}: partial results reach {total}"
                    );
                    let r = reduced(op, world, i);
                    assert!((1..=255).contains(&r));
                }
            }
        }
    }

    #[test]
    fn avg_is_exact() {
        for world in 1..=AVG_VARIED_MAX_WORLD {
            for i in 0..5 {
                let sum: i64 = (0..world)
                    .map(|r| value(Pattern::Reduce(ReduceOp::Avg), world, r, i))
                    .sum();
                assert_eq!(sum % world as i64, 0, "world {world}");
                assert_eq!(reduced(ReduceOp::Avg, world, i), sum / world as i64);
            }
        }
        // The values differ between ranks, so a rank that sends the wrong data is caught.
        assert_ne!(
            value(Pattern::Reduce(ReduceOp::Avg), 4, 0, 0),
            value(Pattern::Reduce(ReduceOp::Avg), 4, 1, 0)
        );
    }

    #[test]
    fn expected_values() {
        // rank r element i = ((7i + 3r) mod 5) + 1 for sum on 2 ranks.
        assert_eq!(value(Pattern::Reduce(ReduceOp::Sum), 2, 0, 0), 1);
        assert_eq!(value(Pattern::Reduce(ReduceOp::Sum), 2, 1, 0), 4);
        assert_eq!(value(Pattern::Reduce(ReduceOp::Sum), 2, 1, 1), 1);
        assert_eq!(reduced(ReduceOp::Sum, 2, 0), 5);
        assert_eq!(reduced(ReduceOp::Max, 2, 0), 4);
        assert_eq!(reduced(ReduceOp::Min, 2, 0), 1);
        assert_eq!(reduced(ReduceOp::Prod, 3, 0), 4);
        assert_eq!(reduced(ReduceOp::Prod, 3, 1), 2);
    }

    /// Simulates the collectives naively and checks that correct outputs count as right and
    /// damaged ones as wrong, in every type.
    fn simulate<T: CheckElem + std::fmt::Debug>() {
        let world = 3;
        let count = 200;
        for op in ReduceOp::ALL {
            // all-reduce
            let inputs: Vec<Vec<T>> = (0..world)
                .map(|r| {
                    let mut b = vec![T::from_small(0); count];
                    fill_input(&mut b, Collective::AllReduce, op, world, r, 0);
                    b
                })
                .collect();
            let out: Vec<T> = (0..count)
                .map(|i| T::from_small(reduced(op, world, i)))
                .collect();
            for r in 0..world {
                assert_eq!(count_wrong(&out, Collective::AllReduce, op, world, r, 0), 0);
            }
            let mut bad = out.clone();
            bad[17] = T::from_small(0);
            bad[150] = inputs[1][150];
            let expect_bad = 1 + u64::from(inputs[1][150].bits() != out[150].bits());
            assert_eq!(
                count_wrong(&bad, Collective::AllReduce, op, world, 0, 0),
                expect_bad
            );
            // reduce-scatter: rank r gets slice r of the reduction of inputs of world*count.
            for r in 0..world {
                let slice: Vec<T> = (0..count)
                    .map(|i| T::from_small(reduced(op, world, r * count + i)))
                    .collect();
                assert_eq!(
                    count_wrong(&slice, Collective::ReduceScatter, op, world, r, 0),
                    0
                );
            }
            // reduce: checked on the root only.
            let zeros = vec![T::from_small(0); count];
            assert_eq!(count_wrong(&zeros, Collective::Reduce, op, world, 1, 2), 0);
            assert_eq!(
                count_wrong(&zeros, Collective::Reduce, op, world, 2, 2),
                count as u64
            );
        }
        // all-gather: the concatenation of every rank's input.
        let mut gathered = Vec::new();
        for r in 0..world {
            let mut b = vec![T::from_small(0); count];
            fill_input(&mut b, Collective::AllGather, ReduceOp::Sum, world, r, 0);
            gathered.extend(b);
        }
        assert_eq!(
            count_wrong(&gathered, Collective::AllGather, ReduceOp::Sum, world, 1, 0),
            0
        );
        gathered.swap(0, count);
        assert_eq!(
            count_wrong(&gathered, Collective::AllGather, ReduceOp::Sum, world, 1, 0),
            2
        );
        // broadcast: everybody ends with the root's buffer; non-roots start with zeros.
        let mut root_buf = vec![T::from_small(0); count];
        fill_input(
            &mut root_buf,
            Collective::Broadcast,
            ReduceOp::Sum,
            world,
            2,
            2,
        );
        let mut other = vec![T::from_small(9); count];
        fill_input(
            &mut other,
            Collective::Broadcast,
            ReduceOp::Sum,
            world,
            0,
            2,
        );
        assert_eq!(
            count_wrong(&other, Collective::Broadcast, ReduceOp::Sum, world, 0, 2),
            count as u64
        );
        assert_eq!(
            count_wrong(&root_buf, Collective::Broadcast, ReduceOp::Sum, world, 0, 2),
            0
        );
    }

    #[test]
    fn simulated_collectives_every_type() {
        simulate::<f32>();
        simulate::<f64>();
        simulate::<half::f16>();
        simulate::<half::bf16>();
        simulate::<i32>();
        simulate::<i64>();
        simulate::<u8>();
    }

    #[test]
    fn small_integers_are_exact() {
        for v in 0..=255 {
            assert_eq!(half::f16::from_small(v).to_f64(), v as f64);
            assert_eq!(half::bf16::from_small(v).to_f64(), v as f64);
            assert_eq!(i64::from(u8::from_small(v)), v);
        }
    }
}
