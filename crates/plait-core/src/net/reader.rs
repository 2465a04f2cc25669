//! The reading side of a peer link, which two kinds of thread can drive:
//!
//! - the link's own receiver thread (the default), which waits for its socket and reads frames
//!   as they come, so bulk transfers on every link proceed at once;
//! - the thread that waits for a small operation ("caller progress"): it reads the frames its
//!   operation waits for itself, so a small message costs one thread wake-up instead of two
//!   (the receiver's, then the caller's). On an oversubscribed machine that hand-off is most of
//!   a small allreduce's time.
//!
//! Whoever reads holds `frame_lock` for whole frames, so the stream never interleaves. Reads go
//! through a small buffer per link, so a small frame costs one `recv` (header and payload
//! together, often with the next frame), and "is there more?" is a non-blocking `recv` that
//! also reads it; large payloads bypass the buffer and land in the destination directly. In
//! caller mode the receiver thread parks and only drains what is waiting once per heartbeat
//! period, so heartbeats, Abort frames and closed connections are still noticed while the
//! caller is busy elsewhere.
//!
//! Waiting is portable through the `polling` crate (epoll, kqueue, IOCP): each receiver thread
//! waits on a poller of its own, which another thread can wake (`notify`) to hand reading to a
//! caller or to stop; callers wait on one `CallerPoll` that holds every link of their
//! communicator. Both are level-triggered, so a socket registered in both never loses readiness
//! to the other: only one of them is waited on at a time (the receiver thread parks in caller
//! mode). Receives that must not block go through `platform::socket`.

use super::frame::{FrameHeader, FrameKind, HEADER_LEN};
use super::peer::Inbox;
use crate::platform::socket;
use parking_lot::{Condvar, Mutex, RwLock};
use polling::{Event, Events, PollMode, Poller};
use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) struct ReadSide {
    pub peer: usize,
    stream: TcpStream,
    inbox: Arc<dyn Inbox>,
    heartbeat: Duration,
    frame_lock: Mutex<RxBuf>,
    caller_mode: AtomicBool,
    park: Mutex<()>,
    unpark: Condvar,
    /// What the receiver thread waits on.
    wait: SocketWait,
    /// Whether the socket is still registered in a `CallerPoll` (it leaves once the link ends).
    with_callers: AtomicBool,
    /// Nanoseconds since `epoch_start` when the last byte arrived from this peer.
    pub last_rx: Arc<AtomicU64>,
    pub epoch_start: Instant,
    /// Set when this side stops reading on purpose: nobody reports the link's end.
    pub deaf: Arc<AtomicBool>,
    /// The link ended (reported once) or the peer said Close.
    ended: AtomicBool,
    closed_cleanly: AtomicBool,
}

impl ReadSide {
    pub fn new(
        peer: usize,
        stream: TcpStream,
        inbox: Arc<dyn Inbox>,
        heartbeat: Duration,
        last_rx: Arc<AtomicU64>,
        epoch_start: Instant,
        deaf: Arc<AtomicBool>,
    ) -> io::Result<ReadSide> {
        Ok(ReadSide {
            wait: SocketWait::new(&stream)?,
            peer,
            stream,
            inbox,
            heartbeat,
            frame_lock: Mutex::new(RxBuf { data: vec![0; RX_BUF], start: 0, end: 0, lowat: 1 }),
            caller_mode: AtomicBool::new(false),
            park: Mutex::new(()),
            unpark: Condvar::new(),
            with_callers: AtomicBool::new(false),
            last_rx,
            epoch_start,
            deaf,
            ended: AtomicBool::new(false),
            closed_cleanly: AtomicBool::new(false),
        })
    }

    /// Whether a caller may poll and read this link now.
    pub fn readable_by_caller(&self) -> bool {
        self.caller_mode.load(Ordering::Acquire) && !self.finished()
    }

    /// Nobody will read this link again: it ended, or this side stopped reading.
    fn finished(&self) -> bool {
        self.ended.load(Ordering::Acquire) || self.deaf.load(Ordering::Acquire)
    }

    /// Hands reading to callers (true) or back to the receiver thread (false).
    pub fn set_caller_mode(&self, on: bool) {
        if self.caller_mode.swap(on, Ordering::AcqRel) == on {
            return;
        }
        if on {
            self.kick();
        } else {
            self.unpark();
        }
    }

    /// Wakes the receiver thread so it sees the link was shut down.
    pub fn wake(&self) {
        self.unpark();
        self.kick();
    }

    /// Wakes the receiver thread out of its wait for the socket.
    fn kick(&self) {
        if let Err(e) = self.wait.kick() {
            tracing::warn!(peer = self.peer, "cannot wake the link's receiver thread: {e}");
        }
    }

