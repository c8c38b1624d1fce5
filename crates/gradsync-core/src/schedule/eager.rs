//! The eager all-reduce of small buffers: every rank's whole buffer to every peer at once, then
//! one reduction in rank order.
//!
//! Rank `r`'s program, for `count` elements over `n > 1` ranks:
//!
//! 1. one `Post` of its contribution, where it is (`Input`, or `Output` in place): one message
//!    to every peer, or one posting on a shared-memory board that every peer reads; first, as
//!    it is what the peers wait for;
//! 2. `Copy` of its own contribution into scratch part `r` (`r * count ..`), beside the post;
//! 3. one copying `Recv` from every peer `p` into scratch part `p`, in the order
//!    `r + 1, r + 2, ..., r - 1` (mod n);
//! 4. a `ReduceParts` of the `n` scratch parts into `Output`, after the copy and every receive
//!    (and in place after the post, which reads what it overwrites):
//!    `out = ((part 0 op part 1) op part 2) ...`, the rank-order fold of `reduce_rank_order` in
//!    the engine;
//! 5. for `ReduceOp::Avg`, a `Finalize` of `Output`.
//!
//! Every rank reduces the same parts in the same order, so all ranks hold the same bits, and they
//! equal the rank-order reduction of the inputs whatever the timing (unlike the ring, whose order
//! of reduction differs from element to element). Two ranks need no order: their program is a
//! post and one receive that reduces on arrival (see `pair`).
//!
//! There is one message per pair of ranks whatever [`Params::segment`] says: the engine uses the
//! eager path only for buffers it can send in one message. The cost is one latency and
//! `(n - 1) * B` bytes out of every rank, which only pays for small buffers. Scratch holds every
//! rank's part: `n * count` elements. A world of one copies `Input` to `Output` (nothing in
//! place); a count of 0 is an empty program.

use super::common::{alone, finalizes};
use super::params::Params;
use super::program::{Buf, Loc, Op, OpId, Program};

/// The eager all-reduce of rank `p.rank`.
pub(crate) fn all_reduce(p: &Params) -> Program {
    let (n, r, count) = (p.world, p.rank, p.count);
    if n == 1 {
        return alone(p);
    }
    let mut prog = Program::new();
    if count == 0 {
        return prog;
    }
    if n == 2 {
        return pair(p);
    }
    prog.reserve_scratch(n * count);
    let part = |q: usize| Loc::new(Buf::Scratch, q * count);
    let src = Loc::new(if p.in_place { Buf::Output } else { Buf::Input }, 0);
    // The post reads the contribution where it is; the copy into this rank's part runs beside
    // it.
    let own = prog.push(
        Op::Copy {
            src,
            dst: part(r),
            len: count,
        },
        &[],
    );
    let post = prog.push(Op::Post { src, len: count }, &[]);
    let mut parts: Vec<OpId> = vec![own];
    for k in 1..n {
        let q = (r + k) % n;
        parts.push(prog.push(
            Op::Recv {
                peer: q,
                dst: part(q),
                reduce_with: None,
                len: count,
            },
            &[],
        ));
    }
    let out = Loc::new(Buf::Output, 0);
    if p.in_place {
        // The reduction overwrites what the post reads.
        parts.push(post);
    }
    let reduce = prog.push(
        Op::ReduceParts {
            src: part(0),
            dst: out,
            len: count,
        },
        &parts,
    );
    if finalizes(p) {
        prog.push(
            Op::Finalize {
                loc: out,
                len: count,
            },
            &[reduce],
        );
    }
    prog
}

/// The eager all-reduce of two ranks: the post, and one receive that reduces the peer's part
/// into the output on arrival (`out = mine op theirs`). With two parts the rank order does not
/// matter: every operator is commutative bit for bit (float NaNs come out canonical, `-0.0` is
/// below `+0.0`), so both ranks hold `part 0 op part 1`. No scratch, copy or separate
/// reduction. In place the receive overwrites what the post reads, so it waits for the post,
/// which is buffered (it completes once its data is copied out, see [`Op::Post`]).
fn pair(p: &Params) -> Program {
    let mut prog = Program::new();
    let count = p.count;
    let out = Loc::new(Buf::Output, 0);
    let src = if p.in_place {
        out
    } else {
        Loc::new(Buf::Input, 0)
    };
    let post = prog.push(Op::Post { src, len: count }, &[]);
    let deps: &[OpId] = if p.in_place { &[post] } else { &[] };
    let recv = prog.push(
        Op::Recv {
            peer: 1 - p.rank,
            dst: out,
            reduce_with: Some(src),
            len: count,
        },
        deps,
    );
    if finalizes(p) {
        prog.push(
            Op::Finalize {
                loc: out,
                len: count,
            },
            &[recv],
        );
    }
    prog
}
