//! Matches frames arriving from peers with the receives operations have posted.
//!
//! A frame whose receive is already posted is read straight into its destination (no copy); one
//! that arrives early is stashed and copied when its receive is posted. Every posted receive
//! produces exactly one completion event: from the receiver thread, from `fail`, or not at all
//! when its operation cancels it (and then knows it).
//!
//! Flow control. Early frames are held up to a budget per peer (`PLAIT_UNEXPECTED_BYTES`). A
//! frame that would go over it is parked, not refused: its lane stops reading (the payload waits
//! in the socket, or in the lane's shared-memory ring, and the sender stops, see `net::reader`)
//! until its receive is posted (then
//! it lands in place, never copied) or room frees (stashed frames of that peer taken, or the
//! call they belong to ended). A frame parked for the timeout (`PLAIT_TIMEOUT`) with neither
//! fails the link, naming the peer, the frame, the bytes held and both settings. Every budget
//! change that could let a parked frame go on wakes its lane; waking too often costs only a look.
//!
//! Why parking cannot hold back what the current call needs: a lane carries a sender's frames in
//! the order it issued them, and a blocking call ends on the sender only once all its sends are
//! written, so every frame of call c is ahead of every frame of call c+1 on every lane. A parked
//! frame of a later call therefore only holds back later calls' frames. Within one call, a rank
//! posts the receives of a segment's step k+1 only after its step k is done, and the sender sends
//! step k+1 of that segment only after its own step k is done, so the frames ahead of a parked one
//! on its lane are ones already posted or held. Where this ordering does not hold, parking can
//! hold back a frame the current call needs: asynchronous calls run at once by workers (their
//! frames interleave on a lane), a point-to-point program that needs a later message before it
//! posts the receive of an earlier one (the classic "unsafe" MPI pattern, past the budget), or an
//! any-source receive behind a parked message of another tag. Then the waiting call times out,
//! or the parked frame does, each with an error naming the peer; nothing waits forever. Below the
//! budget nothing changes: every such program that ran before still runs.

use super::landing::Landing;
use super::pool::BufferPool;
use super::stash::{Stash, Stashed};
use super::Event;
use crate::codec::Wire;
use crate::dtype::DType;
use crate::error::PlaitError;
use crate::net::frame::{
    CallId, FrameHeader, FrameKind, PIECE_TAGS, PIECE_TAG_LIMIT, PONG_TAG, PROBE_AGAIN_TAG, PROBE_FRAME_BYTES, PROBE_GO_TAG, PROBE_TAG, RESERVED_TAGS,
};
use crate::net::peer::{Delivery, LaneWaker};
use crossbeam_channel::Sender;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{self, Read};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// (peer, frame kind, seq or tag, step, segment, ordinal)
pub type Key = (usize, u8, u64, u32, u32, u32);

/// What the receiving side expects the frame to say; any difference is a mismatch.
#[derive(Clone, Debug)]
pub struct Expect {
    /// The call (its `seq` is already part of the key the frame matched).
    pub call: CallId,
    pub count: u64,
    pub nbytes: u64,
    /// "allreduce #12 (f32, sum, 1000 elements)": for error messages.
    pub what: Arc<str>,
}

pub struct Posted {
    pub landing: Landing,
    /// Bytes at the destination (decoded).
    pub len: usize,
    /// How the payload is encoded on the wire (`expect.nbytes` is its size there).
    pub wire: Wire,
    pub expect: Expect,
    pub op_id: u64,
    pub token: u32,
    pub events: Sender<Event>,
    /// Set once the event is sent (or the receive withdrawn); see `Drop`.
    pub reported: bool,
}
// SAFETY: the pointers refer to buffers the posting operation keeps alive until it has received
// this receive's completion event or cancelled it.
unsafe impl Send for Posted {}

impl Posted {
    /// Completes this receive: the one event its operation waits for.
    pub fn report(self, result: Result<(), PlaitError>, source: usize) {
        self.report_at(result, source, Instant::now())
    }

