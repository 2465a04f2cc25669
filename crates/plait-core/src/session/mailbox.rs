//! Matches frames arriving from peers with the receives operations have posted.
//!
//! A frame whose receive is already posted is read straight into its destination (no copy); one
//! that arrives early is stashed and copied when its receive is posted. Every posted receive
//! produces exactly one completion event: from the receiver thread, from `fail`, or not at all
//! when its operation cancels it (and then knows it).

use super::landing::Landing;
use super::pool::BufferPool;
use super::stash::{Stash, Stashed};
use super::Event;
use crate::codec::Wire;
use crate::dtype::DType;
use crate::error::PlaitError;
use crate::net::frame::{CallId, FrameHeader, FrameKind, PONG_TAG, RESERVED_TAGS};
use crossbeam_channel::Sender;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{self, Read};
use std::sync::Arc;

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
    pub fn report(mut self, result: Result<(), PlaitError>, source: usize) {
        self.reported = true;
        let _ = self.events.send(Event { token: self.token, result, source });
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
            let _ = self.events.send(Event { token: self.token, result: Err(err), source: usize::MAX });
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
}

impl Inner {
    fn is_finished(&self, seq: u64) -> bool {
        seq < self.finished_below || self.finished_above.contains(&seq)
    }
}

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
    /// Bytes of early frames held per peer (`PLAIT_UNEXPECTED_BYTES`): a peer that sends more
    /// is cut off before the frame is read.
    budget: u64,
}

impl Default for Mailbox {
    fn default() -> Self {
        Mailbox::with_budget(DEFAULT_UNEXPECTED_BYTES)
    }
}

