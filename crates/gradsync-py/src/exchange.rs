//! `Communicator.all_to_all`, `all_to_allv`, `gather` and `scatter` (and their `_async`
//! forms): the collectives that move blocks between ranks without reducing them.

use crate::buffer::{Access, Buffer, extract};
use crate::comm::{Communicator, Work, with_element};
use crate::worker::Task;
use gradsync::DataType;
use pyo3::prelude::*;

impl Communicator {
    fn all_to_all_impl(
        &self,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
    ) -> PyResult<Work> {
        const NAME: &str = "all_to_all";
        let py = input.py();
        self.check_open(NAME)?;
        let i = extract(input, Access::Read, self.ctx(NAME, "input"))?;
        let o = extract(output, Access::Write, self.ctx(NAME, "output"))?;
        self.same_dtype(NAME, &i, &o)?;
        let world = self.world();
        if i.len != o.len || !i.len.is_multiple_of(world) {
            return Err(self.invalid(
                NAME,
                format!(
                    "input has {} elements and output {}: both must have the same number, a multiple of the world size {world}",
                    i.len, o.len
                ),
            ));
        }
        self.no_overlap(NAME, &i, &o)?;
        let dt = i.dtype;
        let (si, mut keep) = i.into_parts();
        let (so, k) = o.into_parts();
        keep.extend(k);
        let task: Task = with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
            // SAFETY: both describe `T`s (dispatch on the checked common dtype) whose owners
            // travel with this job; the output is writable and does not overlap the input (both
            // checked); the caller does not touch them until the operation has finished.
            let (input, output) = unsafe { (si.slice::<T>(), so.slice_mut::<T>()) };
            c.all_to_all(input, output)
        }));
        self.submit(py, NAME, task, keep)
    }

    fn all_to_allv_impl(
        &self,
        input: &Bound<'_, PyAny>,
        send_counts: Vec<usize>,
        output: &Bound<'_, PyAny>,
        recv_counts: Vec<usize>,
    ) -> PyResult<Work> {
        const NAME: &str = "all_to_allv";
        let py = input.py();
        self.check_open(NAME)?;
        let i = extract(input, Access::Read, self.ctx(NAME, "input"))?;
        let o = extract(output, Access::Write, self.ctx(NAME, "output"))?;
        self.same_dtype(NAME, &i, &o)?;
        self.no_overlap(NAME, &i, &o)?;
        let dt = i.dtype;
        let (si, mut keep) = i.into_parts();
        let (so, k) = o.into_parts();
        keep.extend(k);
        // The counts are checked against the buffers by the Rust call, on the worker: its error
        // names the rank, the call and the sizes, and fails the returned work.
        let task: Task = with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
            // SAFETY: as in all_to_all: typed, alive, the output writable and separate.
            let (input, output) = unsafe { (si.slice::<T>(), so.slice_mut::<T>()) };
            c.all_to_allv(input, &send_counts, output, &recv_counts)
        }));
        self.submit(py, NAME, task, keep)
    }

    /// The rooted collectives: `gather` (`scatter` false) or `scatter`. `whole` is the root's
    /// `world * n` buffer (gather's output, scatter's input), `part` every rank's `n`.
    fn rooted_impl(
        &self,
        name: &'static str,
        part: &Bound<'_, PyAny>,
        whole: Option<&Bound<'_, PyAny>>,
        root: usize,
        scatter: bool,
    ) -> PyResult<Work> {
        let py = part.py();
        self.check_open(name)?;
        self.check_root(name, root)?;
        let (part_access, whole_access, part_name, whole_name) = if scatter {
            (Access::Write, Access::Read, "output", "input")
        } else {
            (Access::Read, Access::Write, "input", "output")
        };
        let p = extract(part, part_access, self.ctx(name, part_name))?;
        let is_root = self.info_rank() == root;
        let w = match whole {
            Some(w) if is_root => {
                let w = extract(w, whole_access, self.ctx(name, whole_name))?;
                self.same_dtype(name, &p, &w)?;
                self.world_multiple(name, (whole_name, w.len), (part_name, p.len))?;
                self.no_overlap(name, &p, &w)?;
                w
            }
            None if is_root => {
                return Err(self.invalid(
                    name,
                    format!("the root (rank {root}) needs an {whole_name} array"),
                ));
            }
            // Other ranks' whole buffer is never touched.
            _ => Buffer::empty(p.dtype),
        };
        let dt: DataType = p.dtype;
        let (sp, mut keep) = p.into_parts();
        let (sw, k) = w.into_parts();
        keep.extend(k);
        let task: Task = if scatter {
            with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
                // SAFETY: typed (one checked dtype), alive with this job, the output writable
                // and separate from the root's input; elsewhere the input is empty.
                let (input, output) = unsafe { (sw.slice::<T>(), sp.slice_mut::<T>()) };
                c.scatter(input, output, root)
            }))
        } else {
            with_element!(dt, T => Box::new(move |c: &mut gradsync::Communicator| {
                // SAFETY: as for scatter, with the root's output the whole buffer.
                let (input, output) = unsafe { (sp.slice::<T>(), sw.slice_mut::<T>()) };
                c.gather(input, output, root)
            }))
        };
        self.submit(py, name, task, keep)
    }
}

