//! Waiting for an operation's events: on the links' threads' reports, or reading the links on
//! this thread (small calls); and what a failure is blamed on while waiting.

use crate::error::PlaitError;
use crate::session::{Event, Session};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::cell::Cell;
use std::time::{Duration, Instant};

/// The next event of an operation, waiting until `until`. While callers read the links (a
/// small operation run on the waiting thread), this thread reads frames itself meanwhile and
/// finishes a frame it began by `frame_deadline` (the operation's deadline).
///
/// For the session's busy-poll budget it does not sleep: it polls the links and yields its core
/// between polls. `spin_until` is when the budget ends, set the first time the operation would
/// sleep, so that one operation spends it once over all its waits.
///
/// Why: sleeping costs a small operation most of its time where ranks share cores, because
/// every message must wake this thread (an inter-processor interrupt) and the scheduler switch
/// back to it. A thread that yields instead lets the ranks it waits for run on its core and
/// finds their frames on its next poll; where every rank has a core of its own, yielding
/// returns at once and this is plain busy polling.
pub(super) fn next_event(
    session: &Session,
    rx: &Receiver<Event>,
    until: Instant,
    frame_deadline: Instant,
    spin_until: &Cell<Option<Instant>>,
) -> std::result::Result<Event, RecvTimeoutError> {
    loop {
        if !session.caller_progress() {
            // Another operation (of this group or another on the same links) may switch the links
            // to caller reading meanwhile: then nobody reads for this one unless it does.
            let watch = session.watch_switch();
            if !session.caller_progress() {
                crossbeam_channel::select! {
                    recv(rx) -> ev => return ev.map_err(|_| RecvTimeoutError::Disconnected),
                    recv(watch.switched) -> _ => continue,
                    default(until.saturating_duration_since(Instant::now())) => return Err(RecvTimeoutError::Timeout),
                }
            }
            continue;
        }
        match rx.try_recv() {
            Ok(ev) => return Ok(ev),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        let now = Instant::now();
        if now >= until {
            return Err(RecvTimeoutError::Timeout);
        }
        let spin_end = spin_until.get().unwrap_or_else(|| {
            let end = now + session.busy_poll;
            spin_until.set(Some(end));
            end
        });
        if now < spin_end {
            if !session.progress(Duration::ZERO, frame_deadline) {
                std::thread::yield_now();
            }
            continue;
        }
        // Short waits: a send finished by a link's sender thread reports through `rx`, not a socket.
        session.progress((until - now).min(Duration::from_millis(2)), frame_deadline);
    }
}

/// A transfer that failed because its peer's socket closed says little about why: the peer may
/// have closed it because a third rank failed. Give the communicator a moment to learn the real
/// cause (an Abort frame, or the dead rank's own link closing) before blaming that peer.
pub(super) fn better_explained(session: &Session, err: PlaitError) -> PlaitError {
    if !matches!(err, PlaitError::Peer { .. }) {
        return err;
    }
    let until = Instant::now() + Duration::from_millis(250);
    while Instant::now() < until {
        if let Some(first) = session.broken() {
            return first;
        }
        // While callers read the links, the cause arrives only if this thread reads it.
        if session.caller_progress() {
            session.progress(Duration::from_millis(5), until);
        } else {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    err
}

pub(super) fn with_waited(err: PlaitError, waited: Duration) -> PlaitError {
    match err {
        PlaitError::Peer { op, peer, addr, what, .. } => PlaitError::Peer { op, peer, addr, what, waited },
        other => other,
    }
}

