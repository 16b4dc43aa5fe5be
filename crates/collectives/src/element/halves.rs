//! Reductions of the 16-bit floats at memory speed, not conversion speed.
//!
//! Both types are reduced in `f32` and rounded back after each step, as gloo
//! does. Done element by element through `half`'s conversions, an `f16` sum
//! ran at 0.45 GB/s and a `bf16` sum at 4 GB/s on this project's test VM (an
//! `f32` sum: 42 GB/s), so a 64 MiB `f16` all_reduce was bound by the
//! reduction and ran at 0.4–0.7x gloo. Here:
//!
//! - **`f16`** is widened and narrowed [`CHUNK`] elements at a time into
//!   `f32` scratch on the stack, the reduction running on the scratch. On
//!   x86-64 with F16C and AVX (checked once, at run time) the conversions
//!   are `vcvtph2ps`/`vcvtps2ph`, eight elements per instruction, and the
//!   whole loop is compiled for AVX; elsewhere they are `half`'s slice
//!   conversions.
//! - **`bf16`** is the top half of an `f32`: widening is a shift, and
//!   narrowing rounds to nearest even with integer arithmetic and no branch
//!   ([`narrow_bf16`]), so the compiler vectorises the loop. On x86-64 with
//!   AVX2 (checked at run time) it is compiled a second time for AVX2.
//!
//! Results are bit for bit those of `half`'s own conversions (rounding to
//! nearest even; NaN stays NaN, its payload aside), which the tests check
//! over every class of input.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Elements converted per round: two `f32` scratch buffers of 4 KiB each.
const CHUNK: usize = 1024;

/// `acc[i] = f(acc[i], other[i])` in `f32`, for `f16`.
#[inline(always)]
pub(super) fn zip_f16(acc: &mut [f16], other: &[f16], f: impl Fn(f32, f32) -> f32 + Copy) {
    debug_assert_eq!(acc.len(), other.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { x86::zip_f16(acc, other, f) };
    }
    zip_f16_portable(acc, other, f)
}

/// `acc[i] = f(acc[i])` in `f32`, for `f16`.
pub(super) fn map_f16(acc: &mut [f16], f: impl Fn(f32) -> f32 + Copy) {
    // The same kernel, a copy of each chunk standing in for the unused
    // operand.
    let mut copy = [f16::ZERO; CHUNK];
    for a in acc.chunks_mut(CHUNK) {
        let c = &mut copy[..a.len()];
        c.copy_from_slice(a);
        zip_f16(a, c, move |v, _| f(v));
    }
}

