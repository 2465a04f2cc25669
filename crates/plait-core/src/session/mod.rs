//! The live mesh that every operation of a communicator shares: the links to the peers, the
//! mailbox that matches arriving frames with posted receives, incoming-frame routing and control
//! frames (`demux`), who is to blame when something fails (`blame`), the one-way switch that
//! marks the communicator failed, and the buffer pool.
//!
//! Data flows one way: a link's reader (`net`) hands each frame to the `Demux`, which answers
//! control frames and passes data to the `Mailbox`, which lands it in the memory an operation
//! (`exec`) posted and reports an `Event` to that operation. Operations go down through
//! `Session`: they send on its links and post receives in its mailbox.

mod blame;
mod demux;
pub(crate) mod groups;
pub(crate) mod landing;
pub(crate) mod mailbox;
pub(crate) mod pool;
mod stash;
#[cfg(test)]
mod fuzz_tests;

pub(crate) use demux::Demux;
pub(crate) use groups::{group_id, Groups};
pub(crate) use landing::{Keep, Landing, Part};
pub(crate) use mailbox::{describe_header, Expect, Mailbox, Posted, DEFAULT_UNEXPECTED_BYTES, MIN_UNEXPECTED_BYTES};
pub(crate) use pool::BufferPool;

use crate::error::{PlaitError, Result};
use crate::net::frame::{AbortReason, FrameHeader, FrameKind, REASON_MAX_BYTES};
use crate::net::peer::{CallerPoll, PeerLink, SendBuf, SendReq};
use crossbeam_channel::Sender;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a closing communicator waits for its peers to read what it sent and close too.
const LINGER: Duration = Duration::from_millis(500);

/// Completion of one transfer, reported to the operation that started it.
pub(crate) struct Event {
    pub token: u32,
    pub result: Result<()>,
    /// The peer the transfer was with.
    pub source: usize,
    /// When it completed (a receive: when its message had landed).
    pub at: Instant,
}

pub(crate) struct Session {
    pub rank: usize,
    pub size: usize,
    /// 0 for the session that owns the links; a subgroup's id (see `groups`) for one that
    /// shares them. Every frame this session sends carries it.
    pub group: u64,
    /// Filled by `attach_link` (a subgroup: the owner's links to its members, by group rank).
    pub(crate) links: Vec<Option<Arc<PeerLink>>>,
    /// Who reads the links, shared by the owner and its subgroups (the links are the same).
    reading: Arc<Reading>,
    /// The owner's subgroups (a subgroup holds its owner's, to leave it when it closes).
    pub(crate) groups: Arc<Groups>,
    pub mailbox: Arc<Mailbox>,
    broken: Mutex<Option<PlaitError>>,
    /// How long an operation whose caller reads the links polls them, yielding its core between
    /// polls, before it blocks (`PLAIT_BUSY_POLL_US`; see `exec::wait::next_event`).
    pub busy_poll: Duration,
    next_op_id: AtomicU64,
    p2p_send_next: Mutex<HashMap<(usize, u64), u32>>,
}

/// Whether threads waiting for operations read the links themselves (see `net::reader`).
struct Reading {
    /// Every link's lanes, for threads that read the links themselves (`progress`).
    callers: CallerPoll,
    on: AtomicBool,
    /// Every link of the owner: the switch applies to all of them.
    links: Mutex<Vec<Arc<PeerLink>>>,
    /// Held while the links are switched, so two threads switching at once cannot leave the
    /// links disagreeing with `on`.
    switch: Mutex<()>,
    /// Threads waiting on their links' receiver threads, told when those stop reading.
    watchers: Mutex<Vec<(u64, Sender<()>)>>,
    next_watcher: AtomicU64,
    /// Asynchronous operations started on these links (by any group) and not yet ended.
    in_background: Arc<AtomicUsize>,
}

/// An asynchronous operation counted in flight on its session's links until this is dropped.
pub(crate) struct InBackground(Arc<AtomicUsize>);

impl Drop for InBackground {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Told when the links' receiver threads stop reading (callers read them from then on), so a
/// thread waiting on their reports starts reading itself at once. Removed when dropped.
pub(crate) struct SwitchWatch<'a> {
    reading: &'a Reading,
    id: u64,
    pub switched: crossbeam_channel::Receiver<()>,
}

impl Drop for SwitchWatch<'_> {
    fn drop(&mut self) {
        self.reading.watchers.lock().retain(|(id, _)| *id != self.id);
    }
}

