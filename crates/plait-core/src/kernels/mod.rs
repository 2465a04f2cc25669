//! Reduce kernels: combine byte buffers holding `DType` elements, element by element.
//!
//! Each call dispatches on (dtype, op) exactly once, into a loop monomorphized for that element
//! type and combiner, so the per-element work is a single arithmetic op LLVM can vectorize.
//!
//! Buffers come straight from user tensors and wire frames, so they may be misaligned for the
//! element type. Aligned buffers are reinterpreted in place; misaligned ones are copied through
//! stack blocks of `BLOCK` elements (a memcpy, so still a straight vectorizable loop).
//!
//! f16 and bf16 are widened to f32 a block at a time (half's slice converters use F16C when the
//! CPU has it), combined in f32 and rounded once back to the storage type.
//!
//! Semantics: integers wrap on overflow; float min/max return NaN if either side is NaN
//! (like `torch.minimum`); bool is 0/1 with sum/max = or, prod/min = and, and any nonzero input
//! counts as true. Bitwise ops on float dtypes (which `ReduceOp::supports` rejects) act on the
//! raw bit patterns rather than panicking.

use crate::dtype::{DType, ReduceOp};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::marker::PhantomData;
use std::mem::size_of;

pub mod hash;
#[cfg(test)]
mod tests;

/// Elements per stack block: big enough to amortise loop overhead, small enough (6 KiB for
/// three i64 blocks) to stay in L1 and on any thread's stack.
const BLOCK: usize = 256;