    /// Wakes the receiver thread out of its park.
    fn unpark(&self) {
        let _g = self.park.lock();
        self.unpark.notify_all();
    }

    /// The receiver thread's loop.
    pub fn run(&self) {
        let mut events = Events::new();
        loop {
            if self.deaf.load(Ordering::Acquire) || self.ended.load(Ordering::Acquire) {
                return;
            }
            if self.caller_mode.load(Ordering::Acquire) {
                {
                    let mut g = self.park.lock();
                    if self.caller_mode.load(Ordering::Acquire) && !self.deaf.load(Ordering::Acquire) {
                        self.unpark.wait_for(&mut g, self.heartbeat);
                    }
                }
                if self.caller_mode.load(Ordering::Acquire) {
                    // Nobody may be waiting on this link: keep liveness and control frames flowing.
                    if let Some(mut rx) = self.frame_lock.try_lock() {
                        self.read_waiting(&mut rx, None);
                    }
                }
                continue;
            }
            match self.wait.wait(&mut events) {
                Err(e) => {
                    self.end(e);
                    return;
                }
                // A kick: the loop looks at why.
                Ok(false) => {}
                Ok(true) => {
                    // A caller may have read the frame while this thread waited for the lock:
                    // the reads below do not block when nothing is there.
                    let mut rx = self.frame_lock.lock();
                    self.read_waiting(&mut rx, None);
                }
            }
        }
    }

    /// Reads every frame already waiting (the caller holds `frame_lock`: `rx`). A frame begun
    /// is read to its end, waiting until `deadline` at most for the rest of it (None: blocking).
    /// Returns false when the link ended; when it returns true, less than a header is left in
    /// the buffer, so a waiter may rely on the socket's readiness alone.
    fn read_waiting(&self, rx: &mut RxBuf, deadline: Option<Instant>) -> bool {
        loop {
            if self.ended.load(Ordering::Acquire) || self.deaf.load(Ordering::Acquire) {
                return false;
            }
            if rx.len() < HEADER_LEN {
                match fill(&self.stream, rx, Wait::No) {
                    Ok(0) => return true,
                    Ok(_) => continue,
                    Err(e) => {
                        self.end(e);
                        return false;
                    }
                }
            }
            if let Err(e) = self.read_frame(rx, deadline) {
                self.end(e);
                return false;
            }
        }
    }

    /// Reads what is waiting on behalf of a caller, taking the frame lock by `deadline`.
    pub fn caller_read(&self, deadline: Instant) -> bool {
        match self.frame_lock.try_lock_until(deadline) {
            Some(mut rx) => self.read_waiting(&mut rx, Some(deadline)),
            None => true,
        }
    }

    fn read_frame(&self, rx: &mut RxBuf, deadline: Option<Instant>) -> io::Result<()> {
        let wait = match deadline {
            Some(d) => Wait::Until(d),
            None => Wait::Forever,
        };
        while rx.len() < HEADER_LEN {
            fill(&self.stream, rx, wait)?;
        }
        let raw: [u8; HEADER_LEN] = rx.data[rx.start..rx.start + HEADER_LEN].try_into().unwrap();
        rx.start += HEADER_LEN;
        let header = FrameHeader::decode(&raw)?;
        self.touch();
        match FrameKind::from_u8(header.kind) {
            Some(FrameKind::Heartbeat) => return Ok(()),
            Some(FrameKind::Close) => self.closed_cleanly.store(true, Ordering::Release),
            _ => {}
        }
        let mut payload = Payload { rx, stream: &self.stream, wait, left: header.nbytes, side: self };
        let delivered = self.inbox.deliver(self.peer, &header, &mut payload);
        // Headers and polls must see every byte again.
        set_lowat(&self.stream, payload.rx, 1);
        delivered?;
        if payload.left != 0 {
            // Only a read that failed part-way leaves payload behind: the link went down mid-frame.
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection closed in the middle of a message"));
        }
        Ok(())
    }

