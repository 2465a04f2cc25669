//! Matches frames arriving from peers with the receives operations have posted.
//!
//! A frame whose receive is already posted is read straight into its destination (no copy); one
//! that arrives early is stashed and copied when its receive is posted. Every posted receive
//! produces exactly one completion event: from the receiver thread, from `fail`, or not at all
//! when its operation cancels it (and then knows it).

use super::Event;
use crate::dtype::{DType, ReduceOp};
use crate::error::PlaitError;
use crate::codec::{self, Wire};
use crate::kernels;
use crate::net::frame::{FrameHeader, FrameKind};
use crossbeam_channel::Sender;
use parking_lot::Mutex;
use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{self, Read};
use std::sync::Arc;

/// (peer, frame kind, seq or tag, step, segment, ordinal)
pub type Key = (usize, u8, u64, u32, u32, u32);

/// What the receiving side expects the frame to say; any difference is a mismatch.
#[derive(Clone, Debug)]
pub struct Expect {
    pub coll: u8,
    pub dtype: u8,
    pub op: u8,
    pub root: u32,
    pub count: u64,
    pub nbytes: u64,
    pub sched_id: u32,
    pub layout_id: u32,
    /// "allreduce #12 (f32, sum, 1000 elements)": for error messages.
    pub what: Arc<str>,
}

/// Where the bytes of one output region go before anything overwrites them, so that a failed
/// operation can put them back. One per region, shared by everything that writes the region
/// (receives on any receiver thread, the operation's own local steps). Writers keep the region
/// from its start up to the end of what they are about to write, on their own thread, just
/// before writing: a receive never waits for a copy to be posted, a region nobody wrote is never
/// copied, and a receive landing piece by piece copies each piece while it is in the cache it
/// is about to be reduced or received in.
pub struct Keep {
    region: *mut u8,
    copy: *mut u8,
    len: usize,
    /// Bytes of the region kept so far, from its start.
    kept: Mutex<usize>,
}
// SAFETY: both pointers refer to buffers the operation keeps alive until every transfer has
// completed or been cancelled; `kept` serialises the copying.
unsafe impl Send for Keep {}
unsafe impl Sync for Keep {}

