//! A panic in the middle of an operation (made by a failpoint) must leave no receive posted into
//! memory the caller may free, and must fail the call on every rank with an error that says so.

use crate::failpoint;
use crate::{CollRequest, Collective, CommConfig, Communicator, DType, MemStore, RawBuf, ReduceOp};
use std::sync::{Arc, Barrier};
use std::time::Duration;

fn two_ranks<T: Send + 'static>(f: impl Fn(Arc<Communicator>, &Barrier) -> T + Send + Sync + 'static) -> Vec<T> {
    let store = Arc::new(MemStore::new());
    let f = Arc::new(f);
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let (store, f, barrier) = (store.clone(), f.clone(), barrier.clone());
            std::thread::spawn(move || {
                let mut cfg = CommConfig::from_env(r, 2).unwrap();
                cfg.timeout = Duration::from_secs(10);
                cfg.group = "transfers-panic".into();
                let comm = Communicator::new(&*store, cfg).unwrap();
                let out = f(comm.clone(), &barrier);
                comm.close();
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// An f32 sum allreduce from `input` into `output` (the caller keeps both until it has waited).
fn sum_f32(input: &mut [f32], output: &mut [f32], timeout: Option<Duration>) -> CollRequest {
    CollRequest {
        coll: Collective::AllReduce,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: 0,
        input: RawBuf { ptr: input.as_mut_ptr() as *mut u8, len: input.len() * 4 },
        output: RawBuf { ptr: output.as_mut_ptr() as *mut u8, len: output.len() * 4 },
        send_counts: None,
        recv_counts: None,
        timeout,
        algo: None,
        wire: None,
    }
}

#[test]
fn a_receive_that_panics_while_waiting_is_withdrawn_before_its_buffer_is_released() {
    let out = two_ranks(|comm, barrier| {
        let mut buf = vec![0xAAu8; 64];
        if comm.rank() == 1 {
            failpoint::arm("p2p.wait");
            let work = unsafe { comm.recv(RawBuf::of(&mut buf), DType::U8, Some(0), 7, None, true) }.unwrap();
            let err = work.wait(None).unwrap().unwrap_err().to_string();
            barrier.wait();
            // Rank 0 sends now: a receive left posted would land the message in `buf`.
            barrier.wait();
            std::thread::sleep(Duration::from_millis(300));
            (err, buf.iter().all(|&b| b == 0xAA), comm.session().mailbox.posted_len())
        } else {
            barrier.wait();
            buf.fill(0x55);
            let sent = unsafe { comm.send(RawBuf::of(&mut buf), DType::U8, 1, 7, None, true) }.and_then(|w| w.wait(None).unwrap());
            barrier.wait();
            (sent.err().map(|e| e.to_string()).unwrap_or_default(), true, 0)
        }
    });
    let (err, untouched, posted) = &out[1];
    assert!(err.contains("panic"), "the receive's error says what happened: {err}");
    assert!(*untouched, "a frame landed in the buffer of a receive that had already failed");
    assert_eq!(*posted, 0, "the failed receive is still posted");
}

#[test]
fn a_collective_that_panics_midway_restores_nothing_late_and_fails_every_rank() {
    let out = two_ranks(|comm, _| {
        let n = 4096;
        let mut input = vec![1.0f32; n];
        let mut output = vec![7.0f32; n];
        if comm.rank() == 1 {
            failpoint::arm("collective.drive");
        }
        let req = sum_f32(&mut input, &mut output, None);
        let result = unsafe { comm.collective(req, true) }.unwrap().wait(None).unwrap();
        let posted = comm.session().mailbox.posted_len();
        (result.map_err(|e| e.to_string()), output.iter().all(|&x| x == 7.0), posted)
    });
    let (err, untouched, posted) = &out[1];
    let err = err.clone().unwrap_err();
    assert!(err.contains("panic"), "the panicking rank's error says what happened: {err}");
    assert!(*untouched, "the output was changed by a failed allreduce");
    assert_eq!(*posted, 0, "receives left posted");
    // Rank 0 may have finished (rank 1 had sent its part before it panicked); if not, it was
    // told why, and by whom.
    if let (Err(err), untouched, posted) = &out[0] {
        assert!(err.contains("rank 1") && err.contains("panic"), "rank 0 names the rank and the cause: {err}");
        assert!(*untouched && *posted == 0);
    }
}

#[test]
fn a_started_receive_dropped_unwaited_is_withdrawn() {
    let out = two_ranks(|comm, barrier| {
        let mut buf = vec![0xAAu8; 64];
        if comm.rank() == 1 {
            let started = super::super::p2p::start_recv(comm.session(), Some(0), 9, DType::U8, RawBuf::of(&mut buf), "recv".into()).unwrap();
            drop(started); // an early return or an error between starting and waiting
            barrier.wait();
            barrier.wait();
            std::thread::sleep(Duration::from_millis(300));
            (buf.iter().all(|&b| b == 0xAA), comm.session().mailbox.posted_len())
        } else {
            barrier.wait();
            buf.fill(0x55);
            let _ = unsafe { comm.send(RawBuf::of(&mut buf), DType::U8, 1, 9, None, true) }.map(|w| w.wait(None));
            barrier.wait();
            (true, 0)
        }
    });
    assert!(out[1].0, "a frame landed in the buffer of a receive that was dropped");
    assert_eq!(out[1].1, 0, "the dropped receive is still posted");
}

#[test]
fn a_panic_while_a_stashed_message_is_landed_fails_the_call_instead_of_hanging() {
    // Rank 1 enters late, so rank 0's frames wait in its stash and are landed on rank 1's own
    // thread as it posts its receives: the failpoint panics there, with the receive taken.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let out = two_ranks(|comm, barrier| {
            let n = 1024;
            let mut input = vec![1.0f32; n];
            let mut output = vec![7.0f32; n];
            if comm.rank() == 1 {
                barrier.wait();
                std::thread::sleep(Duration::from_millis(300));
                failpoint::arm("mailbox.land_from_memory");
            } else {
                barrier.wait();
            }
            let req = sum_f32(&mut input, &mut output, Some(Duration::from_secs(5)));
            let result = unsafe { comm.collective(req, true) }.unwrap().wait(None).unwrap();
            (result.map_err(|e| e.to_string()), output.iter().all(|&x| x == 7.0))
        });
        let _ = tx.send(out);
    });
    let out = rx.recv_timeout(Duration::from_secs(30)).expect("the call hung after a panic while landing a message");
    let (result, untouched) = &out[1];
    let err = result.clone().unwrap_err();
    assert!(err.contains("panic"), "{err}");
    assert!(*untouched, "the output was changed by a failed allreduce");
}