/// Copies `src` to `dst` (same length) with streaming stores where the CPU has them: the copy
/// is written to memory without passing through the cache. For copies nobody reads soon (the
/// output kept for restoring after a failure), so they neither evict the data a transfer is
/// about to use nor pay a read of the destination first.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Up to the first 16-byte aligned byte of dst, then whole aligned blocks, then the tail.
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let blocks = (dst.len() - head) / 16;
        // SAFETY: x86_64 always has SSE2; every block lies inside both slices, dst blocks are
        // 16-byte aligned (as _mm_stream_si128 requires), src loads are unaligned loads.
        unsafe {
            let d = dst.as_mut_ptr().add(head) as *mut __m128i;
            let s = src.as_ptr().add(head) as *const __m128i;
            for k in 0..blocks {
                _mm_stream_si128(d.add(k), _mm_loadu_si128(s.add(k)));
            }
            _mm_sfence();
        }
        let done = head + blocks * 16;
        dst[done..].copy_from_slice(&src[done..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// dst[i] = dst[i] (+) src[i], where (+) is `op.combiner()`. Byte slices hold `dtype` elements
/// in native byte order. Mismatched lengths are a caller bug (debug assertion); release builds
/// process the whole elements common to both.
pub fn reduce_into(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    debug_assert_eq!(dst.len(), src.len(), "reduce_into: length mismatch");
    debug_assert_eq!(dst.len() % dtype.size(), 0, "reduce_into: partial element");
    dispatch(
        Operands {
            dst,
            lhs: None,
            rhs: src,
        },
        dtype,
        op,
    );
}

/// dst[i] = a[i] (+) b[i]. `dst` must not alias `a` or `b` (the borrow rules already ensure it
/// for safe callers). Length rules as for [`reduce_into`].
pub fn reduce_from(dst: &mut [u8], a: &[u8], b: &[u8], dtype: DType, op: ReduceOp) {
    debug_assert!(
        dst.len() == a.len() && a.len() == b.len(),
        "reduce_from: length mismatch"
    );
    debug_assert_eq!(dst.len() % dtype.size(), 0, "reduce_from: partial element");
    dispatch(
        Operands {
            dst,
            lhs: Some(a),
            rhs: b,
        },
        dtype,
        op,
    );
}

/// Applied once to the final reduced buffer, so every rank rounds the same way: `Avg` divides by
/// `nranks`, `PremulSum(f)` multiplies by `f`; every other op is a no-op.
///
/// Floats compute in their own precision (f16/bf16 in f32, rounded once). For integer dtypes,
/// which `ReduceOp::supports` rejects for these ops, `Avg` truncates toward zero like C integer
/// division and `PremulSum` leaves the buffer alone; bool is never changed. `nranks == 0` is a
/// no-op.
pub fn finalize(buf: &mut [u8], dtype: DType, op: ReduceOp, nranks: usize) {
    let scale = match op {
        ReduceOp::Avg if nranks > 1 => Scale::Div(nranks),
        ReduceOp::PremulSum(f) => Scale::Mul(f),
        _ => return,
    };
    match dtype {
        DType::F16 => float_scale::<f32>(scale, Widened::<f16>(buf, PhantomData)),
        DType::BF16 => float_scale::<f32>(scale, Widened::<bf16>(buf, PhantomData)),
        DType::F32 => float_scale::<f32>(scale, Direct(buf)),
        DType::F64 => float_scale::<f64>(scale, Direct(buf)),
        DType::I8 => int_scale::<i8>(scale, buf),
        DType::U8 => int_scale::<u8>(scale, buf),
        DType::I16 => int_scale::<i16>(scale, buf),
        DType::I32 => int_scale::<i32>(scale, buf),
        DType::I64 => int_scale::<i64>(scale, buf),
        DType::Bool => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Dispatch: pick the element type and combiner once, then run a monomorphized loop.

fn dispatch(o: Operands<'_, '_>, dtype: DType, op: ReduceOp) {
    let op = op.combiner();
    let bitwise = matches!(op, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor);
    match dtype {
        DType::F16 | DType::BF16 if bitwise => int::<u16>(op, o),
        DType::F16 => float::<f32>(op, WidenedZip::<f16>(o, PhantomData)),
        DType::BF16 => float::<f32>(op, WidenedZip::<bf16>(o, PhantomData)),
        DType::F32 if bitwise => int::<u32>(op, o),
        DType::F32 => float::<f32>(op, o),
        DType::F64 if bitwise => int::<u64>(op, o),
        DType::F64 => float::<f64>(op, o),
        DType::I8 => int::<i8>(op, o),
        DType::U8 => int::<u8>(op, o),
        DType::I16 => int::<i16>(op, o),
        DType::I32 => int::<i32>(op, o),
        DType::I64 => int::<i64>(op, o),
        DType::Bool => boolean(op, o),
    }
}

/// Something that runs a binary combiner over its buffers. Generic in `F` so every combiner gets
/// its own inlined loop.
trait Zip<T> {
    fn zip<F: Fn(T, T) -> T + Copy>(self, f: F);
}

/// Something that applies a unary function over its buffer.
trait Map<T> {
    fn map<F: Fn(T) -> T + Copy>(self, f: F);
}

fn float<T: Float>(op: ReduceOp, z: impl Zip<T>) {
    match op {
        ReduceOp::Prod => z.zip(|a, b| a * b),
        // `a < b` is false when either is NaN, so a NaN `b` falls through to `b`, and a NaN `a`
        // is caught explicitly. Both are plain selects, which vectorize (unlike f32::min,
        // which drops NaNs).
        ReduceOp::Min => z.zip(|a, b| if a.is_nan() || a < b { a } else { b }),
        ReduceOp::Max => z.zip(|a, b| if a.is_nan() || a > b { a } else { b }),
        // Sum; bitwise ops never reach here (dispatch sends them to `int`).
        _ => z.zip(|a, b| a + b),
    }
}

fn int<T: Int>(op: ReduceOp, z: impl Zip<T>) {
    match op {
        ReduceOp::Prod => z.zip(T::wrapping_mul),
        ReduceOp::Min => z.zip(Ord::min),
        ReduceOp::Max => z.zip(Ord::max),
        ReduceOp::BAnd => z.zip(|a, b| a & b),
        ReduceOp::BOr => z.zip(|a, b| a | b),
        ReduceOp::BXor => z.zip(|a, b| a ^ b),
        _ => z.zip(T::wrapping_add),
    }
}

fn boolean(op: ReduceOp, z: impl Zip<u8>) {
    // Non-short-circuit `&`/`|`/`^` on bools keep the loop branch-free.
    match op {
        ReduceOp::Prod | ReduceOp::Min | ReduceOp::BAnd => {
            z.zip(|a, b| ((a != 0) & (b != 0)) as u8)
        }
        ReduceOp::BXor => z.zip(|a, b| ((a != 0) ^ (b != 0)) as u8),
        _ => z.zip(|a, b| ((a | b) != 0) as u8),
    }
}

#[derive(Clone, Copy)]
enum Scale {
    Div(usize),
    Mul(f64),
}

fn float_scale<T: Float>(scale: Scale, m: impl Map<T>) {
    match scale {
        Scale::Div(n) => {
            let n = T::from_f64(n as f64);
            m.map(move |x| x / n)
        }
        Scale::Mul(f) => {
            let f = T::from_f64(f);
            m.map(move |x| x * f)
        }
    }
}

fn int_scale<T: Int>(scale: Scale, buf: &mut [u8]) {
    if let Scale::Div(n) = scale {
        // In i64 so that `n` never wraps in a narrow type; |x / n| <= |x| so the result fits.
        let n = n.min(i64::MAX as usize) as i64;
        Direct(buf).map(move |x: T| T::from_i64(x.to_i64() / n));
    }
}

// ---------------------------------------------------------------------------------------------
// Element types.

/// # Safety
/// Implementors are plain old data: no padding and every bit pattern is a valid value, so byte
/// slices may be reinterpreted as `[Self]` and back.
unsafe trait Pod: Copy + Default + 'static {}

macro_rules! pod {
    ($($t:ty),*) => { $(unsafe impl Pod for $t {})* };
}
pod!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64, f16, bf16);

trait Float:
    Pod
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    fn is_nan(self) -> bool;
    fn from_f64(v: f64) -> Self;
}

impl Float for f32 {
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Float for f64 {
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}

trait Int:
    Pod
    + Ord
    + std::ops::BitAnd<Output = Self>
    + std::ops::BitOr<Output = Self>
    + std::ops::BitXor<Output = Self>
{
    fn wrapping_add(self, o: Self) -> Self;
    fn wrapping_mul(self, o: Self) -> Self;
    fn to_i64(self) -> i64;
    fn from_i64(v: i64) -> Self;
}

macro_rules! int_impl {
    ($($t:ty),*) => {$(
        impl Int for $t {
            fn wrapping_add(self, o: Self) -> Self { <$t>::wrapping_add(self, o) }
            fn wrapping_mul(self, o: Self) -> Self { <$t>::wrapping_mul(self, o) }
            fn to_i64(self) -> i64 { self as i64 }
            fn from_i64(v: i64) -> Self { v as $t }
        }
    )*};
}
int_impl!(u8, i8, u16, i16, u32, i32, u64, i64);

/// Storage types computed in f32.
trait Half: Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

macro_rules! half_impl {
    ($($t:ty),*) => {$(
        impl Half for $t {
            fn widen(src: &[Self], dst: &mut [f32]) { src.convert_to_f32_slice(dst) }
            fn narrow(src: &[f32], dst: &mut [Self]) { dst.convert_from_f32_slice(src) }
        }
    )*};
}
half_impl!(f16, bf16);

// ---------------------------------------------------------------------------------------------
// Byte views.

fn cast<T: Pod>(bytes: &[u8]) -> Option<&[T]> {
    if !bytes.as_ptr().cast::<T>().is_aligned() {
        return None;
    }
    // SAFETY: aligned, length rounded down to whole elements, T is Pod.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / size_of::<T>()) })
}

fn cast_mut<T: Pod>(bytes: &mut [u8]) -> Option<&mut [T]> {
    if !bytes.as_ptr().cast::<T>().is_aligned() {
        return None;
    }
    // SAFETY: as in `cast`, and the unique borrow of `bytes` moves into the result.
    Some(unsafe {
        std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), bytes.len() / size_of::<T>())
    })
}

fn as_bytes<T: Pod>(s: &[T]) -> &[u8] {
    // SAFETY: T is Pod (no padding), u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

fn as_bytes_mut<T: Pod>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: T is Pod, so any bytes written are a valid T.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

/// `bytes` as `[T]`: borrowed in place when aligned, else copied into `scratch`.
fn view<'a, T: Pod>(bytes: &'a [u8], scratch: &'a mut [T]) -> &'a [T] {
    match cast(bytes) {
        Some(s) => s,
        None => {
            let s = &mut scratch[..bytes.len() / size_of::<T>()];
            as_bytes_mut(s).copy_from_slice(bytes);
            s
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Loops. `#[inline(always)]` so each combiner closure is inlined into its own copy of the loop;
// re-slicing to a common length lets LLVM drop the bounds checks.

#[inline(always)]
fn zip_into<T: Copy>(d: &mut [T], s: &[T], f: impl Fn(T, T) -> T) {
    let n = d.len().min(s.len());
    let (d, s) = (&mut d[..n], &s[..n]);
    for i in 0..n {
        d[i] = f(d[i], s[i]);
    }
}

#[inline(always)]
fn zip_from<T: Copy>(d: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    let n = d.len().min(a.len()).min(b.len());
    let (d, a, b) = (&mut d[..n], &a[..n], &b[..n]);
    for i in 0..n {
        d[i] = f(a[i], b[i]);
    }
}

#[inline(always)]
fn map_in_place<T: Copy>(d: &mut [T], f: impl Fn(T) -> T) {
    for x in d {
        *x = f(*x);
    }
}

/// The buffers of one reduce call; `lhs: None` means the left operand is `dst` itself.
struct Operands<'d, 's> {
    dst: &'d mut [u8],
    lhs: Option<&'s [u8]>,
    rhs: &'s [u8],
}

impl<'d, 's> Operands<'d, 's> {
    /// Trims every operand to the whole `size`-byte elements they all have; returns the count.
    fn trim(self, size: usize) -> (usize, Self) {
        let mut len = self.dst.len().min(self.rhs.len());
        if let Some(a) = self.lhs {
            len = len.min(a.len());
        }
        let n = len / size;
        let len = n * size;
        let o = Operands {
            dst: &mut self.dst[..len],
            lhs: self.lhs.map(|a| &a[..len]),
            rhs: &self.rhs[..len],
        };
        (n, o)
    }
}

impl<T: Pod> Zip<T> for Operands<'_, '_> {
    fn zip<F: Fn(T, T) -> T + Copy>(self, f: F) {
        let sz = size_of::<T>();
        let (n, Operands { dst, lhs, rhs }) = self.trim(sz);
        match (cast_mut::<T>(dst), lhs.map(cast::<T>), cast::<T>(rhs)) {
            (Some(d), None, Some(b)) => return zip_into(d, b, f),
            (Some(d), Some(Some(a)), Some(b)) => return zip_from(d, a, b, f),
            _ => {}
        }
        // Combining into a separate block makes `reduce_into` and `reduce_from` one path.
        let (mut sa, mut sb, mut so) = (
            [T::default(); BLOCK],
            [T::default(); BLOCK],
            [T::default(); BLOCK],
        );
        for start in (0..n).step_by(BLOCK) {
            let r = start * sz..(start + BLOCK).min(n) * sz;
            let a = view(lhs.map_or(&dst[r.clone()], |a| &a[r.clone()]), &mut sa);
            let b = view(&rhs[r.clone()], &mut sb);
            let out = &mut so[..b.len()];
            zip_from(out, a, b, f);
            dst[r].copy_from_slice(as_bytes(out));
        }
    }
}

/// f16/bf16 operands, combined in f32.
struct WidenedZip<'d, 's, H>(Operands<'d, 's>, PhantomData<H>);

impl<H: Half> Zip<f32> for WidenedZip<'_, '_, H> {
    fn zip<F: Fn(f32, f32) -> f32 + Copy>(self, f: F) {
        let sz = size_of::<H>();
        let (n, Operands { dst, lhs, rhs }) = self.0.trim(sz);
        let (mut ha, mut hb) = ([H::default(); BLOCK], [H::default(); BLOCK]);
        let (mut fa, mut fb) = ([0f32; BLOCK], [0f32; BLOCK]);
        for start in (0..n).step_by(BLOCK) {
            let m = BLOCK.min(n - start);
            let r = start * sz..(start + m) * sz;
            let (fa, fb) = (&mut fa[..m], &mut fb[..m]);
            H::widen(
                view(lhs.map_or(&dst[r.clone()], |a| &a[r.clone()]), &mut ha),
                fa,
            );
            H::widen(view(&rhs[r.clone()], &mut hb), fb);
            zip_into(fa, fb, f);
            store(&mut dst[r], fa, &mut ha);
        }
    }
}

/// Rounds `src` into `dst` bytes, through `scratch` when `dst` is misaligned.
fn store<H: Half>(dst: &mut [u8], src: &[f32], scratch: &mut [H]) {
    match cast_mut::<H>(dst) {
        Some(d) => H::narrow(src, d),
        None => {
            let s = &mut scratch[..src.len()];
            H::narrow(src, s);
            dst.copy_from_slice(as_bytes(s));
        }
    }
}

/// A whole-buffer view for `finalize`.
struct Direct<'a>(&'a mut [u8]);

impl<T: Pod> Map<T> for Direct<'_> {
    fn map<F: Fn(T) -> T + Copy>(self, f: F) {
        let sz = size_of::<T>();
        let len = self.0.len() / sz * sz;
        let buf = &mut self.0[..len];
        if let Some(s) = cast_mut::<T>(buf) {
            return map_in_place(s, f);
        }
        let mut scratch = [T::default(); BLOCK];
        for chunk in buf.chunks_mut(BLOCK * sz) {
            let s = &mut scratch[..chunk.len() / sz];
            as_bytes_mut(s).copy_from_slice(chunk);
            map_in_place(s, f);
            chunk.copy_from_slice(as_bytes(s));
        }
    }
}

struct Widened<'a, H>(&'a mut [u8], PhantomData<H>);

impl<H: Half> Map<f32> for Widened<'_, H> {
    fn map<F: Fn(f32) -> f32 + Copy>(self, f: F) {
        let sz = size_of::<H>();
        let len = self.0.len() / sz * sz;
        let mut scratch = [H::default(); BLOCK];
        let mut wide = [0f32; BLOCK];
        for chunk in self.0[..len].chunks_mut(BLOCK * sz) {
            let w = &mut wide[..chunk.len() / sz];
            H::widen(view(chunk, &mut scratch), w);
            map_in_place(w, f);
            store(chunk, w, &mut scratch);
        }
    }
}