impl Keep {
    /// # Safety
    /// `region` and `copy` must be valid for `len` bytes for as long as the Keep is used.
    pub unsafe fn new(region: *mut u8, copy: *mut u8, len: usize) -> Keep {
        Keep { region, copy, len, kept: Mutex::new(0) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Call before writing anything below byte `end` of the region.
    pub fn before_write(&self, end: usize) {
        let end = end.min(self.len);
        let mut kept = self.kept.lock();
        if *kept < end {
            let (a, n) = (*kept, end - *kept);
            // Streaming stores: the copy is only read back after a failure.
            // SAFETY: a..a + n lies inside both buffers (see `new`).
            kernels::copy_streaming(unsafe { super::bytes_mut(self.copy.add(a), n) }, unsafe { super::bytes(self.region.add(a), n) });
            *kept = end;
        }
    }

    /// Puts back what was kept (everything anybody was about to overwrite).
    pub fn restore(&self) {
        let kept = *self.kept.lock();
        unsafe { super::bytes_mut(self.region, kept) }.copy_from_slice(unsafe { super::bytes(self.copy, kept) });
    }
}

fn before_write(keep: &Option<Arc<Keep>>, end: usize) {
    if let Some(k) = keep {
        k.before_write(end);
    }
}

pub enum Landing {
    /// Read the payload into `dst`.
    Copy { dst: *mut u8, keep: Option<Arc<Keep>> },
    /// `dst = with (+) payload`; `with` may equal `dst` (accumulate). `lock` serialises
    /// accumulations into the same destination by different receiver threads.
    Reduce { dst: *mut u8, with: *const u8, dtype: DType, op: ReduceOp, lock: Arc<Mutex<()>>, keep: Option<Arc<Keep>> },
    /// Several small transfers of one step from the same peer, sent as one frame: the payload
    /// is their wire bytes back to back, in ordinal order.
    Bundle(Vec<Part>),
}

/// One transfer inside a bundle: where it lands, its size there and on the wire.
pub struct Part {
    pub landing: Landing,
    pub len: usize,
    pub wire_len: usize,
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
}
// SAFETY: the pointers refer to buffers the posting operation keeps alive until it has received
// this receive's completion event or cancelled it.
unsafe impl Send for Posted {}

struct Stashed {
    header: FrameHeader,
    data: Vec<u8>,
}

#[derive(Default)]
struct Inner {
    posted: HashMap<Key, Posted>,
    stashed: HashMap<Key, Stashed>,
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
}

impl Inner {
    fn is_finished(&self, seq: u64) -> bool {
        seq < self.finished_below || self.finished_above.contains(&seq)
    }
}

#[derive(Default)]
pub struct Mailbox {
    inner: Mutex<Inner>,
    /// Buffers for early frames, shared with the executor's snapshots and scratch.
    pub pool: super::pool::BufferPool,
}

/// Receives land this much at a time: each piece is kept (see `Keep`) and, for a reducing
/// receive, reduced while it is still in cache (a multiple of every element size).
const LANDING_PIECE: usize = 256 * 1024;

thread_local! {
    static REDUCE_TMP: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static DECODE_TMP: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

impl Mailbox {
    pub fn new() -> Self {
        Self::default()
    }

    /// Posts a receive, or completes it at once from a stashed frame (on this thread).
    pub fn post(&self, key: Key, p: Posted) {
        let stashed = {
            let mut inner = self.inner.lock();
            if let Some(err) = &inner.broken {
                let err = err.clone();
                drop(inner);
                let _ = p.events.send(Event { token: p.token, result: Err(err), source: key.0 });
                return;
            }
            match inner.stashed.remove(&key) {
                Some(s) => s,
                None => {
                    if let Some(err) = inner.closed.get(&key.0).cloned() {
                        drop(inner);
                        let _ = p.events.send(Event { token: p.token, result: Err(err), source: key.0 });
                        return;
                    }
                    inner.posted.insert(key, p);
                    return;
                }
            }
        };
        let result = land_from_memory(key.0, &stashed.header, &stashed.data, &p);
        self.pool.give(stashed.data);
        let _ = p.events.send(Event { token: p.token, result, source: key.0 });
    }

    /// Posts a point-to-point receive from `src` (or any source when `None`) with `tag`.
    pub fn post_p2p(&self, src: Option<usize>, tag: u64, p: Posted) {
        let mut inner = self.inner.lock();
        if let Some(err) = &inner.broken {
            let err = err.clone();
            drop(inner);
            let _ = p.events.send(Event { token: p.token, result: Err(err), source: src.unwrap_or(0) });
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
        match inner.stashed.remove(&key) {
            Some(s) => {
                drop(inner);
                let result = land_from_memory(peer, &s.header, &s.data, &p);
                self.pool.give(s.data);
                let _ = p.events.send(Event { token: p.token, result, source: peer });
            }
            None => {
                if let Some(err) = inner.closed.get(&peer).cloned() {
                    drop(inner);
                    let _ = p.events.send(Event { token: p.token, result: Err(err), source: peer });
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
            let _ = p.events.send(Event { token: p.token, result: Err(err.clone()), source: peer });
        }
    }

    /// Removes the receives `op_id` posted that no frame has taken yet; returns how many.
    pub fn cancel(&self, op_id: u64) -> usize {
        let mut inner = self.inner.lock();
        let before = inner.posted.len();
        inner.posted.retain(|_, p| p.op_id != op_id);
        let mut removed = before - inner.posted.len();
        for list in inner.any_source.values_mut() {
            let b = list.len();
            list.retain(|p| p.op_id != op_id);
            removed += b - list.len();
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
            inner.stashed.clear();
            (inner.posted.drain().collect(), inner.any_source.drain().flat_map(|(_, v)| v).collect())
        };
        for (key, p) in posted {
            let _ = p.events.send(Event { token: p.token, result: Err(err.clone()), source: key.0 });
        }
        for p in any {
            let _ = p.events.send(Event { token: p.token, result: Err(err.clone()), source: 0 });
        }
    }

    /// Marks collective `seq` complete on this rank. Returns a frame of it that arrived but was
    /// never asked for: the ranks disagreed about the call (root, counts, algorithm).
    pub fn finish(&self, seq: u64) -> Option<(usize, FrameHeader)> {
        let mut inner = self.inner.lock();
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
        let stray: Vec<Key> = inner.stashed.keys().filter(|k| k.1 == data && k.2 == seq).copied().collect();
        let first = stray.first().and_then(|k| inner.stashed.get(k).map(|s| (k.0, s.header)));
        for k in stray {
            if let Some(s) = inner.stashed.remove(&k) {
                self.pool.give(s.data);
            }
        }
        first
    }

    /// Called by the receiver thread of `peer` for a Data or P2p frame.
    pub fn deliver(&self, peer: usize, h: &FrameHeader, payload: &mut dyn Read) -> io::Result<()> {
        if h.kind == FrameKind::Data as u8 && self.inner.lock().is_finished(h.seq) {
            io::copy(payload, &mut io::sink())?;
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "it sent {} after this rank had completed that operation: the ranks disagree about the call (root, counts or algorithm)",
                    describe_header(h)
                ),
            ));
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
                    let _ = p.events.send(Event { token: p.token, result, source: peer });
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
                            let _ = p.events.send(Event { token: p.token, result: Err(err), source: peer });
                        }
                        None => {
                            inner.posted.insert(key, p);
                        }
                    }
                    Err(io_err)
                }
            };
        }
        // Not posted yet: read without holding the lock, then look again before stashing.
        let mut data = self.pool.take(h.nbytes as usize);
        payload.read_exact(&mut data)?;
        let mut inner = self.inner.lock();
        if inner.broken.is_some() {
            return Ok(());
        }
        if let Some(p) = take_locked(&mut inner, peer, key) {
            drop(inner);
            let result = land_from_memory(peer, h, &data, &p);
            self.pool.give(data);
            let _ = p.events.send(Event { token: p.token, result, source: peer });
            if h.kind == FrameKind::P2p as u8 {
                self.hand_on_overtaken(h.seq);
            }
        } else {
            inner.stashed.insert(key, Stashed { header: *h, data });
        }
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
            let _ = p.events.send(Event { token: p.token, result, source: peer });
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
        let sender = inner
            .stashed
            .keys()
            .filter(|k| k.1 == kind && k.2 == tag && k.5 == inner.p2p_next.get(&(k.0, tag)).copied().unwrap_or(0))
            .map(|k| k.0)
            .min();
        let Some(peer) = sender else { break };
        let next = inner.p2p_next.entry((peer, tag)).or_insert(0);
        let key = (peer, kind, tag, 0, 0, *next);
        *next += 1;
        let s = inner.stashed.remove(&key).expect("found above");
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
    let e = &p.expect;
    let theirs = describe_header(h);
    let mismatch = |detail: String| PlaitError::Mismatch { op: e.what.to_string(), peer, detail };
    if h.coll != e.coll || h.root != e.root || h.op != e.op || h.sched_id != e.sched_id {
        return Err(mismatch(format!("rank {peer} sent {theirs}; this rank runs {}", e.what)));
    }
    if h.dtype != e.dtype {
        return Err(mismatch(format!("rank {peer} sent {theirs}; dtypes differ")));
    }
    // Same call, different counts (checked after the call itself, so the message says what differs).
    if h.layout_id != 0 && e.layout_id != 0 && h.layout_id != e.layout_id {
        return Err(mismatch(format!("rank {peer} sent {theirs} with different counts than this rank passed to {}", e.what)));
    }
    if h.count != e.count || h.nbytes != e.nbytes {
        return Err(mismatch(format!(
            "rank {peer} sent {} bytes ({} elements in its block), this rank expects {} bytes ({} elements): counts differ",
            h.nbytes, h.count, e.nbytes, e.count
        )));
    }
    Ok(())
}

