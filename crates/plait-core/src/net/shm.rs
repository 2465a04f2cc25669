//! Payloads through shared memory between two ranks of one host (`PLAIT_SHM_BYTES`).
//!
//! Over loopback TCP every byte is copied into the kernel and out again, with per-packet work on
//! both sides; on a machine with few cores that, not memory, bounds a large collective. A lane
//! between ranks of one host may instead carry large payloads through a ring of shared memory,
//! one per direction: the sender copies the payload into the ring and then writes the frame's
//! header on the lane as before, marked `SHM_PAYLOAD`; the receiver, reading that header, lands
//! the payload straight from the ring and frees its room. Everything else stays as it is: headers,
//! order, matching, parking (a parked frame's payload just waits in the ring), heartbeats, and
//! failure (the TCP connection still says when a peer is gone).
//!
//! Setting a ring up takes no round trip. The sender creates it (`Outbound::create`) and writes
//! an offer frame (`FrameKind::ShmOffer`: the region's name, a random nonce, the capacity) on
//! the lane; the receiver's reader maps it (`Inbound::accept`), checks the nonce the sender wrote
//! in the region, removes the name, and marks the region accepted. The sender uses the ring from
//! the first frame after it sees that mark. A receiver that cannot map it (another `/dev/shm`,
//! a platform without shared memory) leaves it unmarked, and the lane stays on TCP.
//!
//! The ring is a byte FIFO with two counters that only grow: `head` (bytes the sender has
//! placed) and `tail` (bytes the receiver has freed). A payload is never split: one that does
//! not fit before the ring's end starts at its beginning, and both sides compute that place from
//! their own counter (`place`), since both see the frames in one order. A sender that finds no
//! room says so in the ring and sleeps (a futex on Linux, short sleeps elsewhere) until the
//! receiver frees some and wakes it: the ring holds several segments, so it waits only when the
//! receiver falls behind, as a full socket would make it.
//!
//! Only a link's first connection offers a ring: start-up's probes travel on it after the offer,
//! so once they are answered the sender knows whether the peer took the ring, and a ring the
//! peer could not map is dropped (its name removed) then and there.

use crate::platform::shm::{self, Region};
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// The region starts with this header; payloads start at `DATA`.
const MAGIC: u64 = u64::from_le_bytes(*b"PLTRING2");
const MAGIC_AT: usize = 0;
const NONCE_AT: usize = 8;
const CAPACITY_AT: usize = 24;
/// Words on cache lines of their own (128 bytes apart: Apple's M-series lines are that long).
/// The receiver writes `ACCEPTED`, `TAIL` and, beside it, `FREED` (u32: bumped each time it
/// frees room); the sender writes `HEAD`, and `WAITING` (u32) while it sleeps on `FREED`.
const ACCEPTED_AT: usize = 128;
const HEAD_AT: usize = 256;
const TAIL_AT: usize = 384;
const FREED_AT: usize = 392;
const WAITING_AT: usize = 512;
const DATA: usize = 4096;

/// The longest offer payload a reader takes (a name, a nonce, a capacity).
pub const OFFER_MAX_BYTES: u64 = 128;
/// The largest ring a reader maps (`PLAIT_SHM_BYTES` allows no more).
const CAPACITY_MAX: u64 = 1 << 30;

struct Ring {
    region: Region,
    capacity: u64,
}

impl Ring {
    fn counter(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is an 8-aligned offset inside the header page of a live, page-aligned
        // mapping; the peer only ever touches these words atomically.
        unsafe { &*(self.region.as_ptr().add(at) as *const AtomicU64) }
    }

