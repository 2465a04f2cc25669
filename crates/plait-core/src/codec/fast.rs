//! The codec loops. Data moves in steps of `L` elements: each step reads its (possibly
//! misaligned) little-endian bytes into a fixed-size array with `from_le_bytes`, converts the
//! whole array, and writes the results out. Every loop inside a step has a constant trip count
//! and no bounds checks, so LLVM unrolls and vectorises it and keeps the values in registers.
//! The last, partial step goes through zero-padded arrays. int8 works a block (`INT8_BLOCK`,
//! a multiple of `L`) at a time: one pass over the block's input for the scale, then steps.
//!
//! Each loop is generic over `F16C` and `#[inline(always)]`; `mod.rs` instantiates it once for
//! the baseline target and, on x86_64 CPUs with AVX2 and F16C, once inside a
//! `#[target_feature]` function, so the same source gets 256-bit vectors there. fp16 is the
//! one place the two differ: with F16C it uses `vcvtps2ph`/`vcvtph2ps` (the instructions `half`
//! itself uses per element when the CPU has F16C), otherwise `half`'s slice converters, which
//! make the same choice `half::f16::from_f32` / `to_f32` make on that CPU. Either way the bits
//! are those of the scalar conversions.

use super::{Wire, INT8_BLOCK};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Elements per step.
const L: usize = 32;
const _: () = assert!(INT8_BLOCK % L == 0 && L % 8 == 0);

// ---------------------------------------------------------------------------------------------
// Per-element bit conversions (branch-free, so they vectorise).

/// `half::bf16::from_f32(f32::from_bits(x)).to_bits()`: round to nearest, ties to even; a NaN
/// keeps its top mantissa bits and gets the quiet bit.
#[inline(always)]
fn bf16_from_bits(x: u32) -> u16 {
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let nan = (x & 0x7fff_ffff) > 0x7f80_0000;
    if nan {
        ((x >> 16) | 0x40) as u16
    } else {
        rounded as u16
    }
}

/// `half::bf16::from_bits(h).to_f32().to_bits()`: exact, NaNs get the quiet bit.
#[inline(always)]
fn bf16_to_bits(h: u16) -> u32 {
    let h = h as u32;
    let nan = (h & 0x7fff) > 0x7f80;
    (if nan { h | 0x40 } else { h }) << 16
}

/// `y.round().clamp(-127.0, 127.0) as i8` for every non-NaN `y` (round half away from zero).
/// Clamping first gives the same integer (round is monotonic and fixes +-127) and makes the
/// truncating conversion exact; `y - trunc(y)` is exact at this magnitude. `max`/`min` rather
/// than `clamp` so that even a NaN (which cannot occur here) lands in range, which keeps the
/// conversion sound for every input.
#[inline(always)]
fn round_i8(y: f32) -> i8 {
    let y = y.max(-127.0).min(127.0);
    // SAFETY: y is in [-127, 127], so it truncates to an i32 without overflow.
    let t: i32 = unsafe { y.to_int_unchecked() };
    let f = y - t as f32;
    (t + (f >= 0.5) as i32 - (f <= -0.5) as i32) as i8
}

// ---------------------------------------------------------------------------------------------
// Fixed-size arrays: element-wise maps, and reads and writes of little-endian bytes.

/// `[f(a[0]), f(a[1]), ...]`, as a plain loop (which LLVM vectorises more reliably than
/// `array::map`).
#[inline(always)]
fn map<A: Copy, B: Copy + Default, const N: usize>(a: &[A; N], f: impl Fn(A) -> B) -> [B; N] {
    let mut b = [B::default(); N];
    for (b, &a) in b.iter_mut().zip(a) {
        *b = f(a);
    }
    b
}

/// The first `4 * N` bytes of `b` as u32s.
#[inline(always)]
fn read_u32s<const N: usize>(b: &[u8]) -> [u32; N] {
    let mut x = [0u32; N];
    for (x, c) in x.iter_mut().zip(b[..4 * N].chunks_exact(4)) {
        *x = u32::from_le_bytes(c.try_into().unwrap());
    }
    x
}

/// The first `2 * N` bytes of `b` as u16s.
#[inline(always)]
fn read_u16s<const N: usize>(b: &[u8]) -> [u16; N] {
    let mut h = [0u16; N];
    for (h, c) in h.iter_mut().zip(b[..2 * N].chunks_exact(2)) {
        *h = u16::from_le_bytes(c.try_into().unwrap());
    }
    h
}

