//! A control link between two members of an elastic group: one TCP connection carrying `Ctl`
//! messages, each as a u32 length and its JSON. With a token (`PLAIT_TOKEN`), the link first runs
//! the Noise `NNpsk0` handshake with a key derived from the token and the group name, and every
//! message travels sealed (ChaCha20-Poly1305, in records of at most `RECORD` bytes): a process
//! without the token can neither join nor forge a member's message. Without a token the messages
//! travel in the clear, as the static mode's frames do without `PLAIT_ENCRYPT`.
//!
//! Control messages are few and small (views, suspicions, the bootstrap records of an epoch),
//! so plain JSON costs nothing that matters and reads well in a packet capture.

use super::agree::{MemberId, Msg};
use crate::net::auth::token_key;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use snow::{Builder, StatelessTransportState};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The largest control message accepted; anything longer is not a plait member.
pub(crate) const MAX_MESSAGE: usize = 1 << 20;
/// Plaintext bytes per sealed record (a Noise message is at most 65535 bytes with its tag).
const RECORD: usize = 60_000;
const TAG: usize = 16;
const PATTERN: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";

/// What members say to each other.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum Ctl {
    /// The first message of a link between members, each way: who this is.
    Hello { id: MemberId, group: String, contact: String, epoch: u64 },
    /// The first message of a joiner: its id, and the port its control plane listens on (its
    /// address is the one the member sees the connection come from).
    Join { id: MemberId, group: String, port: u16 },
    /// A joiner waits to be admitted; told to every member, so a new leader knows it too.
    Pending { id: MemberId, contact: String },
    /// That joiner went away before it was admitted.
    Withdrawn { id: MemberId },
    /// The view agreement.
    Agree(Msg),
    /// The sender lost `who` in `epoch` (`why` says how); sent to the leader.
    Suspect { epoch: u64, who: MemberId, why: String },
    /// A bootstrap record of `epoch` (the store of that epoch's mesh), sent to every member.
    Kv { epoch: u64, key: String, value: Vec<u8> },
    /// The sender (the link's member) leaves the group: it still votes until a view without it
    /// is agreed.
    Leave,
    /// "I am alive, at `epoch`"; on idle links.
    Heartbeat { epoch: u64 },
    /// The answer to a hello or join that is refused.
    Refused { why: String },
    /// The answer of a process that is not a member (any more) to a joiner: ask another.
    NotMember,
}

struct Sealing {
    state: StatelessTransportState,
    send_nonce: AtomicU64,
}

/// One end of a control link. Writes come from any thread (one at a time); reads from the
/// link's reader thread only.
pub(crate) struct CtlLink {
    stream: TcpStream,
    write: Mutex<TcpStream>,
    read: Mutex<(TcpStream, u64)>,
    sealing: Option<Arc<Sealing>>,
    pub peer_addr: Option<SocketAddr>,
}

fn prologue(group: &str) -> Vec<u8> {
    format!("plait control v1\n{group}\n").into_bytes()
}

fn refused(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

impl CtlLink {
    /// Runs the handshake (with `token`) on a fresh connection; `dialer` is the end that
    /// connected. Both ends must use a token or neither: the first byte says which.
    pub fn establish(stream: TcpStream, group: &str, token: Option<&[u8]>, dialer: bool, deadline: Duration) -> io::Result<CtlLink> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(deadline))?;
        stream.set_write_timeout(Some(deadline))?;
        let mut s = stream.try_clone()?;
        s.write_all(&[token.is_some() as u8])?;
        let mut theirs = [0u8];
        s.read_exact(&mut theirs)?;
        if theirs[0] != token.is_some() as u8 {
            return Err(refused(if token.is_some() {
                "the other end has no PLAIT_TOKEN, this one has: set the same token on every member"
            } else {
                "the other end has a PLAIT_TOKEN, this one has not: set the same token on every member"
            }));
        }
        let sealing = match token {
            None => None,
            Some(t) => Some(Arc::new(handshake(&mut s, group, t, dialer)?)),
        };
        let peer_addr = stream.peer_addr().ok();
        Ok(CtlLink { write: Mutex::new(stream.try_clone()?), read: Mutex::new((stream.try_clone()?, 0)), stream, sealing, peer_addr })
    }

    /// Read deadline for `recv`: a member silent this long is not waited for here (the
    /// heartbeat check names it); writes give up after `write` (a stopped peer's full buffer).
    pub fn set_timeouts(&self, read: Option<Duration>, write: Duration) -> io::Result<()> {
        self.stream.set_read_timeout(read)?;
        self.stream.set_write_timeout(Some(write))
    }

    pub fn send(&self, msg: &Ctl) -> io::Result<()> {
        let body = serde_json::to_vec(msg).map_err(refused)?;
        let mut w = self.write.lock();
        let mut out = Vec::with_capacity(4 + body.len() + TAG * (1 + body.len() / RECORD));
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        match &self.sealing {
            None => out.extend_from_slice(&body),
            Some(seal) => {
                // One nonce per record, in write order: the write lock keeps them in order.
                let mut chunk = vec![0u8; RECORD + TAG];
                for part in body.chunks(RECORD).chain(body.is_empty().then_some(&[][..])) {
                    let nonce = seal.send_nonce.fetch_add(1, Ordering::Relaxed);
                    let n = seal.state.write_message(nonce, part, &mut chunk).map_err(refused)?;
                    out.extend_from_slice(&chunk[..n]);
                }
            }
        }
        w.write_all(&out)
    }

    /// The next message; an error when the link ends or sends something that is not one.
    pub fn recv(&self) -> io::Result<Ctl> {
        let mut guard = self.read.lock();
        let (r, nonce) = &mut *guard;
        let mut len = [0u8; 4];
        r.read_exact(&mut len)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_MESSAGE {
            return Err(refused(format!("a control message of {len} bytes (at most {MAX_MESSAGE})")));
        }
        let body = match &self.sealing {
            None => {
                let mut body = vec![0u8; len];
                r.read_exact(&mut body)?;
                body
            }
            Some(seal) => {
                let mut body = Vec::with_capacity(len);
                let mut sealed = vec![0u8; RECORD + TAG];
                let mut plain = vec![0u8; RECORD];
                let records = if len == 0 { 1 } else { len.div_ceil(RECORD) };
                for i in 0..records {
                    let part = (len - i * RECORD).min(RECORD);
                    r.read_exact(&mut sealed[..part + TAG])?;
                    let n = seal.state.read_message(*nonce, &sealed[..part + TAG], &mut plain).map_err(|_| refused("a control message failed its authentication"))?;
                    *nonce += 1;
                    body.extend_from_slice(&plain[..n]);
                }
                body
            }
        };
        serde_json::from_slice(&body).map_err(|e| refused(format!("an unreadable control message: {e}")))
    }

    /// Ends the link: the reader's `recv` returns and the peer sees it closed.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// NNpsk0: both ends prove the token (mixed with the group's name) before anything else.