    /// `report`, for a message that had landed (in the stash) at `at`.
    fn report_at(mut self, result: Result<(), PlaitError>, source: usize, at: Instant) {
        self.reported = true;
        let _ = self.events.send(Event { token: self.token, result, source, at });
    }

    /// Forgets this receive without an event: its operation withdrew it and counts that itself.
    fn withdrawn(mut self) {
        self.reported = true;
    }
}

/// Every posted receive reports exactly once: one dropped any other way (a panic while its
/// message was landed, on a link's thread or the caller's) reports failure, so its operation
/// does not wait for it forever.
impl Drop for Posted {
    fn drop(&mut self) {
        if !self.reported {
            let err = PlaitError::Internal(format!("{}: a receive ended without completing (a panic while its message was landed)", self.expect.what));
            let _ = self.events.send(Event { token: self.token, result: Err(err), source: usize::MAX, at: Instant::now() });
        }
    }
}

#[derive(Default)]
struct Inner {
    posted: HashMap<Key, Posted>,
    stash: Stash,
    /// Receives from any source, by tag, oldest first.
    any_source: HashMap<u64, Vec<Posted>>,
    /// Next point-to-point ordinal to hand out per (peer, tag).
    p2p_next: HashMap<(usize, u64), u32>,
    broken: Option<PlaitError>,
    /// Peers that closed normally: receives from them fail once nothing stashed can serve them.
    closed: HashMap<usize, PlaitError>,
    /// Collective sequence numbers this rank has completed: every one below `finished_below`,
    /// and those in `finished_above`. A frame for one of them means the ranks disagree.
    finished_below: u64,
    finished_above: std::collections::HashSet<u64>,
    /// Collectives some rank refused (by seq): (that rank, its reason). Receives posted for
    /// them fail with `Refused`, so this rank's part of the call ends instead of waiting.
    refused: HashMap<u64, (usize, String)>,
    /// Collectives this rank ended because of a refusal (its own or a peer's): frames of them
    /// still on their way from the ranks that went ahead are dropped, not a disagreement.
    dropped: std::collections::HashSet<u64>,
    /// Frames left unread on their lane until they can be taken (see the module doc); at most
    /// one per lane. Kept until the frame is taken, so a frame offered again keeps its `since`.
    parked: HashMap<Key, ParkedFrame>,
}

struct ParkedFrame {
    header: FrameHeader,
    /// When it was first parked: the timeout counts from here.
    since: Instant,
    lane: LaneWaker,
}

impl Inner {
    fn is_finished(&self, seq: u64) -> bool {
        seq < self.finished_below || self.finished_above.contains(&seq)
    }

    /// Wakes the lanes of parked frames that `which` selects, to offer them again.
    fn wake_parked(&self, which: impl Fn(&Key) -> bool) {
        if self.parked.is_empty() {
            return;
        }
        for (_, p) in self.parked.iter().filter(|(k, _)| which(k)) {
            p.lane.wake();
        }
    }

    /// Room in `peer`'s budget came back: its parked frames may fit now.
    fn room_freed(&self, peer: usize) {
        self.wake_parked(|k| k.0 == peer);
    }
}

/// No host buffer is larger than this: a frame that claims more is not a message, whatever is
/// posted (so it is refused at once rather than parked).
const FRAME_MAX_BYTES: u64 = isize::MAX as u64;

/// Messages that arrive before their receive is posted are held in memory, up to this many
/// bytes per peer. Early collective data rarely exceeds the largest buffer in flight; a
/// point-to-point send posted long before its receive is held whole.
pub const DEFAULT_UNEXPECTED_BYTES: u64 = 1 << 30;
/// The smallest budget accepted (`PLAIT_UNEXPECTED_BYTES`).
pub const MIN_UNEXPECTED_BYTES: u64 = 1 << 20;