    fn word(&self, at: usize) -> &AtomicU32 {
        // SAFETY: as `counter`, 4-aligned.
        unsafe { &*(self.region.as_ptr().add(at) as *const AtomicU32) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the mapping is DATA + capacity bytes long.
        unsafe { self.region.as_ptr().add(DATA) }
    }
}

/// Where a payload of `n` bytes goes when the ring's counter is at `pos`: there, or at the
/// ring's start when it would run past the end.
fn place(pos: u64, n: u64, capacity: u64) -> u64 {
    let off = pos % capacity;
    if off + n > capacity {
        pos + (capacity - off)
    } else {
        pos
    }
}

/// The sending end of one lane's ring.
pub struct Outbound {
    ring: Ring,
    head: u64,
    accepted: bool,
}

impl Outbound {
    /// A ring that carries payloads of up to `capacity` bytes, and the offer to send the peer.
    pub fn create(capacity: usize) -> io::Result<(Outbound, Vec<u8>)> {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).map_err(|e| io::Error::other(format!("no random nonce: {e}")))?;
        let region = Region::create(DATA + capacity)?;
        // SAFETY: the header lies inside the fresh mapping, which nobody else has mapped yet.
        unsafe {
            let p = region.as_ptr();
            std::ptr::copy_nonoverlapping(nonce.as_ptr(), p.add(NONCE_AT), 16);
            (p.add(CAPACITY_AT) as *mut u64).write((capacity as u64).to_le());
            (p.add(MAGIC_AT) as *mut u64).write(MAGIC.to_le());
        }
        let mut offer = Vec::with_capacity(64);
        offer.extend_from_slice(&(capacity as u64).to_le_bytes());
        offer.extend_from_slice(&nonce);
        offer.extend_from_slice(region.name().as_bytes());
        let ring = Ring { region, capacity: capacity as u64 };
        Ok((Outbound { ring, head: 0, accepted: false }, offer))
    }

    /// Whether a payload of `n` bytes may go through the ring now: the peer has accepted it
    /// and the payload fits.
    pub fn takes(&mut self, n: usize) -> bool {
        n as u64 <= self.ring.capacity && self.accepted()
    }

    /// Whether the peer has mapped the ring (once true, it stays so).
    pub fn accepted(&mut self) -> bool {
        if !self.accepted && self.ring.counter(ACCEPTED_AT).load(Ordering::Acquire) == 1 {
            self.accepted = true;
            // Both ends have it mapped: the name is no longer needed.
            self.ring.region.unlink();
        }
        self.accepted
    }

    /// Copies `payload` into the ring once there is room, and publishes it. `stopped` is asked
    /// while waiting; its error ends the wait (the link is shutting down or the peer is gone).
    pub fn put(&mut self, payload: &[u8], stopped: impl Fn() -> Option<io::Error>) -> io::Result<()> {
        let n = payload.len() as u64;
        let start = place(self.head, n, self.ring.capacity);
        let (tail, freed, waiting) = (self.ring.counter(TAIL_AT), self.ring.word(FREED_AT), self.ring.word(WAITING_AT));
        // Room: the bytes from the oldest unread one to this payload's end fit in the ring, or
        // nothing is unread (then the stretch skipped at the ring's end does not count).
        let room = |tail: u64| tail == self.head || start + n - tail <= self.ring.capacity;
        // Without a futex the sleeps grow from 5 µs to 1 ms; with one, the sleep ends when woken
        // and is bounded only so that `stopped` is asked again (a shutdown is seen within it).
        let mut nap = Duration::from_micros(5);
        while !room(tail.load(Ordering::SeqCst)) {
            if let Some(e) = stopped() {
                return Err(e);
            }
            // Say so before looking once more: the receiver frees, then reads the flag.
            let seen = freed.load(Ordering::SeqCst);
            waiting.store(1, Ordering::SeqCst);
            if !room(tail.load(Ordering::SeqCst)) {
                shm::wait_while(freed, seen, if shm::CAN_WAKE { Duration::from_millis(10) } else { nap });
                nap = (nap * 2).min(Duration::from_millis(1));
            }
            waiting.store(0, Ordering::SeqCst);
        }
        // SAFETY: start % capacity + n <= capacity (`place`), and the receiver has freed these
        // bytes (tail), so nobody reads them until `head` says so.
        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), self.ring.data().add((start % self.ring.capacity) as usize), payload.len()) };
        self.head = start + n;
        self.ring.counter(HEAD_AT).store(self.head, Ordering::Release);
        Ok(())
    }
}

