//! A connected peer: per connection, one sender thread that writes frames from a queue and one
//! receiver thread that reads frames and hands each to an [`Inbox`]. Neither knows about
//! collectives.
//!
//! Why threads per peer: every link carries traffic at once (a full mesh uses all cables), and a
//! blocked write to one slow peer must never stall another.

use super::auth::LinkStream;
use super::frame::{FrameHeader, FrameKind, HEADER_LEN, SHM_PAYLOAD};
use super::reader::ReadSide;
use super::seal::{Sealer, RECORD_MAX};
use super::shm::Outbound;
pub use super::wait::CallerPoll;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Mutex, RwLock};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Payloads up to this size are copied next to their header and written with one syscall:
/// one packet for small messages instead of two. They always go on the socket, even to a rank of
/// this host (`shm`): that one write is all they cost.
pub const EAGER_MAX: usize = 64 * 1024;

/// Receives what a peer sends: implemented by the session's `Demux`, which routes each frame.
pub trait Inbox: Send + Sync {
    /// Must consume exactly `header.nbytes` bytes from `payload` (or fail), or none of them and
    /// answer `Parked` (only when `lane` is given): see `Delivery`.
    fn deliver(&self, peer: usize, header: &FrameHeader, payload: &mut dyn Read, lane: Option<&LaneWaker>) -> io::Result<Delivery>;
    /// A frame inside a relay envelope (`FrameKind::Relay`) that rank `origin` sent to rank `dest`
    /// and the lane's peer `via` passed on; `header` is the frame's own, and `payload` holds its
    /// payload (the envelope's header and the frame's were read). As `deliver` otherwise.
    fn deliver_relayed(&self, via: usize, origin: usize, dest: usize, header: &FrameHeader, payload: &mut dyn Read, lane: Option<&LaneWaker>) -> io::Result<Delivery> {
        let _ = (origin, dest, header, payload, lane);
        Err(io::Error::new(io::ErrorKind::InvalidData, format!("rank {via} sent a relayed frame, which this link does not take")))
    }
    /// The link to `peer` ended: `clean` when the peer said Close first.
    fn link_down(&self, peer: usize, error: io::Error, clean: bool);
}

/// What became of a frame handed to an [`Inbox`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Read whole: landed, held, or dropped.
    Taken,
    /// Not read at all: nothing can take it now and holding it would go over what the inbox may
    /// hold for this peer. The lane reads nothing more (its bytes wait in the socket, so TCP
    /// holds the sender back) and offers the same frame again when its `LaneWaker` is woken, or
    /// at `until`, when the inbox decides whether it has waited too long.
    Parked { until: Instant },
}

/// Something that stops reading and can be told to look again (a lane's reader; tests' fakes).
pub trait Resume: Send + Sync {
    fn resume(&self);
}

/// Tells a lane that parked a frame to offer it again (a receive was posted, or room freed).
/// Holds the lane weakly: waking a lane that has ended does nothing.
#[derive(Clone)]
pub struct LaneWaker(Weak<dyn Resume>);

impl LaneWaker {
    pub fn new(lane: Weak<dyn Resume>) -> LaneWaker {
        LaneWaker(lane)
    }

    pub fn wake(&self) {
        if let Some(lane) = self.0.upgrade() {
            lane.resume();
        }
    }

    /// Whether both wake the same lane.
    pub fn same(&self, other: &LaneWaker) -> bool {
        Weak::ptr_eq(&self.0, &other.0)
    }
}

/// Memory the sender thread reads from. The submitter keeps it alive until `done` is called.
pub struct SendBuf {
    pub ptr: *const u8,
    pub len: usize,
}
// SAFETY: the executor guarantees the memory outlives the send (it waits for every completion,
// success or failure, before it returns to the caller).
unsafe impl Send for SendBuf {}

pub type SendDone = Box<dyn FnOnce(io::Result<()>) + Send>;

pub struct SendReq {
    pub header: FrameHeader,
    pub data: SendBuf,
    pub done: Option<SendDone>,
}

/// Every submitter hears back exactly once: a request dropped unsent (a closed queue, a sender
/// thread that died) reports failure, so no operation waits for a frame nobody will write.
impl Drop for SendReq {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            done(Err(io::Error::new(io::ErrorKind::BrokenPipe, "the frame was never sent: the link's sender stopped")));
        }
    }
}

