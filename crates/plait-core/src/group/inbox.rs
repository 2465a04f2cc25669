//! Turns what the links report into mailbox deliveries and communicator failures.

use crate::error::PlaitError;
use crate::exec::fabric::{AbortReason, Fabric};
use crate::exec::mailbox::Mailbox;
use crate::net::frame::{FrameHeader, FrameKind};
use crate::net::peer::Inbox;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::{self, Read};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long an unexplained closed link waits before it is blamed: a rank that fails on purpose
/// says why (an Abort frame) before it closes, and when a peer dies every survivor's own link
/// to it closes within this time too, so the report names the rank that really died.
const DOWN_GRACE: Duration = Duration::from_millis(100);

pub(super) struct CommInbox {
    mailbox: Arc<Mailbox>,
    fabric: Mutex<Weak<Fabric>>,
    /// A failure reported before the fabric existed (during set-up).
    early: Mutex<Option<(PlaitError, bool)>>,
    /// Links seen closing without explanation: (peer, when, why).
    downs: Mutex<Vec<(usize, Instant, String)>>,
    /// Pings that arrived before the fabric existed, answered on attach.
    early_pings: Mutex<Vec<(usize, FrameHeader, Vec<u8>)>>,
    /// A link silent for longer than this (several missed heartbeats) is cut off or hung.
    quiet: Duration,
    /// Close frames received per peer: one comes on each of its lanes, and the peer has closed
    /// once all have (data sent earlier on another lane may still be on its way before that).
    closes: Mutex<HashMap<usize, usize>>,
}

