//! Kernels against a scalar, per-element reference written independently of the fast paths.

use super::*;

const LENS: [usize; 5] = [0, 1, 7, 1000, 4099];

/// Deterministic LCG (Knuth's MMIX constants); the high bits are the usable ones.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// `n` elements of `dtype`: full-range bytes for integers (so sums and products wrap), exact
/// small fractions for floats, and 0/1 plus non-canonical trues for bool.
fn random(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut g = Lcg(seed);
    let mut out = Vec::with_capacity(n * dtype.size());
    for _ in 0..n {
        let v = (g.next() % 4001) as f64 / 128.0 - 15.625;
        match dtype {
            DType::F16 => out.extend(f16::from_f64(v).to_ne_bytes()),
            DType::BF16 => out.extend(bf16::from_f64(v).to_ne_bytes()),
            DType::F32 => out.extend((v as f32).to_ne_bytes()),
            DType::F64 => out.extend(v.to_ne_bytes()),
            DType::Bool => out.push([0u8, 1, 0, 1, 7, 255][(g.next() % 6) as usize]),
            _ => out.extend(&g.next().to_ne_bytes()[..dtype.size()]),
        }
    }
    out
}

fn ops() -> Vec<ReduceOp> {
    use ReduceOp::*;
    vec![Sum, Avg, Prod, Min, Max, BAnd, BOr, BXor, PremulSum(0.5)]
}

macro_rules! ref_float {
    ($t:ty, $op:expr, $a:expr, $b:expr) => {{
        let (a, b): ($t, $t) = ($a, $b);
        match $op {
            ReduceOp::Sum => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Min if a.is_nan() || b.is_nan() => <$t>::NAN,
            ReduceOp::Max if a.is_nan() || b.is_nan() => <$t>::NAN,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            op => unreachable!("{op:?} on a float"),
        }
    }};
}

macro_rules! ref_int {
    ($t:ty, $op:expr, $x:expr, $y:expr) => {{
        let a = <$t>::from_ne_bytes($x.try_into().unwrap());
        let b = <$t>::from_ne_bytes($y.try_into().unwrap());
        let r = match $op {
            ReduceOp::Sum => a.wrapping_add(b),
            ReduceOp::Prod => a.wrapping_mul(b),
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::BAnd => a & b,
            ReduceOp::BOr => a | b,
            ReduceOp::BXor => a ^ b,
            op => unreachable!("{op:?} after combiner"),
        };
        r.to_ne_bytes().to_vec()
    }};
}

fn reference(dtype: DType, op: ReduceOp, a: &[u8], b: &[u8]) -> Vec<u8> {
    let op = op.combiner();
    let sz = dtype.size();
    let mut out = Vec::with_capacity(a.len());
    for (x, y) in a.chunks_exact(sz).zip(b.chunks_exact(sz)) {
        let r: Vec<u8> = match dtype {
            DType::F16 => {
                let (a, b) = (
                    f16::from_ne_bytes([x[0], x[1]]),
                    f16::from_ne_bytes([y[0], y[1]]),
                );
                f16::from_f32(ref_float!(f32, op, a.to_f32(), b.to_f32()))
                    .to_ne_bytes()
                    .to_vec()
            }
            DType::BF16 => {
                let (a, b) = (
                    bf16::from_ne_bytes([x[0], x[1]]),
                    bf16::from_ne_bytes([y[0], y[1]]),
                );
                bf16::from_f32(ref_float!(f32, op, a.to_f32(), b.to_f32()))
                    .to_ne_bytes()
                    .to_vec()
            }
            DType::F32 => {
                let (a, b) = (
                    f32::from_ne_bytes(x.try_into().unwrap()),
                    f32::from_ne_bytes(y.try_into().unwrap()),
                );
                ref_float!(f32, op, a, b).to_ne_bytes().to_vec()
            }
            DType::F64 => {
                let (a, b) = (
                    f64::from_ne_bytes(x.try_into().unwrap()),
                    f64::from_ne_bytes(y.try_into().unwrap()),
                );
                ref_float!(f64, op, a, b).to_ne_bytes().to_vec()
            }
            DType::I8 => ref_int!(i8, op, x, y),
            DType::U8 => ref_int!(u8, op, x, y),
            DType::I16 => ref_int!(i16, op, x, y),
            DType::I32 => ref_int!(i32, op, x, y),
            DType::I64 => ref_int!(i64, op, x, y),
            DType::Bool => {
                let (a, b) = (x[0] != 0, y[0] != 0);
                let r = match op {
                    ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => a || b,
                    ReduceOp::Prod | ReduceOp::Min | ReduceOp::BAnd => a && b,
                    ReduceOp::BXor => a != b,
                    op => unreachable!("{op:?} after combiner"),
                };
                vec![r as u8]
            }
        };
        out.extend(r);
    }
    out
}