pub struct Mailbox {
    inner: Mutex<Inner>,
    /// Buffers for early frames, shared with the executor's snapshots and scratch.
    pub pool: BufferPool,
    /// Bytes of early frames held per peer (`PLAIT_UNEXPECTED_BYTES`): a frame that would go over
    /// is parked on its lane, unread.
    budget: u64,
    /// How long a frame may stay parked with no receive posted for it (`PLAIT_TIMEOUT`).
    park_timeout: Duration,
}

impl Default for Mailbox {
    fn default() -> Self {
        Mailbox::with_limits(DEFAULT_UNEXPECTED_BYTES, Duration::from_secs(300))
    }
}

impl Mailbox {
    #[cfg(test)]
    pub fn new() -> Self {
        Self::default()
    }

    /// `budget`: bytes of early frames held per peer; `park_timeout`: how long a frame over it
    /// may wait for its receive.
    pub fn with_limits(budget: u64, park_timeout: Duration) -> Self {
        Mailbox { inner: Mutex::default(), pool: BufferPool::default(), budget, park_timeout }
    }

    /// Posts a receive, or completes it at once from a stashed frame (on this thread).
    pub fn post(&self, key: Key, p: Posted) {
        let stashed = {
            let mut inner = self.inner.lock();
            if let Some(err) = &inner.broken {
                let err = err.clone();
                drop(inner);
                p.report(Err(err), key.0);
                return;
            }
            if let Some((peer, reason)) = inner.refused.get(&key.2).filter(|_| key.1 == FrameKind::Data as u8) {
                let err = PlaitError::Refused { op: p.expect.what.to_string(), peer: *peer, reason: reason.clone() };
                drop(inner);
                p.report(Err(err), key.0);
                return;
            }
            match inner.stash.remove(&key) {
                Some(s) => {
                    inner.room_freed(key.0);
                    s
                }
                None => {
                    if let Some(err) = inner.closed.get(&key.0).cloned() {
                        drop(inner);
                        p.report(Err(err), key.0);
                        return;
                    }
                    inner.posted.insert(key, p);
                    inner.wake_parked(|k| *k == key);
                    return;
                }
            }
        };
        let result = land_from_memory(key.0, &stashed.header, &stashed.data, &p);
        self.pool.give(stashed.data);
        p.report_at(result, key.0, stashed.arrived);
    }

    /// Posts a point-to-point receive from `src` (or any source when `None`) with `tag`; returns
    /// the ordinal it takes (None for any source: it takes the next message of whoever sends).
    pub fn post_p2p(&self, src: Option<usize>, tag: u64, p: Posted) -> Option<u32> {
        let mut inner = self.inner.lock();
        let kind = FrameKind::P2p as u8;
        let Some(peer) = src else {
            if let Some(err) = inner.broken.clone() {
                drop(inner);
                p.report(Err(err), 0);
                return None;
            }
            // Behind any-source receives already waiting: they take stashed messages first.
            inner.any_source.entry(tag).or_default().push(p);
            let ready = next_in_line_for_any_source(&mut inner, tag);
            // A parked message of this tag may be the next in line of its sender.
            inner.wake_parked(|k| k.1 == kind && k.2 == tag);
            drop(inner);
            self.land_stashed(ready);
            return None;
        };
        let next = inner.p2p_next.entry((peer, tag)).or_insert(0);
        let ordinal = *next;
        *next += 1;
        self.post_keyed(inner, (peer, kind, tag, 0, 0, ordinal), p);
        Some(ordinal)
    }

    /// Posts a receive for the message from `peer` with `tag` and `ordinal` exactly (the pieces
    /// of a message after its first, see `exec::p2p::pieces`): it takes no ordinal in turn.
    pub fn post_p2p_at(&self, peer: usize, tag: u64, ordinal: u32, p: Posted) {
        self.post_keyed(self.inner.lock(), (peer, FrameKind::P2p as u8, tag, 0, 0, ordinal), p);
    }

