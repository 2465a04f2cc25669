//! Every message on a link starts with a fixed header that says which operation, which step and
//! what it carries, so that ranks calling different collectives, counts, dtypes or algorithms get
//! a clear error instead of corrupt data.

use crate::error::PlaitError;
use std::io;

pub const MAGIC: u32 = u32::from_le_bytes(*b"PLT1");
pub const HEADER_LEN: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// A segment of a collective.
    Data = 1,
    /// A tagged point-to-point message.
    P2p = 2,
    /// "I am alive": sent on idle links so silent peers can be told from slow ones.
    Heartbeat = 3,
    /// The sender's communicator failed; the payload is the reason (UTF-8).
    Abort = 4,
    /// The sender closed its communicator normally.
    Close = 5,
    /// The sender refused its arguments for collective `seq` (the payload says why, UTF-8): it
    /// takes no part in that call, and the others end it instead of waiting.
    Refuse = 6,
    /// Another frame on its way between two ranks that have no connection of their own
    /// (`FrameHeader::relay`): the payload is that frame, header and all. The rank in between
    /// passes it on; the rank it is for reads it as if it came straight from its sender.
    Relay = 7,
    /// A ring of shared memory for this lane's large payloads (`net::shm`): its name, nonce and
    /// capacity. Only between ranks of one host; the peer's reader takes it, nothing above sees it.
    ShmOffer = 8,
}

/// Set in a header's `kind` on the wire: the payload is in the lane's shared-memory ring
/// (`net::shm`), not on the socket. The lane's reader clears it; nothing above sees it.
pub const SHM_PAYLOAD: u8 = 0x80;

impl FrameKind {
    pub fn from_u8(v: u8) -> Option<FrameKind> {
        Some(match v {
            1 => FrameKind::Data,
            2 => FrameKind::P2p,
            3 => FrameKind::Heartbeat,
            4 => FrameKind::Abort,
            5 => FrameKind::Close,
            6 => FrameKind::Refuse,
            7 => FrameKind::Relay,
            8 => FrameKind::ShmOffer,
            _ => return None,
        })
    }
}

/// For `Data`: `seq` is the operation's sequence number, `step`/`segment`/`ordinal` place the
/// message in the schedule. For `P2p`: `seq` is the user's tag and `ordinal` counts messages per
/// (sender, tag).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FrameHeader {
    pub kind: u8,
    pub coll: u8,
    pub dtype: u8,
    pub op: u8,
    pub seq: u64,
    pub step: u32,
    pub segment: u32,
    pub ordinal: u32,
    pub root: u32,
    /// Total elements of the operation (per the sender), to detect count mismatches.
    pub count: u64,
    /// Payload bytes that follow the header.
    pub nbytes: u64,
    /// Hash of (algorithm, segment size): ranks must run the same schedule.
    pub sched_id: u32,
    /// Hash of the call's counts where every rank knows them all (0: not checked), so ranks
    /// passing different counts fail even when the messages they exchange happen to fit.
    pub layout_id: u32,
    /// Which group of the mesh the frame belongs to: 0 for the communicator that owns the links,
    /// else a subgroup sharing them (see `session::groups`).
    pub group: u64,
}

/// The longest reason (UTF-8) an Abort or Refuse frame carries: a sender sends no more, a
/// receiver keeps no more.
pub const REASON_MAX_BYTES: usize = 4096;

