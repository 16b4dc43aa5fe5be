//! Element types and reductions.
//!
//! An [`Element`] is a plain number that travels as its in-memory bytes (the
//! handshake refuses a peer of the other byte order). Reductions work on whole
//! slices with the operator chosen once outside the loop, so each loop body is a
//! single arithmetic operation that the compiler vectorises. Integers wrap on
//! overflow, as PyTorch's do; floating-point `MIN`/`MAX` propagate NaN. The 16-bit
//! floats are reduced in `f32` and rounded back after each step, as gloo does.

use std::fmt;
use std::sync::{Arc, Mutex};

use half::{bf16, f16};
use rallypoint_sync::MutexExt;

mod halves;

/// The element type of a buffer, as it appears in frames and error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    U8 = 1,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    BF16,
    F32,
    F64,
}

impl DType {
    /// All types, for tests and decoders.
    pub const ALL: [DType; 12] = [
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    /// Whether this is a floating-point type (the only kind `AVG` accepts).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::U16 => "u16",
            DType::I16 => "i16",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::U64 => "u64",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        };
        f.write_str(s)
    }
}

/// PyTorch's `ReduceOp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 1,
    Product,
    Min,
    Max,
    /// The mean over the group's ranks: floating-point types only.
    Avg,
    /// Bitwise and: integer types only.
    Band,
    /// Bitwise or: integer types only.
    Bor,
    /// Bitwise exclusive or: integer types only.
    Bxor,
}

impl ReduceOp {
    /// All operators, for tests and decoders.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::Band,
        ReduceOp::Bor,
        ReduceOp::Bxor,
    ];

    pub(crate) fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL
            .get(usize::from(code).checked_sub(1)?)
            .copied()
    }

    /// Whether the operator applies to `dtype`, as PyTorch decides it.
    pub fn supports(self, dtype: DType) -> bool {
        match self {
            ReduceOp::Avg => dtype.is_float(),
            ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => !dtype.is_float(),
            _ => true,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            ReduceOp::Sum => "SUM",
            ReduceOp::Product => "PRODUCT",
            ReduceOp::Min => "MIN",
            ReduceOp::Max => "MAX",
            ReduceOp::Avg => "AVG",
            ReduceOp::Band => "BAND",
            ReduceOp::Bor => "BOR",
            ReduceOp::Bxor => "BXOR",
        };
        f.write_str(s)
    }
}

/// A number a process group can move and reduce.
///
/// # Safety
///
/// Implementors must be plain data: no padding, no pointers, every bit pattern
/// valid and alignment at most 8, so that a buffer can be sent as its bytes and a
/// received 8-byte-aligned buffer read back as `[Self]`. The crate implements it
/// for the twelve types of [`DType`]; there is no reason to implement it elsewhere.
pub unsafe trait Element: Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// The type's tag.
    const DTYPE: DType;

    /// `acc[i] = op(acc[i], other[i])`. `op` must [support](ReduceOp::supports)
    /// the type and `AVG` reduces as `SUM` (see [`Element::divide`]).
    fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]);

    /// Divides by `n` in place: the last step of `AVG`. A no-op for integers.
    fn divide(acc: &mut [Self], n: usize);

    /// A small integer as this type, for tests and examples.
    fn from_i8(v: i8) -> Self;
}

#[inline(always)]
fn zip_apply<T: Copy>(acc: &mut [T], other: &[T], f: impl Fn(T, T) -> T) {
    debug_assert_eq!(acc.len(), other.len());
    for (a, b) in acc.iter_mut().zip(other) {
        *a = f(*a, *b);
    }
}