fn zip_f16_portable(acc: &mut [f16], other: &[f16], f: impl Fn(f32, f32) -> f32) {
    let (mut x, mut y) = ([0f32; CHUNK], [0f32; CHUNK]);
    for (a, b) in acc.chunks_mut(CHUNK).zip(other.chunks(CHUNK)) {
        let (x, y) = (&mut x[..a.len()], &mut y[..a.len()]);
        a.convert_to_f32_slice(x);
        b.convert_to_f32_slice(y);
        for (p, q) in x.iter_mut().zip(y.iter()) {
            *p = f(*p, *q);
        }
        a.convert_from_f32_slice(x);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
        _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };

    use half::{bf16, f16};

    use super::CHUNK;

    /// [`super::zip_f16`] with F16C conversions, the loop compiled for AVX.
    ///
    /// # Safety
    ///
    /// The CPU must have F16C and AVX.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn zip_f16(acc: &mut [f16], other: &[f16], f: impl Fn(f32, f32) -> f32) {
        let (mut x, mut y) = ([0f32; CHUNK], [0f32; CHUNK]);
        for (a, b) in acc.chunks_mut(CHUNK).zip(other.chunks(CHUNK)) {
            let k = a.len();
            // SAFETY: the caller's promise of the features.
            unsafe {
                widen(a, &mut x[..k]);
                widen(b, &mut y[..k]);
            }
            for (p, q) in x[..k].iter_mut().zip(&y[..k]) {
                *p = f(*p, *q);
            }
            // SAFETY: as above.
            unsafe { narrow(&x[..k], a) };
        }
    }

    /// # Safety
    ///
    /// The CPU must have F16C and AVX. (`unsafe fn`: safe functions with
    /// target features need Rust 1.86, and the workspace supports 1.85.)
    #[target_feature(enable = "avx,f16c")]
    unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        let mut s8 = src.chunks_exact(8);
        let mut d8 = dst.chunks_exact_mut(8);
        for (s, d) in (&mut s8).zip(&mut d8) {
            // SAFETY: eight `f16` (16 bytes) in, eight `f32` (32 bytes) out,
            // unaligned loads and stores.
            unsafe {
                let h = _mm_loadu_si128(s.as_ptr().cast::<__m128i>());
                _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
        }
        for (s, d) in s8.remainder().iter().zip(d8.into_remainder()) {
            *d = s.to_f32();
        }
    }

    /// # Safety
    ///
    /// As [`widen`].
    #[target_feature(enable = "avx,f16c")]
    unsafe fn narrow(src: &[f32], dst: &mut [f16]) {
        let mut s8 = src.chunks_exact(8);
        let mut d8 = dst.chunks_exact_mut(8);
        for (s, d) in (&mut s8).zip(&mut d8) {
            // SAFETY: as in `widen`, the other way.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.as_ptr()));
                _mm_storeu_si128(d.as_mut_ptr().cast::<__m128i>(), h);
            }
        }
        for (s, d) in s8.remainder().iter().zip(d8.into_remainder()) {
            *d = f16::from_f32(*s);
        }
    }

    /// [`super::zip_bf16`]'s loop compiled for AVX2.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn zip_bf16(acc: &mut [bf16], other: &[bf16], f: impl Fn(f32, f32) -> f32) {
        super::zip_bf16_any(acc, other, f)
    }
}

/// `bf16` to `f32`: exact.
#[inline(always)]
fn widen_bf16(b: bf16) -> f32 {
    f32::from_bits(u32::from(b.to_bits()) << 16)
}

/// `f32` to `bf16`, rounding to nearest even, NaN kept NaN (its top
/// mantissa bit set): `bf16::from_f32` without its branches.
#[inline(always)]
fn narrow_bf16(f: f32) -> bf16 {
    let x = f.to_bits();
    let nan = x & 0x7fff_ffff > 0x7f80_0000;
    // Adding 0x7fff, plus one when the kept part is odd, carries into the
    // kept part exactly when rounding to nearest even rounds up.
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let quiet = ((x >> 16) as u16) | 0x0040;
    bf16::from_bits(if nan { quiet } else { rounded })
}

#[inline(always)]
fn zip_bf16_any(acc: &mut [bf16], other: &[bf16], f: impl Fn(f32, f32) -> f32) {
    debug_assert_eq!(acc.len(), other.len());
    for (a, b) in acc.iter_mut().zip(other) {
        *a = narrow_bf16(f(widen_bf16(*a), widen_bf16(*b)));
    }
}

/// `acc[i] = f(acc[i], other[i])` in `f32`, for `bf16`.
#[inline(always)]
pub(super) fn zip_bf16(acc: &mut [bf16], other: &[bf16], f: impl Fn(f32, f32) -> f32 + Copy) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has the feature the function is compiled for.
        return unsafe { x86::zip_bf16(acc, other, f) };
    }
    zip_bf16_any(acc, other, f)
}

