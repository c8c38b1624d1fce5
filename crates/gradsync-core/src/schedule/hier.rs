//! Hierarchical (two-level) schedules: rings inside each host and rings across hosts.
//!
//! The world of `n = H L` ranks is split into `H` hosts of `L = local_size` ranks each, host `h`
//! holding ranks `h L .. (h + 1) L` (see [`Params::local_size`]); rank `r` is local rank
//! `l = r mod L` of host `h = r / L`. Two kinds of rings connect them:
//!
//! - the **intra-host ring** of host `h`: its `L` ranks in local rank order;
//! - the **inter-host rings**: for each local rank `l`, the `H` ranks `{k L + l}` in host order.
//!   There are `L` of them, one per local rank, so every rank's own network path is used (one NIC
//!   per GPU, as on most multi-GPU hosts) and no single rank funnels the host's traffic.
//!
//! Both are the ring phases of [`super::ring`], with the same fixed reduction order per element,
//! so all ranks end with identical bits whatever the timing.
//!
//! # All-reduce
//!
//! The buffer is cut into `L` blocks ([`block_range`]):
//!
//! 1. a ring reduce-scatter inside each host leaves local rank `l` with block `l` reduced over its
//!    host;
//! 2. a ring all-reduce of block `l` across hosts, among the ranks of local rank `l` (block `l`
//!    cut into `H` sub-blocks), leaves every one of them with block `l` reduced over the world.
//!    For `ReduceOp::Avg` the owner of each sub-block divides it once, between the reduce-scatter
//!    and the all-gather of this ring;
//! 3. a ring all-gather inside each host spreads the `L` blocks to every local rank.
//!
//! Per rank, the intra-host phases move `2 (L - 1) / L * B` bytes and the inter-host ring only
//! `2 (H - 1) / H * B / L`, against `2 (n - 1) / n * B` over the slow links for a flat ring that
//! crosses hosts. Everything is pipelined per segment: a piece of block `l` enters the inter-host
//! ring as soon as the intra-host reduce-scatter has finished it, and leaves for the intra-host
//! all-gather as soon as the inter-host ring has.
//!
//! # All-gather
//!
//! 1. A ring all-gather across hosts among the ranks of local rank `l`: rank `k L + l`'s input
//!    reaches every rank of local rank `l`, at its place `(k L + l) * count` of `Output`;
//! 2. a ring all-gather inside each host, in which local rank `l`'s block is its column: the `H`
//!    slices `(k L + l) * count` for every host `k`, sent as separate pieces (they are not
//!    contiguous). Each piece leaves as soon as the inter-host ring has delivered it.
//!
//! # Reduce-scatter
//!
//! The mirror of the all-gather:
//!
//! 1. a ring reduce-scatter inside each host over the columns: local rank `l` ends with column
//!    `l` (the slices `(k L + l) * count` for every host `k`) reduced over its host, in scratch;
//! 2. a ring reduce-scatter across hosts among the ranks of local rank `l` over the `H` slices of
//!    that column: rank `h L + l` ends with slice `h L + l` reduced over the world, in `Output`.
//!
//! Scratch holds the column (`H * count` elements) and, for `L > 2`, two alternating slots of
//! partial sums of the intra-host phase (`2 H * count`).
//!
//! # Degenerate shapes
//!
//! With one host (`H = 1`) or one rank per host (`L = 1`) both levels collapse into one ring over
//! all ranks in rank order, and the schedules are exactly the flat ring's.

use super::common::{at, block_range, copy_segments, finalizes, segments};
use super::params::{Params, host_shape};
use super::program::{Buf, Loc, OpId, Program};
use super::ring::{AgLayout, RingPos, RsLayout, ag_phase, all_reduce_range, rs_phase, segmented};

/// Where a rank sits: local rank `l` of host `h`, in `hosts` hosts of `local` ranks.
#[derive(Clone, Copy, Debug)]
struct Topo {
    hosts: usize,
    local: usize,
    h: usize,
    l: usize,
}

impl Topo {
    fn new(p: &Params) -> Self {
        let (hosts, local) =
            host_shape(p.world, p.local_size).expect("build validates the host shape");
        Topo {
            hosts,
            local,
            h: p.rank / local,
            l: p.rank % local,
        }
    }

    /// Whether both levels have more than one rank (otherwise the flat ring is the schedule).
    fn two_level(&self) -> bool {
        self.hosts > 1 && self.local > 1
    }

