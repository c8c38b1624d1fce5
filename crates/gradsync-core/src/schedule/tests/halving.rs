//! The shape of the recursive halving-doubling (Rabenseifner) all-reduce: `log2 p` messages per
//! phase and the fold of the ranks above the largest power of two, on every world up to 33.

use super::*;
use crate::schedule::common::block_range;
use crate::{Collective, ReduceOp};

fn params(rank: usize, world: usize, count: usize, segment: usize) -> Params {
    Params {
        coll: Collective::AllReduce,
        rank,
        world,
        count,
        root: 0,
        op: ReduceOp::Sum,
        segment,
        in_place: false,
        algorithm: Algorithm::Rabenseifner,
        local_size: 0,
    }
}

/// `(peer, elements)` of every send, or of every receive, of `prog`, in program order.
fn messages(prog: &Program, sends: bool) -> Vec<(usize, usize)> {
    prog.ops()
        .iter()
        .filter_map(|o| match *o {
            Op::Send { peer, len, .. } if sends => Some((peer, len)),
            Op::Recv { peer, len, .. } if !sends => Some((peer, len)),
            _ => None,
        })
        .collect()
}

/// The largest power of two `<= n`.
fn pow2_floor(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// With the buffer in one segment, every step is one message: a rank of the `p` (largest power of
/// two `<= n`) that run the exchange sends and receives `log2 p` messages in the halving phase, to
/// the partners at distance `p / 2, p / 4, ..., 1`, and `log2 p` in the doubling phase, at
/// distance `1, 2, ..., p / 2`. On other worlds the first `2 (n - p)` ranks fold in pairs: the
/// even one sends its whole buffer to the odd one in one message before the exchange and gets the
/// result back in one message after it. Every rank receives what the others hold, once.
#[test]
fn rabenseifner_sends_log2_p_messages_per_phase() {
    for n in 2..=33usize {
        let pow = pow2_floor(n);
        let (rem, steps) = (n - pow, pow.trailing_zeros() as usize);
        // Counts of at least one element per block, odd ones among them.
        for count in [pow, 2 * pow + 1, 8 * n + 3, 1001] {
            let mut total = 0;
            for r in 0..n {
                let prog = build(&params(r, n, count, usize::MAX)).unwrap();
                let (sent, got) = (messages(&prog, true), messages(&prog, false));
                let ctx = format!("n = {n}, count = {count}, rank {r}: sends {sent:?}");
                total += sent.len();
                if r < 2 * rem && r % 2 == 0 {
                    assert_eq!(sent, [(r + 1, count)], "{ctx}");
                    assert_eq!(got, [(r + 1, count)], "{ctx}");
                    continue;
                }
                let fold = r < 2 * rem;
                let v = if fold { r / 2 } else { r - rem };
                let real = |u: usize| if u < rem { 2 * u + 1 } else { u + rem };
                let halving = (0..steps).map(|i| real(v ^ (pow >> (i + 1))));
                let doubling = (0..steps).map(|i| real(v ^ (1 << i)));
                let want: Vec<usize> = halving.chain(doubling).collect();
                let peers = |m: &[(usize, usize)]| m.iter().map(|x| x.0).collect::<Vec<_>>();
                let folded = usize::from(fold);
                assert_eq!(sent.len(), 2 * steps + folded, "{ctx}");
                assert_eq!(got.len(), 2 * steps + folded, "{ctx}");
                assert_eq!(peers(&sent[..2 * steps]), want, "{ctx}");
                assert_eq!(peers(&got[folded..]), want, "{ctx}");
                if fold {
                    assert_eq!(sent[2 * steps], (r - 1, count), "{ctx}");
                    assert_eq!(got[0], (r - 1, count), "{ctx}");
                }
                // The halving phase sends every block but this rank's once (to be reduced
                // elsewhere), and the doubling phase receives each of them once (reduced).
                let own = block_range(count, pow, v).len();
                let elems = |m: &[(usize, usize)]| m.iter().map(|x| x.1).sum::<usize>();
                assert_eq!(elems(&sent[..steps]), count - own, "{ctx}");
                assert_eq!(elems(&got[folded + steps..]), count - own, "{ctx}");
            }
            assert_eq!(total, 2 * steps * pow + 2 * rem, "n = {n}, count = {count}");
        }
    }
}

/// With segments, a step is cut into messages of `segment` elements and one shorter last one,
/// whatever the blocks' sizes: at most one message per step that is not a full segment.
#[test]
fn rabenseifner_cuts_each_step_into_full_segments() {
    for n in 2..=17usize {
        let pow = pow2_floor(n);
        let (rem, steps) = (n - pow, pow.trailing_zeros() as usize);
        for (count, segment) in [(1001, 7), (8 * n + 3, 5), (10 * pow, 10), (3 * pow, 64)] {
            for r in 0..n {
                let prog = build(&params(r, n, count, segment)).unwrap();
                let sent = messages(&prog, true);
                let short = sent.iter().filter(|m| m.1 < segment).count();
                // A rank that folds out sends once; the others send in 2 log2 p steps, and the
                // ones they fold for send the result back.
                let runs = match r < 2 * rem {
                    true if r % 2 == 0 => 1,
                    fold => 2 * steps + usize::from(fold),
                };
                assert!(
                    short <= runs,
                    "n = {n}, count = {count}, segment = {segment}, rank {r}: {short} short \
                     messages in {sent:?}"
                );
            }
        }
    }
}

/// Across hosts a step's message starts with what its receiver passes on first: in halving step
/// `i` the half the partner gives away in step `i + 1`, in doubling step `i` the run the sender
/// sent in step `i - 1`. On one host every step goes in address order.
#[test]
fn rabenseifner_across_hosts_sends_first_what_the_receiver_passes_on_first() {
    let starts = |prog: &Program, peer: usize| -> Vec<usize> {
        prog.ops()
            .iter()
            .filter_map(|o| match *o {
                Op::Send { peer: p, src, .. } if p == peer => Some(src.start),
                _ => None,
            })
            .collect()
    };
    for n in [4usize, 8, 16] {
        let steps = n.trailing_zeros() as usize;
        let count = 64 * n + 5;
        let elems = |b: usize| block_range(count, n, b);
        for local_size in [0, 1, 2] {
            for v in 0..n {
                let p = Params {
                    local_size,
                    ..params(v, n, count, 8)
                };
                let prog = build(&p).unwrap();
                // Halving step i: the partner is v ^ d; doubling step i: v ^ 2^i. In a world
                // of a power of two each pair meets once per phase, so the sends to a partner
                // are the halving step's then the doubling step's.
                for i in 0..steps {
                    let d = n >> (i + 1);
                    let w = v ^ d;
                    let sent = starts(&prog, w);
                    let dbl_i = d.trailing_zeros() as usize;
                    // Elements this rank sends in halving step i: the run w keeps.
                    let lo = (v & !(2 * d - 1)) + if w & d == 0 { 0 } else { d };
                    let give = elems(lo).start..elems(lo + d - 1).end;
                    let halving_len = sent.iter().take_while(|s| give.contains(s)).count();
                    let (halving, doubling) = sent.split_at(halving_len);
                    assert!(!halving.is_empty(), "n {n} v {v} step {i}");
                    let first = halving[0];
                    if local_size == 0 || i + 1 == steps {
                        assert!(halving.is_sorted(), "n {n} v {v} step {i}: {halving:?}");
                    } else {
                        // w's own step i + 1 gives the half of `give` on w's other side.
                        let d2 = d / 2;
                        let b = if w & d2 == 0 { lo + d2 } else { lo };
                        let next = elems(b).start..elems(b + d2 - 1).end;
                        assert!(
                            next.contains(&first),
                            "n {n} v {v} step {i}: {first} not in {next:?}"
                        );
                    }
                    // Doubling step dbl_i with the same partner: the run v held after step
                    // dbl_i - 1 comes first.
                    let first = doubling[0];
                    if local_size == 0 || dbl_i == 0 {
                        assert!(doubling.is_sorted(), "n {n} v {v} doubling {dbl_i}");
                    } else {
                        let prev = v & !((1 << (dbl_i - 1)) - 1);
                        let run = elems(prev).start..elems(prev + (1 << (dbl_i - 1)) - 1).end;
                        assert!(
                            run.contains(&first),
                            "n {n} v {v} doubling {dbl_i}: {first} not in {run:?}"
                        );
                    }
                }
            }
        }
    }
}
