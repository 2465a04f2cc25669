//! The communicator end to end, ranks as threads of one process over loopback.
//!
//! Every `unsafe` call here passes buffers that live on the calling test's stack or heap until
//! it has waited for the call's Work: the contract of `plait_core::RawBuf`.

use plait_core::{algorithms, CollRequest, Collective, CommConfig, Communicator, DType, Measure, MemStore, PlaitError, RawBuf, ReduceOp, RingOrder};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn world<T: Send + 'static>(n: usize, epoch: u64, f: impl Fn(Arc<Communicator>) -> T + Send + Sync + 'static) -> Vec<T> {
    world_with(n, epoch, |cfg| cfg.segment_bytes = 4096, f)
}

fn world_with<T: Send + 'static>(
    n: usize,
    epoch: u64,
    tweak: impl Fn(&mut CommConfig) + Send + Sync + 'static,
    f: impl Fn(Arc<Communicator>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store = Arc::new(MemStore::new());
    let tweak = Arc::new(tweak);
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (store, f, tweak) = (store.clone(), f.clone(), tweak.clone());
            std::thread::spawn(move || {
                let mut cfg = CommConfig::from_env(r, n).unwrap();
                cfg.timeout = Duration::from_secs(20);
                cfg.epoch = epoch;
                tweak(&mut cfg);
                let comm = Communicator::new(&*store, cfg).unwrap();
                let out = f(comm.clone());
                comm.close();
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn f32_buf(v: &mut [f32]) -> RawBuf {
    RawBuf { ptr: v.as_mut_ptr() as *mut u8, len: v.len() * 4 }
}

fn allreduce(comm: &Arc<Communicator>, input: &mut [f32], output: &mut [f32], algo: Option<&str>) -> Result<(), PlaitError> {
    collective(comm, Collective::AllReduce, input, output, algo)
}

/// A blocking f32 sum `coll` over `input` and `output` (each rank's own buffers).
fn collective(comm: &Arc<Communicator>, coll: Collective, input: &mut [f32], output: &mut [f32], algo: Option<&str>) -> Result<(), PlaitError> {
    let req = CollRequest { coll, output: f32_buf(output), algo: algo.map(String::from), ..CollRequest::allreduce(f32_buf(input), DType::F32, ReduceOp::Sum) };
    unsafe { comm.collective(req, true) }?.wait(None).unwrap().map(|_| ())
}

#[test]
fn allreduce_every_algorithm_every_small_world() {
    for n in [1, 2, 3, 5] {
        for &algo in algorithms(Collective::AllReduce) {
            let results = world(n, 0, move |comm| {
                let r = comm.rank();
                let mut errs = Vec::new();
                for count in [0usize, 1, 7, 4099, 20000] {
                    let mut input: Vec<f32> = (0..count).map(|i| (i % 13) as f32 + r as f32).collect();
                    let mut output = vec![-1.0f32; count];
                    allreduce(&comm, &mut input, &mut output, Some(algo)).unwrap();
                    for (i, v) in output.iter().enumerate() {
                        let want: f32 = (0..n).map(|q| (i % 13) as f32 + q as f32).sum();
                        if *v != want {
                            errs.push(format!("n={n} {algo} count={count} [{i}] = {v}, want {want}"));
                            break;
                        }
                    }
                }
                errs
            });
            let errs: Vec<String> = results.into_iter().flatten().collect();
            assert!(errs.is_empty(), "{errs:?}");
        }
    }
}

#[test]
fn abort_from_another_thread_ends_the_operation_and_restores_the_output() {
    let results = world(2, 0, |comm| {
        if comm.rank() == 1 {
            // Rank 1 never joins: rank 0 waits until it is aborted.
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let mut input = vec![1.0f32; 100_000];
        let mut output = vec![7.0f32; 100_000];
        let c2 = comm.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            c2.abort("test abort");
        });
        let start = Instant::now();
        let err = allreduce(&comm, &mut input, &mut output, None).unwrap_err();
        t.join().unwrap();
        assert!(output.iter().all(|v| *v == 7.0), "output was modified");
        Some((err, start.elapsed()))
    });
    let (err, took) = results[0].clone().unwrap();
    assert!(matches!(err, PlaitError::Aborted { .. }), "{err}");
    assert!(took < Duration::from_millis(1300), "abort took {took:?}");
}

#[test]
fn compressed_allreduce_is_bit_identical_on_every_rank_and_close_to_exact() {
    use plait_core::Wire;
    for wire in [Wire::Bf16, Wire::F16, Wire::Int8] {
        let n = 3;
        let count = 10_007;
        let results = world(n, 0, move |comm| {
            let r = comm.rank();
            let mut input: Vec<f32> = (0..count).map(|i| ((i * 7 + r * 13) % 101) as f32 / 10.0 - 5.0).collect();
            let mut output = vec![0.0f32; count];
            let req = CollRequest { output: f32_buf(&mut output), wire: Some(wire), ..CollRequest::allreduce(f32_buf(&mut input), DType::F32, ReduceOp::Sum) };
            unsafe { comm.collective(req, true) }.unwrap().wait(None).unwrap().unwrap();
            output
        });
        for r in 1..n {
            assert!(results[r].iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits()), "{wire:?}: rank {r} differs from rank 0");
        }
        // Each contribution is within 5.0 in magnitude; the error bound is per-contribution.
        let tol = match wire {
            Wire::Int8 => 3.0 * 2.0 * 5.0 / 254.0 + 15.0 / 254.0,
            Wire::Bf16 => 15.0 / 128.0,
            _ => 15.0 / 1024.0,
        };
        for (i, got) in results[0].iter().enumerate() {
            let exact: f64 = (0..n).map(|r| (((i * 7 + r * 13) % 101) as f64) / 10.0 - 5.0).sum();
            assert!((*got as f64 - exact).abs() <= tol, "{wire:?} [{i}]: {got} vs {exact}");
        }
    }
}

#[test]
fn wire_compression_refuses_what_it_cannot_do() {
    use plait_core::Wire;
    let results = world(2, 0, |comm| {
        let mut v = vec![0i32; 8];
        let buf = RawBuf { ptr: v.as_mut_ptr() as *mut u8, len: 32 };
        let req = CollRequest { wire: Some(Wire::Bf16), ..CollRequest::allreduce(buf, DType::I32, ReduceOp::Sum) };
        matches!(unsafe { comm.collective(req, true) }, Err(PlaitError::InvalidArgument(_)))
    });
    assert!(results.iter().all(|ok| *ok));
}

#[test]
fn async_receives_posted_before_their_sends_do_not_deadlock() {
    // Every rank posts a receive from every peer, async, before sending anything: with a fixed
    // pool of workers the receives would hold every worker and the sends would never run.
    let n = 4;
    let results = world(n, 0, move |comm| {
        let r = comm.rank();
        let mut inbox: Vec<Vec<f32>> = (0..n).map(|_| vec![0.0f32; 1000]).collect();
        let mut outbox = vec![r as f32; 1000];
        let mut works = Vec::new();
        for (p, buf) in inbox.iter_mut().enumerate().filter(|(p, _)| *p != r) {
            works.push(unsafe { comm.recv(f32_buf(buf), DType::F32, Some(p), 7, Some(Duration::from_secs(10)), false) }.unwrap());
        }
        for p in (0..n).filter(|&p| p != r) {
            works.push(unsafe { comm.send(f32_buf(&mut outbox), DType::F32, p, 7, Some(Duration::from_secs(10)), false) }.unwrap());
        }
        for w in works {
            w.wait(Some(Duration::from_secs(15))).expect("finished").unwrap();
        }
        (0..n).filter(|&p| p != r).all(|p| inbox[p].iter().all(|v| *v == p as f32))
    });
    assert!(results.iter().all(|ok| *ok));
}

#[test]
fn async_messages_with_one_tag_match_in_call_order() {
    let results = world(2, 0, |comm| {
        let mut swapped = 0;
        for _ in 0..300 {
            let mut a = vec![1.0f32; 4];
            let mut b = vec![2.0f32; 4];
            if comm.rank() == 0 {
                let w1 = unsafe { comm.send(f32_buf(&mut a), DType::F32, 1, 7, None, false) }.unwrap();
                let w2 = unsafe { comm.send(f32_buf(&mut b), DType::F32, 1, 7, None, false) }.unwrap();
                w1.wait(None).unwrap().unwrap();
                w2.wait(None).unwrap().unwrap();
            } else {
                let (mut x, mut y) = (vec![0.0f32; 4], vec![0.0f32; 4]);
                let r1 = unsafe { comm.recv(f32_buf(&mut x), DType::F32, Some(0), 7, None, false) }.unwrap();
                let r2 = unsafe { comm.recv(f32_buf(&mut y), DType::F32, None, 7, None, false) }.unwrap();
                r1.wait(None).unwrap().unwrap();
                r2.wait(None).unwrap().unwrap();
                swapped += (x[0] != 1.0 || y[0] != 2.0) as usize;
            }
        }
        swapped
    });
    assert_eq!(results, vec![0, 0]);
}

/// Several TCP streams per peer (`PLAIT_STREAMS`): large segments take the lanes in turn and
/// arrive in any order; results and message order must not change.
#[test]
fn several_streams_per_peer_keep_results_and_message_order() {
    let lanes = |cfg: &mut CommConfig| {
        cfg.streams = 3;
        cfg.segment_bytes = 128 * 1024;
    };
    for n in [2, 3, 4] {
        let errs: Vec<String> = world_with(n, 0, lanes, move |comm| {
            let r = comm.rank();
            let mut errs = Vec::new();
            for algo in ["ring", "direct", "rhd"] {
                for count in [0usize, 5, 300_001] {
                    let mut input: Vec<f32> = (0..count).map(|i| (i % 31) as f32 * 0.5 + r as f32).collect();
                    let mut output = vec![-1.0f32; count];
                    allreduce(&comm, &mut input, &mut output, Some(algo)).unwrap();
                    if let Some((i, v)) = output.iter().enumerate().find(|(i, v)| {
                        **v != (0..n).map(|q| (i % 31) as f32 * 0.5 + q as f32).sum::<f32>()
                    }) {
                        errs.push(format!("n={n} {algo} count={count}: [{i}] = {v}"));
                    }
                }
            }
            errs
        })
        .into_iter()
        .flatten()
        .collect();
        assert!(errs.is_empty(), "{errs:?}");
    }
    // Large messages with one tag, received from any source: lanes let a later message overtake
    // an earlier one on the wire, but receives must still match in the order of the sends.
    let results = world_with(2, 0, lanes, |comm| {
        let len = 100_000;
        let mut wrong = Vec::new();
        for round in 0..20 {
            if comm.rank() == 0 {
                let mut bufs: Vec<Vec<f32>> = (0..4).map(|k| vec![(round * 4 + k) as f32; len]).collect();
                let works: Vec<_> =
                    bufs.iter_mut().map(|b| unsafe { comm.send(f32_buf(b), DType::F32, 1, 9, None, false) }.unwrap()).collect();
                for w in works {
                    w.wait(None).unwrap().unwrap();
                }
            } else {
                let mut bufs: Vec<Vec<f32>> = (0..4).map(|_| vec![0.0f32; len]).collect();
                let works: Vec<_> =
                    bufs.iter_mut().map(|b| unsafe { comm.recv(f32_buf(b), DType::F32, None, 9, None, false) }.unwrap()).collect();
                for w in works {
                    w.wait(None).unwrap().unwrap();
                }
                for (k, b) in bufs.iter().enumerate() {
                    if let Some(v) = b.iter().find(|v| **v != (round * 4 + k) as f32) {
                        wrong.push(format!("round {round}: receive {k} holds message {v}"));
                    }
                }
            }
        }
        wrong
    });
    assert!(results.iter().all(|w| w.is_empty()), "{results:?}");
}

/// Every rank of a world of `n` whose configurations `tweak` sets, expected to be refused at
/// start-up: each rank's error and how long it took.
fn refusals(n: usize, timeout: Duration, tweak: impl Fn(&mut CommConfig) + Send + Sync + 'static) -> Vec<(String, Duration)> {
    let store = Arc::new(MemStore::new());
    let tweak = Arc::new(tweak);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (store, tweak) = (store.clone(), tweak.clone());
            std::thread::spawn(move || {
                let mut cfg = CommConfig::from_env(r, n).unwrap();
                cfg.timeout = timeout;
                tweak(&mut cfg);
                let t0 = Instant::now();
                let e = Communicator::new(&*store, cfg).map(|c| c.close()).expect_err("refused").to_string();
                (e, t0.elapsed())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn ranks_disagreeing_on_streams_fail_naming_the_setting() {
    let errs = refusals(2, Duration::from_secs(3), |cfg| cfg.streams = 1 + cfg.rank);
    assert!(errs.iter().any(|(e, _)| e.contains("PLAIT_STREAMS")), "{errs:?}");
}

/// Receiver threads wait for several hundred KiB per wake-up while reading a large payload; a
/// message whose tail is shorter than that, with nothing sent after it, must still arrive.
#[test]
fn large_messages_arrive_when_nothing_follows_them() {
    let results = world_with(2, 0, |cfg| cfg.timeout = Duration::from_secs(5), |comm| {
        let mut errs = Vec::new();
        for len in [40_000usize, 65_537, 262_143, 262_145, 300_007, 524_289, 1_048_577, 3_000_001] {
            let mut msg: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let mut got = vec![0u8; len];
            let buf = |v: &mut Vec<u8>| RawBuf { ptr: v.as_mut_ptr(), len: v.len() };
            let other = 1 - comm.rank();
            // Ping-pong: each message is the last thing its sender sends until it hears back.
            let result = if comm.rank() == 0 {
                unsafe { comm.send(buf(&mut msg), DType::U8, other, 3, None, true) }.and_then(|w| w.wait(None).unwrap())
                    .and_then(|_| unsafe { comm.recv(buf(&mut got), DType::U8, Some(other), 3, None, true) }?.wait(None).unwrap())
            } else {
                unsafe { comm.recv(buf(&mut got), DType::U8, Some(other), 3, None, true) }.and_then(|w| w.wait(None).unwrap())
                    .and_then(|_| unsafe { comm.send(buf(&mut msg), DType::U8, other, 3, None, true) }?.wait(None).unwrap())
            };
            match result {
                Err(e) => errs.push(format!("{len} bytes: {e}")),
                Ok(_) if got != msg => errs.push(format!("{len} bytes: wrong contents")),
                Ok(_) => {}
            }
        }
        errs
    });
    assert!(results.iter().all(|e| e.is_empty()), "{results:?}");
}

/// Messages from 8 MiB on go as pieces spread over a link's connections: sizes around the piece
/// thresholds, odd element counts, receives from a given rank and from any rank, several messages
/// with one tag in flight at once (their pieces must not cross), all arrive whole and in the
/// order of their sends; with one connection or three, and with an early-data budget so small
/// that pieces wait in the sockets.
#[test]
fn large_messages_in_pieces_arrive_whole_and_in_order() {
    for (streams, budget) in [(3, None), (1, None), (3, Some(MIB as u64))] {
        let results = world_with(2, 0, move |cfg| {
            cfg.streams = streams;
            if let Some(b) = budget {
                cfg.unexpected_bytes = b;
            }
        }, |comm| {
            let counts = [2 * MIB - 1, 2 * MIB, 2 * MIB + 3, 9 * MIB + 5, 5];
            let f = |k: usize, i: usize| ((k * 131 + i) % 9973) as f32;
            let mut wrong = Vec::new();
            for any_source in [false, true] {
                if comm.rank() == 0 {
                    let mut msgs: Vec<Vec<f32>> = counts.iter().enumerate().map(|(k, &c)| (0..c).map(|i| f(k, i)).collect()).collect();
                    let works: Vec<_> = msgs.iter_mut().map(|m| unsafe { comm.send(f32_buf(m), DType::F32, 1, 11, None, false) }.unwrap()).collect();
                    for w in works {
                        if let Err(e) = w.wait(None).unwrap() {
                            wrong.push(format!("send: {e}"));
                        }
                    }
                } else {
                    let mut bufs: Vec<Vec<f32>> = counts.iter().map(|&c| vec![-1.0; c]).collect();
                    let src = if any_source { None } else { Some(0) };
                    let works: Vec<_> = bufs.iter_mut().map(|b| unsafe { comm.recv(f32_buf(b), DType::F32, src, 11, None, false) }.unwrap()).collect();
                    for (k, w) in works.into_iter().enumerate() {
                        match w.wait(None).unwrap() {
                            Err(e) => wrong.push(format!("any_source={any_source} message {k}: {e}")),
                            Ok(_) => {
                                if let Some((i, v)) = bufs[k].iter().enumerate().find(|(i, v)| **v != f(k, *i)) {
                                    wrong.push(format!("any_source={any_source} message {k}: [{i}] = {v}"));
                                }
                            }
                        }
                    }
                }
                comm.barrier(None, true).unwrap().wait(None).unwrap().unwrap();
            }
            wrong
        });
        assert!(results.iter().all(|w| w.is_empty()), "streams={streams} budget={budget:?}: {results:?}");
    }
}

/// A receive of another size than the message sent in pieces fails on both ranks, naming the
/// counts, instead of waiting for pieces that never come.
#[test]
fn a_message_in_pieces_received_with_another_size_fails_naming_the_counts() {
    let results = world_with(2, 0, |cfg| {
        cfg.streams = 2;
        cfg.timeout = Duration::from_secs(10);
    }, |comm| {
        let t0 = Instant::now();
        let mut buf = vec![1u8; if comm.rank() == 0 { 12 * MIB } else { 16 * MIB }];
        let raw = RawBuf { ptr: buf.as_mut_ptr(), len: buf.len() };
        let result = if comm.rank() == 0 {
            unsafe { comm.send(raw, DType::U8, 1, 3, None, true) }.and_then(|w| w.wait(None).unwrap())
        } else {
            unsafe { comm.recv(raw, DType::U8, Some(0), 3, None, true) }.and_then(|w| w.wait(None).unwrap())
        };
        (result.map_err(|e| e.to_string()), t0.elapsed(), buf.iter().all(|b| *b == 1))
    });
    let (err, took, untouched) = &results[1];
    let err = err.as_ref().unwrap_err();
    assert!(err.contains("counts differ") || err.contains("elements"), "{err}");
    assert!(*untouched, "the receiver's buffer is as it was");
    assert!(*took < Duration::from_secs(8), "{took:?}");
    assert!(results[0].1 < Duration::from_secs(12), "the sender does not hang either: {:?}", results[0]);
}

/// A receive aborted while its 256 MiB message is streaming in leaves the buffer as it was.
#[test]
fn a_receive_aborted_mid_message_leaves_its_buffer_as_it_was() {
    let results = world(2, 0, |comm| {
        let len = 256 << 20;
        if comm.rank() == 0 {
            let mut msg = vec![1u8; len];
            let buf = RawBuf { ptr: msg.as_mut_ptr(), len };
            // Fails once rank 1 aborts; only the receiver's buffer is judged.
            let _ = unsafe { comm.send(buf, DType::U8, 1, 4, None, true) }.map(|w| w.wait(None));
            return true;
        }
        let mut got = vec![7u8; len];
        let buf = RawBuf { ptr: got.as_mut_ptr(), len };
        let c2 = comm.clone();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            c2.abort("test: abort mid-message");
        });
        let result = unsafe { comm.recv(buf, DType::U8, Some(0), 4, None, true) }.and_then(|w| w.wait(None).unwrap());
        aborter.join().unwrap();
        result.is_err() && got.iter().all(|b| *b == 7)
    });
    assert_eq!(results, vec![true, true]);
}

// -- flow control: early data over PLAIT_UNEXPECTED_BYTES waits in the socket for its receive --

const MIB: usize = 1 << 20;

/// A 1 MiB budget for early frames, and who reads the links: the receiver threads, or (for
/// blocking calls of any size) the waiting caller itself.
fn small_budget(streams: usize, caller_reads: bool) -> impl Fn(&mut CommConfig) + Send + Sync + 'static {
    move |cfg: &mut CommConfig| {
        cfg.unexpected_bytes = MIB as u64;
        cfg.streams = streams;
        if caller_reads {
            cfg.caller_read_bytes = 1 << 30;
        }
    }
}

/// Was: the late rank's link was cut ("over the 1048576 bytes allowed per peer").
#[test]
fn a_late_rank_gets_collectives_of_many_times_its_budget_right() {
    for (n, streams, caller_reads) in [(2, 1, false), (2, 1, true), (3, 3, false), (3, 1, true)] {
        let results = world_with(n, 0, small_budget(streams, caller_reads), move |comm| {
            let r = comm.rank();
            if r == n - 1 {
                std::thread::sleep(Duration::from_millis(500));
            }
            let count = 4 * MIB; // 16 MiB of f32
            let mut input: Vec<f32> = (0..count).map(|i| (i % 1001) as f32 + r as f32).collect();
            let mut output = vec![0.0f32; count];
            let reduced = allreduce(&comm, &mut input, &mut output, None).map(|_| {
                output.iter().enumerate().all(|(i, v)| *v == (0..n).map(|q| (i % 1001) as f32 + q as f32).sum::<f32>())
            });
            // A broadcast from rank 0 (the whole 16 MiB goes to late ranks at once), then late again.
            if r == n - 1 {
                std::thread::sleep(Duration::from_millis(300));
            }
            let mut data: Vec<f32> = if r == 0 { (0..count).map(|i| i as f32).collect() } else { vec![0.0; count] };
            let req = CollRequest { coll: Collective::Broadcast, ..CollRequest::allreduce(f32_buf(&mut data), DType::F32, ReduceOp::Sum) };
            let sent = unsafe { comm.collective(req, true) }.and_then(|w| w.wait(None).unwrap()).map(|_| data.iter().enumerate().all(|(i, v)| *v == i as f32));
            (reduced.map_err(|e| e.to_string()), sent.map_err(|e| e.to_string()))
        });
        for (r, (reduced, sent)) in results.iter().enumerate() {
            assert_eq!(reduced, &Ok(true), "n={n} streams={streams} caller_reads={caller_reads}: allreduce on rank {r}");
            assert_eq!(sent, &Ok(true), "n={n} streams={streams} caller_reads={caller_reads}: broadcast on rank {r}");
        }
    }
}

/// Was: the second message went over the budget and the link was cut.
#[test]
fn sends_of_many_times_the_budget_before_their_receives_arrive_whole_and_in_order() {
    for (streams, caller_reads) in [(1, false), (1, true), (3, false)] {
        let results = world_with(2, 0, small_budget(streams, caller_reads), |comm| {
            let sizes = [3 * MIB, MIB / 2, 5 * MIB, 100];
            let buf = |v: &mut Vec<u8>| RawBuf { ptr: v.as_mut_ptr(), len: v.len() };
            if comm.rank() == 0 {
                let mut msgs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(k, &s)| vec![k as u8 + 1; s]).collect();
                let works: Vec<_> = msgs.iter_mut().map(|m| unsafe { comm.send(buf(m), DType::U8, 1, 7, None, false) }.unwrap()).collect();
                return works.into_iter().map(|w| w.wait(None).unwrap().map(|_| String::new()).unwrap_or_else(|e| e.to_string())).collect::<Vec<_>>();
            }
            std::thread::sleep(Duration::from_millis(500));
            let mut wrong = Vec::new();
            for (k, &s) in sizes.iter().enumerate() {
                let mut got = vec![0u8; s];
                // Blocking receives; the third from any source.
                let src = if k == 2 { None } else { Some(0) };
                match unsafe { comm.recv(buf(&mut got), DType::U8, src, 7, None, true) }.and_then(|w| w.wait(None).unwrap()) {
                    Err(e) => wrong.push(format!("message {k}: {e}")),
                    Ok(_) if got.iter().any(|b| *b != k as u8 + 1) => wrong.push(format!("message {k}: wrong contents")),
                    Ok(_) => {}
                }
            }
            wrong
        });
        assert!(results.iter().flatten().all(|e| e.is_empty()), "streams={streams} caller_reads={caller_reads}: {results:?}");
    }
}

