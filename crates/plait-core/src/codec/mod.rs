//! Wire compression for f32 data: bf16 and fp16 (half the bytes) and int8 with one f32 scale
//! per block of 256 values (a little over a quarter).
//!
//! Every codec is a pure function of its input, so ranks that encode the same values send the
//! same bytes. Non-finite values: bf16 and fp16 keep NaN and +-inf (fp16 turns values beyond
//! 65504 into inf); an int8 block containing NaN or inf decodes to NaN for the whole block,
//! so a poisoned gradient is never silently turned into a finite one.
//!
//! The definitions are the scalar loops kept in `reference.rs` (the bf16/fp16 conversions of
//! the `half` crate; int8 as described above). The loops in `fast.rs` are vectorised versions
//! of them, tested to give the same bits for every input on both the AVX2 and the baseline
//! instantiation; byte buffers may be misaligned. On the receive side, [`decode_add_into`] and
//! [`decode_add_from`] fuse decoding with a Sum reduce, so no decoded temporary is needed.

mod fast;
#[cfg(test)]
mod reference;
#[cfg(test)]
mod equivalence;
#[cfg(test)]
mod bench;

pub const INT8_BLOCK: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Wire {
    /// The data's own dtype: no compression.
    Native,
    Bf16,
    F16,
    Int8,
}

impl Wire {
    pub const ALL: [Wire; 4] = [Wire::Native, Wire::Bf16, Wire::F16, Wire::Int8];

