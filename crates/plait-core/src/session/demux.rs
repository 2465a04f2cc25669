//! Routes what the links report: data and point-to-point frames to the mailbox, link probes
//! answered at once, Close and Abort frames and links that end turned into peer closures and
//! communicator failures (with the blame worked out in `blame`).

use super::blame::{self, Down};
use super::groups::Groups;
use super::mailbox::Mailbox;
use super::Session;
use crate::error::PlaitError;
use crate::net::frame::{AbortReason, FrameHeader, FrameKind, PING_TAG, PONG_TAG, REASON_MAX_BYTES};
use crate::net::peer::{Delivery, Inbox, LaneWaker, PeerLink, SendBuf, SendDone, SendReq};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet};
use std::io::{self, Read};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long an unexplained closed link waits before it is blamed: a rank that fails on purpose
/// says why (an Abort frame) before it closes, and when a peer dies every survivor's own link
/// to it closes within this time too, so the report names the rank that really died.
const DOWN_GRACE: Duration = Duration::from_millis(100);

pub(crate) struct Demux {
    mailbox: Arc<Mailbox>,
    session: Mutex<Weak<Session>>,
    /// A failure reported before the session existed (during set-up).
    early: Mutex<Option<(PlaitError, bool)>>,
    /// Links seen closing without explanation: (peer, when, why).
    downs: Mutex<Vec<Down>>,
    /// Pings that arrived before the session existed, answered on attach.
    early_pings: Mutex<Vec<(usize, FrameHeader, Vec<u8>)>>,
    /// A link silent for longer than this (several missed heartbeats) is cut off or hung.
    quiet: Duration,
    /// Close frames received per peer: one comes on each of its lanes, and the peer has closed
    /// once all have (data sent earlier on another lane may still be on its way before that).
    closes: Mutex<HashMap<usize, usize>>,
    /// The subgroups sharing these links (the owner's demux only): frames of a group go there.
    groups: Option<Arc<Groups>>,
    /// Frames this rank passes on for ranks that cannot reach each other (`relay`).
    forwarding: Arc<Forwarding>,
}

/// The most bytes a relaying rank holds, per rank it passes frames on to, before it reads no more
/// relayed frames for that rank (they wait in their senders' sockets, as a parked frame does).
/// One frame larger than this is passed on when nothing else is held.
const FORWARD_MAX: u64 = 64 << 20;

/// Bytes passed on and not yet written, per destination, and the lanes waiting for room; the
/// pairs this rank relays and the Close frames it passed on between them.
#[derive(Default)]
struct Forwarding {
    state: Mutex<(HashMap<usize, u64>, Vec<LaneWaker>)>,
    closes: Mutex<Closes>,
    closed: Condvar,
}

#[derive(Default)]
struct Closes {
    pairs: Vec<(usize, usize)>,
    /// (from, to): a Close passed on from `from` to `to`.
    seen: HashSet<(usize, usize)>,
}

impl Forwarding {
    /// Claims room for `n` bytes to `dest`, or keeps `lane` to wake once some frees.
    fn claim(&self, dest: usize, n: u64, lane: Option<&LaneWaker>) -> bool {
        let mut st = self.state.lock();
        let held = st.0.get(&dest).copied().unwrap_or(0);
        if held > 0 && held.saturating_add(n) > FORWARD_MAX {
            if let Some(lane) = lane {
                if !st.1.iter().any(|w| w.same(lane)) {
                    st.1.push(lane.clone());
                }
                return false;
            }
        }
        *st.0.entry(dest).or_insert(0) += n;
        true
    }

    fn passed_close(&self, from: usize, to: usize) {
        self.closes.lock().seen.insert((from, to));
        self.closed.notify_all();
    }

    fn release(&self, dest: usize, n: u64) {
        let waiting = {
            let mut st = self.state.lock();
            if let Some(held) = st.0.get_mut(&dest) {
                *held = held.saturating_sub(n);
            }
            std::mem::take(&mut st.1)
        };
        for lane in waiting {
            lane.wake();
        }
    }
}