/// A rank whose link has a parked frame can still abort and close at once: the parked reader
/// wakes and ends instead of waiting out the frame's timeout (30 s here).
#[test]
fn a_rank_with_a_parked_frame_aborts_and_closes_without_waiting_for_it() {
    for caller_reads in [false, true] {
        let results = world_with(2, 0, move |cfg| {
            small_budget(1, caller_reads)(cfg);
            cfg.timeout = Duration::from_secs(30);
        }, |comm| {
            let buf = |v: &mut Vec<u8>| RawBuf { ptr: v.as_mut_ptr(), len: v.len() };
            let mut msg = vec![1u8; 8 * MIB];
            if comm.rank() == 0 {
                // Never received; it ends once rank 1 aborts: failed, or written whole when rank
                // 1's aborted reader drains what was left in its socket before this rank heard
                // of the abort (a send completes once written; CI saw both). Either way it ends.
                let w = unsafe { comm.send(buf(&mut msg), DType::U8, 1, 3, None, false) }.unwrap();
                return w.wait(Some(Duration::from_secs(25))).is_some();
            }
            std::thread::sleep(Duration::from_millis(500));
            let t = Instant::now();
            comm.abort("done waiting");
            comm.close();
            t.elapsed() < Duration::from_secs(10)
        });
        assert_eq!(results, vec![true, true], "caller_reads={caller_reads}: (rank 0's send ended, rank 1 closed promptly)");
    }
}

