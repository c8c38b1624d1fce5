//! Operations in flight: [`Pending`], which holds the borrow of its buffers until it is waited
//! for, and the queue of operations on owned buffers ([`Work`],
//! [`Communicator::all_reduce_owned`]).

use super::communicator::Communicator;
use super::state::Queued;
use crate::Element;
use crate::Result;
use crate::engine::RawBuf;
use crate::error::Error;
use gradsync_core::{Collective, ReduceOp};
use std::marker::PhantomData;

/// Handle of an operation on an owned buffer (see [`Communicator::all_reduce_owned`]).
#[derive(Debug)]
#[must_use = "the buffer comes back only through Communicator::wait"]
pub struct Work<T> {
    id: u64,
    _t: PhantomData<fn() -> T>,
}

/// An operation in flight. It holds the borrow of its buffers until [`Pending::wait`] (or
/// drop, which waits), so the buffers cannot be touched while the operation may use them.
///
/// Progress is made by the thread that calls [`Pending::test`] or [`Pending::wait`].
#[derive(Debug)]
#[must_use = "an operation completes only when it is waited for (or dropped, which waits)"]
pub struct Pending<'a> {
    comm: &'a mut Communicator,
    done: bool,
    _bufs: PhantomData<&'a mut [u8]>,
}

impl<'a> Pending<'a> {
    /// The handle of the operation just started on `comm` (`done` when it already ended).
    pub(super) fn new(comm: &'a mut Communicator, done: bool) -> Self {
        Pending {
            comm,
            done,
            _bufs: PhantomData,
        }
    }

    /// Drives the operation without blocking; `true` once it has completed.
    pub fn test(&mut self) -> Result<bool> {
        if !self.done {
            self.done = self.comm.engine.progress(false)?;
        }
        Ok(self.done)
    }

    /// Waits for completion (bounded by the communicator's timeout).
    pub fn wait(mut self) -> Result<()> {
        if !self.done {
            self.done = true;
            self.comm.engine.progress(true)?;
        }
        Ok(())
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.done
            && let Err(e) = self.comm.engine.progress(true)
        {
            tracing::warn!(target: "gradsync::coll", "operation dropped without wait failed: {e}");
        }
    }
}

pub(super) fn raw<T>(s: &[T]) -> RawBuf {
    RawBuf {
        addr: s.as_ptr() as usize,
        len: std::mem::size_of_val(s),
    }
}

impl Communicator {
    /// Queues an in-place all-reduce of an owned buffer and returns a handle for it.
    ///
    /// Queued operations run one after another in the order they were queued, and before any
    /// later call on this communicator; they progress whenever the communicator is driven:
    /// [`progress`](Self::progress), [`test`](Self::test), [`wait`](Self::wait), or any
    /// blocking collective (which first completes the queue). Owning the buffer, the
    /// communicator can never leave memory shared with an operation in flight.
    pub fn all_reduce_owned<T: Element>(&mut self, buf: Vec<T>, op: ReduceOp) -> Result<Work<T>> {
        self.check_op(Collective::AllReduce, T::DTYPE, op)?;
        self.engine.check_usable_or_running()?;
        let raw_buf = raw(&buf);
        let (sig, prog, algo) =
            self.plan(Collective::AllReduce, T::DTYPE, op, 0, buf.len(), true)?;
        let id = self.next_work;
        self.next_work += 1;
        self.queue.push_back(Queued {
            id,
            sig,
            prog,
            algo,
            buf: raw_buf,
            owner: Box::new(buf),
        });
        self.drive(false, Some(id))?;
        Ok(Work {
            id,
            _t: PhantomData,
        })
    }

    /// Drives queued operations without blocking; whether `w` has finished.
    pub fn test<T: Element>(&mut self, w: &Work<T>) -> Result<bool> {
        self.drive(false, Some(w.id))?;
        Ok(self.finished.contains_key(&w.id))
    }

    /// Waits for `w` and returns its buffer.
    pub fn wait<T: Element>(&mut self, w: Work<T>) -> Result<Vec<T>> {
        self.drive(true, Some(w.id))?;
        let b = self.finished.remove(&w.id).ok_or_else(|| Error::Internal {
            rank: self.rank,
            msg: format!("work {} is not known to this communicator", w.id),
        })?;
        b.downcast::<Vec<T>>()
            .map(|b| *b)
            .map_err(|_| Error::Internal {
                rank: self.rank,
                msg: "work handle of another element type".into(),
            })
    }

    /// Drives queued operations without blocking.
    pub fn progress(&mut self) -> Result<()> {
        self.drive(false, None)
    }

    /// Drives the queue of owned-buffer operations: blocks until `until` has finished (or the
    /// whole queue, with `None`) when `block`, else makes one round of progress.
    pub(super) fn drive(&mut self, block: bool, until: Option<u64>) -> Result<()> {
        loop {
            let target_done = |c: &Self| match until {
                Some(id) => c.finished.contains_key(&id),
                None => c.current.is_none() && c.queue.is_empty(),
            };
            if self.current.is_some() {
                let done = match self.engine.progress(block) {
                    Ok(d) => d,
                    Err(e) => {
                        self.current = None;
                        self.queue.clear();
                        return Err(e);
                    }
                };
                if !done {
                    return Ok(());
                }
                let (id, owner) = self.current.take().expect("current");
                self.finished.insert(id, owner);
            }
            if target_done(self) {
                return Ok(());
            }
            let Some(q) = self.queue.pop_front() else {
                return Ok(());
            };
            // SAFETY: the buffer is owned by `q.owner`, which the communicator keeps (in
            // `current`, then `finished`) until the operation has ended.
            unsafe { self.engine.start(q.sig, q.prog, q.algo, q.buf, q.buf)? };
            self.current = Some((q.id, q.owner));
            if !block {
                self.engine.progress(false)?;
            }
        }
    }
}