/// Every connection to one peer. With several lanes (`PLAIT_STREAMS`), large payloads are
/// spread over them in turn, each lane with its own sender and receiver thread, so a link that
/// one TCP stream cannot fill (a long fat pipe, a per-flow limit) gets several; small frames
/// all take lane 0. Nothing relies on order across lanes: the mailbox matches frames by what
/// their headers say, and control frames (Abort, Close) go on every lane so that each lane's
/// reader hears them before it sees that lane close.
pub struct PeerLink {
    pub addr: String,
    peer: usize,
    inbox: Arc<dyn Inbox>,
    heartbeat: Duration,
    /// Grows (never shrinks) when start-up adds lanes to a link one stream cannot fill.
    lanes: RwLock<Vec<Lane>>,
    /// Which lane the next large payload takes.
    next_lane: AtomicUsize,
    epoch_start: Instant,
    /// Set when this side stops reading on purpose: the receivers exit without reporting.
    deaf: Arc<AtomicBool>,
    closing: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Set for a peer this rank has no connection to: the link has no lanes, and its frames go
    /// through another rank (see `PeerLink::relayed`).
    relay: Option<Relayed>,
    /// `keep_receiver_threads`.
    receiver_threads_only: AtomicBool,
}

/// Where a relayed link's frames go: inside relay envelopes, over the link to a rank that
/// reaches both ends. Chosen once, after start-up has measured the links (`set_via`).
struct Relayed {
    me: usize,
    via: OnceLock<(usize, Arc<PeerLink>)>,
}

/// One TCP connection to the peer.
struct Lane {
    stream: TcpStream,
    /// The writing end, shared by the sender thread and callers that write small frames
    /// themselves when the lane is idle (one thread hand-off less per small message).
    writer: Arc<Mutex<Writer>>,
    queue: Sender<SendReq>,
    urgent: Sender<SendReq>,
    /// Nanoseconds since `epoch_start` when the last byte arrived on this lane.
    last_rx: Arc<AtomicU64>,
    read: Arc<ReadSide>,
    /// Wakes an idle sender thread at shutdown, which would otherwise sleep on until its next
    /// heartbeat check (up to 50 ms that a closing session waits out when it joins the thread).
    wake_sender: Sender<()>,
}

impl PeerLink {
    /// Starts the threads of every lane; `streams[i]` is lane i.
    pub fn start(
        peer: usize,
        addr: String,
        streams: Vec<LinkStream>,
        inbox: Arc<dyn Inbox>,
        heartbeat: Duration,
    ) -> io::Result<Arc<PeerLink>> {
        assert!(!streams.is_empty(), "a peer link needs at least one connection");
        let link = Arc::new(PeerLink {
            addr,
            peer,
            inbox,
            heartbeat,
            lanes: RwLock::new(Vec::with_capacity(streams.len())),
            next_lane: AtomicUsize::new(0),
            epoch_start: Instant::now(),
            deaf: Arc::new(AtomicBool::new(false)),
            closing: Arc::new(AtomicBool::new(false)),
            threads: Mutex::new(Vec::new()),
            relay: None,
            receiver_threads_only: AtomicBool::new(false),
        });
        link.start_lanes(streams)?;
        Ok(link)
    }

    /// The link from rank `me` to a `peer` it cannot connect to (a firewall, NAT, no cable): every
    /// frame goes whole inside a relay envelope (`FrameKind::Relay`) over the link to the rank
    /// `set_via` names, always on that link's first connection, so the frames of a relayed link
    /// keep their order end to end (a Close never overtakes data). Frames sent before the relay
    /// is set fail. The link has no threads of its own: reading, heartbeats and shutting down are
    /// the relay link's.
    pub fn relayed(peer: usize, me: usize, addr: String, inbox: Arc<dyn Inbox>, heartbeat: Duration) -> Arc<PeerLink> {
        Arc::new(PeerLink {
            addr,
            peer,
            inbox,
            heartbeat,
            lanes: RwLock::new(Vec::new()),
            next_lane: AtomicUsize::new(0),
            epoch_start: Instant::now(),
            deaf: Arc::new(AtomicBool::new(false)),
            closing: Arc::new(AtomicBool::new(false)),
            threads: Mutex::new(Vec::new()),
            relay: Some(Relayed { me, via: OnceLock::new() }),
            receiver_threads_only: AtomicBool::new(false),
        })
    }

