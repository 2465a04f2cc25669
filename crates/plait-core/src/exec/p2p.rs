//! Point-to-point transfers. Starting one (taking its ordinal, queueing its frame or posting its
//! receive) happens on the caller's thread, in call order, so transfers with the same peer and
//! tag match in the order they were called; only the waiting may run later, on a worker.

use super::transfers::{OpMemory, Transfers};
use super::wait::with_waited;
use crate::codec::Wire;
use crate::dtype::DType;
use crate::error::{PlaitError, Result};
use crate::net::frame::{CallId, FrameHeader, PIECE_TAGS, PIECE_TAG_LIMIT};
use crate::raw::RawBuf;
use crate::session::{BufferPool, Expect, Keep, Landing, Posted, Session};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A point-to-point transfer that has been started (its ordinal taken, its frame queued or its
/// receive posted) and not yet waited for. Starting happens on the caller's thread, in call
/// order, so transfers with the same peer and tag match in the order they were called.
pub(crate) struct P2pStarted {
    transfers: Transfers<P2pMemory>,
    start: Instant,
    what: Arc<str>,
    peer: usize,
    /// Events to wait for: one per piece posted or queued.
    events: usize,
    /// An any-source receive of a message in pieces: the pieces after the first, posted once the
    /// first has come and named its sender and ordinal.
    rest: Option<Receive>,
}

/// A receive cut in pieces: where each lands in `dst`.
struct Receive {
    tag: u64,
    dtype: DType,
    dst: RawBuf,
    pieces: Vec<(usize, usize)>,
}

impl Receive {
    /// The posted receive of piece `j`, landing in its part of `dst`, kept by `keeps[j]`.
    fn piece(&self, j: usize, transfers: &Transfers<P2pMemory>, keeps: &[Arc<Keep>], what: &Arc<str>) -> Posted {
        let (at, len) = self.pieces[j];
        let call = CallId { dtype: self.dtype as u8, ..Default::default() };
        let count = (self.dst.len / self.dtype.size()) as u64;
        let expect = Expect { call, count, nbytes: len as u64, what: what.clone() };
        // SAFETY: the caller's buffer, alive until every piece has reported or been withdrawn;
        // the pieces tile it.
        let landing = Landing::Copy { dst: unsafe { self.dst.ptr.add(at) }, keep: Some(keeps[j].clone()) };
        Posted { landing, len, wire: Wire::Native, expect, op_id: transfers.op_id(), token: 0, events: transfers.issue(), reported: false }
    }

    /// Posts the pieces after the first, from `peer`, whose first piece has ordinal `first`.
    fn post_rest(&self, session: &Session, peer: usize, first: u32, transfers: &Transfers<P2pMemory>, keeps: &[Arc<Keep>], what: &Arc<str>) {
        for j in 1..self.pieces.len() {
            let (t, ordinal) = piece_key(self.tag, first, j);
            session.mailbox.post_p2p_at(peer, t, ordinal, self.piece(j, transfers, keeps, what));
        }
    }
}

/// A receive keeps what it overwrites (in `copy`, one `Keep` per piece), to put back if it fails.
enum P2pMemory {
    Send,
    Recv { keeps: Vec<Arc<Keep>>, copy: Vec<u8> },
}

impl OpMemory for P2pMemory {
    fn give_back(&mut self, pool: &BufferPool) {
        if let P2pMemory::Recv { copy, .. } = self {
            pool.give(std::mem::take(copy));
        }
    }
}

/// Messages from twice this size on go as pieces of at least this size, one frame each, so a
/// link with several connections (`PLAIT_STREAMS`, `PLAIT_STREAMS_MAX`) carries one message over
/// all of them at once. A piece is large enough that its frame costs nothing next to its bytes.
pub(crate) const PIECE_MIN_BYTES: usize = 4 << 20;
/// At most this many pieces (the piece ordinals below leave room for this many).
pub(crate) const MAX_PIECES: usize = 16;

/// Where the pieces of a message of `count` elements of `dtype` with `tag` lie, `(byte offset,
/// bytes)`: one piece below `2 * PIECE_MIN_BYTES` (and for tags from `PIECE_TAG_LIMIT` on, which
/// have no piece tag), else up to `MAX_PIECES` of whole elements. Sender and receiver reach the
/// same pieces from the same count; a receive of another count fails on the first piece, which
/// carries the whole message's count.
pub(crate) fn pieces(count: usize, dtype: DType, tag: u64) -> Vec<(usize, usize)> {
    let bytes = count * dtype.size();
    if bytes < 2 * PIECE_MIN_BYTES || tag >= PIECE_TAG_LIMIT {
        return vec![(0, bytes)];
    }
    let k = (bytes / PIECE_MIN_BYTES).min(MAX_PIECES);
    let mut at = 0;
    (0..k)
        .map(|j| {
            let n = ((j + 1) * count / k - j * count / k) * dtype.size();
            at += n;
            (at - n, n)
        })
        .collect()
}

/// The tag and ordinal piece `j` of the message with `tag` and ordinal `first` travels with:
/// the first piece as the message itself, the others under the message's piece tag, at ordinals
/// that follow from the first piece's, so no other message's pieces can take them.
fn piece_key(tag: u64, first: u32, j: usize) -> (u64, u32) {
    if j == 0 {
        (tag, first)
    } else {
        (PIECE_TAGS | tag, first.wrapping_mul(MAX_PIECES as u32).wrapping_add(j as u32))
    }
}

/// Queues `data` for `peer` with `tag`.
pub(crate) fn start_send(session: &Arc<Session>, peer: usize, tag: u64, dtype: DType, data: RawBuf, what: Arc<str>) -> Result<P2pStarted> {
    if let Some(err) = session.broken() {
        return Err(PlaitError::Broken(err.to_string()));
    }
    let start = Instant::now();
    let transfers = Transfers::new(session, what.clone(), P2pMemory::Send);
    let count = data.len / dtype.size();
    let parts = pieces(count, dtype, tag);
    let first = session.p2p_ordinal(peer, tag);
    for (j, &(at, len)) in parts.iter().enumerate() {
        let (t, ordinal) = piece_key(tag, first, j);
        let header = FrameHeader::p2p(t, ordinal, dtype as u8, count as u64, len as u64);
        // SAFETY: at + len <= data.len (the pieces tile the message).
        session.send_frame(peer, header, unsafe { data.ptr.add(at) }, len, None, what.clone(), 0, transfers.issue());
    }
    Ok(P2pStarted { transfers, start, what, peer, events: parts.len(), rest: None })
}

/// Posts a receive into `dst` from `src` (any peer when None) with `tag`.
pub(crate) fn start_recv(session: &Arc<Session>, src: Option<usize>, tag: u64, dtype: DType, dst: RawBuf, what: Arc<str>) -> Result<P2pStarted> {
    if let Some(err) = session.broken() {
        return Err(PlaitError::Broken(err.to_string()));
    }
    let start = Instant::now();
    let mut copy = session.mailbox.pool.take(dst.len);
    let count = dst.len / dtype.size();
    let parts = pieces(count, dtype, tag);
    // SAFETY: dst is the caller's buffer and copy ours (owned by the transfers below), both
    // dst.len bytes, alive until every piece has reported or been withdrawn; the pieces tile them.
    let keeps: Vec<Arc<Keep>> =
        parts.iter().map(|&(at, len)| Arc::new(unsafe { Keep::new(dst.ptr.add(at), copy.as_mut_ptr().add(at), len) })).collect();
    let transfers = Transfers::new(session, what.clone(), P2pMemory::Recv { keeps: keeps.clone(), copy });
    let receive = Receive { tag, dtype, dst, pieces: parts };
    let first = session.mailbox.post_p2p(src, tag, receive.piece(0, &transfers, &keeps, &what));
    let k = receive.pieces.len();
    let (events, rest) = match (src, first) {
        (Some(peer), Some(first)) => {
            receive.post_rest(session, peer, first, &transfers, &keeps, &what);
            (k, None)
        }
        _ if k > 1 => (1, Some(receive)),
        _ => (1, None),
    };
    Ok(P2pStarted { transfers, start, what, peer: src.unwrap_or(usize::MAX), events, rest })
}

/// Waits for a started transfer; returns the peer it was with. On failure a receive's buffer
/// holds what it held before.
pub(crate) fn finish_p2p(session: &Session, p: P2pStarted, timeout: Duration) -> Result<usize> {
    finish_p2p_landed(session, p, timeout).map(|(peer, _)| peer)
}

/// `finish_p2p`, and when the transfer completed (a receive: when its last piece had landed), which
/// may be well before this returns when the caller waited for another transfer meanwhile.
pub(crate) fn finish_p2p_landed(session: &Session, mut p: P2pStarted, timeout: Duration) -> Result<(usize, Instant)> {
    let doing = match p.transfers.memory {
        P2pMemory::Send => "take this message",
        P2pMemory::Recv { .. } => "send",
    };
    crate::failpoint::hit("p2p.wait");
    let mut result = Ok(p.peer);
    let mut left = p.events;
    let mut landed: Option<Instant> = None;
    while left > 0 {
        let waited_for = if p.peer == usize::MAX { 0 } else { p.peer };
        match wait_one(session, &p.transfers, p.start, timeout, &p.what, waited_for, doing) {
            Ok((source, ordinal, at)) => {
                (p.peer, left) = (source, left - 1);
                landed = landed.max(Some(at));
                if let (Some(rest), P2pMemory::Recv { keeps, .. }) = (p.rest.take(), &p.transfers.memory) {
                    // The first piece named the sender and its ordinal: the other pieces follow.
                    left += rest.pieces.len() - 1;
                    rest.post_rest(session, source, ordinal, &p.transfers, keeps, &p.what);
                }
                result = Ok(source);
            }
            Err(err) => {
                result = Err(err);
                break;
            }
        }
    }
    match result {
        Ok(source) => Ok((source, landed.unwrap_or_else(Instant::now))),
        Err(err) => {
            let first = session.fail(err, true);
            // The link thread of a transfer under way reports once the shut socket fails it;
            // only then is the caller's memory free of it.
            p.transfers.withdraw();
            if let P2pMemory::Recv { keeps, .. } = &p.transfers.memory {
                keeps.iter().for_each(|k| k.restore());
            }
            Err(with_waited(first.for_op(&p.what), p.start.elapsed()))
        }
    }
}

/// Sends `data` to `peer` with `tag`; returns once it is on the wire.
pub(crate) fn send_p2p(session: &Arc<Session>, peer: usize, tag: u64, dtype: DType, data: RawBuf, timeout: Duration, what: Arc<str>) -> Result<()> {
    finish_p2p(session, start_send(session, peer, tag, dtype, data, what)?, timeout).map(|_| ())
}

/// Receives into `dst` from `src` (any peer when None) with `tag`; returns the sender.
pub(crate) fn recv_p2p(session: &Arc<Session>, src: Option<usize>, tag: u64, dtype: DType, dst: RawBuf, timeout: Duration, what: Arc<str>) -> Result<usize> {
    finish_p2p(session, start_recv(session, src, tag, dtype, dst, what)?, timeout)
}

/// Waits for one event of a point-to-point transfer: its source, and the token the mailbox set
/// (an any-source receive's: the ordinal of the message it took).
fn wait_one(session: &Session, transfers: &Transfers<P2pMemory>, start: Instant, timeout: Duration, what: &str, peer: usize, doing: &str) -> Result<(usize, u32, Instant)> {
    let deadline = start + timeout;
    loop {
        match transfers.next_event(deadline.min(Instant::now() + Duration::from_millis(100)), deadline) {
            Ok(ev) => return ev.result.map(|_| (ev.source, ev.token, ev.at)),
            Err(_) => {
                if let Some(err) = session.broken() {
                    return Err(err);
                }
                if Instant::now() >= deadline {
                    return Err(PlaitError::Timeout {
                        op: what.to_string(),
                        waiting_on: format!("rank {peer} ({}) to {doing}", session.peer_addr(peer)),
                        waited: start.elapsed(),
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_messages_split_into_whole_element_pieces_that_tile_them() {
        let mib = 1 << 20;
        assert_eq!(pieces(0, DType::F32, 1), vec![(0, 0)]);
        assert_eq!(pieces((2 * PIECE_MIN_BYTES - 1) / 1, DType::U8, 1).len(), 1, "just below twice a piece: whole");
        assert_eq!(pieces(2 * PIECE_MIN_BYTES, DType::U8, 1).len(), 2);
        assert_eq!(pieces(64 * mib / 4, DType::F32, 1).len(), MAX_PIECES);
        assert_eq!(pieces(1024 * mib, DType::U8, 1).len(), MAX_PIECES, "never more than MAX_PIECES");
        assert_eq!(pieces(64 * mib, DType::U8, PIECE_TAG_LIMIT).len(), 1, "tags without a piece tag go whole");
        for (count, dtype) in [(3_000_001usize, DType::F32), (8_388_609, DType::U8), (5_000_003, DType::F64), (40_000_000, DType::BF16)] {
            let p = pieces(count, dtype, 7);
            let mut at = 0;
            for &(off, len) in &p {
                assert_eq!(off, at, "{count} {dtype:?}: pieces follow each other");
                assert_eq!(len % dtype.size(), 0, "{count} {dtype:?}: whole elements");
                assert!(len >= PIECE_MIN_BYTES - dtype.size() || p.len() == 1, "{count} {dtype:?}: {len}");
                at += len;
            }
            assert_eq!(at, count * dtype.size(), "{count} {dtype:?}: the pieces tile the message");
        }
    }

    #[test]
    fn piece_keys_of_different_messages_never_meet() {
        let mut seen = std::collections::HashSet::new();
        for first in 0..64u32 {
            for j in 0..MAX_PIECES {
                assert!(seen.insert(piece_key(5, first, j)), "message {first} piece {j}");
            }
        }
        assert_eq!(piece_key(5, 9, 0), (5, 9));
        let (t, _) = piece_key(5, 9, 1);
        assert!(t >= crate::net::frame::RESERVED_TAGS && t != 5 && t & !PIECE_TAGS == 5);
    }
}