impl Demux {
    /// `groups`: this demux is the links' own (their owner's), and routes subgroups' frames there.
    pub(crate) fn new(mailbox: Arc<Mailbox>, heartbeat: Duration, groups: Option<Arc<Groups>>) -> Self {
        Demux {
            mailbox,
            session: Mutex::new(Weak::new()),
            early: Mutex::new(None),
            downs: Mutex::new(Vec::new()),
            early_pings: Mutex::new(Vec::new()),
            quiet: heartbeat * 3,
            closes: Mutex::new(HashMap::new()),
            groups,
            forwarding: Arc::default(),
        }
    }

    /// Lets go of the session it delivered to (a grown mesh's is not built yet): pings are
    /// held for the next `attach`, and failures kept for it, as during a first start-up.
    pub(crate) fn detach(&self) {
        *self.session.lock() = Weak::new();
    }

    pub(crate) fn attach(&self, session: &Arc<Session>) {
        {
            // Hold the slot while answering early pings, so a ping arriving now waits its turn.
            let mut slot = self.session.lock();
            *slot = Arc::downgrade(session);
            for (peer, h, word) in self.early_pings.lock().drain(..) {
                answer_ping(session, peer, &h, word);
            }
        }
        if let Some((err, tell)) = self.early.lock().take() {
            session.fail(err, tell);
        }
    }

    fn fail(&self, err: PlaitError, tell_peers: bool) {
        let session = self.session.lock().upgrade();
        match session {
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
        let session = self.session.lock().upgrade();
        match session {
            Some(f) => {
                f.fail_with(err, Some(reason));
            }
            None => self.fail(err, false),
        }
    }

    /// What an Abort frame from `sender` means here: the error this rank's operations fail with.
    fn explain_abort(&self, sender: usize, reason: &AbortReason) -> PlaitError {
        let session = self.session.lock().upgrade();
        let me = session.as_ref().map(|f| f.rank);
        let silent = session.map(|f| f.silent_peers(self.quiet)).unwrap_or_default();
        blame::explain_abort(me, sender, reason, &|p| self.addr(p), &silent)
    }

    fn addr(&self, peer: usize) -> String {
        self.session.lock().upgrade().map(|f| f.peer_addr(peer)).unwrap_or_default()
    }
}

fn answer_ping(f: &Session, peer: usize, h: &FrameHeader, word: Vec<u8>) {
    let n = word.len() as u64;
    let pong = FrameHeader::p2p(PONG_TAG, f.p2p_ordinal(peer, PONG_TAG), h.dtype, n, n);
    f.link(peer).send_owned(pong, word);
}

/// Link probes held until the session is ready (start-up sends 3 per link).
const EARLY_PINGS_MAX: usize = 1024;

/// Control frames (Abort, Close, Refuse, link probes, kinds from newer versions) carry short
/// texts: one that claims more is refused before any of it is read, and the link closes.
pub(crate) const CONTROL_MAX_BYTES: u64 = 64 << 10;

/// The payload of control frame `h` as text, at most `max` bytes of it kept.
fn read_text(h: &FrameHeader, payload: &mut dyn Read, max: usize) -> io::Result<String> {
    if h.nbytes > CONTROL_MAX_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("it sent a control frame (kind {}) of {} bytes; control frames carry at most {CONTROL_MAX_BYTES}", h.kind, h.nbytes),
        ));
    }
    let mut buf = Vec::with_capacity(h.nbytes as usize);
    payload.read_to_end(&mut buf)?;
    buf.truncate(max);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

impl Inbox for Demux {
    fn deliver(&self, peer: usize, h: &FrameHeader, payload: &mut dyn Read, lane: Option<&LaneWaker>) -> io::Result<Delivery> {
        // The links' own demux hands subgroups' frames on; a subgroup's gets only its own.
        if let (Some(groups), true) = (&self.groups, h.group != 0) {
            return groups.deliver(peer, h, payload, lane);
        }
        if let Some(FrameKind::Data | FrameKind::P2p) = FrameKind::from_u8(h.kind) {
            if h.kind != FrameKind::P2p as u8 || h.seq != PING_TAG {
                return self.mailbox.deliver(peer, h, payload, lane);
            }
        }
        self.control(peer, h, payload).map(|_| Delivery::Taken)
    }

