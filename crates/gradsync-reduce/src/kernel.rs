//! The loops: typed element-wise loops over the caller's memory viewed in place (the fast path),
//! loops over element-sized byte chunks for memory that cannot be viewed so (the unaligned path),
//! and the [`Backend`] that instantiates them for one instruction set.

use crate::ops::{Elem, Half, through_f32};

/// One instantiation of the loops for an instruction set.
///
/// The loops are `#[inline(always)]`, so each backend compiles its own copy of them with its
/// own target features; the operators passed in are inlined into that copy. The `half_*`
/// methods compute 16-bit floats through `f32`; a backend with hardware conversions overrides
/// them.
pub(crate) trait Backend: Copy {
    /// `acc[i] = f(acc[i], inc[i])` over byte buffers holding `T`s.
    fn fold<T: Elem>(self, acc: &mut [u8], inc: &[u8], f: impl Fn(T, T) -> T + Copy);

    /// `dst[i] = f(a[i], b[i])` over byte buffers holding `T`s.
    fn combine<T: Elem>(self, dst: &mut [u8], a: &[u8], b: &[u8], f: impl Fn(T, T) -> T + Copy);

    /// `buf[i] = f(buf[i])` over a byte buffer holding `T`s.
    fn map<T: Elem>(self, buf: &mut [u8], f: impl Fn(T) -> T + Copy);

    /// [`Backend::fold`] for a 16-bit float format, computing in `f32`.
    fn half_fold<H: Half>(self, acc: &mut [u8], inc: &[u8], f: impl Fn(f32, f32) -> f32 + Copy) {
        self.fold(acc, inc, through_f32::<H>(f));
    }

    /// [`Backend::combine`] for a 16-bit float format, computing in `f32`.
    fn half_combine<H: Half>(
        self,
        dst: &mut [u8],
        a: &[u8],
        b: &[u8],
        f: impl Fn(f32, f32) -> f32 + Copy,
    ) {
        self.combine(dst, a, b, through_f32::<H>(f));
    }

    /// [`Backend::map`] for a 16-bit float format, computing in `f32`.
    fn half_map<H: Half>(self, buf: &mut [u8], f: impl Fn(f32) -> f32 + Copy) {
        self.map(buf, move |h: u16| H::narrow(f(H::widen(h))));
    }
}

/// The loops compiled for the target's baseline instruction set (SSE2 on x86-64), with the
/// 16-bit conversions in portable integer code.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Portable;

impl Backend for Portable {
    fn fold<T: Elem>(self, acc: &mut [u8], inc: &[u8], f: impl Fn(T, T) -> T + Copy) {
        bytes_in_place(acc, inc, f);
    }

    fn combine<T: Elem>(self, dst: &mut [u8], a: &[u8], b: &[u8], f: impl Fn(T, T) -> T + Copy) {
        bytes_into(dst, a, b, f);
    }

    fn map<T: Elem>(self, buf: &mut [u8], f: impl Fn(T) -> T + Copy) {
        bytes_map(buf, f);
    }
}

/// Elements per unrolled step of the typed loops: a multiple of every vector width in use (16
/// `f32` fill one AVX-512 register, two AVX2 or four SSE registers).
const LANES: usize = 16;

/// Whether `bytes` can be viewed in place as a `[T]`: a little-endian host (the buffer's encoding
/// is the native one) and an address aligned for `T`.
#[inline(always)]
fn viewable<T: Elem>(bytes: &[u8]) -> bool {
    cfg!(target_endian = "little") && bytes.as_ptr().align_offset(align_of::<T>()) == 0
}

