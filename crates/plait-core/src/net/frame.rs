//! Every message on a link starts with a fixed header that says which operation, which step and
//! what it carries, so that ranks calling different collectives, counts, dtypes or algorithms get
//! a clear error instead of corrupt data.

use std::io::{self, Read};

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
}

impl FrameKind {
    pub fn from_u8(v: u8) -> Option<FrameKind> {
        Some(match v {
            1 => FrameKind::Data,
            2 => FrameKind::P2p,
            3 => FrameKind::Heartbeat,
            4 => FrameKind::Abort,
            5 => FrameKind::Close,
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
}

impl FrameHeader {
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
        };
        if FrameKind::from_u8(h.kind).is_none() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown frame kind {}", h.kind)));
        }
        Ok(h)
    }

    pub fn read_from(r: &mut impl Read) -> io::Result<FrameHeader> {
        let mut b = [0u8; HEADER_LEN];
        r.read_exact(&mut b)?;
        FrameHeader::decode(&b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = FrameHeader { kind: 1, coll: 2, dtype: 3, op: 4, seq: 5, step: 6, segment: 7, ordinal: 8, root: 9, count: 10, nbytes: 11, sched_id: 12, layout_id: 13 };
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        let mut junk = h.encode();
        junk[0] ^= 0xff;
        assert!(FrameHeader::decode(&junk).is_err());
    }
}