    /// Lands the stashed message `key` in `p`, or posts `p` for it (fails it on a broken mailbox).
    fn post_keyed(&self, mut inner: parking_lot::MutexGuard<'_, Inner>, key: Key, p: Posted) {
        let peer = key.0;
        if let Some(err) = inner.broken.clone() {
            drop(inner);
            p.report(Err(err), peer);
            return;
        }
        match inner.stash.remove(&key) {
            Some(s) => {
                inner.room_freed(peer);
                drop(inner);
                let result = land_from_memory(peer, &s.header, &s.data, &p);
                self.pool.give(s.data);
                p.report_at(result, peer, s.arrived);
            }
            None => {
                if let Some(err) = inner.closed.get(&peer).cloned() {
                    drop(inner);
                    p.report(Err(err), peer);
                    return;
                }
                inner.posted.insert(key, p);
                inner.wake_parked(|k| *k == key);
            }
        }
    }

    /// `peer` closed its communicator: what it sent before still counts, nothing more will come.
    pub fn peer_closed(&self, peer: usize, err: &PlaitError) {
        let failed: Vec<Posted> = {
            let mut inner = self.inner.lock();
            inner.closed.insert(peer, err.clone());
            let keys: Vec<Key> = inner.posted.keys().filter(|k| k.0 == peer).copied().collect();
            keys.into_iter().filter_map(|k| inner.posted.remove(&k)).collect()
        };
        for p in failed {
            p.report(Err(err.clone()), peer);
        }
    }

    /// Frames held for receives not yet posted (for tests).
    #[cfg(test)]
    pub fn stashed_len(&self) -> usize {
        self.inner.lock().stash.len()
    }

    /// Bytes counted against every peer's budget (for tests).
    #[cfg(test)]
    pub fn held_total(&self) -> u64 {
        self.inner.lock().stash.held_total()
    }

    /// Receives posted and not yet taken by a frame (for tests of withdrawal).
    #[cfg(test)]
    pub fn posted_len(&self) -> usize {
        let inner = self.inner.lock();
        inner.posted.len() + inner.any_source.values().map(Vec::len).sum::<usize>()
    }

    /// Removes the receives `op_id` posted that no frame has taken yet; returns how many.
    pub fn cancel(&self, op_id: u64) -> usize {
        let mut inner = self.inner.lock();
        let keys: Vec<Key> = inner.posted.iter().filter(|(_, p)| p.op_id == op_id).map(|(k, _)| *k).collect();
        let mut removed = 0;
        for k in keys {
            if let Some(p) = inner.posted.remove(&k) {
                p.withdrawn();
                removed += 1;
            }
        }
        for list in inner.any_source.values_mut() {
            let (mine, others): (Vec<Posted>, Vec<Posted>) = std::mem::take(list).into_iter().partition(|p| p.op_id == op_id);
            *list = others;
            removed += mine.len();
            mine.into_iter().for_each(Posted::withdrawn);
        }
        removed
    }

    /// Starts the call numbering over, for the next epoch's mesh grown from this one (elastic
    /// mode): its calls count from 1 again. Only while nothing is held, posted or parked: any
    /// frame here now could be taken for one of the new epoch's calls. The peers send none of
    /// those before this rank publishes its record, which it does after this.
    pub fn restart(&self) -> Result<(), PlaitError> {
        let mut inner = self.inner.lock();
        if let Some(e) = &inner.broken {
            return Err(e.clone());
        }
        if !inner.posted.is_empty() || !inner.stash.is_empty() || !inner.parked.is_empty() || !inner.any_source.is_empty() {
            return Err(PlaitError::Internal("the last epoch's mesh still holds frames or receives: it cannot carry on into the next".into()));
        }
        inner.finished_below = 0;
        inner.finished_above.clear();
        inner.refused.clear();
        inner.dropped.clear();
        inner.p2p_next.clear();
        Ok(())
    }

