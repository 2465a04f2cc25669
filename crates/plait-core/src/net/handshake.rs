//! The handshake that opens every link between two ranks: the hello a connecting rank sends,
//! the reply it gets, their wire format and the checks that accept or refuse a peer.
//!
//! The lower rank listens and the higher rank connects, so two ranks can never both wait for the
//! other to accept. The handshake carries group, epoch and ranks, so a stray process, a stale
//! communicator from an earlier epoch, or a misconfigured peer is refused with a reason both
//! sides can log, instead of being paired with the wrong rank.
//!
//! Wire format (little endian):
//!   hello: b"PLAITHS" | version u8 | epoch u64 | from u32 | to u32 | world u32 | lane u8 | lanes u8
//!          | mode u8 (bit 0: a token is set, bit 1: frames are sealed) | group_len u16 | group (UTF-8)
//!   reply: b"PLAITHR" | version u8 | status u8 (1 accept, 0 refuse) | reason_len u16 | reason (UTF-8)
//! Lengths are bounded (1 KiB) so garbage cannot make either side allocate much.
//!
//! A pair of ranks may open several connections ("lanes", `PLAIT_STREAMS`): each hello names its
//! lane, and both sides must agree on how many there are. Start-up may add lanes to a link one
//! stream cannot fill (`PLAIT_STREAMS_MAX`): their hellos name a lane past the agreed count and the
//! link's new count.
//!
//! The hello itself proves nothing: the Noise handshake that follows it (`auth`) proves that each
//! end holds the key its rank published, and binds the hello's fields to that proof.

use super::auth::LinkMode;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, PartialEq)]
pub struct Hello {
    pub group: String,
    pub epoch: u64,
    pub from: u32,
    pub to: u32,
    pub world: u32,
    /// Which of the `lanes` connections between the two ranks this is.
    pub lane: u8,
    pub lanes: u8,
    /// Token and sealing: both ends must agree.
    pub mode: LinkMode,
}

const HELLO_MAGIC: &[u8; 7] = b"PLAITHS";
pub(super) const REPLY_MAGIC: &[u8; 7] = b"PLAITHR";
pub(super) const VERSION: u8 = 3;
pub(super) const HELLO_FIXED_LEN: usize = 7 + 1 + 8 + 4 + 4 + 4 + 1 + 1 + 1 + 2;
pub(super) const REPLY_FIXED_LEN: usize = 7 + 1 + 1 + 2;
pub(super) const MAX_GROUP_LEN: usize = 1024;
pub(super) const MAX_REASON_LEN: usize = 1024;

impl Hello {
    pub(super) fn encode(&self) -> Vec<u8> {
        let g = self.group.as_bytes();
        let mut b = Vec::with_capacity(HELLO_FIXED_LEN + g.len());
        b.extend_from_slice(HELLO_MAGIC);
        b.push(VERSION);
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&self.from.to_le_bytes());
        b.extend_from_slice(&self.to.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.push(self.lane);
        b.push(self.lanes);
        b.push(self.mode.to_byte());
        b.extend_from_slice(&(g.len() as u16).to_le_bytes());
        b.extend_from_slice(g);
        b
    }
}

pub(super) enum HsFail {
    /// Tell the peer why, then close.
    Refuse(String),
    /// The connection itself failed (timeout, reset); nobody to tell.
    Io(String),
}

pub(super) fn check_hello(h: &Hello, e: &Hello) -> Option<String> {
    let me = e.to;
    Some(if h.group != e.group {
        format!("rank {} of group {:?}, but this listener is group {:?}", h.from, h.group, e.group)
    } else if h.epoch != e.epoch {
        format!("rank {} is at epoch {}, this listener at epoch {} (stale or newer communicator)", h.from, h.epoch, e.epoch)
    } else if h.world != e.world {
        format!("rank {} has world size {}, this listener {}", h.from, h.world, e.world)
    } else if h.to != me {
        format!("rank {} addressed rank {}, but this is rank {me}", h.from, h.to)
    } else if h.from >= e.world {
        format!("sender rank {} out of range for world size {}", h.from, e.world)
    } else if h.from <= me {
        format!("rank {} must listen for rank {me}, not connect to it (the higher rank connects)", h.from)
    } else if h.lanes != e.lanes && !(h.lane >= e.lanes && h.lanes > e.lanes && h.lanes <= MAX_LANES) {
        format!(
            "rank {} opens {} connection(s) per peer, this rank {} (set PLAIT_STREAMS the same on every rank)",
            h.from, h.lanes, e.lanes
        )
    } else if h.lane >= h.lanes {
        format!("rank {} sent connection index {} of {}", h.from, h.lane, h.lanes)
    } else {
        return e.mode.refusal(h.from, h.mode);
    })
}