macro_rules! int_element {
    ($($t:ty => $d:ident),*) => {$(
        // SAFETY: a primitive integer is plain data of alignment at most 8.
        unsafe impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => zip_apply(acc, other, |a, b| a.wrapping_add(b)),
                    ReduceOp::Product => zip_apply(acc, other, |a, b| a.wrapping_mul(b)),
                    ReduceOp::Min => zip_apply(acc, other, |a, b| a.min(b)),
                    ReduceOp::Max => zip_apply(acc, other, |a, b| a.max(b)),
                    ReduceOp::Band => zip_apply(acc, other, |a, b| a & b),
                    ReduceOp::Bor => zip_apply(acc, other, |a, b| a | b),
                    ReduceOp::Bxor => zip_apply(acc, other, |a, b| a ^ b),
                }
            }
            fn divide(_: &mut [Self], _: usize) {}
            fn from_i8(v: i8) -> Self {
                v as $t
            }
        }
    )*};
}

int_element!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64, i64 => I64);

/// NaN-propagating minimum and maximum, the same on every rank whatever the
/// argument order (PyTorch propagates NaN too).
macro_rules! float_minmax {
    ($a:expr, $b:expr, $cmp:tt) => {{
        let (a, b) = ($a, $b);
        if a != a {
            a
        } else if b != b || b $cmp a {
            b
        } else {
            a
        }
    }};
}

macro_rules! float_element {
    ($($t:ty => $d:ident),*) => {$(
        // SAFETY: a primitive float is plain data of alignment at most 8.
        unsafe impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => zip_apply(acc, other, |a, b| a + b),
                    ReduceOp::Product => zip_apply(acc, other, |a, b| a * b),
                    ReduceOp::Min => zip_apply(acc, other, |a, b| float_minmax!(a, b, <)),
                    ReduceOp::Max => zip_apply(acc, other, |a, b| float_minmax!(a, b, >)),
                    ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => {
                        unreachable!("bitwise reduction of a float type is refused before it runs")
                    }
                }
            }
            fn divide(acc: &mut [Self], n: usize) {
                let n = n as $t;
                for a in acc {
                    *a /= n;
                }
            }
            fn from_i8(v: i8) -> Self {
                v as $t
            }
        }
    )*};
}

float_element!(f32 => F32, f64 => F64);

/// The 16-bit floats: reduced in `f32` by the kernels in `halves.rs`.
macro_rules! half_element {
    ($($t:ty => $d:ident, $zip:path, $map:path);*) => {$(
        // SAFETY: `f16` and `bf16` are a `u16` each: plain data.
        unsafe impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => $zip(acc, other, |a, b| a + b),
                    ReduceOp::Product => $zip(acc, other, |a, b| a * b),
                    ReduceOp::Min => $zip(acc, other, |a, b| float_minmax!(a, b, <)),
                    ReduceOp::Max => $zip(acc, other, |a, b| float_minmax!(a, b, >)),
                    ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => {
                        unreachable!("bitwise reduction of a float type is refused before it runs")
                    }
                }
            }
            fn divide(acc: &mut [Self], n: usize) {
                let n = n as f32;
                $map(acc, move |a| a / n);
            }
            fn from_i8(v: i8) -> Self {
                <$t>::from_f32(f32::from(v))
            }
        }
    )*};
}

half_element!(
    f16 => F16, halves::zip_f16, halves::map_f16;
    bf16 => BF16, halves::zip_bf16, halves::map_bf16
);

/// The bytes of a slice of elements.
pub(crate) fn bytes_of<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: `Element` types are plain data with no padding.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// The bytes of a mutable slice of elements; any bytes written form valid elements.
pub(crate) fn bytes_of_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as above, and every bit pattern is a valid `Element`.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// A received payload, 8-byte aligned so that it can be read as any element type.
/// Large payloads borrow their memory from a [`Pool`] and give it back on drop, so
/// a stream of segments reuses a few cache-warm buffers instead of allocating and
/// zeroing fresh pages for each.
pub(crate) struct Buf {
    words: Vec<u64>,
    len: usize,
    /// The pool and class the words go back to.
    pool: Option<(Arc<Pool>, usize)>,
}

