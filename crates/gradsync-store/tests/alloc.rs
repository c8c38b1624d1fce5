//! Announced lengths do not drive allocations: a peer that claims a huge frame gets an error
//! (over the limit) or a buffer that grows only with the bytes it really sends (within it).
//!
//! The test binary counts allocations with a wrapper around the system allocator, so this file
//! holds a single test: nothing else allocates while it measures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::Duration;

use gradsync_store::wire::{Frame, Kind, MAGIC, MAX_BODY_LEN, Repr, VERSION};
use gradsync_store::{StoreClient, StoreError, StoreServer, WireError};

/// The system allocator, recording the largest single request while armed.
struct PeakAlloc;

static ARMED: AtomicBool = AtomicBool::new(false);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn record(size: usize) {
    if ARMED.load(Ordering::Relaxed) {
        PEAK.fetch_max(size, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// `GlobalAlloc` contract is the system allocator's; recording a size has no effect on memory.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: forwarded as is; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is; `ptr` came from `System` through this wrapper.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        // SAFETY: forwarded as is; `ptr` came from `System` through this wrapper.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: PeakAlloc = PeakAlloc;

fn header(kind: Kind, body_len: u32) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&[VERSION, kind as u8, 0, 0]);
    h.extend_from_slice(&body_len.to_le_bytes());
    h
}

/// Largest single allocation allowed while a peer announces gigabytes: the 1 MiB read step
/// plus room for ordinary bookkeeping.
const BOUND: usize = 2 << 20;

#[test]
fn announced_lengths_do_not_allocate() {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr().to_string();
    let mut good = StoreClient::connect(&addr, Duration::from_secs(10)).unwrap();
    good.set("warm", b"up").unwrap();

    PEAK.store(0, Ordering::Relaxed);
    ARMED.store(true, Ordering::Relaxed);

    // 1. Over the limit: refused from the header with an error reply, then closed.
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    raw.write_all(&header(Kind::Set, u32::MAX)).unwrap();
    let mut reply = Vec::new();
    raw.read_to_end(&mut reply).unwrap();
    let frame = Frame::new_checked(&reply[..]).unwrap();
    assert!(
        matches!(Repr::parse(&frame), Ok(Repr::Error { message }) if message.contains("exceeds the limit"))
    );

    // 2. Within the limit (65 MiB announced) but only 100 bytes sent: the server's buffer
    //    follows the bytes, not the announcement.
    let mut slow = TcpStream::connect(&addr).unwrap();
    slow.write_all(&header(Kind::Set, MAX_BODY_LEN as u32))
        .unwrap();
    slow.write_all(&[0u8; 100]).unwrap();
    thread::sleep(Duration::from_millis(300));
    drop(slow);

    // 3. The client side: a server announcing a 4 GiB reply.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_addr = listener.local_addr().unwrap().to_string();
    let fake = thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut request = [0u8; 17];
        stream.read_exact(&mut request).unwrap();
        stream.write_all(&header(Kind::Value, u32::MAX)).unwrap();
        thread::sleep(Duration::from_millis(200));
    });
    let mut victim = StoreClient::connect(&fake_addr, Duration::from_secs(10)).unwrap();
    let err = victim.get("a").unwrap_err();
    assert!(matches!(
        err,
        StoreError::Protocol {
            source: WireError::BodyTooLong { .. },
            ..
        }
    ));
    fake.join().unwrap();

    // The good client was not disturbed.
    assert_eq!(good.get("warm").unwrap().as_deref(), Some(&b"up"[..]));

    ARMED.store(false, Ordering::Relaxed);
    let peak = PEAK.load(Ordering::Relaxed);
    assert!(peak <= BOUND, "largest allocation was {peak} bytes");
    server.shutdown();
}
