//! Validation data of `gradsync bench -c 1`: deterministic inputs whose reductions are exact in
//! every data type, and the expected outputs, computed locally and compared bit for bit.
//!
//! Inputs differ from rank to rank and from element to element (a hash of both), so a block
//! that lands in the wrong place, a rank counted twice or another rank's data in place of a
//! rank's show up as wrong elements at any world size. Every input is an integer from 1 to 255,
//! and every partial result of any reduction order stays within the exact integers of the data
//! type (`E`: 256 for `bfloat16`, 2048 for `half`, 255 for `uint8`, 2^24 for `float`, ...), so
//! the result cannot depend on the algorithm, the chunking or the order of the ranks.
//!
//! Each reduction has a part that repeats every [`PERIOD`] elements (its expected values are a
//! table of `PERIOD` entries, computed once) and a part that follows the element index without
//! period (computed per element), so that checking costs one pass over the output whatever the
//! world size. With `h(...)` a hash, `n` ranks and `j = i mod PERIOD`:
//!
//! | op | value of element `i` on rank `r` | result |
//! |---|---|---|
//! | sum | `1 + h(r, j) mod m`, plus 1 on the `k(i)` ranks from `s(i)` on (`m`, `k` sized to `E`) | table + `k(i)` |
//! | prod | 2 on the `k(i)` ranks from `s(i)` on, else 1 (`k(i) <= log2 E`) | `2^k(i)` |
//! | max | `1 + h(r, j) mod 200`; rank `s(i)`: `201 + h(i) mod 55` | `201 + h(i) mod 55` |
//! | min | `56 + h(r, j) mod 200`; rank `s(i)`: `1 + h(i) mod 55` | `1 + h(i) mod 55` |
//! | avg | `a(i) + d(r, j)`, `d` = `+x`, `-x` on the ranks of a pair, 0 on the last of an odd count | `a(i)` |
//! | band | 128 plus the low seven bits, less those whose owner `o_b(i)` is `r` | 128 plus the bits with `o_b(i) >= n` |
//! | bor | 128 plus the low bits whose owner `o_b(i)` is `r` | 128 plus the bits with `o_b(i) < n` |
//! | bxor | `1 + h(r, j) mod 127`; rank `s(i)`: that xor `h(i) mod 128`, plus 128 | 128 plus (table xor `h(i) mod 128`) |
//! | data of all-gather and broadcast | `1 + h(r, i) mod 255` | the source rank's |
//!
//! The owner `o_b(i)` of bit `b` of element `i` is a hash in `0..2n`, so about half the bits
//! have an owner among the ranks and the result of band and bor changes from element to element;
//! a rank's input differs from another's in the bits it owns. The bitwise operators take the
//! integer types only, where every value and result (at most 255) is exact.
//!
//! Exactness needs `n <= E` (sum, avg); `avg` varies between ranks while `5 n <= E` (51 ranks in
//! `bfloat16`, every world in `float`), above which the ranks of a pair send the same values.
//! Every expected value is at least 1, so outputs are cleared to 0 before the validated call:
//! an operation that leaves its output untouched is caught.

use anyhow::Context;
use gradsync::{Collective, Communicator, Element, ReduceOp};

/// The period of the part of the inputs that repeats (a prime, so that no block size of a
/// power of two or a small multiple of one lines two blocks up with the same values).
pub const PERIOD: usize = 251;

/// An element type the bench can fill and compare bit for bit.
pub trait CheckElem: Element + PartialEq {
    /// Every integer from 0 to `EXACT` is exact in this type, and so are sums up to it.
    const EXACT: i64;
    /// The element equal to the small integer `v` (exact for `0..=255`).
    fn from_small(v: i64) -> Self;
    /// The bits of the element, for bitwise comparison.
    fn bits(self) -> u64;
}

