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
//! Receives that must not block go through `platform::socket`; waiting for the socket is in
//! `wait`.
//!
//! Parking (flow control): when the inbox cannot take a frame now (its receive is not posted and
//! holding it would go over what may be held for the peer), it answers `Delivery::Parked` without
//! reading a byte of the payload. The lane then keeps the frame's header and reads nothing more:
//! the receiver thread sleeps instead of waiting for the socket, and the lane leaves the callers'
//! poll (its socket stays readable, which would wake every wait). The payload waits in the
//! kernel's socket buffer, so TCP flow control stops the sender (or, sent through shared memory,
//! in the lane's ring, whose room the sender then waits for: see `shm`). Whoever can take the frame later
//! (a receive posted, room freed) wakes the lane through its `LaneWaker`; the receiver thread
//! then offers the frame again (in either mode: a caller's wait never blocks on a parked frame,
//! and the caller that posts the receive need not read it itself). Past the parked deadline the
//! frame is offered again anyway, and the inbox decides whether to fail the link. A shut link
//! wakes the thread like any other stop.
//!
//! A sealed link (`PLAIT_ENCRYPT=1`) reads the same way, record by record (see `seal`): a
//! header's record whole, then each payload record through `Unsealing` into plaintext that the
//! payload's reader hands out. Records never span frames, so between frames nothing is left
//! decrypted and the readiness rule above still holds.

use super::frame::{FrameHeader, FrameKind, HEADER_LEN, SHM_PAYLOAD};
use super::peer::{Delivery, Inbox, LaneWaker, Resume};
use super::seal::{sealed_len, Opener, RECORD_MAX};
use super::shm::{Inbound, OFFER_MAX_BYTES};
use super::wait::SocketWait;
use crate::platform::socket;
use parking_lot::{Condvar, Mutex};
use polling::{Event, Events, PollMode, Poller};
use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

