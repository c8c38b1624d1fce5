//! Rooted gather and scatter: the root exchanges one block with every other rank directly, and
//! every other rank moves only its own block (`count` elements), never the whole buffer.
//!
//! Buffers: for gather, `Input` is `count` elements on every rank and the root's `Output` is
//! `world * count` (rank r's block at `r * count`; other ranks' `Output` is never touched); for
//! scatter, the root's `Input` is `world * count` and every rank's `Output` is `count`. The root
//! posts its receives (gather) or sends (scatter) to every peer at once: the links of all peers
//! work in parallel, and the root's link carries `(n - 1) * count` elements, the least any
//! schedule can. Out of place only.

use super::common::{at, copy_segments, segments};
use super::params::Params;
use super::program::{Buf, Loc, Op, Program};

/// Gather to `p.root`.
pub(crate) fn gather(p: &Params) -> Program {
    let (n, c, r, root) = (p.world, p.count, p.rank, p.root);
    let mut prog = Program::new();
    let input = Loc::new(Buf::Input, 0);
    if r != root {
        for (off, len) in segments(c, p.segment) {
            let op = Op::Send {
                peer: root,
                src: at(input, off),
                len,
            };
            prog.push(op, &[]);
        }
        return prog;
    }
    copy_segments(
        &mut prog,
        input,
        Loc::new(Buf::Output, r * c),
        c,
        p.segment,
        |_| None,
    );
    for peer in (1..n).map(|s| (root + s) % n) {
        for (off, len) in segments(c, p.segment) {
            let op = Op::Recv {
                peer,
                dst: Loc::new(Buf::Output, peer * c + off),
                reduce_with: None,
                len,
            };
            prog.push(op, &[]);
        }
    }
    prog
}

/// Scatter from `p.root`.
pub(crate) fn scatter(p: &Params) -> Program {
    let (n, c, r, root) = (p.world, p.count, p.rank, p.root);
    let mut prog = Program::new();
    let output = Loc::new(Buf::Output, 0);
    if r != root {
        for (off, len) in segments(c, p.segment) {
            let op = Op::Recv {
                peer: root,
                dst: at(output, off),
                reduce_with: None,
                len,
            };
            prog.push(op, &[]);
        }
        return prog;
    }
    copy_segments(
        &mut prog,
        Loc::new(Buf::Input, r * c),
        output,
        c,
        p.segment,
        |_| None,
    );
    for peer in (1..n).map(|s| (root + s) % n) {
        for (off, len) in segments(c, p.segment) {
            let op = Op::Send {
                peer,
                src: Loc::new(Buf::Input, peer * c + off),
                len,
            };
            prog.push(op, &[]);
        }
    }
    prog
}