/// `acc[i] = f(acc[i], inc[i])` over equally long typed slices.
///
/// Written as fixed-width steps of [`LANES`] elements plus a tail: the inner loop has a constant
/// trip count, so LLVM vectorizes it whatever it concludes about the outer one.
#[inline(always)]
pub(crate) fn zip_in_place<T: Copy>(acc: &mut [T], inc: &[T], f: impl Fn(T, T) -> T + Copy) {
    debug_assert_eq!(acc.len(), inc.len());
    let mut acc_steps = acc.chunks_exact_mut(LANES);
    let mut inc_steps = inc.chunks_exact(LANES);
    for (a, b) in acc_steps.by_ref().zip(inc_steps.by_ref()) {
        for (x, y) in a.iter_mut().zip(b) {
            *x = f(*x, *y);
        }
    }
    let tail = acc_steps.into_remainder().iter_mut();
    for (x, y) in tail.zip(inc_steps.remainder()) {
        *x = f(*x, *y);
    }
}

/// `dst[i] = f(a[i], b[i])` over equally long typed slices (see [`zip_in_place`]).
#[inline(always)]
pub(crate) fn zip_into<T: Copy>(dst: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T + Copy) {
    debug_assert!(dst.len() == a.len() && a.len() == b.len());
    let mut dst_steps = dst.chunks_exact_mut(LANES);
    let mut a_steps = a.chunks_exact(LANES);
    let mut b_steps = b.chunks_exact(LANES);
    for ((d, x), y) in dst_steps
        .by_ref()
        .zip(a_steps.by_ref())
        .zip(b_steps.by_ref())
    {
        for ((d, x), y) in d.iter_mut().zip(x).zip(y) {
            *d = f(*x, *y);
        }
    }
    let tail = dst_steps.into_remainder().iter_mut();
    for ((d, x), y) in tail.zip(a_steps.remainder()).zip(b_steps.remainder()) {
        *d = f(*x, *y);
    }
}

/// `buf[i] = f(buf[i])` over a typed slice (see [`zip_in_place`]).
#[inline(always)]
pub(crate) fn map_in_place<T: Copy>(buf: &mut [T], f: impl Fn(T) -> T + Copy) {
    let mut steps = buf.chunks_exact_mut(LANES);
    for s in steps.by_ref() {
        for x in s.iter_mut() {
            *x = f(*x);
        }
    }
    for x in steps.into_remainder() {
        *x = f(*x);
    }
}

/// [`zip_in_place`] over byte buffers holding `T`s.
#[inline(always)]
pub(crate) fn bytes_in_place<T: Elem>(acc: &mut [u8], inc: &[u8], f: impl Fn(T, T) -> T + Copy) {
    if viewable::<T>(acc) && viewable::<T>(inc) {
        zip_in_place(bytemuck::cast_slice_mut(acc), bytemuck::cast_slice(inc), f);
        return;
    }
    let acc = acc.chunks_exact_mut(size_of::<T>());
    for (x, y) in acc.zip(inc.chunks_exact(size_of::<T>())) {
        f(T::load_le(x), T::load_le(y)).store_le(x);
    }
}

/// [`zip_into`] over byte buffers holding `T`s.
#[inline(always)]
pub(crate) fn bytes_into<T: Elem>(
    dst: &mut [u8],
    a: &[u8],
    b: &[u8],
    f: impl Fn(T, T) -> T + Copy,
) {
    if viewable::<T>(dst) && viewable::<T>(a) && viewable::<T>(b) {
        let dst = bytemuck::cast_slice_mut(dst);
        zip_into(dst, bytemuck::cast_slice(a), bytemuck::cast_slice(b), f);
        return;
    }
    let size = size_of::<T>();
    let dst = dst.chunks_exact_mut(size);
    for ((d, x), y) in dst.zip(a.chunks_exact(size)).zip(b.chunks_exact(size)) {
        f(T::load_le(x), T::load_le(y)).store_le(d);
    }
}

/// [`map_in_place`] over a byte buffer holding `T`s.
#[inline(always)]
pub(crate) fn bytes_map<T: Elem>(buf: &mut [u8], f: impl Fn(T) -> T + Copy) {
    if viewable::<T>(buf) {
        map_in_place(bytemuck::cast_slice_mut(buf), f);
        return;
    }
    for x in buf.chunks_exact_mut(size_of::<T>()) {
        f(T::load_le(x)).store_le(x);
    }
}
