//! Matches frames arriving from peers with the receives operations have posted.
//!
//! A frame whose receive is already posted is read straight into its destination (no copy); one
//! that arrives early is stashed and copied when its receive is posted. Every posted receive
//! produces exactly one completion event: from the receiver thread, from `fail`, or not at all
//! when its operation cancels it (and then knows it).

use super::landing::Landing;
use super::pool::BufferPool;
use super::Event;
use crate::codec::Wire;
use crate::dtype::DType;
use crate::error::PlaitError;
use crate::net::frame::{CallId, FrameHeader, FrameKind};
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
    pub pool: BufferPool,
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
    check(peer, h, p)?;
    p.landing.from_memory(p.len, p.wire, data);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::landing::Keep;
    use crossbeam_channel::Receiver;

    /// A receive into `dst` and the channel its completion arrives on.
    fn posted(dst: &mut [u8], call: CallId, op_id: u64) -> (Posted, Receiver<Event>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let p = Posted {
            landing: Landing::Copy { dst: dst.as_mut_ptr(), keep: None },
            len: dst.len(),
            wire: Wire::Native,
            expect: Expect { call, count: dst.len() as u64, nbytes: dst.len() as u64, what: "test op".into() },
            op_id,
            token: 0,
            events: tx,
        };
        (p, rx)
    }

    fn u8_call() -> CallId {
        CallId { dtype: DType::U8 as u8, ..Default::default() }
    }

    fn data_call(seq: u64) -> CallId {
        CallId { coll: 1, dtype: DType::U8 as u8, seq, sched_id: 7, ..Default::default() }
    }

    fn p2p(tag: u64, ordinal: u32, payload: &[u8]) -> FrameHeader {
        FrameHeader::p2p(tag, ordinal, DType::U8 as u8, payload.len() as u64, payload.len() as u64)
    }

    fn deliver(m: &Mailbox, peer: usize, h: &FrameHeader, payload: &[u8]) -> io::Result<()> {
        m.deliver(peer, h, &mut &payload[..])
    }

    fn ok_from(rx: &Receiver<Event>) -> usize {
        let ev = rx.try_recv().expect("the receive completed");
        ev.result.expect("the receive succeeded");
        ev.source
    }

    #[test]
    fn a_frame_for_a_posted_receive_lands_in_place() {
        let m = Mailbox::new();
        let mut dst = [0u8; 4];
        let (p, rx) = posted(&mut dst, data_call(3), 1);
        m.post((2, FrameKind::Data as u8, 3, 0, 0, 0), p);
        assert!(rx.try_recv().is_err(), "nothing arrived yet");
        deliver(&m, 2, &FrameHeader::data(&data_call(3), 0, 0, 0, 4, 4), b"abcd").unwrap();
        assert_eq!(ok_from(&rx), 2);
        assert_eq!(&dst, b"abcd");
    }

    #[test]
    fn an_early_frame_is_stashed_and_lands_when_its_receive_is_posted() {
        let m = Mailbox::new();
        deliver(&m, 1, &FrameHeader::data(&data_call(5), 2, 1, 0, 3, 3), b"xyz").unwrap();
        let mut dst = [0u8; 3];
        let (p, rx) = posted(&mut dst, data_call(5), 1);
        m.post((1, FrameKind::Data as u8, 5, 2, 1, 0), p);
        assert_eq!(ok_from(&rx), 1);
        assert_eq!(&dst, b"xyz");
    }

    #[test]
    fn messages_with_one_tag_match_receives_in_the_order_they_were_sent() {
        let m = Mailbox::new();
        // The second message overtakes the first (another lane), before any receive is posted.
        deliver(&m, 1, &p2p(9, 1, b"two"), b"two").unwrap();
        let (mut a, mut b) = ([0u8; 3], [0u8; 3]);
        let (pa, ra) = posted(&mut a, u8_call(), 1);
        let (pb, rb) = posted(&mut b, u8_call(), 2);
        m.post_p2p(Some(1), 9, pa);
        m.post_p2p(Some(1), 9, pb);
        assert_eq!(ok_from(&rb), 1, "the second receive takes the second message at once");
        assert!(ra.try_recv().is_err(), "the first receive waits for the first message");
        deliver(&m, 1, &p2p(9, 0, b"one"), b"one").unwrap();
        ok_from(&ra);
        assert_eq!((&a, &b), (b"one", b"two"));
    }

    #[test]
    fn any_source_receives_take_messages_oldest_receive_first_in_each_senders_order() {
        let m = Mailbox::new();
        let (mut a, mut b, mut c) = ([0u8; 1], [0u8; 1], [0u8; 1]);
        let (pa, ra) = posted(&mut a, u8_call(), 1);
        let (pb, rb) = posted(&mut b, u8_call(), 2);
        let (pc, rc) = posted(&mut c, u8_call(), 3);
        m.post_p2p(None, 4, pa);
        m.post_p2p(None, 4, pb);
        m.post_p2p(None, 4, pc);
        // Rank 2's second message overtakes its first: it must wait for it, not jump the queue.
        deliver(&m, 2, &p2p(4, 1, b"B"), b"B").unwrap();
        assert!(ra.try_recv().is_err());
        deliver(&m, 3, &p2p(4, 0, b"C"), b"C").unwrap();
        assert_eq!(ok_from(&ra), 3);
        deliver(&m, 2, &p2p(4, 0, b"A"), b"A").unwrap();
        assert_eq!((ok_from(&rb), ok_from(&rc)), (2, 2));
        assert_eq!((a[0], b[0], c[0]), (b'C', b'A', b'B'));
    }

    #[test]
    fn a_stashed_message_serves_a_later_any_source_receive() {
        let m = Mailbox::new();
        deliver(&m, 1, &p2p(6, 0, b"Q"), b"Q").unwrap();
        let mut a = [0u8; 1];
        let (pa, ra) = posted(&mut a, u8_call(), 1);
        m.post_p2p(None, 6, pa);
        assert_eq!(ok_from(&ra), 1);
        assert_eq!(a[0], b'Q');
    }

    #[test]
    fn a_frame_that_disagrees_fails_its_receive_and_leaves_the_stream_in_step() {
        let m = Mailbox::new();
        let mut dst = [7u8; 4];
        let (p, rx) = posted(&mut dst, data_call(3), 1);
        m.post((1, FrameKind::Data as u8, 3, 0, 0, 0), p);
        let other = CallId { sched_id: 8, ..data_call(3) };
        let mut stream: &[u8] = b"abcdNEXT";
        m.deliver(1, &FrameHeader::data(&other, 0, 0, 0, 4, 4), &mut (&mut stream).take(4)).unwrap();
        assert_eq!(stream, b"NEXT", "exactly the payload was consumed");
        let err = rx.try_recv().unwrap().result.unwrap_err();
        assert!(matches!(err, PlaitError::Mismatch { peer: 1, .. }), "{err}");
        assert_eq!(dst, [7; 4], "nothing landed");
    }

    #[test]
    fn cancel_withdraws_only_that_operations_receives() {
        let m = Mailbox::new();
        let (mut a, mut b) = ([0u8; 1], [0u8; 1]);
        let (pa, ra) = posted(&mut a, data_call(1), 10);
        let (pb, rb) = posted(&mut b, u8_call(), 11);
        m.post((1, FrameKind::Data as u8, 1, 0, 0, 0), pa);
        m.post_p2p(None, 2, pb);
        assert_eq!(m.cancel(10), 1);
        assert!(ra.try_recv().is_err(), "a cancelled receive reports nothing");
        deliver(&m, 1, &p2p(2, 0, b"z"), b"z").unwrap();
        assert_eq!(ok_from(&rb), 1);
    }

    #[test]
    fn fail_completes_every_receive_with_the_error_and_refuses_new_ones() {
        let m = Mailbox::new();
        let (mut a, mut b) = ([0u8; 1], [0u8; 1]);
        let (pa, ra) = posted(&mut a, data_call(1), 1);
        m.post((1, FrameKind::Data as u8, 1, 0, 0, 0), pa);
        m.fail(&PlaitError::Broken("gone".into()));
        assert!(matches!(ra.try_recv().unwrap().result, Err(PlaitError::Broken(_))));
        let (pb, rb) = posted(&mut b, u8_call(), 2);
        m.post_p2p(Some(1), 0, pb);
        assert!(matches!(rb.try_recv().unwrap().result, Err(PlaitError::Broken(_))));
    }

    #[test]
    fn a_peer_that_closed_still_serves_what_it_sent_before() {
        let m = Mailbox::new();
        deliver(&m, 1, &p2p(3, 0, b"k"), b"k").unwrap();
        let closed = PlaitError::Peer { op: String::new(), peer: 1, addr: String::new(), what: "closed".into(), waited: Default::default() };
        m.peer_closed(1, &closed);
        let (mut a, mut b) = ([0u8; 1], [0u8; 1]);
        let (pa, ra) = posted(&mut a, u8_call(), 1);
        let (pb, rb) = posted(&mut b, u8_call(), 2);
        m.post_p2p(Some(1), 3, pa);
        m.post_p2p(Some(1), 3, pb);
        ok_from(&ra);
        assert!(matches!(rb.try_recv().unwrap().result, Err(PlaitError::Peer { peer: 1, .. })));
    }

    #[test]
    fn frames_of_a_finished_operation_are_named_as_disagreement() {
        let m = Mailbox::new();
        // A frame nobody asked for, then the operation finishes: that frame is the evidence.
        deliver(&m, 2, &FrameHeader::data(&data_call(1), 0, 0, 5, 1, 1), b"s").unwrap();
        let (peer, h) = m.finish(1).expect("the stray frame is reported");
        assert_eq!((peer, h.seq, h.ordinal), (2, 1, 5));
        let late = deliver(&m, 2, &FrameHeader::data(&data_call(1), 0, 0, 6, 1, 1), b"t").unwrap_err();
        assert_eq!(late.kind(), io::ErrorKind::InvalidData);
        assert!(m.finish(2).is_none());
    }

    #[test]
    fn a_receive_keeps_what_it_overwrites_so_a_failure_can_restore_it() {
        let m = Mailbox::new();
        let mut dst = *b"old!";
        let mut copy = [0u8; 4];
        // SAFETY: both buffers outlive the keep, which this test uses only on this thread.
        let keep = Arc::new(unsafe { Keep::new(dst.as_mut_ptr(), copy.as_mut_ptr(), 4) });
        let (tx, rx) = crossbeam_channel::unbounded();
        let p = Posted {
            landing: Landing::Copy { dst: dst.as_mut_ptr(), keep: Some(keep.clone()) },
            len: 4,
            wire: Wire::Native,
            expect: Expect { call: data_call(1), count: 4, nbytes: 4, what: "test op".into() },
            op_id: 1,
            token: 0,
            events: tx,
        };
        m.post((1, FrameKind::Data as u8, 1, 0, 0, 0), p);
        deliver(&m, 1, &FrameHeader::data(&data_call(1), 0, 0, 0, 4, 4), b"new!").unwrap();
        ok_from(&rx);
        assert_eq!(&dst, b"new!");
        keep.restore();
        assert_eq!(&dst, b"old!");
    }
}