/// `acc[i] = f(acc[i])` in `f32`, for `bf16`.
pub(super) fn map_bf16(acc: &mut [bf16], f: impl Fn(f32) -> f32) {
    for a in acc {
        *a = narrow_bf16(f(widen_bf16(*a)));
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Every class of `f32`: zeros, subnormals, normals near each type's
    /// limits and rounding ties, infinities, NaNs of either sign and payload;
    /// and a sweep of every 9,973rd bit pattern.
    fn specimens() -> Vec<f32> {
        let mut v: Vec<f32> = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffc1_2345),
            f32::from_bits(0x0000_0001),
            f32::from_bits(0x3f80_8000), // a bf16 tie, even below
            f32::from_bits(0x3f81_8000), // a bf16 tie, odd below
            f32::from_bits(0x7f7f_ffff), // rounds to infinity in bf16
            65504.0,                     // f16::MAX
            65520.0,                     // rounds to infinity in f16
            6.1e-5,
            5.96e-8, // f16's smallest subnormal
            1.0 + f32::EPSILON,
        ]
        .to_vec();
        v.extend((0..u32::MAX / 9973).map(|i| f32::from_bits(i * 9973)));
        v
    }

    fn same_bits_f16(a: f16, b: f16) -> bool {
        (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
    }

    #[test]
    fn bf16_narrowing_is_half_s_bit_for_bit() {
        for f in specimens() {
            assert_eq!(
                narrow_bf16(f).to_bits(),
                bf16::from_f32(f).to_bits(),
                "{f:e} ({:#010x})",
                f.to_bits()
            );
        }
    }

    /// The kernels against `half`'s element-by-element conversions, at
    /// lengths around the chunk and vector widths.
    fn check_both(xs: &[f32], ys: &[f32]) {
        let ops: [fn(f32, f32) -> f32; 3] = [|a, b| a + b, |a, b| a * b, f32::max];
        for f in ops {
            let (a, b): (Vec<f16>, Vec<f16>) = (
                xs.iter().map(|&x| f16::from_f32(x)).collect(),
                ys.iter().map(|&y| f16::from_f32(y)).collect(),
            );
            let want: Vec<f16> = a
                .iter()
                .zip(&b)
                .map(|(p, q)| f16::from_f32(f(p.to_f32(), q.to_f32())))
                .collect();
            let mut got = a.clone();
            zip_f16(&mut got, &b, f);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(same_bits_f16(*g, *w), "f16 #{i}: {g} vs {w}");
            }
            let mut portable = a.clone();
            zip_f16_portable(&mut portable, &b, f);
            for (i, (g, w)) in portable.iter().zip(&want).enumerate() {
                assert!(same_bits_f16(*g, *w), "portable f16 #{i}: {g} vs {w}");
            }

            let (a, b): (Vec<bf16>, Vec<bf16>) = (
                xs.iter().map(|&x| bf16::from_f32(x)).collect(),
                ys.iter().map(|&y| bf16::from_f32(y)).collect(),
            );
            let want: Vec<bf16> = a
                .iter()
                .zip(&b)
                .map(|(p, q)| bf16::from_f32(f(p.to_f32(), q.to_f32())))
                .collect();
            let mut got = a.clone();
            zip_bf16(&mut got, &b, f);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits(),
                    "bf16 #{i}: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn kernels_match_element_by_element_on_every_class() {
        let xs = specimens();
        let mut ys = xs.clone();
        ys.rotate_left(7);
        check_both(&xs, &ys);
        // Lengths off the vector and chunk widths.
        for len in [0, 1, 7, 8, 9, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5] {
            check_both(&xs[..len], &ys[..len]);
        }
    }

    #[test]
    fn maps_divide_like_half() {
        let xs = specimens();
        let mut a: Vec<f16> = xs.iter().map(|&x| f16::from_f32(x)).collect();
        let want: Vec<f16> = a.iter().map(|v| f16::from_f32(v.to_f32() / 3.0)).collect();
        map_f16(&mut a, |v| v / 3.0);
        assert!(a.iter().zip(&want).all(|(g, w)| same_bits_f16(*g, *w)));
        let mut b: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
        let want: Vec<bf16> = b.iter().map(|v| bf16::from_f32(v.to_f32() / 3.0)).collect();
        map_bf16(&mut b, |v| v / 3.0);
        assert!(b
            .iter()
            .zip(&want)
            .all(|(g, w)| (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits()));
    }

    proptest! {
        #[test]
        fn random_bits_reduce_like_half(pairs in proptest::collection::vec((any::<u32>(), any::<u32>()), 0..3000)) {
            let (xs, ys): (Vec<f32>, Vec<f32>) =
                pairs.iter().map(|&(x, y)| (f32::from_bits(x), f32::from_bits(y))).unzip();
            check_both(&xs, &ys);
        }
    }
}
