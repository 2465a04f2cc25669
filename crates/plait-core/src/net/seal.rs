//! Sealed frames (`PLAIT_ENCRYPT=1`): every frame is sent as records encrypted and
//! authenticated (ChaCha20-Poly1305) with the keys of its connection's handshake, so a frame read
//! or changed in transit is refused, not computed with.
//!
//! A frame becomes its 64-byte header as one record (80 bytes on the wire), then its payload cut
//! into records of at most `RECORD_MAX` bytes, each followed by its 16-byte tag. Both ends know
//! where records end from the header's `nbytes`, so records carry no lengths. Each direction of
//! each connection counts its records (the AEAD nonce): a record dropped, repeated or moved fails
//! to open. The writer is one thread at a time (the lane's writer lock), and so is the reader
//! (the frame lock), so the counters need no locks of their own.

use snow::StatelessTransportState;
use std::io;
use std::sync::Arc;

pub const TAG_LEN: usize = 16;
/// Noise transport messages are at most 65535 bytes, tag included.
pub const RECORD_MAX: usize = 65535 - TAG_LEN;

/// Both directions of one connection.
pub struct FrameCipher {
    pub seal: Sealer,
    pub open: Opener,
}

/// The sending direction.
pub struct Sealer {
    keys: Arc<StatelessTransportState>,
    next: u64,
}

/// The receiving direction.
pub struct Opener {
    keys: Arc<StatelessTransportState>,
    next: u64,
}

impl Sealer {
    pub(super) fn new(keys: Arc<StatelessTransportState>) -> Sealer {
        Sealer { keys, next: 0 }
    }

    /// Appends `plain` (at most `RECORD_MAX` bytes) sealed, with its tag, to `out`.
    pub fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        let at = out.len();
        out.resize(at + plain.len() + TAG_LEN, 0);
        let n = self.keys.write_message(self.next, plain, &mut out[at..]).map_err(|e| invalid(format!("cannot seal a frame: {e}")))?;
        debug_assert_eq!(n, plain.len() + TAG_LEN);
        self.next += 1;
        Ok(())
    }

}

impl Opener {
    pub(super) fn new(keys: Arc<StatelessTransportState>) -> Opener {
        Opener { keys, next: 0 }
    }

    /// Opens one record (`sealed` with its tag) into `plain`; returns the plaintext's length.
    pub fn open(&mut self, sealed: &[u8], plain: &mut [u8]) -> io::Result<usize> {
        let n = self.keys.read_message(self.next, sealed, plain).map_err(|_| {
            invalid(format!(
                "a sealed frame failed authentication (record {}): changed in transit, or not from this link's peer",
                self.next
            ))
        })?;
        self.next += 1;
        Ok(n)
    }
}