    /// Whether this link goes through another rank (`relayed`).
    pub fn is_relayed(&self) -> bool {
        self.relay.is_some()
    }

    /// The rank a relayed link goes through, once chosen.
    pub fn via(&self) -> Option<usize> {
        self.relay.as_ref()?.via.get().map(|v| v.0)
    }

    /// Sends this relayed link's frames over `link`, the link to rank `rank`. Once only.
    pub fn set_via(&self, rank: usize, link: Arc<PeerLink>) {
        let relay = self.relay.as_ref().expect("only a relayed link has a relay");
        assert!(!link.is_relayed(), "a relay is reached directly");
        let _ = relay.via.set((rank, link));
    }

    /// Starts more lanes on a running link (start-up found one TCP stream cannot fill it). The
    /// peer adds the same lanes at the same time; the new lanes carry large payloads from the
    /// next frame on. `caller_mode` and `poll`: as the link's other lanes are read (see
    /// `Session::add_lanes`).
    pub fn add_lanes(&self, streams: Vec<LinkStream>, caller_mode: bool, poll: &CallerPoll) -> io::Result<()> {
        for read in self.start_lanes(streams)? {
            if caller_mode {
                read.set_caller_mode(true);
            }
            poll.add(&read)?;
        }
        Ok(())
    }

    fn start_lanes(&self, streams: Vec<LinkStream>) -> io::Result<Vec<Arc<ReadSide>>> {
        let mut started = Vec::with_capacity(streams.len());
        let mut threads = Vec::new();
        let first = self.lanes.read().len();
        for (k, LinkStream { stream, cipher }) in streams.into_iter().enumerate() {
            let i = first + k;
            let (seal, open) = cipher.map(|c| (c.seal, c.open)).unzip();
            let (queue, queue_rx) = crossbeam_channel::unbounded();
            let (urgent, urgent_rx) = crossbeam_channel::unbounded();
            let (wake_sender, wake_rx) = crossbeam_channel::bounded(1);
            // A lane starts as heard from now, not at the link's start.
            let last_rx = Arc::new(AtomicU64::new(self.epoch_start.elapsed().as_nanos() as u64));
            let writer = Arc::new(Mutex::new(Writer {
                stream: stream.try_clone()?,
                scratch: Vec::with_capacity(HEADER_LEN + EAGER_MAX),
                last_tx: Instant::now(),
                failed: None,
                seal,
                shm: None,
                closing: self.closing.clone(),
                read: Weak::new(),
            }));
            let read = ReadSide::new(
                self.peer,
                stream.try_clone()?,
                self.inbox.clone(),
                self.heartbeat,
                last_rx.clone(),
                self.epoch_start,
                self.deaf.clone(),
                open,
            )?;
            writer.lock().read = Arc::downgrade(&read);
            let (w, c, heartbeat) = (writer.clone(), self.closing.clone(), self.heartbeat);
            let suffix = if i == 0 { String::new() } else { format!(".{i}") };
            threads.push(
                std::thread::Builder::new()
                    .name(format!("plait-send-{}{suffix}", self.peer))
                    .spawn(move || send_loop_guarded(w, queue_rx, urgent_rx, wake_rx, heartbeat, c))?,
            );
            let r = read.clone();
            threads.push(std::thread::Builder::new().name(format!("plait-recv-{}{suffix}", self.peer)).spawn(move || r.run_guarded())?);
            started.push(read.clone());
            self.lanes.write().push(Lane { stream, writer, queue, urgent, last_rx, read, wake_sender });
        }
        self.threads.lock().extend(threads);
        Ok(started)
    }

    /// Offers the peer, a rank of this host, a ring of `capacity` bytes of shared memory for the
    /// large payloads of the link's first connection (see `shm`). The connection uses it once the
    /// peer has mapped it; a sealed link, or a system without shared memory, stays on TCP.
    pub fn offer_shm(&self, capacity: usize) {
        let lanes = self.lanes.read();
        let Some(lane) = lanes.first() else { return };
        let mut w = lane.writer.lock();
        if w.seal.is_some() || w.shm.is_some() || w.failed.is_some() {
            return;
        }
        let (ring, offer) = match Outbound::create(capacity) {
            Ok(made) => made,
            Err(e) => {
                tracing::info!(peer = self.peer, "no {capacity}-byte ring of shared memory for the link to rank {} (it stays on TCP): {e}", self.peer);
                return;
            }
        };
        let req = SendReq {
            header: FrameHeader { kind: FrameKind::ShmOffer as u8, nbytes: offer.len() as u64, ..Default::default() },
            data: SendBuf { ptr: offer.as_ptr(), len: offer.len() },
            done: None,
        };
        match w.write(&req) {
            Ok(()) => w.shm = Some(ring),
            Err(e) => tracing::info!(peer = self.peer, "could not offer shared memory to rank {}: {e}", self.peer),
        }
    }