/// The most connections a pair of ranks may have (`PLAIT_STREAMS`, `PLAIT_STREAMS_MAX`).
pub const MAX_LANES: u8 = 16;

pub(super) fn read_hello(s: &mut TcpStream, deadline: Instant) -> Result<Hello, HsFail> {
    let io = |e: io::Error| HsFail::Io(describe_read_error(&e));
    let mut b = [0u8; HELLO_FIXED_LEN];
    // Check the magic before waiting for the rest, so a non-plait client gets a clear answer.
    read_exact_by(s, &mut b[..7], deadline).map_err(io)?;
    if &b[..7] != HELLO_MAGIC {
        return Err(HsFail::Refuse(format!("not a plait handshake (starts with {:02x?})", &b[..7])));
    }
    read_exact_by(s, &mut b[7..], deadline).map_err(io)?;
    if b[7] != VERSION {
        return Err(HsFail::Refuse(format!("handshake version {}, this side speaks {VERSION}", b[7])));
    }
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let epoch = u64::from_le_bytes(b[8..16].try_into().unwrap());
    let (from, to, world) = (u32_at(16), u32_at(20), u32_at(24));
    let (lane, lanes) = (b[28], b[29]);
    let mode = LinkMode::from_byte(b[30]).ok_or_else(|| HsFail::Refuse(format!("unknown link mode {:#04x} from rank {from}", b[30])))?;
    let glen = u16::from_le_bytes([b[31], b[32]]) as usize;
    if glen > MAX_GROUP_LEN {
        return Err(HsFail::Refuse(format!("group id of {glen} bytes exceeds {MAX_GROUP_LEN}")));
    }
    let mut g = vec![0u8; glen];
    read_exact_by(s, &mut g, deadline).map_err(io)?;
    let group = String::from_utf8(g).map_err(|_| HsFail::Refuse("group id is not UTF-8".into()))?;
    Ok(Hello { group, epoch, from, to, world, lane, lanes, mode })
}

fn describe_read_error(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "no complete hello within the handshake timeout".into(),
        io::ErrorKind::UnexpectedEof => "connection closed before a complete hello".into(),
        _ => e.to_string(),
    }
}

pub(super) fn write_reply(s: &mut TcpStream, accept: bool, reason: &str) -> io::Result<()> {
    s.write_all(&reply(accept, reason))
}

/// The reply's bytes (an accepting one is followed by the handshake's next message).
pub(super) fn reply(accept: bool, reason: &str) -> Vec<u8> {
    let mut r = reason.as_bytes();
    if r.len() > MAX_REASON_LEN {
        let mut n = MAX_REASON_LEN;
        while !reason.is_char_boundary(n) {
            n -= 1;
        }
        r = &r[..n];
    }
    let mut b = Vec::with_capacity(REPLY_FIXED_LEN + r.len());
    b.extend_from_slice(REPLY_MAGIC);
    b.push(VERSION);
    b.push(accept as u8);
    b.extend_from_slice(&(r.len() as u16).to_le_bytes());
    b.extend_from_slice(r);
    b
}

/// read_exact with an overall deadline (a per-read timeout alone would let a peer trickle one
/// byte at a time forever).
pub(super) fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        match s.read(&mut buf[filled..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Helpers for the tests of the listener and of connect.
#[cfg(test)]
pub(super) mod testing {
    use super::Hello;
    use crate::net::iface::IfaceAddr;
    use crate::net::route::Route;
    use std::time::{Duration, Instant};

    pub(in crate::net) fn lo_route() -> Route {
        Route {
            local: IfaceAddr { name: "lo".into(), ip: "127.0.0.1".parse().unwrap(), prefix: 8, mtu: None, speed_mbps: None },
            peer_ip: "127.0.0.1".parse().unwrap(),
            reason: "test".into(),
        }
    }

    pub(in crate::net) fn hello(group: &str, epoch: u64, from: u32, to: u32, world: u32) -> Hello {
        Hello { group: group.into(), epoch, from, to, world, lane: 0, lanes: 1, mode: Default::default() }
    }

    pub(in crate::net) fn soon(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }
}
