//! The loops compiled for AVX2, and binary16 kernels on the F16C conversion instructions.
//!
//! Everything here is safe code except the calls into `#[target_feature]` functions, which are
//! sound exactly when the CPU has the features. An [`Avx2`] token can only be obtained from
//! [`Avx2::detect`], which checks them at run time, so each of those calls is justified by the
//! token it is made through.

use std::arch::x86_64::{_MM_FROUND_TO_NEAREST_INT, _mm256_cvtph_ps, _mm256_cvtps_ph};

use crate::kernel::{Backend, bytes_in_place, bytes_into, bytes_map};
use crate::ops::{Elem, F16, Half, through_f32};

/// Proof that the CPU supports AVX2 and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The token, when the CPU has AVX2 and F16C (`std` caches the detection).
    #[inline]
    pub(crate) fn detect() -> Option<Avx2> {
        let ok = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
        ok.then_some(Avx2(()))
    }
}

impl Backend for Avx2 {
    fn fold<T: Elem>(self, acc: &mut [u8], inc: &[u8], f: impl Fn(T, T) -> T + Copy) {
        // SAFETY: `self` exists only if `Avx2::detect` found AVX2 and F16C on this CPU.
        unsafe { in_place_avx2(acc, inc, f) }
    }

    fn combine<T: Elem>(self, dst: &mut [u8], a: &[u8], b: &[u8], f: impl Fn(T, T) -> T + Copy) {
        // SAFETY: `self` exists only if `Avx2::detect` found AVX2 and F16C on this CPU.
        unsafe { into_avx2(dst, a, b, f) }
    }

    fn map<T: Elem>(self, buf: &mut [u8], f: impl Fn(T) -> T + Copy) {
        // SAFETY: `self` exists only if `Avx2::detect` found AVX2 and F16C on this CPU.
        unsafe { map_avx2(buf, f) }
    }

    fn half_fold<H: Half>(self, acc: &mut [u8], inc: &[u8], f: impl Fn(f32, f32) -> f32 + Copy) {
        if H::BINARY16 {
            // SAFETY: `self` exists only if `Avx2::detect` found AVX2 and F16C on this CPU.
            unsafe { f16c_in_place(acc, inc, f) }
        } else {
            self.fold(acc, inc, through_f32::<H>(f));
        }
    }

    fn half_combine<H: Half>(
        self,
        dst: &mut [u8],
        a: &[u8],
        b: &[u8],
        f: impl Fn(f32, f32) -> f32 + Copy,
    ) {
        if H::BINARY16 {
            // SAFETY: `self` exists only if `Avx2::detect` found AVX2 and F16C on this CPU.
            unsafe { f16c_into(dst, a, b, f) }
        } else {
            self.combine(dst, a, b, through_f32::<H>(f));
        }
    }

    fn half_map<H: Half>(self, buf: &mut [u8], f: impl Fn(f32) -> f32 + Copy) {
        if H::BINARY16 {
            // SAFETY: `self` exists only if `Avx2::detect` found AVX2 and F16C on this CPU.
            unsafe { f16c_map(buf, f) }
        } else {
            self.map(buf, move |h: u16| H::narrow(f(H::widen(h))));
        }
    }
}

/// [`bytes_in_place`] compiled for AVX2.
#[target_feature(enable = "avx2,f16c")]
fn in_place_avx2<T: Elem>(acc: &mut [u8], inc: &[u8], f: impl Fn(T, T) -> T + Copy) {
    bytes_in_place(acc, inc, f);
}

/// [`bytes_into`] compiled for AVX2.
#[target_feature(enable = "avx2,f16c")]
fn into_avx2<T: Elem>(dst: &mut [u8], a: &[u8], b: &[u8], f: impl Fn(T, T) -> T + Copy) {
    bytes_into(dst, a, b, f);
}

/// [`bytes_map`] compiled for AVX2.
#[target_feature(enable = "avx2,f16c")]
fn map_avx2<T: Elem>(buf: &mut [u8], f: impl Fn(T) -> T + Copy) {
    bytes_map(buf, f);
}

/// Bytes of eight binary16 values, one F16C conversion.
const STEP: usize = 16;

/// Eight little-endian binary16 values widened to `f32` (`vcvtph2ps`; any alignment).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn widen8(bytes: &[u8]) -> [f32; 8] {
    let h: [u8; STEP] = bytes.try_into().expect("one step of halves");
    bytemuck::cast(_mm256_cvtph_ps(bytemuck::cast(h)))
}

