//! Waiting for link sockets: a receiver thread's own poller that another thread can wake
//! (`SocketWait`), and one poller over every lane of a communicator for callers that read links
//! themselves (`CallerPoll`).
//!
//! Waiting is portable through the `polling` crate (epoll, kqueue, IOCP): each receiver thread
//! waits on a poller of its own, which another thread can wake (`notify`) to hand reading to a
//! caller or to stop; callers wait on one `CallerPoll` that holds every link of their
//! communicator. Both are level-triggered, so a socket registered in both never loses readiness
//! to the other: only one of them is waited on at a time (the receiver thread parks in caller
//! mode).

use super::reader::ReadSide;
use parking_lot::{Mutex, RwLock};
use polling::{Event, Events, PollMode, Poller};
use std::io;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Waits until one socket is readable, or until another thread cuts the wait short (`kick`).
pub(super) struct SocketWait {
    poller: Poller,
}

impl SocketWait {
    /// The socket must be `forget`-ten before it closes.
    pub(super) fn new(stream: &TcpStream) -> io::Result<SocketWait> {
        let poller = Poller::new()?;
        // SAFETY: the owner calls `forget` before the stream closes (see ReadSide's Drop).
        unsafe { poller.add_with_mode(stream, Event::readable(0), PollMode::Level)? };
        Ok(SocketWait { poller })
    }

    /// Blocks until the socket is readable (true) or a kick came (false; also spuriously).
    /// A kick that comes while nobody waits ends the next wait at once, so none is lost.
    pub(super) fn wait(&self, events: &mut Events) -> io::Result<bool> {
        events.clear();
        self.poller.wait(events, None)?;
        Ok(!events.is_empty())
    }

    pub(super) fn kick(&self) -> io::Result<()> {
        self.poller.notify()
    }

    pub(super) fn forget(&self, stream: &TcpStream) {
        let _ = self.poller.delete(stream);
    }
}

/// Every link a waiting caller may read, in one poller, so that a caller waits on all of them
/// at once (see the module doc). Links join when they start and leave once they end (a closed
/// socket stays readable, which would otherwise wake every wait).
pub struct CallerPoll {
    poller: Arc<Poller>,
    /// Indexed by the key each side was registered with.
    sides: RwLock<Vec<Arc<ReadSide>>>,
    events: Mutex<Events>,
}

impl CallerPoll {
    pub fn new() -> io::Result<CallerPoll> {
        Ok(CallerPoll { poller: Arc::new(Poller::new()?), sides: RwLock::new(Vec::new()), events: Mutex::new(Events::new()) })
    }

    pub(super) fn add(&self, side: &Arc<ReadSide>) -> io::Result<()> {
        let mut sides = self.sides.write();
        // The poll keeps the side (and so its stream) alive, and `Drop` deletes it first.
        side.join_callers(&self.poller, sides.len())?;
        sides.push(side.clone());
        Ok(())
    }