/// Tags at and above this are plait's own (link probes, message pieces); users get the ones below.
pub const RESERVED_TAGS: u64 = 1 << 63;
/// A large point-to-point message goes as pieces (`exec::p2p::pieces`): the first with the
/// message's tag, the others with `PIECE_TAGS | tag`, for tags below `PIECE_TAG_LIMIT` (larger
/// tags are sent whole). The range stays clear of the probe tags at the top.
pub const PIECE_TAGS: u64 = RESERVED_TAGS | (1 << 62);
pub const PIECE_TAG_LIMIT: u64 = 1 << 61;
/// A probe that the peer's receiver thread answers at once with a `PONG_TAG` message carrying
/// the same word, so the round trip measures the link, not how far along the peer is.
pub const PING_TAG: u64 = u64::MAX;
pub const PONG_TAG: u64 = u64::MAX - 1;
/// Start-up bandwidth probes (`PLAIT_MEASURE`): a train of frames of at most
/// `PROBE_FRAME_BYTES`, sent once the receiver says it is ready with a `PROBE_GO_TAG` word.
pub const PROBE_TAG: u64 = u64::MAX - 2;
pub const PROBE_GO_TAG: u64 = u64::MAX - 3;
/// The trains of the measurement that follows connections added to a link. A train's receiver
/// posts receives ahead and withdraws the ones the train did not fill, so `PROBE_TAG`'s ordinals
/// are out of step between the two ends after a train: a second measurement needs a tag of its
/// own.
pub const PROBE_AGAIN_TAG: u64 = u64::MAX - 4;
/// Larger than the 64 KiB a link always sends on its first connection, so a train spreads over
/// every connection of a link that has several.
pub const PROBE_FRAME_BYTES: u64 = 256 * 1024;

/// What names one collective call on the wire. A receiver compares it with its own call's, so
/// ranks that disagree about the call (collective, dtype, op, root, algorithm, counts) fail
/// with a mismatch instead of exchanging garbage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CallId {
    pub coll: u8,
    pub dtype: u8,
    pub op: u8,
    pub root: u32,
    pub seq: u64,
    pub sched_id: u32,
    pub layout_id: u32,
}

impl FrameHeader {
    /// A segment of collective `call`: step, segment and ordinal place it in the schedule.
    pub fn data(call: &CallId, step: u32, segment: u32, ordinal: u32, count: u64, nbytes: u64) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data as u8,
            coll: call.coll,
            dtype: call.dtype,
            op: call.op,
            seq: call.seq,
            step,
            segment,
            ordinal,
            root: call.root,
            count,
            nbytes,
            sched_id: call.sched_id,
            layout_id: call.layout_id,
            group: 0,
        }
    }

    /// The `ordinal`-th message from this rank to one peer with `tag`.
    pub fn p2p(tag: u64, ordinal: u32, dtype: u8, count: u64, nbytes: u64) -> FrameHeader {
        FrameHeader { kind: FrameKind::P2p as u8, dtype, seq: tag, ordinal, count, nbytes, ..Default::default() }
    }

    /// The envelope of a frame of `inner_nbytes` payload bytes from rank `origin` to rank `dest`,
    /// through the rank between them: the inner header and its payload follow.
    pub fn relay(origin: usize, dest: usize, inner_nbytes: u64) -> FrameHeader {
        FrameHeader { kind: FrameKind::Relay as u8, seq: origin as u64, root: dest as u32, nbytes: HEADER_LEN as u64 + inner_nbytes, ..Default::default() }
    }

    /// A relay envelope's sender and the rank it is for.
    pub fn relay_ends(&self) -> (usize, usize) {
        (self.seq.min(u32::MAX as u64) as usize, self.root as usize)
    }

    /// The call this frame belongs to (a point-to-point message: its tag and dtype only).
    pub fn call(&self) -> CallId {
        CallId {
            coll: self.coll,
            dtype: self.dtype,
            op: self.op,
            root: self.root,
            seq: self.seq,
            sched_id: self.sched_id,
            layout_id: self.layout_id,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind;
        b[5] = self.coll;
        b[6] = self.dtype;
        b[7] = self.op;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.step.to_le_bytes());
        b[20..24].copy_from_slice(&self.segment.to_le_bytes());
        b[24..28].copy_from_slice(&self.ordinal.to_le_bytes());
        b[28..32].copy_from_slice(&self.root.to_le_bytes());
        b[32..40].copy_from_slice(&self.count.to_le_bytes());
        b[40..48].copy_from_slice(&self.nbytes.to_le_bytes());
        b[48..52].copy_from_slice(&self.sched_id.to_le_bytes());
        b[52..56].copy_from_slice(&self.layout_id.to_le_bytes());
        b[56..64].copy_from_slice(&self.group.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> io::Result<FrameHeader> {
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap());
        if magic != MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad frame magic {magic:#010x} (not a plait peer, or the stream is out of sync)"),
            ));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let h = FrameHeader {
            kind: b[4],
            coll: b[5],
            dtype: b[6],
            op: b[7],
            seq: u64_at(8),
            step: u32_at(16),
            segment: u32_at(20),
            ordinal: u32_at(24),
            root: u32_at(28),
            count: u64_at(32),
            nbytes: u64_at(40),
            sched_id: u32_at(48),
            layout_id: u32_at(52),
            group: u64_at(56),
        };
        if FrameKind::from_u8(h.kind & !SHM_PAYLOAD).is_none() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown frame kind {}", h.kind)));
        }
        Ok(h)
    }
}

