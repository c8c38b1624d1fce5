//! Python buffers as element slices: numpy arrays through the array interface, CPU torch
//! tensors through `tensor.numpy()` (zero copy).
//!
//! The stable ABI this package is built for (abi3, Python 3.9) has no buffer protocol (it
//! entered the limited API in 3.11), so memory is found through numpy's
//! `__array_interface__`: a data pointer, a read-only flag, a type string, a shape and strides.
//! The object that exported them is kept alive (a strong reference in [`Buffer`]) until the
//! operation that uses the memory has finished: numpy never frees or moves the data of an array
//! that is referenced (`ndarray.resize` refuses while other references exist), so the pointer
//! stays valid.

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
    /// The numpy array (or other exporter) whose memory this is, and the torch tensor it came
    /// from, if any: holding them keeps the memory alive.
    owners: Vec<Py<PyAny>>,
}

impl Buffer {
    /// An empty buffer of `dtype` that owns nothing (a non-root `reduce` output).
    pub(crate) fn empty(dtype: DataType) -> Self {
        Buffer {
            addr: dtype.size(),
            len: 0,
            dtype,
            owners: Vec::new(),
        }
    }

    /// The byte range `[start, end)` the buffer covers.
    fn span(&self) -> (usize, usize) {
        (self.addr, self.addr + self.len * self.dtype.size())
    }

    /// Whether two buffers share memory.
    pub(crate) fn overlaps(&self, other: &Buffer) -> bool {
        let (a0, a1) = self.span();
        let (b0, b1) = other.span();
        a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1
    }

    /// The raw parts for building a slice on the worker thread, and the owners to keep alive
    /// until that slice is no longer used.
    pub(crate) fn into_parts(self) -> (RawSlice, Vec<Py<PyAny>>) {
        (
            RawSlice {
                addr: self.addr,
                len: self.len,
            },
            self.owners,
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
    /// `T` must be the buffer's element type, and its owners (see [`Buffer::into_parts`]) must
    /// be alive, and nothing may write the memory, for as long as the slice is used.
    pub(crate) unsafe fn slice<'a, T>(self) -> &'a [T] {
        // SAFETY: `addr` is non-null and aligned for the element type (checked in `extract`,
        // or dangling-but-aligned when `len` is 0) and points at `len` initialised elements
        // inside the owner's memory, which the caller keeps alive and unwritten.
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

/// The `torch.Tensor` class if torch is already imported (an object cannot be a tensor
/// otherwise, so torch is never imported here).
fn torch_tensor_class<'py>(
    py: Python<'py>,
) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
    let modules = py.import("sys")?.getattr("modules")?;
    let torch = modules.call_method1("get", ("torch",))?;
    if torch.is_none() {
        return Ok(None);
    }
    match torch.getattr("Tensor") {
        Ok(cls) => Ok(Some((torch, cls))),
        // A module named torch that is not PyTorch (or one half imported).
        Err(_) => Ok(None),
    }
}

/// Finds the memory of `obj`: a numpy array (or any object with `__array_interface__`) or a
/// CPU torch tensor. It must be C-contiguous, of a supported type, and writable for
/// [`Access::Write`].
pub(crate) fn extract(obj: &Bound<'_, PyAny>, access: Access, ctx: Ctx<'_>) -> PyResult<Buffer> {
    let py = obj.py();
    let mut owners = Vec::with_capacity(2);
    let mut forced = None;
    let array = match torch_tensor_class(py)? {
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
            numpy
        }
        _ => obj.clone(),
    };
    let iface = match array.getattr("__array_interface__") {
        Ok(i) => i,
        Err(_) => {
            let ty = obj.get_type().name()?.to_string();
            return Err(ctx.type_err(format!(
                "expected a numpy array or a CPU torch tensor, got {ty}"
            )));
        }
    };
    let iface = iface
        .cast_into::<PyDict>()
        .map_err(|_| ctx.type_err("__array_interface__ is not a dict"))?;
    let item = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        Ok(iface.get_item(k)?.filter(|v| !v.is_none()))
    };
    if item("mask")?.is_some() {
        return Err(ctx.type_err("masked arrays are not supported"));
    }
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