    /// Fails every posted receive and refuses new ones.
    pub fn fail(&self, err: &PlaitError) {
        let (posted, any): (Vec<_>, Vec<_>) = {
            let mut inner = self.inner.lock();
            if inner.broken.is_none() {
                inner.broken = Some(err.clone());
            }
            inner.stash.clear();
            // Offered again, they are read and dropped (nothing will receive them).
            inner.wake_parked(|_| true);
            inner.parked.clear();
            (inner.posted.drain().collect(), inner.any_source.drain().flat_map(|(_, v)| v).collect())
        };
        for (key, p) in posted {
            p.report(Err(err.clone()), key.0);
        }
        for p in any {
            p.report(Err(err.clone()), 0);
        }
    }

    /// `peer` refused collective `seq`: this rank's receives for it fail now or when posted.
    /// (Nothing changes for a call this rank has already finished.)
    pub fn refused_by(&self, peer: usize, seq: u64, reason: String) {
        let failed: Vec<(Key, Posted)> = {
            let mut inner = self.inner.lock();
            if inner.is_finished(seq) || inner.broken.is_some() {
                return;
            }
            inner.refused.entry(seq).or_insert((peer, reason.clone()));
            let data = FrameKind::Data as u8;
            let keys: Vec<Key> = inner.posted.keys().filter(|k| k.1 == data && k.2 == seq).copied().collect();
            keys.into_iter().filter_map(|k| inner.posted.remove(&k).map(|p| (k, p))).collect()
        };
        for (key, p) in failed {
            let err = PlaitError::Refused { op: p.expect.what.to_string(), peer, reason: reason.clone() };
            p.report(Err(err), key.0);
        }
    }

    /// Ends collective `seq` on this rank because a rank refused it (this one, or a peer): its
    /// early frames are dropped, and so are those still on their way.
    pub fn finish_refused(&self, seq: u64) {
        // Marked first: a parked frame of the call that `finish` wakes is then dropped quietly.
        self.inner.lock().dropped.insert(seq);
        self.finish(seq);
    }

    /// Marks collective `seq` complete on this rank. Returns a frame of it that arrived but was
    /// never asked for: the ranks disagreed about the call (root, counts, algorithm).
    pub fn finish(&self, seq: u64) -> Option<(usize, FrameHeader)> {
        let mut inner = self.inner.lock();
        inner.refused.remove(&seq);
        if inner.finished_below == 0 {
            inner.finished_below = 1;
        }
        inner.finished_above.insert(seq);
        loop {
            let next = inner.finished_below;
            if !inner.finished_above.remove(&next) {
                break;
            }
            inner.finished_below += 1;
        }
        let data = FrameKind::Data as u8;
        let stray = inner.stash.remove_call(data, seq);
        for (k, _) in &stray {
            inner.room_freed(k.0);
        }
        // A parked frame of the call is a stray too; offered again, it is dropped or named late.
        let parked = inner.parked.iter().find(|(k, _)| k.1 == data && k.2 == seq).map(|(k, p)| (k.0, p.header));
        inner.wake_parked(|k| k.1 == data && k.2 == seq);
        drop(inner);
        let first = stray.first().map(|(k, s)| (k.0, s.header)).or(parked);
        for (_, s) in stray {
            self.pool.give(s.data);
        }
        first
    }

