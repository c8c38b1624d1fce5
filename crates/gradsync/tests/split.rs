//! Split: new communicators out of an existing one, on the in-memory, TCP and shared-memory
//! transports, worlds 1 to 8.
//!
//! Every world splits its ranks in several ways (halves, odd and even, one color for all, some
//! ranks without a color, keys that reverse the order); every child runs all-reduces of every
//! dtype at odd counts, an all-gather and broadcasts, each checked against a naive computation
//! over the parent ranks of its members, so a child with the wrong members or the wrong order
//! fails. Over TCP and shared memory the rendezvous store is shut down before the first split:
//! the children can only have been formed over their parent. Also: the parent keeps working
//! between and after child operations, two children of one parent used alternately, a split of
//! a child, the members-only form while the other ranks talk among themselves, and the errors
//! (bad arguments, members that disagree, a rank that never calls).

use gradsync::{Communicator, Config, Error, ReduceOp, TransportMode};
use gradsync_store::StoreServer;
use half::{bf16, f16};
use std::fmt::Debug;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Mem,
    Tcp,
    Shm,
    /// RDMA verbs between every pair: needs an active port (the Soft-RoCE VM of
    /// `scripts/rdma-check.sh`).
    #[cfg(feature = "rdma")]
    Rdma,
}

impl Kind {
    fn route(self) -> &'static str {
        match self {
            Kind::Mem => "mem",
            Kind::Tcp => "tcp",
            Kind::Shm => "shm",
            #[cfg(feature = "rdma")]
            Kind::Rdma => "rdma",
        }
    }
}

/// Runs `f` on every rank of a new world of `kind`, one thread per rank; returns the results
/// in rank order. Over TCP and shared memory every rank inits through a store that is shut
/// down once all of them are connected (an all-to-all connects every pair), before `f` runs.
fn run<R: Send + 'static>(
    kind: Kind,
    world: usize,
    timeout: Duration,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let mut base = Config::new("unused:0", 0, world);
    base.timeout = timeout;
    let handles: Vec<_> = match kind {
        Kind::Mem => Communicator::mem_group(world, &base)
            .unwrap()
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(c))
            })
            .collect(),
        _ => {
            let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let inited = Arc::new(Barrier::new(world + 1));
            let closed = Arc::new(Barrier::new(world + 1));
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let mut cfg = base.clone();
                    cfg.store_addr = server.local_addr().to_string();
                    cfg.host_store = false;
                    cfg.rank = rank;
                    cfg.transport = match kind {
                        Kind::Mem | Kind::Tcp => TransportMode::Tcp,
                        Kind::Shm => TransportMode::Shm,
                        #[cfg(feature = "rdma")]
                        Kind::Rdma => TransportMode::Rdma,
                    };
                    let (f, inited, closed) = (f.clone(), inited.clone(), closed.clone());
                    std::thread::spawn(move || {
                        let mut c = Communicator::init(cfg).unwrap();
                        // Every pair of the parent connects while the store is up: a rank
                        // reads the records of a rank it has not talked to from the store.
                        let ones = vec![1u8; world];
                        let mut got = vec![0u8; world];
                        c.all_to_all(&ones, &mut got).unwrap();
                        inited.wait();
                        closed.wait();
                        f(c)
                    })
                })
                .collect();
            inited.wait();
            drop(server);
            closed.wait();
            hs
        }
    };
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

trait Elem: gradsync::Element + Debug + Default {
    fn from_i64(v: i64) -> Self;
    fn bits(&self) -> u64;
}

macro_rules! elem {
    ($($t:ty: $from:expr, $bits:expr;)*) => {$(
        impl Elem for $t {
            fn from_i64(v: i64) -> Self {
                $from(v)
            }
            fn bits(&self) -> u64 {
                $bits(*self)
            }
        }
    )*};
}
elem! {
    f32: |v| v as f32, |x: f32| x.to_bits() as u64;
    f64: |v| v as f64, |x: f64| x.to_bits();
    f16: |v| f16::from_f32(v as f32), |x: f16| x.to_bits() as u64;
    bf16: |v| bf16::from_f32(v as f32), |x: bf16| x.to_bits() as u64;
    i32: |v| v as i32, |x: i32| x as u32 as u64;
    i64: |v| v, |x: i64| x as u64;
    u8: |v| v as u8, |x: u8| x as u64;
}