    /// Waits up to `wait` until a link a caller may read has something to read, then reads
    /// what every ready one has waiting (frames begun are finished by `deadline`). Returns
    /// whether any link had something.
    pub fn progress(&self, wait: Duration, deadline: Instant) -> bool {
        let until = Instant::now() + wait;
        // The ready sides, read after both locks are let go, so that another caller of the
        // same communicator can wait and read meanwhile; kept per thread (small operations
        // call this on every wait).
        thread_local! {
            static READY: std::cell::RefCell<Vec<Arc<ReadSide>>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        READY.with(|ready| {
            let mut ready = ready.borrow_mut();
            ready.clear();
            {
                let sides = self.sides.read();
                if !sides.iter().any(|s| s.readable_by_caller()) {
                    drop(sides);
                    std::thread::sleep(wait.min(Duration::from_millis(1)));
                    return false;
                }
                // Another caller may be waiting: take turns rather than spin (`Poller::wait`
                // returns at once while another thread waits on the same poller).
                let Some(mut events) = self.events.try_lock_until(until) else {
                    return false;
                };
                events.clear();
                if let Err(e) = self.poller.wait(&mut events, Some(until.saturating_duration_since(Instant::now()))) {
                    tracing::warn!("waiting for the links failed: {e}");
                    std::thread::sleep(wait.min(Duration::from_millis(1)));
                    return false;
                }
                for ev in events.iter() {
                    let side = &sides[ev.key];
                    if side.readable_by_caller() {
                        ready.push(side.clone());
                    } else if side.finished() && side.with_callers.swap(false, Ordering::AcqRel) {
                        let _ = self.poller.delete(&side.stream);
                    }
                }
                if ready.is_empty() && !events.is_empty() {
                    // Readiness only of links that callers may not read now (caller mode being
                    // switched off): their receiver threads read them; do not spin meanwhile.
                    drop(events);
                    drop(sides);
                    std::thread::sleep(until.saturating_duration_since(Instant::now()).min(Duration::from_millis(1)));
                    return false;
                }
            }
            let any = !ready.is_empty();
            for side in ready.drain(..) {
                side.caller_read(deadline);
            }
            any
        })
    }
}

impl Drop for CallerPoll {
    fn drop(&mut self) {
        for side in self.sides.get_mut().iter() {
            if side.with_callers.swap(false, Ordering::AcqRel) {
                let _ = self.poller.delete(&side.stream);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::frame::{FrameHeader, FrameKind};
    use crate::net::reader::testing::side_for;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::sync::atomic::AtomicBool;

    fn connected_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (a, b)
    }

    fn send_frame(tx: &mut TcpStream, payload: &[u8]) {
        let header = FrameHeader { kind: FrameKind::P2p as u8, nbytes: payload.len() as u64, ..Default::default() };
        tx.write_all(&header.encode()).unwrap();
        tx.write_all(payload).unwrap();
    }

    /// The receiver thread's wait is cut short by a kick, every time, while a loopback
    /// connection carries bulk traffic: a lost kick would leave a link unread until its next
    /// byte, and a slow one delays every hand-over to a caller. No kick may be lost. On a
    /// shared 2-core machine the scheduler itself sometimes takes over 1 ms to run a woken
    /// thread (0 to 17 of 10 000 kicks in runs beside a compiler), so up to 1 % may be late.
    #[test]
    fn ten_thousand_kicks_in_a_row_each_wake_a_blocked_wait_within_a_millisecond() {
        const KICKS: usize = 10_000;
        // Rounds not timed: the threads start and the load reaches its pace.
        const WARM_UP: usize = 200;
        let (_idle_tx, idle_rx) = connected_pair();
        let wait = Arc::new(SocketWait::new(&idle_rx).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        // Load: one thread keeps a loopback connection busy for the whole test, writing 64 KiB
        // and reading it back, so the kernel's network path and a core are loaded.
        let (mut bulk_tx, mut bulk_rx) = connected_pair();
        let load = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut chunk = vec![1u8; 64 * 1024];
                let mut moved = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    bulk_tx.write_all(&chunk).unwrap();
                    bulk_rx.read_exact(&mut chunk).unwrap();
                    moved += chunk.len();
                }
                moved
            })
        };
        let (woke_tx, woke) = crossbeam_channel::bounded::<Instant>(1);
        let waiter = {
            let wait = wait.clone();
            std::thread::spawn(move || {
                let mut events = Events::new();
                for _ in 0..WARM_UP + KICKS {
                    // A spurious return is allowed by the poller; a kick must end some wait.
                    while wait.wait(&mut events).unwrap() {}
                    woke_tx.send(Instant::now()).unwrap();
                }
            })
        };
        let mut late = Vec::new();
        for i in 0..WARM_UP + KICKS {
            // Let the waiter block again before the next kick.
            std::thread::sleep(Duration::from_micros(50));
            let kicked = Instant::now();
            wait.kick().unwrap();
            let woke_at = woke.recv_timeout(Duration::from_secs(2)).unwrap_or_else(|_| panic!("kick {i} was lost"));
            let delay = woke_at.saturating_duration_since(kicked);
            if i >= WARM_UP && delay > Duration::from_millis(1) {
                late.push((i - WARM_UP, delay));
            }
        }
        stop.store(true, Ordering::Relaxed);
        waiter.join().unwrap();
        let moved = load.join().unwrap();
        assert!(moved > 0);
        wait.forget(&idle_rx);
        eprintln!("{} of {KICKS} kicks took over 1 ms: {late:?}", late.len());
        assert!(late.len() <= KICKS / 100, "{} of {KICKS} kicks took over 1 ms to wake the wait: {:?}", late.len(), &late[..late.len().min(10)]);
    }