impl Session {
    /// The session that owns the links (attached with `attach_link`).
    pub fn new(rank: usize, size: usize, mailbox: Arc<Mailbox>, groups: Arc<Groups>) -> std::io::Result<Session> {
        let reading = Reading {
            callers: CallerPoll::new()?,
            on: AtomicBool::new(false),
            links: Mutex::new(Vec::new()),
            switch: Mutex::new(()),
            watchers: Mutex::new(Vec::new()),
            next_watcher: AtomicU64::new(0),
            in_background: Arc::new(AtomicUsize::new(0)),
        };
        Ok(Session::with(rank, size, 0, (0..size).map(|_| None).collect(), Arc::new(reading), groups, mailbox))
    }

    /// The owner session of a mesh grown from `prev` (elastic mode, members added at the end):
    /// `prev`'s links keep their ranks, and its mailbox, readers and subgroups carry on; the new
    /// ranks' links are attached with `attach_link`. `prev` must never be used again.
    pub fn grown(prev: &Session, size: usize) -> Session {
        // Relayed links are chosen afresh: their relay may be gone, or a connection possible now.
        let mut links: Vec<_> = prev.links.iter().map(|l| l.clone().filter(|l| !l.is_relayed())).collect();
        links.resize(size, None);
        let mut s = Session::with(prev.rank, size, 0, links, prev.reading.clone(), prev.groups.clone(), prev.mailbox.clone());
        s.busy_poll = prev.busy_poll;
        s
    }

    /// A subgroup of `owner` on its links: `ranks[g]` is the owner rank of group rank `g`.
    pub fn subgroup(owner: &Session, group: u64, ranks: &[usize], mailbox: Arc<Mailbox>) -> Session {
        let links = ranks.iter().map(|&r| owner.links[r].clone()).collect();
        let rank = ranks.iter().position(|&r| r == owner.rank).expect("a subgroup of which this rank is a member");
        let mut s = Session::with(rank, ranks.len(), group, links, owner.reading.clone(), owner.groups.clone(), mailbox);
        s.busy_poll = owner.busy_poll;
        s
    }

    fn with(rank: usize, size: usize, group: u64, links: Vec<Option<Arc<PeerLink>>>, reading: Arc<Reading>, groups: Arc<Groups>, mailbox: Arc<Mailbox>) -> Session {
        Session {
            rank,
            size,
            group,
            links,
            reading,
            groups,
            mailbox,
            broken: Mutex::new(None),
            busy_poll: Duration::ZERO,
            next_op_id: AtomicU64::new(1),
            p2p_send_next: Mutex::new(HashMap::new()),
        }
    }

    fn owns_links(&self) -> bool {
        self.group == 0
    }

    /// Takes the started link to `peer` into the communicator.
    pub fn attach_link(&mut self, peer: usize, link: Arc<PeerLink>) -> std::io::Result<()> {
        // Kept first, so that a failure below still has the link shut down with the others.
        self.links[peer] = Some(link.clone());
        let _switching = self.reading.switch.lock();
        self.reading.links.lock().push(link.clone());
        // A grown mesh's links may already be read by callers: a new one follows them.
        if self.reading.on.load(Ordering::Acquire) {
            link.set_caller_mode(true);
        }
        link.join_caller_poll(&self.reading.callers)
    }

    /// Takes a link to `peer` that goes through another rank (`PeerLink::relayed`): it has no
    /// lanes to read; its frames arrive on the relay's link.
    pub fn attach_relayed(&mut self, peer: usize, link: Arc<PeerLink>) {
        debug_assert!(link.is_relayed());
        self.links[peer] = Some(link);
    }

    /// The peers this rank reaches over connections of its own.
    pub fn direct_peers(&self) -> Vec<usize> {
        (0..self.size).filter(|&p| self.links[p].as_ref().is_some_and(|l| !l.is_relayed())).collect()
    }

    /// Adds lanes to the running link to `peer`, read as its other lanes are.
    pub fn add_lanes(&self, peer: usize, streams: Vec<crate::net::auth::LinkStream>) -> std::io::Result<()> {
        let _switching = self.reading.switch.lock();
        let on = self.reading.on.load(Ordering::Acquire);
        self.link(peer).add_lanes(streams, on, &self.reading.callers)
    }

    pub fn link(&self, peer: usize) -> &PeerLink {
        self.links[peer].as_deref().expect("no link to self")
    }