#[test]
fn measured_links_are_shared_alike_and_the_ring_runs_in_the_order_given() {
    // Loopback links are measured only when asked (PLAIT_MEASURE=1): every rank ends with the
    // same matrix of positive rates and the same ring order, and rings run correctly in it.
    let n = 4;
    let out = world_with(n, 0, |cfg| cfg.measure = Measure::Always, move |comm| {
        let m = comm.link_matrix().expect("measured").clone();
        let mut input: Vec<f32> = (0..1000).map(|i| (i + comm.rank()) as f32).collect();
        let mut output = vec![0f32; 1000];
        allreduce(&comm, &mut input, &mut output, Some("ring")).unwrap();
        let want: Vec<f32> = (0..1000).map(|i| (n * i + 6) as f32).collect();
        assert_eq!(output, want);
        // Broadcast and reduce along the tree the measured links call for, from every root.
        for root in 0..n {
            let label = comm.predict(Collective::Broadcast, 4000, root, Some("tree")).unwrap().1;
            assert!(label.starts_with("tree (edges "), "{label}");
            for coll in [Collective::Broadcast, Collective::Reduce] {
                let r = comm.rank();
                let mut input: Vec<f32> = (0..1001).map(|i| (i * (r + 1)) as f32).collect();
                let mut output = vec![-1f32; 1001];
                let req = CollRequest { coll, root, output: f32_buf(&mut output), algo: Some("tree".into()), ..CollRequest::allreduce(f32_buf(&mut input), DType::F32, ReduceOp::Sum) };
                unsafe { comm.collective(req, true) }.and_then(|w| w.wait(None).unwrap()).unwrap();
                let want: Vec<f32> = match coll {
                    Collective::Broadcast => (0..1001).map(|i| (i * (root + 1)) as f32).collect(),
                    _ if r == root => (0..1001).map(|i| (i * 10) as f32).collect(),
                    _ => vec![-1f32; 1001],
                };
                assert_eq!(output, want, "{coll} from {root}: {label}");
            }
        }
        (m, comm.ring_order())
    });
    for (m, order) in &out {
        assert_eq!(m, &out[0].0, "every rank has the same matrix");
        assert_eq!(order, &out[0].1, "every rank has the same ring order");
        for i in 0..n {
            for j in (0..n).filter(|&j| j != i) {
                assert!(m.bandwidth(i, j) > 1e6 && m.latency(i, j) > 0.0, "{i}->{j}: {m:?}");
            }
        }
    }
    let out = world_with(n, 0, |cfg| cfg.ring_order = RingOrder::Given(vec![0, 2, 1, 3]), move |comm| {
        assert!(comm.link_matrix().is_none(), "loopback is not measured by default");
        for algo in ["ring", "ring2"] {
            let mut input: Vec<f32> = (0..777).map(|i| (i * (comm.rank() + 1)) as f32).collect();
            let mut output = vec![0f32; 777];
            allreduce(&comm, &mut input, &mut output, Some(algo)).unwrap();
            assert_eq!(output, (0..777).map(|i| (i * 10) as f32).collect::<Vec<_>>(), "{algo}");
        }
        comm.ring_order()
    });
    assert!(out.iter().all(|o| o == &[0, 2, 1, 3]), "{out:?}");
}