/// Recycled payload buffers, in two capacities.
///
/// Each class keeps as many free buffers as `keep_bytes` holds (at least
/// 32), so that it covers what can be in flight at once (the transport asks
/// for a receive window's worth, capped): with fewer kept, a sender running
/// a window ahead made each rank allocate and fault in fresh pages for most
/// segments (5,000 page faults per 64 MiB all_reduce at 4 ranks, a third
/// more CPU per op). Kept buffers are not trimmed.
///
/// The classes: the largest payload (`bytes`, a segment), and a quarter of
/// it (at least [`POOL_MIN`]) for the rest. A payload takes the smaller
/// class that holds it, so at segments up to 1 MiB (the default) no pooled
/// buffer is more than 4 times its payload (a receive window counts
/// payload bytes, and the memory it bounds should stay within a small
/// factor). Each class keeps up to `keep_bytes`, so a process whose
/// traffic peaked in both keeps up to twice that.
pub(crate) struct Pool {
    classes: [Class; 2],
}

/// Free buffers of `words` words each.
struct Class {
    words: usize,
    keep: usize,
    free: Mutex<Vec<Vec<u64>>>,
}

impl Class {
    fn new(bytes: usize, keep_bytes: usize) -> Class {
        Class {
            words: bytes.div_ceil(8),
            keep: (keep_bytes / bytes.max(1)).max(POOL_KEEP_MIN),
            free: Mutex::new(Vec::new()),
        }
    }
}

/// Buffers kept per class at least, whatever `keep_bytes` says.
const POOL_KEEP_MIN: usize = 32;
/// Payloads below this are allocated plainly (small allocations are cheap).
const POOL_MIN: usize = 64 << 10;

impl Pool {
    /// Buffers of `bytes` and of a quarter of it, each class keeping up to
    /// `keep_bytes` of them free (at least 32).
    pub(crate) fn new(bytes: usize, keep_bytes: usize) -> Arc<Pool> {
        let small = (bytes / 4).max(POOL_MIN).min(bytes);
        Arc::new(Pool {
            classes: [Class::new(small, keep_bytes), Class::new(bytes, keep_bytes)],
        })
    }

    /// A buffer of `len` bytes: pooled, from the smallest class that holds
    /// it, if it is large and fits.
    pub(crate) fn get(self: &Arc<Pool>, len: usize) -> Buf {
        let Some(class) = (len >= POOL_MIN)
            .then(|| self.classes.iter().position(|c| len.div_ceil(8) <= c.words))
            .flatten()
        else {
            return Buf::new(len);
        };
        let c = &self.classes[class];
        let words = c.free.locked().pop().unwrap_or_else(|| vec![0; c.words]);
        Buf {
            words,
            len,
            pool: Some((self.clone(), class)),
        }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some((p, class)) = self.pool.take() {
            let c = &p.classes[class];
            let mut free = c.free.locked();
            if free.len() < c.keep {
                free.push(std::mem::take(&mut self.words));
            }
        }
    }
}