    /// Queues a frame of `len` bytes at `src` for `peer`. Once it is written (or the link has
    /// failed) an `Event` with `token` goes to `events`; `owned` (a bundle's payload that `src`
    /// points into) is kept alive until then.
    #[allow(clippy::too_many_arguments)]
    pub fn send_frame(&self, peer: usize, mut header: FrameHeader, src: *const u8, len: usize, owned: Option<Vec<u8>>, what: Arc<str>, token: u32, events: Sender<Event>) {
        let addr = self.peer_addr(peer);
        header.group = self.group;
        self.link(peer).send(SendReq {
            header,
            data: SendBuf { ptr: src, len },
            done: Some(Box::new(move |r| {
                drop(owned);
                let result = r.map_err(|e| PlaitError::Peer {
                    op: what.to_string(),
                    peer,
                    addr,
                    what: format!("could not be sent to: {e}"),
                    waited: Duration::ZERO,
                });
                let _ = events.send(Event { token, result, source: peer, at: Instant::now() });
            })),
        });
    }

    /// Tells every peer that this rank refused collective `seq` and why (at most
    /// `REASON_MAX_BYTES` of it).
    pub fn send_refusal(&self, seq: u64, reason: &str) {
        let mut text = reason.as_bytes().to_vec();
        text.truncate(REASON_MAX_BYTES);
        for link in self.links.iter().flatten() {
            let header = FrameHeader { kind: FrameKind::Refuse as u8, seq, group: self.group, ..Default::default() };
            link.send_owned(header, text.clone());
        }
    }

    pub fn peer_addr(&self, peer: usize) -> String {
        self.links.get(peer).and_then(|l| l.as_ref()).map(|l| l.addr.clone()).unwrap_or_default()
    }

    /// Small operations: the thread that waits for one reads the links itself, one thread
    /// wake-up per message instead of two. Anything else: the links' receiver threads read.
    pub fn set_caller_progress(&self, on: bool) {
        let r = &*self.reading;
        if r.on.load(Ordering::Acquire) == on {
            return;
        }
        let _switching = r.switch.lock();
        self.switch_reading(on);
    }

    /// Sets who reads the links; the caller holds `reading.switch`.
    fn switch_reading(&self, on: bool) {
        let r = &*self.reading;
        if r.on.swap(on, Ordering::AcqRel) != on {
            for link in r.links.lock().iter() {
                link.set_caller_mode(on);
            }
            if on {
                for (_, w) in r.watchers.lock().iter() {
                    let _ = w.try_send(());
                }
            }
        }
    }