/// Element `i` of the input of parent rank `p` (sums over 8 ranks stay exact in every dtype).
fn val(p: usize, i: usize, salt: usize) -> i64 {
    ((i * 7 + p * 3 + salt) % 5 + 1) as i64
}

fn check<T: Elem>(what: &str, got: &[T], want: impl Fn(usize) -> i64) {
    for (i, g) in got.iter().enumerate() {
        let w = T::from_i64(want(i));
        assert!(
            g.bits() == w.bits(),
            "{what}: element {i} of {}: got {g:?}, want {w:?}",
            got.len()
        );
    }
}

/// All-reduces (odd counts), an all-gather and a broadcast of `T` on `c`, whose ranks are the
/// parent ranks `members`, checked against a naive computation.
fn exercise<T: Elem>(c: &mut Communicator, members: &[usize], me: usize, tag: &str, salt: usize) {
    let n = members.len();
    let p = members[me];
    let ctx = |what: &str| format!("{tag}: parent rank {p} (rank {me} of {n}) {what}");
    for count in [1, 3, 1000, 10007] {
        let mut buf: Vec<T> = (0..count).map(|i| T::from_i64(val(p, i, salt))).collect();
        c.all_reduce(&mut buf, ReduceOp::Sum)
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_reduce")));
        check(&ctx(&format!("all_reduce count {count}")), &buf, |i| {
            members.iter().map(|&q| val(q, i, salt)).sum()
        });
    }
    let count = 3;
    let input: Vec<T> = (0..count).map(|i| T::from_i64(val(p, i, salt))).collect();
    let mut out = vec![T::default(); count * n];
    c.all_gather(&input, &mut out)
        .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_gather")));
    check(&ctx("all_gather"), &out, |k| {
        val(members[k / count], k % count, salt)
    });
    let root = n - 1;
    let mut buf: Vec<T> = (0..1000).map(|i| T::from_i64(val(p, i, salt))).collect();
    c.broadcast(&mut buf, root)
        .unwrap_or_else(|e| panic!("{}: {e}", ctx("broadcast")));
    check(&ctx(&format!("broadcast from {root}")), &buf, |i| {
        val(members[root], i, salt)
    });
}

fn exercise_all(c: &mut Communicator, members: &[usize], me: usize, tag: &str) {
    exercise::<f32>(c, members, me, tag, 0);
    exercise::<f64>(c, members, me, tag, 1);
    exercise::<f16>(c, members, me, tag, 2);
    exercise::<bf16>(c, members, me, tag, 3);
    exercise::<i32>(c, members, me, tag, 4);
    exercise::<i64>(c, members, me, tag, 0);
    exercise::<u8>(c, members, me, tag, 1);
}

/// Every rank's (color, key).
type Coloring = Vec<(Option<u32>, i64)>;

/// The ways a world is split, with their names.
fn colorings(world: usize) -> Vec<(&'static str, Coloring)> {
    let w = world as i64;
    vec![
        (
            "halves",
            (0..world)
                .map(|r| (Some((2 * r / world) as u32), 0))
                .collect(),
        ),
        (
            "odd/even",
            (0..world).map(|r| (Some(r as u32 % 2), r as i64)).collect(),
        ),
        ("one color", (0..world).map(|_| (Some(7), 0)).collect()),
        (
            "some without color",
            (0..world)
                .map(|r| (if r % 3 == 1 { None } else { Some(r as u32 % 2) }, 5))
                .collect(),
        ),
        (
            "keys reverse the order",
            (0..world).map(|r| (Some(3), w - r as i64)).collect(),
        ),
        (
            "keys tie, then by rank",
            (0..world).map(|r| (Some(0), -((r / 2) as i64))).collect(),
        ),
    ]
}

/// The members of the child of `rank` under `how`, in their order (naive).
fn members_of(how: &[(Option<u32>, i64)], rank: usize) -> Option<Vec<usize>> {
    let color = how[rank].0?;
    let mut m: Vec<(i64, usize)> = how
        .iter()
        .enumerate()
        .filter(|(_, ck)| ck.0 == Some(color))
        .map(|(r, ck)| (ck.1, r))
        .collect();
    m.sort();
    Some(m.into_iter().map(|(_, r)| r).collect())
}