impl Drop for Outbound {
    fn drop(&mut self) {
        // A peer that never mapped the ring leaves its name behind otherwise.
        self.ring.region.unlink();
    }
}

/// The receiving end of one lane's ring.
pub struct Inbound {
    ring: Ring,
    pos: u64,
}

impl Inbound {
    /// Maps the ring `offer` names, checks it is the one the sender made, and accepts it.
    pub fn accept(offer: &[u8]) -> io::Result<Inbound> {
        let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, format!("a shared-memory offer {why}"));
        if offer.len() < 24 || offer.len() as u64 > OFFER_MAX_BYTES {
            return Err(bad(&format!("of {} bytes", offer.len())));
        }
        let capacity = u64::from_le_bytes(offer[..8].try_into().unwrap());
        let Some(len) = (1..=CAPACITY_MAX).contains(&capacity).then(|| usize::try_from(capacity).ok()).flatten() else {
            return Err(bad(&format!("of {capacity} bytes")));
        };
        let name = std::str::from_utf8(&offer[24..]).map_err(|_| bad("whose name is not UTF-8"))?;
        let region = Region::open(name, DATA + len)?;
        // SAFETY: the header lies inside the mapping; the sender wrote it before offering.
        let (magic, nonce, cap) = unsafe {
            let p = region.as_ptr();
            let mut nonce = [0u8; 16];
            std::ptr::copy_nonoverlapping(p.add(NONCE_AT), nonce.as_mut_ptr(), 16);
            (u64::from_le((p.add(MAGIC_AT) as *const u64).read()), nonce, u64::from_le((p.add(CAPACITY_AT) as *const u64).read()))
        };
        if magic != MAGIC || nonce[..] != offer[8..24] || cap != capacity {
            return Err(bad(&format!("names {name}, which holds another ring")));
        }
        let ring = Ring { region, capacity };
        ring.region.unlink();
        ring.counter(ACCEPTED_AT).store(1, Ordering::Release);
        Ok(Inbound { ring, pos: 0 })
    }

    /// The next payload, of `n` bytes, as the sender placed it.
    pub fn next(&self, n: u64) -> io::Result<ShmPayload<'_>> {
        let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        if n > self.ring.capacity {
            return Err(bad(format!("it sent a {n}-byte payload through a shared-memory ring of {} bytes", self.ring.capacity)));
        }
        let start = place(self.pos, n, self.ring.capacity);
        let head = self.ring.counter(HEAD_AT).load(Ordering::Acquire);
        if head < start + n {
            return Err(bad(format!("it announced {n} bytes in shared memory that it had not placed there (ring at {start}, filled to {head})")));
        }
        // SAFETY: inside the data area (`place`); the sender published these bytes (head).
        let at = unsafe { self.ring.data().add((start % self.ring.capacity) as usize) };
        Ok(ShmPayload { at, left: n as usize, end: start + n, _ring: std::marker::PhantomData })
    }

    /// Frees the room of the payload whose `end` is given, once read to its end.
    pub fn consumed(&mut self, end: u64) {
        self.pos = end;
        self.ring.counter(TAIL_AT).store(self.pos, Ordering::SeqCst);
        let freed = self.ring.word(FREED_AT);
        freed.fetch_add(1, Ordering::SeqCst);
        if self.ring.word(WAITING_AT).load(Ordering::SeqCst) != 0 {
            shm::wake(freed);
        }
    }
}

/// A payload in the ring, read like the socket's.
pub struct ShmPayload<'a> {
    at: *const u8,
    left: usize,
    /// The ring's counter after this payload.
    end: u64,
    _ring: std::marker::PhantomData<&'a Inbound>,
}

impl ShmPayload<'_> {
    pub fn left(&self) -> u64 {
        self.left as u64
    }

    /// What `Inbound::consumed` takes once the payload is read.
    pub fn end(&self) -> u64 {
        self.end
    }
}

impl io::Read for ShmPayload<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.left);
        // SAFETY: `at` has `left` bytes the sender published and will not touch before `tail`
        // passes them; ptr::copy reads them without forming a reference to shared memory.
        unsafe {
            std::ptr::copy_nonoverlapping(self.at, buf.as_mut_ptr(), n);
            self.at = self.at.add(n);
        }
        self.left -= n;
        Ok(n)
    }
}

