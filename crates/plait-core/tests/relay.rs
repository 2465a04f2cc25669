//! Ranks that cannot connect to each other reach each other through a rank that reaches both
//! (`PLAIT_RELAY`), ranks as threads of one process over loopback. The route file's `"relay"`
//! entries cut the pairs, as a firewall or a missing cable would.
//!
//! Every `unsafe` call here passes buffers that live on the calling test's stack or heap until
//! it has waited for the call's Work: the contract of `plait_core::RawBuf`.

use plait_core::{algorithms, CollRequest, Collective, CommConfig, Communicator, DType, Measure, MemStore, PlaitError, RawBuf, ReduceOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A route file for `n` ranks on loopback with the pairs `cut` relayed.
fn route_file(name: &str, n: usize, cut: &[(usize, usize)]) -> String {
    let m: Vec<Vec<Option<&str>>> = (0..n)
        .map(|i| {
            (0..n)
                .map(|j| match (i == j, cut.contains(&(i.min(j), i.max(j)))) {
                    (true, _) => None,
                    (_, true) => Some("relay"),
                    _ => Some("127.0.0.1"),
                })
                .collect()
        })
        .collect();
    let path = std::env::temp_dir().join(format!("plait-relay-{name}-{}.json", std::process::id()));
    std::fs::write(&path, serde_json::to_string(&m).unwrap()).unwrap();
    path.to_string_lossy().into_owned()
}

fn world<T: Send + 'static>(
    n: usize,
    routes: String,
    tweak: impl Fn(&mut CommConfig) + Send + Sync + 'static,
    f: impl Fn(Result<Arc<Communicator>, PlaitError>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store = Arc::new(MemStore::new());
    let (f, tweak) = (Arc::new(f), Arc::new(tweak));
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (store, f, tweak, routes) = (store.clone(), f.clone(), tweak.clone(), routes.clone());
            std::thread::spawn(move || {
                let mut cfg = CommConfig::from_env(r, n).unwrap();
                cfg.timeout = Duration::from_secs(20);
                cfg.segment_bytes = 4096;
                cfg.routes_file = Some(routes);
                tweak(&mut cfg);
                let comm = Communicator::new(&*store, cfg);
                let out = f(comm.clone());
                if let Ok(c) = comm {
                    c.close();
                }
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn buf<T>(v: &mut [T]) -> RawBuf {
    RawBuf { ptr: v.as_mut_ptr() as *mut u8, len: std::mem::size_of_val(v) }
}

fn collective(comm: &Arc<Communicator>, coll: Collective, input: &mut [f32], output: &mut [f32], algo: &str) -> Result<(), PlaitError> {
    let req = CollRequest {
        coll,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: 0,
        input: buf(input),
        output: buf(output),
        send_counts: None,
        recv_counts: None,
        timeout: None,
        algo: Some(algo.into()),
        wire: None,
    };
    unsafe { comm.collective(req, true) }?.wait(None).unwrap().map(|_| ())
}

/// A message of `len` bytes from `from` to `to` (any-source receive when `any`); what `to` got.
fn message(comm: &Arc<Communicator>, from: usize, to: usize, len: usize, tag: u64, any: bool) -> Result<bool, PlaitError> {
    let mut msg: Vec<u8> = (0..len).map(|i| (i * 31 + len + from) as u8).collect();
    if comm.rank() == from {
        unsafe { comm.send(buf(&mut msg), DType::U8, to, tag, None, true) }?.wait(None).unwrap()?;
        Ok(true)
    } else if comm.rank() == to {
        let mut got = vec![0u8; len];
        let src = if any { None } else { Some(from) };
        unsafe { comm.recv(buf(&mut got), DType::U8, src, tag, None, true) }?.wait(None).unwrap()?;
        Ok(got == msg)
    } else {
        Ok(true)
    }
}

/// A square of four ranks without its diagonals (0-2 and 1-3 cut), the links measured: each cut
/// pair goes through a rank of the square, every rank agrees which, the matrix holds the detour,
/// and every collective and algorithm, and messages both small and in pieces (any source too),
/// arrive whole over the relayed links.
#[test]
fn a_square_without_diagonals_relays_them_and_every_operation_is_right() {
    let n = 4;
    let routes = route_file("square", n, &[(0, 2), (1, 3)]);
    let out = world(n, routes.clone(), |cfg| cfg.measure = Measure::Always, move |comm| {
        let comm = comm.unwrap();
        let r = comm.rank();
        let vias: Vec<(usize, Option<usize>)> = comm.routes().iter().map(|l| (l.peer, l.via)).collect();
        let mut errs = Vec::new();
        for coll in [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::Broadcast, Collective::AllToAll] {
            for &algo in algorithms(coll) {
                let count = 4 * 1031;
                let mut input: Vec<f32> = (0..count).map(|i| ((i % 17) * (r + 1)) as f32).collect();
                let out_len = match coll {
                    Collective::AllGather => count * n,
                    Collective::ReduceScatter => count / n,
                    _ => count,
                };
                let mut output = vec![-1f32; out_len];
                if let Err(e) = collective(&comm, coll, &mut input, &mut output, algo) {
                    errs.push(format!("{coll} {algo}: {e}"));
                    continue;
                }
                let value = |q: usize, i: usize| ((i % 17) * (q + 1)) as f32;
                let want: Vec<f32> = match coll {
                    Collective::AllReduce => (0..count).map(|i| (0..n).map(|q| value(q, i)).sum()).collect(),
                    Collective::AllGather => (0..count * n).map(|k| value(k / count, k % count)).collect(),
                    Collective::ReduceScatter => (0..count / n).map(|i| (0..n).map(|q| value(q, r * count / n + i)).sum()).collect(),
                    Collective::Broadcast => (0..count).map(|i| value(0, i)).collect(),
                    _ => (0..count).map(|k| value(k / (count / n), r * count / n + k % (count / n))).collect(),
                };
                if output != want {
                    errs.push(format!("{coll} {algo}: wrong result on rank {r}"));
                }
            }
        }
        for (from, to, len, any) in [(0, 2, 100, false), (2, 0, 70_001, true), (1, 3, 9 << 20, false), (3, 1, (17 << 20) + 3, true)] {
            match message(&comm, from, to, len, 5, any) {
                Ok(true) => {}
                Ok(false) => errs.push(format!("{len} bytes {from} -> {to}: wrong contents")),
                Err(e) => errs.push(format!("{len} bytes {from} -> {to}: {e}")),
            }
        }
        (vias, comm.link_matrix().cloned(), errs)
    });
    let _ = std::fs::remove_file(routes);
    for (r, (vias, _, errs)) in out.iter().enumerate() {
        assert!(errs.is_empty(), "rank {r}: {errs:?}");
        let relayed: Vec<&(usize, Option<usize>)> = vias.iter().filter(|v| v.1.is_some()).collect();
        assert_eq!(relayed.len(), 1, "rank {r}: one relayed peer, {vias:?}");
        let (peer, via) = (relayed[0].0, relayed[0].1.unwrap());
        assert_eq!(peer, (r + 2) % n, "rank {r}: the diagonal is relayed");
        assert!(via == (r + 1) % n || via == (r + 3) % n, "rank {r}: through a neighbour, not {via}");
        let theirs = out[peer].0.iter().find(|v| v.0 == r).unwrap().1;
        assert_eq!(theirs, Some(via), "rank {r} and rank {peer} agree on the relay");
    }
    let m = out[0].1.as_ref().expect("the links were measured");
    assert!(out.iter().all(|o| o.1.as_ref() == Some(m)), "every rank has the same matrix");
    let via = out[0].0.iter().find(|v| v.0 == 2).unwrap().1.unwrap();
    assert!(m.latency(0, 2) >= m.latency(0, via), "the relayed link is the detour: {m:?}");
}

/// With sealed frames the relay passes the frames on as sealed on each hop.
#[test]
fn a_relayed_link_carries_encrypted_frames() {
    let routes = route_file("sealed", 3, &[(0, 2)]);
    let out = world(3, routes.clone(), |cfg| cfg.encrypt = true, |comm| {
        let comm = comm.unwrap();
        let r = comm.rank();
        let mut input: Vec<f32> = (0..100_003).map(|i| (i % 7 + r) as f32).collect();
        let mut output = vec![0f32; input.len()];
        collective(&comm, Collective::AllReduce, &mut input, &mut output, "direct").unwrap();
        let ok = output.iter().enumerate().all(|(i, v)| *v == (3 * (i % 7) + 3) as f32);
        (ok, message(&comm, 2, 0, 300_001, 1, false).unwrap())
    });
    let _ = std::fs::remove_file(routes);
    assert!(out.iter().all(|&(a, b)| a && b), "{out:?}");
}

/// With `PLAIT_RELAY=0` a cut pair fails start-up on both of its ranks at once, naming the pair
/// and the setting (the rank it does not involve fails on the aborts, or waits: it is not asked).
#[test]
fn without_relays_a_cut_pair_fails_start_up_naming_it() {
    let routes = route_file("off", 3, &[(0, 2)]);
    let t0 = Instant::now();
    let out = world(3, routes.clone(), |cfg| {
        cfg.relay = false;
        cfg.timeout = Duration::from_secs(10);
    }, move |comm| (comm.err().map(|e| e.to_string()), t0.elapsed()));
    let _ = std::fs::remove_file(routes);
    for r in [0, 2] {
        let err = out[r].0.as_deref().unwrap_or_else(|| panic!("rank {r} started: {out:?}"));
        assert!(err.contains("PLAIT_RELAY=0") && (err.contains("ranks 0 and 2") || err.contains("could not connect to rank 0")), "rank {r}: {err}");
        assert!(out[r].1 < Duration::from_secs(5), "rank {r} failed at once, not at the deadline: {:?}", out[r].1);
    }
}

/// A pair that no rank connects to both (0-1 and 2-3 only) fails on every rank, naming it.
#[test]
fn a_pair_nobody_can_relay_fails_start_up_on_every_rank() {
    let routes = route_file("islands", 4, &[(0, 2), (0, 3), (1, 2), (1, 3)]);
    let out = world(4, routes.clone(), |cfg| cfg.timeout = Duration::from_secs(10), |comm| comm.err().map(|e| e.to_string()));
    let _ = std::fs::remove_file(routes);
    for (r, err) in out.iter().enumerate() {
        let err = err.as_deref().unwrap_or_else(|| panic!("rank {r} started"));
        assert!(err.contains("no other rank connects to both"), "rank {r}: {err}");
    }
}


/// A relay that has nothing to do of its own (it is computing, or sleeping here) after a small
/// blocking call, which hands reading to waiting callers, still passes frames on as they come:
/// 30 round trips between the ends take far less than the 30 heartbeat periods (1 s each) a relay
/// that read only on its heartbeats would hold them.
#[test]
fn an_idle_relay_passes_frames_on_at_once() {
    let routes = route_file("idle", 3, &[(0, 2)]);
    let out = world(3, routes.clone(), |cfg| cfg.timeout = Duration::from_secs(60), |comm| {
        let comm = comm.unwrap();
        let mut x = vec![1f32; 4];
        let mut y = vec![0f32; 4];
        collective(&comm, Collective::AllReduce, &mut x, &mut y, "ring").unwrap();
        let t0 = Instant::now();
        match comm.rank() {
            1 => std::thread::sleep(Duration::from_secs(8)),
            r => {
                for i in 0..30 {
                    let (from, to) = if i % 2 == 0 { (0, 2) } else { (2, 0) };
                    assert!(message(&comm, from, to, 16, 9, false).unwrap(), "rank {r}: round {i}");
                }
            }
        }
        t0.elapsed()
    });
    let _ = std::fs::remove_file(routes);
    for r in [0, 2] {
        assert!(out[r] < Duration::from_secs(5), "rank {r}: 30 relayed messages took {:?}", out[r]);
    }
}

/// A relay that closes before the pair it relays (its own close waited its timeout for them)
/// cuts them off: a receive waiting across it fails at once, naming the relay, not at its own
/// deadline blaming the other end.
#[test]
fn a_relay_closing_first_fails_what_waits_across_it_naming_it() {
    let routes = route_file("leaves", 3, &[(0, 2)]);
    let out = world(3, routes.clone(), |cfg| cfg.timeout = Duration::from_secs(if cfg.rank == 1 { 2 } else { 30 }), |comm| {
        let comm = comm.unwrap();
        let t0 = Instant::now();
        let result = match comm.rank() {
            0 => {
                let mut got = vec![0u8; 8];
                unsafe { comm.recv(buf(&mut got), DType::U8, Some(2), 4, None, true) }.and_then(|w| w.wait(None).unwrap()).err().map(|e| e.to_string())
            }
            2 => {
                std::thread::sleep(Duration::from_secs(6));
                None
            }
            _ => None, // closes at once, and waits its 2 s for the pair
        };
        (result, t0.elapsed())
    });
    let _ = std::fs::remove_file(routes);
    let (err, waited) = &out[0];
    let err = err.as_deref().expect("the receive failed");
    assert!(err.contains("through rank 1") && err.contains("closed"), "{err}");
    assert!(*waited < Duration::from_secs(6), "failed when the relay left, not at its deadline: {waited:?}");
}