    /// Called by the reader of a lane of `peer` for a Data or P2p frame. With `lane`, a frame
    /// that can neither be taken nor held now is parked (nothing read); without, it is refused.
    pub fn deliver(&self, peer: usize, h: &FrameHeader, payload: &mut dyn Read, lane: Option<&LaneWaker>) -> io::Result<Delivery> {
        let key: Key = if h.kind == FrameKind::P2p as u8 {
            (peer, h.kind, h.seq, 0, 0, h.ordinal)
        } else {
            (peer, h.kind, h.seq, h.step, h.segment, h.ordinal)
        };
        let mut inner = self.inner.lock();
        // A frame of a call this rank has finished: Some(whether a refusal ended that call).
        let late = (h.kind == FrameKind::Data as u8 && inner.is_finished(h.seq)).then(|| inner.dropped.contains(&h.seq));
        if late.is_some() || inner.broken.is_some() {
            // Nothing will receive it: read and dropped (a late one is a disagreement).
            inner.parked.remove(&key);
            drop(inner);
            io::copy(payload, &mut io::sink())?;
            return match late {
                Some(false) => Err(late_frame(h)),
                _ => Ok(Delivery::Taken),
            };
        }
        if let Some(p) = take_locked(&mut inner, peer, key) {
            inner.parked.remove(&key);
            drop(inner);
            return self.land_posted(peer, key, h, payload, p);
        }
        refuse_hostile(h)?;
        // Not posted yet: claim room in this peer's budget (before a byte is allocated or
        // read), read without holding the lock, then look again before stashing.
        let held = inner.stash.held(peer);
        if h.nbytes > self.budget.saturating_sub(held) {
            return match lane {
                Some(lane) => self.park(&mut inner, key, h, held, lane),
                None => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: over the {} bytes allowed per peer (PLAIT_UNEXPECTED_BYTES)", early(h, held), self.budget),
                )),
            };
        }
        inner.parked.remove(&key);
        inner.stash.reserve(peer, h.nbytes);
        drop(inner);
        let mut data = self.pool.take(h.nbytes as usize);
        let read = payload.read_exact(&mut data);
        let mut inner = self.inner.lock();
        inner.stash.release(peer, h.nbytes);
        if let Err(e) = read {
            inner.room_freed(peer);
            return Err(e);
        }
        if inner.broken.is_some() {
            return Ok(Delivery::Taken);
        }
        if let Some(p) = take_locked(&mut inner, peer, key) {
            inner.room_freed(peer);
            drop(inner);
            let result = land_from_memory(peer, h, &data, &p);
            self.pool.give(data);
            p.report(result, peer);
            if h.kind == FrameKind::P2p as u8 {
                self.hand_on_overtaken(h.seq);
            }
        } else if h.kind == FrameKind::Data as u8 && inner.is_finished(h.seq) {
            // The call ended while this frame was read (a refusal): it would be held for good.
            let dropped = inner.dropped.contains(&h.seq);
            inner.room_freed(peer);
            drop(inner);
            self.pool.give(data);
            if !dropped {
                return Err(late_frame(h));
            }
        } else {
            inner.stash.insert(key, Stashed { header: *h, data, arrived: Instant::now() });
        }
        Ok(Delivery::Taken)
    }

    /// Reads `h`'s payload into the receive `p` posted for it.
    fn land_posted(&self, peer: usize, key: Key, h: &FrameHeader, payload: &mut dyn Read, p: Posted) -> io::Result<Delivery> {
        match land_from_stream(peer, h, payload, &p) {
            Ok(result) => {
                p.report(result, peer);
                if h.kind == FrameKind::P2p as u8 {
                    self.hand_on_overtaken(h.seq);
                }
                Ok(Delivery::Taken)
            }
            Err(io_err) => {
                // The link broke mid-message: let the link failure, which names the cause,
                // complete this receive.
                let mut inner = self.inner.lock();
                match inner.broken.clone() {
                    Some(err) => {
                        drop(inner);
                        p.report(Err(err), peer);
                    }
                    None => {
                        inner.posted.insert(key, p);
                    }
                }
                Err(io_err)
            }
        }
    }

    /// Leaves `h` unread on its lane until its receive is posted or room frees (`lane` is woken
    /// then), or fails it once it has waited `park_timeout` for that.
    fn park(&self, inner: &mut Inner, key: Key, h: &FrameHeader, held: u64, lane: &LaneWaker) -> io::Result<Delivery> {
        let now = Instant::now();
        let since = inner.parked.get(&key).map_or(now, |p| p.since);
        if now.saturating_duration_since(since) >= self.park_timeout {
            inner.parked.remove(&key);
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                NeverReceived(format!(
                    "{}, and no receive for it was posted within {:.1?} (PLAIT_TIMEOUT); this rank read nothing more from that link meanwhile, as holding the message would go over the {} bytes it may hold per peer (PLAIT_UNEXPECTED_BYTES)",
                    early(h, held),
                    self.park_timeout,
                    self.budget
                )),
            ));
        }
        inner.parked.insert(key, ParkedFrame { header: *h, since, lane: lane.clone() });
        Ok(Delivery::Parked { until: since + self.park_timeout })
    }

    /// With several lanes a later message can overtake an earlier one from the same sender and
    /// wait in the stash while any-source receives are posted. Once the earlier one is taken,
    /// the stashed one may be next in line: hand it to the oldest waiting any-source receive.
    fn hand_on_overtaken(&self, tag: u64) {
        let mut inner = self.inner.lock();
        let ready = next_in_line_for_any_source(&mut inner, tag);
        if inner.any_source.get(&tag).is_some_and(|l| !l.is_empty()) {
            // A parked message of this tag may be next in line now.
            inner.wake_parked(|k| k.1 == FrameKind::P2p as u8 && k.2 == tag);
        }
        drop(inner);
        self.land_stashed(ready);
    }

    fn land_stashed(&self, ready: Vec<(usize, Stashed, Posted)>) {
        for (peer, s, p) in ready {
            let result = land_from_memory(peer, &s.header, &s.data, &p);
            self.pool.give(s.data);
            p.report_at(result, peer, s.arrived);
        }
    }

}

