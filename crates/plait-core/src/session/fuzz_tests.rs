//! The frame fuzz target: byte streams read the way a link's reader reads them (a 64-byte
//! header, then exactly the payload it announces) and handed to the links' demux, mailbox and
//! subgroups. The seeds are `fuzz/frames.corpus`; proptest mutates them and adds random streams.
//! Whatever the bytes, nothing may panic, a frame may not consume more than it announced, and
//! the bytes held for a peer stay within its budget. `PROPTEST_CASES` sets the number of runs.

use super::demux::Demux;
use super::groups::Groups;
use super::mailbox::{Mailbox, MIN_UNEXPECTED_BYTES};
use crate::net::frame::{FrameHeader, FrameKind, HEADER_LEN, SHM_PAYLOAD};
use crate::net::peer::{Delivery, Inbox, LaneWaker, Resume};
use proptest::prelude::*;
use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

fn corpus() -> Vec<Vec<u8>> {
    let text = include_str!("../../fuzz/frames.corpus");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let hex = l.split_whitespace().next().unwrap();
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("corpus lines are hex")).collect()
        })
        .collect()
}

/// A lane that frames may park on (waking it does nothing here: the stream ends there).
struct Lane;

impl Resume for Lane {
    fn resume(&self) {}
}

/// Reads `stream` as one peer's link: frames until the bytes run out, a frame is refused or one
/// is parked (which must leave its payload unread). Returns how many frames were delivered.
fn read_link(demux: &Demux, mailbox: &Mailbox, stream: &[u8]) -> usize {
    let lane = Arc::new(Lane);
    let weak: std::sync::Weak<dyn Resume> = Arc::downgrade(&lane) as std::sync::Weak<Lane>;
    let waker = LaneWaker::new(weak);
    let mut rest = stream;
    let mut frames = 0;
    while rest.len() >= HEADER_LEN {
        let raw: [u8; HEADER_LEN] = rest[..HEADER_LEN].try_into().unwrap();
        rest = &rest[HEADER_LEN..];
        let Ok(h) = FrameHeader::decode(&raw) else { break };
        if h.kind == FrameKind::Heartbeat as u8 && h.nbytes != 0 {
            break; // the reader refuses these before the demux sees them
        }
        if h.kind & SHM_PAYLOAD != 0 || h.kind == FrameKind::ShmOffer as u8 {
            break; // the reader takes these itself (net::shm); the demux never sees them
        }
        let before = rest.len();
        let mut payload = (&mut rest).take(h.nbytes);
        let delivered = demux.deliver(1, &h, &mut payload as &mut dyn Read, Some(&waker));
        let consumed = (before - rest.len()) as u64;
        assert!(consumed <= h.nbytes, "a frame consumed {consumed} bytes, past the {} it announced", h.nbytes);
        assert!(mailbox.held_total() <= MIN_UNEXPECTED_BYTES, "more held than the peer's budget");
        if let Ok(Delivery::Parked { .. }) = delivered {
            assert_eq!(consumed, 0, "a parked frame consumed part of its payload");
            break;
        }
        if delivered.is_err() || consumed < h.nbytes {
            break;
        }
        frames += 1;
    }
    frames
}

fn fresh() -> (Demux, Arc<Mailbox>) {
    let mailbox = Arc::new(Mailbox::with_limits(MIN_UNEXPECTED_BYTES, Duration::from_secs(60)));
    (Demux::new(mailbox.clone(), Duration::from_secs(1), Some(Arc::new(Groups::default()))), mailbox)
}

#[test]
fn every_corpus_stream_is_read_without_panic() {
    for stream in corpus() {
        let (demux, mailbox) = fresh();
        read_link(&demux, &mailbox, &stream);
    }
}

/// A corpus stream with some bytes changed, cut short or repeated, or random bytes behind a
/// valid magic.
fn mutated() -> impl Strategy<Value = Vec<u8>> {
    let seeds = corpus();
    let n = seeds.len();
    prop_oneof![
        (0..n, prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8), any::<prop::sample::Index>(), 1..3usize).prop_map(
            move |(i, edits, cut, repeat)| {
                let mut s = seeds[i].repeat(repeat);
                for (at, b) in edits {
                    let at = at.index(s.len());
                    s[at] = b;
                }
                let keep = s.len() - cut.index(s.len() / 4 + 1);
                s.truncate(keep);
                s
            }
        ),
        prop::collection::vec(any::<u8>(), 0..300).prop_map(|mut v| {
            let mut s = b"PLT1".to_vec();
            s.append(&mut v);
            s
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn mutated_streams_never_panic_overread_or_overspend(stream in mutated()) {
        let (demux, mailbox) = fresh();
        read_link(&demux, &mailbox, &stream);
    }
}
