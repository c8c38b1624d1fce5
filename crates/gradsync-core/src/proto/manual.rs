//! The protocol, end to end: how a rank's messages reach its peers.
//!
//! This page is documentation only. The rules it describes live in [`Protocol`] (and its
//! modules), the bytes in [`crate::wire`], the transports' side in `gradsync-transport`.
//!
//! # Layers
//!
//! A collective call becomes a [`Program`] (see [`crate::schedule`]): sends, receives, posts
//! and local ops with dependencies. The [`Schedule`] hands out the ops that may start. The
//! protocol machine turns the sends and receives into traffic, in one of two modes
//! ([`Mode`]): through *slots* (every algorithm) or *eagerly* (the small all-reduce). A driver
//! carries the machine's [`Action`]s out with a transport that speaks a subset of RDMA verbs:
//! one-sided writes with an immediate value, small two-sided messages, completions, and on
//! shared memory a *board*.
//!
//! # The inbox and its slots
//!
//! Every rank registers one *inbox* region at init and publishes its descriptor (key, length,
//! address) with its slot settings ([`crate::wire::settings`]) through the rendezvous store;
//! all ranks must have the same settings. The inbox holds, for every sender, `nslots` slots of
//! [`Config::stride`] bytes: a 64-byte [`DataHeader`] and up to `slot_bytes` of payload. Rank
//! `s`'s slot `k` in a receiver's inbox lies at `(s * nslots + k) * stride`.
//!
//! A message is one write with immediate into a slot: a gather list of the header (staged by
//! the sender, one staging area per peer and slot) and the payload straight from the caller's
//! buffer. No other copy is made on the sender; over TCP the receiver's transport reads the
//! payload straight into the slot, over shared memory the sender copies it into a mapping of
//! the receiver's inbox, over RDMA the adapter writes it there.
//!
//! # Credits, window, counters
//!
//! A pair uses `window` of its `nslots` slots (fewer over TCP, where fewer messages in flight
//! keep the socket queues short); both ranks of the pair use the same window. The sender holds
//! `window` *credits* for the pair: a slot write spends one, and it writes only while it has a
//! credit and the slot's staged header is free again (its previous write done). Message `k` of
//! the pair — counted over every operation — goes to slot `k % window`; the write's immediate
//! is `k`'s low 31 bits (the top bit marks a direct write, below).
//!
//! The receiver learns of an arrival from the write's completion. The immediate's distance
//! from the next counter it expects gives the full counter, once it lies within the window:
//! a notification outside it, for a slot still full, or longer than a slot, is a
//! [`Violation::UnknownSlot`]. Arrivals are consumed in counter order, whatever stream or
//! queue pair they came on, so the k-th send to a peer meets the peer's k-th receive, as the
//! schedules require. The receiver parses the header as the message lands and checks it
//! against the receive that takes it: the call's full signature, the message index within the
//! call, the payload length and the sender; any difference is a mismatch naming both calls.
//! With checksums on (`GRADSYNC_CHECKSUM=1`) the header carries the payload's CRC32C and the
//! driver verifies it before anything is copied or reduced.
//!
//! Consuming a slot (copying or reducing its payload into place) frees it. The receiver hands
//! freed slots back in one *credit* message once half the window is free, so the sender
//! always keeps one; and after [`IDLE_CREDIT_RETURN`] without progress it returns all of them,
//! in case the peer is the one waiting. Credits beyond the window are a
//! [`Violation::TooManyCredits`].
//!
//! # Clear-to-send: writing straight into place
//!
//! A receive that copies (no reduction) at least `direct_min` bytes — set per peer from what
//! the transport can do: shared memory from a threshold, TCP at its own threshold, never over
//! RDMA, whose caller buffers are not pinned — sends a *clear-to-send* as it is issued: the
//! region's key, the offset and the length, with the receiver's signature. The sender checks
//! the signature and length, and writes that message straight into the receiver's buffer with
//! the immediate's top bit set and the message index in the rest: no slot, credit or copy out.
//! A sender without the offer (it sent already) uses a slot, which the receiver accepts for a
//! direct receive too. A direct write nobody offered is a [`Violation::UnsolicitedDirect`]. With
//! checksums on there are no direct writes (they carry no header).
//!
//! In the collectives whose every receive copies (all-to-all(v) and all-gather: no receive
//! reduces) the sender knows the receiver's rule — the pair's threshold for them, set alike on
//! both ranks, which holds for calls whose block (what the pair moves one way, from the
//! signature's count; an all-to-allv's count as large) is at least the pair's block threshold,
//! smaller blocks following `direct_min` — so a message of at least that size *waits* for its
//! offer instead of taking a slot: every byte is copied once, by the sender, into place. The
//! wait is bounded: once nothing has moved for [`OFFER_PATIENCE`](super::OFFER_PATIENCE) (a
//! receiver configured otherwise, which never offers), the operation's waiting sends go
//! through slots.
//!
//! A pass posts at most one direct write of at least [`PACE_MIN`](super::PACE_MIN) bytes to each
//! peer; the next one waits for the next round, after the driver has polled. Over shared memory
//! the write is done when its post returns, so its completion arrives in that poll, and the
//! local op that waited for it (the copy of the rank's own piece, which reads the same input)
//! runs before the next write, while that input is still in the cache.
//!
//! # Pooled pairs: receive memory beyond the budget
//!
//! A pair may have no slots at all ([`Protocol::set_pooled`] on both ranks; the driver pools
//! the pairs past its receive budget). Its window and credits are 0, and every message goes
//! where the receiver's clear-to-send says:
//!
//! - a receive that copies goes straight into place, unasked, as above, where the pair takes
//!   direct writes (the same rule on both ranks, from the pair's thresholds);
//! - any other (a reduction, an empty message, a copy without direct writes) is staged in a
//!   slot of the receiver's shared *pool* ([`Protocol::set_pool`]). The sender first sends a
//!   *ready-to-send* (message index, sequence number, whether a send/recv) for the message at
//!   the front of its queue to that peer, one at a time. The receiver grants a free pool slot
//!   to a receive its schedule has issued and whose sender is ready, in issue order, and names
//!   the slot (region key, offset or address, length) in a clear-to-send. The sender writes the
//!   payload there (no header; the immediate as for a direct write), and the receiver delivers
//!   it ([`Action::DeliverPooled`](super::Action::DeliverPooled)) and frees the slot.
//!
//! Because a slot goes only to a message that is ready, whose receive is issued and which is
//! next in its pair's order, a granted slot is written and freed without waiting for anything
//! else: a pool of one slot cannot deadlock (the simulator runs every program with pools of
//! 1 and 2). The price is a round trip per staged message, and one such message in flight per
//! pair. A ready-to-send on a pair that is not pooled here is a [`Violation::NotPooled`]; a
//! staged receive larger than a slot, a [`Violation::PoolOverflow`]. With checksums on a pair
//! cannot be pooled.
//!
//! # Eager all-reduces and the board
//!
//! An all-reduce of a few KiB (at most [`crate::schedule::Algorithm::Eager`]'s limit in the
//! engine, and at most 16 ranks) runs the *eager* program: every rank makes its whole buffer
//! available to every peer, receives every peer's, and reduces all of them in rank order
//! (`ReduceParts`), so all ranks compute the same bits in one message latency. Its messages
//! are whole two-sided messages — a data header and the payload — with no slot, credit or
//! clear-to-send. A rank may receive a peer's eager message before it reaches the call: a few
//! ([`EAGER_AHEAD_MAX`]) are kept; one for a call this rank has finished is
//! [`Violation::Late`].
//!
//! When every rank's transport has a *board* (all ranks on one host's shared memory, every
//! board large enough), a post is one posting on the poster's own board under the call's
//! sequence number instead of a message per peer, and every peer reads it from its mapping of
//! that memory: one copy in, one copy out per reader, no record, completion or wake-up per
//! peer. Postings alternate between two slots; a slot is rewritten only when every peer has
//! *released* the posting in it (the transport refuses the post until then, and the machine
//! tries again next round). A reader releases a call's postings when its next call starts,
//! just before that call's own posting, which carries the release to the peers. A
//! waiting rank's transport watches the call's postings, so a posting wakes a sleeping reader.
//! A posting's header carries sequence number 0 ([`DataHeader::set_seq`]), since the board
//! carries the number beside it: the header of a loop of equal calls is then the same bytes
//! at every call, which a board keeps on a cache line that the poster does not rewrite and
//! the readers keep in their caches. A reader writes the number back before it checks the
//! header ([`Protocol::handle_board_read`] and [`Protocol::fast_check`] take it).
//!
//! **The fast path.** A board all-reduce whose schedule the driver already knows (not the
//! first call of its shape) does not need the machine's rounds: the driver asks
//! [`Protocol::fast_begin`], releases what is due, puts its posting up, reads every peer's
//! posting for a short budget of spins (a few passes with a yield of the core between them when
//! the host's ranks do not have a core each), checks each one
//! ([`Protocol::fast_check`]: the same header checks as the eager path), reduces in rank order
//! and ends with [`Protocol::fast_end`]. No clock read, allocation or system call is on that
//! path, and the bytes are the eager path's, so a rank on the fast path and a rank on the
//! machine's work together. Whatever the fast path cannot finish at once — a refused posting,
//! a peer not there within the budget, a posting with a checksum — it hands to the machine,
//! which starts the operation as usual and takes the posting as made; the deadline, probes and
//! mismatches are then the machine's.
//!
//! Every rank must choose eager or scheduled alike. A rank that runs a call eagerly and finds
//! a slot message of the same call from a peer, or that runs it through slots and finds an
//! eager message or (looked for every [`BOARD_CHECK_EVERY`] while it waits) a board posting
//! of it, reports a mismatch that names the settings to align.
//!
//! # Timeouts, probes, aborts
//!
//! Every operation has a deadline. When it passes, the rank asks every live peer where it is
//! (a *probe*); each answers with the sequence number it runs or ran last and whether it is
//! inside it. The [`Verdict`] names the peers that did not answer (stopped, hung, or not
//! calling the library), the lost ones and the ones behind; since every rank that times out
//! asks everyone, all of them name the same culprit. A rank that fails sends an *abort* with
//! its error to every peer, which fails their operations with it.
//!
//! # The simulator
//!
//! [`super::sim`] runs the machines of up to 64 ranks over a simulated transport with seeded
//! reordering, slow peers and one-slot windows, and checks what a real transport cannot: a
//! write into a slot not yet consumed, a write with another operation's key, deadlock, and
//! results against the reference bit for bit.
//!
//! [`Protocol`]: super::Protocol
//! [`Protocol::fast_begin`]: super::Protocol::fast_begin
//! [`Protocol::fast_check`]: super::Protocol::fast_check
//! [`Protocol::fast_end`]: super::Protocol::fast_end
//! [`Protocol::handle_board_read`]: super::Protocol::handle_board_read
//! [`Program`]: crate::schedule::Program
//! [`Schedule`]: crate::schedule::Schedule
//! [`Mode`]: super::Mode
//! [`Action`]: super::Action
//! [`Config::stride`]: super::Config::stride
//! [`DataHeader`]: crate::wire::DataHeader
//! [`DataHeader::set_seq`]: crate::wire::DataHeader::set_seq
//! [`Violation::UnknownSlot`]: super::Violation::UnknownSlot
//! [`Violation::TooManyCredits`]: super::Violation::TooManyCredits
//! [`Violation::UnsolicitedDirect`]: super::Violation::UnsolicitedDirect
//! [`Violation::Late`]: super::Violation::Late
//! [`Violation::NotPooled`]: super::Violation::NotPooled
//! [`Violation::PoolOverflow`]: super::Violation::PoolOverflow
//! [`Protocol::set_pooled`]: super::Protocol::set_pooled
//! [`Protocol::set_pool`]: super::Protocol::set_pool
//! [`IDLE_CREDIT_RETURN`]: super::IDLE_CREDIT_RETURN
//! [`BOARD_CHECK_EVERY`]: super::BOARD_CHECK_EVERY
//! [`EAGER_AHEAD_MAX`]: super::EAGER_AHEAD_MAX
//! [`Verdict`]: super::Verdict