pub(super) struct ReadSide {
    pub peer: usize,
    pub(super) stream: TcpStream,
    inbox: Arc<dyn Inbox>,
    heartbeat: Duration,
    frame_lock: Mutex<RxBuf>,
    caller_mode: AtomicBool,
    park: Mutex<()>,
    unpark: Condvar,
    /// What the receiver thread waits on.
    wait: SocketWait,
    /// Whether the socket is still registered in a `CallerPoll` (it leaves once the link ends).
    pub(super) with_callers: AtomicBool,
    /// That poll and this lane's key in it, to leave it while a frame is parked.
    callers: OnceLock<(Arc<Poller>, usize)>,
    /// Held while this lane's interest in that poll changes, so it always matches `parked`.
    interest: Mutex<()>,
    /// A frame is parked: nobody reads this lane until it is offered again.
    parked: AtomicBool,
    /// The lane was woken since a parked frame was last offered (see `Resume`).
    woken: AtomicBool,
    /// Handed to the inbox with every frame, to wake this lane once a parked frame may go on.
    waker: LaneWaker,
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
    /// A lane's reading side; frames on it are sealed with `open`'s keys (when given).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        peer: usize,
        stream: TcpStream,
        inbox: Arc<dyn Inbox>,
        heartbeat: Duration,
        last_rx: Arc<AtomicU64>,
        epoch_start: Instant,
        deaf: Arc<AtomicBool>,
        open: Option<Opener>,
    ) -> io::Result<Arc<ReadSide>> {
        let wait = SocketWait::new(&stream)?;
        let open = open.map(|opener| Box::new(Unsealing { opener, wire: vec![0; sealed_len(RECORD_MAX)], plain: vec![0; RECORD_MAX], start: 0, end: 0 }));
        Ok(Arc::new_cyclic(|me: &Weak<ReadSide>| ReadSide {
            wait,
            peer,
            stream,
            inbox,
            heartbeat,
            frame_lock: Mutex::new(RxBuf { data: vec![0; RX_BUF], start: 0, end: 0, lowat: 1, open, parked: None, shm: None }),
            caller_mode: AtomicBool::new(false),
            park: Mutex::new(()),
            unpark: Condvar::new(),
            with_callers: AtomicBool::new(false),
            callers: OnceLock::new(),
            interest: Mutex::new(()),
            parked: AtomicBool::new(false),
            woken: AtomicBool::new(false),
            waker: LaneWaker::new(me.clone() as Weak<dyn Resume>),
            last_rx,
            epoch_start,
            deaf,
            ended: AtomicBool::new(false),
            closed_cleanly: AtomicBool::new(false),
        }))
    }

    /// Joins the callers' `poll` under `key`, interested in the socket unless a frame is parked.
    pub(super) fn join_callers(&self, poll: &Arc<Poller>, key: usize) -> io::Result<()> {
        let _g = self.interest.lock();
        // SAFETY: the poll keeps the side (and so its stream) alive, and deletes it first.
        unsafe { poll.add_with_mode(&self.stream, self.caller_interest(key), PollMode::Level)? };
        let _ = self.callers.set((poll.clone(), key));
        self.with_callers.store(true, Ordering::Release);
        Ok(())
    }

    fn caller_interest(&self, key: usize) -> Event {
        if self.parked.load(Ordering::Acquire) {
            Event::none(key)
        } else {
            Event::readable(key)
        }
    }

    /// Whether a caller may poll and read this link now.
    pub fn readable_by_caller(&self) -> bool {
        self.caller_mode.load(Ordering::Acquire) && !self.finished()
    }

    /// The connection ended (read to its end, or failed): the peer hears nothing more from here.
    pub(super) fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Nobody will read this link again: it ended, or this side stopped reading.
    pub(super) fn finished(&self) -> bool {
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
    /// `run`, and if reading panics the link ends with an error that says so (its operations
    /// fail naming this peer) instead of the thread vanishing.
    pub fn run_guarded(&self) {
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run())) {
            let why = crate::error::panic_message(&*panic);
            tracing::error!("the reader of rank {}'s link panicked: {why}", self.peer);
            self.end(io::Error::other(format!("internal error (a panic) while reading this link: {why}")));
        }
    }

    pub fn run(&self) {
        let mut events = Events::new();
        loop {
            if self.deaf.load(Ordering::Acquire) || self.ended.load(Ordering::Acquire) {
                return;
            }
            if self.parked.load(Ordering::Acquire) && !self.caller_mode.load(Ordering::Acquire) {
                {
                    let mut g = self.park.lock();
                    if self.parked.load(Ordering::Acquire) && !self.woken.load(Ordering::Acquire) && !self.finished() && !self.caller_mode.load(Ordering::Acquire) {
                        self.unpark.wait_for(&mut g, self.heartbeat);
                    }
                }
                // The peer is not silent: its bytes wait for this rank to read them.
                self.touch();
                let mut rx = self.frame_lock.lock();
                self.read_waiting(&mut rx, None);
                continue;
            }
            if self.caller_mode.load(Ordering::Acquire) {
                {
                    let mut g = self.park.lock();
                    let offer_now = self.parked.load(Ordering::Acquire) && self.woken.load(Ordering::Acquire);
                    if self.caller_mode.load(Ordering::Acquire) && !self.deaf.load(Ordering::Acquire) && !offer_now {
                        self.unpark.wait_for(&mut g, self.heartbeat);
                    }
                }
                if self.parked.load(Ordering::Acquire) {
                    self.touch();
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
    /// A parked frame is offered again first, when it is due; while it stays parked nothing
    /// else is read.
    fn read_waiting(&self, rx: &mut RxBuf, deadline: Option<Instant>) -> bool {
        loop {
            if self.ended.load(Ordering::Acquire) || self.deaf.load(Ordering::Acquire) {
                return false;
            }
            if let Some(parked) = &rx.parked {
                let due = self.woken.swap(false, Ordering::AcqRel) || Instant::now() >= parked.until;
                if !due {
                    return true;
                }
                let (header, relay, in_shm) = (parked.header, parked.relay, parked.in_shm);
                if let Err(e) = self.offer(rx, header, relay, in_shm, deadline) {
                    self.end(e);
                    return false;
                }
                continue;
            }
            if rx.len() < rx.header_len() {
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
        let header_len = rx.header_len();
        while rx.len() < header_len {
            fill(&self.stream, rx, wait)?;
        }
        let on_wire = &rx.data[rx.start..rx.start + header_len];
        let mut raw = [0u8; HEADER_LEN];
        match &mut rx.open {
            None => raw.copy_from_slice(on_wire),
            Some(u) => {
                u.opener.open(on_wire, &mut raw)?;
            }
        }
        rx.start += header_len;
        let mut header = FrameHeader::decode(&raw)?;
        let in_shm = header.kind & SHM_PAYLOAD != 0;
        header.kind &= !SHM_PAYLOAD;
        self.touch();
        let kind = FrameKind::from_u8(header.kind);
        if in_shm && !matches!(kind, Some(FrameKind::Data | FrameKind::P2p)) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("it sent a frame of kind {} through shared memory", header.kind)));
        }
        match kind {
            Some(FrameKind::Heartbeat) if header.nbytes == 0 => return Ok(()),
            // Unread, its payload would be taken for the next header: a frame hidden inside.
            Some(FrameKind::Heartbeat) => {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("it sent a heartbeat carrying {} bytes; heartbeats carry none", header.nbytes)))
            }
            // A subgroup's Close ends that group, not the link.
            Some(FrameKind::Close) if header.group == 0 => self.closed_cleanly.store(true, Ordering::Release),
            Some(FrameKind::Relay) => {
                let (origin, dest, inner) = self.open_envelope(rx, &header, wait)?;
                return self.offer(rx, inner, Some((origin, dest)), false, deadline);
            }
            Some(FrameKind::ShmOffer) => return self.take_shm_offer(rx, &header, wait),
            _ => {}
        }
        self.offer(rx, header, None, in_shm, deadline)
    }

    /// Maps the ring of shared memory the peer offers for this lane's large payloads (see
    /// `shm`). One that cannot be mapped is declined by leaving it unmarked: the peer then keeps
    /// sending over TCP. A sealed lane declines every offer, so nothing it carries bypasses the
    /// encryption.
    fn take_shm_offer(&self, rx: &mut RxBuf, header: &FrameHeader, wait: Wait) -> io::Result<()> {
        if header.nbytes > OFFER_MAX_BYTES {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("it sent a shared-memory offer of {} bytes", header.nbytes)));
        }
        let mut offer = vec![0u8; header.nbytes as usize];
        Payload { rx, stream: &self.stream, wait, left: header.nbytes, side: self }.read_exact(&mut offer)?;
        if rx.open.is_some() || rx.shm.is_some() {
            return Ok(());
        }
        match Inbound::accept(&offer) {
            Ok(ring) => rx.shm = Some(ring),
            Err(e) => tracing::info!(
                peer = self.peer,
                "cannot map the shared memory rank {} offered ({e}; do the two processes see the same /dev/shm?): the link stays on TCP",
                self.peer
            ),
        }
        Ok(())
    }

    /// Reads the header of the frame inside relay envelope `outer`: (sender, rank it is for, header).
    fn open_envelope(&self, rx: &mut RxBuf, outer: &FrameHeader, wait: Wait) -> io::Result<(usize, usize, FrameHeader)> {
        let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        if outer.nbytes < HEADER_LEN as u64 {
            return Err(bad(format!("it sent a relay envelope of {} bytes, shorter than the frame header inside", outer.nbytes)));
        }
        let mut raw = [0u8; HEADER_LEN];
        // Read through the envelope's payload, so a sealed link's records are sized as sent.
        let mut payload = Payload { rx, stream: &self.stream, wait, left: outer.nbytes, side: self };
        payload.read_exact(&mut raw)?;
        let inner = FrameHeader::decode(&raw)?;
        if inner.kind == FrameKind::Relay as u8 || inner.kind & SHM_PAYLOAD != 0 || inner.nbytes != payload.left {
            return Err(bad(format!(
                "it sent a relay envelope of {} bytes around a frame of kind {} and {} bytes",
                outer.nbytes, inner.kind, inner.nbytes
            )));
        }
        let (origin, dest) = outer.relay_ends();
        Ok((origin, dest, inner))
    }

    /// Hands the frame whose header was just read (or that was parked) to the inbox: it is read
    /// whole, or parked (see the module doc).
    /// `relay`: the frame came in a relay envelope (sender, rank it is for); its header was read.
    /// `in_shm`: its payload is in the lane's shared-memory ring, not on the socket.
    fn offer(&self, rx: &mut RxBuf, header: FrameHeader, relay: Option<(usize, usize)>, in_shm: bool, deadline: Option<Instant>) -> io::Result<()> {
        if in_shm {
            return self.offer_from_shm(rx, header);
        }
        let wait = match deadline {
            Some(d) => Wait::Until(d),
            None => Wait::Forever,
        };
        let was_parked = rx.parked.take().is_some();
        let mut payload = Payload { rx, stream: &self.stream, wait, left: header.nbytes, side: self };
        let delivered = match relay {
            None => self.inbox.deliver(self.peer, &header, &mut payload, Some(&self.waker)),
            Some((origin, dest)) => self.inbox.deliver_relayed(self.peer, origin, dest, &header, &mut payload, Some(&self.waker)),
        };
        // Headers and polls must see every byte again.
        set_lowat(&self.stream, payload.rx, 1);
        let left = payload.left;
        if !self.settle(rx, delivered?, left, (header, relay, false), was_parked)? {
            return Ok(());
        }
        if left != 0 {
            // Only a read that failed part-way leaves payload behind: the link went down mid-frame.
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection closed in the middle of a message"));
        }
        Ok(())
    }

    /// `offer` for a frame whose payload is the next one in the lane's ring: read from there,
    /// and its room freed once taken. A parked frame's payload stays where it is, and so does
    /// everything the sender placed after it.
    fn offer_from_shm(&self, rx: &mut RxBuf, header: FrameHeader) -> io::Result<()> {
        let was_parked = rx.parked.take().is_some();
        let ring = rx.shm.as_mut().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "it sent a payload through shared memory it never offered"))?;
        let mut payload = ring.next(header.nbytes)?;
        let delivered = self.inbox.deliver(self.peer, &header, &mut payload, Some(&self.waker))?;
        let (left, end) = (payload.left(), payload.end());
        if !self.settle(rx, delivered, left, (header, None, true), was_parked)? {
            return Ok(());
        }
        if left != 0 {
            return Err(io::Error::other("internal error: a payload in shared memory was taken but not read to its end"));
        }
        rx.shm.as_mut().expect("read from it above").consumed(end);
        Ok(())
    }

    /// What the inbox answered for `frame` (header, relay ends, payload in shared memory), with
    /// `left` of its payload unread: a parked frame is kept, unread, and its lane held back; a
    /// taken one lets a held-back lane go on. Returns whether the frame was taken.
    fn settle(&self, rx: &mut RxBuf, delivered: Delivery, left: u64, frame: (FrameHeader, Option<(usize, usize)>, bool), was_parked: bool) -> io::Result<bool> {
        let (header, relay, in_shm) = frame;
        match delivered {
            Delivery::Parked { until } => {
                if left != header.nbytes {
                    return Err(io::Error::other("internal error: a frame was parked after part of it was read"));
                }
                rx.parked = Some(Parked { header, relay, until, in_shm });
                if !was_parked {
                    self.hold_back(true);
                }
                Ok(false)
            }
            Delivery::Taken => {
                if was_parked {
                    self.hold_back(false);
                }
                Ok(true)
            }
        }
    }

    /// Stops (true) or resumes (false) reading this lane for a parked frame: callers' waits
    /// ignore the socket meanwhile, and the receiver thread sleeps instead of waiting on it.
    fn hold_back(&self, on: bool) {
        {
            let _g = self.interest.lock();
            self.parked.store(on, Ordering::Release);
            if let (Some((poller, key)), true) = (self.callers.get(), self.with_callers.load(Ordering::Acquire)) {
                // An error means the lane already left the poll (it ended): nothing to change.
                let _ = poller.modify_with_mode(&self.stream, self.caller_interest(*key), PollMode::Level);
            }
        }
        if !on {
            // The receiver thread may be asleep for the parked frame: back to the socket.
            self.unpark();
        }
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
    /// A sealed link's receiving keys and record buffers.
    open: Option<Box<Unsealing>>,
    /// The frame the inbox could not take yet (its payload not read at all).
    parked: Option<Parked>,
    /// The ring of shared memory the peer sends this lane's large payloads through (`shm`).
    shm: Option<Inbound>,
}