    /// The ring of this rank's host, in local rank order.
    fn intra(&self) -> RingPos {
        let (base, n, l) = (self.h * self.local, self.local, self.l);
        RingPos {
            n,
            pos: l,
            right: base + (l + 1) % n,
            left: base + (l + n - 1) % n,
        }
    }

    /// The ring across hosts of the ranks with this rank's local rank, in host order.
    fn inter(&self) -> RingPos {
        let (n, h, l) = (self.hosts, self.h, self.l);
        RingPos {
            n,
            pos: h,
            right: (h + 1) % n * self.local + l,
            left: (h + n - 1) % n * self.local + l,
        }
    }

    /// The pieces of a column: the `hosts` slices of `count` elements, each cut into segments, at
    /// offsets `k * count + off` within the column.
    fn column_pieces(&self, count: usize, segment: usize) -> Vec<(usize, usize)> {
        (0..self.hosts)
            .flat_map(|k| segments(count, segment).map(move |(off, len)| (k * count + off, len)))
            .collect()
    }
}

/// The ops that last wrote the pieces of a region, to find what a later access to any range of
/// it must wait for.
struct Cover {
    /// `(start, end, op)`, sorted and disjoint.
    pieces: Vec<(usize, usize, OpId)>,
}

impl Cover {
    /// From `(start, len, op)` pieces.
    fn new(pieces: impl IntoIterator<Item = (usize, usize, OpId)>) -> Self {
        let mut pieces: Vec<(usize, usize, OpId)> = pieces
            .into_iter()
            .map(|(start, len, op)| (start, start + len, op))
            .collect();
        pieces.sort_unstable();
        Cover { pieces }
    }

    /// The ops that wrote any element of `start .. start + len`.
    fn deps(&self, start: usize, len: usize) -> Vec<OpId> {
        let end = start + len;
        let first = self.pieces.partition_point(|&(_, e, _)| e <= start);
        self.pieces[first..]
            .iter()
            .take_while(|&&(s, _, _)| s < end)
            .map(|&(_, _, op)| op)
            .collect()
    }
}

/// Hierarchical all-reduce: reduce-scatter inside the host, all-reduce across hosts, all-gather
/// inside the host.
pub(crate) fn all_reduce(p: &Params) -> Program {
    let t = Topo::new(p);
    if !t.two_level() {
        return super::ring::all_reduce(p);
    }
    let mut prog = Program::new();
    let (count, seg, local, l) = (p.count, p.segment, t.local, t.l);
    let src = if p.in_place { Buf::Output } else { Buf::Input };
    let start = |b: usize| block_range(count, local, b).start;
    let mine = block_range(count, local, l);
    let blocks = segmented((0..local).map(|b| block_range(count, local, b).len()), seg);
    let out = |b: usize, off: usize| Loc::new(Buf::Output, start(b) + off);

    // 1. Reduce-scatter inside the host: block l, reduced over the host, in `Output`.
    let rs = rs_phase(
        &mut prog,
        t.intra(),
        &blocks,
        &RsLayout {
            input: &|b, off| Loc::new(src, start(b) + off),
            input_deps: &|_, _, _| Vec::new(),
            partial: &|b, _s, off| out(b, off),
            final_loc: &|off| out(l, off),
            double_buffered: false,
            finalize: false,
        },
    );
    let reduced = Cover::new(
        blocks[l]
            .iter()
            .zip(&rs.last)
            .map(|(&(off, len), &op)| (off, len, op)),
    );

    // 2. All-reduce of block l across hosts, in place in `Output`.
    let done = all_reduce_range(
        &mut prog,
        t.inter(),
        Buf::Output,
        mine,
        seg,
        &|off, len| reduced.deps(off, len),
        finalizes(p),
    );
    let done = Cover::new(done);

    // 3. All-gather inside the host. Step t overwrites the block that step t of the
    // reduce-scatter sent, from `Output` in place or after step 0.
    let recv_deps = |step: usize, _b: usize, j: usize| -> Vec<OpId> {
        if p.in_place || step > 0 {
            rs.sends[step].get(j).copied().into_iter().collect()
        } else {
            Vec::new()
        }
    };
    ag_phase(
        &mut prog,
        t.intra(),
        &blocks,
        &AgLayout {
            loc: &out,
            first: &|_, off, len| (out(l, off), done.deps(off, len)),
            recv_deps: &recv_deps,
        },
    );
    prog
}

