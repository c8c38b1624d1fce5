//! Python buffers as element slices: numpy arrays through the array interface, CPU torch
//! tensors through `tensor.numpy()` (zero copy).
//!
//! The stable ABI this package is built for (abi3, Python 3.9) has no buffer protocol (it
//! entered the limited API in 3.11), so memory is found through numpy's
//! `__array_interface__`: a data pointer, a read-only flag, a type string, a shape and strides.
//! Only real `numpy.ndarray`s (subclasses included) and torch tensors are accepted, and the
//! interface is read through `ndarray`'s own descriptor, never through an attribute an object
//! or a subclass may define: the pointer is then the array's own data, which the array keeps
//! alive itself (it owns the memory or holds a reference to the object that does). The array
//! (and the tensor it came from) is kept alive (a strong reference in [`Buffer`]) until the
//! operation that uses the memory has finished; numpy never frees or moves the data of an
//! array that is referenced (`ndarray.resize` refuses while other references exist), so the
//! pointer stays valid.

use gradsync::DataType;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// What a buffer is used for, for error messages and checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// Only read.
    Read,
    /// Written (in place or as an output).
    Write,
}

/// Memory of a Python object, described by pointer, element count and type, with the object
/// that owns it.
#[derive(Debug)]
pub(crate) struct Buffer {
    /// Address of the first element; aligned for `dtype`; dangling (but aligned) when `len` is 0.
    addr: usize,
    /// Number of elements.
    pub(crate) len: usize,
    /// Element type.
    pub(crate) dtype: DataType,
    /// The numpy array whose memory this is, and the torch tensor it came from, if any:
    /// holding them keeps the memory alive.
    owners: Vec<Py<PyAny>>,
    /// The torch tensor, when the operation writes it: its version counter is bumped when the
    /// operation is submitted, as torch's in-place operations do, so that autograd notices
    /// the change of a tensor it saved for backward.
    written: Option<Py<PyAny>>,
}

/// What an operation holds on to: the objects that own its buffers' memory, and the torch
/// tensors it writes.
#[derive(Debug, Default)]
pub(crate) struct Keep {
    /// Kept alive until the operation has finished.
    pub(crate) owners: Vec<Py<PyAny>>,
    /// Tensors whose version counters are bumped when the operation is submitted.
    pub(crate) written: Vec<Py<PyAny>>,
}

impl Keep {
    /// Adds what `other` holds.
    pub(crate) fn extend(&mut self, other: Keep) {
        self.owners.extend(other.owners);
        self.written.extend(other.written);
    }
}

impl Buffer {
    /// An empty buffer of `dtype` that owns nothing (a non-root `reduce` output).
    pub(crate) fn empty(dtype: DataType) -> Self {
        Buffer {
            addr: dtype.size(),
            len: 0,
            dtype,
            owners: Vec::new(),
            written: None,
        }
    }

    /// The byte range `[start, end)` the buffer covers.
    fn span(&self) -> (usize, usize) {
        (self.addr, self.addr + self.len * self.dtype.size())
    }

    /// Whether this buffer is exactly block `index` of `whole` cut into blocks of this
    /// buffer's length (NCCL's rule for an in-place all-gather or reduce-scatter).
    pub(crate) fn is_block_of(&self, whole: &Buffer, index: usize) -> bool {
        self.dtype == whole.dtype
            && self.len > 0
            && index
                .checked_mul(self.len * self.dtype.size())
                .and_then(|off| whole.addr.checked_add(off))
                == Some(self.addr)
    }

    /// Whether two buffers share memory.
    pub(crate) fn overlaps(&self, other: &Buffer) -> bool {
        let (a0, a1) = self.span();
        let (b0, b1) = other.span();
        a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
    }

    /// The raw parts for building a slice on the worker thread, and what the operation holds:
    /// the owners to keep alive until that slice is no longer used, and the tensor it writes.
    pub(crate) fn into_parts(self) -> (RawSlice, Keep) {
        (
            RawSlice {
                addr: self.addr,
                len: self.len,
            },
            Keep {
                owners: self.owners,
                written: self.written.into_iter().collect(),
            },
        )
    }
}

/// Pointer and length of a buffer, sent to the worker thread.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawSlice {
    addr: usize,
    len: usize,
}

impl RawSlice {
    /// The elements, read only.
    ///
    /// # Safety
    ///
    /// `T` must be the buffer's element type, and its owners (see [`Buffer::into_parts`]: the
    /// numpy ndarray whose data it is, and the tensor it came from) must be alive, and nothing
    /// may write the memory, for as long as the slice is used.
    pub(crate) unsafe fn slice<'a, T>(self) -> &'a [T] {
        // SAFETY: `addr` is non-null and aligned for the element type (checked in `extract`,
        // or dangling-but-aligned when `len` is 0) and points at `len` initialised elements
        // of a numpy ndarray's data, read through `ndarray`'s own descriptor (`extract`
        // accepts no other object); the ndarray owns or references that memory, and the
        // caller keeps it alive and the memory unwritten.
        unsafe { std::slice::from_raw_parts(self.addr as *const T, self.len) }
    }