macro_rules! check_elem {
    ($($t:ty => $exact:expr, |$v:ident| $from:expr, |$x:ident| $bits:expr;)*) => {$(
        impl CheckElem for $t {
            const EXACT: i64 = $exact;
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
    f32 => 1 << 24, |v| v as f32, |x| u64::from(x.to_bits());
    f64 => 1 << 53, |v| v as f64, |x| x.to_bits();
    half::f16 => 2048, |v| half::f16::from_f64(v as f64), |x| u64::from(x.to_bits());
    half::bf16 => 256, |v| half::bf16::from_f64(v as f64), |x| u64::from(x.to_bits());
    i32 => i32::MAX as i64, |v| v as i32, |x| x as u32 as u64;
    i64 => i64::MAX, |v| v, |x| x as u64;
    u8 => 255, |v| v as u8, |x| u64::from(x);
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

/// Whether `avg` inputs differ between the ranks of a pair at `world` ranks in a type whose
/// exact integers reach `exact`.
pub fn avg_varies(world: usize, exact: i64) -> bool {
    exact / world.max(1) as i64 >= 5
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finalizer
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A hash of a tag and two indices, reduced modulo `m`.
fn h(tag: u64, a: usize, b: usize, m: i64) -> i64 {
    let x = mix(tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ mix(a as u64 ^ mix(b as u64)));
    (x % m.max(1) as u64) as i64
}

/// The inputs of one pattern at one world size in one type: every rank's value of every
/// element, and the exact reduction.
#[derive(Clone, Copy, Debug)]
pub struct Inputs {
    pattern: Pattern,
    world: usize,
    /// Sum: the per-rank values of the periodic part are `1..=m`.
    m: i64,
    /// Sum and prod: the most ranks of the window that add one (sum) or a factor 2 (prod).
    kmax: usize,
    /// Avg: whether the ranks of a pair differ, and the largest base value.
    avg_varied: bool,
    amax: i64,
}

impl Inputs {
    /// The inputs of `pattern` at `world` ranks in a type whose exact integers reach `exact`.
    pub fn new(pattern: Pattern, world: usize, exact: i64) -> Inputs {
        let n = world.max(1);
        let cap = (exact / n as i64).max(1);
        let (m, kmax) = match pattern {
            Pattern::Reduce(ReduceOp::Sum) => {
                let kmax = n.min(8).min((exact - n as i64).max(0) as usize);
                (((exact - kmax as i64) / n as i64).clamp(1, 254), kmax)
            }
            Pattern::Reduce(ReduceOp::Prod) => (1, n.min(exact.max(2).ilog2() as usize).min(7)),
            _ => (1, 0),
        };
        let avg_varied = avg_varies(n, exact);
        let amax = if avg_varied {
            cap.min(204) - 2
        } else {
            cap.min(255)
        };
        Inputs {
            pattern,
            world: n,
            m,
            kmax,
            avg_varied,
            amax,
        }
    }

    /// The window of ranks of element `i`: its first rank and its length.
    fn window(&self, i: usize) -> (usize, usize) {
        let s = h(1, i, 0, self.world as i64) as usize;
        let k = h(2, i, 0, self.kmax as i64 + 1) as usize;
        (s, k)
    }

    fn in_window(&self, rank: usize, i: usize) -> bool {
        let (s, k) = self.window(i);
        (rank + self.world - s) % self.world < k
    }

    /// The rank with the extreme value of element `i` (min, max).
    fn designated(&self, i: usize) -> usize {
        h(3, i, 0, self.world as i64) as usize
    }

    /// Band, bor: the owner of each of the low seven bits of element `i`, a rank when below the
    /// world size (about half of them), else no rank.
    fn owners(&self, i: usize) -> [usize; 7] {
        let x = mix(0xb175 ^ mix(i as u64));
        std::array::from_fn(|b| (((x >> (9 * b)) & 0x1ff) as usize * 2 * self.world) >> 9)
    }

    /// Band, bor: the low bits of element `i` that `rank` owns (`rank == world`: that no rank
    /// owns).
    fn owned(&self, rank: usize, i: usize) -> i64 {
        let owners = self.owners(i);
        (0..7)
            .filter(|&b| owners[b] == rank || (rank == self.world && owners[b] >= rank))
            .fold(0, |m, b| m | 1 << b)
    }

    /// Bxor: the per-rank value of the periodic part.
    fn xor_part(rank: usize, j: usize) -> i64 {
        1 + h(4, rank, j, 127)
    }

    /// Avg: the base value of element `i`.
    fn base(&self, i: usize) -> i64 {
        if self.avg_varied {
            3 + h(6, i, 0, self.amax - 2)
        } else {
            1 + h(6, i, 0, self.amax)
        }
    }

    /// The input value of element `i` on `rank`.
    pub fn value(&self, rank: usize, i: usize) -> i64 {
        let j = i % PERIOD;
        match self.pattern {
            Pattern::Data => 1 + h(5, rank, i, 255),
            Pattern::Reduce(ReduceOp::Sum) => {
                1 + h(4, rank, j, self.m) + i64::from(self.in_window(rank, i))
            }
            Pattern::Reduce(ReduceOp::Prod) => 1 + i64::from(self.in_window(rank, i)),
            Pattern::Reduce(ReduceOp::Max) if rank == self.designated(i) => 201 + h(7, i, 0, 55),
            Pattern::Reduce(ReduceOp::Max) => 1 + h(4, rank, j, 200),
            Pattern::Reduce(ReduceOp::Min) if rank == self.designated(i) => 1 + h(7, i, 0, 55),
            Pattern::Reduce(ReduceOp::Min) => 56 + h(4, rank, j, 200),
            Pattern::Reduce(ReduceOp::Band) => 0x80 | (0x7f & !self.owned(rank, i)),
            Pattern::Reduce(ReduceOp::Bor) => 0x80 | self.owned(rank, i),
            Pattern::Reduce(ReduceOp::Bxor) if rank == self.designated(i) => {
                0x80 | (Self::xor_part(rank, j) ^ h(7, i, 0, 128))
            }
            Pattern::Reduce(ReduceOp::Bxor) => Self::xor_part(rank, j),
            Pattern::Reduce(ReduceOp::Avg) => {
                let paired = !(self.world % 2 == 1 && rank == self.world - 1);
                let x = if self.avg_varied && paired {
                    1 + h(4, rank / 2, j, 2)
                } else {
                    0
                };
                self.base(i) + if rank.is_multiple_of(2) { x } else { -x }
            }
        }
    }

    /// The expected outputs: the periodic part's reduction, one table for all elements.
    pub fn expected(&self) -> Expected {
        let table = match self.pattern {
            Pattern::Reduce(ReduceOp::Sum) => (0..PERIOD)
                .map(|j| (0..self.world).map(|r| 1 + h(4, r, j, self.m)).sum())
                .collect(),
            Pattern::Reduce(ReduceOp::Bxor) => (0..PERIOD)
                .map(|j| (0..self.world).fold(0, |a, r| a ^ Inputs::xor_part(r, j)))
                .collect(),
            _ => Vec::new(),
        };
        Expected {
            inputs: *self,
            table,
        }
    }

    /// The exact reduction of element `i`, from every rank's value (the reference the tests
    /// hold [`Expected`] to).
    #[cfg(test)]
    fn reduced_slow(&self, i: usize) -> i64 {
        let Pattern::Reduce(op) = self.pattern else {
            return 0;
        };
        let vals = (0..self.world).map(|r| self.value(r, i));
        match op {
            ReduceOp::Sum => vals.sum(),
            ReduceOp::Prod => vals.product(),
            ReduceOp::Min => vals.min().unwrap_or(0),
            ReduceOp::Max => vals.max().unwrap_or(0),
            ReduceOp::Avg => vals.sum::<i64>() / self.world as i64,
            ReduceOp::Band => vals.fold(-1, |a, v| a & v),
            ReduceOp::Bor => vals.fold(0, |a, v| a | v),
            ReduceOp::Bxor => vals.fold(0, |a, v| a ^ v),
        }
    }
}

/// The exact reduction of every element of a pattern, computed in constant time per element.
pub struct Expected {
    inputs: Inputs,
    table: Vec<i64>,
}

impl Expected {
    /// The reduction over all ranks of element `i`.
    pub fn at(&self, i: usize) -> i64 {
        let x = &self.inputs;
        match x.pattern {
            Pattern::Data => 0,
            Pattern::Reduce(ReduceOp::Sum) => self.table[i % PERIOD] + x.window(i).1 as i64,
            Pattern::Reduce(ReduceOp::Prod) => 1 << x.window(i).1,
            Pattern::Reduce(ReduceOp::Max) => 201 + h(7, i, 0, 55),
            Pattern::Reduce(ReduceOp::Min) => 1 + h(7, i, 0, 55),
            Pattern::Reduce(ReduceOp::Avg) => x.base(i),
            Pattern::Reduce(ReduceOp::Band) => 0x80 | x.owned(x.world, i),
            Pattern::Reduce(ReduceOp::Bor) => 0x80 | (0x7f & !x.owned(x.world, i)),
            Pattern::Reduce(ReduceOp::Bxor) => 0x80 | (self.table[i % PERIOD] ^ h(7, i, 0, 128)),
        }
    }
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
    let inputs = Inputs::new(pattern, world, T::EXACT);
    for (i, x) in buf.iter_mut().enumerate() {
        *x = T::from_small(inputs.value(rank, offset + i));
    }
}

/// Counts the elements of `out` whose bits differ from `expected(offset + i)`.
fn count_mismatches<T: CheckElem>(
    out: &[T],
    offset: usize,
    expected: impl Fn(usize) -> i64,
) -> u64 {
    out.iter()
        .enumerate()
        .filter(|&(i, x)| x.bits() != T::from_small(expected(offset + i)).bits())
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
        Collective::AllGather | Collective::AllToAll => fill(buf, Pattern::Data, world, rank, 0),
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
    let data = Inputs::new(Pattern::Data, world, T::EXACT);
    match coll {
        Collective::AllGather => {
            let per_rank = out.len() / world.max(1);
            if per_rank == 0 {
                return 0;
            }
            out.chunks(per_rank)
                .enumerate()
                .map(|(src, chunk)| count_mismatches(chunk, 0, |i| data.value(src, i)))
                .sum()
        }
        Collective::AllToAll => {
            // Block s of the output is block `rank` of rank s's input.
            let per_peer = out.len() / world.max(1);
            if per_peer == 0 {
                return 0;
            }
            out.chunks(per_peer)
                .enumerate()
                .map(|(src, chunk)| {
                    count_mismatches(chunk, rank * per_peer, |i| data.value(src, i))
                })
                .sum()
        }
        Collective::Broadcast => count_mismatches(out, 0, |i| data.value(root, i)),
        Collective::Reduce if rank != root => 0,
        _ => {
            let expected = Inputs::new(Pattern::Reduce(op), world, T::EXACT).expected();
            // Rank r of a reduce-scatter holds slice r of the reduced input.
            let offset = if coll == Collective::ReduceScatter {
                rank * out.len()
            } else {
                0
            };
            count_mismatches(out, offset, |i| expected.at(i))
        }
    }
}

/// Wrong elements summed over ranks. Each rank's count is capped at 2^40 first, so that the
/// sum of any world fits and a total is never wrapped around to 0 (or below).
pub fn total_wrong(comm: &mut Communicator, local: u64) -> anyhow::Result<u64> {
    let mut w = [local.min(1 << 40) as i64];
    comm.all_reduce(&mut w, ReduceOp::Sum)
        .context("all_reduce of the wrong counts")?;
    Ok(u64::try_from(w[0]).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORLDS: [usize; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 128, 255];
    const EXACTS: [i64; 5] = [255, 256, 2048, 1 << 24, i64::MAX];

    /// Every input is in 1..=255, every partial result (any order, any subset of ranks) stays
    /// within the type's exact integers, and the fast expected values equal the slow reference.
    #[test]
    fn reductions_stay_exact_and_the_table_is_right() {
        for exact in EXACTS {
            for world in WORLDS {
                for op in ReduceOp::ALL {
                    let x = Inputs::new(Pattern::Reduce(op), world, exact);
                    let e = x.expected();
                    for i in (0..3 * PERIOD).chain([10_000, 123_457, 1 << 30]) {
                        let vals: Vec<i64> = (0..world).map(|r| x.value(r, i)).collect();
                        assert!(
                            vals.iter().all(|&v| (1..=255).contains(&v)),
                            "{op} {world} {vals:?}"
                        );
                        let worst: i64 = match op {
                            ReduceOp::Prod => vals.iter().product(),
                            ReduceOp::Min
                            | ReduceOp::Max
                            | ReduceOp::Band
                            | ReduceOp::Bor
                            | ReduceOp::Bxor => *vals.iter().max().unwrap(),
                            _ => vals.iter().sum(),
                        };
                        if world as i64 <= exact {
                            assert!(worst <= exact, "{op} world {world} exact {exact}: {worst}");
                        }
                        let r = x.reduced_slow(i);
                        assert_eq!(e.at(i), r, "{op} world {world} exact {exact} element {i}");
                        assert!((1..=255.max(exact.min(1 << 20))).contains(&r));
                    }
                }
            }
        }
    }

    #[test]
    fn avg_is_exact_and_varies_where_it_can() {
        for exact in EXACTS {
            for world in 1..=64 {
                let x = Inputs::new(Pattern::Reduce(ReduceOp::Avg), world, exact);
                for i in 0..2 * PERIOD {
                    let sum: i64 = (0..world).map(|r| x.value(r, i)).sum();
                    assert_eq!(sum % world as i64, 0, "world {world}");
                }
                if world >= 2 && avg_varies(world, exact) {
                    assert!((0..PERIOD).any(|i| x.value(0, i) != x.value(1, i)));
                }
            }
        }
        assert!(avg_varies(51, 256) && !avg_varies(52, 256) && avg_varies(4096, 1 << 24));
    }

    /// No two ranks send the same data, and no rank's data repeats with a short period:
    /// the weakness of inputs built from `(7i + 3r) mod m`.
    #[test]
    fn inputs_differ_between_ranks_and_do_not_repeat() {
        for exact in [256, 1 << 24] {
            for world in [6, 9, 128] {
                for pattern in [Pattern::Data]
                    .into_iter()
                    .chain(ReduceOp::ALL.map(Pattern::Reduce))
                {
                    if pattern == Pattern::Reduce(ReduceOp::Avg) && !avg_varies(world, exact) {
                        continue;
                    }
                    let x = Inputs::new(pattern, world, exact);
                    let row = |r: usize, from: usize| -> Vec<i64> {
                        (from..from + 4 * PERIOD).map(|i| x.value(r, i)).collect()
                    };
                    for a in 0..world.min(12) {
                        for b in a + 1..world.min(12) {
                            assert_ne!(
                                row(a, 0),
                                row(b, 0),
                                "{pattern:?} world {world}: ranks {a}, {b}"
                            );
                        }
                        for shift in [1, 2, 5, 8, 64, 1024] {
                            assert_ne!(
                                row(a, 0),
                                row(a, shift * world),
                                "{pattern:?} world {world}: period"
                            );
                        }
                    }
                }
            }
        }
    }

    fn small<T: CheckElem>(v: T) -> i64 {
        (0..=255)
            .find(|&s| T::from_small(s).bits() == v.bits())
            .expect("a small integer")
    }

    /// The exact reduction of `inputs` (one per rank), element by element.
    fn reduce<T: CheckElem>(op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
        (0..inputs[0].len())
            .map(|i| {
                let vals = inputs.iter().map(|b| small(b[i]));
                T::from_small(match op {
                    ReduceOp::Sum => vals.sum(),
                    ReduceOp::Prod => vals.product(),
                    ReduceOp::Min => vals.min().unwrap(),
                    ReduceOp::Max => vals.max().unwrap(),
                    ReduceOp::Band => vals.fold(0xff, |a, v| a & v),
                    ReduceOp::Bor => vals.fold(0, |a, v| a | v),
                    ReduceOp::Bxor => vals.fold(0, |a, v| a ^ v),
                    // A float average that is no integer (0 here) matches no expected value;
                    // an integer average truncates and may hide what the float one shows.
                    ReduceOp::Avg => {
                        let (sum, n) = (vals.sum::<i64>(), inputs.len() as i64);
                        if sum % n == 0 { sum / n } else { 0 }
                    }
                })
            })
            .collect()
    }

    /// What a collective with a misrouting bug produces: at 6 and 9 ranks, a block swapped
    /// with another, one rank's input in place of another's (a rank counted twice), and one
    /// rank's contribution counted twice, are all wrong elements.
    fn faults_are_seen<T: CheckElem + std::fmt::Debug>() {
        for world in [6, 9] {
            let count = 2 * 5 * 7 * 9 * 4; // a multiple of every small period and world
            let block = count / world;
            for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(T::DTYPE)) {
                let inputs: Vec<Vec<T>> = (0..world)
                    .map(|r| {
                        let mut b = vec![T::from_small(0); count];
                        fill_input(&mut b, Collective::AllReduce, op, world, r, 0);
                        b
                    })
                    .collect();
                let right = reduce(op, &inputs);
                let wrong = |out: &[T]| count_wrong(out, Collective::AllReduce, op, world, 0, 0);
                assert_eq!(wrong(&right), 0, "{op} world {world}");
                let mut swapped = right.clone();
                let (a, b) = swapped.split_at_mut(block);
                a.swap_with_slice(&mut b[..block]);
                assert!(wrong(&swapped) > 0, "{op} world {world}: swapped blocks");
                let mut twice = inputs.clone();
                twice[world - 1] = inputs[0].clone();
                assert!(
                    wrong(&reduce(op, &twice)) > 0,
                    "{op} world {world}: rank 0 counted twice"
                );
                if matches!(op, ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Avg) {
                    let mut doubled = inputs.clone();
                    doubled.push(inputs[world / 2].clone());
                    let mut out = reduce(op, &doubled);
                    if op == ReduceOp::Avg {
                        // world + 1 contributions, divided by the world
                        let sums: Vec<i64> = (0..count)
                            .map(|i| doubled.iter().map(|b| small(b[i])).sum())
                            .collect();
                        out = sums
                            .iter()
                            .map(|&s| {
                                T::from_small(if s % world as i64 == 0 {
                                    s / world as i64
                                } else {
                                    0
                                })
                            })
                            .collect();
                    }
                    assert!(
                        wrong(&out) > 0,
                        "{op} world {world}: a contribution counted twice"
                    );
                }
                // reduce-scatter: rank 1 given rank 2's block
                let rs = |r: usize| right[r * block..(r + 1) * block].to_vec();
                let count_rs =
                    |out: &[T], r| count_wrong(out, Collective::ReduceScatter, op, world, r, 0);
                assert_eq!(count_rs(&rs(1), 1), 0);
                assert!(
                    count_rs(&rs(2), 1) > 0,
                    "{op} world {world}: reduce-scatter block"
                );
            }
            // all-gather: the blocks of ranks 0 and world - 1 exchanged
            let mut gathered = Vec::new();
            for r in 0..world {
                let mut b = vec![T::from_small(0); block];
                fill_input(&mut b, Collective::AllGather, ReduceOp::Sum, world, r, 0);
                gathered.extend(b);
            }
            let ag =
                |out: &[T]| count_wrong(out, Collective::AllGather, ReduceOp::Sum, world, 1, 0);
            assert_eq!(ag(&gathered), 0);
            let (a, b) = gathered.split_at_mut((world - 1) * block);
            a[..block].swap_with_slice(b);
            assert!(
                ag(&gathered) > 0,
                "world {world}: all-gather blocks exchanged"
            );
        }
    }

    #[test]
    fn misrouted_blocks_and_ranks_counted_twice_are_wrong_in_every_type() {
        faults_are_seen::<f32>();
        faults_are_seen::<f64>();
        faults_are_seen::<half::f16>();
        faults_are_seen::<half::bf16>();
        faults_are_seen::<i32>();
        faults_are_seen::<i64>();
        faults_are_seen::<u8>();
    }

    /// All-to-all: the blocks moved as the collective moves them count nothing wrong; blocks
    /// from the wrong rank, or the wrong block of the right rank, are wrong.
    fn all_to_all_check<T: CheckElem + std::fmt::Debug>() {
        let (world, per) = (4, 37);
        let c = Collective::AllToAll;
        let inputs: Vec<Vec<T>> = (0..world)
            .map(|r| {
                let mut b = vec![T::from_small(0); world * per];
                fill_input(&mut b, c, ReduceOp::Sum, world, r, 0);
                b
            })
            .collect();
        let out = |src_of: &dyn Fn(usize) -> usize, blk: &dyn Fn(usize) -> usize| {
            (0..world)
                .flat_map(|s| inputs[src_of(s)][blk(s) * per..(blk(s) + 1) * per].to_vec())
                .collect::<Vec<T>>()
        };
        for r in 0..world {
            let good = out(&|s| s, &|_| r);
            assert_eq!(
                count_wrong(&good, c, ReduceOp::Sum, world, r, 0),
                0,
                "rank {r}"
            );
            let swapped = out(&|s| (s + 1) % world, &|_| r);
            assert!(
                count_wrong(&swapped, c, ReduceOp::Sum, world, r, 0) > 0,
                "rank {r}"
            );
            let wrong_block = out(&|s| s, &|_| (r + 1) % world);
            assert!(
                count_wrong(&wrong_block, c, ReduceOp::Sum, world, r, 0) > 0,
                "rank {r}"
            );
        }
    }

    #[test]
    fn all_to_all_blocks_every_type() {
        all_to_all_check::<f32>();
        all_to_all_check::<f64>();
        all_to_all_check::<half::f16>();
        all_to_all_check::<half::bf16>();
        all_to_all_check::<i32>();
        all_to_all_check::<i64>();
        all_to_all_check::<u8>();
    }

    /// Broadcast: everybody ends with the root's buffer; a reduce is checked on its root only;
    /// an untouched (zero) output is all wrong.
    fn rooted<T: CheckElem + std::fmt::Debug>() {
        let (world, count) = (3, 200);
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
        let bc = |out: &[T]| count_wrong(out, Collective::Broadcast, ReduceOp::Sum, world, 0, 2);
        assert_eq!(bc(&other), count as u64);
        assert_eq!(bc(&root_buf), 0);
        let zeros = vec![T::from_small(0); count];
        for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(T::DTYPE)) {
            assert_eq!(count_wrong(&zeros, Collective::Reduce, op, world, 1, 2), 0);
            assert_eq!(
                count_wrong(&zeros, Collective::Reduce, op, world, 2, 2),
                count as u64
            );
            assert_eq!(
                count_wrong(&zeros, Collective::AllReduce, op, world, 0, 0),
                count as u64
            );
        }
    }

    #[test]
    fn rooted_collectives_every_type() {
        rooted::<f32>();
        rooted::<f64>();
        rooted::<half::f16>();
        rooted::<half::bf16>();
        rooted::<i32>();
        rooted::<i64>();
        rooted::<u8>();
    }

    /// The bitwise results change from element to element at every world size (so a misplaced
    /// block is wrong), and every rank's input takes part: dropping any one rank changes some
    /// element of band, bor and bxor alike.
    #[test]
    fn bitwise_results_vary_and_every_rank_counts() {
        for world in WORLDS {
            for op in [ReduceOp::Band, ReduceOp::Bor, ReduceOp::Bxor] {
                let x = Inputs::new(Pattern::Reduce(op), world, 255);
                let e = x.expected();
                let results: std::collections::BTreeSet<i64> = (0..1000).map(|i| e.at(i)).collect();
                assert!(results.len() >= 30, "{op} world {world}: {results:?}");
                assert!(
                    results.iter().all(|&r| (128..=255).contains(&r)),
                    "{op} world {world}"
                );
                for dropped in (0..world).step_by(world.div_ceil(8)) {
                    let changed = (0..4 * PERIOD).any(|i| {
                        let vals = (0..world).filter(|&r| r != dropped).map(|r| x.value(r, i));
                        let without = match op {
                            ReduceOp::Band => vals.fold(0xff, |a, v| a & v),
                            ReduceOp::Bor => vals.fold(0, |a, v| a | v),
                            _ => vals.fold(0, |a, v| a ^ v),
                        };
                        without != e.at(i)
                    });
                    assert!(
                        changed,
                        "{op} world {world}: rank {dropped} makes no difference"
                    );
                }
            }
        }
    }

    #[test]
    fn small_integers_are_exact() {
        for v in 0..=255 {
            assert_eq!(half::f16::from_small(v).to_f64(), v as f64);
            assert_eq!(half::bf16::from_small(v).to_f64(), v as f64);
            assert_eq!(i64::from(u8::from_small(v)), v);
        }
        assert_eq!(half::bf16::from_small(256).to_f64(), 256.0);
        assert_eq!(half::f16::from_small(2048).to_f64(), 2048.0);
    }
}