impl CommInbox {
    pub(super) fn new(mailbox: Arc<Mailbox>, heartbeat: Duration) -> Self {
        CommInbox {
            mailbox,
            fabric: Mutex::new(Weak::new()),
            early: Mutex::new(None),
            downs: Mutex::new(Vec::new()),
            early_pings: Mutex::new(Vec::new()),
            quiet: heartbeat * 3,
            closes: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn attach(&self, fabric: &Arc<Fabric>) {
        {
            // Hold the slot while answering early pings, so a ping arriving now waits its turn.
            let mut slot = self.fabric.lock();
            *slot = Arc::downgrade(fabric);
            for (peer, h, word) in self.early_pings.lock().drain(..) {
                answer_ping(fabric, peer, &h, word);
            }
        }
        if let Some((err, tell)) = self.early.lock().take() {
            fabric.fail(err, tell);
        }
    }

    fn fail(&self, err: PlaitError, tell_peers: bool) {
        let fabric = self.fabric.lock().upgrade();
        match fabric {
            Some(f) => {
                f.fail(err, tell_peers);
            }
            None => {
                self.mailbox.fail(&err);
                self.early.lock().get_or_insert((err, tell_peers));
            }
        }
    }

    fn fail_relaying(&self, err: PlaitError, reason: AbortReason) {
        let fabric = self.fabric.lock().upgrade();
        match fabric {
            Some(f) => {
                f.fail_with(err, Some(reason));
            }
            None => self.fail(err, false),
        }
    }

    /// What an Abort frame from `sender` means here: the error this rank's operations fail with.
    fn explain_abort(&self, sender: usize, reason: &AbortReason) -> PlaitError {
        let via = if reason.reporter == sender { String::new() } else { format!(", relayed by rank {sender}") };
        let fabric = self.fabric.lock().upgrade();
        let me = fabric.as_ref().map(|f| f.rank);
        let (mut blamed, mut addr, mut what) = if reason.culprit == reason.reporter {
            (reason.reporter, self.addr(reason.reporter), format!("failed: {}{via}", reason.what))
        } else if Some(reason.culprit) == me {
            // The reporter lost contact with this rank (a dead link between the two): from
            // here, the reporter is the peer that is out of reach.
            (reason.reporter, self.addr(reason.reporter), format!("lost contact with this rank and gave up ({}){via}", reason.what))
        } else {
            let addr = if reason.addr.is_empty() { self.addr(reason.culprit) } else { reason.addr.clone() };
            (reason.culprit, addr, format!("{} (reported by rank {}{via})", reason.what, reason.reporter))
        };
        // A link of this rank that went quiet (a cut cable, a stopped process), other than the
        // ones the report is about.
        let silent = fabric
            .map(|f| f.silent_peers(self.quiet))
            .unwrap_or_default()
            .into_iter()
            .find(|(p, _)| ![sender, reason.culprit, reason.reporter].contains(p));
        if let Some((p, d)) = silent {
            if blamed == reason.reporter {
                // The reporter most likely gave up because this rank was itself waiting on its
                // silent link: that link is the cause here.
                what = format!("silent for {d:.1?} (cut off, stopped or hung); meanwhile rank {blamed} {what}");
                (blamed, addr) = (p, self.addr(p));
            } else {
                what = format!("{what}; rank {p} ({}) has also been silent for {d:.1?}", self.addr(p));
            }
        }
        PlaitError::Peer { op: String::new(), peer: blamed, addr, what, waited: Duration::ZERO }
    }

    fn addr(&self, peer: usize) -> String {
        self.fabric.lock().upgrade().map(|f| f.peer_addr(peer)).unwrap_or_default()
    }
}

fn answer_ping(f: &Fabric, peer: usize, h: &FrameHeader, word: Vec<u8>) {
    let pong = FrameHeader {
        kind: FrameKind::P2p as u8,
        dtype: h.dtype,
        seq: super::PONG_TAG,
        ordinal: f.p2p_ordinal(peer, super::PONG_TAG),
        count: word.len() as u64,
        ..Default::default()
    };
    f.link(peer).send_owned(pong, word);
}

fn read_text(payload: &mut dyn Read, max: usize) -> io::Result<String> {
    let mut buf = Vec::new();
    payload.read_to_end(&mut buf)?;
    buf.truncate(max);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

impl Inbox for CommInbox {
    fn deliver(&self, peer: usize, h: &FrameHeader, payload: &mut dyn Read) -> io::Result<()> {
        match FrameKind::from_u8(h.kind) {
            Some(FrameKind::P2p) if h.seq == super::PING_TAG => {
                // Answered here, on the receiver thread, so the prober measures the link alone.
                let word = read_text(payload, 8)?.into_bytes();
                let slot = self.fabric.lock();
                match slot.upgrade() {
                    Some(f) => answer_ping(&f, peer, h, word),
                    None => self.early_pings.lock().push((peer, *h, word)),
                }
                Ok(())
            }
            Some(FrameKind::Data) | Some(FrameKind::P2p) => self.mailbox.deliver(peer, h, payload),
            Some(FrameKind::Abort) => {
                let reason = AbortReason::parse(peer, &read_text(payload, 4096)?);
                let err = self.explain_abort(peer, &reason);
                // Passed on once, so that ranks the reporter cannot reach still hear the reason
                // before this rank's links close.
                self.fail_relaying(err, reason);
                Ok(())
            }
            Some(FrameKind::Close) => {
                read_text(payload, 0)?;
                let lanes = self.fabric.lock().upgrade().and_then(|f| f.links.get(peer)?.as_ref().map(|l| l.lanes())).unwrap_or(1);
                let closes = {
                    let mut c = self.closes.lock();
                    let n = c.entry(peer).or_insert(0);
                    *n += 1;
                    *n
                };
                if closes < lanes {
                    return Ok(());
                }
                let err = PlaitError::Peer {
                    op: String::new(),
                    peer,
                    addr: self.addr(peer),
                    what: "closed its communicator".into(),
                    waited: Duration::ZERO,
                };
                // Operations that no longer need this peer go on; those waiting for it fail.
                self.mailbox.peer_closed(peer, &err);
                Ok(())
            }
            _ => read_text(payload, 0).map(|_| ()),
        }
    }

    fn link_down(&self, peer: usize, error: io::Error, clean: bool) {
        if clean {
            return;
        }
        let what = match error.kind() {
            io::ErrorKind::UnexpectedEof => "closed the connection (the process exited or was killed)".to_string(),
            io::ErrorKind::ConnectionReset => "reset the connection (the process died or the link dropped)".to_string(),
            io::ErrorKind::InvalidData => format!("sent data this rank cannot read: {error}"),
            _ => format!("link failed: {error}"),
        };
        let first = {
            let mut downs = self.downs.lock();
            // With several lanes to a peer, each lane reports its end: the first one tells.
            if downs.iter().any(|(p, _, _)| *p == peer) {
                return;
            }
            downs.push((peer, Instant::now(), what));
            downs.len() == 1
        };
        if !first {
            return;
        }
        std::thread::sleep(DOWN_GRACE);
        if self.fabric.lock().upgrade().is_some_and(|f| f.broken().is_some()) {
            return;
        }
        let downs = self.downs.lock().clone();
        let (peer, _, what) = &downs[0];
        let mut what = what.clone();
        if downs.len() > 1 {
            let others: Vec<String> = downs[1..]
                .iter()
                .map(|(p, t, _)| format!("rank {p} ({}, {:.0?} later)", self.addr(*p), t.duration_since(downs[0].1)))
                .collect();
            what = format!("{what}; the links to {} closed too", others.join(", "));
        }
        let err = PlaitError::Peer { op: String::new(), peer: *peer, addr: self.addr(*peer), what, waited: Duration::ZERO };
        self.fail(err, true);
    }
}