    /// A caller waits on several links at once and reads what arrives on each; a link that
    /// closed leaves the poll instead of waking every later wait.
    #[test]
    fn a_caller_reads_every_link_and_a_closed_link_leaves_the_poll() {
        let poll = CallerPoll::new().unwrap();
        let (got_tx, got) = crossbeam_channel::unbounded();
        let mut senders = Vec::new();
        let mut sides = Vec::new();
        for peer in 0..3 {
            let (tx, rx) = connected_pair();
            let side = side_for(rx, peer, got_tx.clone());
            side.set_caller_mode(true);
            poll.add(&side).unwrap();
            senders.push(tx);
            sides.push(side);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        assert!(!poll.progress(Duration::from_millis(20), deadline), "nothing was sent yet");
        for (i, tx) in senders.iter_mut().enumerate() {
            send_frame(tx, &[i as u8; 100]);
        }
        let mut seen = Vec::new();
        while seen.len() < 3 && Instant::now() < deadline {
            poll.progress(Duration::from_millis(50), deadline);
            seen.extend(got.try_iter().map(|v| v[0]));
        }
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2]);
        // Peer 1 closes: its end is read once, then it leaves the poll.
        drop(senders.remove(1));
        let t = Instant::now();
        while !sides[1].finished() && t.elapsed() < Duration::from_secs(5) {
            poll.progress(Duration::from_millis(50), deadline);
        }
        assert!(sides[1].finished());
        poll.progress(Duration::from_millis(10), deadline);
        assert!(!sides[1].with_callers.load(Ordering::Acquire), "the closed link is still polled");
        let t = Instant::now();
        assert!(!poll.progress(Duration::from_millis(30), deadline), "a closed link woke the wait");
        assert!(t.elapsed() >= Duration::from_millis(25), "the wait returned early: {:?}", t.elapsed());
        send_frame(&mut senders[1], &[9; 10]);
        let t = Instant::now();
        while got.try_recv().is_err() {
            assert!(t.elapsed() < Duration::from_secs(5), "the live link was not read after the other closed");
            poll.progress(Duration::from_millis(50), deadline);
        }
    }

    /// A link callers may not read now (its receiver thread reads it) with data waiting must
    /// not turn a caller's wait into a busy loop: level-triggered readiness that nobody here
    /// consumes would otherwise end every wait at once.
    #[test]
    fn readiness_of_a_link_callers_may_not_read_does_not_spin_the_caller() {
        let poll = CallerPoll::new().unwrap();
        let (sink, _got) = crossbeam_channel::unbounded();
        let (_idle_tx, idle_rx) = connected_pair();
        let (mut busy_tx, busy_rx) = connected_pair();
        let idle = side_for(idle_rx, 0, sink.clone());
        let busy = side_for(busy_rx, 1, sink);
        idle.set_caller_mode(true);
        poll.add(&idle).unwrap();
        poll.add(&busy).unwrap();
        busy_tx.write_all(b"unread").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let deadline = Instant::now() + Duration::from_secs(5);
        let t = Instant::now();
        let mut calls = 0;
        while t.elapsed() < Duration::from_millis(50) {
            assert!(!poll.progress(Duration::from_millis(2), deadline));
            calls += 1;
        }
        assert!(calls <= 60, "{calls} waits in 50 ms: the caller spins");
    }
}