struct Parked {
    header: FrameHeader,
    /// The frame came in a relay envelope: (sender, rank it is for).
    relay: Option<(usize, usize)>,
    /// When to offer it again even if the lane is not woken.
    until: Instant,
    /// Its payload is in the lane's shared-memory ring.
    in_shm: bool,
}

/// The inbox can take a parked frame now (or it should look again): offer it on the receiver
/// thread, whichever mode the lane is in.
impl Resume for ReadSide {
    fn resume(&self) {
        self.woken.store(true, Ordering::Release);
        self.unpark();
    }
}

/// One record of a sealed link at a time: as read off the wire, then opened.
struct Unsealing {
    opener: Opener,
    wire: Vec<u8>,
    plain: Vec<u8>,
    /// `plain[start..end]` is opened and not yet handed out.
    start: usize,
    end: usize,
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

    /// A frame header's length on the wire.
    fn header_len(&self) -> usize {
        if self.open.is_some() {
            sealed_len(HEADER_LEN)
        } else {
            HEADER_LEN
        }
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

impl Payload<'_> {
    /// Hands out the opened part of the current record, opening the next one when it is used up.
    fn read_sealed(&mut self, u: &mut Unsealing, buf: &mut [u8]) -> io::Result<usize> {
        if u.start == u.end {
            let wire = sealed_len((self.left as usize).min(RECORD_MAX));
            let mut got = 0;
            while got < wire {
                if self.rx.len() > 0 {
                    let n = (wire - got).min(self.rx.len());
                    u.wire[got..got + n].copy_from_slice(&self.rx.data[self.rx.start..self.rx.start + n]);
                    self.rx.start += n;
                    got += n;
                    continue;
                }
                if wire - got >= RX_BUF / 2 {
                    if matches!(self.wait, Wait::Forever) {
                        // As for plain payloads: the rest of this record is on its way.
                        set_lowat(self.stream, self.rx, ((wire - got) / 2).min(LOWAT));
                    }
                    got += recv_some(self.stream, &mut u.wire[got..wire], self.wait)?;
                } else {
                    set_lowat(self.stream, self.rx, 1);
                    fill(self.stream, self.rx, self.wait)?;
                }
                self.side.touch();
            }
            u.end = u.opener.open(&u.wire[..wire], &mut u.plain)?;
            u.start = 0;
        }
        let n = buf.len().min(u.end - u.start);
        buf[..n].copy_from_slice(&u.plain[u.start..u.start + n]);
        u.start += n;
        self.left -= n as u64;
        Ok(n)
    }
}

impl Read for Payload<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 || buf.is_empty() {
            return Ok(0);
        }
        if let Some(mut u) = self.rx.open.take() {
            let n = self.read_sealed(&mut u, buf);
            self.rx.open = Some(u);
            return n;
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

/// Helpers for the tests of the reader and of the waits.
#[cfg(test)]
pub(super) mod testing {
    use super::*;

    /// Hands each payload it reads to the test.
    pub(super) struct Collect(pub(super) crossbeam_channel::Sender<Vec<u8>>);

    impl Inbox for Collect {
        fn deliver(&self, _peer: usize, h: &FrameHeader, payload: &mut dyn Read, _lane: Option<&LaneWaker>) -> io::Result<Delivery> {
            let mut v = vec![0u8; h.nbytes as usize];
            payload.read_exact(&mut v)?;
            let _ = self.0.send(v);
            Ok(Delivery::Taken)
        }
        fn link_down(&self, _peer: usize, _error: io::Error, _clean: bool) {}
    }

    pub(in crate::net) fn side_for(stream: TcpStream, peer: usize, sink: crossbeam_channel::Sender<Vec<u8>>) -> Arc<ReadSide> {
        let deaf = Arc::new(AtomicBool::new(false));
        ReadSide::new(peer, stream, Arc::new(Collect(sink)), Duration::from_secs(1), Arc::new(AtomicU64::new(0)), Instant::now(), deaf, None).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::testing::Collect;
    use std::io::Write;
    use std::net::TcpListener;

    /// A large payload that arrives in two parts, the second shorter than the receive
    /// low-water mark and followed by nothing: the receiver must wake for it.
    #[test]
    fn a_payload_whose_tail_comes_late_is_read_to_its_end() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx_stream, _) = listener.accept().unwrap();
        let (got_tx, got) = crossbeam_channel::unbounded();
        let deaf = Arc::new(AtomicBool::new(false));
        let side =
            ReadSide::new(1, rx_stream, Arc::new(Collect(got_tx)), Duration::from_secs(1), Arc::new(AtomicU64::new(0)), Instant::now(), deaf.clone(), None)
                .unwrap();
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
    /// What a lane's reader makes of shared-memory frames it cannot take: an offer naming no
    /// region is declined and the lane goes on over TCP; a payload announced in a ring that was
    /// never offered ends the link with an error that says so.
    #[test]
    fn shared_memory_a_lane_cannot_take_is_declined_or_named() {
        struct Seen(crossbeam_channel::Sender<Result<Vec<u8>, String>>);
        impl Inbox for Seen {
            fn deliver(&self, _peer: usize, h: &FrameHeader, payload: &mut dyn Read, _lane: Option<&LaneWaker>) -> io::Result<Delivery> {
                let mut v = vec![0u8; h.nbytes as usize];
                payload.read_exact(&mut v)?;
                let _ = self.0.send(Ok(v));
                Ok(Delivery::Taken)
            }
            fn link_down(&self, _peer: usize, error: io::Error, _clean: bool) {
                let _ = self.0.send(Err(error.to_string()));
            }
        }
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx_stream, _) = listener.accept().unwrap();
        let (seen_tx, seen) = crossbeam_channel::unbounded();
        let deaf = Arc::new(AtomicBool::new(false));
        let side = ReadSide::new(1, rx_stream, Arc::new(Seen(seen_tx)), Duration::from_secs(1), Arc::new(AtomicU64::new(0)), Instant::now(), deaf, None).unwrap();
        let runner = side.clone();
        let thread = std::thread::spawn(move || runner.run());
        let mut offer = 4096u64.to_le_bytes().to_vec();
        offer.extend_from_slice(&[9u8; 16]);
        offer.extend_from_slice(b"plait-00000000deadbeef");
        let frame = |kind: u8, payload: &[u8]| {
            let mut v = FrameHeader { kind, nbytes: payload.len() as u64, ..Default::default() }.encode().to_vec();
            v.extend_from_slice(payload);
            v
        };
        tx.write_all(&frame(FrameKind::ShmOffer as u8, &offer)).unwrap();
        tx.write_all(&frame(FrameKind::P2p as u8, b"hello")).unwrap();
        assert_eq!(seen.recv_timeout(Duration::from_secs(3)).unwrap(), Ok(b"hello".to_vec()));
        let header = FrameHeader { kind: FrameKind::P2p as u8 | SHM_PAYLOAD, nbytes: 100_000, ..Default::default() };
        tx.write_all(&header.encode()).unwrap();
        let err = seen.recv_timeout(Duration::from_secs(3)).unwrap().unwrap_err();
        assert!(err.contains("never offered"), "{err}");
        thread.join().unwrap();
    }
}
