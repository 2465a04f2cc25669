//! What an executing operation needs from its communicator: the links, the mailbox, and the
//! one-way switch that marks the communicator failed.

use super::mailbox::Mailbox;
use crate::error::PlaitError;
use crate::net::frame::FrameKind;
use crate::net::peer::PeerLink;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Fabric {
    pub rank: usize,
    pub size: usize,
    pub links: Vec<Option<Arc<PeerLink>>>,
    pub mailbox: Arc<Mailbox>,
    broken: Mutex<Option<PlaitError>>,
    next_op_id: AtomicU64,
    p2p_send_next: Mutex<HashMap<(usize, u64), u32>>,
}

/// The Abort frame's payload: the rank to blame, its address, and what happened, one per line,
/// so the peers report the culprit itself rather than the rank that relayed the news.
fn abort_reason(me: usize, err: &PlaitError) -> String {
    match err {
        PlaitError::Peer { peer, addr, what, .. } => format!("{peer}\n{addr}\n{what}"),
        other => format!("{me}\n\n{other}"),
    }
}

/// Reads an Abort payload sent by `sender`: (culprit, address, what happened).
pub fn parse_abort_reason(sender: usize, text: &str) -> (usize, String, String) {
    let mut lines = text.splitn(3, '\n');
    match (lines.next().and_then(|l| l.parse().ok()), lines.next(), lines.next()) {
        (Some(culprit), Some(addr), Some(what)) => (culprit, addr.to_string(), what.to_string()),
        _ => (sender, String::new(), text.to_string()),
    }
}

impl Fabric {
    pub fn new(rank: usize, size: usize, mailbox: Arc<Mailbox>) -> Fabric {
        Fabric {
            rank,
            size,
            links: (0..size).map(|_| None).collect(),
            mailbox,
            broken: Mutex::new(None),
            next_op_id: AtomicU64::new(1),
            p2p_send_next: Mutex::new(HashMap::new()),
        }
    }

    pub fn link(&self, peer: usize) -> &PeerLink {
        self.links[peer].as_deref().expect("no link to self")
    }

    pub fn peer_addr(&self, peer: usize) -> String {
        self.links.get(peer).and_then(|l| l.as_ref()).map(|l| l.addr.clone()).unwrap_or_default()
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
        {
            let mut b = self.broken.lock();
            if let Some(first) = b.as_ref() {
                return first.clone();
            }
            *b = Some(err.clone());
        }
        tracing::warn!(rank = self.rank, "communicator failed: {err}");
        self.mailbox.fail(&err);
        // Stop reading first: our receivers return, while the peers still get the reason
        // before they see the connection close (and so blame the right rank).
        for link in self.links.iter().flatten() {
            link.stop_reading();
        }
        if tell_peers {
            self.broadcast_control(FrameKind::Abort, abort_reason(self.rank, &err), Duration::from_secs(1));
        }
        for link in self.links.iter().flatten() {
            link.shutdown();
        }
        err
    }

    /// Sends a control frame to every peer ahead of queued data and waits (bounded) until
    /// the frames are written, so that peers learn the reason before they see the socket close.
    pub fn broadcast_control(&self, kind: FrameKind, text: String, grace: Duration) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut sent = 0;
        for link in self.links.iter().flatten() {
            let tx = tx.clone();
            link.send_urgent(kind, text.clone().into_bytes(), Some(Box::new(move |r| {
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

    pub fn join_links(&self) {
        for link in self.links.iter().flatten() {
            link.join();
        }
    }
}