/// Why a communicator failed, as carried by an Abort frame: the rank to blame, its address, the
/// rank that saw it happen first, and what happened. Receivers relay it once, so a rank whose
/// link to the reporter is down still learns the culprit instead of blaming the relaying rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbortReason {
    pub culprit: usize,
    pub addr: String,
    pub reporter: usize,
    pub what: String,
}

impl AbortReason {
    /// The reason `reporter` gives its peers for failing with `err`.
    pub fn of(reporter: usize, err: &PlaitError) -> AbortReason {
        match err {
            PlaitError::Peer { peer, addr, what, .. } => {
                AbortReason { culprit: *peer, addr: addr.clone(), reporter, what: what.clone() }
            }
            other => AbortReason { culprit: reporter, addr: String::new(), reporter, what: other.to_string() },
        }
    }

    pub fn encode(&self) -> String {
        format!("{}\n{}\n{}\n{}", self.culprit, self.addr, self.reporter, self.what)
    }

    /// Reads an Abort payload that arrived from `sender`; unreadable text blames the sender.
    pub fn parse(sender: usize, text: &str) -> AbortReason {
        let mut lines = text.splitn(4, '\n');
        let culprit = lines.next().and_then(|l| l.parse().ok());
        let addr = lines.next();
        let reporter = lines.next().and_then(|l| l.parse().ok());
        match (culprit, addr, reporter, lines.next()) {
            (Some(culprit), Some(addr), Some(reporter), Some(what)) => {
                AbortReason { culprit, addr: addr.to_string(), reporter, what: what.to_string() }
            }
            _ => AbortReason { culprit: sender, addr: String::new(), reporter: sender, what: text.to_string() },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn abort_reason_survives_the_wire_and_keeps_the_reporter() {
        let err = PlaitError::Peer {
            op: "allreduce #5".into(),
            peer: 1,
            addr: "10.1.2.2:4000".into(),
            what: "silent for 4.0s\nsecond line".into(),
            waited: Duration::from_secs(4),
        };
        let reason = AbortReason::of(0, &err);
        assert_eq!(AbortReason::parse(2, &reason.encode()), reason);
        assert_eq!(reason.culprit, 1);
        assert_eq!(reason.reporter, 0);
        let own = AbortReason::of(3, &PlaitError::Aborted { op: String::new(), reason: "by the user".into() });
        assert_eq!((own.culprit, own.reporter), (3, 3));
        let junk = AbortReason::parse(4, "not a reason");
        assert_eq!((junk.culprit, junk.reporter, junk.what.as_str()), (4, 4, "not a reason"));
    }

    #[test]
    fn a_data_header_carries_its_call_and_place() {
        let call = CallId { coll: 1, dtype: 2, op: 3, root: 4, seq: 5, sched_id: 6, layout_id: 7 };
        let h = FrameHeader::data(&call, 8, 9, 10, 11, 12);
        let back = FrameHeader::decode(&h.encode()).unwrap();
        assert_eq!(back.call(), call);
        assert_eq!((back.kind, back.step, back.segment, back.ordinal, back.count, back.nbytes), (FrameKind::Data as u8, 8, 9, 10, 11, 12));
        let p = FrameHeader::p2p(PING_TAG, 3, 0, 8, 8);
        assert_eq!((p.kind, p.seq, p.ordinal), (FrameKind::P2p as u8, PING_TAG, 3));
    }

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = FrameHeader { kind: 1, coll: 2, dtype: 3, op: 4, seq: 5, step: 6, segment: 7, ordinal: 8, root: 9, count: 10, nbytes: 11, sched_id: 12, layout_id: 13, group: u64::MAX - 14 };
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        let mut junk = h.encode();
        junk[0] ^= 0xff;
        assert!(FrameHeader::decode(&junk).is_err());
    }
}
