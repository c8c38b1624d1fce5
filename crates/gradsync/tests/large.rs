//! Operations large enough (at least 8 MiB per rank) that the engine places results with
//! non-temporal stores, and all-to-alls whose blocks go as several messages smaller than a
//! slot (over shared memory), on the in-memory, TCP and shared-memory transports: every element
//! of every output is checked, over an output first filled with values no rank sends.

use gradsync::{Communicator, Config, ReduceOp, TransportMode};
use gradsync_store::StoreServer;
use gradsync_transport::shm::huge_kib_at;
use std::time::Duration;

/// Elements per rank: just over 8 MiB of `f32`, and not a multiple of a cache line.
const COUNT: usize = (8 << 20) / 4 + 5;

/// Distinct for every rank and, within a rank, for indices less than a prime near 2^20
/// apart; exact in `f32`.
fn val(rank: usize, i: usize) -> f32 {
    ((rank << 20) + (i * 13) % 1_048_573) as f32
}

/// Whether this kernel collapses a registered output into huge pages: transparent huge pages
/// not `never`, and `MADV_COLLAPSE` (Linux 6.1).
fn kernel_collapses() -> bool {
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
    let rel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = rel.split(['.', '-']).map(|x| x.parse::<u32>().unwrap_or(0));
    let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    thp.is_ok_and(|s| !s.contains("[never]")) && (major, minor) >= (6, 1)
}

/// `huge`: the transport collapses outputs that peers wrote by cross-memory attach, used
/// again, into huge pages (shared memory with direct writes).
fn run_rank(mut c: Communicator, huge: bool) {
    let (r, w) = (c.rank(), c.world_size());
    let input: Vec<f32> = (0..COUNT).map(|i| val(r, i)).collect();
    let mut out = vec![f32::NAN; COUNT * w];
    // The second and third rounds write into the output the first registered: on shared
    // memory, where the first round's writes went straight into it, collapsed into huge pages
    // at the second (every element is checked after each).
    for round in 0..3 {
        c.all_gather(&input, &mut out).unwrap();
        if huge && round > 0 && kernel_collapses() {
            let kib = huge_kib_at(out.as_ptr() as usize).expect("the output's mapping");
            assert!(
                kib >= 2048,
                "rank {r}, round {round}: {kib} KiB of huge pages"
            );
        }
        for (j, x) in out.iter().enumerate() {
            let want = val(j / COUNT, j % COUNT);
            assert_eq!(
                x.to_bits(),
                want.to_bits(),
                "rank {r} of {w}, round {round}: all_gather element {j}"
            );
        }
        out.fill(-1.0);
    }
    // Blocks of 8 MiB (a local copy with non-temporal stores), and of about 1 MiB (with a
    // remainder): over shared memory the large ones written straight into place, a slot's
    // size at a time, and the small ones split into messages of a quarter of a block through
    // the slots (written in place too where the block threshold is 0).
    for block in [COUNT, (1 << 18) + 3] {
        let input: Vec<f32> = (0..block * w).map(|k| val(r, k)).collect();
        let mut out = vec![f32::NAN; block * w];
        c.all_to_all(&input, &mut out).unwrap();
        for (k, x) in out.iter().enumerate() {
            let (src, j) = (k / block, k % block);
            let want = val(src, r * block + j);
            assert_eq!(
                x.to_bits(),
                want.to_bits(),
                "rank {r} of {w}: all_to_all of {block}-element blocks, element {k}"
            );
        }
    }
    let mut sum = vec![f32::NAN; COUNT];
    for round in 0..3 {
        c.all_reduce_into(&input, &mut sum, ReduceOp::Sum).unwrap();
        for (i, x) in sum.iter().enumerate() {
            let want: f32 = (0..w).map(|q| val(q, i)).sum();
            assert_eq!(
                *x, want,
                "rank {r} of {w}, round {round}: all_reduce element {i}"
            );
        }
    }
}

fn run(world: usize, transport: Option<TransportMode>) {
    run_with(world, transport, |_| {});
}

fn run_with(world: usize, transport: Option<TransportMode>, tweak: impl Fn(&mut Config)) {
    let mut base = Config::new("unused:0", 0, 1);
    tweak(&mut base);
    base.timeout = Duration::from_secs(120);
    let Some(transport) = transport else {
        let comms = Communicator::mem_group(world, &base).unwrap();
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| std::thread::spawn(move || run_rank(c, false)))
            .collect();
        for h in hs {
            h.join().expect("rank thread panicked");
        }
        return;
    };
    // Outputs that peers write by cross-memory attach (direct writes on) get huge pages.
    let huge = transport == TransportMode::Shm
        && base.shm_huge_pages
        && base.shm_move_direct_min < usize::MAX;
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr().to_string();
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let mut cfg = base.clone();
            cfg.store_addr = addr.clone();
            cfg.host_store = false;
            cfg.rank = rank;
            cfg.world = world;
            cfg.transport = transport;
            std::thread::spawn(move || run_rank(Communicator::init(cfg).unwrap(), huge))
        })
        .collect();
    for h in hs {
        h.join().expect("rank thread panicked");
    }
}

#[test]
fn large_mem_w1() {
    run(1, None);
}

#[test]
fn large_mem_w3() {
    run(3, None);
}

#[test]
fn large_shm_w2() {
    run(2, Some(TransportMode::Shm));
}

#[test]
fn large_shm_w3() {
    run(3, Some(TransportMode::Shm));
}

/// Shared memory with direct writes off: all-to-all and all-gather messages go through the
/// inbox slots, the all-to-all's blocks split in four.
#[test]
fn large_shm_w3_through_slots() {
    run_with(3, Some(TransportMode::Shm), |c| {
        c.shm_direct_min = usize::MAX;
        c.shm_move_direct_min = usize::MAX;
    });
}

/// Shared memory with direct writes for blocks of every size: the 1 MiB blocks of the
/// all-to-all go straight into place too, a block a message.
#[test]
fn large_shm_w3_small_blocks_direct() {
    run_with(3, Some(TransportMode::Shm), |c| c.shm_move_block_min = 0);
}

/// Huge pages off: the outputs keep their pages, results as above.
#[test]
fn large_shm_w2_without_huge_pages() {
    run_with(2, Some(TransportMode::Shm), |c| c.shm_huge_pages = false);
}

#[test]
fn large_tcp_w2() {
    run(2, Some(TransportMode::Tcp));
}