/// The wire length of a record carrying `plain` bytes.
pub const fn sealed_len(plain: usize) -> usize {
    plain + TAG_LEN
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

#[cfg(test)]
mod tests {
    use crate::net::auth::{test_world, LinkStream};
    use crate::net::connect::connect;
    use crate::net::frame::{FrameHeader, FrameKind};
    use crate::net::handshake::testing::{hello, lo_route, soon};
    use crate::net::listener::Listener;
    use crate::net::peer::{write_sealed, Delivery, Inbox, LaneWaker, SendBuf, SendReq};
    use crate::net::reader::ReadSide;
    use crossbeam_channel::{Receiver, Sender};
    use std::io::{self, Read, Write};
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// A sealed link's two ends, as the handshake leaves them.
    fn sealed_pair() -> (LinkStream, LinkStream) {
        let a = test_world(2, None, true);
        let l = Listener::bind(hello("g", 1, 0, 0, 2), a[0].clone()).unwrap();
        let (port, a1) = (l.port(), a[1].clone());
        let c = std::thread::spawn(move || connect(&lo_route(), port, &hello("g", 1, 1, 0, 2), &a1, soon(3000)).unwrap());
        let accepted = l.accept_from(1, soon(3000)).unwrap();
        (c.join().unwrap(), accepted)
    }

    enum Got {
        Frame(Vec<u8>),
        Down(io::Error),
    }

    struct Record(Sender<Got>);

    impl Inbox for Record {
        fn deliver(&self, _peer: usize, h: &FrameHeader, payload: &mut dyn Read, _lane: Option<&LaneWaker>) -> io::Result<Delivery> {
            let mut v = vec![0u8; h.nbytes as usize];
            // Odd-sized reads, as a reduction reading piece by piece does.
            for piece in v.chunks_mut(1000) {
                payload.read_exact(piece)?;
            }
            let _ = self.0.send(Got::Frame(v));
            Ok(Delivery::Taken)
        }
        fn link_down(&self, _peer: usize, error: io::Error, _clean: bool) {
            let _ = self.0.send(Got::Down(error));
        }
    }

    /// The receiving end reading frames on a thread of its own.
    fn receiver(end: LinkStream) -> (Receiver<Got>, Arc<ReadSide>, Arc<AtomicBool>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let deaf = Arc::new(AtomicBool::new(false));
        let open = end.cipher.map(|c| c.open);
        let side = ReadSide::new(1, end.stream, Arc::new(Record(tx)), Duration::from_secs(1), Arc::new(AtomicU64::new(0)), Instant::now(), deaf.clone(), open).unwrap();
        let r = side.clone();
        std::thread::spawn(move || r.run());
        (rx, side, deaf)
    }

    fn frame(payload: &[u8]) -> SendReq {
        let header = FrameHeader { kind: FrameKind::P2p as u8, nbytes: payload.len() as u64, ..Default::default() };
        SendReq { header, data: SendBuf { ptr: payload.as_ptr(), len: payload.len() }, done: None }
    }

    #[test]
    fn sealed_frames_of_every_size_arrive_intact() {
        let (mut tx_end, rx_end) = sealed_pair();
        let mut seal = tx_end.cipher.take().unwrap().seal;
        let (got, side, deaf) = receiver(rx_end);
        let mut scratch = Vec::new();
        for len in [0usize, 1, 100, super::RECORD_MAX - 1, super::RECORD_MAX, super::RECORD_MAX + 1, 300_007, 3 << 20] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 13 + len) as u8).collect();
            write_sealed(&mut tx_end.stream, &frame(&payload), &mut scratch, &mut seal).unwrap();
            match got.recv_timeout(Duration::from_secs(5)).unwrap() {
                Got::Frame(v) => assert!(v == payload, "{len}-byte payload corrupted"),
                Got::Down(e) => panic!("{len}-byte frame: link down: {e}"),
            }
        }
        deaf.store(true, std::sync::atomic::Ordering::SeqCst);
        side.wake();
    }

    /// A byte changed in transit, in a header or in a payload, ends the link with an error that
    /// says so; nothing of the changed frame is delivered.
    #[test]
    fn a_sealed_frame_changed_in_transit_is_refused() {
        for flip in [3usize, 80 + 5, 80 + 70_000] {
            let (mut tx_end, rx_end) = sealed_pair();
            let mut seal = tx_end.cipher.take().unwrap().seal;
            let (got, _side, _deaf) = receiver(rx_end);
            let payload = vec![42u8; 100_000];
            let mut wire = Vec::new();
            write_sealed(&mut wire, &frame(&payload), &mut Vec::new(), &mut seal).unwrap();
            wire[flip] ^= 1;
            tx_end.stream.write_all(&wire).unwrap();
            match got.recv_timeout(Duration::from_secs(5)).unwrap() {
                Got::Down(e) => assert!(e.to_string().contains("failed authentication"), "byte {flip}: {e}"),
                Got::Frame(_) => panic!("byte {flip}: a changed frame was delivered"),
            }
        }
    }
}