    fn touch(&self) {
        self.last_rx.store(self.epoch_start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// The link ended with `err`: report it once, unless this side stopped reading on purpose.
    fn end(&self, err: io::Error) {
        if self.ended.swap(true, Ordering::AcqRel) || self.deaf.load(Ordering::Acquire) {
            return;
        }
        self.wake();
        self.inbox.link_down(self.peer, err, self.closed_cleanly.load(Ordering::Acquire));
    }
}

/// Bytes read from the socket but not yet consumed: `data[start..end]`.
pub(super) struct RxBuf {
    data: Vec<u8>,
    start: usize,
    end: usize,
    /// The socket's SO_RCVLOWAT: raised while a large payload is read by a blocking thread, so
    /// it wakes once per `LOWAT` bytes instead of once per packet; 1 otherwise.
    lowat: usize,
}

/// How many bytes a receiver thread reading a large payload waits for per wake-up (at most).
/// Measured on 2 ranks, 64 MiB allreduce: 33-36 ms against 35-41 ms waking per packet.
const LOWAT: usize = 256 * 1024;

/// Sets SO_RCVLOWAT when it differs from what `rx` says it is.
fn set_lowat(stream: &TcpStream, rx: &mut RxBuf, bytes: usize) {
    let bytes = bytes.max(1);
    if rx.lowat != bytes && socket::set_recv_lowat(stream, bytes) {
        rx.lowat = bytes;
    }
}

/// Size of each link's receive buffer; payloads at least this large skip it.
const RX_BUF: usize = 64 * 1024;

impl RxBuf {
    fn len(&self) -> usize {
        self.end - self.start
    }
}

#[derive(Clone, Copy)]
enum Wait {
    /// Return at once when nothing is there (`Ok(0)`).
    No,
    Until(Instant),
    Forever,
}

/// One `recv` into `buf`: Ok(0) only for `Wait::No` with nothing there; end of stream is an
/// error (the peer closed the connection). Never blocks past a `Wait::Until` deadline.
fn recv_some(stream: &TcpStream, buf: &mut [u8], wait: Wait) -> io::Result<usize> {
    loop {
        let err = match socket::recv(stream, buf, matches!(wait, Wait::Forever)) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection")),
            Ok(n) => return Ok(n),
            Err(e) => e,
        };
        match (err.kind(), wait) {
            (io::ErrorKind::Interrupted, _) => continue,
            (io::ErrorKind::WouldBlock, Wait::No) => return Ok(0),
            (io::ErrorKind::WouldBlock, Wait::Until(deadline)) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "the peer stopped sending in the middle of a message"));
                }
                socket::wait_readable(stream, left)?;
            }
            _ => return Err(err),
        }
    }
}

/// Reads more bytes into the buffer (moving what is left to its front when needed).
fn fill(stream: &TcpStream, rx: &mut RxBuf, wait: Wait) -> io::Result<usize> {
    if rx.start == rx.end {
        rx.start = 0;
        rx.end = 0;
    } else if rx.end == rx.data.len() {
        rx.data.copy_within(rx.start..rx.end, 0);
        rx.end -= rx.start;
        rx.start = 0;
    }
    let n = recv_some(stream, &mut rx.data[rx.end..], wait)?;
    rx.end += n;
    Ok(n)
}

/// A frame's payload: buffered bytes first, then the socket (directly into the destination
/// for large reads), refreshing the liveness clock as bytes arrive.
struct Payload<'a> {
    rx: &'a mut RxBuf,
    stream: &'a TcpStream,
    wait: Wait,
    left: u64,
    side: &'a ReadSide,
}

impl Read for Payload<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        let max = buf.len().min(self.left as usize);
        let n = if self.rx.len() > 0 {
            let n = max.min(self.rx.len());
            buf[..n].copy_from_slice(&self.rx.data[self.rx.start..self.rx.start + n]);
            self.rx.start += n;
            n
        } else if max >= RX_BUF / 2 {
            if matches!(self.wait, Wait::Forever) {
                // A blocked recv that has copied c bytes sleeps until `lowat` *more* have come,
                // and the peer may send nothing after this payload: lowat <= left/2 guarantees
                // left - c >= lowat bytes are still on their way.
                set_lowat(self.stream, self.rx, (self.left as usize / 2).min(LOWAT));
            }
            recv_some(self.stream, &mut buf[..max], self.wait)?
        } else {
            // The buffer may take the next frame's bytes too: wait for any byte, not a mark.
            set_lowat(self.stream, self.rx, 1);
            fill(self.stream, self.rx, self.wait)?;
            let n = max.min(self.rx.len());
            buf[..n].copy_from_slice(&self.rx.data[self.rx.start..self.rx.start + n]);
            self.rx.start += n;
            n
        };
        self.left -= n as u64;
        self.side.touch();
        Ok(n)
    }
}

impl Drop for ReadSide {
    fn drop(&mut self) {
        self.wait.forget(&self.stream);
    }
}

/// Waits until one socket is readable, or until another thread cuts the wait short (`kick`).
struct SocketWait {
    poller: Poller,
}

impl SocketWait {
    /// The socket must be `forget`-ten before it closes.
    fn new(stream: &TcpStream) -> io::Result<SocketWait> {
        let poller = Poller::new()?;
        // SAFETY: the owner calls `forget` before the stream closes (see ReadSide's Drop).
        unsafe { poller.add_with_mode(stream, Event::readable(0), PollMode::Level)? };
        Ok(SocketWait { poller })
    }