    fn deliver_relayed(&self, via: usize, origin: usize, dest: usize, h: &FrameHeader, payload: &mut dyn Read, lane: Option<&LaneWaker>) -> io::Result<Delivery> {
        let session = self.session.lock().upgrade();
        let link = |p: usize| session.as_ref().and_then(|f| f.links.get(p)?.clone());
        let me = session.as_ref().map(|f| f.rank);
        let why = if me == Some(dest) {
            // Only over the link its sender relays through (or will: the choice is made as
            // start-up ends, and the sender may finish first).
            match link(origin) {
                Some(l) if l.is_relayed() && l.via().is_none_or(|r| r == via) => return self.deliver(origin, h, payload, lane),
                _ => format!("this rank does not reach rank {origin} through rank {via}"),
            }
        } else {
            // The sender of an envelope is the rank it came from: a relayed frame takes one hop.
            match link(dest) {
                Some(out) if origin == via && !out.is_relayed() && dest != via => return self.forward(&out, origin, dest, h, payload, lane),
                _ if me.is_none() => "this rank's mesh is not ready or has closed".into(),
                _ => format!("this rank does not relay for rank {origin} and rank {dest}"),
            }
        };
        // A frame of a mesh that is gone (an elastic view's, a subgroup's kept over a grown mesh):
        // read and dropped, as the mailbox drops a finished call's; the link it came over is not
        // at fault.
        tracing::warn!("a frame relayed from rank {origin} to rank {dest} by rank {via} was dropped: {why}");
        io::copy(payload, &mut io::sink()).map(|_| Delivery::Taken)
    }

    fn link_down(&self, peer: usize, error: io::Error, clean: bool) {
        self.link_ended(peer, error, clean)
    }
}

impl Demux {
    /// The pairs of ranks whose frames this rank passes on, for this mesh (`relay`).
    pub(crate) fn set_relaying(&self, pairs: Vec<(usize, usize)>) {
        *self.forwarding.closes.lock() = Closes { pairs, seen: HashSet::new() };
    }

    /// Waits until both ranks of every pair this rank relays have closed (their Close frames
    /// passed on, behind everything they sent each other), the session fails, or `deadline`: a
    /// relay that closes first would cut off what its pairs still send each other.
    pub(crate) fn wait_relayed_closes(&self, deadline: Instant) {
        let broken = || self.session.lock().upgrade().is_none_or(|f| f.broken().is_some());
        let mut c = self.forwarding.closes.lock();
        while c.pairs.iter().any(|&(a, b)| !(c.seen.contains(&(a, b)) && c.seen.contains(&(b, a)))) && Instant::now() < deadline && !broken() {
            // Short waits: a failure is not announced on this condition.
            self.forwarding.closed.wait_for(&mut c, Duration::from_millis(20));
        }
    }

    /// The link to `peer` ended after its Close: the ranks this rank reaches through `peer` that
    /// have not closed yet are cut off (the relay waited for them as long as it could), and the
    /// operations waiting for them fail now, naming the relay, instead of at their deadlines.
    fn relay_closed(&self, peer: usize) {
        let Some(f) = self.session.lock().upgrade() else { return };
        // Once every lane has ended: frames still on another lane (relayed ones take the first)
        // may yet satisfy what waits.
        if !f.links.get(peer).and_then(|l| l.as_ref()).is_some_and(|l| l.ended()) {
            return;
        }
        let closed: Vec<usize> = self.closes.lock().keys().copied().collect();
        for (p, l) in f.links.iter().enumerate() {
            let Some(l) = l else { continue };
            if l.via() != Some(peer) || closed.contains(&p) {
                continue;
            }
            self.peer_closed(p, l.addr.clone(), format!("is reached through rank {peer}, which closed its communicator before rank {p} closed"));
        }
    }

