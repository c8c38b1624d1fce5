//! Recursive doubling all-reduce and the dissemination barrier: latency-bound schedules.
//!
//! # Recursive doubling
//!
//! For a power-of-two world, step `i` (of `log2 n`) pairs rank `v` with `v xor 2^i`; the two
//! exchange their whole buffers and both reduce. After step `i` every group of `2^(i+1)` ranks
//! holds the reduction over the group, so after `log2 n` steps everyone has the full result. The
//! cost is `log2(n) * (alpha + B * beta)`: the fewest message latencies of any all-reduce, but the
//! whole buffer crosses every link `log2 n` times, against `2 (n - 1) / n` for the ring. It
//! therefore wins for small buffers, where `alpha` dominates.
//!
//! **Identical bits.** Both partners compute `mine op theirs` over the same two operands, which
//! are themselves identical on both sides by induction, and every reduction operator here is
//! commutative bit for bit (`a op b == b op a`, NaNs aside for hardware that propagates
//! payloads), so all ranks end with the same bits.
//!
//! **Other worlds** use the standard fold: with `p` the largest power of two `<= n` and
//! `rem = n - p`, each even rank `r < 2 rem` first sends its buffer to `r + 1` and leaves the
//! exchange; the `p` remaining ranks run recursive doubling; at the end each `r + 1` sends the
//! result back. That costs two extra latencies.
//!
//! **Buffers.** A rank sends its buffer and, at the same time, receives its partner's, so the
//! reduction cannot land where the outgoing data is still being read. Instead the running value
//! alternates between `Output` and a scratch buffer of `count` elements, arranged so that the last
//! step writes `Output` (one extra local copy when that is impossible in place). The
//! write-after-read hazards of this alternation are explicit dependencies, so no step waits for a
//! partner's progress beyond the data it needs: the schedule is deadlock-free even when a send
//! completes only once the peer has posted the matching receive.
//!
//! # Dissemination barrier
//!
//! In round `k` (of `ceil(log2 n)`) rank `r` sends an empty message to `r + 2^k` and receives one
//! from `r - 2^k`; each send waits for every earlier receive. After round `k` a rank has heard,
//! directly or through others, from the `2^(k+1)` ranks before it, so after the last round from
//! everyone: no rank leaves before all have entered.

use super::common::{Hazards, alone, finalizes, segments};
use super::params::Params;
use super::program::{Buf, Loc, Op, OpId, Program};

/// Recursive doubling all-reduce.
pub(crate) fn all_reduce(p: &Params) -> Program {
    let mut prog = Program::new();
    let (n, r, count, seg) = (p.world, p.rank, p.count, p.segment);
    let base = if p.in_place { Buf::Output } else { Buf::Input };
    if n == 1 {
        return alone(p);
    }
    let pow = if n.is_power_of_two() {
        n
    } else {
        n.next_power_of_two() / 2
    };
    let rem = n - pow;
    let steps = pow.trailing_zeros() as usize;
    let segs: Vec<(usize, usize)> = segments(count, seg).collect();
    let mut hz = Hazards::new(segs.len());
    let loc = |b: Buf, off: usize| Loc::new(b, off);

    if r < 2 * rem && r % 2 == 0 {
        let indexed: Vec<_> = segs
            .iter()
            .enumerate()
            .map(|(j, &(o, l))| (o, l, j))
            .collect();
        fold_out(&mut prog, &mut hz, base, r + 1, &indexed);
        return prog;
    }
    let fold = r < 2 * rem;
    let vrank = if fold { r / 2 } else { r - rem };
    let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };

    // Every reducing receive writes the buffer the running value is not in; choose the sequence
    // so that the last one writes `Output`. Only a recursive doubling step must not write the
    // buffer it sends from; the fold's receive may reduce in place.
    let writes = usize::from(fold) + steps;
    let mut targets: Vec<Buf> = (0..writes)
        .map(|i| {
            if (writes - 1 - i).is_multiple_of(2) {
                Buf::Output
            } else {
                Buf::Scratch
            }
        })
        .collect();
    if p.in_place && !fold && targets.first() == Some(&Buf::Output) {
        targets = (0..writes)
            .map(|i| {
                if i % 2 == 0 {
                    Buf::Scratch
                } else {
                    Buf::Output
                }
            })
            .collect();
    }
    if targets.contains(&Buf::Scratch) {
        prog.reserve_scratch(count);
    }
    let mut targets = targets.into_iter();
    let mut cur = base;
    if fold {
        let t = targets.next().expect("one target per write");
        for (j, &(off, len)) in segs.iter().enumerate() {
            let op = Op::Recv {
                peer: r - 1,
                dst: loc(t, off),
                reduce_with: Some(loc(cur, off)),
                len,
            };
            hz.push(&mut prog, op, j, &[cur], &[t], &[]);
        }
        cur = t;
    }
    for i in 0..steps {
        let partner = real(vrank ^ (1 << i));
        let t = targets.next().expect("one target per write");
        debug_assert_ne!(t, cur);
        for (j, &(off, len)) in segs.iter().enumerate() {
            let send = Op::Send {
                peer: partner,
                src: loc(cur, off),
                len,
            };
            hz.push(&mut prog, send, j, &[cur], &[], &[]);
            let recv = Op::Recv {
                peer: partner,
                dst: loc(t, off),
                reduce_with: Some(loc(cur, off)),
                len,
            };
            hz.push(&mut prog, recv, j, &[cur], &[t], &[]);
        }
        cur = t;
    }
    for (j, &(off, len)) in segs.iter().enumerate() {
        if cur != Buf::Output {
            let op = Op::Copy {
                src: loc(cur, off),
                dst: loc(Buf::Output, off),
                len,
            };
            hz.push(&mut prog, op, j, &[cur], &[Buf::Output], &[]);
        }
        finish_segment(&mut prog, &mut hz, p, fold.then(|| r - 1), (off, len, j));
    }
    prog
}