/// `h` into the first `2 * N` bytes of `o`, or as many whole u16s as `o` holds if fewer.
#[inline(always)]
fn write_u16s<const N: usize>(o: &mut [u8], h: &[u16; N]) {
    for (o, h) in o.chunks_exact_mut(2).zip(h) {
        o.copy_from_slice(&h.to_le_bytes());
    }
}

/// `b` (at most `4 * L` bytes) at the start of zeros: the input of a partial last step.
#[inline(always)]
fn padded(b: &[u8]) -> [[u8; 4]; L] {
    let mut p = [[0u8; 4]; L];
    p.as_flattened_mut()[..b.len()].copy_from_slice(b);
    p
}

// ---------------------------------------------------------------------------------------------
// Step conversions.

#[inline(always)]
fn bf16_encode(x: &[u32; L]) -> [u16; L] {
    map(x, bf16_from_bits)
}

#[inline(always)]
fn bf16_decode(b: &[u8]) -> [f32; L] {
    map(&read_u16s::<L>(b), |h| f32::from_bits(bf16_to_bits(h)))
}

#[inline(always)]
fn f16_encode<const F16C: bool>(x: &[u32; L]) -> [u16; L] {
    #[cfg(target_arch = "x86_64")]
    if F16C {
        let mut h = [0u16; L];
        // SAFETY: F16C is only true on the path `mod.rs` takes after detecting AVX2 and F16C.
        unsafe { x86::f32_to_f16(x, &mut h) };
        return h;
    }
    let mut h = [f16::ZERO; L];
    h.convert_from_f32_slice(&map(x, f32::from_bits));
    map(&h, f16::to_bits)
}

#[inline(always)]
fn f16_decode<const F16C: bool>(b: &[u8]) -> [f32; L] {
    let h = read_u16s::<L>(b);
    let mut v = [0f32; L];
    #[cfg(target_arch = "x86_64")]
    if F16C {
        // SAFETY: as in `f16_encode`.
        unsafe { x86::f16_to_f32(&h, &mut v) };
        return v;
    }
    map(&h, f16::from_bits).convert_to_f32_slice(&mut v);
    v
}

#[inline(always)]
fn native_decode(b: &[u8]) -> [f32; L] {
    map(&read_u32s::<L>(b), f32::from_bits)
}

// ---------------------------------------------------------------------------------------------
// Whole buffers. The per-wire step and the sink are type parameters (not closures) so that
// every piece is `#[inline(always)]` into the one loop, including inside the AVX2 function.

/// An element-wise encoding to two bytes per value.
trait Halves {
    fn encode(x: &[u32; L]) -> [u16; L];
}

/// An element-wise decoding from `SIZE` bytes per value.
trait Elems {
    const SIZE: usize;
    /// Decodes `SIZE * L` bytes.
    fn decode(b: &[u8]) -> [f32; L];
}

struct Native;
struct Bf16;
struct F16<const F16C: bool>;

impl Halves for Bf16 {
    #[inline(always)]
    fn encode(x: &[u32; L]) -> [u16; L] {
        bf16_encode(x)
    }
}

impl<const F16C: bool> Halves for F16<F16C> {
    #[inline(always)]
    fn encode(x: &[u32; L]) -> [u16; L] {
        f16_encode::<F16C>(x)
    }
}

impl Elems for Native {
    const SIZE: usize = 4;
    #[inline(always)]
    fn decode(b: &[u8]) -> [f32; L] {
        native_decode(b)
    }
}

impl Elems for Bf16 {
    const SIZE: usize = 2;
    #[inline(always)]
    fn decode(b: &[u8]) -> [f32; L] {
        bf16_decode(b)
    }
}

impl<const F16C: bool> Elems for F16<F16C> {
    const SIZE: usize = 2;
    #[inline(always)]
    fn decode(b: &[u8]) -> [f32; L] {
        f16_decode::<F16C>(b)
    }
}

/// Encodes `src` (`n` whole f32s) into `out` (exactly `wire.encoded_len(n)` bytes).
#[inline(always)]
pub(super) fn encode<const F16C: bool>(wire: Wire, src: &[u8], out: &mut [u8]) {
    match wire {
        Wire::Native => out.copy_from_slice(src),
        Wire::Bf16 => encode_halves::<Bf16>(src, out),
        Wire::F16 => encode_halves::<F16<F16C>>(src, out),
        Wire::Int8 => encode_int8(src, out),
    }
}