    /// `peer` is gone (`what`): operations that no longer need it go on; those waiting for it fail.
    fn peer_closed(&self, peer: usize, addr: String, what: String) {
        let err = PlaitError::Peer { op: String::new(), peer, addr, what, waited: Duration::ZERO };
        self.mailbox.peer_closed(peer, &err);
        if let Some(groups) = &self.groups {
            groups.peer_closed(peer, &err);
        }
    }

    /// Passes the frame `h` from `origin` on to `dest` over `out`, in order with the others it
    /// passes on there; parks it while `FORWARD_MAX` bytes for `dest` wait to be written.
    fn forward(&self, out: &PeerLink, origin: usize, dest: usize, h: &FrameHeader, payload: &mut dyn Read, lane: Option<&LaneWaker>) -> io::Result<Delivery> {
        let too_large = || io::Error::new(io::ErrorKind::InvalidData, format!("rank {origin} sent a frame of {} bytes for rank {dest} to pass on: more than this rank can hold", h.nbytes));
        if h.nbytes > isize::MAX as u64 / 2 {
            return Err(too_large());
        }
        if !self.forwarding.claim(dest, h.nbytes, lane) {
            return Ok(Delivery::Parked { until: Instant::now() + Duration::from_millis(100) });
        }
        let mut inner = Vec::new();
        if inner.try_reserve_exact(crate::net::frame::HEADER_LEN + h.nbytes as usize).is_err() {
            self.forwarding.release(dest, h.nbytes);
            return Err(too_large());
        }
        inner.extend_from_slice(&h.encode());
        let read = payload.take(h.nbytes).read_to_end(&mut inner);
        let (forwarding, n) = (self.forwarding.clone(), h.nbytes);
        if let Err(e) = read {
            forwarding.release(dest, n);
            return Err(e);
        }
        let data = SendBuf { ptr: inner.as_ptr(), len: inner.len() };
        let done: SendDone = Box::new(move |_| {
            // A failed write fails the link to `dest`, and that link's end says so.
            drop(inner);
            forwarding.release(dest, n);
        });
        out.send_in_order(SendReq { header: FrameHeader::relay(origin, dest, n), data, done: Some(done) }, false);
        if h.kind == FrameKind::Close as u8 && h.group == 0 {
            self.forwarding.passed_close(origin, dest);
        }
        Ok(Delivery::Taken)
    }
}