    /// Blocks until the socket is readable (true) or a kick came (false; also spuriously).
    /// A kick that comes while nobody waits ends the next wait at once, so none is lost.
    fn wait(&self, events: &mut Events) -> io::Result<bool> {
        events.clear();
        self.poller.wait(events, None)?;
        Ok(!events.is_empty())
    }

    fn kick(&self) -> io::Result<()> {
        self.poller.notify()
    }

    fn forget(&self, stream: &TcpStream) {
        let _ = self.poller.delete(stream);
    }
}

/// Every link a waiting caller may read, in one poller, so that a caller waits on all of them
/// at once (see the module doc). Links join when they start and leave once they end (a closed
/// socket stays readable, which would otherwise wake every wait).
pub struct CallerPoll {
    poller: Poller,
    /// Indexed by the key each side was registered with.
    sides: RwLock<Vec<Arc<ReadSide>>>,
    events: Mutex<Events>,
}

impl CallerPoll {
    pub fn new() -> io::Result<CallerPoll> {
        Ok(CallerPoll { poller: Poller::new()?, sides: RwLock::new(Vec::new()), events: Mutex::new(Events::new()) })
    }

    pub(super) fn add(&self, side: &Arc<ReadSide>) -> io::Result<()> {
        let mut sides = self.sides.write();
        // SAFETY: the poll keeps the side (and so its stream) alive, and `Drop` deletes it first.
        unsafe { self.poller.add_with_mode(&side.stream, Event::readable(sides.len()), PollMode::Level)? };
        side.with_callers.store(true, Ordering::Release);
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
    use std::io::Write;
    use std::net::TcpListener;

    /// Hands each payload it reads to the test.
    struct Collect(crossbeam_channel::Sender<Vec<u8>>);

    impl Inbox for Collect {
        fn deliver(&self, _peer: usize, h: &FrameHeader, payload: &mut dyn Read) -> io::Result<()> {
            let mut v = vec![0u8; h.nbytes as usize];
            payload.read_exact(&mut v)?;
            let _ = self.0.send(v);
            Ok(())
        }
        fn link_down(&self, _peer: usize, _error: io::Error, _clean: bool) {}
    }

    /// A large payload that arrives in two parts, the second shorter than the receive
    /// low-water mark and followed by nothing: the receiver must wake for it.
    #[test]
    fn a_payload_whose_tail_comes_late_is_read_to_its_end() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx_stream, _) = listener.accept().unwrap();
        let (got_tx, got) = crossbeam_channel::unbounded();
        let deaf = Arc::new(AtomicBool::new(false));
        let side = Arc::new(
            ReadSide::new(1, rx_stream, Arc::new(Collect(got_tx)), Duration::from_secs(1), Arc::new(AtomicU64::new(0)), Instant::now(), deaf.clone())
                .unwrap(),
        );
        let runner = side.clone();
        let thread = std::thread::spawn(move || runner.run());
        // Bulk traffic first, so receive-window autotuning opens the window wide: a narrow
        // window wakes a blocked reader by itself and would hide a mark set too high.
        let bulk = vec![7u8; 4 << 20];
        for _ in 0..16 {
            let header = FrameHeader { kind: FrameKind::P2p as u8, nbytes: bulk.len() as u64, ..Default::default() };
            tx.write_all(&header.encode()).unwrap();
            tx.write_all(&bulk).unwrap();
            assert_eq!(got.recv_timeout(Duration::from_secs(3)).unwrap().len(), bulk.len());
        }
        for (len, first) in [(300_000usize, 100_000usize), (600_000, 250_000), (1 << 20, 40_000), (1 << 20, 700_000)] {
            let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let header = FrameHeader { kind: FrameKind::P2p as u8, nbytes: len as u64, ..Default::default() };
            tx.write_all(&header.encode()).unwrap();
            tx.write_all(&payload[..first]).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            tx.write_all(&payload[first..]).unwrap();
            let v = got.recv_timeout(Duration::from_secs(3)).unwrap_or_else(|_| panic!("{len}-byte payload never completed"));
            assert!(v == payload, "{len}-byte payload corrupted");
        }
        deaf.store(true, Ordering::SeqCst);
        side.wake();
        drop(tx);
        thread.join().unwrap();
    }

    fn connected_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (a, b)
    }

    fn side_for(stream: TcpStream, peer: usize, sink: crossbeam_channel::Sender<Vec<u8>>) -> Arc<ReadSide> {
        let deaf = Arc::new(AtomicBool::new(false));
        Arc::new(ReadSide::new(peer, stream, Arc::new(Collect(sink)), Duration::from_secs(1), Arc::new(AtomicU64::new(0)), Instant::now(), deaf).unwrap())
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