fn parent_all_reduce(c: &mut Communicator, tag: &str) {
    let (r, w) = (c.rank(), c.world_size());
    let mut buf: Vec<i64> = (0..37).map(|i| (i * (r + 1)) as i64).collect();
    c.all_reduce(&mut buf, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("{tag}: parent all_reduce on rank {r}: {e}"));
    let tri = (w * (w + 1) / 2) as i64;
    assert!(
        buf.iter().enumerate().all(|(i, &v)| v == i as i64 * tri),
        "{tag}: parent all_reduce on rank {r}: {buf:?}"
    );
}

/// Every coloring of the world: split, check the child's shape and transport, exercise it,
/// and all-reduce on the parent between children.
fn suite(kind: Kind, world: usize) {
    if !available(kind) {
        return;
    }
    run(kind, world, Duration::from_secs(60), move |mut parent| {
        let rank = parent.rank();
        for (name, how) in colorings(world) {
            let tag = format!("{} world {world} {name}", kind.route());
            let (color, key) = how[rank];
            let child = parent
                .split(color, key)
                .unwrap_or_else(|e| panic!("{tag}: split on rank {rank}: {e}"));
            let want = members_of(&how, rank);
            let (Some(mut child), Some(members)) = (child, want.clone()) else {
                assert!(
                    want.is_none(),
                    "{tag}: rank {rank} got no communicator, want {want:?}"
                );
                parent_all_reduce(&mut parent, &tag);
                continue;
            };
            let me = members.iter().position(|&r| r == rank).unwrap();
            assert_eq!(
                (child.rank(), child.world_size()),
                (me, members.len()),
                "{tag}: rank {rank} in {members:?}"
            );
            for q in (0..members.len()).filter(|&q| q != me) {
                assert_eq!(child.peer_transport(q).name(), kind.route(), "{tag}");
            }
            assert_eq!(child.timeout(), parent.timeout(), "{tag}");
            assert_eq!(child.local_size(), members.len(), "{tag}: one host");
            exercise_all(&mut child, &members, me, &tag);
            parent_all_reduce(&mut parent, &tag);
            // The child still works after the parent's operation.
            exercise::<f32>(&mut child, &members, me, &tag, 2);
        }
        parent_all_reduce(&mut parent, "after every split");
    });
}

macro_rules! suites {
    ($($name:ident: $kind:ident $world:expr;)*) => {$(
        #[test]
        fn $name() {
            suite(Kind::$kind, $world);
        }
    )*};
}

suites! {
    mem_w1: Mem 1;
    mem_w2: Mem 2;
    mem_w3: Mem 3;
    mem_w4: Mem 4;
    mem_w5: Mem 5;
    mem_w6: Mem 6;
    mem_w7: Mem 7;
    mem_w8: Mem 8;
    tcp_w1: Tcp 1;
    tcp_w2: Tcp 2;
    tcp_w3: Tcp 3;
    tcp_w4: Tcp 4;
    tcp_w5: Tcp 5;
    tcp_w6: Tcp 6;
    tcp_w7: Tcp 7;
    tcp_w8: Tcp 8;
    shm_w1: Shm 1;
    shm_w2: Shm 2;
    shm_w3: Shm 3;
    shm_w4: Shm 4;
    shm_w5: Shm 5;
    shm_w6: Shm 6;
    shm_w7: Shm 7;
    shm_w8: Shm 8;
}

/// Whether `kind` can run here; says why not when it cannot.
fn available(kind: Kind) -> bool {
    #[cfg(feature = "rdma")]
    if kind == Kind::Rdma && !gradsync_transport::rdma::active_port_present() {
        eprintln!(
            "skipped: no active RDMA port on this machine (scripts/rdma-check.sh runs the rdma suites under Soft-RoCE)"
        );
        return false;
    }
    let _ = kind;
    true
}

#[cfg(feature = "rdma")]
suites! {
    rdma_w1: Rdma 1;
    rdma_w2: Rdma 2;
    rdma_w3: Rdma 3;
    rdma_w4: Rdma 4;
    rdma_w5: Rdma 5;
}

#[cfg(feature = "rdma")]
#[test]
fn rdma_siblings_and_nested() {
    siblings_and_nested(Kind::Rdma);
}

#[cfg(feature = "rdma")]
#[test]
fn rdma_members_only() {
    members_only(Kind::Rdma);
}

