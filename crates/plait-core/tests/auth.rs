//! Authenticated and sealed links end to end: ranks as threads of one process over loopback,
//! with `PLAIT_TOKEN` and `PLAIT_ENCRYPT` set through the configuration.
//!
//! Every `unsafe` call here passes buffers that live on the calling test's stack or heap until
//! it has waited for the call's Work: the contract of `plait_core::RawBuf`.

use plait_core::{CollRequest, Collective, CommConfig, Communicator, DType, MemStore, RawBuf, ReduceOp, Token};
use std::sync::Arc;
use std::time::Duration;

/// Runs `f` on every rank of a world of `n`, each configured by `tweak(rank, cfg)`; returns each
/// rank's result, or the error its communicator failed with.
fn world_with<T: Send + 'static>(
    n: usize,
    tweak: impl Fn(usize, &mut CommConfig) + Send + Sync + 'static,
    f: impl Fn(Arc<Communicator>) -> T + Send + Sync + 'static,
) -> Vec<Result<T, String>> {
    let store = Arc::new(MemStore::new());
    let (tweak, f) = (Arc::new(tweak), Arc::new(f));
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (store, f, tweak) = (store.clone(), f.clone(), tweak.clone());
            std::thread::spawn(move || {
                let mut cfg = CommConfig::from_env(r, n).unwrap();
                cfg.timeout = Duration::from_secs(10);
                cfg.segment_bytes = 256 * 1024;
                tweak(r, &mut cfg);
                let comm = Communicator::new(&*store, cfg).map_err(|e| e.to_string())?;
                let out = f(comm.clone());
                comm.close();
                Ok(out)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn bytes<T>(v: &mut [T]) -> RawBuf {
    RawBuf { ptr: v.as_mut_ptr() as *mut u8, len: std::mem::size_of_val(v) }
}

/// Allreduces with every algorithm and sizes around the sealed record size, and point-to-point
/// messages that end on and just past record boundaries; returns what went wrong.
fn exercise(comm: Arc<Communicator>) -> Vec<String> {
    let (r, n) = (comm.rank(), comm.size());
    let mut errs = Vec::new();
    for algo in ["ring", "direct", "rhd", "oneshot"] {
        for count in [0usize, 1, 2, 16_379, 16_380, 300_001] {
            let mut input: Vec<f32> = (0..count).map(|i| (i % 29) as f32 + r as f32).collect();
            let mut output = vec![-1.0f32; count];
            let req = CollRequest {
                coll: Collective::AllReduce,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                root: 0,
                input: bytes(&mut input),
                output: bytes(&mut output),
                send_counts: None,
                recv_counts: None,
                timeout: None,
                algo: Some(algo.into()),
                wire: None,
            };
            match unsafe { comm.collective(req, true) }.and_then(|w| w.wait(None).unwrap()) {
                Err(e) => errs.push(format!("{algo} count={count}: {e}")),
                Ok(_) => {
                    let want = |i: usize| (0..n).map(|q| (i % 29) as f32 + q as f32).sum::<f32>();
                    if let Some(i) = (0..count).find(|&i| output[i] != want(i)) {
                        errs.push(format!("{algo} count={count}: [{i}] = {} (want {})", output[i], want(i)));
                    }
                }
            }
        }
    }
    if n == 2 {
        let other = 1 - r;
        for len in [65_519usize, 65_520, 1_000_003] {
            let mut msg: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let mut got = vec![0u8; len];
            let result = if r == 0 {
                unsafe { comm.send(bytes(&mut msg), DType::U8, other, 3, None, true) }.and_then(|w| w.wait(None).unwrap())
            } else {
                unsafe { comm.recv(bytes(&mut got), DType::U8, Some(other), 3, None, true) }.and_then(|w| w.wait(None).unwrap())
            };
            match result {
                Err(e) => errs.push(format!("p2p {len} bytes: {e}")),
                Ok(_) if r == 1 && got != msg => errs.push(format!("p2p {len} bytes: wrong contents")),
                Ok(_) => {}
            }
        }
    }
    errs
}

#[test]
fn worlds_with_a_token_and_sealed_frames_compute_what_open_ones_do() {
    for (token, encrypt) in [(false, false), (true, false), (false, true), (true, true)] {
        for (n, streams) in [(2, 1), (3, 2)] {
            let results = world_with(
                n,
                move |_, cfg| {
                    cfg.token = token.then(|| Token::new("correct horse"));
                    cfg.encrypt = encrypt;
                    cfg.streams = streams;
                },
                exercise,
            );
            for (r, res) in results.into_iter().enumerate() {
                let errs = res.unwrap_or_else(|e| panic!("token={token} encrypt={encrypt} n={n}: rank {r}: {e}"));
                assert!(errs.is_empty(), "token={token} encrypt={encrypt} n={n} streams={streams}: rank {r}: {errs:?}");
            }
        }
    }
}

/// Ranks that disagree on the token or on sealing fail start-up with an error that names the
/// setting, instead of linking (or hanging).
#[test]
fn ranks_disagreeing_on_token_or_sealing_fail_naming_the_setting() {
    type Tweak = fn(usize, &mut CommConfig);
    let cases: [(Tweak, &str); 3] = [
        (|r, cfg| cfg.token = (r == 1).then(|| Token::new("t")), "PLAIT_TOKEN set"),
        (|r, cfg| cfg.token = Some(Token::new(format!("token of rank {r}"))), "PLAIT_TOKEN differs"),
        (|r, cfg| cfg.encrypt = r == 0, "PLAIT_ENCRYPT"),
    ];
    for (tweak, what) in cases {
        let results = world_with(
            2,
            move |r, cfg| {
                cfg.timeout = Duration::from_secs(2);
                tweak(r, cfg)
            },
            |_| (),
        );
        let errs: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        assert!(errs.iter().any(|e| e.contains(what) && e.contains("rank 1")), "{what}: {errs:?}");
    }
}