/// Hierarchical all-gather: all-gather across hosts among equal local ranks, then all-gather of
/// the columns inside the host.
pub(crate) fn all_gather(p: &Params) -> Program {
    let t = Topo::new(p);
    if !t.two_level() {
        return super::ring::all_gather(p);
    }
    let mut prog = Program::new();
    let (count, seg, local, h, l) = (p.count, p.segment, t.local, t.h, t.l);
    let own = Loc::new(Buf::Output, p.rank * count);
    let own_src = if p.in_place {
        own
    } else {
        copy_segments(&mut prog, Loc::new(Buf::Input, 0), own, count, seg, |_| {
            None
        });
        Loc::new(Buf::Input, 0)
    };
    // Slice `voff / count` of column `b`, at offset `voff % count`.
    let column = |b: usize, voff: usize| {
        let (k, off) = (voff / count, voff % count);
        Loc::new(Buf::Output, (k * local + b) * count + off)
    };

    // 1. All-gather across hosts: host k's block is slice k of column l.
    let inter_blocks = segmented((0..t.hosts).map(|_| count), seg);
    let recvs = ag_phase(
        &mut prog,
        t.inter(),
        &inter_blocks,
        &AgLayout {
            loc: &|k, off| column(l, k * count + off),
            first: &|_, off, _| (at(own_src, off), Vec::new()),
            recv_deps: &|_, _, _| Vec::new(),
        },
    )
    .recvs;
    let arrived = Cover::new(recvs.iter().flat_map(|(k, ids)| {
        inter_blocks[*k]
            .iter()
            .zip(ids)
            .map(move |(&(off, len), &op)| (k * count + off, len, op))
    }));

    // 2. All-gather of the columns inside the host; this rank's own slice is read where it was
    // at the start, the others once they have arrived.
    let pieces = t.column_pieces(count, seg);
    let blocks = vec![pieces; local];
    let first = |_j: usize, voff: usize, len: usize| {
        if voff / count == h {
            (at(own_src, voff % count), Vec::new())
        } else {
            (column(l, voff), arrived.deps(voff, len))
        }
    };
    ag_phase(
        &mut prog,
        t.intra(),
        &blocks,
        &AgLayout {
            loc: &column,
            first: &first,
            recv_deps: &|_, _, _| Vec::new(),
        },
    );
    prog
}

/// Hierarchical reduce-scatter: reduce-scatter of the columns inside the host, then
/// reduce-scatter of this rank's column across hosts among equal local ranks.
pub(crate) fn reduce_scatter(p: &Params) -> Program {
    let t = Topo::new(p);
    if !t.two_level() {
        return super::ring::reduce_scatter(p);
    }
    let mut prog = Program::new();
    let (count, seg, local, l) = (p.count, p.segment, t.local, t.l);
    let src = if p.in_place { Buf::Output } else { Buf::Input };
    let final_loc = Loc::new(Buf::Output, if p.in_place { p.rank * count } else { 0 });
    let hc = t.hosts * count;
    // Scratch: two slots of partial sums of the intra-host phase when it has more than one step,
    // then the reduced column.
    let col_base = if local > 2 { 2 * hc } else { 0 };
    prog.reserve_scratch(col_base + hc);

    // 1. Reduce-scatter of the columns inside the host: column l, reduced over the host, in
    // scratch.
    let pieces = t.column_pieces(count, seg);
    let blocks = vec![pieces; local];
    let rs = rs_phase(
        &mut prog,
        t.intra(),
        &blocks,
        &RsLayout {
            input: &|b, voff| {
                let (k, off) = (voff / count, voff % count);
                Loc::new(src, (k * local + b) * count + off)
            },
            input_deps: &|_, _, _| Vec::new(),
            partial: &|_b, s, voff| Loc::new(Buf::Scratch, (s % 2) * hc + voff),
            final_loc: &|voff| Loc::new(Buf::Scratch, col_base + voff),
            double_buffered: true,
            finalize: false,
        },
    );
    let reduced = Cover::new(
        blocks[l]
            .iter()
            .zip(&rs.last)
            .map(|(&(voff, len), &op)| (voff, len, op)),
    );

    // 2. Reduce-scatter of the column across hosts: host k's block is slice k, reduced in place
    // in scratch, the last step into `Output`.
    let slice = |k: usize, off: usize| Loc::new(Buf::Scratch, col_base + k * count + off);
    let inter_blocks = segmented((0..t.hosts).map(|_| count), seg);
    rs_phase(
        &mut prog,
        t.inter(),
        &inter_blocks,
        &RsLayout {
            input: &slice,
            input_deps: &|k, off, len| reduced.deps(k * count + off, len),
            partial: &|k, _s, off| slice(k, off),
            final_loc: &|off| at(final_loc, off),
            double_buffered: false,
            finalize: finalizes(p),
        },
    );
    prog
}
