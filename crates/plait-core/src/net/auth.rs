//! Who is at the other end of a link. Every rank makes a fresh static key pair for each
//! communicator (each epoch) and publishes the public half through the store with its address;
//! every connection (every lane) then runs the Noise `KK` handshake against the keys published
//! for both ends, so a process that can read the store but lacks a rank's private key cannot
//! pass for that rank. With `PLAIT_TOKEN` set, a key derived from the token is mixed in first
//! (`KKpsk0`), so a process that can also *write* the store (and publish keys of its own) still
//! cannot complete a handshake without the token.
//!
//! On the wire, after the plain hello (which says who the connector claims to be, so the acceptor
//! knows which published key to expect, and which both ends mix in as the Noise prologue, so a
//! hello changed in transit fails the handshake):
//!   connector -> acceptor: len u16 | Noise message 1 (sent with the hello, in one write)
//!   acceptor -> connector: the reply (accept) | len u16 | Noise message 2
//!   connector -> acceptor: len u16 | an empty sealed record (proves the connector holds the
//!                          final keys, so a replayed message 1 never becomes a link)
//! A refusal stays a plain reply with its reason, as before.
//!
//! What it costs: one more round trip's worth of bytes per connection at start-up (about 100
//! bytes), and nothing per frame unless `PLAIT_ENCRYPT=1`, which seals every frame with the
//! handshake's keys (see `seal`).

use super::handshake::{read_exact_by, Hello};
use super::seal::{FrameCipher, Opener, Sealer, TAG_LEN};
use crate::error::PlaitError;
use blake2::{Blake2s256, Digest};
use parking_lot::{Condvar, Mutex};
use snow::{Builder, HandshakeState};
use std::io::{self, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Instant;

pub const KEY_LEN: usize = 32;
pub type PublicKey = [u8; KEY_LEN];

const PATTERN: &str = "Noise_KK_25519_ChaChaPoly_BLAKE2s";
const PATTERN_PSK: &str = "Noise_KKpsk0_25519_ChaChaPoly_BLAKE2s";
const PROLOGUE: &[u8] = b"plait link v3\n";
/// Noise messages here are 16-96 bytes; anything longer is not a plait peer.
const MAX_MSG_LEN: usize = 512;

/// What both ends of a link must agree on beyond the hello's identity fields; carried in the
/// hello, so a mismatch is refused with a reason that says which setting differs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkMode {
    /// `PLAIT_TOKEN` (or `PLAIT_TOKEN_FILE`) is set.
    pub token: bool,
    /// `PLAIT_ENCRYPT=1`: every frame is sealed.
    pub encrypt: bool,
}

impl LinkMode {
    pub(super) fn to_byte(self) -> u8 {
        self.token as u8 | (self.encrypt as u8) << 1
    }

    pub(super) fn from_byte(b: u8) -> Option<LinkMode> {
        (b & !3 == 0).then_some(LinkMode { token: b & 1 != 0, encrypt: b & 2 != 0 })
    }

    /// Why a peer in `theirs` cannot link with this rank in `self`, if it cannot.
    pub(super) fn refusal(self, peer: u32, theirs: LinkMode) -> Option<String> {
        let has = |on: bool| if on { "has" } else { "does not have" };
        if theirs.token != self.token {
            Some(format!(
                "rank {peer} {} PLAIT_TOKEN set and this rank {} (every rank needs the same token, or none)",
                has(theirs.token),
                has(self.token)
            ))
        } else if theirs.encrypt != self.encrypt {
            Some(format!(
                "rank {peer} {} PLAIT_ENCRYPT=1 and this rank {} (set it the same on every rank)",
                has(theirs.encrypt),
                has(self.encrypt)
            ))
        } else {
            None
        }
    }
}

/// One rank's credentials for one communicator: its key pair, the token's key, and the keys the
/// other ranks published (known once the rendezvous has read them).
pub struct LinkAuth {
    private: Vec<u8>,
    public: PublicKey,
    psk: Option<[u8; KEY_LEN]>,
    encrypt: bool,
    peers: Mutex<Peers>,
    peers_known: Condvar,
    /// Start-up was called off: connects stop retrying.
    cancelled: std::sync::atomic::AtomicBool,
}

#[derive(Clone)]
enum Peers {
    /// The rendezvous has not read them yet.
    Unknown,
    Known(Vec<PublicKey>),
    /// Nobody will learn them (the listener closed): waiters give up.
    NeverKnown,
}

