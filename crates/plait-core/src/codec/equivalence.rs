//! The fast codecs against the scalar reference (`reference.rs`), bit for bit.

use super::{decode, decode_add_from, decode_add_into, encode, reference, Wire, INT8_BLOCK};
use crate::dtype::{DType, ReduceOp};
use crate::kernels;

thread_local! {
    /// Set to make this thread's codec calls take the baseline (non-AVX2) instantiation.
    pub(super) static BASELINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` on both instantiations of the fast paths (the same one twice where AVX2 and F16C
/// are missing or on other architectures).
fn both_paths(mut f: impl FnMut(&str)) {
    for (baseline, name) in [(false, "dispatched"), (true, "baseline")] {
        BASELINE.set(baseline);
        f(name);
    }
    BASELINE.set(false);
}

const WIRES: [Wire; 4] = [Wire::Native, Wire::Bf16, Wire::F16, Wire::Int8];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn u32(&mut self) -> u32 {
        (self.next() >> 32) as u32
    }
    fn below(&mut self, n: u32) -> u32 {
        ((self.next() >> 32) * n as u64 >> 32) as u32
    }
}

fn bytes_of(bits: &[u32]) -> Vec<u8> {
    bits.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `data` copied to offset `off` of a fresh Vec, so the slice handed out is misaligned for f32
/// when `off` is odd.
fn at(off: usize, data: &[u8]) -> (Vec<u8>, usize) {
    let mut v = vec![0xa5u8; off + data.len()];
    v[off..].copy_from_slice(data);
    (v, off)
}

/// f32 bit patterns that sit on every edge the codecs care about: each sign and exponent with
/// mantissas around the bf16 and fp16 rounding points (ties, one either side, all ones that
/// carry into the exponent), NaN payloads (quiet and signalling), inf, subnormals, +-0, and
/// fp16's overflow and subnormal boundaries.
fn edge_bits() -> Vec<u32> {
    let mut v = Vec::new();
    let mans: [u32; 22] = [
        0, 1, 2, 0x7f_ffff, 0x40_0000, 0x3f_ffff, 0x20_0000, // ends and quiet bit
        0x7fff, 0x8000, 0x8001, 0x1_7fff, 0x1_8000, 0x1_8001, 0x7f_8000, 0x7f_7fff, // bf16
        0xfff, 0x1000, 0x1001, 0x2fff, 0x3000, 0x7f_f000, 0x7f_efff, // fp16
    ];
    for sign in [0u32, 0x8000_0000] {
        for exp in 0u32..256 {
            for m in mans {
                v.push(sign | exp << 23 | m);
            }
        }
    }
    for x in [
        0x477f_e000u32, 0x477f_efff, 0x477f_f000, 0x477f_f001, 0x4780_0000, // 65504 .. 65536
        0x3380_0000, 0x3300_0000, 0x3300_0001, 0x32ff_ffff, 0x3340_0000, 0x33c0_0000, // 2^-24 ties
        0x3880_0000, 0x387f_ffff, 0x387f_f000, 0x387f_efff, // fp16 min normal
        0x7f7f_ffff, 0x7f7f_8000, 0x7f7f_7fff, // bf16 rounding to inf
    ] {
        v.push(x);
        v.push(x | 0x8000_0000);
    }
    v
}

fn check_encode(bits: &[u32], what: &str) {
    both_paths(|path| check_encode_on(bits, &format!("{what} ({path})")));
}

fn check_encode_on(bits: &[u32], what: &str) {
    let src = bytes_of(bits);
    for wire in WIRES {
        let n = bits.len();
        for off in [0usize, 1] {
            let (buf, o) = at(off, &src);
            let src = &buf[o..];
            let mut want = vec![0u8; wire.encoded_len(n)];
            reference::encode(wire, src, &mut want);
            let mut got = vec![0x5au8; off + wire.encoded_len(n)];
            encode(wire, src, &mut got[off..]);
            if got[off..] != want[..] {
                let i = (0..want.len()).find(|&i| got[off + i] != want[i]).unwrap();
                panic!("{what} {wire:?} off {off}: first difference at byte {i} of {}", want.len());
            }
        }
    }
}

/// Decode, decode_add_into and decode_add_from of `enc` (for `n` elements) against the reference
/// decode, then the kernels' Sum (the path the fused functions replace), at offsets 0 and 1.
fn check_decode(wire: Wire, enc: &[u8], n: usize, rng: &mut Rng, what: &str) {
    both_paths(|path| check_decode_on(wire, enc, n, rng, &format!("{what} ({path})")));
}

fn check_decode_on(wire: Wire, enc: &[u8], n: usize, rng: &mut Rng, what: &str) {
    let mut want = vec![0u8; 4 * n];
    reference::decode(wire, enc, &mut want);
    // Accumulators with NaNs, infs, zeros and subnormals mixed in.
    let acc: Vec<u32> = (0..n)
        .map(|_| match rng.below(16) {
            0 => 0x7fc0_0000 | rng.u32() & 0x803f_ffff,
            1 => (0xff80_0000 * (rng.u32() & 1)).wrapping_add(0x7f80_0000 * (rng.u32() & 1)),
            2 => rng.u32() & 0x807f_ffff,
            3 => 0x8000_0000 * (rng.u32() & 1),
            _ => rng.u32(),
        })
        .collect();
    let acc = bytes_of(&acc);
    let with: Vec<u8> = bytes_of(&(0..n).map(|_| rng.u32()).collect::<Vec<_>>());
    let mut want_into = acc.clone();
    kernels::reduce_into(&mut want_into, &want, DType::F32, ReduceOp::Sum);
    let mut want_from = vec![0u8; 4 * n];
    kernels::reduce_from(&mut want_from, &with, &want, DType::F32, ReduceOp::Sum);
    // NaN + NaN: the kernels return either payload (it differs between their vector body and
    // scalar tail); the fused functions always return the decoded one, quieted.
    both_nan_keeps_decoded(&mut want_into, &acc, &want);
    both_nan_keeps_decoded(&mut want_from, &with, &want);
    for off in [0usize, 1, 2, 3] {
        let (sbuf, so) = at(off, enc);
        let src = &sbuf[so..];
        let mut got = vec![0x5au8; off + 4 * n];
        decode(wire, src, &mut got[off..]);
        assert!(got[off..] == want[..], "{what} {wire:?} decode off {off}");
        let (mut dbuf, d) = at(off, &acc);
        decode_add_into(wire, src, &mut dbuf[d..]);
        if dbuf[d..] != want_into[..] {
            let f = |b: &[u8], i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
            let bad: Vec<_> = (0..n).filter(|&i| f(&dbuf[d..], i) != f(&want_into, i)).take(5)
                .map(|i| format!("acc {:08x} dec {:08x} want {:08x} got {:08x}", f(&acc, i), f(&want, i), f(&want_into, i), f(&dbuf[d..], i))).collect();
            panic!("{what} {wire:?} decode_add_into off {off}: {bad:?}");
        }
        let (wbuf, w) = at(3 - off, &with);
        let mut got = vec![0x5au8; off + 4 * n];
        decode_add_from(wire, src, &wbuf[w..], &mut got[off..]);
        assert!(got[off..] == want_from[..], "{what} {wire:?} decode_add_from off {off}");
    }
}

fn both_nan_keeps_decoded(sum: &mut [u8], acc: &[u8], dec: &[u8]) {
    for ((s, a), d) in sum.chunks_exact_mut(4).zip(acc.chunks_exact(4)).zip(dec.chunks_exact(4)) {
        let (a, d) = (f32::from_le_bytes(a.try_into().unwrap()), f32::from_le_bytes(d.try_into().unwrap()));
        if a.is_nan() && d.is_nan() {
            assert!(f32::from_le_bytes((&*s).try_into().unwrap()).is_nan());
            s.copy_from_slice(&(d.to_bits() | 0x0040_0000).to_le_bytes());
        }
    }
}

#[test]
fn every_bf16_and_f16_pattern_decodes_like_the_reference() {
    let mut rng = Rng(1);
    let all: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
    for wire in [Wire::Bf16, Wire::F16] {
        check_decode(wire, &all, 1 << 16, &mut rng, "all patterns");
        // Shifted by one element so block boundaries fall elsewhere, and a partial last block.
        check_decode(wire, &all[2..2 * 1000 + 2], 1000, &mut rng, "all patterns, shifted");
    }
}

#[test]
fn edge_values_encode_like_the_reference() {
    let bits = edge_bits();
    check_encode(&bits, "edges");
    // Also every edge value alone in its int8 block next to ordinary values.
    let mut rng = Rng(2);
    for chunk in bits.chunks(97) {
        let mut block: Vec<u32> = (0..INT8_BLOCK).map(|_| (rng.u32() & 0x807f_ffff) | 0x3f00_0000).collect();
        block[..chunk.len()].copy_from_slice(chunk);
        check_encode(&block[..chunk.len().max(1)], "edge chunk");
    }
}

#[test]
fn random_bit_patterns_encode_like_the_reference() {
    let mut rng = Rng(3);
    let bits: Vec<u32> = (0..1_000_003).map(|_| rng.u32()).collect();
    check_encode(&bits, "random bits");
}

/// Random bit patterns almost always put a NaN or inf in each int8 block, so int8 gets its own
/// finite blocks: random exponent windows (from subnormal to near f32::MAX), exact ties of
/// v / scale, constant, single-value, all-zero and -0.0 blocks, and poison at each position.
#[test]
fn finite_int8_blocks_encode_like_the_reference() {
    let mut rng = Rng(4);
    let mut bits = Vec::new();
    for b in 0..6000u32 {
        let kind = b % 10;
        let center = rng.below(254) + 1;
        let width = rng.below(30);
        for i in 0..INT8_BLOCK as u32 {
            let sign = rng.u32() & 0x8000_0000;
            let x = match kind {
                // Ordinary: exponents in [center - width, center].
                0..=3 => {
                    let e = center.saturating_sub(rng.below(width + 1));
                    sign | e << 23 | rng.u32() & 0x7f_ffff
                }
                // Subnormal and tiny maxima: scale underflows to 0 or is subnormal.
                4 => sign | rng.u32() >> (9 + rng.below(23)),
                // max = 127 exactly, so scale = 1 and half-integers are exact ties.
                5 => {
                    if i == 0 {
                        127.0f32.to_bits()
                    } else {
                        sign | ((rng.below(254) as f32 - 127.0) * 0.5 + 0.25 * rng.below(2) as f32).to_bits()
                    }
                }
                // max = 63.5: scale = 0.5 (127 * 0.5 = 63.5), quarters are ties.
                6 => {
                    if i == 5 {
                        (-63.5f32).to_bits()
                    } else {
                        sign | (rng.below(254) as f32 * 0.25).to_bits()
                    }
                }
                7 => [0u32, 0x8000_0000, 3.25f32.to_bits()][(b / 10 % 3) as usize],
                8 => {
                    if i == b / 10 % 256 {
                        sign | rng.u32() & 0x7fff_ffff
                    } else {
                        0
                    }
                }
                // Near the top of the range.
                _ => sign | (254 - rng.below(3)) << 23 | rng.u32() & 0x7f_ffff,
            };
            bits.push(x);
        }
        // Poison one value in every 7th block, at a varying position.
        if b % 7 == 3 {
            let at = bits.len() - 1 - rng.below(INT8_BLOCK as u32) as usize;
            bits[at] = [0x7f80_0000, 0xff80_0000, 0x7fc0_0000, 0xffff_ffff, 0x7f80_0001][rng.below(5) as usize];
        }
    }
    check_encode(&bits, "int8 blocks");
    // A partial last block, poisoned at its end or not.
    for len in [1usize, 2, 100, 255, 257, 511] {
        check_encode(&bits[..len], "partial");
        let mut b = bits[..len].to_vec();
        *b.last_mut().unwrap() = 0x7fc0_0000;
        check_encode(&b, "partial poisoned");
    }
    // Decoding what was encoded, and arbitrary int8 payloads (NaN, inf, subnormal scales).
    let src = bytes_of(&bits);
    let n = bits.len();
    let mut enc = vec![0u8; Wire::Int8.encoded_len(n)];
    encode(Wire::Int8, &src, &mut enc);
    check_decode(Wire::Int8, &enc, n, &mut rng, "int8 round trip");
    let mut junk: Vec<u8> = (0..Wire::Int8.encoded_len(n)).map(|_| rng.u32() as u8).collect();
    for (k, blk) in junk.chunks_mut(4 + INT8_BLOCK).enumerate() {
        if k % 4 == 0 {
            let scale = [f32::NAN, f32::INFINITY, 1e-45, 0.0, -0.0, -1.5, f32::MAX][k / 4 % 7];
            blk[..4].copy_from_slice(&scale.to_le_bytes());
        }
    }
    check_decode(Wire::Int8, &junk, n, &mut rng, "int8 junk");
}

#[test]
fn lengths_and_misaligned_offsets_match_the_reference() {
    let mut rng = Rng(5);
    for len in [0usize, 1, 3, 255, 256, 257, 1000] {
        let mut bits: Vec<u32> = (0..len).map(|_| (rng.u32() & 0x87ff_ffff) | 0x3800_0000).collect();
        check_encode(&bits, &format!("len {len}"));
        if len > 2 {
            bits[len / 2] = rng.u32();
            bits[len - 1] = 0xff80_0000;
            check_encode(&bits, &format!("len {len} with specials"));
        }
        for wire in WIRES {
            let src = bytes_of(&bits);
            let mut enc = vec![0u8; wire.encoded_len(len)];
            reference::encode(wire, &src, &mut enc);
            check_decode(wire, &enc, len, &mut rng, &format!("len {len}"));
            let junk: Vec<u8> = (0..wire.encoded_len(len)).map(|_| rng.u32() as u8).collect();
            check_decode(wire, &junk, len, &mut rng, &format!("len {len} junk"));
        }
    }
}

#[test]
fn fused_sum_is_decode_then_add() {
    // Spelled out without the kernels, so the contract is visible here: acc + decoded.
    let mut rng = Rng(6);
    let n = 3000;
    let vals: Vec<u32> = (0..n).map(|_| (rng.u32() & 0x87ff_ffff) | 0x3800_0000).collect();
    let acc: Vec<f32> = (0..n).map(|i| i as f32 * 0.37 - 500.0).collect();
    let acc_b: Vec<u8> = acc.iter().flat_map(|x| x.to_le_bytes()).collect();
    for wire in WIRES {
        let mut enc = vec![0u8; wire.encoded_len(n)];
        encode(wire, &bytes_of(&vals), &mut enc);
        let mut dec = vec![0u8; 4 * n];
        decode(wire, &enc, &mut dec);
        let want: Vec<u8> = acc
            .iter()
            .zip(dec.chunks_exact(4))
            .flat_map(|(a, d)| (a + f32::from_le_bytes(d.try_into().unwrap())).to_le_bytes())
            .collect();
        let mut into = acc_b.clone();
        decode_add_into(wire, &enc, &mut into);
        assert!(into == want, "{wire:?} into");
        let mut from = vec![0u8; 4 * n];
        decode_add_from(wire, &enc, &acc_b, &mut from);
        assert!(from == want, "{wire:?} from");
    }
}

/// Every f32 bit pattern through bf16 and fp16 (2^32 each): run with `--ignored`.
#[test]
#[ignore]
fn every_f32_pattern_encodes_like_the_reference() {
    const CHUNK: u64 = 1 << 24;
    let mut src = vec![0u8; 4 * CHUNK as usize];
    let (mut got, mut want) = (vec![0u8; 2 * CHUNK as usize], vec![0u8; 2 * CHUNK as usize]);
    for start in (0..1u64 << 32).step_by(CHUNK as usize) {
        for (i, c) in src.chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&((start + i as u64) as u32).to_le_bytes());
        }
        for wire in [Wire::Bf16, Wire::F16] {
            reference::encode(wire, &src, &mut want);
            both_paths(|path| {
                encode(wire, &src, &mut got);
                assert!(got == want, "{wire:?} ({path}) in chunk starting {start:#x}");
            });
        }
    }
}