pub(crate) fn describe_header(h: &FrameHeader) -> String {
    let coll = crate::sched::Collective::from_code(h.coll).map(|c| c.name()).unwrap_or("p2p");
    let dtype = DType::from_u8(h.dtype).map(|d| d.name()).unwrap_or("?");
    format!("{coll} #{} ({dtype}, root {}, schedule {:#x})", h.seq, h.root, h.sched_id)
}

/// Reads the payload into the landing place. The outer error is the link's (I/O); the inner
/// one this receive's (a mismatch, after which the payload is drained to keep the stream in sync).
fn land_from_stream(peer: usize, h: &FrameHeader, payload: &mut dyn Read, p: &Posted) -> io::Result<Result<(), PlaitError>> {
    if let Err(e) = check(peer, h, p) {
        io::copy(payload, &mut io::sink())?;
        return Ok(Err(e));
    }
    match (&p.landing, p.wire) {
        (Landing::Copy { dst, keep }, Wire::Native) => {
            let dst = unsafe { super::bytes_mut(*dst, p.len) };
            // Piece by piece: each piece is kept just before the socket overwrites it.
            for at in (0..p.len).step_by(LANDING_PIECE) {
                let end = (at + LANDING_PIECE).min(p.len);
                before_write(keep, end);
                payload.read_exact(&mut dst[at..end])?;
            }
        }
        (Landing::Reduce { .. }, Wire::Native) => {
            REDUCE_TMP.with(|tmp| -> io::Result<()> {
                let mut tmp = tmp.borrow_mut();
                tmp.resize(LANDING_PIECE.min(p.len), 0);
                for at in (0..p.len).step_by(LANDING_PIECE) {
                    let piece = &mut tmp[..LANDING_PIECE.min(p.len - at)];
                    payload.read_exact(piece)?;
                    reduce_landing_at(&p.landing, at, piece);
                }
                Ok(())
            })?
        }
        _ => REDUCE_TMP.with(|tmp| -> io::Result<()> {
            let mut tmp = tmp.borrow_mut();
            tmp.resize(h.nbytes as usize, 0);
            payload.read_exact(&mut tmp[..])?;
            land_bytes(p, &tmp[..]);
            Ok(())
        })?,
    }
    Ok(Ok(()))
}