    /// Once the peer has answered a probe sent after `offer_shm`: drops a ring it did not take (its
    /// name goes with it, so nothing is left in /dev/shm), and says how many connections carry
    /// payloads through shared memory (0 or 1).
    pub fn settle_shm(&self) -> usize {
        let lanes = self.lanes.read();
        let Some(lane) = lanes.first() else { return 0 };
        let mut w = lane.writer.lock();
        match w.shm.as_mut().map(|r| r.accepted()) {
            Some(true) => 1,
            Some(false) => {
                w.shm = None;
                0
            }
            None => 0,
        }
    }

    /// Connections to the peer (a relayed link counts as one: its frames take one connection).
    pub fn lanes(&self) -> usize {
        self.lanes.read().len().max(1)
    }

    /// Sizes every lane's socket buffers for a link of `bdp_bytes` in flight (see
    /// `tuning::fit_buffers_to_bdp`); returns the size set, if any.
    pub fn fit_buffers_to_bdp(&self, bdp_bytes: usize) -> Option<usize> {
        let lanes = self.lanes.read();
        if lanes.is_empty() {
            return None;
        }
        let per_lane = bdp_bytes.div_ceil(lanes.len());
        let mut set = None;
        for lane in lanes.iter() {
            set = super::tuning::fit_buffers_to_bdp(&lane.stream, per_lane);
        }
        set
    }

    /// Queues a frame. `done` runs once it is written (or failed): on this thread when the
    /// frame is small and its lane idle, else on that lane's sender thread.
    pub fn send(&self, req: SendReq) {
        self.send_on(req)
    }

    /// Sends on the first connection, behind every frame sent so before it (`relayed`): always
    /// through the queue, which a frame written by its caller could overtake. `urgent`: ahead of
    /// queued frames, as `send_urgent` does (for an Abort, whose order does not matter).
    pub fn send_in_order(&self, req: SendReq, urgent: bool) {
        if let Some(relay) = &self.relay {
            return self.send_relayed(relay, req, urgent);
        }
        let lanes = self.lanes.read();
        let queue = if urgent { &lanes[0].urgent } else { &lanes[0].queue };
        if let Err(e) = queue.send(req) {
            drop(lanes);
            drop(e.into_inner()); // reports the failure to its submitter
        }
    }

    fn send_on(&self, req: SendReq) {
        if let Some(relay) = &self.relay {
            return self.send_relayed(relay, req, false);
        }
        let small = req.data.len <= EAGER_MAX;
        // `done` runs with the lanes unlocked: it may send again.
        let (result, req) = {
            let lanes = self.lanes.read();
            let lane = if small || lanes.len() == 1 {
                &lanes[0]
            } else {
                &lanes[self.next_lane.fetch_add(1, Ordering::Relaxed) % lanes.len()]
            };
            let written = (small && lane.queue.is_empty() && lane.urgent.is_empty())
                .then(|| lane.writer.try_lock().map(|mut w| w.write(&req)))
                .flatten();
            match written {
                Some(result) => (result, req),
                None => match lane.queue.send(req) {
                    Ok(()) => return,
                    Err(e) => (Err(io::Error::new(io::ErrorKind::BrokenPipe, "link is closed")), e.into_inner()),
                },
            }
        };
        let mut req = req;
        if let Some(done) = req.done.take() {
            done(result);
        }
    }

    /// `req` inside a relay envelope, over the relay's first connection (see `relayed`). The frame
    /// is copied, so the caller's memory is free once this returns.
    fn send_relayed(&self, relay: &Relayed, mut req: SendReq, urgent: bool) {
        let done = req.done.take();
        let Some((_, via)) = relay.via.get() else {
            if let Some(done) = done {
                done(Err(io::Error::new(io::ErrorKind::NotConnected, "no rank to relay through has been chosen for it yet")));
            }
            return;
        };
        let mut inner = Vec::with_capacity(HEADER_LEN + req.data.len);
        inner.extend_from_slice(&req.header.encode());
        inner.extend_from_slice(payload_of(&req));
        let header = FrameHeader::relay(relay.me, self.peer, req.data.len as u64);
        let data = SendBuf { ptr: inner.as_ptr(), len: inner.len() };
        via.send_in_order(
            SendReq {
                header,
                data,
                done: Some(Box::new(move |r| {
                    drop(inner);
                    if let Some(done) = done {
                        done(r);
                    }
                })),
            },
            urgent,
        );
    }