#[cfg(all(test, any(target_os = "linux", target_vendor = "apple")))]
mod tests {
    use super::*;
    use std::io::Read;

    fn pair(capacity: usize) -> (Outbound, Inbound) {
        let (mut out, offer) = Outbound::create(capacity).unwrap();
        assert!(!out.takes(1), "nothing goes through a ring before the peer accepts it");
        let inb = Inbound::accept(&offer).unwrap();
        assert!(out.takes(capacity) && !out.takes(capacity + 1));
        (out, inb)
    }

    fn take(inb: &mut Inbound, n: usize) -> Vec<u8> {
        let mut p = inb.next(n as u64).unwrap();
        let mut v = vec![0; n];
        p.read_exact(&mut v).unwrap();
        let end = p.end();
        inb.consumed(end);
        v
    }

    #[test]
    fn payloads_come_out_in_order_across_the_ring_end() {
        let (mut out, mut inb) = pair(1000);
        for round in 0..50u32 {
            let sizes = [300usize, 450, 1000, 7, 0, 640];
            for (i, &n) in sizes.iter().enumerate() {
                let v: Vec<u8> = (0..n).map(|k| (k as u32 * 31 + round * 7 + i as u32) as u8).collect();
                out.put(&v, || None).unwrap();
                assert_eq!(take(&mut inb, n), v, "round {round}, payload {i}");
            }
        }
    }

    #[test]
    fn a_full_ring_makes_the_sender_wait_until_the_receiver_frees_room() {
        let (mut out, mut inb) = pair(1000);
        out.put(&[1; 600], || None).unwrap();
        let t = std::thread::spawn(move || {
            out.put(&[2; 600], || None).unwrap();
            out
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished(), "the second payload needs the first one's room");
        assert_eq!(take(&mut inb, 600), vec![1; 600]);
        t.join().unwrap();
        assert_eq!(take(&mut inb, 600), vec![2; 600]);
    }

    #[test]
    fn a_wait_for_room_ends_when_the_link_stops() {
        let (mut out, _inb) = pair(1000);
        out.put(&[1; 800], || None).unwrap();
        let err = out.put(&[2; 800], || Some(io::Error::new(io::ErrorKind::BrokenPipe, "gone"))).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn an_announced_payload_that_was_never_placed_is_an_error_not_garbage() {
        let (_out, inb) = pair(1000);
        let err = inb.next(10).err().unwrap();
        assert!(err.to_string().contains("had not placed"), "{err}");
        assert!(inb.next(1001).is_err());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_ring_leaves_no_name_behind_taken_or_not() {
        let exists = |out: &Outbound| std::path::Path::new("/dev/shm").join(out.ring.region.name()).exists();
        let (out, _offer) = Outbound::create(4096).unwrap();
        assert!(exists(&out));
        let gone = out.ring.region.name().to_string();
        drop(out);
        assert!(!std::path::Path::new("/dev/shm").join(gone).exists(), "a ring nobody took is removed with its sender");
        let (mut out, offer) = Outbound::create(4096).unwrap();
        let _inb = Inbound::accept(&offer).unwrap();
        assert!(!exists(&out), "the receiver removes the name once it has mapped the ring");
        assert!(out.accepted());
    }

    #[test]
    fn offers_for_other_rings_are_refused() {
        let (_a, offer_a) = Outbound::create(4096).unwrap();
        let (_b, offer_b) = Outbound::create(4096).unwrap();
        let mut forged = offer_a[..24].to_vec();
        forged.extend_from_slice(&offer_b[24..]);
        assert!(Inbound::accept(&forged).err().unwrap().to_string().contains("another ring"));
        assert!(Inbound::accept(&offer_a[..10]).is_err());
        let mut gone = offer_a.clone();
        gone[24..].copy_from_slice(b"plait-0000000000000000");
        assert!(Inbound::accept(&gone).is_err());
    }
}