/// Eight `f32` rounded to binary16, nearest-even, stored little-endian (`vcvtps2ph`).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn narrow8(x: [f32; 8], bytes: &mut [u8]) {
    let h: [u8; STEP] = bytemuck::cast(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(
        bytemuck::cast(x),
    ));
    bytes.copy_from_slice(&h);
}

/// `acc[i] = f(acc[i], inc[i])` over binary16 buffers, eight at a time through F16C; the
/// operator runs on `[f32; 8]`, which LLVM turns into one AVX operation. The last few elements
/// take the portable conversions, which round identically.
#[target_feature(enable = "avx2,f16c")]
fn f16c_in_place(acc: &mut [u8], inc: &[u8], f: impl Fn(f32, f32) -> f32 + Copy) {
    let mut acc_steps = acc.chunks_exact_mut(STEP);
    let mut inc_steps = inc.chunks_exact(STEP);
    for (a, b) in acc_steps.by_ref().zip(inc_steps.by_ref()) {
        let (x, y) = (widen8(a), widen8(b));
        narrow8(std::array::from_fn(|i| f(x[i], y[i])), a);
    }
    let (acc, inc) = (acc_steps.into_remainder(), inc_steps.remainder());
    bytes_in_place(acc, inc, through_f32::<F16>(f));
}

/// `dst[i] = f(a[i], b[i])` over binary16 buffers (see [`f16c_in_place`]).
#[target_feature(enable = "avx2,f16c")]
fn f16c_into(dst: &mut [u8], a: &[u8], b: &[u8], f: impl Fn(f32, f32) -> f32 + Copy) {
    let mut dst_steps = dst.chunks_exact_mut(STEP);
    let mut a_steps = a.chunks_exact(STEP);
    let mut b_steps = b.chunks_exact(STEP);
    for ((d, a), b) in dst_steps
        .by_ref()
        .zip(a_steps.by_ref())
        .zip(b_steps.by_ref())
    {
        let (x, y) = (widen8(a), widen8(b));
        narrow8(std::array::from_fn(|i| f(x[i], y[i])), d);
    }
    let dst = dst_steps.into_remainder();
    bytes_into(
        dst,
        a_steps.remainder(),
        b_steps.remainder(),
        through_f32::<F16>(f),
    );
}

/// `buf[i] = f(buf[i])` over a binary16 buffer (see [`f16c_in_place`]).
#[target_feature(enable = "avx2,f16c")]
fn f16c_map(buf: &mut [u8], f: impl Fn(f32) -> f32 + Copy) {
    let mut steps = buf.chunks_exact_mut(STEP);
    for s in steps.by_ref() {
        let x = widen8(s);
        narrow8(x.map(f), s);
    }
    bytes_map(steps.into_remainder(), move |h: u16| {
        F16::narrow(f(F16::widen(h)))
    });
}

/// Copies `src` into `dst` with non-temporal stores for the 16-byte aligned middle of `dst`
/// (the ends go through an ordinary copy), then fences, so the stores are visible to other
/// cores in program order like ordinary ones.
///
/// # Panics
///
/// If the lengths differ.
pub(crate) fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    let body = (dst.len() - head) & !63;
    dst[..head].copy_from_slice(&src[..head]);
    let (d, s) = (&mut dst[head..head + body], &src[head..head + body]);
    for (dc, sc) in d.chunks_exact_mut(64).zip(s.chunks_exact(64)) {
        let dp = dc.as_mut_ptr().cast::<__m128i>();
        let sp = sc.as_ptr().cast::<__m128i>();
        // SAFETY: both chunks are 64 bytes long; `dp` is 16-byte aligned (`head` made it so
        // and the chunks are multiples of 16); `_mm_loadu_si128` takes any alignment; SSE2 is
        // part of the x86-64 baseline.
        unsafe {
            let (a, b) = (_mm_loadu_si128(sp), _mm_loadu_si128(sp.add(1)));
            let (c, e) = (_mm_loadu_si128(sp.add(2)), _mm_loadu_si128(sp.add(3)));
            _mm_stream_si128(dp, a);
            _mm_stream_si128(dp.add(1), b);
            _mm_stream_si128(dp.add(2), c);
            _mm_stream_si128(dp.add(3), e);
        }
    }
    dst[head + body..].copy_from_slice(&src[head + body..]);
    // SAFETY: SSE is part of the x86-64 baseline.
    unsafe { _mm_sfence() };
}