    /// Sends a frame whose payload the link owns (no caller memory to keep alive).
    pub fn send_owned(&self, mut header: FrameHeader, payload: Vec<u8>) {
        header.nbytes = payload.len() as u64;
        let data = SendBuf { ptr: payload.as_ptr(), len: payload.len() };
        self.send(SendReq { header, data, done: Some(Box::new(move |_| drop(payload))) });
    }

    /// Sends a control frame (Abort, Close) of `group` on every lane ahead of queued data, at the
    /// next frame boundary. `done` runs once, when every lane has written it (or failed to).
    pub fn send_urgent(&self, kind: FrameKind, group: u64, payload: Vec<u8>, done: Option<SendDone>) {
        let header = FrameHeader { kind: kind as u8, nbytes: payload.len() as u64, group, ..Default::default() };
        if self.is_relayed() {
            let data = SendBuf { ptr: payload.as_ptr(), len: payload.len() };
            let done: SendDone = Box::new(move |r| {
                drop(payload);
                if let Some(done) = done {
                    done(r);
                }
            });
            // A Close keeps its place behind the data, as on the peer's own lanes.
            return self.send_in_order(SendReq { header, data, done: Some(done) }, kind == FrameKind::Abort);
        }
        // The payload lives until the last lane has written it; the first error is reported.
        struct Fanout {
            payload: Vec<u8>,
            lanes_left: usize,
            first_error: Option<io::Error>,
            done: Option<SendDone>,
        }
        let lanes = self.lanes.read();
        let fanout = Arc::new(Mutex::new(Fanout { payload, lanes_left: lanes.len(), first_error: None, done }));
        let data = {
            let f = fanout.lock();
            SendBuf { ptr: f.payload.as_ptr(), len: f.payload.len() }
        };
        for lane in lanes.iter() {
            let fanout = fanout.clone();
            let on_written: SendDone = Box::new(move |r: io::Result<()>| {
                let mut f = fanout.lock();
                if let Err(e) = r {
                    f.first_error.get_or_insert(e);
                }
                f.lanes_left -= 1;
                if f.lanes_left == 0 {
                    let result = f.first_error.take().map_or(Ok(()), Err);
                    if let Some(done) = f.done.take() {
                        drop(f);
                        done(result);
                    }
                }
            });
            let data = SendBuf { ptr: data.ptr, len: data.len };
            let _ = lane.urgent.send(SendReq { header, data, done: Some(on_written) });
        }
    }

    /// Whether every lane of this link has ended (read to its end, or failed).
    pub fn ended(&self) -> bool {
        self.lanes.read().iter().all(|l| l.read.finished())
    }

    /// Time since anything (data or heartbeat) arrived on the most silent lane to this peer.
    pub fn silent_for(&self) -> Duration {
        if let Some(relay) = &self.relay {
            // It has no lanes to hear on: as silent as the link its frames come over.
            return relay.via.get().map_or(Duration::ZERO, |v| v.1.silent_for());
        }
        let now = self.epoch_start.elapsed();
        let last = self.lanes.read().iter().map(|l| l.last_rx.load(Ordering::Relaxed)).min().unwrap_or(0);
        now.saturating_sub(Duration::from_nanos(last))
    }

    /// Stops reading (a blocked read returns at once) without telling the peer anything, so
    /// control frames queued for it can still go out before the connection closes.
    pub fn stop_reading(&self) {
        self.deaf.store(true, Ordering::SeqCst);
        for lane in self.lanes.read().iter() {
            let _ = lane.stream.shutdown(Shutdown::Read);
            lane.read.wake();
        }
    }

    /// Registers every lane with the poll that threads waiting for small operations use.
    pub fn join_caller_poll(&self, poll: &CallerPoll) -> io::Result<()> {
        self.lanes.read().iter().try_for_each(|lane| poll.add(&lane.read))
    }