/// Element values as f64 (exact for every float dtype), for comparisons where any NaN matches
/// any NaN and -0.0 matches 0.0.
fn floats(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F16 => f16::from_ne_bytes([c[0], c[1]]).to_f64(),
            DType::BF16 => bf16::from_ne_bytes([c[0], c[1]]).to_f64(),
            DType::F32 => f32::from_ne_bytes(c.try_into().unwrap()) as f64,
            DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
            _ => unreachable!(),
        })
        .collect()
}

fn assert_same(dtype: DType, got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if !dtype.is_float() {
        assert!(got == want, "{what}: bytes differ");
        return;
    }
    for (i, (g, w)) in floats(dtype, got)
        .into_iter()
        .zip(floats(dtype, want))
        .enumerate()
    {
        assert!(
            g == w || (g.is_nan() && w.is_nan()),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

/// Byte buffers at a chosen offset from 8-byte alignment.
struct Buf(Vec<u64>);

impl Buf {
    fn new(data: &[u8], offset: usize) -> Buf {
        let mut b = Buf(vec![0; (data.len() + offset).div_ceil(8) + 1]);
        b.bytes_mut(offset, data.len()).copy_from_slice(data);
        b
    }
    fn bytes_mut(&mut self, offset: usize, len: usize) -> &mut [u8] {
        &mut as_bytes_mut(&mut self.0)[offset..offset + len]
    }
}

#[test]
fn every_dtype_op_len_and_alignment_matches_reference() {
    let mut cases = 0;
    for dtype in DType::ALL {
        for op in ops().into_iter().filter(|op| op.supports(dtype)) {
            for (k, &n) in LENS.iter().enumerate() {
                let a = random(dtype, n, 1 + k as u64 * 7 + dtype as u64 * 131);
                let b = random(dtype, n, 2 + k as u64 * 11 + dtype as u64 * 137);
                let want = reference(dtype, op, &a, &b);
                let len = a.len();
                let what =
                    |f: &str, offs: &[usize]| format!("{f} {dtype} {op:?} n={n} offsets={offs:?}");

                for (od, os) in [(0, 0), (1, 0), (0, 1), (1, 1), (3, 2)] {
                    let (mut d, mut s) = (Buf::new(&a, od), Buf::new(&b, os));
                    let dst = d.bytes_mut(od, len);
                    reduce_into(dst, s.bytes_mut(os, len), dtype, op);
                    assert_same(dtype, dst, &want, &what("reduce_into", &[od, os]));
                    cases += 1;
                }
                for offs in [
                    [0, 0, 0],
                    [1, 0, 0],
                    [0, 1, 0],
                    [0, 0, 1],
                    [1, 1, 1],
                    [0, 1, 1],
                ] {
                    let mut d = Buf::new(&vec![0xAB; len], offs[0]);
                    let (mut x, mut y) = (Buf::new(&a, offs[1]), Buf::new(&b, offs[2]));
                    let dst = d.bytes_mut(offs[0], len);
                    reduce_from(
                        dst,
                        x.bytes_mut(offs[1], len),
                        y.bytes_mut(offs[2], len),
                        dtype,
                        op,
                    );
                    assert_same(dtype, dst, &want, &what("reduce_from", &offs));
                    cases += 1;
                }
            }
        }
    }
    // 4 floats x 6 ops + 6 integer-likes x 7 ops, 5 lengths, 11 alignments.
    assert_eq!(cases, (4 * 6 + 6 * 7) * 5 * 11);
}

#[test]
fn half_types_round_to_nearest_even_from_f32() {
    // f16 has 10 fraction bits: 1 + 2^-11 is a tie that rounds down to even, 1 + 3 * 2^-11 a tie
    // that rounds up to even.
    let a = [f16::from_f32(1.0), f16::from_f32(1.0)];
    let b = [
        f16::from_f32(2f32.powi(-11)),
        f16::from_f32(3.0 * 2f32.powi(-11)),
    ];
    let mut d = as_bytes(&a).to_vec();
    reduce_into(&mut d, as_bytes(&b), DType::F16, ReduceOp::Sum);
    assert_eq!(floats(DType::F16, &d), [1.0, 1.0 + 2f64.powi(-9)]);

    // bf16 has 7: 1 + 0.75 ulp must round up (truncating the f32 sum would give 1.0).
    let (x, y) = (bf16::from_f32(1.0), bf16::from_f32(1.5 * 2f32.powi(-8)));
    let mut d = x.to_ne_bytes().to_vec();
    reduce_into(&mut d, &y.to_ne_bytes(), DType::BF16, ReduceOp::Sum);
    assert_eq!(floats(DType::BF16, &d), [1.0 + 2f64.powi(-7)]);
}

#[test]
fn float_min_max_propagate_nan() {
    let nan = f64::NAN;
    let a = [1.0, nan, nan, -2.0, 0.5];
    let b = [nan, 3.0, nan, -1.0, 0.25];
    for dtype in [DType::F16, DType::BF16, DType::F32, DType::F64] {
        let enc = |v: &[f64]| -> Vec<u8> {
            v.iter()
                .flat_map(|&x| match dtype {
                    DType::F16 => f16::from_f64(x).to_ne_bytes().to_vec(),
                    DType::BF16 => bf16::from_f64(x).to_ne_bytes().to_vec(),
                    DType::F32 => (x as f32).to_ne_bytes().to_vec(),
                    _ => x.to_ne_bytes().to_vec(),
                })
                .collect()
        };
        for (op, tail) in [(ReduceOp::Min, [-2.0, 0.25]), (ReduceOp::Max, [-1.0, 0.5])] {
            for swap in [false, true] {
                let (l, r) = if swap {
                    (enc(&b), enc(&a))
                } else {
                    (enc(&a), enc(&b))
                };
                let mut into = l.clone();
                reduce_into(&mut into, &r, dtype, op);
                let mut from = vec![0; l.len()];
                reduce_from(&mut from, &l, &r, dtype, op);
                for got in [floats(dtype, &into), floats(dtype, &from)] {
                    assert!(
                        got[..3].iter().all(|x| x.is_nan()),
                        "{dtype} {op:?} {got:?}"
                    );
                    assert_eq!(got[3..], tail, "{dtype} {op:?}");
                }
            }
        }
    }
}

#[test]
fn integers_wrap() {
    let mut d = [127i8 as u8, 0x80];
    reduce_into(&mut d, &[1, 0xFF], DType::I8, ReduceOp::Sum);
    assert_eq!(d, [0x80, 0x7F]); // 127 + 1 = -128, -128 + -1 = 127

    let mut d = [255u8, 16];
    reduce_into(&mut d, &[1, 16], DType::U8, ReduceOp::Sum);
    assert_eq!(d, [0, 32]);
    reduce_into(&mut d, &[7, 8], DType::U8, ReduceOp::Prod);
    assert_eq!(d, [0, 0]); // 32 * 8 = 256

    let mut d = i32::MAX.to_ne_bytes();
    reduce_into(&mut d, &2i32.to_ne_bytes(), DType::I32, ReduceOp::Prod);
    assert_eq!(i32::from_ne_bytes(d), -2);

    let mut d = i64::MIN.to_ne_bytes();
    reduce_into(&mut d, &(-1i64).to_ne_bytes(), DType::I64, ReduceOp::Sum);
    assert_eq!(i64::from_ne_bytes(d), i64::MAX);
}

#[test]
fn bool_ops_normalize_to_zero_one() {
    let a = [0u8, 0, 2, 9, 255];
    let b = [0u8, 3, 0, 4, 1];
    let run = |op| {
        let mut d = a;
        reduce_into(&mut d, &b, DType::Bool, op);
        d
    };
    assert_eq!(run(ReduceOp::Sum), [0, 1, 1, 1, 1]);
    assert_eq!(run(ReduceOp::Max), [0, 1, 1, 1, 1]);
    assert_eq!(run(ReduceOp::BOr), [0, 1, 1, 1, 1]);
    assert_eq!(run(ReduceOp::Prod), [0, 0, 0, 1, 1]);
    assert_eq!(run(ReduceOp::Min), [0, 0, 0, 1, 1]);
    assert_eq!(run(ReduceOp::BAnd), [0, 0, 0, 1, 1]);
    assert_eq!(run(ReduceOp::BXor), [0, 1, 1, 0, 0]);
}

#[test]
fn bitwise_on_floats_uses_bit_patterns() {
    let mut d = 1.5f32.to_ne_bytes();
    reduce_into(&mut d, &(-0.0f32).to_ne_bytes(), DType::F32, ReduceOp::BOr);
    assert_eq!(f32::from_ne_bytes(d), -1.5);
}

#[test]
fn finalize_scales_floats_once() {
    for dtype in [DType::F16, DType::BF16, DType::F32, DType::F64] {
        for (op, n) in [
            (ReduceOp::Avg, 3),
            (ReduceOp::Avg, 8),
            (ReduceOp::PremulSum(0.1), 4),
        ] {
            for &len in &LENS {
                let data = random(dtype, len, 99 + len as u64);
                let want: Vec<f64> = floats(dtype, &data)
                    .into_iter()
                    .map(|x| match (dtype, op) {
                        (DType::F16, ReduceOp::Avg) => f16::from_f32(x as f32 / n as f32).to_f64(),
                        (DType::BF16, ReduceOp::Avg) => {
                            bf16::from_f32(x as f32 / n as f32).to_f64()
                        }
                        (DType::F16, _) => f16::from_f32(x as f32 * 0.1f32).to_f64(),
                        (DType::BF16, _) => bf16::from_f32(x as f32 * 0.1f32).to_f64(),
                        (DType::F32, ReduceOp::Avg) => (x as f32 / n as f32) as f64,
                        (DType::F32, _) => (x as f32 * 0.1f32) as f64,
                        (_, ReduceOp::Avg) => x / n as f64,
                        _ => x * 0.1,
                    })
                    .collect();
                for off in [0, 1] {
                    let mut b = Buf::new(&data, off);
                    let buf = b.bytes_mut(off, data.len());
                    finalize(buf, dtype, op, n);
                    assert_eq!(
                        floats(dtype, buf),
                        want,
                        "{dtype} {op:?} n={n} len={len} off={off}"
                    );
                }
            }
        }
    }
}

#[test]
fn finalize_other_cases() {
    // Non-scaling ops, a single rank and zero ranks leave floats untouched.
    let orig = 7.0f32.to_ne_bytes();
    for (op, n) in [
        (ReduceOp::Sum, 4),
        (ReduceOp::Max, 4),
        (ReduceOp::Avg, 1),
        (ReduceOp::Avg, 0),
    ] {
        let mut d = orig;
        finalize(&mut d, DType::F32, op, n);
        assert_eq!(d, orig, "{op:?} n={n}");
    }
    // Integers: Avg truncates toward zero, PremulSum is ignored.
    let mut d: Vec<u8> = [7i32, -7, i32::MIN]
        .iter()
        .flat_map(|x| x.to_ne_bytes())
        .collect();
    finalize(&mut d, DType::I32, ReduceOp::Avg, 2);
    let got: Vec<i32> = d
        .chunks(4)
        .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, [3, -3, i32::MIN / 2]);
    let mut d = [200u8, 9];
    finalize(&mut d, DType::U8, ReduceOp::Avg, 300); // nranks wider than the type
    assert_eq!(d, [0, 0]);
    let mut d = [100u8];
    finalize(&mut d, DType::U8, ReduceOp::PremulSum(0.5), 2);
    assert_eq!(d, [100]);
    let mut d = [1u8, 0];
    finalize(&mut d, DType::Bool, ReduceOp::Avg, 2);
    assert_eq!(d, [1, 0]);
}

#[test]
#[cfg_attr(debug_assertions, should_panic(expected = "length mismatch"))]
fn mismatched_lengths_assert_in_debug_and_use_common_prefix_in_release() {
    let mut d = [1u8, 2, 3, 4, 5];
    reduce_into(&mut d, &[10, 10, 10], DType::U8, ReduceOp::Sum);
    assert_eq!(d, [11, 12, 13, 4, 5]);
    let mut d = [0u8; 4];
    reduce_from(&mut d, &[1, 2, 3, 4], &[1, 1], DType::U8, ReduceOp::Sum);
    assert_eq!(d, [2, 3, 0, 0]);
}

#[test]
fn streaming_copy_matches_plain_copy_at_every_alignment() {
    let src = random(DType::U8, 4096 + 64, 7);
    for offset in 0..17 {
        for len in [0usize, 1, 15, 16, 17, 31, 33, 1000, 4096] {
            let mut dst = vec![0xAAu8; len + 40];
            copy_streaming(&mut dst[offset..offset + len], &src[3..3 + len]);
            assert_eq!(&dst[offset..offset + len], &src[3..3 + len], "offset {offset} len {len}");
            assert!(dst[..offset].iter().chain(&dst[offset + len..]).all(|b| *b == 0xAA), "wrote outside");
        }
    }
}