/// A frame no receive was posted for while it waited parked (an io error's inner error, so
/// `blame` can tell it from a link that failed).
#[derive(Debug)]
pub(crate) struct NeverReceived(pub String);

impl std::fmt::Display for NeverReceived {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NeverReceived {}

/// What a peer sent early, for errors: "it sent <frame> of N bytes before ...".
fn early(h: &FrameHeader, held: u64) -> String {
    format!(
        "it sent {} of {} bytes before this rank posted its receive, with {held} bytes of its early messages already held",
        describe_header(h),
        h.nbytes
    )
}

/// Refuses frames that no receive could take, whatever is posted.
fn refuse_hostile(h: &FrameHeader) -> io::Result<()> {
    if h.kind == FrameKind::P2p as u8 && h.seq >= RESERVED_TAGS {
        // Link probes are answered by the demux and their answers always awaited; bandwidth
        // probes are received by the start-up that asked for them.
        let allowed = match h.seq {
            PONG_TAG | PROBE_GO_TAG => 8,
            PROBE_TAG | PROBE_AGAIN_TAG => PROBE_FRAME_BYTES,
            t if t & PIECE_TAGS == PIECE_TAGS && t & !PIECE_TAGS < PIECE_TAG_LIMIT => FRAME_MAX_BYTES,
            _ => 0,
        };
        if h.nbytes > allowed || allowed == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("it sent a message with reserved tag {:#x} that nothing receives", h.seq)));
        }
    }
    if h.nbytes > FRAME_MAX_BYTES {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("it sent {} claiming {} bytes, more than any buffer holds", describe_header(h), h.nbytes)));
    }
    Ok(())
}

/// Pairs waiting any-source receives of `tag`, oldest first, with stashed messages that are
/// next in line for their sender (the lowest rank first when several are).
fn next_in_line_for_any_source(inner: &mut Inner, tag: u64) -> Vec<(usize, Stashed, Posted)> {
    let kind = FrameKind::P2p as u8;
    let mut ready = Vec::new();
    while inner.any_source.get(&tag).is_some_and(|l| !l.is_empty()) {
        let p2p_next = &inner.p2p_next;
        let Some(key) = inner.stash.next_in_line(kind, tag, |peer| p2p_next.get(&(peer, tag)).copied().unwrap_or(0)) else { break };
        let peer = key.0;
        *inner.p2p_next.entry((peer, tag)).or_insert(0) += 1;
        let s = inner.stash.remove(&key).expect("found above");
        inner.room_freed(peer);
        let mut p = inner.any_source.get_mut(&tag).expect("checked above").remove(0);
        p.token = key.5; // an any-source receive reports the ordinal it took (see `exec::p2p`)
        ready.push((peer, s, p));
    }
    ready
}