    /// Lets the thread waiting for a small operation read this link itself (see `reader`);
    /// never for a link kept with its receiver threads (`keep_receiver_threads`).
    pub fn set_caller_mode(&self, on: bool) {
        let on = on && !self.receiver_threads_only.load(Ordering::Acquire);
        for lane in self.lanes.read().iter() {
            lane.read.set_caller_mode(on);
        }
    }

    /// Reads this link on its receiver threads from now on, whatever `set_caller_mode` says: a
    /// relay passes frames on as they come, not when one of its own operations waits.
    pub fn keep_receiver_threads(&self) {
        self.receiver_threads_only.store(true, Ordering::Release);
        self.set_caller_mode(false);
    }

    /// The graceful end of a link: waits (until `deadline`) for queued frames to be written, ends
    /// this side's writing (the peer reads everything sent, then the end of the stream), and lets
    /// the receivers read on until the peer closes too. A socket closed with bytes unread is
    /// reset, and a reset destroys what the peer had not read yet: data a late peer left in its
    /// socket (flow control parks it there) would be lost. Returns once every lane's receiver has
    /// seen the end, or at `deadline`.
    pub fn linger(&self, deadline: Instant) {
        for lane in self.lanes.read().iter() {
            while !(lane.queue.is_empty() && lane.urgent.is_empty()) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            // Not in the middle of a frame: the writer is held while the side closes.
            let _w = lane.writer.lock();
            let _ = lane.stream.shutdown(Shutdown::Write);
        }
        while Instant::now() < deadline {
            let receiving = self.threads.lock().iter().any(|t| !t.is_finished() && t.thread().name().is_some_and(|n| n.starts_with("plait-recv")));
            if !receiving {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Ends both directions now: blocked reads and writes return at once.
    pub fn shutdown(&self) {
        self.deaf.store(true, Ordering::SeqCst);
        self.closing.store(true, Ordering::SeqCst);
        for lane in self.lanes.read().iter() {
            let _ = lane.stream.shutdown(Shutdown::Both);
            lane.read.wake();
            let _ = lane.wake_sender.try_send(());
        }
    }

    /// Shuts the sockets down and joins every thread.
    pub fn join(&self) {
        self.shutdown();
        let threads: Vec<_> = self.threads.lock().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

struct Writer {
    stream: TcpStream,
    scratch: Vec<u8>,
    last_tx: Instant,
    failed: Option<io::ErrorKind>,
    /// `PLAIT_ENCRYPT`: this lane's sending keys.
    seal: Option<Sealer>,
    /// The lane's shared-memory ring, once offered (`PeerLink::offer_shm`).
    shm: Option<Outbound>,
    /// The link's shutdown flag and this lane's reader: a wait for room in the ring ends when
    /// either says the link is over.
    closing: Arc<AtomicBool>,
    read: Weak<ReadSide>,
}

impl Writer {
    fn write(&mut self, req: &SendReq) -> io::Result<()> {
        let kind = req.header.kind;
        let through_shm = req.data.len > EAGER_MAX
            && (kind == FrameKind::Data as u8 || kind == FrameKind::P2p as u8)
            && self.shm.as_mut().is_some_and(|ring| ring.takes(req.data.len));
        let result = match (self.failed, &mut self.seal, &mut self.shm) {
            (Some(kind), _, _) => Err(io::Error::new(kind, "link failed earlier")),
            (None, None, Some(ring)) if through_shm => {
                let (closing, read) = (&self.closing, &self.read);
                ring.put(payload_of(req), || link_over(closing, read)).and_then(|()| {
                    let mut header = req.header;
                    header.kind |= SHM_PAYLOAD;
                    self.stream.write_all(&header.encode())
                })
            }
            (None, None, _) => write_frame(&mut self.stream, req, &mut self.scratch),
            (None, Some(seal), _) => write_sealed(&mut self.stream, req, &mut self.scratch, seal),
        };
        if let Err(e) = &result {
            self.failed.get_or_insert(e.kind());
        }
        self.last_tx = Instant::now();
        result
    }
}

/// Why a sender waiting for room in its ring should stop: the link is shutting down, or the
/// lane's reader saw the connection end (the peer is gone and will free nothing).
fn link_over(closing: &AtomicBool, read: &Weak<ReadSide>) -> Option<io::Error> {
    if closing.load(Ordering::Acquire) {
        return Some(io::Error::new(io::ErrorKind::BrokenPipe, "link is shut down"));
    }
    match read.upgrade() {
        Some(r) if !r.ended() => None,
        _ => Some(io::Error::new(io::ErrorKind::BrokenPipe, "the connection ended while this rank waited for room in the shared memory")),
    }
}

/// `send_loop`, and if it panics the lane fails instead of going quiet: the socket is shut (the
/// peer and this side's reader see the link end) and every queued frame reports failure.
fn send_loop_guarded(
    writer: Arc<Mutex<Writer>>,
    queue: Receiver<SendReq>,
    urgent: Receiver<SendReq>,
    wake: Receiver<()>,
    heartbeat: Duration,
    closing: Arc<AtomicBool>,
) {
    let w = writer.clone();
    if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| send_loop(writer, queue, urgent, wake, heartbeat, closing))) {
        let mut w = w.lock();
        tracing::error!("a link's sender thread panicked: {}", crate::error::panic_message(&*panic));
        w.failed = Some(io::ErrorKind::BrokenPipe);
        let _ = w.stream.shutdown(std::net::Shutdown::Both);
    }
}

fn send_loop(
    writer: Arc<Mutex<Writer>>,
    queue: Receiver<SendReq>,
    urgent: Receiver<SendReq>,
    wake: Receiver<()>,
    heartbeat: Duration,
    closing: Arc<AtomicBool>,
) {
    loop {
        if closing.load(Ordering::SeqCst) {
            // Every submitter must hear back, even after shutdown.
            for mut req in urgent.try_iter().chain(queue.try_iter()) {
                if let Some(done) = req.done.take() {
                    done(Err(io::Error::new(io::ErrorKind::BrokenPipe, "link is shut down")));
                }
            }
            return;
        }
        let req = match urgent.try_recv() {
            Ok(r) => r,
            Err(_) => {
                let idle = writer.lock().last_tx.elapsed();
                let wait = heartbeat.saturating_sub(idle).clamp(Duration::from_millis(1), Duration::from_millis(50));
                crossbeam_channel::select! {
                    recv(urgent) -> r => match r { Ok(r) => r, Err(_) => return },
                    recv(queue) -> r => match r { Ok(r) => r, Err(_) => return },
                    recv(wake) -> _ => continue,
                    default(wait) => {
                        let mut w = writer.lock();
                        if w.failed.is_none() && w.last_tx.elapsed() >= heartbeat {
                            let hb = SendReq {
                                header: FrameHeader { kind: FrameKind::Heartbeat as u8, ..Default::default() },
                                data: SendBuf { ptr: std::ptr::null(), len: 0 },
                                done: None,
                            };
                            let _ = w.write(&hb);
                        }
                        continue;
                    }
                }
            }
        };
        let mut req = req;
        let result = writer.lock().write(&req);
        if let Some(done) = req.done.take() {
            done(result);
        }
    }
}

fn write_frame(w: &mut impl Write, req: &SendReq, scratch: &mut Vec<u8>) -> io::Result<()> {
    let header = req.header.encode();
    let payload = payload_of(req);
    if payload.len() <= EAGER_MAX {
        scratch.clear();
        scratch.extend_from_slice(&header);
        scratch.extend_from_slice(payload);
        w.write_all(scratch)
    } else {
        w.write_all(&header)?;
        w.write_all(payload)
    }
}

/// The frame sealed (see `seal`), written a few records at a time.
pub(super) fn write_sealed(w: &mut impl Write, req: &SendReq, scratch: &mut Vec<u8>, seal: &mut Sealer) -> io::Result<()> {
    /// Sealed bytes gathered per write: small frames go out whole in one write.
    const BATCH: usize = 256 * 1024;
    scratch.clear();
    seal.seal(&req.header.encode(), scratch)?;
    for record in payload_of(req).chunks(RECORD_MAX) {
        seal.seal(record, scratch)?;
        if scratch.len() >= BATCH {
            w.write_all(scratch)?;
            scratch.clear();
        }
    }
    // The batch stays allocated (at most BATCH + one record per lane), as the eager copy does.
    if scratch.is_empty() {
        Ok(())
    } else {
        w.write_all(scratch)
    }
}

fn payload_of(req: &SendReq) -> &[u8] {
    // SAFETY: see SendBuf.
    if req.data.len == 0 {
        &[]
    } else {
        unsafe { std::slice::from_raw_parts(req.data.ptr, req.data.len) }
    }
}