#[test]
fn ranks_given_different_ring_orders_all_fail_naming_their_orders_instead_of_mixing_data() {
    let out = world_with(3, 0, |cfg| {
        cfg.timeout = Duration::from_secs(2);
        cfg.ring_order = if cfg.rank == 0 { RingOrder::Rank } else { RingOrder::Given(vec![0, 2, 1]) };
    }, |comm| {
        let mut input = vec![1f32; 3000];
        let mut output = vec![0f32; 3000];
        allreduce(&comm, &mut input, &mut output, Some("ring")).map_err(|e| e.to_string())
    });
    assert!(out.iter().all(|r| r.is_err()), "{out:?}");
    let shown = format!("{out:?}");
    assert!(shown.contains("ring (order 0>2>1)") && shown.contains("elements, ring)"), "{shown}");
}

#[test]
fn ranks_that_would_measure_differently_are_refused_at_once_naming_the_setting() {
    let out = refusals(2, Duration::from_secs(30), |cfg| {
        cfg.measure = if cfg.rank == 0 { Measure::Always } else { Measure::Never };
    });
    for (e, took) in out {
        assert!(e.contains("PLAIT_MEASURE") && e.contains("set it the same on every rank"), "{e}");
        assert!(took < Duration::from_secs(10), "refused after {took:?}, not at the deadline");
    }
}