/// Two children of one parent (halves and odd/even) used alternately with the parent, then a
/// split of a child.
fn siblings_and_nested(kind: Kind) {
    let world = 6;
    if !available(kind) {
        return;
    }
    run(kind, world, Duration::from_secs(60), move |mut parent| {
        let rank = parent.rank();
        let halves: Vec<usize> = (0..world).filter(|r| r / 3 == rank / 3).collect();
        let parity: Vec<usize> = (0..world).filter(|r| r % 2 == rank % 2).collect();
        let mut a = parent.split(Some((rank / 3) as u32), 0).unwrap().unwrap();
        let mut b = parent
            .split(Some((rank % 2) as u32), rank as i64)
            .unwrap()
            .unwrap();
        let (ma, mb) = (
            halves.iter().position(|&r| r == rank).unwrap(),
            parity.iter().position(|&r| r == rank).unwrap(),
        );
        for round in 0..3 {
            let tag = format!("{} round {round}", kind.route());
            exercise::<f32>(&mut a, &halves, ma, &format!("{tag} halves"), round);
            exercise::<i32>(&mut b, &parity, mb, &format!("{tag} parity"), round);
            parent_all_reduce(&mut parent, &tag);
            exercise::<u8>(&mut b, &parity, mb, &format!("{tag} parity"), round + 1);
            exercise::<f64>(&mut a, &halves, ma, &format!("{tag} halves"), round + 1);
        }
        // Split the halves again by their rank in the half (0 and 2 together, 1 alone), with
        // keys that reverse the order.
        let sub = a.split(Some(ma as u32 % 2), -(ma as i64)).unwrap().unwrap();
        let mut sub_members: Vec<usize> = (0..halves.len())
            .filter(|q| q % 2 == ma % 2)
            .map(|q| halves[q])
            .collect();
        sub_members.reverse();
        let me = sub_members.iter().position(|&r| r == rank).unwrap();
        assert_eq!((sub.rank(), sub.world_size()), (me, sub_members.len()));
        let mut sub = sub;
        exercise_all(
            &mut sub,
            &sub_members,
            me,
            &format!("{} nested", kind.route()),
        );
        exercise::<f32>(&mut a, &halves, ma, "halves after the nested split", 4);
        parent_all_reduce(&mut parent, "after the nested split");
    });
}

#[test]
fn mem_siblings_and_nested() {
    siblings_and_nested(Kind::Mem);
}

#[test]
fn tcp_siblings_and_nested() {
    siblings_and_nested(Kind::Tcp);
}

#[test]
fn shm_siblings_and_nested() {
    siblings_and_nested(Kind::Shm);
}

/// `split_ranks` by the members alone (ranks 3 and 1 of 5, in that order, and then 0, 2 and 4)
/// while the others exchange messages among themselves on the parent; then everyone meets on
/// the parent again.
fn members_only(kind: Kind) {
    let world = 5;
    if !available(kind) {
        return;
    }
    run(kind, world, Duration::from_secs(60), move |mut parent| {
        let rank = parent.rank();
        let pair = [3, 1];
        let rest = [0, 2, 4];
        let tag = format!("{} split_ranks", kind.route());
        if pair.contains(&rank) {
            let me = pair.iter().position(|&r| r == rank).unwrap();
            let mut c = parent.split_ranks(&pair).unwrap();
            assert_eq!((c.rank(), c.world_size()), (me, 2));
            exercise_all(&mut c, &pair, me, &tag);
        } else {
            // The others talk among themselves meanwhile, over the same parent.
            let next = rest[(rest.iter().position(|&r| r == rank).unwrap() + 1) % 3];
            let prev = rest[(rest.iter().position(|&r| r == rank).unwrap() + 2) % 3];
            let mut got = [0i64; 5];
            if rank == 0 {
                parent.send(&[rank as i64; 5], next).unwrap();
                parent.recv(&mut got, prev).unwrap();
            } else {
                parent.recv(&mut got, prev).unwrap();
                parent.send(&[rank as i64; 5], next).unwrap();
            }
            assert_eq!(got, [prev as i64; 5], "{tag}");
            let me = rest.iter().position(|&r| r == rank).unwrap();
            let mut c = parent.split_ranks(&rest).unwrap();
            assert_eq!((c.rank(), c.world_size()), (me, 3));
            exercise::<f32>(&mut c, &rest, me, &tag, 0);
            exercise::<i64>(&mut c, &rest, me, &tag, 1);
        }
        parent_all_reduce(&mut parent, &tag);
    });
}