/// The rank folded out of a world that is not a power of two: it contributes its buffer (in
/// `base`) to `partner` and receives the result into `Output`, segment by segment (also the
/// fold of [`super::halving`]).
pub(super) fn fold_out(
    prog: &mut Program,
    hz: &mut Hazards,
    base: Buf,
    partner: usize,
    segs: &[(usize, usize, usize)],
) {
    for &(off, len, j) in segs {
        let op = Op::Send {
            peer: partner,
            src: Loc::new(base, off),
            len,
        };
        hz.push(prog, op, j, &[base], &[], &[]);
    }
    for &(off, len, j) in segs {
        let op = Op::Recv {
            peer: partner,
            dst: Loc::new(Buf::Output, off),
            reduce_with: None,
            len,
        };
        hz.push(prog, op, j, &[], &[Buf::Output], &[]);
    }
}

/// The end of segment `(off, len, j)` of `Output`, once its result is there: the division of
/// an average, then, for a rank that folded in `fold_back`, the result sent back to it.
fn finish_segment(
    prog: &mut Program,
    hz: &mut Hazards,
    p: &Params,
    fold_back: Option<usize>,
    (off, len, j): (usize, usize, usize),
) {
    if finalizes(p) {
        let op = Op::Finalize {
            loc: Loc::new(Buf::Output, off),
            len,
        };
        hz.push(prog, op, j, &[Buf::Output], &[Buf::Output], &[]);
    }
    if let Some(peer) = fold_back {
        let op = Op::Send {
            peer,
            src: Loc::new(Buf::Output, off),
            len,
        };
        hz.push(prog, op, j, &[Buf::Output], &[], &[]);
    }
}

/// Dissemination barrier of zero-length messages.
pub(crate) fn barrier(p: &Params) -> Program {
    let mut prog = Program::new();
    let (n, r) = (p.world, p.rank);
    let rounds = n.next_power_of_two().trailing_zeros() as usize;
    let nowhere = Loc::new(Buf::Output, 0);
    let mut recvs: Vec<OpId> = Vec::with_capacity(rounds);
    for k in 0..rounds {
        let d = 1usize << k;
        prog.push(
            Op::Send {
                peer: (r + d) % n,
                src: nowhere,
                len: 0,
            },
            &recvs,
        );
        let from = (r + n - d % n) % n;
        recvs.push(prog.push(
            Op::Recv {
                peer: from,
                dst: nowhere,
                reduce_with: None,
                len: 0,
            },
            &[],
        ));
    }
    prog
}