impl LinkAuth {
    /// A fresh key pair; `token` is the pre-shared secret, if any.
    pub fn generate(token: Option<&[u8]>, encrypt: bool) -> Result<LinkAuth, PlaitError> {
        let kp = Builder::new(PATTERN.parse().expect("a valid Noise pattern"))
            .generate_keypair()
            .map_err(|e| PlaitError::Io(format!("cannot generate this rank's link key: {e}")))?;
        let public = kp.public.as_slice().try_into().expect("a 32-byte X25519 key");
        let psk = token.map(|t| token_key(b"plait token v1\n", t));
        Ok(LinkAuth { private: kp.private, public, psk, encrypt, peers: Mutex::new(Peers::Unknown), peers_known: Condvar::new(), cancelled: Default::default() })
    }

    pub fn public_key(&self) -> PublicKey {
        self.public
    }

    pub fn mode(&self) -> LinkMode {
        LinkMode { token: self.psk.is_some(), encrypt: self.encrypt }
    }

    /// The public key every rank published, by rank (this rank's own included).
    pub fn learn_peers(&self, keys: Vec<PublicKey>) {
        *self.peers.lock() = Peers::Known(keys);
        self.peers_known.notify_all();
    }

    /// Handshakes still waiting for the keys give up (their listener closed).
    pub fn stop_waiting(&self) {
        let mut peers = self.peers.lock();
        if matches!(*peers, Peers::Unknown) {
            *peers = Peers::NeverKnown;
        }
        self.peers_known.notify_all();
    }

    /// Calls start-up off: connects stop retrying, handshakes stop waiting for keys.
    pub fn cancel(&self) {
        self.cancelled.store(true, std::sync::atomic::Ordering::SeqCst);
        self.stop_waiting();
    }

    pub fn cancelled(&self) -> bool {
        self.cancelled.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The key `rank` published, waiting until the rendezvous has read it (by `deadline`).
    fn peer_key(&self, rank: u32, deadline: Instant) -> Option<PublicKey> {
        let mut peers = self.peers.lock();
        while matches!(*peers, Peers::Unknown) {
            if self.peers_known.wait_until(&mut peers, deadline).timed_out() {
                break;
            }
        }
        match &*peers {
            Peers::Known(keys) => keys.get(rank as usize).copied(),
            _ => None,
        }
    }

    fn handshake(&self, hello: &Hello, peer_key: &PublicKey, initiator: bool) -> HandshakeState {
        let pattern = if self.psk.is_some() { PATTERN_PSK } else { PATTERN };
        let mut prologue = PROLOGUE.to_vec();
        prologue.extend_from_slice(&hello.encode());
        let build = || -> Result<HandshakeState, snow::Error> {
            let b = Builder::new(pattern.parse()?).local_private_key(&self.private)?.remote_public_key(peer_key)?.prologue(&prologue)?;
            let b = match &self.psk {
                Some(psk) => b.psk(0, psk)?,
                None => b,
            };
            if initiator {
                b.build_initiator()
            } else {
                b.build_responder()
            }
        };
        build().expect("the pattern and the keys are well formed")
    }

    fn not_proven(&self, rank: u32) -> String {
        let token = if self.psk.is_some() { ", or its PLAIT_TOKEN differs from this rank's" } else { "" };
        format!("rank {rank} did not prove it holds the key rank {rank} published in the store (not the rank it claims to be{token})")
    }
}

/// A connection that passed the handshake, with its frame keys when frames are sealed.
pub struct LinkStream {
    pub stream: TcpStream,
    pub cipher: Option<FrameCipher>,
}

impl std::fmt::Debug for LinkStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkStream").field("stream", &self.stream).field("sealed", &self.cipher.is_some()).finish()
    }
}

/// The connecting side, between sending its first message and reading the acceptor's answer.
pub(super) struct Initiator {
    hs: HandshakeState,
    to: u32,
}

/// Builds message 1 for `hello` (whose sender is this rank) and appends it to `out`.
pub(super) fn initiate(auth: &LinkAuth, hello: &Hello, deadline: Instant, out: &mut Vec<u8>) -> Result<Initiator, String> {
    let key = auth.peer_key(hello.to, deadline).ok_or_else(|| format!("no published key of rank {} is known", hello.to))?;
    let mut hs = auth.handshake(hello, &key, true);
    let mut msg = [0u8; MAX_MSG_LEN];
    let n = hs.write_message(&[], &mut msg).map_err(|e| format!("cannot write handshake message: {e}"))?;
    push_msg(out, &msg[..n]);
    Ok(Initiator { hs, to: hello.to })
}