impl Buf {
    pub(crate) fn new(len: usize) -> Buf {
        Buf {
            words: vec![0; len.div_ceil(8)],
            len,
            pool: None,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }

    /// The payload as elements; the caller has checked the length is a multiple
    /// of the element size.
    pub(crate) fn typed<T: Element>(&self) -> &[T] {
        let n = self.len / std::mem::size_of::<T>();
        assert_eq!(
            n * std::mem::size_of::<T>(),
            self.len,
            "payload is not whole elements"
        );
        // SAFETY: 8-byte aligned (alignment of every `Element` divides 8), `n`
        // elements fit in `len` initialised bytes, every bit pattern is valid.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<T>(), n) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d as u8), Some(d));
        }
        for op in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_code(op as u8), Some(op));
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!(DType::from_code(13), None);
        assert_eq!(ReduceOp::from_code(9), None);
    }

    #[test]
    fn supports_follows_pytorch() {
        assert!(ReduceOp::Avg.supports(DType::BF16));
        assert!(!ReduceOp::Avg.supports(DType::I32));
        assert!(ReduceOp::Bxor.supports(DType::U8));
        assert!(!ReduceOp::Band.supports(DType::F32));
        assert!(ReduceOp::Max.supports(DType::F16));
    }

    #[test]
    fn reductions() {
        let mut a = [1i8, 100, -3];
        i8::reduce(ReduceOp::Sum, &mut a, &[1, 100, 2]);
        assert_eq!(a, [2, -56, -1], "integers wrap");
        let mut f = [1.0f32, f32::NAN, 2.0];
        f32::reduce(ReduceOp::Min, &mut f, &[0.5, 1.0, f32::NAN]);
        assert_eq!(f[0], 0.5);
        assert!(
            f[1].is_nan() && f[2].is_nan(),
            "NaN propagates from either side"
        );
        let mut h = [f16::from_f32(3.0)];
        f16::reduce(ReduceOp::Product, &mut h, &[f16::from_f32(-2.0)]);
        f16::divide(&mut h, 4);
        assert_eq!(h[0].to_f32(), -1.5);
        let mut u = [0b1100u16];
        u16::reduce(ReduceOp::Bxor, &mut u, &[0b1010]);
        assert_eq!(u, [0b0110]);
    }

    #[test]
    fn buf_views() {
        let mut b = Buf::new(12);
        b.bytes_mut().copy_from_slice(bytes_of(&[1.0f32, 2.0, 3.0]));
        assert_eq!(b.typed::<f32>(), &[1.0, 2.0, 3.0]);
        assert_eq!(b.len(), 12);
    }

    #[test]
    fn a_pool_keeps_what_its_budget_holds() {
        // 100 buffers of each class in flight at once, a budget of 80 MiB:
        // 80 segments of 1 MiB are kept, and all 100 quarter-size ones.
        let pool = Pool::new(1 << 20, 80 << 20);
        drop((0..100).map(|_| pool.get(1 << 20)).collect::<Vec<_>>());
        drop((0..100).map(|_| pool.get(256 << 10)).collect::<Vec<_>>());
        assert_eq!(pool.classes[1].free.lock().unwrap().len(), 80);
        assert_eq!(pool.classes[0].free.lock().unwrap().len(), 100);
        // The floor: a budget below one buffer still keeps 32 of each.
        let small = Pool::new(1 << 20, 0);
        drop((0..40).map(|_| small.get(1 << 20)).collect::<Vec<_>>());
        drop((0..40).map(|_| small.get(100 << 10)).collect::<Vec<_>>());
        assert_eq!(small.classes[1].free.lock().unwrap().len(), POOL_KEEP_MIN);
        assert_eq!(small.classes[0].free.lock().unwrap().len(), POOL_KEEP_MIN);
    }

    #[test]
    fn pooled_buffers_are_reused() {
        let pool = Pool::new(1 << 20, 0);
        let a = pool.get(1 << 20);
        let ptr = a.bytes().as_ptr();
        drop(a);
        let b = pool.get((1 << 20) - 8);
        assert_eq!(b.bytes().as_ptr(), ptr, "the freed buffer comes back");
        assert_eq!(b.len(), (1 << 20) - 8);
        assert!(
            pool.get(100).pool.is_none(),
            "small payloads are not pooled"
        );
        assert!(
            pool.get(2 << 20).pool.is_none(),
            "nor ones above the capacity"
        );
    }

    #[test]
    fn no_pooled_buffer_is_more_than_four_times_its_payload() {
        let pool = Pool::new(1 << 20, 0);
        for len in [64 << 10, 100 << 10, 256 << 10, (256 << 10) + 8, 1 << 20] {
            let b = pool.get(len);
            assert!(b.pool.is_some(), "{len} is pooled");
            assert!(
                b.words.len() * 8 <= 4 * len,
                "{len} took {} words",
                b.words.len()
            );
            assert!(b.words.len() * 8 >= len);
        }
        // A quarter-size buffer freed comes back for a quarter-size payload,
        // never for a full one.
        let q = pool.get(200 << 10);
        let ptr = q.bytes().as_ptr();
        drop(q);
        assert_ne!(pool.get(1 << 20).bytes().as_ptr(), ptr);
        assert_eq!(pool.get(256 << 10).bytes().as_ptr(), ptr);
    }
}
