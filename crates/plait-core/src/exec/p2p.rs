//! Point-to-point transfers. Starting one (taking its ordinal, queueing its frame or posting its
//! receive) happens on the caller's thread, in call order, so transfers with the same peer and
//! tag match in the order they were called; only the waiting may run later, on a worker.

use super::wait::{next_event, with_waited};
use crate::codec::Wire;
use crate::dtype::DType;
use crate::error::{PlaitError, Result};
use crate::net::frame::{CallId, FrameHeader};
use crate::raw::RawBuf;
use crate::session::{Event, Expect, Keep, Landing, Posted, Session};
use crossbeam_channel::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A point-to-point transfer that has been started (its ordinal taken, its frame queued or its
/// receive posted) and not yet waited for. Starting happens on the caller's thread, in call
/// order, so transfers with the same peer and tag match in the order they were called.
pub(crate) struct P2pStarted {
    rx: Receiver<Event>,
    start: Instant,
    what: Arc<str>,
    peer: usize,
    kind: P2pKind,
}

enum P2pKind {
    Send,
    /// `keep` holds what the receive overwrote (in `copy`), to put back if it fails.
    Recv { keep: Arc<Keep>, copy: Vec<u8>, op_id: u64 },
}

/// Queues `data` for `peer` with `tag`.
pub(crate) fn start_send(session: &Session, peer: usize, tag: u64, dtype: DType, data: RawBuf, what: Arc<str>) -> Result<P2pStarted> {
    if let Some(err) = session.broken() {
        return Err(PlaitError::Broken(err.to_string()));
    }
    let start = Instant::now();
    let (tx, rx) = crossbeam_channel::bounded(1);
    let count = (data.len / dtype.size()) as u64;
    let header = FrameHeader::p2p(tag, session.p2p_ordinal(peer, tag), dtype as u8, count, data.len as u64);
    session.send_frame(peer, header, data.ptr, data.len, None, what.clone(), 0, tx);
    Ok(P2pStarted { rx, start, what, peer, kind: P2pKind::Send })
}

/// Posts a receive into `dst` from `src` (any peer when None) with `tag`.
pub(crate) fn start_recv(session: &Session, src: Option<usize>, tag: u64, dtype: DType, dst: RawBuf, what: Arc<str>) -> Result<P2pStarted> {
    if let Some(err) = session.broken() {
        return Err(PlaitError::Broken(err.to_string()));
    }
    let start = Instant::now();
    let mut copy = session.mailbox.pool.take(dst.len);
    // SAFETY: dst is the caller's buffer and copy ours, both dst.len bytes, alive until the
    // receive has completed or been cancelled (finish_p2p).
    let keep = Arc::new(unsafe { Keep::new(dst.ptr, copy.as_mut_ptr(), dst.len) });
    let (tx, rx) = crossbeam_channel::bounded(1);
    let op_id = session.op_id();
    let call = CallId { dtype: dtype as u8, ..Default::default() };
    let expect = Expect { call, count: (dst.len / dtype.size()) as u64, nbytes: dst.len as u64, what: what.clone() };
    session.mailbox.post_p2p(src, tag, Posted { landing: Landing::Copy { dst: dst.ptr, keep: Some(keep.clone()) }, len: dst.len, wire: Wire::Native, expect, op_id, token: 0, events: tx });
    Ok(P2pStarted { rx, start, what, peer: src.unwrap_or(usize::MAX), kind: P2pKind::Recv { keep, copy, op_id } })
}

/// Waits for a started transfer; returns the peer it was with. On failure a receive's buffer
/// holds what it held before.
pub(crate) fn finish_p2p(session: &Session, p: P2pStarted, timeout: Duration) -> Result<usize> {
    let doing = match p.kind {
        P2pKind::Send => "take this message",
        P2pKind::Recv { .. } => "send",
    };
    let waited_for = if p.peer == usize::MAX { 0 } else { p.peer };
    let outcome = wait_one(session, &p.rx, p.start, timeout, &p.what, waited_for, doing);
    let result = match outcome {
        Ok(source) => Ok(source),
        Err((err, under_way)) => {
            let first = session.fail(err, true);
            let still_posted = match &p.kind {
                P2pKind::Recv { op_id, .. } => session.mailbox.cancel(*op_id) == 0,
                P2pKind::Send => true,
            };
            if under_way && still_posted {
                // The link thread reports once the shut socket fails it; only then is the
                // caller's memory free of it.
                let _ = p.rx.recv_timeout(Duration::from_secs(10));
            }
            if let P2pKind::Recv { keep, .. } = &p.kind {
                keep.restore();
            }
            Err(with_waited(first.for_op(&p.what), p.start.elapsed()))
        }
    };
    if let P2pKind::Recv { copy, .. } = p.kind {
        session.mailbox.pool.give(copy);
    }
    result
}

/// Sends `data` to `peer` with `tag`; returns once it is on the wire.
pub(crate) fn send_p2p(session: &Session, peer: usize, tag: u64, dtype: DType, data: RawBuf, timeout: Duration, what: Arc<str>) -> Result<()> {
    finish_p2p(session, start_send(session, peer, tag, dtype, data, what)?, timeout).map(|_| ())
}

/// Receives into `dst` from `src` (any peer when None) with `tag`; returns the sender.
pub(crate) fn recv_p2p(session: &Session, src: Option<usize>, tag: u64, dtype: DType, dst: RawBuf, timeout: Duration, what: Arc<str>) -> Result<usize> {
    finish_p2p(session, start_recv(session, src, tag, dtype, dst, what)?, timeout)
}

/// Waits for the single event of a point-to-point transfer. On error, says whether the
/// transfer is still under way (its event not yet received).
fn wait_one(session: &Session, rx: &Receiver<Event>, start: Instant, timeout: Duration, what: &str, peer: usize, doing: &str) -> std::result::Result<usize, (PlaitError, bool)> {
    let deadline = start + timeout;
    loop {
        match next_event(session, rx, deadline.min(Instant::now() + Duration::from_millis(100)), deadline) {
            Ok(ev) => return ev.result.map(|_| ev.source).map_err(|e| (e, false)),
            Err(_) => {
                if let Some(err) = session.broken() {
                    return Err((err, true));
                }
                if Instant::now() >= deadline {
                    return Err((PlaitError::Timeout {
                        op: what.to_string(),
                        waiting_on: format!("rank {peer} ({}) to {doing}", session.peer_addr(peer)),
                        waited: start.elapsed(),
                    }, true));
                }
            }
        }
    }
}