impl Initiator {
    /// After an accepting reply: checks message 2 (the acceptor proves its key) and sends the
    /// confirmation. `Err` from the I/O is worth a retry; `Ok(Err(why))` is not.
    pub(super) fn finish(mut self, auth: &LinkAuth, s: &mut TcpStream, deadline: Instant) -> io::Result<Result<Option<FrameCipher>, String>> {
        let msg = read_msg(s, deadline)?;
        if self.hs.read_message(&msg, &mut [0u8; MAX_MSG_LEN]).is_err() {
            return Ok(Err(auth.not_proven(self.to)));
        }
        let keys = match self.hs.into_stateless_transport_mode() {
            Ok(k) => Arc::new(k),
            Err(e) => return Ok(Err(format!("handshake did not finish: {e}"))),
        };
        let (mut seal, open) = (Sealer::new(keys.clone()), Opener::new(keys));
        let mut confirm = Vec::new();
        let mut record = Vec::new();
        seal.seal(&[], &mut record).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        push_msg(&mut confirm, &record);
        s.write_all(&confirm)?;
        Ok(Ok(auth.encrypt.then_some(FrameCipher { seal, open })))
    }
}

/// The accepting side, once message 1 proved the connector's key.
pub(super) struct Responder {
    hs: HandshakeState,
}

/// Why a connection is not accepted: the peer hears `Refuse`; `Drop` closes it silently (the
/// connector retries).
pub(super) enum Rejection {
    Refuse(String),
    Drop(String),
}

/// Checks message 1 against the key `hello.from` published.
pub(super) fn respond(auth: &LinkAuth, hello: &Hello, msg1: &[u8], deadline: Instant) -> Result<Responder, Rejection> {
    let key = auth
        .peer_key(hello.from, deadline)
        .ok_or_else(|| Rejection::Drop(format!("the published key of rank {} is not known yet", hello.from)))?;
    let mut hs = auth.handshake(hello, &key, false);
    if hs.read_message(msg1, &mut [0u8; MAX_MSG_LEN]).is_err() {
        return Err(Rejection::Refuse(auth.not_proven(hello.from)));
    }
    Ok(Responder { hs })
}

impl Responder {
    /// Appends message 2 to `out` (after the accepting reply).
    pub(super) fn answer(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        let mut msg = [0u8; MAX_MSG_LEN];
        let n = self.hs.write_message(&[], &mut msg).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        push_msg(out, &msg[..n]);
        Ok(())
    }

    /// Reads the connector's confirmation: only then is the link up.
    pub(super) fn confirm(self, auth: &LinkAuth, from: u32, s: &mut TcpStream, deadline: Instant) -> io::Result<Option<FrameCipher>> {
        let msg = read_msg(s, deadline)?;
        let keys = Arc::new(self.hs.into_stateless_transport_mode().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?);
        let (seal, mut open) = (Sealer::new(keys.clone()), Opener::new(keys));
        let mut out = [0u8; MAX_MSG_LEN];
        if msg.len() != TAG_LEN || open.open(&msg, &mut out).is_err() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, auth.not_proven(from)));
        }
        Ok(auth.encrypt.then_some(FrameCipher { seal, open }))
    }
}

fn push_msg(out: &mut Vec<u8>, msg: &[u8]) {
    out.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    out.extend_from_slice(msg);
}

/// One length-prefixed handshake message, refusing lengths no plait peer sends.
pub(super) fn read_msg(s: &mut TcpStream, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 2];
    read_exact_by(s, &mut len, deadline)?;
    let len = u16::from_le_bytes(len) as usize;
    if len > MAX_MSG_LEN {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("handshake message of {len} bytes exceeds {MAX_MSG_LEN}")));
    }
    let mut msg = vec![0u8; len];
    read_exact_by(s, &mut msg, deadline)?;
    Ok(msg)
}

/// Public keys as they travel in the store: hex.
/// The 32-byte pre-shared key a handshake mixes in, from `PLAIT_TOKEN`; `label` keeps the keys
/// of different uses (data links, control links) apart.
pub(crate) fn token_key(label: &[u8], token: &[u8]) -> [u8; KEY_LEN] {
    let mut h = Blake2s256::new();
    h.update(label);
    h.update(token);
    h.finalize().into()
}