#[test]
fn mem_members_only() {
    members_only(Kind::Mem);
}

#[test]
fn tcp_members_only() {
    members_only(Kind::Tcp);
}

#[test]
fn shm_members_only() {
    members_only(Kind::Shm);
}

#[test]
fn bad_arguments_fail_at_once_and_leave_the_parent_usable() {
    run(Kind::Mem, 3, Duration::from_secs(20), |mut c| {
        let rank = c.rank();
        for (ranks, says) in [
            (vec![0, 3], "rank 3 of [0, 3] is not a rank of a world of 3"),
            (vec![0, 1, 2, 1], "rank 1 appears twice"),
            (vec![], "is not among []"),
        ] {
            let t = Instant::now();
            match c.split_ranks(&ranks) {
                Err(
                    e @ Error::InvalidArgument {
                        op: "split_ranks", ..
                    },
                ) => {
                    assert!(e.to_string().contains(says), "rank {rank}: {e}")
                }
                other => panic!("rank {rank}: split_ranks({ranks:?}): {other:?}"),
            }
            assert!(t.elapsed() < Duration::from_secs(1));
        }
        let others: Vec<usize> = (0..3).filter(|&r| r != rank).collect();
        let e = c.split_ranks(&others).unwrap_err();
        assert!(e.to_string().contains("only the members call it"), "{e}");
        parent_all_reduce(&mut c, "after bad arguments");
    });
}

/// Members whose lists differ (same first rank) all fail with an error naming both lists; the
/// parent stays usable.
#[test]
fn members_that_disagree_all_fail() {
    for kind in [Kind::Mem, Kind::Tcp] {
        run(kind, 3, Duration::from_secs(20), move |mut c| {
            let rank = c.rank();
            let list = if rank == 1 {
                vec![0, 2, 1]
            } else {
                vec![0, 1, 2]
            };
            let e = c.split_ranks(&list).unwrap_err();
            let msg = e.to_string();
            assert!(
                matches!(
                    e,
                    Error::Split {
                        op: "split_ranks",
                        ..
                    }
                ) && msg.contains("forms it of ranks")
                    && msg.contains("[0, 2, 1]")
                    && msg.contains("[0, 1, 2]"),
                "rank {rank}: {msg}"
            );
            parent_all_reduce(&mut c, "after a disagreement");
        });
    }
}

/// A rank that never calls: the others fail within the deadline, naming the call and the
/// rank they wait on.
fn never_calls(kind: Kind, members_only: bool) {
    let timeout = Duration::from_secs(3);
    let out = run(kind, 3, timeout, move |mut c| {
        let rank = c.rank();
        if rank == 2 {
            // Stays away until the others have given up.
            std::thread::sleep(timeout + Duration::from_secs(3));
            return None;
        }
        let t = Instant::now();
        let e = if members_only {
            c.split_ranks(&[0, 1, 2]).map(|_| ()).unwrap_err()
        } else {
            c.split(Some(0), 0).map(|_| ()).unwrap_err()
        };
        Some((rank, t.elapsed(), e.to_string()))
    });
    let op = if members_only { "split_ranks" } else { "split" };
    for (rank, took, msg) in out.into_iter().flatten() {
        assert!(
            msg.contains(&format!("rank {rank}: {op}: ")) && msg.contains("timed out"),
            "{} rank {rank}: {msg}",
            kind.route()
        );
        assert!(
            took >= timeout - Duration::from_millis(100) && took < timeout + Duration::from_secs(2),
            "rank {rank}: failed after {took:?} ({msg})"
        );
        if rank == 0 {
            // Rank 0 waits on rank 2 itself.
            assert!(msg.contains("rank 2"), "rank 0: {msg}");
        }
        if members_only && rank == 0 {
            assert!(msg.contains("(parent rank 2)"), "rank 0: {msg}");
        }
    }
}

#[test]
fn mem_split_times_out_when_a_rank_never_calls() {
    never_calls(Kind::Mem, false);
}

#[test]
fn tcp_split_times_out_when_a_rank_never_calls() {
    never_calls(Kind::Tcp, false);
}

#[test]
fn mem_split_ranks_times_out_when_a_member_never_calls() {
    never_calls(Kind::Mem, true);
}

#[test]
fn shm_split_ranks_times_out_when_a_member_never_calls() {
    never_calls(Kind::Shm, true);
}