#[test]
fn ranks_with_different_cost_models_or_relay_settings_are_refused_at_once_naming_the_setting() {
    let out = refusals(2, Duration::from_secs(30), |cfg| {
        if cfg.rank == 1 {
            cfg.cost = plait_core::CostConstants::parse("alpha=2e-5").unwrap();
        }
    });
    for (e, took) in out {
        assert!(e.contains("PLAIT_COST_MODEL") && e.contains("unset") && e.contains("alpha=2e-5") && e.contains("set it the same on every rank"), "{e}");
        assert!(took < Duration::from_secs(10), "refused after {took:?}, not at the deadline");
    }
    let out = refusals(2, Duration::from_secs(30), |cfg| cfg.relay = cfg.rank == 0);
    for (e, _) in out {
        assert!(e.contains("PLAIT_RELAY=") && e.contains("set it the same on every rank"), "{e}");
    }
}

/// A custom allgather (every rank sends straight to every other, written in reverse order) as
/// a schedule file for `n` ranks.
fn custom_allgather(n: usize, name: &str) -> Arc<plait_core::CustomSchedule> {
    let text = plait_core::builtin_schedule_file(Collective::AllGather, "direct", n, 0, Some(name)).unwrap();
    Arc::new(plait_core::parse_schedule_file(&text, &format!("{name}.json")).unwrap())
}