    /// The elements, writable.
    ///
    /// # Safety
    ///
    /// As for [`slice`](Self::slice), and the memory must be writable (checked in `extract`
    /// for [`Access::Write`]) and not be used through any other reference while the slice is
    /// used.
    pub(crate) unsafe fn slice_mut<'a, T>(self) -> &'a mut [T] {
        // SAFETY: as in `slice`; the caller guarantees the memory is writable and not aliased.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.len) }
    }
}

/// The numpy name of a data type.
pub(crate) fn dtype_name(d: DataType) -> &'static str {
    match d {
        DataType::F32 => "float32",
        DataType::F64 => "float64",
        DataType::F16 => "float16",
        DataType::Bf16 => "bfloat16",
        DataType::I32 => "int32",
        DataType::I64 => "int64",
        DataType::U8 => "uint8",
    }
}

const SUPPORTED: &str = "float32, float64, float16, bfloat16 (torch), int32, int64, uint8";

/// Context of an extraction, for the messages of its errors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ctx<'a> {
    /// The operation (`all_reduce`, ...).
    pub(crate) op: &'a str,
    /// This rank.
    pub(crate) rank: usize,
    /// The argument (`buf`, `input`, `output`).
    pub(crate) arg: &'a str,
}

impl Ctx<'_> {
    fn type_err(&self, msg: impl std::fmt::Display) -> PyErr {
        PyTypeError::new_err(format!(
            "rank {}: {}: {}: {msg}",
            self.rank, self.op, self.arg
        ))
    }

    fn value_err(&self, msg: impl std::fmt::Display) -> PyErr {
        PyValueError::new_err(format!(
            "rank {}: {}: {}: {msg}",
            self.rank, self.op, self.arg
        ))
    }
}

/// The module `name` and its attribute `attr` if the module is already imported (an object
/// cannot be an instance of its class otherwise, so nothing is imported here).
fn imported<'py>(
    py: Python<'py>,
    name: &str,
    attr: &str,
) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
    let modules = py.import("sys")?.getattr("modules")?;
    let module = modules.call_method1("get", (name,))?;
    if module.is_none() {
        return Ok(None);
    }
    match module.getattr(attr) {
        Ok(a) => Ok(Some((module, a))),
        // A module of that name that is not the library (or one half imported).
        Err(_) => Ok(None),
    }
}

/// Bumps the version counter of each torch tensor in `tensors` (those an operation is about
/// to write), as an in-place torch operation does: autograd then refuses to use a tensor it
/// saved for backward and that was modified since. Inference tensors have no version counter
/// and are left alone.
pub(crate) fn bump_versions(py: Python<'_>, tensors: &[Py<PyAny>]) -> PyResult<()> {
    if tensors.is_empty() {
        return Ok(());
    }
    let Some((torch, _)) = imported(py, "torch", "Tensor")? else {
        return Ok(());
    };
    let increment = torch
        .getattr("autograd")?
        .getattr("graph")?
        .getattr("increment_version")?;
    for t in tensors {
        let t = t.bind(py);
        if t.call_method0("is_inference")?.extract::<bool>()? {
            continue;
        }
        increment.call1((t,))?;
    }
    Ok(())
}