fn handshake(s: &mut TcpStream, group: &str, token: &[u8], dialer: bool) -> io::Result<Sealing> {
    let psk = token_key(b"plait control token v1\n", token);
    let prologue = prologue(group);
    let builder = Builder::new(PATTERN.parse().expect("a valid Noise pattern")).prologue(&prologue).and_then(|b| b.psk(0, &psk)).map_err(refused)?;
    let mut hs = if dialer { builder.build_initiator() } else { builder.build_responder() }.map_err(refused)?;
    let mut buf = vec![0u8; 256];
    let send = |hs: &mut snow::HandshakeState, s: &mut TcpStream, buf: &mut [u8]| -> io::Result<()> {
        let n = hs.write_message(&[], buf).map_err(refused)?;
        s.write_all(&(n as u16).to_le_bytes())?;
        s.write_all(&buf[..n])
    };
    // An empty message is the responder's "no": the dialer then knows the token (or group) is
    // wrong, not that the member went away, and stops trying (an on-path attacker who forges it
    // could have cut the connection anyway).
    const NO: [u8; 2] = [0, 0];
    let mismatch = || refused("the other end does not hold this group's PLAIT_TOKEN (or belongs to another group)");
    let recv = |hs: &mut snow::HandshakeState, s: &mut TcpStream, buf: &mut [u8]| -> io::Result<()> {
        let mut len = [0u8; 2];
        s.read_exact(&mut len)?;
        let len = u16::from_le_bytes(len) as usize;
        if len == 0 {
            return Err(mismatch());
        }
        if len > buf.len() {
            return Err(refused("a handshake message too long to be a plait member's"));
        }
        let mut msg = vec![0u8; len];
        s.read_exact(&mut msg)?;
        hs.read_message(&msg, buf).map(|_| ()).map_err(|_| mismatch())
    };
    if dialer {
        send(&mut hs, s, &mut buf)?;
        recv(&mut hs, s, &mut buf)?;
    } else {
        if let Err(e) = recv(&mut hs, s, &mut buf) {
            if e.kind() == io::ErrorKind::InvalidData {
                let _ = s.write_all(&NO);
            }
            return Err(e);
        }
        send(&mut hs, s, &mut buf)?;
    }
    let state = hs.into_stateless_transport_mode().map_err(refused)?;
    Ok(Sealing { state, send_nonce: AtomicU64::new(0) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair(a: Option<&'static [u8]>, b: Option<&'static [u8]>, group_b: &'static str) -> (io::Result<CtlLink>, io::Result<CtlLink>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            CtlLink::establish(s, group_b, b, false, Duration::from_secs(5))
        });
        let s = TcpStream::connect(addr).unwrap();
        let dialer = CtlLink::establish(s, "g", a, true, Duration::from_secs(5));
        (dialer, t.join().unwrap())
    }

    #[test]
    fn messages_cross_sealed_and_in_the_clear_at_any_size() {
        for token in [None, Some(&b"secret"[..])] {
            let (a, b) = pair(token, token, "g");
            let (a, b) = (a.unwrap(), b.unwrap());
            for n in [0, 1, RECORD - 40, RECORD, 3 * RECORD + 7] {
                let msg = Ctl::Kv { epoch: 3, key: "k".into(), value: vec![7u8; n] };
                a.send(&msg).unwrap();
                match b.recv().unwrap() {
                    Ctl::Kv { epoch: 3, value, .. } => assert_eq!(value.len(), n),
                    other => panic!("got {other:?}"),
                }
            }
            b.send(&Ctl::Heartbeat { epoch: 9 }).unwrap();
            assert!(matches!(a.recv().unwrap(), Ctl::Heartbeat { epoch: 9 }));
        }
    }

    #[test]
    fn a_wrong_token_another_group_or_a_missing_token_is_refused() {
        let (a, b) = pair(Some(b"one"), Some(b"two"), "g");
        assert!(a.is_err() || b.is_err());
        let (a, b) = pair(Some(b"one"), Some(b"one"), "other");
        assert!(a.is_err() || b.is_err());
        let (a, b) = pair(Some(b"one"), None, "g");
        let e = a.err().or(b.err()).expect("refused");
        assert!(e.to_string().contains("PLAIT_TOKEN"), "{e}");
    }
}