#[inline(always)]
fn encode_halves<H: Halves>(src: &[u8], out: &mut [u8]) {
    let mut s = src.chunks_exact(4 * L);
    let mut o = out.chunks_exact_mut(2 * L);
    for (s, o) in (&mut s).zip(&mut o) {
        write_u16s(o, &H::encode(&read_u32s(s)));
    }
    let (s, o) = (s.remainder(), o.into_remainder());
    if !s.is_empty() {
        write_u16s(o, &H::encode(&read_u32s(padded(s).as_flattened())));
    }
}

/// The scale of an int8 block (up to `INT8_BLOCK` f32s), bit-for-bit what the scalar definition
/// gives. That takes `max(|v|)` with `f32::max` and checks finiteness separately; when every
/// value is finite, the float max of |v| is the integer max of the bit patterns with the sign
/// cleared, and when any is not, that integer max is >= the bits of inf. So one integer max,
/// which vectorises, gives both.
#[inline(always)]
fn int8_scale(block: &[u8]) -> f32 {
    let mut m = 0u32;
    for c in block.chunks_exact(4) {
        m = m.max(u32::from_le_bytes(c.try_into().unwrap()) & 0x7fff_ffff);
    }
    if m < 0x7f80_0000 {
        f32::from_bits(m) / 127.0
    } else {
        f32::NAN
    }
}

#[inline(always)]
fn int8_quantise(x: &[u32; L], scale: f32) -> [u8; L] {
    map(x, |x| round_i8(f32::from_bits(x) / scale) as u8)
}

#[inline(always)]
fn encode_int8(src: &[u8], out: &mut [u8]) {
    for (s, o) in src.chunks(4 * INT8_BLOCK).zip(out.chunks_mut(4 + INT8_BLOCK)) {
        let scale = int8_scale(s);
        let (os, oq) = o.split_at_mut(4);
        os.copy_from_slice(&scale.to_le_bytes());
        if scale.is_nan() || scale <= 0.0 {
            // The scalar definition's `if scale > 0.0 { .. } else { 0 }`.
            oq.fill(0);
            continue;
        }
        let mut s = s.chunks_exact(4 * L);
        let mut q = oq.chunks_exact_mut(L);
        for (s, q) in (&mut s).zip(&mut q) {
            q.copy_from_slice(&int8_quantise(&read_u32s(s), scale));
        }
        let (s, q) = (s.remainder(), q.into_remainder());
        if !s.is_empty() {
            let v = int8_quantise(&read_u32s(padded(s).as_flattened()), scale);
            q.copy_from_slice(&v[..q.len()]);
        }
    }
}

/// Where decoded values go: `put(first element, values)`, at most `L` values at a time.
pub(super) trait Sink {
    fn put(&mut self, start: usize, v: &[f32]);
}

/// Decodes `src` (`wire.encoded_len(n)` bytes) a step at a time into `sink`.
#[inline(always)]
pub(super) fn decode<const F16C: bool>(wire: Wire, src: &[u8], n: usize, sink: &mut impl Sink) {
    match wire {
        Wire::Native => decode_elems::<Native>(src, n, sink),
        Wire::Bf16 => decode_elems::<Bf16>(src, n, sink),
        Wire::F16 => decode_elems::<F16<F16C>>(src, n, sink),
        Wire::Int8 => decode_int8(src, n, sink),
    }
}

#[inline(always)]
fn decode_elems<E: Elems>(src: &[u8], n: usize, sink: &mut impl Sink) {
    let mut s = src.chunks_exact(E::SIZE * L);
    let mut start = 0;
    for s in &mut s {
        sink.put(start, &E::decode(s));
        start += L;
    }
    let s = s.remainder();
    if !s.is_empty() {
        sink.put(start, &E::decode(padded(s).as_flattened())[..n - start]);
    }
}

#[inline(always)]
fn int8_dequantise(q: &[u8], scale: f32) -> [f32; L] {
    let q: &[u8; L] = q[..L].try_into().unwrap();
    map(q, |q| (q as i8) as f32 * scale)
}