    /// Starts watching for the switch to caller reading (see `SwitchWatch`). Check
    /// `caller_progress` again after this: a switch just before it is not reported.
    pub fn watch_switch(&self) -> SwitchWatch<'_> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let id = self.reading.next_watcher.fetch_add(1, Ordering::Relaxed);
        self.reading.watchers.lock().push((id, tx));
        SwitchWatch { reading: &self.reading, id, switched: rx }
    }

    /// Starts an asynchronous operation on these links: it counts as in flight until the guard
    /// is dropped. The worker running it reads the links itself only when it `may_read` (a small
    /// collective) and no other asynchronous operation, of any group sharing these links, is in
    /// flight; otherwise the links' receiver threads read. Counted, decided and switched under
    /// one lock, so an operation started at the same time on another thread cannot slip between
    /// the decision and the switch.
    pub fn start_in_background(&self, may_read: bool) -> InBackground {
        let r = &*self.reading;
        let _switching = r.switch.lock();
        let alone = r.in_background.fetch_add(1, Ordering::SeqCst) == 0;
        self.switch_reading(may_read && alone);
        InBackground(r.in_background.clone())
    }

    pub fn caller_progress(&self) -> bool {
        self.reading.on.load(Ordering::Acquire)
    }

    /// Reads, on this thread, frames that arrive within `wait` (see `set_caller_progress`;
    /// a zero `wait` reads what is there now). Returns whether any link had something.
    pub fn progress(&self, wait: Duration, frame_deadline: Instant) -> bool {
        self.reading.callers.progress(wait, frame_deadline)
    }

    pub fn op_id(&self) -> u64 {
        self.next_op_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn p2p_ordinal(&self, peer: usize, tag: u64) -> u32 {
        let mut m = self.p2p_send_next.lock();
        let next = m.entry((peer, tag)).or_insert(0);
        let o = *next;
        *next += 1;
        o
    }

    pub fn broken(&self) -> Option<PlaitError> {
        self.broken.lock().clone()
    }

    /// Marks the communicator failed with `err` (the first failure wins), tells the peers why,
    /// and shuts every link so that every blocked read and write returns. Returns the error the
    /// communicator failed with.
    pub fn fail(&self, err: PlaitError, tell_peers: bool) -> PlaitError {
        let reason = tell_peers.then(|| AbortReason::of(self.rank, &err));
        self.fail_with(err, reason)
    }

    /// Like `fail`, telling the peers `reason` (which may name another rank as the reporter).
    pub fn fail_with(&self, err: PlaitError, reason: Option<AbortReason>) -> PlaitError {
        self.end(err, reason, false)
    }

    /// Ends the session at a clean close, as `fail` does (every link shut, later calls refused
    /// with `err`), telling the peers nothing and logging it as the normal end it is, not as a
    /// failure (unless the session had already failed).
    pub fn close(&self, err: PlaitError) -> PlaitError {
        self.end(err, None, true)
    }

    fn end(&self, err: PlaitError, reason: Option<AbortReason>, closing: bool) -> PlaitError {
        {
            let mut b = self.broken.lock();
            if let Some(first) = b.as_ref() {
                return first.clone();
            }
            *b = Some(err.clone());
        }
        if closing {
            tracing::debug!(rank = self.rank, group = self.group, "communicator closed");
        } else {
            tracing::warn!(rank = self.rank, group = self.group, "communicator failed: {err}");
        }
        self.mailbox.fail(&err);
        if !self.owns_links() {
            // The links stay up for the owner and the other groups; the peers' copies of this
            // group fail on the Abort (or time out on their own).
            if let Some(reason) = reason {
                self.broadcast_control(FrameKind::Abort, reason.encode(), Duration::from_secs(1));
            }
            return err;
        }
        self.groups.fail_all(&err);
        if closing && reason.is_none() {
            // A goodbye: every peer reads what was sent to it before it sees the end (see
            // `PeerLink::linger`); the peers close on their side meanwhile, or soon after.
            let deadline = Instant::now() + LINGER;
            for link in self.links.iter().flatten() {
                link.linger(deadline);
            }
        }
        // Stop reading first: our receivers return, while the peers still get the reason
        // before they see the connection close (and so blame the right rank).
        for link in self.links.iter().flatten() {
            link.stop_reading();
        }
        if let Some(reason) = reason {
            self.broadcast_control(FrameKind::Abort, reason.encode(), Duration::from_secs(1));
        }
        for link in self.links.iter().flatten() {
            link.shutdown();
        }
        err
    }

    /// Shuts every link this session uses, even a subgroup's (which are its owner's, so the owner
    /// fails too). The last resort of an operation whose transfers outlived its failure: a link
    /// thread blocked on a socket (a frozen peer) lets go of the operation's memory only when the
    /// socket is shut.
    pub fn shut_links(&self) {
        for link in self.links.iter().flatten() {
            link.shutdown();
        }
    }

    /// Sends a control frame to every peer ahead of queued data and waits (bounded) until
    /// the frames are written, so that peers learn the reason before they see the socket close.
    pub fn broadcast_control(&self, kind: FrameKind, text: String, grace: Duration) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut sent = 0;
        for link in self.links.iter().flatten() {
            let tx = tx.clone();
            link.send_urgent(kind, self.group, text.clone().into_bytes(), Some(Box::new(move |r| {
                let _ = tx.send(r.is_ok());
            })));
            sent += 1;
        }
        let deadline = Instant::now() + grace;
        for _ in 0..sent {
            if rx.recv_deadline(deadline).is_err() {
                break;
            }
        }
    }

    /// Peers that have sent nothing (not even a heartbeat) for longer than `quiet`.
    pub fn silent_peers(&self, quiet: Duration) -> Vec<(usize, Duration)> {
        self.links
            .iter()
            .enumerate()
            .filter_map(|(p, l)| l.as_ref().map(|l| (p, l.silent_for())))
            .filter(|(_, d)| *d > quiet)
            .collect()
    }

    /// Joins the threads of the links (the owner only: a subgroup's links are the owner's).
    pub fn join_links(&self) {
        if !self.owns_links() {
            return;
        }
        for link in self.links.iter().flatten() {
            link.join();
        }
    }
}
