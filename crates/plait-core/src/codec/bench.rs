//! Throughput of the codecs, old scalar reference against the fast paths. Run with
//! `cargo test -p plait-core --release codec::bench -- --ignored --nocapture`.

use super::equivalence::BASELINE;
use super::{decode, decode_add_into, encode, reference, Wire};
use crate::dtype::{DType, ReduceOp};
use crate::kernels;
use std::hint::black_box;
use std::time::Instant;

/// Timed runs per measurement; the best counts (the machine may be shared).
const REPS: usize = 11;

/// GB/s of f32 data (4 bytes per element), best of `reps`.
fn rate(elems: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    (elems * 4) as f64 / best / 1e9
}

#[test]
#[ignore]
fn codec_throughput() {
    const N: usize = 16 << 20;
    let mut s = 12345u64;
    let src: Vec<u8> = (0..N)
        .flat_map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 3.0).to_le_bytes()
        })
        .collect();
    // Offset by one byte so the f32 side is misaligned, as user tensors and frames may be.
    let mut f32buf = vec![0u8; 4 * N + 1];
    let mut acc = vec![0u8; 4 * N];
    acc.copy_from_slice(&src);
    println!("{N} f32 elements ({} MiB), f32 side misaligned; GB/s of f32 data, best of {REPS}", 4 * N >> 20);
    println!("'fast' is what this CPU dispatches to; 'baseline' the x86-64 (SSE2) instantiation.");
    println!("{:<6} {:<10} {:>10} {:>10} {:>10} {:>8}", "wire", "direction", "reference", "fast", "baseline", "speedup");
    let both = |f: &mut dyn FnMut()| {
        let fast = rate(N, REPS, &mut *f);
        BASELINE.set(true);
        let base = rate(N, REPS, &mut *f);
        BASELINE.set(false);
        (fast, base)
    };
    let row = |wire: Wire, dir: &str, old: f64, (new, base): (f64, f64)| {
        println!("{:<6} {:<10} {old:>10.2} {new:>10.2} {base:>10.2} {:>7.1}x", wire.name(), dir, new / old);
    };
    for wire in [Wire::Bf16, Wire::F16, Wire::Int8] {
        let mut enc = vec![0u8; wire.encoded_len(N)];
        let old = rate(N, REPS, || reference::encode(wire, black_box(&src), black_box(&mut enc)));
        row(wire, "encode", old, both(&mut || encode(wire, black_box(&src), black_box(&mut enc))));
        let out = &mut f32buf[1..];
        let old = rate(N, REPS, || reference::decode(wire, black_box(&enc), black_box(&mut *out)));
        row(wire, "decode", old, both(&mut || decode(wire, black_box(&enc), black_box(&mut *out))));
        // Receive-and-reduce: reference decode into a temp + kernels Sum, against the fused call.
        let mut tmp = vec![0u8; 4 * N];
        let old = rate(N, REPS, || {
            reference::decode(wire, black_box(&enc), &mut tmp);
            kernels::reduce_into(black_box(&mut acc), &tmp, DType::F32, ReduceOp::Sum);
        });
        row(wire, "decode+add", old, both(&mut || decode_add_into(wire, black_box(&enc), black_box(&mut acc))));
    }
}