#[pymethods]
impl Communicator {
    /// All-to-all: ``input`` and ``output`` hold ``world_size`` blocks of ``n`` elements;
    /// block ``p`` of ``input`` goes to rank ``p``, which stores it as block ``rank`` of its
    /// ``output``.
    fn all_to_all(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        Self::finish(py, self.all_to_all_impl(input, output))
    }

    /// Starts :meth:`all_to_all` and returns its :class:`Work`.
    fn all_to_all_async(
        &self,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
    ) -> PyResult<Work> {
        self.all_to_all_impl(input, output)
    }

    /// All-to-all with a count per pair of ranks: ``send_counts[p]`` elements of ``input`` go
    /// to rank ``p``, ``recv_counts[p]`` elements of ``output`` come from rank ``p``; each
    /// buffer's blocks are contiguous in rank order (``all_to_all_single`` with split sizes).
    fn all_to_allv(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        send_counts: Vec<usize>,
        output: &Bound<'_, PyAny>,
        recv_counts: Vec<usize>,
    ) -> PyResult<()> {
        Self::finish(
            py,
            self.all_to_allv_impl(input, send_counts, output, recv_counts),
        )
    }

    /// Starts :meth:`all_to_allv` and returns its :class:`Work`.
    fn all_to_allv_async(
        &self,
        input: &Bound<'_, PyAny>,
        send_counts: Vec<usize>,
        output: &Bound<'_, PyAny>,
        recv_counts: Vec<usize>,
    ) -> PyResult<Work> {
        self.all_to_allv_impl(input, send_counts, output, recv_counts)
    }

    /// Gather: the root's ``output`` (``world_size * n`` elements) gets every rank's ``input``
    /// (``n``), rank ``r``'s at block ``r``; each rank sends only its own block. Other ranks'
    /// ``output`` may be ``None``; it is never written.
    #[pyo3(signature = (input, output, root=0))]
    fn gather(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        root: usize,
    ) -> PyResult<()> {
        Self::finish(py, self.rooted_impl("gather", input, output, root, false))
    }

    /// Starts :meth:`gather` and returns its :class:`Work`.
    #[pyo3(signature = (input, output, root=0))]
    fn gather_async(
        &self,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        root: usize,
    ) -> PyResult<Work> {
        self.rooted_impl("gather", input, output, root, false)
    }

    /// Scatter: rank ``r``'s ``output`` (``n`` elements) gets block ``r`` of the root's
    /// ``input`` (``world_size * n``); each rank receives only its own block. Other ranks'
    /// ``input`` may be ``None``; it is never read.
    #[pyo3(signature = (input, output, root=0))]
    fn scatter(
        &self,
        py: Python<'_>,
        input: Option<&Bound<'_, PyAny>>,
        output: &Bound<'_, PyAny>,
        root: usize,
    ) -> PyResult<()> {
        Self::finish(py, self.rooted_impl("scatter", output, input, root, true))
    }

    /// Starts :meth:`scatter` and returns its :class:`Work`.
    #[pyo3(signature = (input, output, root=0))]
    fn scatter_async(
        &self,
        input: Option<&Bound<'_, PyAny>>,
        output: &Bound<'_, PyAny>,
        root: usize,
    ) -> PyResult<Work> {
        self.rooted_impl("scatter", output, input, root, true)
    }
}
