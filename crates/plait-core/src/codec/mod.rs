//! Wire compression for f32 data: bf16 and fp16 (half the bytes) and int8 with one f32 scale
//! per block of 256 values (a little over a quarter).
//!
//! Every codec is a pure function of its input, so ranks that encode the same values send the
//! same bytes. Non-finite values: bf16 and fp16 keep NaN and +-inf (fp16 turns values beyond
//! 65504 into inf); an int8 block containing NaN or inf decodes to NaN for the whole block,
//! so a poisoned gradient is never silently turned into a finite one.

use half::{bf16, f16};

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

fn read_f32(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap())
}

/// Encodes f32 values (little-endian bytes `src`) into `out` (`wire.encoded_len` bytes).
pub fn encode(wire: Wire, src: &[u8], out: &mut [u8]) {
    let n = src.len() / 4;
    debug_assert_eq!(out.len(), wire.encoded_len(n));
    match wire {
        Wire::Native => out.copy_from_slice(&src[..n * 4]),
        Wire::Bf16 => {
            for i in 0..n {
                out[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(read_f32(src, i)).to_le_bytes());
            }
        }
        Wire::F16 => {
            for i in 0..n {
                out[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(read_f32(src, i)).to_le_bytes());
            }
        }
        Wire::Int8 => {
            let mut o = 0;
            for start in (0..n).step_by(INT8_BLOCK) {
                let end = (start + INT8_BLOCK).min(n);
                let mut max = 0.0f32;
                let mut finite = true;
                for i in start..end {
                    let v = read_f32(src, i);
                    finite &= v.is_finite();
                    max = max.max(v.abs());
                }
                let scale = if finite { max / 127.0 } else { f32::NAN };
                out[o..o + 4].copy_from_slice(&scale.to_le_bytes());
                o += 4;
                for i in start..end {
                    let q = if scale > 0.0 { (read_f32(src, i) / scale).round().clamp(-127.0, 127.0) as i8 } else { 0 };
                    out[o] = q as u8;
                    o += 1;
                }
            }
        }
    }
}

/// Decodes `src` (as produced by `encode`) into f32 little-endian bytes `out`.
pub fn decode(wire: Wire, src: &[u8], out: &mut [u8]) {
    let n = out.len() / 4;
    debug_assert_eq!(src.len(), wire.encoded_len(n));
    let mut put = |i: usize, v: f32| out[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    match wire {
        Wire::Native => {
            for i in 0..n {
                put(i, read_f32(src, i));
            }
        }
        Wire::Bf16 => {
            for i in 0..n {
                put(i, bf16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f32());
            }
        }
        Wire::F16 => {
            for i in 0..n {
                put(i, f16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f32());
            }
        }
        Wire::Int8 => {
            let mut o = 0;
            for start in (0..n).step_by(INT8_BLOCK) {
                let end = (start + INT8_BLOCK).min(n);
                let scale = f32::from_le_bytes(src[o..o + 4].try_into().unwrap());
                o += 4;
                for i in start..end {
                    put(i, (src[o] as i8) as f32 * scale);
                    o += 1;
                }
            }
        }
    }
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
