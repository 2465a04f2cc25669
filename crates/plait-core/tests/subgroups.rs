//! Subgroups on their owner's links, end to end: ranks as threads of one process over loopback.
//!
//! Every `unsafe` call here passes buffers that live on the calling test's stack or heap until
//! it has waited for the call's Work: the contract of `plait_core::RawBuf`.

use plait_core::{CollRequest, Collective, CommConfig, Communicator, DType, MemStore, PlaitError, RawBuf, ReduceOp, ThreadUse};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

fn world<T: Send + 'static>(n: usize, f: impl Fn(Arc<Communicator>, &Barrier) -> T + Send + Sync + 'static) -> Vec<T> {
    let store = Arc::new(MemStore::new());
    let f = Arc::new(f);
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (store, f, barrier) = (store.clone(), f.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut cfg = CommConfig::from_env(r, n).unwrap();
                cfg.timeout = Duration::from_secs(20);
                cfg.segment_bytes = 4096;
                // The tests drive the world and its subgroups from threads other than the one
                // that created them, each communicator from one thread at a time.
                cfg.threads = ThreadUse::Sequential;
                let comm = Communicator::new(&*store, cfg).unwrap();
                let out = f(comm.clone(), &barrier);
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

/// Sums `v` over `comm` in place; `inline` runs it on this thread.
fn allreduce(comm: &Arc<Communicator>, v: &mut [f32], timeout: Option<Duration>, inline: bool) -> Result<(), PlaitError> {
    let b = f32_buf(v);
    let req = CollRequest {
        coll: Collective::AllReduce,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: 0,
        input: b,
        output: b,
        send_counts: None,
        recv_counts: None,
        timeout,
        algo: None,
        wire: None,
    };
    unsafe { comm.collective(req, inline) }?.wait(None).unwrap().map(|_| ())
}

#[test]
fn subgroups_and_their_owner_run_at_once_on_shared_links() {
    let results = world(4, |comm, _| {
        let r = comm.rank();
        // Pairs {0,2} and {1,3}, and {3,1,0} whose order gives the new ranks.
        let pair = comm.subgroup(&format!("pair{}", r % 2), &[r % 2, r % 2 + 2], None, None).unwrap();
        let trio = if r == 2 { None } else { Some(comm.subgroup("trio", &[3, 1, 0], None, None).unwrap()) };
        assert_eq!((pair.rank(), pair.size()), (r / 2, 2));
        if let Some(t) = &trio {
            assert_eq!((t.rank(), t.size()), ([2, 1, usize::MAX, 0][r], 3));
        }
        // Large enough for many segments, so frames of the three groups interleave on each link.
        let n = 50_000;
        let (c1, c2, t) = (comm.clone(), pair.clone(), trio.clone());
        let world_sum = std::thread::spawn(move || {
            let mut v = vec![r as f32; n];
            allreduce(&c1, &mut v, None, false).map(|_| v[n - 1])
        });
        let pair_sum = std::thread::spawn(move || {
            let mut v = vec![r as f32 + 1.0; n];
            allreduce(&c2, &mut v, None, false).map(|_| v[0])
        });
        let trio_sum = t.map(|t| {
            let mut v = vec![10.0 * r as f32; 3];
            allreduce(&t, &mut v, None, true).map(|_| v[2])
        });
        (world_sum.join().unwrap().unwrap(), pair_sum.join().unwrap().unwrap(), trio_sum.map(|s| s.unwrap()))
    });
    for (r, (w, p, t)) in results.into_iter().enumerate() {
        assert_eq!(w, 6.0, "rank {r}: world");
        assert_eq!(p, if r % 2 == 0 { 1.0 + 3.0 } else { 2.0 + 4.0 }, "rank {r}: pair");
        assert_eq!(t, if r == 2 { None } else { Some(40.0) }, "rank {r}: trio");
    }
}

#[test]
fn a_member_that_sends_before_the_others_created_the_group_is_not_lost() {
    let results = world(3, |comm, _| {
        if comm.rank() == 1 {
            // Frames of the group reach this rank before it exists here.
            std::thread::sleep(Duration::from_millis(300));
        }
        let g = comm.subgroup("late", &[0, 1, 2], None, None).unwrap();
        let mut v = vec![1.0f32; 10_000];
        allreduce(&g, &mut v, None, false).unwrap();
        let mut msg = [0u8; 5];
        let b = RawBuf { ptr: msg.as_mut_ptr(), len: 5 };
        match g.rank() {
            0 => {
                msg.copy_from_slice(b"hello");
                unsafe { g.send(b, DType::U8, 2, 4, None, false) }.unwrap().wait(None).unwrap().unwrap();
            }
            2 => {
                unsafe { g.recv(b, DType::U8, Some(0), 4, None, false) }.unwrap().wait(None).unwrap().unwrap();
            }
            _ => {}
        }
        (v[9_999], msg)
    });
    assert_eq!(results[0].0, 3.0);
    assert_eq!(results[2], (3.0, *b"hello"));
}

#[test]
fn a_subgroup_that_times_out_leaves_its_owner_and_the_other_groups_working() {
    let results = world(3, |comm, barrier| {
        let r = comm.rank();
        let g = comm.subgroup("flaky", &[0, 1, 2], None, None).unwrap();
        let other = comm.subgroup("other", &[0, 1, 2], None, None).unwrap();
        let mut v = vec![1.0f32; 4];
        let started = Instant::now();
        // Rank 2 never joins this call: ranks 0 and 1 time out, naming it.
        let failed = if r == 2 { None } else { Some((allreduce(&g, &mut v, Some(Duration::from_millis(500)), false), started.elapsed())) };
        barrier.wait();
        let mut w = vec![1.0f32; 4];
        allreduce(&comm, &mut w, None, true).unwrap();
        let mut o = vec![2.0f32; 4];
        allreduce(&other, &mut o, None, true).unwrap();
        // The failed group stays failed, with a clear error, on every rank (rank 2 heard why).
        let mut again = vec![1.0f32; 4];
        let later = allreduce(&g, &mut again, Some(Duration::from_secs(2)), false);
        (failed, w[0], o[0], later)
    });
    for (r, (failed, w, o, later)) in results.into_iter().enumerate() {
        assert_eq!((w, o), (3.0, 6.0), "rank {r}: owner and the other group still work");
        if let Some((err, took)) = failed {
            let msg = err.unwrap_err().to_string();
            assert!(msg.contains("rank 2"), "rank {r}: {msg}");
            assert!(took < Duration::from_secs(5), "rank {r} took {took:?}");
        }
        assert!(later.is_err(), "rank {r}: the failed group must refuse new calls");
    }
}

#[test]
fn the_owner_failing_fails_its_subgroups_and_a_closed_group_is_refused() {
    let results = world(2, |comm, barrier| {
        let g = comm.subgroup("child", &[0, 1], None, None).unwrap();
        let mut v = vec![1.0f32; 4];
        allreduce(&g, &mut v, None, true).unwrap();
        g.close();
        let reuse = comm.subgroup("child", &[0, 1], None, None).map(|_| ()).unwrap_err().to_string();
        let g2 = comm.subgroup("child2", &[0, 1], None, None).unwrap();
        barrier.wait();
        if comm.rank() == 0 {
            comm.abort("stopped by the test");
        }
        let mut w = vec![1.0f32; 4];
        let started = Instant::now();
        let err = allreduce(&g2, &mut w, None, false).unwrap_err().to_string();
        (reuse, err, started.elapsed(), w)
    });
    for (r, (reuse, err, took, w)) in results.into_iter().enumerate() {
        assert!(reuse.contains("new name"), "rank {r}: {reuse}");
        assert!(err.contains("stopped by the test"), "rank {r}: {err}");
        assert!(took < Duration::from_secs(5), "rank {r} took {took:?}");
        assert_eq!(w, vec![1.0; 4], "rank {r}: the buffer is left as it was");
    }
}

#[test]
fn subgroup_arguments_are_checked() {
    world(2, |comm, _| {
        let r = comm.rank();
        let other = 1 - r;
        for (ranks, want) in [(vec![other], "not in"), (vec![0, 0, 1], "twice"), (vec![0, 5], "rank")] {
            let err = comm.subgroup("bad", &ranks, None, None).map(|_| ()).unwrap_err().to_string();
            assert!(err.contains(want), "{ranks:?}: {err}");
        }
    });
}

#[test]
fn a_waiting_operation_reads_for_itself_once_another_group_switches_the_links_to_caller_reading() {
    // Rank 0's world allreduce waits on a worker for the links' receiver threads; meanwhile a
    // small inline call of a subgroup switches the links to caller reading, and finishes. Before
    // the switch woke waiters, nobody read the links for the world call until its worker's next
    // 100 ms wake (measured: 60-90 ms late); now it reads for itself at once.
    let results = world(2, |comm, barrier| {
        let g = comm.subgroup("small", &[0, 1], None, None).unwrap();
        let mut late = Vec::new();
        for _ in 0..5 {
            barrier.wait();
            let mut x = vec![1.0f32; 1000];
            if comm.rank() == 0 {
                let b = f32_buf(&mut x);
                let req = CollRequest { coll: Collective::AllReduce, dtype: DType::F32, op: ReduceOp::Sum, root: 0, input: b, output: b, send_counts: None, recv_counts: None, timeout: None, algo: None, wire: None };
                let work = unsafe { comm.collective(req, false) }.unwrap();
                std::thread::sleep(Duration::from_millis(5));
                allreduce(&g, &mut [1.0f32], None, true).unwrap();
                barrier.wait(); // rank 1 joins the world call after this
                let joined = Instant::now();
                work.wait(None).unwrap().unwrap();
                late.push(joined.elapsed());
                assert_eq!(x[999], 2.0);
            } else {
                allreduce(&g, &mut [1.0f32], None, true).unwrap();
                barrier.wait();
                allreduce(&comm, &mut x, None, true).unwrap();
            }
        }
        late
    });
    let mut late = results[0].clone();
    late.sort();
    assert!(late[2] < Duration::from_millis(40), "the world call finished {late:?} after its peer joined");
}