#[inline(always)]
fn decode_int8(src: &[u8], n: usize, sink: &mut impl Sink) {
    let mut start = 0;
    for b in src.chunks(4 + INT8_BLOCK) {
        let (sc, q) = b.split_at(4);
        let scale = f32::from_le_bytes(sc.try_into().unwrap());
        let mut q = q.chunks_exact(L);
        for q in &mut q {
            sink.put(start, &int8_dequantise(q, scale));
            start += L;
        }
        let q = q.remainder();
        if !q.is_empty() {
            sink.put(start, &int8_dequantise(padded(q).as_flattened(), scale)[..n - start]);
            start = n;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sinks: f32 little-endian bytes.

/// out[i] = v[i].
pub(super) struct Store<'a>(pub &'a mut [u8]);

impl Sink for Store<'_> {
    #[inline(always)]
    fn put(&mut self, start: usize, v: &[f32]) {
        let out = &mut self.0[4 * start..4 * (start + v.len())];
        for (o, v) in out.chunks_exact_mut(4).zip(v) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// `a + v` for the fused sums, with the NaN payload pinned down. When both are NaN, IEEE and
/// Rust leave open which payload the sum keeps, and the kernels' Sum is not consistent about it
/// either (on x86 its vector body returns the incoming NaN, its scalar tail the accumulator's).
/// Here it is always the incoming (decoded) NaN, quieted, whatever the codegen or CPU path.
/// Every other case is the plain IEEE sum, whose bits do not depend on operand order.
#[inline(always)]
fn sum(a: f32, v: f32) -> f32 {
    let s = a + v;
    if v.is_nan() {
        f32::from_bits(v.to_bits() | 0x0040_0000)
    } else {
        s
    }
}

/// d[i] = d[i] + v[i], as `kernels::reduce_into(d, v, F32, Sum)` computes it.
pub(super) struct AddInto<'a>(pub &'a mut [u8]);

impl Sink for AddInto<'_> {
    #[inline(always)]
    fn put(&mut self, start: usize, v: &[f32]) {
        let d = &mut self.0[4 * start..4 * (start + v.len())];
        for (d, v) in d.chunks_exact_mut(4).zip(v) {
            let a = f32::from_le_bytes((&*d).try_into().unwrap());
            d.copy_from_slice(&sum(a, *v).to_le_bytes());
        }
    }
}

/// d[i] = w[i] + v[i], as `kernels::reduce_from(d, w, v, F32, Sum)` computes it.
pub(super) struct AddFrom<'a, 'b> {
    pub with: &'b [u8],
    pub dst: &'a mut [u8],
}

impl Sink for AddFrom<'_, '_> {
    #[inline(always)]
    fn put(&mut self, start: usize, v: &[f32]) {
        let r = 4 * start..4 * (start + v.len());
        let (d, w) = (&mut self.dst[r.clone()], &self.with[r]);
        for ((d, w), v) in d.chunks_exact_mut(4).zip(w.chunks_exact(4)).zip(v) {
            let a = f32::from_le_bytes(w.try_into().unwrap());
            d.copy_from_slice(&sum(a, *v).to_le_bytes());
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::L;
    use std::arch::x86_64::*;

    /// The conversion `half`'s F16C path uses for `f16::from_f32` (`vcvtps2ph`, round to nearest
    /// even by immediate), 8 lanes at a time.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn f32_to_f16(x: &[u32; L], h: &mut [u16; L]) {
        for (x, h) in x.chunks_exact(8).zip(h.chunks_exact_mut(8)) {
            // SAFETY: each chunk is 8 elements: 32 bytes read, 16 written; unaligned ops.
            unsafe {
                let v = _mm256_loadu_ps(x.as_ptr().cast());
                let r = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm_storeu_si128(h.as_mut_ptr().cast(), r);
            }
        }
    }

    /// The conversion `half`'s F16C path uses for `f16::to_f32` (`vcvtph2ps`), 8 lanes at a time.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn f16_to_f32(h: &[u16; L], v: &mut [f32; L]) {
        for (h, v) in h.chunks_exact(8).zip(v.chunks_exact_mut(8)) {
            // SAFETY: as above, 16 bytes read and 32 written.
            unsafe {
                let r = _mm_loadu_si128(h.as_ptr().cast());
                _mm256_storeu_ps(v.as_mut_ptr(), _mm256_cvtph_ps(r));
            }
        }
    }
}