fn land_from_memory(peer: usize, h: &FrameHeader, data: &[u8], p: &Posted) -> Result<(), PlaitError> {
    check(peer, h, p)?;
    land_bytes(p, data);
    Ok(())
}

/// Puts a whole (wire-encoded) payload in its landing place: decoded, then copied or reduced.
fn land_bytes(p: &Posted, wire_bytes: &[u8]) {
    land_part(&p.landing, p.len, p.wire, wire_bytes);
}

fn land_part(landing: &Landing, len: usize, wire: Wire, wire_bytes: &[u8]) {
    match landing {
        Landing::Bundle(parts) => {
            let mut at = 0;
            for part in parts {
                land_part(&part.landing, part.len, wire, &wire_bytes[at..at + part.wire_len]);
                at += part.wire_len;
            }
        }
        Landing::Copy { dst, keep } if wire == Wire::Native => {
            before_write(keep, len);
            unsafe { super::bytes_mut(*dst, len) }.copy_from_slice(wire_bytes)
        }
        Landing::Copy { dst, keep } => {
            before_write(keep, len);
            codec::decode(wire, wire_bytes, unsafe { super::bytes_mut(*dst, len) })
        }
        Landing::Reduce { .. } if wire == Wire::Native => reduce_landing_at(landing, 0, wire_bytes),
        Landing::Reduce { dst, with, dtype, op, lock, keep } if *dtype == DType::F32 && op.combiner() == ReduceOp::Sum => {
            // Decoded and added in one pass, no temporary.
            let _guard = lock.lock();
            before_write(keep, len);
            let d = unsafe { super::bytes_mut(*dst, len) };
            if std::ptr::eq(*dst as *const u8, *with) {
                codec::decode_add_into(wire, wire_bytes, d);
            } else {
                codec::decode_add_from(wire, wire_bytes, unsafe { super::bytes(*with, len) }, d);
            }
        }
        Landing::Reduce { .. } => DECODE_TMP.with(|t| {
            let mut t = t.borrow_mut();
            t.resize(len, 0);
            codec::decode(wire, wire_bytes, &mut t[..]);
            reduce_landing_at(landing, 0, &t[..]);
        }),
    }
}

/// Reduces `incoming` into the landing's bytes `at..at + incoming.len()`.
fn reduce_landing_at(landing: &Landing, at: usize, incoming: &[u8]) {
    if let Landing::Reduce { dst, with, dtype, op, lock, keep } = landing {
        let _guard = lock.lock();
        let len = incoming.len();
        before_write(keep, at + len);
        // SAFETY: the posted receive covers `at + len` bytes of dst and with.
        let d = unsafe { super::bytes_mut(dst.add(at), len) };
        if std::ptr::eq(*dst as *const u8, *with) {
            kernels::reduce_into(d, incoming, *dtype, *op);
        } else {
            let w = unsafe { super::bytes(with.add(at), len) };
            kernels::reduce_from(d, w, incoming, *dtype, *op);
        }
    }
}

