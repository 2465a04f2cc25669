//! How held, never-received messages affect collectives: rank 0 sends N small messages that
//! rank 1 never receives, then both ranks time small allreduces. Before the mailbox indexed its
//! early frames, every collective scanned all of them.
//!
//! `cargo run --release -p plait-core --example unmatched -- 0 50000 400000`

use plait_core::{CollRequest, CommConfig, Communicator, DType, MemStore, RawBuf, ReduceOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ITERS: usize = 2000;

fn main() {
    let counts: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("a number of messages")).collect();
    let counts = if counts.is_empty() { vec![0, 50_000, 400_000] } else { counts };
    for (i, n) in counts.into_iter().enumerate() {
        let store = Arc::new(MemStore::new());
        let ranks: Vec<_> = (0..2)
            .map(|r| {
                let store = store.clone();
                std::thread::spawn(move || run(r, n, i as u64, &*store))
            })
            .collect();
        let p50s: Vec<Duration> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        println!("{n:>8} unreceived messages: allreduce (4 B) p50 {:?} (rank 0), {:?} (rank 1)", p50s[0], p50s[1]);
    }
}

fn run(rank: usize, unreceived: usize, epoch: u64, store: &MemStore) -> Duration {
    let mut cfg = CommConfig::from_env(rank, 2).unwrap();
    cfg.epoch = epoch;
    let comm = Communicator::new(store, cfg).unwrap();
    let mut word = [1u8; 8];
    if rank == 0 {
        for _ in 0..unreceived {
            // SAFETY: `word` outlives the send, which is waited for at once.
            unsafe { comm.send(RawBuf::of(&mut word), DType::U8, 1, 5, None, true) }.unwrap().wait(None).unwrap().unwrap();
        }
    }
    let mut x = [1f32];
    let mut times = Vec::with_capacity(ITERS);
    for _ in 0..ITERS {
        let buf = RawBuf { ptr: x.as_mut_ptr() as *mut u8, len: 4 };
        let req = CollRequest::allreduce(buf, DType::F32, ReduceOp::Max);
        let t0 = Instant::now();
        // SAFETY: `x` outlives the call, which is waited for at once.
        unsafe { comm.collective(req, true) }.unwrap().wait(None).unwrap().unwrap();
        times.push(t0.elapsed());
    }
    comm.close();
    times.sort();
    times[ITERS / 2]
}