fn allgather(comm: &Arc<Communicator>, input: &mut [f32], output: &mut [f32], algo: Option<&str>) -> Result<(), PlaitError> {
    collective(comm, Collective::AllGather, input, output, algo)
}

#[test]
fn a_custom_schedule_runs_when_named_and_says_where_it_does_not_fit() {
    let out = world_with(3, 0, |cfg| {
        cfg.schedules = vec![custom_allgather(3, "mine"), custom_allgather(4, "four")];
        cfg.algo = Some("allgather:mine".into());
    }, |comm| {
        let r = comm.rank();
        let mut input: Vec<f32> = (0..1001).map(|e| (r * 10000 + e) as f32).collect();
        let mut output = vec![0f32; 3003];
        allgather(&comm, &mut input, &mut output, None).unwrap();
        let want: Vec<f32> = (0..3).flat_map(|q| (0..1001).map(move |e| (q * 10000 + e) as f32)).collect();
        assert_eq!(output, want);
        let chosen = comm.algorithm_for(Collective::AllGather, 3003 * 4, 0).unwrap();
        let wrong_size = allgather(&comm, &mut input, &mut output, Some("four")).unwrap_err().to_string();
        (chosen, wrong_size)
    });
    for (chosen, wrong_size) in out {
        assert_eq!(chosen, "mine");
        assert!(wrong_size.contains("custom allgather schedule 'four' is for 4 ranks (four.json), not 3 ranks"), "{wrong_size}");
    }
    // PLAIT_ALGO naming a schedule nobody registered lists the ones there are.
    let errs = refusals(1, Duration::from_secs(5), |cfg| {
        cfg.schedules = vec![custom_allgather(1, "solo")];
        cfg.algo = Some("allgather:nope".into());
    });
    assert!(errs[0].0.contains("'nope'") && errs[0].0.contains("custom: solo"), "{errs:?}");
}

#[test]
fn ranks_holding_different_custom_schedules_are_refused_at_once_naming_them() {
    let out = refusals(2, Duration::from_secs(30), |cfg| {
        if cfg.rank == 1 {
            cfg.schedules = vec![custom_allgather(2, "mine")];
        }
    });
    for (e, took) in out {
        assert!(e.contains("PLAIT_SCHEDULES") && e.contains("allgather mine n=2") && e.contains("[none]"), "{e}");
        assert!(took < Duration::from_secs(10), "refused after {took:?}, not at the deadline");
    }
}

#[test]
fn a_ring_order_that_is_not_one_of_the_worlds_ranks_is_refused_when_the_size_is_known() {
    let mut cfg = CommConfig::from_env(0, 3).unwrap();
    cfg.ring_order = RingOrder::Given(vec![0, 2, 1, 3]);
    let e = Communicator::new(&MemStore::new(), cfg).err().expect("refused").to_string();
    assert!(e.contains("PLAIT_RING_ORDER") && e.contains("the 3 ranks"), "{e}");
}

/// A mesh grown by a rank (elastic mode, at an update point) keeps the figures of the links it
/// keeps and measures only the new rank's: the kept link's rate is the one measured before, to
/// the bit, and every link to the new rank has one.
#[test]
fn a_grown_mesh_measures_only_the_links_to_new_ranks() {
    let store = Arc::new(MemStore::new());
    let cfg = |rank: usize, size: usize, epoch: u64| {
        let mut cfg = CommConfig::from_env(rank, size).unwrap();
        cfg.timeout = Duration::from_secs(30);
        cfg.measure = Measure::Always;
        cfg.group = "grown-measure".into();
        cfg.epoch = epoch;
        cfg
    };
    let handles: Vec<_> = (0..3)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                let (before, comm) = if r < 2 {
                    let first = Communicator::new(&*store, cfg(r, 2, 0)).unwrap();
                    let before = first.link_matrix().expect("measured").clone();
                    (Some(before), first.grow(&*store, cfg(r, 3, 1)).unwrap())
                } else {
                    (None, Communicator::new(&*store, cfg(2, 3, 1)).unwrap())
                };
                let after = comm.link_matrix().expect("measured").clone();
                comm.close();
                (before, after)
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let before = out[0].0.as_ref().unwrap();
    for (r, (_, after)) in out.iter().enumerate() {
        assert_eq!(after, &out[0].1, "rank {r} holds the same matrix");
        assert_eq!((after.bandwidth(0, 1), after.bandwidth(1, 0)), (before.bandwidth(0, 1), before.bandwidth(1, 0)), "the kept link was not measured again");
        for (i, j) in [(0, 2), (2, 0), (1, 2), (2, 1)] {
            assert!(after.bandwidth(i, j) > 1e6, "{i}->{j} measured: {after:?}");
        }
    }
}