    pub fn from_name(name: &str) -> Option<Wire> {
        Some(match name.to_ascii_lowercase().as_str() {
            "" | "native" | "none" | "f32" | "fp32" | "float32" => Wire::Native,
            "bf16" | "bfloat16" => Wire::Bf16,
            "f16" | "fp16" | "float16" | "half" => Wire::F16,
            "int8" | "i8" => Wire::Int8,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Wire::Native => "native",
            Wire::Bf16 => "bf16",
            Wire::F16 => "f16",
            Wire::Int8 => "int8",
        }
    }

    /// Bytes on the wire for `elems` f32 values.
    pub fn encoded_len(self, elems: usize) -> usize {
        match self {
            Wire::Native => elems * 4,
            Wire::Bf16 | Wire::F16 => elems * 2,
            Wire::Int8 => elems + elems.div_ceil(INT8_BLOCK) * 4,
        }
    }
}

/// Encodes f32 values (little-endian bytes `src`) into `out` (`wire.encoded_len` bytes).
pub fn encode(wire: Wire, src: &[u8], out: &mut [u8]) {
    let n = src.len() / 4;
    debug_assert_eq!(out.len(), wire.encoded_len(n));
    let (src, out) = (&src[..n * 4], &mut out[..wire.encoded_len(n)]);
    #[cfg(target_arch = "x86_64")]
    if avx2_f16c() {
        // SAFETY: the CPU has the features `x86_encode` is compiled for.
        return unsafe { x86_encode(wire, src, out) };
    }
    fast::encode::<false>(wire, src, out)
}

/// Replaces f32 values (little-endian bytes) by what they become on the wire: `decode(encode(x))`.
/// The difference is what a sender's error feedback carries over to its next contribution.
pub fn round_trip(wire: Wire, data: &mut [u8]) {
    let n = data.len() / 4;
    let mut enc = vec![0u8; wire.encoded_len(n)];
    encode(wire, &data[..n * 4], &mut enc);
    decode(wire, &enc, &mut data[..n * 4]);
}

/// Decodes `src` (as produced by `encode`) into f32 little-endian bytes `out`.
pub fn decode(wire: Wire, src: &[u8], out: &mut [u8]) {
    let n = out.len() / 4;
    debug_assert_eq!(src.len(), wire.encoded_len(n));
    let src = &src[..wire.encoded_len(n)];
    with_decoded(wire, src, n, &mut fast::Store(out));
}

/// Sum-reduces an encoded payload into f32 little-endian bytes: `dst[i] = dst[i] + decode(src)[i]`.
///
/// The same bits as `decode` into a temporary followed by
/// `kernels::reduce_into(dst, tmp, DType::F32, ReduceOp::Sum)` (one f32 addition per element,
/// no temporary), with one refinement: when both operands are NaN the result is always the
/// decoded NaN, quieted, where the kernels return either depending on which of their loops
/// handled the element. Sum only: compression is only used for sum and avg allreduces (avg
/// divides once at the end, after the last reduce). `dst.len() / 4` elements; `src` must be
/// `wire.encoded_len` of that many.
pub fn decode_add_into(wire: Wire, src: &[u8], dst: &mut [u8]) {
    let n = dst.len() / 4;
    debug_assert_eq!(src.len(), wire.encoded_len(n));
    let src = &src[..wire.encoded_len(n)];
    with_decoded(wire, src, n, &mut fast::AddInto(dst));
}

/// Sum of a buffer and an encoded payload into a third: `dst[i] = with[i] + decode(src)[i]`, all
/// f32 little-endian bytes.
///
/// The same bits as `decode` into a temporary followed by
/// `kernels::reduce_from(dst, with, tmp, DType::F32, ReduceOp::Sum)`, without the temporary and
/// with the NaN + NaN refinement of [`decode_add_into`]. Sum only, as there. `dst.len() / 4`
/// elements; `with` must be as long as `dst` and must not overlap it (the borrow rules ensure
/// that for safe callers); `src` must be `wire.encoded_len` of that many.
pub fn decode_add_from(wire: Wire, src: &[u8], with: &[u8], dst: &mut [u8]) {
    let n = dst.len() / 4;
    debug_assert_eq!(src.len(), wire.encoded_len(n));
    debug_assert_eq!(with.len(), dst.len());
    let (src, with) = (&src[..wire.encoded_len(n)], &with[..n * 4]);
    with_decoded(wire, src, n, &mut fast::AddFrom { with, dst });
}

/// Runs `fast::decode` with the best instantiation for this CPU. `sink` is generic, so each
/// public function gets its own fully inlined loop.
#[inline(always)]
fn with_decoded(wire: Wire, src: &[u8], n: usize, sink: &mut impl fast::Sink) {
    #[cfg(target_arch = "x86_64")]
    if avx2_f16c() {
        // SAFETY: the CPU has the features `x86_decode` is compiled for.
        return unsafe { x86_decode(wire, src, n, sink) };
    }
    fast::decode::<false>(wire, src, n, sink)
}

#[cfg(target_arch = "x86_64")]
fn avx2_f16c() -> bool {
    #[cfg(test)]
    if equivalence::BASELINE.get() {
        return false;
    }
    // Cached by std after the first call: one relaxed load.
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn x86_encode(wire: Wire, src: &[u8], out: &mut [u8]) {
    fast::encode::<true>(wire, src, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn x86_decode(wire: Wire, src: &[u8], n: usize, sink: &mut impl fast::Sink) {
    fast::decode::<true>(wire, src, n, sink)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn floats(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    fn round_trip(wire: Wire, v: &[f32]) -> Vec<f32> {
        let src = bytes(v);
        let mut enc = vec![0u8; wire.encoded_len(v.len())];
        encode(wire, &src, &mut enc);
        let mut out = vec![0u8; src.len()];
        decode(wire, &enc, &mut out);
        floats(&out)
    }

    fn lcg(n: usize, scale: f32) -> Vec<f32> {
        let mut s = 12345u64;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * scale
            })
            .collect()
    }

    #[test]
    fn error_is_bounded_for_random_constant_huge_and_tiny_inputs() {
        for (scale, what) in [(1.0f32, "random"), (1e30, "huge"), (1e-30, "tiny")] {
            let v = lcg(1000, scale);
            let max = v.iter().fold(0.0f32, |a, x| a.max(x.abs()));
            for (wire, rel) in [(Wire::Bf16, 1.0 / 256.0), (Wire::F16, 1.0 / 2048.0)] {
                for (a, b) in v.iter().zip(round_trip(wire, &v)) {
                    if wire == Wire::F16 && scale != 1.0 {
                        continue; // fp16 cannot hold 1e30 or 1e-30: checked below
                    }
                    assert!((a - b).abs() <= a.abs() * rel, "{what} {wire:?}: {a} -> {b}");
                }
            }
            for (a, b) in v.iter().zip(round_trip(Wire::Int8, &v)) {
                assert!((a - b).abs() <= max / 254.0 * 1.0001, "{what} int8: {a} -> {b}");
            }
        }
        let c = vec![3.25f32; 700];
        assert_eq!(round_trip(Wire::Bf16, &c), c);
        assert_eq!(round_trip(Wire::Int8, &c), c, "a constant block is exact in int8");
        assert_eq!(round_trip(Wire::F16, &[1e30, -1e30]), vec![f32::INFINITY, f32::NEG_INFINITY]);
        assert_eq!(round_trip(Wire::Int8, &[0.0; 10]), vec![0.0; 10]);
    }

    #[test]
    fn nan_and_inf_are_never_made_finite() {
        let v = [1.0, f32::NAN, f32::INFINITY, -2.0];
        let b = round_trip(Wire::Bf16, &v);
        assert!(b[1].is_nan() && b[2] == f32::INFINITY && b[0] == 1.0);
        let i = round_trip(Wire::Int8, &v);
        assert!(i.iter().all(|x| x.is_nan()), "{i:?}");
    }

    #[test]
    fn encoding_is_idempotent_after_one_round_trip() {
        // Forwarding a decoded chunk must not change it again.
        for wire in [Wire::Bf16, Wire::F16, Wire::Int8] {
            let once = round_trip(wire, &lcg(777, 10.0));
            assert_eq!(round_trip(wire, &once), once, "{wire:?}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(Wire::Int8.encoded_len(256), 260);
        assert_eq!(Wire::Int8.encoded_len(257), 265);
        assert_eq!(Wire::Bf16.encoded_len(3), 6);
        assert_eq!(Wire::from_name("BF16"), Some(Wire::Bf16));
        assert_eq!(Wire::from_name("zstd"), None);
    }
}
