//! Reading and writing whole frames on a stream, with deadlines and bounded allocation.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use crate::wire::{Frame, HEADER_LEN, MAX_BODY_LEN, WireError};

/// Body bytes read (and allocated) per step: a peer that announces a large body gets buffer
/// space only as fast as it actually sends bytes.
const READ_CHUNK: usize = 1 << 20;

/// A source of bytes whose `read_some` applies its own timeout policy: it returns `Ok(0)` at
/// end of stream and an error of kind `TimedOut` when its deadline has passed.
pub(crate) trait ReadSome {
    /// Reads at least one byte into `buf`, or reports end of stream or an error.
    fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize>;
}

/// Why no frame was read.
#[derive(Debug)]
pub(crate) enum FrameReadError {
    /// The stream ended cleanly before the first byte of a frame.
    Closed,
    /// An I/O error, a timeout, or an end of stream inside a frame.
    Io(io::Error),
    /// The header is invalid (bad magic, version, flags or an oversized body length).
    Header(WireError),
}

impl From<io::Error> for FrameReadError {
    fn from(e: io::Error) -> Self {
        FrameReadError::Io(e)
    }
}

/// Fills `buf` completely. `Ok(false)` means the stream ended before any byte, which is
/// allowed only when `eof_ok`.
fn fill<R: ReadSome>(src: &mut R, buf: &mut [u8], eof_ok: bool) -> io::Result<bool> {
    let mut pos = 0;
    while pos < buf.len() {
        match src.read_some(&mut buf[pos..]) {
            Ok(0) if pos == 0 && eof_ok => return Ok(false),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("stream closed after {pos} of {} bytes", buf.len()),
                ));
            }
            Ok(n) => pos += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Reads one frame into `buf` (replacing its contents): the header, checked with
/// [`Frame::check_header`] before any body byte is read, then the body in chunks of at most
/// [`READ_CHUNK`] bytes. On success `buf` holds exactly one frame.
pub(crate) fn read_frame<R: ReadSome>(
    src: &mut R,
    buf: &mut Vec<u8>,
) -> Result<(), FrameReadError> {
    read_frame_limited(src, buf, MAX_BODY_LEN)
}

/// As [`read_frame`], refusing (as [`WireError::BodyTooLong`]) a body longer than `max_body`
/// before reading it: the handshake reads only small frames.
pub(crate) fn read_frame_limited<R: ReadSome>(
    src: &mut R,
    buf: &mut Vec<u8>,
    max_body: usize,
) -> Result<(), FrameReadError> {
    buf.clear();
    buf.resize(HEADER_LEN, 0);
    if !fill(src, &mut buf[..HEADER_LEN], true)? {
        return Err(FrameReadError::Closed);
    }
    let frame = Frame::new_unchecked(&buf[..]);
    frame.check_header().map_err(FrameReadError::Header)?;
    if frame.body_len() as usize > max_body {
        return Err(FrameReadError::Header(WireError::BodyTooLong {
            len: u64::from(frame.body_len()),
            limit: max_body,
        }));
    }
    let total = frame.frame_len();
    while buf.len() < total {
        let start = buf.len();
        let end = total.min(start + READ_CHUNK);
        buf.resize(end, 0);
        fill(src, &mut buf[start..end], false)?;
    }
    Ok(())
}

/// Whether an I/O error is a socket timeout (`EAGAIN` from `SO_RCVTIMEO`/`SO_SNDTIMEO`, or our
/// own deadline check).
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "deadline passed")
}

/// Reads from a stream until one absolute deadline; each read's socket timeout is the time left.
pub(crate) struct DeadlineReader<'s> {
    pub(crate) stream: &'s TcpStream,
    pub(crate) deadline: Instant,
}

impl ReadSome for DeadlineReader<'_> {
    fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut stream = self.stream;
        stream
            .read(buf)
            .map_err(|e| if is_timeout(&e) { timed_out() } else { e })
    }
}

/// Writes all of `bytes` before `deadline`; each write's socket timeout is the time left.
pub(crate) fn write_all_by(
    mut stream: &TcpStream,
    mut bytes: &[u8],
    deadline: Instant,
) -> io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(bytes) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "peer accepts no more bytes",
                ));
            }
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(timed_out()),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