/// The hierarchical allreduce of examples/schedules combines the two hosts' partial sums on two
/// ranks at once; both must take them in one order, or min and max part on +0 against -0.
#[test]
fn the_hierarchical_example_ends_every_rank_with_the_same_bits_for_every_op() {
    let text = include_str!("../../../examples/schedules/hier_allreduce.json");
    let hier = Arc::new(plait_core::parse_schedule_file(text, "hier_allreduce.json").unwrap());
    let out = world_with(4, 0, move |cfg| {
        cfg.schedules = vec![hier.clone()];
        cfg.algo = Some("allreduce:hier_allreduce".into());
    }, |comm| {
        let r = comm.rank();
        let mut got = Vec::new();
        for op in [ReduceOp::Min, ReduceOp::Max, ReduceOp::Sum] {
            // The first host holds +0 and the second -0 everywhere but in a few odd blocks of
            // numbers, so every block's two partials meet as zeros of both signs.
            let mut input: Vec<f32> = (0..4099).map(|i| if i % 7 == 3 { (i + r) as f32 } else if r < 2 { 0.0 } else { -0.0 }).collect();
            let mut output = vec![1.0f32; input.len()];
            let req = CollRequest { output: f32_buf(&mut output), ..CollRequest::allreduce(f32_buf(&mut input), DType::F32, op) };
            unsafe { comm.collective(req, true) }.unwrap().wait(None).unwrap().unwrap();
            got.push(output.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
        }
        (comm.algorithm_for(Collective::AllReduce, 4099 * 4, 0).unwrap(), got)
    });
    for (r, (algo, got)) in out.iter().enumerate() {
        assert_eq!(algo, "hier_allreduce");
        for (op, bits) in got.iter().enumerate() {
            assert!(bits == &out[0].1[op], "rank {r} ends op #{op} with other bits than rank 0");
        }
    }
}

// -- ranks of one host: payloads over 64 KiB through shared memory (PLAIT_SHM_BYTES) --

const HAS_SHM: bool = cfg!(any(target_os = "linux", target_vendor = "apple"));

/// A ring smaller than the traffic, so payloads wrap around its end and senders wait for room:
/// every algorithm's result is exact, as it is with the same calls over TCP (`shm_bytes` 0), and
/// each link says which way it went.
#[test]
fn payloads_through_shared_memory_land_exactly_as_over_tcp() {
    for shm in [300_000usize, 0] {
        let n = 3;
        let results = world_with(
            n,
            0,
            move |cfg| {
                cfg.segment_bytes = 100_000;
                cfg.shm_bytes = shm;
            },
            move |comm| {
                let lanes: Vec<usize> = comm.routes().iter().map(|l| l.shm_lanes).collect();
                let r = comm.rank();
                let mut errs = Vec::new();
                for &algo in algorithms(Collective::AllReduce) {
                    // Frames under 64 KiB (TCP), between it and the ring, and over the ring (TCP).
                    for count in [70_001usize, 250_000, 1_000_003] {
                        let mut input: Vec<f32> = (0..count).map(|i| (i % 977) as f32 + r as f32).collect();
                        let mut output = vec![-1.0f32; count];
                        allreduce(&comm, &mut input, &mut output, Some(algo)).unwrap();
                        if let Some(i) = (0..count).find(|&i| output[i] != (0..n).map(|q| (i % 977) as f32 + q as f32).sum::<f32>()) {
                            errs.push(format!("shm={shm} {algo} count={count}: [{i}] = {}", output[i]));
                        }
                    }
                }
                // Point to point: a message that fits the ring, and one sent as pieces too large for it.
                for len in [200_000usize, 9 << 20] {
                    let buf = |v: &mut Vec<u8>| RawBuf { ptr: v.as_mut_ptr(), len: v.len() };
                    let (to, from) = ((r + 1) % n, (r + n - 1) % n);
                    let mut out: Vec<u8> = (0..len).map(|i| (i * 7 + r) as u8).collect();
                    let mut got = vec![0u8; len];
                    let s = unsafe { comm.send(buf(&mut out), DType::U8, to, 5, None, false) }.unwrap();
                    unsafe { comm.recv(buf(&mut got), DType::U8, Some(from), 5, None, true) }.unwrap().wait(None).unwrap().unwrap();
                    s.wait(None).unwrap().unwrap();
                    if (0..len).any(|i| got[i] != (i * 7 + from) as u8) {
                        errs.push(format!("shm={shm} p2p of {len} bytes from {from}: wrong contents"));
                    }
                }
                (lanes, errs)
            },
        );
        for (r, (lanes, errs)) in results.iter().enumerate() {
            // Elsewhere than Linux and macOS plait has no shared memory: the links stay on TCP.
            assert_eq!(lanes, &vec![usize::from(shm > 0 && HAS_SHM); n - 1], "rank {r}'s links with shm_bytes={shm}");
            assert!(errs.is_empty(), "{errs:?}");
        }
    }
}

/// A sender waiting for room in a full ring (its peer parks what it cannot hold and reads no
/// more) does not hang when that peer aborts: its sends fail, naming the peer, long before the
/// timeout.
#[test]
fn a_sender_waiting_for_room_in_shared_memory_fails_naming_the_rank_that_aborted() {
    let results = world_with(
        2,
        0,
        |cfg| {
            cfg.unexpected_bytes = MIB as u64;
            cfg.shm_bytes = 300_000;
            cfg.timeout = Duration::from_secs(30);
        },
        |comm| {
            let buf = |v: &mut Vec<u8>| RawBuf { ptr: v.as_mut_ptr(), len: v.len() };
            if comm.rank() == 0 {
                assert_eq!(comm.routes()[0].shm_lanes, usize::from(HAS_SHM));
                let t = Instant::now();
                let mut msgs: Vec<Vec<u8>> = (0..20).map(|k| vec![k as u8; 200_000]).collect();
                let works: Vec<_> = msgs.iter_mut().map(|m| unsafe { comm.send(buf(m), DType::U8, 1, 3, None, false) }.unwrap()).collect();
                let errors: Vec<String> = works.into_iter().filter_map(|w| w.wait(Some(Duration::from_secs(25))).expect("a send hung").err()).map(|e| e.to_string()).collect();
                return (errors, t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(800));
            comm.abort("rank 1 gives up");
            (Vec::new(), Duration::ZERO)
        },
    );
    let (errors, took) = &results[0];
    assert!(!errors.is_empty(), "20 sends of 200 KB to a rank holding 1 MiB all completed");
    assert!(errors.iter().all(|e| e.contains("rank 1")), "{errors:?}");
    assert!(*took < Duration::from_secs(10), "the sends ended after {took:?}");
}

/// CPU time this thread has used (Linux and macOS).
#[cfg(unix)]
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill, and a clock every Unix this project builds for has.
    assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) }, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Rank 0's CPU time in a 3-float sum that rank 1 joins 2 s late, with a 90 ms busy-poll
