//! The original scalar codecs, kept as the definition the fast paths must match bit for bit.

use super::{Wire, INT8_BLOCK};
use half::{bf16, f16};

fn read_f32(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap())
}

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