pub fn key_to_hex(key: &PublicKey) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn key_from_hex(text: &str) -> Option<PublicKey> {
    if text.len() != 2 * KEY_LEN || !text.is_ascii() {
        return None;
    }
    let mut key = [0u8; KEY_LEN];
    for (i, k) in key.iter_mut().enumerate() {
        *k = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(key)
}

#[cfg(test)]
impl LinkAuth {
    /// The same key pair with another token: a rank that holds the right key.
    fn with_token(&self, token: Option<&[u8]>) -> LinkAuth {
        let mut other = LinkAuth::generate(token, self.encrypt).unwrap();
        other.private = self.private.clone();
        other.public = self.public;
        *other.peers.lock() = self.peers.lock().clone();
        other
    }
}

/// Credentials for a whole test world, each knowing every rank's key.
#[cfg(test)]
pub(in crate::net) fn test_world(world: usize, token: Option<&[u8]>, encrypt: bool) -> Vec<Arc<LinkAuth>> {
    let auths: Vec<Arc<LinkAuth>> = (0..world).map(|_| Arc::new(LinkAuth::generate(token, encrypt).unwrap())).collect();
    let keys: Vec<PublicKey> = auths.iter().map(|a| a.public_key()).collect();
    for a in &auths {
        a.learn_peers(keys.clone());
    }
    auths
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::connect::connect;
    use crate::net::handshake::testing::{hello, lo_route, soon};
    use crate::net::listener::Listener;
    use std::io::Read;
    use std::time::Duration;

    /// Rank `from` connects to `listener` (rank 0) with `auth` in a world of 3.
    fn attempt(listener: &Listener, from: u32, auth: &LinkAuth) -> Result<LinkStream, PlaitError> {
        connect(&lo_route(), listener.port(), &hello("g", 1, from, 0, 3), auth, soon(3000))
    }

    /// The real rank `from` connects and the link carries bytes both ways.
    fn real_peer_gets_in(listener: &Listener, from: u32, auth: Arc<LinkAuth>) {
        let port = listener.port();
        let c = std::thread::spawn(move || connect(&lo_route(), port, &hello("g", 1, from, 0, 3), &auth, soon(3000)).unwrap());
        let mut s = listener.accept_from(from, soon(3000)).unwrap().stream;
        let mut c = c.join().unwrap().stream;
        c.write_all(b"ok").unwrap();
        let mut b = [0u8; 2];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"ok");
    }

    /// A process that read every published key from the store but holds none of the private keys
    /// cannot pass for a rank: the listener refuses it, names why, and keeps serving the real
    /// rank; and a listener that is not the rank it claims to be is found out by the connector.
    #[test]
    fn a_stranger_who_read_the_store_cannot_pass_for_a_rank() {
        let world = test_world(3, None, false);
        let stranger = LinkAuth::generate(None, false).unwrap();
        stranger.learn_peers(world.iter().map(|a| a.public_key()).collect());
        let l = Listener::bind(hello("g", 1, 0, 0, 3), world[0].clone()).unwrap();

        let e = attempt(&l, 1, &stranger).unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.kind(), "peer", "{msg}");
        assert!(msg.contains("refused") && msg.contains("rank 1 did not prove it holds the key rank 1 published"), "{msg}");
        // The listener names the refusal when rank 1 is late, and takes the real rank 1.
        let e = l.accept_from(1, soon(100)).unwrap_err();
        assert!(e.to_string().contains("did not prove"), "{e}");
        real_peer_gets_in(&l, 1, world[1].clone());
        // A stranger claiming a rank after the real one is in is refused the same way.
        assert!(attempt(&l, 2, &stranger).unwrap_err().to_string().contains("did not prove"));
        real_peer_gets_in(&l, 2, world[2].clone());

        // The other way round: a stranger listening where rank 0 should be cannot read the
        // connector's first message, and one that accepts blindly is found out by the connector.
        let fake = Listener::bind(hello("g", 1, 0, 0, 3), Arc::new(stranger)).unwrap();
        let e = attempt(&fake, 1, &world[1]).unwrap_err();
        assert!(e.to_string().contains("rank 1 did not prove"), "{e}");
        assert!(fake.accept_from(1, soon(100)).is_err());
        let blind = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = blind.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut s, _) = blind.accept().unwrap();
            let mut first = [0u8; 256];
            let _ = s.read(&mut first);
            let mut answer = super::super::handshake::reply(true, "");
            push_msg(&mut answer, &[7u8; 48]);
            s.write_all(&answer).unwrap();
            let _ = s.read(&mut first);
        });
        let e = connect(&lo_route(), port, &hello("g", 1, 1, 0, 3), &world[1], soon(3000)).unwrap_err();
        assert!(e.to_string().contains("rank 0 did not prove it holds the key rank 0 published"), "{e}");
        server.join().unwrap();
    }

    /// With a token, holding the right key is not enough: a rank without the token, or with
    /// another one, is refused, and so is a stranger that published its own key in the store.
    #[test]
    fn with_a_token_the_right_key_alone_is_refused() {
        let world = test_world(3, Some(b"s3cret"), false);
        let l = Listener::bind(hello("g", 1, 0, 0, 3), world[0].clone()).unwrap();

        let e = attempt(&l, 1, &world[1].with_token(None)).unwrap_err().to_string();
        assert!(e.contains("refused") && e.contains("rank 1 does not have PLAIT_TOKEN set and this rank has"), "{e}");
        let e = attempt(&l, 1, &world[1].with_token(Some(b"guess"))).unwrap_err().to_string();
        assert!(e.contains("rank 1 did not prove") && e.contains("PLAIT_TOKEN differs"), "{e}");
        real_peer_gets_in(&l, 1, world[1].clone());

        // A stranger who can write the store publishes its own key as rank 2's.
        let stranger = LinkAuth::generate(Some(b"guess"), false).unwrap();
        let mut keys: Vec<PublicKey> = world.iter().map(|a| a.public_key()).collect();
        keys[2] = stranger.public_key();
        stranger.learn_peers(keys.clone());
        let fooled = Arc::new(world[0].with_token(Some(b"s3cret")));
        fooled.learn_peers(keys);
        let l2 = Listener::bind(hello("g", 1, 0, 0, 3), fooled).unwrap();
        let e = attempt(&l2, 2, &stranger).unwrap_err().to_string();
        assert!(e.contains("rank 2 did not prove"), "{e}");
        assert!(l2.accept_from(2, soon(100)).is_err());
    }

    /// Connectors retry while the acceptor has not read the published keys yet.
    #[test]
    fn a_connection_before_the_keys_are_known_waits_for_them() {
        let world = test_world(2, None, false);
        let late = Arc::new(world[0].with_token(None));
        *late.peers.lock() = Peers::Unknown;
        let l = Listener::bind(hello("g", 1, 0, 0, 2), late.clone()).unwrap();
        let (port, a1) = (l.port(), world[1].clone());
        let c = std::thread::spawn(move || connect(&lo_route(), port, &hello("g", 1, 1, 0, 2), &a1, soon(5000)));
        std::thread::sleep(Duration::from_millis(200));
        late.learn_peers(world.iter().map(|a| a.public_key()).collect());
        l.accept_from(1, soon(5000)).unwrap();
        c.join().unwrap().unwrap();
    }

    #[test]
    fn keys_survive_the_store_and_junk_is_refused() {
        let a = LinkAuth::generate(None, false).unwrap();
        assert_eq!(key_from_hex(&key_to_hex(&a.public_key())), Some(a.public_key()));
        assert_eq!(key_from_hex("00"), None);
        assert_eq!(key_from_hex(&"zz".repeat(KEY_LEN)), None);
        assert_ne!(LinkAuth::generate(None, false).unwrap().public_key(), a.public_key(), "keys must be fresh");
    }

    #[test]
    fn link_mode_travels_in_one_byte_and_names_the_setting_that_differs() {
        for token in [false, true] {
            for encrypt in [false, true] {
                let m = LinkMode { token, encrypt };
                assert_eq!(LinkMode::from_byte(m.to_byte()), Some(m));
            }
        }
        assert_eq!(LinkMode::from_byte(4), None);
        let plain = LinkMode::default();
        let why = plain.refusal(3, LinkMode { token: true, encrypt: false }).unwrap();
        assert!(why.contains("rank 3 has PLAIT_TOKEN") && why.contains("this rank does not"), "{why}");
        let why = plain.refusal(3, LinkMode { token: false, encrypt: true }).unwrap();
        assert!(why.contains("PLAIT_ENCRYPT"), "{why}");
        assert_eq!(plain.refusal(3, plain), None);
    }
}