impl Demux {
    /// Link probes, Abort, Refuse and Close frames, and kinds from newer versions (read, ignored).
    fn control(&self, peer: usize, h: &FrameHeader, payload: &mut dyn Read) -> io::Result<()> {
        match FrameKind::from_u8(h.kind) {
            Some(FrameKind::P2p) if h.seq == PING_TAG => {
                // Answered here, on the receiver thread, so the prober measures the link alone.
                let word = read_text(h, payload, 8)?.into_bytes();
                let slot = self.session.lock();
                match slot.upgrade() {
                    Some(f) => answer_ping(&f, peer, h, word),
                    None => {
                        let mut early = self.early_pings.lock();
                        // A peer probes each link a few times at start-up; more is not a peer.
                        if early.len() >= EARLY_PINGS_MAX {
                            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("it sent more than {EARLY_PINGS_MAX} link probes before this rank was ready")));
                        }
                        early.push((peer, *h, word));
                    }
                }
                Ok(())
            }
            Some(FrameKind::Abort) => {
                let reason = AbortReason::parse(peer, &read_text(h, payload, REASON_MAX_BYTES)?);
                let err = self.explain_abort(peer, &reason);
                // Passed on once, so that ranks the reporter cannot reach still hear the reason
                // before this rank's links close.
                self.fail_relaying(err, reason);
                Ok(())
            }
            Some(FrameKind::Refuse) => {
                let reason = read_text(h, payload, REASON_MAX_BYTES)?;
                self.mailbox.refused_by(peer, h.seq, reason);
                Ok(())
            }
            Some(FrameKind::Close) => {
                read_text(h, payload, 0)?;
                let lanes = self.session.lock().upgrade().and_then(|f| f.links.get(peer)?.as_ref().map(|l| l.lanes())).unwrap_or(1);
                let closes = {
                    let mut c = self.closes.lock();
                    let n = c.entry(peer).or_insert(0);
                    *n += 1;
                    *n
                };
                if closes < lanes {
                    return Ok(());
                }
                self.peer_closed(peer, self.addr(peer), "closed its communicator".into());
                Ok(())
            }
            _ => read_text(h, payload, 0).map(|_| ()),
        }
    }

    fn link_ended(&self, peer: usize, error: io::Error, clean: bool) {
        if clean {
            self.relay_closed(peer);
            return;
        }
        let what = blame::link_end(&error);
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
        // The grace ends early once the session has failed or closed: nobody is left to blame,
        // and this is a receiver thread that a closing session waits for (an elastic member
        // closes the mesh that lost a member straight away, and would wait out the grace).
        let broken = || self.session.lock().upgrade().is_some_and(|f| f.broken().is_some());
        let until = Instant::now() + DOWN_GRACE;
        while Instant::now() < until {
            if broken() {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        if broken() {
            return;
        }
        let downs = self.downs.lock().clone();
        let err = blame::links_down(&downs, &|p| self.addr(p));
        self.fail(err, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn control(kind: FrameKind, nbytes: u64) -> FrameHeader {
        FrameHeader { kind: kind as u8, nbytes, ..Default::default() }
    }

    #[test]
    fn a_control_frame_claiming_more_than_its_cap_is_refused_before_anything_is_read() {
        let demux = Demux::new(Arc::new(Mailbox::new()), Duration::from_secs(1), None);
        for kind in [FrameKind::Abort, FrameKind::Close, FrameKind::Refuse, FrameKind::Heartbeat] {
            // An endless stream behind a header that claims a terabyte: nothing may be read.
            let mut endless = io::repeat(b'x');
            let err = demux.deliver(1, &control(kind, 1 << 40), &mut endless, None).expect_err("refused");
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
            assert!(err.to_string().contains("control frames carry at most"), "{err}");
        }
        let mut endless = io::repeat(b'x');
        let ping = FrameHeader { seq: PING_TAG, ..control(FrameKind::P2p, 1 << 40) };
        assert!(demux.deliver(1, &ping, &mut endless, None).is_err(), "a link probe is a control frame too");
    }

    #[test]
    fn data_frames_claiming_absurd_sizes_are_refused_by_the_mailbox_before_anything_is_read() {
        let demux = Demux::new(Arc::new(Mailbox::new()), Duration::from_secs(1), None);
        for kind in [FrameKind::Data, FrameKind::P2p] {
            for nbytes in [1u64 << 40, 1 << 63, u64::MAX] {
                let h = FrameHeader { count: nbytes, seq: 1, ..control(kind, nbytes) };
                let err = demux.deliver(1, &h, &mut io::repeat(b'x'), None).expect_err("refused");
                // Past any buffer's size: refused as such; below it: over this peer's budget.
                assert!(err.to_string().contains(if nbytes > isize::MAX as u64 { "more than any buffer holds" } else { "allowed per peer" }), "{err}");
            }
        }
    }

    #[test]
    fn a_control_frame_within_its_cap_is_read_whole() {
        let mailbox = Arc::new(Mailbox::new());
        let demux = Demux::new(mailbox, Duration::from_secs(1), None);
        let text = vec![b'r'; 10_000]; // longer than the REASON_MAX_BYTES of reason kept
        let mut payload = &text[..];
        demux.deliver(1, &control(FrameKind::Refuse, text.len() as u64), &mut payload, None).expect("read");
        assert!(payload.is_empty(), "the whole payload was consumed");
    }
}