fn take_locked(inner: &mut Inner, peer: usize, key: Key) -> Option<Posted> {
    if let Some(p) = inner.posted.remove(&key) {
        return Some(p);
    }
    if key.1 == FrameKind::P2p as u8 {
        let tag = key.2;
        let next = inner.p2p_next.get(&(peer, tag)).copied().unwrap_or(0);
        if key.5 == next {
            if let Some(list) = inner.any_source.get_mut(&tag) {
                if !list.is_empty() {
                    inner.p2p_next.insert((peer, tag), next + 1);
                    let mut p = list.remove(0);
                    p.token = next; // an any-source receive reports the ordinal it took (see `exec::p2p`)
                    return Some(p);
                }
            }
        }
    }
    None
}

fn check(peer: usize, h: &FrameHeader, p: &Posted) -> Result<(), PlaitError> {
    let (e, theirs) = (&p.expect, h.call());
    let described = describe_header(h);
    let mismatch = |detail: String| PlaitError::Mismatch { op: e.what.to_string(), peer, detail };
    if theirs.coll != e.call.coll || theirs.root != e.call.root || theirs.op != e.call.op || theirs.sched_id != e.call.sched_id {
        return Err(mismatch(format!("rank {peer} sent {described}; this rank runs {}", e.what)));
    }
    if theirs.dtype != e.call.dtype {
        return Err(mismatch(format!("rank {peer} sent {described}; dtypes differ")));
    }
    // Same call, different counts (checked after the call itself, so the message says what differs).
    if theirs.layout_id != 0 && e.call.layout_id != 0 && theirs.layout_id != e.call.layout_id {
        return Err(mismatch(format!("rank {peer} sent {described} with different counts than this rank passed to {}", e.what)));
    }
    if h.count != e.count || h.nbytes != e.nbytes {
        return Err(mismatch(format!(
            "rank {peer} sent {} bytes ({} elements in its block), this rank expects {} bytes ({} elements): counts differ",
            h.nbytes, h.count, e.nbytes, e.count
        )));
    }
    Ok(())
}

/// A frame of a call this rank had completed (not ended by a refusal).
fn late_frame(h: &FrameHeader) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("it sent {} after this rank had completed that operation: the ranks disagree about the call (root, counts or algorithm)", describe_header(h)),
    )
}

pub(crate) fn describe_header(h: &FrameHeader) -> String {
    let dtype = DType::from_u8(h.dtype).map(|d| d.name()).unwrap_or("?");
    if h.kind == FrameKind::P2p as u8 {
        return format!("a message with tag {} ({dtype}, its #{} with that tag)", h.seq, h.ordinal);
    }
    let coll = crate::sched::Collective::from_code(h.coll).map(|c| c.name()).unwrap_or("p2p");
    format!("{coll} #{} ({dtype}, root {}, schedule {:#x}, step {} segment {})", h.seq, h.root, h.sched_id, h.step, h.segment)
}

/// Reads the payload into the posted place. The outer error is the link's (I/O); the inner
/// one this receive's (a mismatch, after which the payload is drained to keep the stream in sync).
fn land_from_stream(peer: usize, h: &FrameHeader, payload: &mut dyn Read, p: &Posted) -> io::Result<Result<(), PlaitError>> {
    if let Err(e) = check(peer, h, p) {
        io::copy(payload, &mut io::sink())?;
        return Ok(Err(e));
    }
    p.landing.from_stream(p.len, p.wire, h.nbytes as usize, payload)?;
    Ok(Ok(()))
}

fn land_from_memory(peer: usize, h: &FrameHeader, data: &[u8], p: &Posted) -> Result<(), PlaitError> {
    crate::failpoint::hit("mailbox.land_from_memory");
    check(peer, h, p)?;
    p.landing.from_memory(p.len, p.wire, data);
    Ok(())
}

#[cfg(test)]
#[path = "mailbox_tests.rs"]
mod tests;