impl Mailbox {
    #[cfg(test)]
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_budget(budget: u64) -> Self {
        Mailbox { inner: Mutex::default(), pool: BufferPool::default(), budget }
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
                Some(s) => s,
                None => {
                    if let Some(err) = inner.closed.get(&key.0).cloned() {
                        drop(inner);
                        p.report(Err(err), key.0);
                        return;
                    }
                    inner.posted.insert(key, p);
                    return;
                }
            }
        };
        let result = land_from_memory(key.0, &stashed.header, &stashed.data, &p);
        self.pool.give(stashed.data);
        p.report(result, key.0);
    }

    /// Posts a point-to-point receive from `src` (or any source when `None`) with `tag`.
    pub fn post_p2p(&self, src: Option<usize>, tag: u64, p: Posted) {
        let mut inner = self.inner.lock();
        if let Some(err) = &inner.broken {
            let err = err.clone();
            drop(inner);
            p.report(Err(err), src.unwrap_or(0));
            return;
        }
        let kind = FrameKind::P2p as u8;
        let Some(peer) = src else {
            // Behind any-source receives already waiting: they take stashed messages first.
            inner.any_source.entry(tag).or_default().push(p);
            let ready = next_in_line_for_any_source(&mut inner, tag);
            drop(inner);
            self.land_stashed(ready);
            return;
        };
        let next = inner.p2p_next.entry((peer, tag)).or_insert(0);
        let key = (peer, kind, tag, 0, 0, *next);
        *next += 1;
        match inner.stash.remove(&key) {
            Some(s) => {
                drop(inner);
                let result = land_from_memory(peer, &s.header, &s.data, &p);
                self.pool.give(s.data);
                p.report(result, peer);
            }
            None => {
                if let Some(err) = inner.closed.get(&peer).cloned() {
                    drop(inner);
                    p.report(Err(err), peer);
                    return;
                }
                inner.posted.insert(key, p);
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

    /// Fails every posted receive and refuses new ones.
    pub fn fail(&self, err: &PlaitError) {
        let (posted, any): (Vec<_>, Vec<_>) = {
            let mut inner = self.inner.lock();
            if inner.broken.is_none() {
                inner.broken = Some(err.clone());
            }
            inner.stash.clear();
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
        self.finish(seq);
        self.inner.lock().dropped.insert(seq);
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
        let stray = inner.stash.remove_call(FrameKind::Data as u8, seq);
        drop(inner);
        let first = stray.first().map(|(k, s)| (k.0, s.header));
        for (_, s) in stray {
            self.pool.give(s.data);
        }
        first
    }

    /// Called by the receiver thread of `peer` for a Data or P2p frame.
    pub fn deliver(&self, peer: usize, h: &FrameHeader, payload: &mut dyn Read) -> io::Result<()> {
        // A frame of a call this rank has finished: Some(whether a refusal ended that call).
        let late = if h.kind == FrameKind::Data as u8 {
            let inner = self.inner.lock();
            inner.is_finished(h.seq).then(|| inner.dropped.contains(&h.seq))
        } else {
            None
        };
        if let Some(dropped) = late {
            io::copy(payload, &mut io::sink())?;
            if dropped {
                return Ok(());
            }
            return Err(late_frame(h));
        }
        let key: Key = if h.kind == FrameKind::P2p as u8 {
            (peer, h.kind, h.seq, 0, 0, h.ordinal)
        } else {
            (peer, h.kind, h.seq, h.step, h.segment, h.ordinal)
        };
        let taken = self.take(peer, key);
        if let Some(p) = taken {
            return match land_from_stream(peer, h, payload, &p) {
                Ok(result) => {
                    p.report(result, peer);
                    if h.kind == FrameKind::P2p as u8 {
                        self.hand_on_overtaken(h.seq);
                    }
                    Ok(())
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
            };
        }
        // Not posted yet: claim room in this peer's budget (before a byte is allocated or
        // read), read without holding the lock, then look again before stashing.
        self.reserve(peer, h)?;
        let mut data = self.pool.take(h.nbytes as usize);
        let read = payload.read_exact(&mut data);
        let mut inner = self.inner.lock();
        inner.stash.release(peer, h.nbytes);
        read?;
        if inner.broken.is_some() {
            return Ok(());
        }
        if let Some(p) = take_locked(&mut inner, peer, key) {
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
            drop(inner);
            self.pool.give(data);
            if !dropped {
                return Err(late_frame(h));
            }
        } else {
            inner.stash.insert(key, Stashed { header: *h, data });
        }
        Ok(())
    }

    /// Counts `h`'s payload against `peer`'s budget for early frames, or refuses the frame
    /// (which closes the link, naming the peer) when it would go over.
    fn reserve(&self, peer: usize, h: &FrameHeader) -> io::Result<()> {
        if h.kind == FrameKind::P2p as u8 && h.seq >= RESERVED_TAGS {
            // Link probes are answered by the demux and their answers always awaited.
            if h.seq != PONG_TAG || h.nbytes > 8 {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("it sent a message with reserved tag {:#x} that nothing receives", h.seq)));
            }
        }
        let mut inner = self.inner.lock();
        let held = inner.stash.held(peer);
        if h.nbytes > self.budget.saturating_sub(held) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "it sent {} of {} bytes before this rank posted its receive, with {held} bytes of its early messages already held: over the {} bytes allowed per peer (PLAIT_UNEXPECTED_BYTES)",
                    describe_header(h),
                    h.nbytes,
                    self.budget
                ),
            ));
        }
        inner.stash.reserve(peer, h.nbytes);
        Ok(())
    }

    /// With several lanes a later message can overtake an earlier one from the same sender and
    /// wait in the stash while any-source receives are posted. Once the earlier one is taken,
    /// the stashed one may be next in line: hand it to the oldest waiting any-source receive.
    fn hand_on_overtaken(&self, tag: u64) {
        let ready = next_in_line_for_any_source(&mut self.inner.lock(), tag);
        self.land_stashed(ready);
    }

    fn land_stashed(&self, ready: Vec<(usize, Stashed, Posted)>) {
        for (peer, s, p) in ready {
            let result = land_from_memory(peer, &s.header, &s.data, &p);
            self.pool.give(s.data);
            p.report(result, peer);
        }
    }

    fn take(&self, peer: usize, key: Key) -> Option<Posted> {
        take_locked(&mut self.inner.lock(), peer, key)
    }
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
        let p = inner.any_source.get_mut(&tag).expect("checked above").remove(0);
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
                    return Some(list.remove(0));
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
    let coll = crate::sched::Collective::from_code(h.coll).map(|c| c.name()).unwrap_or("p2p");
    let dtype = DType::from_u8(h.dtype).map(|d| d.name()).unwrap_or("?");
    format!("{coll} #{} ({dtype}, root {}, schedule {:#x})", h.seq, h.root, h.sched_id)
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
