//! Point-to-point transfers. Starting one (taking its ordinal, queueing its frame or posting its
//! receive) happens on the caller's thread, in call order, so transfers with the same peer and
//! tag match in the order they were called; only the waiting may run later, on a worker.

use super::transfers::{OpMemory, Transfers};
use super::wait::with_waited;
use crate::codec::Wire;
use crate::dtype::DType;
use crate::error::{PlaitError, Result};
use crate::net::frame::{CallId, FrameHeader};
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
}

/// A receive keeps what it overwrites (in `copy`), to put back if it fails.
enum P2pMemory {
    Send,
    Recv { keep: Arc<Keep>, copy: Vec<u8> },
}

impl OpMemory for P2pMemory {
    fn give_back(&mut self, pool: &BufferPool) {
        if let P2pMemory::Recv { copy, .. } = self {
            pool.give(std::mem::take(copy));
        }
    }
}

/// Queues `data` for `peer` with `tag`.
pub(crate) fn start_send(session: &Arc<Session>, peer: usize, tag: u64, dtype: DType, data: RawBuf, what: Arc<str>) -> Result<P2pStarted> {
    if let Some(err) = session.broken() {
        return Err(PlaitError::Broken(err.to_string()));
    }
    let start = Instant::now();
    let transfers = Transfers::new(session, what.clone(), P2pMemory::Send);
    let count = (data.len / dtype.size()) as u64;
    let header = FrameHeader::p2p(tag, session.p2p_ordinal(peer, tag), dtype as u8, count, data.len as u64);
    session.send_frame(peer, header, data.ptr, data.len, None, what.clone(), 0, transfers.issue());
    Ok(P2pStarted { transfers, start, what, peer })
}

/// Posts a receive into `dst` from `src` (any peer when None) with `tag`.
pub(crate) fn start_recv(session: &Arc<Session>, src: Option<usize>, tag: u64, dtype: DType, dst: RawBuf, what: Arc<str>) -> Result<P2pStarted> {
    if let Some(err) = session.broken() {
        return Err(PlaitError::Broken(err.to_string()));
    }
    let start = Instant::now();
    let mut copy = session.mailbox.pool.take(dst.len);
    // SAFETY: dst is the caller's buffer and copy ours (owned by the transfers below), both
    // dst.len bytes, alive until the receive has reported or been withdrawn.
    let keep = Arc::new(unsafe { Keep::new(dst.ptr, copy.as_mut_ptr(), dst.len) });
    let transfers = Transfers::new(session, what.clone(), P2pMemory::Recv { keep: keep.clone(), copy });
    let call = CallId { dtype: dtype as u8, ..Default::default() };
    let expect = Expect { call, count: (dst.len / dtype.size()) as u64, nbytes: dst.len as u64, what: what.clone() };
    let landing = Landing::Copy { dst: dst.ptr, keep: Some(keep) };
    let posted = Posted { landing, len: dst.len, wire: Wire::Native, expect, op_id: transfers.op_id(), token: 0, events: transfers.issue(), reported: false };
    session.mailbox.post_p2p(src, tag, posted);
    Ok(P2pStarted { transfers, start, what, peer: src.unwrap_or(usize::MAX) })
}

/// Waits for a started transfer; returns the peer it was with. On failure a receive's buffer
/// holds what it held before.
pub(crate) fn finish_p2p(session: &Session, p: P2pStarted, timeout: Duration) -> Result<usize> {
    let doing = match p.transfers.memory {
        P2pMemory::Send => "take this message",
        P2pMemory::Recv { .. } => "send",
    };
    let waited_for = if p.peer == usize::MAX { 0 } else { p.peer };
    crate::failpoint::hit("p2p.wait");
    match wait_one(session, &p.transfers, p.start, timeout, &p.what, waited_for, doing) {
        Ok(source) => Ok(source),
        Err(err) => {
            let first = session.fail(err, true);
            // The link thread of a transfer under way reports once the shut socket fails it;
            // only then is the caller's memory free of it.
            p.transfers.withdraw();
            if let P2pMemory::Recv { keep, .. } = &p.transfers.memory {
                keep.restore();
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

/// Waits for the single event of a point-to-point transfer.
fn wait_one(session: &Session, transfers: &Transfers<P2pMemory>, start: Instant, timeout: Duration, what: &str, peer: usize, doing: &str) -> Result<usize> {
    let deadline = start + timeout;
    loop {
        match transfers.next_event(deadline.min(Instant::now() + Duration::from_millis(100)), deadline) {
            Ok(ev) => return ev.result.map(|_| ev.source),
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