/// budget: made blocking, or (`asynchronous`) started asynchronously and waited for. Checks the
/// sum and that rank 0 did wait; returns (CPU time, time waited).
#[cfg(unix)]
fn cpu_behind_a_late_peer(asynchronous: bool) -> (Duration, Duration) {
    const LATE: Duration = Duration::from_secs(2);
    let results = world_with(
        2,
        0,
        |cfg| cfg.busy_poll = Duration::from_millis(90),
        move |comm| {
            let (mut x, mut y) = ([1.0f32; 3], [0.0f32; 3]);
            allreduce(&comm, &mut x, &mut y, None).unwrap();
            if comm.rank() == 1 {
                std::thread::sleep(LATE);
            }
            let (cpu, t) = (thread_cpu_time(), Instant::now());
            if asynchronous {
                let req = CollRequest { output: f32_buf(&mut y), ..CollRequest::allreduce(f32_buf(&mut x), DType::F32, ReduceOp::Sum) };
                unsafe { comm.collective(req, false) }.unwrap().wait(None).unwrap().unwrap();
            } else {
                allreduce(&comm, &mut x, &mut y, None).unwrap();
            }
            (thread_cpu_time() - cpu, t.elapsed(), y)
        },
    );
    let (cpu, waited, y) = results[0];
    assert_eq!(y, [2.0; 3]);
    assert!(waited >= LATE / 2, "rank 0 waited only {waited:?} for a peer {LATE:?} late");
    (cpu, waited)
}

/// A small blocking call polls its links for its busy-poll budget, then sleeps: a rank that
/// reaches the call long before a late peer does not spend its core on the whole wait. The
/// budget counts once per call, not once per wait inside it: the call waits in windows of at
/// most 100 ms, so a budget of 90 ms restarted in each would keep polling for most of the two
/// seconds (at least half of that as CPU time even sharing its core with one busy thread).
#[cfg(unix)]
#[test]
fn a_rank_waiting_for_a_late_peer_polls_for_its_budget_then_sleeps() {
    let (cpu, waited) = cpu_behind_a_late_peer(false);
    assert!(cpu < Duration::from_millis(500), "rank 0 used {cpu:?} of CPU waiting {waited:?} with a 90 ms busy-poll budget");
}

/// Waiting for an asynchronous call behind a late peer sleeps once the busy-poll budget is
/// spent: the rank does not spend its core on the whole wait.
#[cfg(unix)]
#[test]
fn waiting_for_an_asynchronous_call_behind_a_late_peer_sleeps_after_its_budget() {
    let (cpu, waited) = cpu_behind_a_late_peer(true);
    assert!(cpu < Duration::from_millis(500), "rank 0 used {cpu:?} of CPU waiting {waited:?} on the Work with a 90 ms busy-poll budget");
}

/// Who reads the links changes hands while calls wait, and every call ends right on every rank.
/// Each round: a small asynchronous allreduce of a subgroup (alone in flight: its worker reads
/// the links), a large asynchronous one of the whole group on the same links (the receiver
/// threads take over), a small blocking one (the calling thread reads, with both in flight),
/// and an asynchronous send and receive (the receiver threads again).
#[test]
fn small_and_large_calls_in_flight_together_all_end_right_whoever_reads_the_links() {
    let n = 3;
    let results = world(n, 0, move |comm| {
        let r = comm.rank();
        let sub = comm.subgroup("all", &[2, 0, 1], None, None).unwrap();
        let mut errors = Vec::new();
        for round in 0..20 {
            let (mut sx, mut sy) = (vec![r as f32 + 1.0; 5], vec![0.0f32; 5]);
            let (mut bx, mut by) = (vec![round as f32; 100_000], vec![0.0f32; 100_000]);
            let (mut cx, mut cy) = ([2.0f32; 7], [0.0f32; 7]);
            let (mut msg, mut got) = (vec![(r * 100 + round) as f32; 9], vec![0.0f32; 9]);
            let small = CollRequest { output: f32_buf(&mut sy), ..CollRequest::allreduce(f32_buf(&mut sx), DType::F32, ReduceOp::Sum) };
            let big = CollRequest { output: f32_buf(&mut by), ..CollRequest::allreduce(f32_buf(&mut bx), DType::F32, ReduceOp::Sum) };
            let (to, from) = ((r + 1) % n, (r + n - 1) % n);
            let mut works = unsafe { vec![sub.collective(small, false).unwrap(), comm.collective(big, false).unwrap()] };
            if let Err(e) = allreduce(&comm, &mut cx, &mut cy, None) {
                errors.push(format!("round {round}: blocking allreduce: {e}"));
            }
            works.extend(unsafe {
                [
                    comm.send(f32_buf(&mut msg), DType::F32, to, 7, None, false).unwrap(),
                    comm.recv(f32_buf(&mut got), DType::F32, Some(from), 7, None, false).unwrap(),
                ]
            });
            for (i, w) in works.iter().enumerate() {
                if let Some(Err(e)) = w.wait(None) {
                    errors.push(format!("round {round}: call {i}: {e}"));
                }
            }
            let want_small = (n * (n + 1) / 2) as f32;
            if sy != vec![want_small; 5] || by != vec![(round * n) as f32; 100_000] || cy != [2.0 * n as f32; 7] {
                errors.push(format!("round {round}: wrong sums {} {} {}", sy[0], by[0], cy[0]));
            }
            if got != vec![(from * 100 + round) as f32; 9] {
                errors.push(format!("round {round}: received {:?} from rank {from}", &got[..1]));
            }
        }
        sub.close();
        errors
    });
    for (r, errors) in results.iter().enumerate() {
        assert!(errors.is_empty(), "rank {r}: {errors:?}");
    }
}