/// Finds the memory of `obj`: a numpy array (an instance of `numpy.ndarray`) or a CPU torch
/// tensor. It must be C-contiguous, of a supported type, and writable for [`Access::Write`].
/// Other objects, even with an `__array_interface__`, are refused: such an interface may
/// describe memory that nothing keeps alive.
pub(crate) fn extract(obj: &Bound<'_, PyAny>, access: Access, ctx: Ctx<'_>) -> PyResult<Buffer> {
    let py = obj.py();
    let mut owners = Vec::with_capacity(2);
    let mut forced = None;
    let mut written = None;
    let not_a_buffer = || -> PyResult<PyErr> {
        let ty = obj.get_type().name()?.to_string();
        Ok(ctx.type_err(format!(
            "expected a numpy array or a CPU torch tensor, got {ty}"
        )))
    };
    let array = match imported(py, "torch", "Tensor")? {
        Some((torch, cls)) if obj.is_instance(&cls)? => {
            let device = obj
                .getattr("device")?
                .getattr("type")?
                .extract::<String>()?;
            if device != "cpu" {
                return Err(ctx.type_err(format!(
                    "tensor is on device {device}; gradsync works on CPU tensors"
                )));
            }
            if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
                let shape = obj.getattr("shape")?.str()?.to_string();
                return Err(ctx.value_err(format!(
                    "tensor of shape {shape} is not contiguous (call .contiguous() first)"
                )));
            }
            let dtype = obj.getattr("dtype")?;
            let detached = obj.call_method0("detach")?;
            let numpy = if dtype.eq(torch.getattr("bfloat16")?)? {
                forced = Some(DataType::Bf16);
                let as_i16 = detached.call_method1("view", (torch.getattr("int16")?,))?;
                as_i16.call_method0("numpy")
            } else {
                detached.call_method0("numpy")
            };
            let numpy = numpy.map_err(|e| {
                ctx.type_err(format!(
                    "tensor of dtype {} has no numpy view ({}); supported: {SUPPORTED}",
                    dtype.str().map(|s| s.to_string()).unwrap_or_default(),
                    e.value(py)
                ))
            })?;
            owners.push(obj.clone().unbind());
            if access == Access::Write {
                written = Some(obj.clone().unbind());
            }
            numpy
        }
        _ => obj.clone(),
    };
    // Only a real ndarray (what `tensor.numpy()` returns too) owns or references its memory.
    let Some((_, ndarray)) = imported(py, "numpy", "ndarray")? else {
        return Err(not_a_buffer()?);
    };
    if !array.is_instance(&ndarray)? {
        return Err(not_a_buffer()?);
    }
    if let Some((_, masked)) = imported(py, "numpy.ma", "MaskedArray")?
        && array.is_instance(&masked)?
    {
        return Err(ctx.type_err("masked arrays are not supported"));
    }
    // `ndarray`'s own descriptor: a subclass may override `__array_interface__`.
    let iface = ndarray
        .getattr("__array_interface__")?
        .call_method1("__get__", (&array, &ndarray))?;
    let iface = iface
        .cast_into::<PyDict>()
        .map_err(|_| ctx.type_err("__array_interface__ is not a dict"))?;
    let item = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        Ok(iface.get_item(k)?.filter(|v| !v.is_none()))
    };
    let typestr: String = item("typestr")?
        .ok_or_else(|| ctx.type_err("__array_interface__ has no typestr"))?
        .extract()?;
    let shape: Vec<usize> = item("shape")?
        .ok_or_else(|| ctx.type_err("__array_interface__ has no shape"))?
        .extract()?;
    let strides: Option<Vec<isize>> = item("strides")?.map(|s| s.extract()).transpose()?;
    let (ptr, readonly): (usize, bool) = item("data")?
        .ok_or_else(|| {
            ctx.type_err("__array_interface__ exposes no data pointer (use a numpy array)")
        })?
        .extract()
        .map_err(|_| ctx.type_err("__array_interface__ data is not a (pointer, read-only) pair"))?;
    let numpy_name = || {
        array
            .getattr("dtype")
            .and_then(|d| d.str().map(|s| s.to_string()))
            .unwrap_or_else(|_| typestr.clone())
    };
    let dtype = parse_typestr(&typestr, forced).ok_or_else(|| {
        ctx.type_err(format!(
            "dtype {} is not supported; supported: {SUPPORTED}",
            numpy_name()
        ))
    })?;
    let size = dtype.size();
    let len = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| ctx.value_err(format!("shape {shape:?} is too large")))?;
    if let Some(strides) = &strides
        && !c_contiguous(&shape, strides, size)
    {
        return Err(ctx.value_err(format!(
            "array of shape {shape:?} with strides {strides:?} is not C-contiguous (use numpy.ascontiguousarray or .copy())"
        )));
    }
    if access == Access::Write && readonly {
        return Err(ctx.value_err(format!(
            "the {} array of {len} elements is read-only but this operation writes it",
            dtype_name(dtype)
        )));
    }
    let addr = if len == 0 {
        size
    } else {
        if ptr == 0 {
            return Err(ctx.value_err("the array's data pointer is null"));
        }
        if ptr % size != 0 {
            return Err(ctx.value_err(format!(
                "the data at {ptr:#x} is not aligned to its {size}-byte elements"
            )));
        }
        ptr
    };
    owners.push(array.unbind());
    Ok(Buffer {
        addr,
        len,
        dtype,
        owners,
        written,
    })
}

/// Parses an array-interface type string (`<f4`, `|u1`, ...). `forced` is the type a torch
/// bfloat16 tensor was viewed from (as int16).
fn parse_typestr(s: &str, forced: Option<DataType>) -> Option<DataType> {
    let mut chars = s.chars();
    let order = chars.next()?;
    let kind = chars.next()?;
    let size: usize = chars.as_str().parse().ok()?;
    let native_little = cfg!(target_endian = "little");
    let ok_order = match order {
        '|' => size == 1,
        '<' => native_little || size == 1,
        '>' => !native_little || size == 1,
        '=' => true,
        _ => false,
    };
    if !ok_order {
        return None;
    }
    if let Some(f) = forced {
        return (kind == 'i' && size == 2).then_some(f);
    }
    match (kind, size) {
        ('f', 4) => Some(DataType::F32),
        ('f', 8) => Some(DataType::F64),
        ('f', 2) => Some(DataType::F16),
        ('i', 4) => Some(DataType::I32),
        ('i', 8) => Some(DataType::I64),
        ('u', 1) => Some(DataType::U8),
        _ => None,
    }
}

/// Whether `strides` (bytes) describe a C-contiguous layout of `shape`; dimensions of extent
/// 0 or 1 may have any stride.
fn c_contiguous(shape: &[usize], strides: &[isize], size: usize) -> bool {
    if shape.len() != strides.len() {
        return false;
    }
    if shape.contains(&0) {
        return true;
    }
    let mut expected = size as isize;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d > 1 && s != expected {
            return false;
        }
        expected = expected.saturating_mul(d as isize);
    }
    true
}
