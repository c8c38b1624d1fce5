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

/// Whether `bytes` can be viewed in place as a `[T]`: a little-endian host (the buffer's encoding
/// is the native one) and an address aligned for `T`.
#[inline(always)]
fn viewable<T: Elem>(bytes: &[u8]) -> bool {
    cfg!(target_endian = "little") && bytes.as_ptr().align_offset(align_of::<T>()) == 0
}

/// `acc[i] = f(acc[i], inc[i])` over equally long typed slices.
#[inline(always)]
pub(crate) fn zip_in_place<T: Copy>(acc: &mut [T], inc: &[T], f: impl Fn(T, T) -> T + Copy) {
    debug_assert_eq!(acc.len(), inc.len());
    for (x, y) in acc.iter_mut().zip(inc) {
        *x = f(*x, *y);
    }
}

/// `dst[i] = f(a[i], b[i])` over equally long typed slices.
#[inline(always)]
pub(crate) fn zip_into<T: Copy>(dst: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T + Copy) {
    debug_assert!(dst.len() == a.len() && a.len() == b.len());
    for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
        *d = f(*x, *y);
    }
}

/// `buf[i] = f(buf[i])` over a typed slice.
#[inline(always)]
pub(crate) fn map_in_place<T: Copy>(buf: &mut [T], f: impl Fn(T) -> T + Copy) {
    for x in buf {
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
