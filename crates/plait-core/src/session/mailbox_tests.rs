//! Unit tests of the mailbox: matching, stashing, ordering, failure and keeping.

use super::*;
use crate::net::peer::Resume;
use crate::session::landing::Keep;
use crossbeam_channel::Receiver;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Weak;

/// A receive into `dst` and the channel its completion arrives on.
fn posted(dst: &mut [u8], call: CallId, op_id: u64) -> (Posted, Receiver<Event>) {
    let (tx, rx) = crossbeam_channel::unbounded();
    let p = Posted {
        landing: Landing::Copy { dst: dst.as_mut_ptr(), keep: None },
        len: dst.len(),
        wire: Wire::Native,
        expect: Expect { call, count: dst.len() as u64, nbytes: dst.len() as u64, what: "test op".into() },
        op_id,
        token: 0,
        events: tx,
        reported: false,
    };
    (p, rx)
}

fn u8_call() -> CallId {
    CallId { dtype: DType::U8 as u8, ..Default::default() }
}

fn data_call(seq: u64) -> CallId {
    CallId { coll: 1, dtype: DType::U8 as u8, seq, sched_id: 7, ..Default::default() }
}

fn p2p(tag: u64, ordinal: u32, payload: &[u8]) -> FrameHeader {
    FrameHeader::p2p(tag, ordinal, DType::U8 as u8, payload.len() as u64, payload.len() as u64)
}

/// Delivers a frame as a reader with no lane to hold back would (over the budget: refused).
fn deliver(m: &Mailbox, peer: usize, h: &FrameHeader, payload: &[u8]) -> io::Result<()> {
    m.deliver(peer, h, &mut &payload[..], None).map(|d| assert_eq!(d, Delivery::Taken))
}

fn ok_from(rx: &Receiver<Event>) -> usize {
    let ev = rx.try_recv().expect("the receive completed");
    ev.result.expect("the receive succeeded");
    ev.source
}

#[test]
fn a_frame_for_a_posted_receive_lands_in_place() {
    let m = Mailbox::new();
    let mut dst = [0u8; 4];
    let (p, rx) = posted(&mut dst, data_call(3), 1);
    m.post((2, FrameKind::Data as u8, 3, 0, 0, 0), p);
    assert!(rx.try_recv().is_err(), "nothing arrived yet");
    deliver(&m, 2, &FrameHeader::data(&data_call(3), 0, 0, 0, 4, 4), b"abcd").unwrap();
    assert_eq!(ok_from(&rx), 2);
    assert_eq!(&dst, b"abcd");
}

#[test]
fn an_early_frame_is_stashed_and_lands_when_its_receive_is_posted() {
    let m = Mailbox::new();
    deliver(&m, 1, &FrameHeader::data(&data_call(5), 2, 1, 0, 3, 3), b"xyz").unwrap();
    let mut dst = [0u8; 3];
    let (p, rx) = posted(&mut dst, data_call(5), 1);
    m.post((1, FrameKind::Data as u8, 5, 2, 1, 0), p);
    assert_eq!(ok_from(&rx), 1);
    assert_eq!(&dst, b"xyz");
}

/// A receive posted after its message arrived completes as of the arrival (what a train's
/// timing reads), not as of the post.
#[test]
fn an_early_frame_reports_when_it_arrived() {
    let m = Mailbox::new();
    deliver(&m, 1, &p2p(4, 0, b"abc"), b"abc").unwrap();
    let arrived = std::time::Instant::now();
    std::thread::sleep(std::time::Duration::from_millis(30));
    let mut dst = [0u8; 3];
    let (p, rx) = posted(&mut dst, u8_call(), 1);
    let posted_at = std::time::Instant::now();
    m.post_p2p(Some(1), 4, p);
    let ev = rx.try_recv().expect("completed at once");
    assert!(ev.at <= arrived && posted_at.duration_since(ev.at) >= std::time::Duration::from_millis(30));
}

#[test]
fn messages_with_one_tag_match_receives_in_the_order_they_were_sent() {
    let m = Mailbox::new();
    // The second message overtakes the first (another lane), before any receive is posted.
    deliver(&m, 1, &p2p(9, 1, b"two"), b"two").unwrap();
    let (mut a, mut b) = ([0u8; 3], [0u8; 3]);
    let (pa, ra) = posted(&mut a, u8_call(), 1);
    let (pb, rb) = posted(&mut b, u8_call(), 2);
    m.post_p2p(Some(1), 9, pa);
    m.post_p2p(Some(1), 9, pb);
    assert_eq!(ok_from(&rb), 1, "the second receive takes the second message at once");
    assert!(ra.try_recv().is_err(), "the first receive waits for the first message");
    deliver(&m, 1, &p2p(9, 0, b"one"), b"one").unwrap();
    ok_from(&ra);
    assert_eq!((&a, &b), (b"one", b"two"));
}

#[test]
fn any_source_receives_take_messages_oldest_receive_first_in_each_senders_order() {
    let m = Mailbox::new();
    let (mut a, mut b, mut c) = ([0u8; 1], [0u8; 1], [0u8; 1]);
    let (pa, ra) = posted(&mut a, u8_call(), 1);
    let (pb, rb) = posted(&mut b, u8_call(), 2);
    let (pc, rc) = posted(&mut c, u8_call(), 3);
    m.post_p2p(None, 4, pa);
    m.post_p2p(None, 4, pb);
    m.post_p2p(None, 4, pc);
    // Rank 2's second message overtakes its first: it must wait for it, not jump the queue.
    deliver(&m, 2, &p2p(4, 1, b"B"), b"B").unwrap();
    assert!(ra.try_recv().is_err());
    deliver(&m, 3, &p2p(4, 0, b"C"), b"C").unwrap();
    assert_eq!(ok_from(&ra), 3);
    deliver(&m, 2, &p2p(4, 0, b"A"), b"A").unwrap();
    assert_eq!((ok_from(&rb), ok_from(&rc)), (2, 2));
    assert_eq!((a[0], b[0], c[0]), (b'C', b'A', b'B'));
}

#[test]
fn a_stashed_message_serves_a_later_any_source_receive() {
    let m = Mailbox::new();
    deliver(&m, 1, &p2p(6, 0, b"Q"), b"Q").unwrap();
    let mut a = [0u8; 1];
    let (pa, ra) = posted(&mut a, u8_call(), 1);
    m.post_p2p(None, 6, pa);
    assert_eq!(ok_from(&ra), 1);
    assert_eq!(a[0], b'Q');
}

#[test]
fn a_frame_that_disagrees_fails_its_receive_and_leaves_the_stream_in_step() {
    let m = Mailbox::new();
    let mut dst = [7u8; 4];
    let (p, rx) = posted(&mut dst, data_call(3), 1);
    m.post((1, FrameKind::Data as u8, 3, 0, 0, 0), p);
    let other = CallId { sched_id: 8, ..data_call(3) };
    let mut stream: &[u8] = b"abcdNEXT";
    m.deliver(1, &FrameHeader::data(&other, 0, 0, 0, 4, 4), &mut (&mut stream).take(4), None).unwrap();
    assert_eq!(stream, b"NEXT", "exactly the payload was consumed");
    let err = rx.try_recv().unwrap().result.unwrap_err();
    assert!(matches!(err, PlaitError::Mismatch { peer: 1, .. }), "{err}");
    assert_eq!(dst, [7; 4], "nothing landed");
}

#[test]
fn cancel_withdraws_only_that_operations_receives() {
    let m = Mailbox::new();
    let (mut a, mut b) = ([0u8; 1], [0u8; 1]);
    let (pa, ra) = posted(&mut a, data_call(1), 10);
    let (pb, rb) = posted(&mut b, u8_call(), 11);
    m.post((1, FrameKind::Data as u8, 1, 0, 0, 0), pa);
    m.post_p2p(None, 2, pb);
    assert_eq!(m.cancel(10), 1);
    assert!(ra.try_recv().is_err(), "a cancelled receive reports nothing");
    deliver(&m, 1, &p2p(2, 0, b"z"), b"z").unwrap();
    assert_eq!(ok_from(&rb), 1);
}

#[test]
fn fail_completes_every_receive_with_the_error_and_refuses_new_ones() {
    let m = Mailbox::new();
    let (mut a, mut b) = ([0u8; 1], [0u8; 1]);
    let (pa, ra) = posted(&mut a, data_call(1), 1);
    m.post((1, FrameKind::Data as u8, 1, 0, 0, 0), pa);
    m.fail(&PlaitError::Broken("gone".into()));
    assert!(matches!(ra.try_recv().unwrap().result, Err(PlaitError::Broken(_))));
    let (pb, rb) = posted(&mut b, u8_call(), 2);
    m.post_p2p(Some(1), 0, pb);
    assert!(matches!(rb.try_recv().unwrap().result, Err(PlaitError::Broken(_))));
}

#[test]
fn a_peer_that_closed_still_serves_what_it_sent_before() {
    let m = Mailbox::new();
    deliver(&m, 1, &p2p(3, 0, b"k"), b"k").unwrap();
    let closed = PlaitError::Peer { op: String::new(), peer: 1, addr: String::new(), what: "closed".into(), waited: Default::default() };
    m.peer_closed(1, &closed);
    let (mut a, mut b) = ([0u8; 1], [0u8; 1]);
    let (pa, ra) = posted(&mut a, u8_call(), 1);
    let (pb, rb) = posted(&mut b, u8_call(), 2);
    m.post_p2p(Some(1), 3, pa);
    m.post_p2p(Some(1), 3, pb);
    ok_from(&ra);
    assert!(matches!(rb.try_recv().unwrap().result, Err(PlaitError::Peer { peer: 1, .. })));
}

#[test]
fn frames_of_a_finished_operation_are_named_as_disagreement() {
    let m = Mailbox::new();
    // A frame nobody asked for, then the operation finishes: that frame is the evidence.
    deliver(&m, 2, &FrameHeader::data(&data_call(1), 0, 0, 5, 1, 1), b"s").unwrap();
    let (peer, h) = m.finish(1).expect("the stray frame is reported");
    assert_eq!((peer, h.seq, h.ordinal), (2, 1, 5));
    let late = deliver(&m, 2, &FrameHeader::data(&data_call(1), 0, 0, 6, 1, 1), b"t").unwrap_err();
    assert_eq!(late.kind(), io::ErrorKind::InvalidData);
    assert!(m.finish(2).is_none());
}

#[test]
fn a_receive_keeps_what_it_overwrites_so_a_failure_can_restore_it() {
    let m = Mailbox::new();
    let mut dst = *b"old!";
    let mut copy = [0u8; 4];
    // SAFETY: both buffers outlive the keep, which this test uses only on this thread.
    let keep = Arc::new(unsafe { Keep::new(dst.as_mut_ptr(), copy.as_mut_ptr(), 4) });
    let (tx, rx) = crossbeam_channel::unbounded();
    let p = Posted {
        landing: Landing::Copy { dst: dst.as_mut_ptr(), keep: Some(keep.clone()) },
        len: 4,
        wire: Wire::Native,
        expect: Expect { call: data_call(1), count: 4, nbytes: 4, what: "test op".into() },
        op_id: 1,
        token: 0,
        events: tx,
        reported: false,
    };
    m.post((1, FrameKind::Data as u8, 1, 0, 0, 0), p);
    deliver(&m, 1, &FrameHeader::data(&data_call(1), 0, 0, 0, 4, 4), b"new!").unwrap();
    ok_from(&rx);
    assert_eq!(&dst, b"new!");
    keep.restore();
    assert_eq!(&dst, b"old!");
}

fn refused_from(rx: &Receiver<Event>) -> String {
    let ev = rx.try_recv().expect("the receive completed");
    match ev.result {
        Err(e @ PlaitError::Refused { .. }) => e.to_string(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_refusal_fails_the_receives_of_that_call_posted_before_and_after_it() {
    let m = Mailbox::new();
    let (mut a, mut b, mut c) = ([0u8; 2], [0u8; 2], [0u8; 2]);
    let (pa, ra) = posted(&mut a, data_call(4), 1);
    let (pc, rc) = posted(&mut c, data_call(5), 2);
    m.post((1, FrameKind::Data as u8, 4, 0, 0, 0), pa);
    m.post((1, FrameKind::Data as u8, 5, 0, 0, 0), pc);
    m.refused_by(2, 4, "bad counts".into());
    assert!(refused_from(&ra).contains("rank 2 refused this call: bad counts"));
    let (pb, rb) = posted(&mut b, data_call(4), 1);
    m.post((1, FrameKind::Data as u8, 4, 1, 0, 0), pb);
    assert!(refused_from(&rb).contains("bad counts"), "a receive of the refused call posted later fails too");
    assert!(rc.try_recv().is_err(), "the next call is not touched");
    assert_eq!(a, [0, 0]);
}

#[test]
fn frames_of_a_refused_call_still_on_their_way_are_dropped_quietly() {
    let m = Mailbox::new();
    // One peer went ahead with call 6 before hearing that another refused it.
    deliver(&m, 1, &FrameHeader::data(&data_call(6), 0, 0, 0, 2, 2), b"ab").unwrap();
    m.refused_by(2, 6, "no".into());
    m.finish_refused(6);
    deliver(&m, 1, &FrameHeader::data(&data_call(6), 1, 0, 0, 2, 2), b"cd").expect("dropped, not a disagreement");
    // A frame of a call this rank finished normally is still a disagreement.
    m.finish(7);
    assert!(deliver(&m, 1, &FrameHeader::data(&data_call(7), 0, 0, 0, 2, 2), b"ef").is_err());
    // The stash kept nothing of call 6: the receive of the next call is not served by it.
    let mut x = [0u8; 2];
    let (p, rx) = posted(&mut x, data_call(8), 1);
    m.post((1, FrameKind::Data as u8, 8, 0, 0, 0), p);
    assert!(rx.try_recv().is_err());
}

#[test]
fn a_refusal_of_a_call_this_rank_finished_changes_nothing() {
    let m = Mailbox::new();
    m.finish(3);
    m.refused_by(1, 3, "late".into());
    let mut x = [0u8; 2];
    let (p, rx) = posted(&mut x, data_call(4), 1);
    m.post((1, FrameKind::Data as u8, 4, 0, 0, 0), p);
    deliver(&m, 1, &FrameHeader::data(&data_call(4), 0, 0, 0, 2, 2), b"gh").unwrap();
    ok_from(&rx);
}

// -- bounds on what a peer can make this rank hold (issue 14: size fields, unbounded buffering)

/// An endless stream behind a header: a check that reads before refusing would never return.
fn endless() -> io::Repeat {
    io::repeat(b'z')
}

#[test]
fn a_frame_claiming_a_huge_size_for_no_posted_receive_is_refused_before_anything_is_read() {
    let m = Mailbox::new();
    for nbytes in [1u64 << 40, 1u64 << 63, u64::MAX] {
        for h in [
            FrameHeader { nbytes, count: nbytes, ..FrameHeader::data(&data_call(4), 0, 0, 0, 1, 1) },
            FrameHeader { nbytes, count: nbytes, ..p2p(3, 0, b"x") },
        ] {
            let err = m.deliver(1, &h, &mut endless(), None).expect_err("refused");
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
            let text = err.to_string();
            let why = if nbytes > isize::MAX as u64 { "more than any buffer holds" } else { "PLAIT_UNEXPECTED_BYTES" };
            assert!(text.contains(&nbytes.to_string()) && text.contains(why), "{text}");
        }
    }
    assert_eq!(m.stashed_len(), 0);
    // The refusals left no claim behind: a normal early frame is still held.
    deliver(&m, 1, &p2p(3, 0, b"ok"), b"ok").unwrap();
    assert_eq!(m.stashed_len(), 1);
}

#[test]
fn early_frames_are_held_up_to_the_budget_per_peer_and_room_comes_back_when_they_are_received() {
    let budget = MIN_UNEXPECTED_BYTES;
    let m = Mailbox::with_limits(budget, Duration::from_secs(60));
    let big = vec![7u8; (budget / 2) as usize + 1];
    deliver(&m, 1, &p2p(5, 0, &big), &big).unwrap();
    // Another peer has a budget of its own.
    deliver(&m, 2, &p2p(5, 0, &big), &big).unwrap();
    let err = deliver(&m, 1, &p2p(5, 1, &big), &big).expect_err("over the budget of peer 1");
    assert!(err.to_string().contains(&format!("{} bytes of its early messages already held", big.len())), "{err}");
    // Receiving the held message gives its room back.
    let mut dst = vec![0u8; big.len()];
    let (p, rx) = posted(&mut dst, u8_call(), 1);
    m.post_p2p(Some(1), 5, p);
    assert_eq!(ok_from(&rx), 1);
    deliver(&m, 1, &p2p(5, 1, &big), &big).unwrap();
}

#[test]
fn a_frame_whose_receive_is_posted_is_not_limited_by_the_budget() {
    let budget = MIN_UNEXPECTED_BYTES;
    let m = Mailbox::with_limits(budget, Duration::from_secs(60));
    let big = vec![3u8; budget as usize * 2];
    let mut dst = vec![0u8; big.len()];
    let (p, rx) = posted(&mut dst, u8_call(), 1);
    m.post_p2p(Some(1), 5, p);
    deliver(&m, 1, &p2p(5, 0, &big), &big).unwrap();
    assert_eq!(ok_from(&rx), 1);
    assert_eq!(dst, big);
}

#[test]
fn a_message_with_a_reserved_tag_that_nothing_receives_is_refused() {
    let m = Mailbox::new();
    for tag in [RESERVED_TAGS, RESERVED_TAGS + 17, PROBE_GO_TAG - 2] {
        let err = deliver(&m, 1, &p2p(tag, 0, b"abcd"), b"abcd").expect_err("refused");
        assert!(err.to_string().contains("reserved tag"), "{err}");
    }
    // The start-up probes' answers and bandwidth trains are still accepted, up to their sizes.
    deliver(&m, 1, &p2p(PONG_TAG, 0, &[0u8; 8]), &[0u8; 8]).unwrap();
    deliver(&m, 1, &p2p(PROBE_GO_TAG, 0, &[0u8; 8]), &[0u8; 8]).unwrap();
    deliver(&m, 1, &p2p(PROBE_TAG, 0, b"abcd"), b"abcd").unwrap();
    deliver(&m, 1, &p2p(crate::net::frame::PROBE_AGAIN_TAG, 0, b"abcd"), b"abcd").unwrap();
    let big = vec![0u8; PROBE_FRAME_BYTES as usize + 1];
    assert!(deliver(&m, 1, &p2p(PROBE_TAG, 1, &big), &big).is_err(), "a probe frame over its size is refused");
}

#[test]
fn finishing_a_call_drops_only_its_strays_among_many_held_frames() {
    let m = Mailbox::new();
    for tag in 0..2000u64 {
        deliver(&m, 1, &p2p(tag, 0, b"m"), b"m").unwrap();
    }
    deliver(&m, 2, &FrameHeader::data(&data_call(9), 0, 0, 0, 1, 1), b"s").unwrap();
    let stray = m.finish(9).expect("the stray frame of call 9 is reported");
    assert_eq!(stray.0, 2);
    assert_eq!(m.stashed_len(), 2000, "the unreceived messages of other tags are kept");
    assert!(m.finish(10).is_none());
}

#[test]
fn an_any_source_receive_takes_the_lowest_sender_whose_next_message_is_held() {
    let m = Mailbox::new();
    // Peer 1's first message (ordinal 0) has not arrived, its second has: not next in line.
    deliver(&m, 1, &p2p(4, 1, b"b"), b"b").unwrap();
    deliver(&m, 3, &p2p(4, 0, b"c"), b"c").unwrap();
    deliver(&m, 2, &p2p(4, 0, b"d"), b"d").unwrap();
    let mut got = Vec::new();
    for _ in 0..2 {
        let mut dst = [0u8; 1];
        let (p, rx) = posted(&mut dst, u8_call(), 1);
        m.post_p2p(None, 4, p);
        got.push((ok_from(&rx), dst[0]));
    }
    assert_eq!(got, vec![(2, b'd'), (3, b'c')]);
    // Once peer 1's first message arrives, both of its messages are next in line in turn.
    let mut dst = [0u8; 1];
    let (p, rx) = posted(&mut dst, u8_call(), 1);
    m.post_p2p(None, 4, p);
    assert!(rx.try_recv().is_err(), "peer 1's second message must wait for its first");
    deliver(&m, 1, &p2p(4, 0, b"a"), b"a").unwrap();
    assert_eq!((ok_from(&rx), dst[0]), (1, b'a'));
    let (p, rx) = posted(&mut dst, u8_call(), 1);
    m.post_p2p(None, 4, p);
    assert_eq!((ok_from(&rx), dst[0]), (1, b'b'));
}

// -- flow control: frames over the budget wait unread on their lane (parked) until they can go on

/// A lane as the mailbox sees it: counts the times it is woken.
struct FakeLane(AtomicUsize);

impl Resume for FakeLane {
    fn resume(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn lane() -> (Arc<FakeLane>, LaneWaker) {
    let l = Arc::new(FakeLane(AtomicUsize::new(0)));
    let weak: Weak<dyn Resume> = Arc::downgrade(&l) as Weak<FakeLane>;
    (l, LaneWaker::new(weak))
}

fn woken(l: &FakeLane) -> usize {
    l.0.load(Ordering::SeqCst)
}

/// A payload that must not be touched: parking reads nothing.
struct Untouched;

impl Read for Untouched {
    fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
        panic!("a parked frame's payload was read");
    }
}

fn offer(m: &Mailbox, peer: usize, h: &FrameHeader, payload: &[u8], lane: &LaneWaker) -> Delivery {
    let mut rest = payload;
    let d = m.deliver(peer, h, &mut rest, Some(lane)).expect("taken or parked");
    match d {
        Delivery::Taken => assert!(rest.is_empty(), "a taken frame is read whole"),
        Delivery::Parked { .. } => assert_eq!(rest.len(), payload.len(), "a parked frame is not read"),
    }
    d
}

fn parked(d: Delivery) -> bool {
    matches!(d, Delivery::Parked { .. })
}

#[test]
fn a_frame_over_the_budget_is_parked_unread_and_lands_in_place_once_its_receive_is_posted() {
    let budget = MIN_UNEXPECTED_BYTES;
    let m = Mailbox::with_limits(budget, Duration::from_secs(60));
    let big: Vec<u8> = (0..3 * budget as usize).map(|i| (i % 251) as u8).collect();
    let h = p2p(5, 0, &big);
    let (l, waker) = lane();
    assert!(parked(m.deliver(1, &h, &mut Untouched, Some(&waker)).unwrap()));
    assert_eq!((m.stashed_len(), m.held_total(), woken(&l)), (0, 0, 0));
    // Another tag's receive does not concern it.
    let mut other = [0u8; 1];
    let (p, _rx) = posted(&mut other, u8_call(), 9);
    m.post_p2p(Some(1), 6, p);
    assert_eq!(woken(&l), 0);
    let mut dst = vec![0u8; big.len()];
    let (p, rx) = posted(&mut dst, u8_call(), 1);
    m.post_p2p(Some(1), 5, p);
    assert_eq!(woken(&l), 1, "posting its receive wakes the lane");
    assert!(rx.try_recv().is_err());
    assert_eq!(offer(&m, 1, &h, &big, &waker), Delivery::Taken);
    assert_eq!(ok_from(&rx), 1);
    assert!(dst == big);
    assert_eq!(m.held_total(), 0, "landed in place, never held");
}

#[test]
fn a_parked_frame_goes_on_once_its_peers_held_frames_are_received() {
    let budget = MIN_UNEXPECTED_BYTES;
    let m = Mailbox::with_limits(budget, Duration::from_secs(60));
    let part = vec![4u8; (budget / 2 + 1) as usize];
    let (l, waker) = lane();
    assert_eq!(offer(&m, 1, &p2p(5, 0, &part), &part, &waker), Delivery::Taken);
    // The second does not fit beside the first: parked, for this peer only.
    assert!(parked(offer(&m, 1, &p2p(5, 1, &part), &part, &waker)));
    assert_eq!(offer(&m, 2, &p2p(5, 0, &part), &part, &waker), Delivery::Taken);
    let mut dst = vec![0u8; part.len()];
    let (p, rx) = posted(&mut dst, u8_call(), 1);
    m.post_p2p(Some(2), 5, p);
    assert_eq!((ok_from(&rx), woken(&l)), (2, 0), "room freed for another peer wakes nothing");
    let (p, rx) = posted(&mut dst, u8_call(), 1);
    m.post_p2p(Some(1), 5, p);
    assert_eq!(ok_from(&rx), 1);
    assert!(woken(&l) >= 1, "room freed for its peer wakes the lane");
    assert_eq!(offer(&m, 1, &p2p(5, 1, &part), &part, &waker), Delivery::Taken, "held now");
    assert_eq!(m.stashed_len(), 1);
}

#[test]
fn a_parked_message_is_taken_by_an_any_source_receive_once_it_is_next_in_line() {
    let m = Mailbox::with_limits(MIN_UNEXPECTED_BYTES, Duration::from_secs(60));
    let big = vec![8u8; 2 * MIN_UNEXPECTED_BYTES as usize];
    let (l, waker) = lane();
    // Its sender's first message with this tag (on another lane) has not arrived yet.
    assert!(parked(offer(&m, 3, &p2p(4, 1, &big), &big, &waker)));
    let (mut a, mut b) = ([0u8; 1], vec![0u8; big.len()]);
    let (pa, ra) = posted(&mut a, u8_call(), 1);
    let (pb, rb) = posted(&mut b, u8_call(), 2);
    m.post_p2p(None, 4, pa);
    m.post_p2p(None, 4, pb);
    assert!(woken(&l) >= 1);
    assert!(parked(offer(&m, 3, &p2p(4, 1, &big), &big, &waker)), "not next in line: still parked");
    let before = woken(&l);
    deliver(&m, 3, &p2p(4, 0, b"x"), b"x").unwrap();
    assert_eq!(ok_from(&ra), 3);
    assert!(woken(&l) > before, "its turn came: woken");
    assert_eq!(offer(&m, 3, &p2p(4, 1, &big), &big, &waker), Delivery::Taken);
    assert_eq!(ok_from(&rb), 3);
    assert!(b == big);
}

#[test]
fn a_frame_parked_for_the_timeout_fails_naming_the_frame_and_both_settings() {
    let m = Mailbox::with_limits(MIN_UNEXPECTED_BYTES, Duration::from_millis(50));
    let (_l, waker) = lane();
    let h = FrameHeader { nbytes: 5 << 20, count: 5 << 20, ..p2p(3, 0, b"") };
    let Delivery::Parked { until } = m.deliver(2, &h, &mut Untouched, Some(&waker)).unwrap() else { panic!("parked") };
    // Offered again before its time: still parked, and its deadline does not move.
    assert_eq!(m.deliver(2, &h, &mut Untouched, Some(&waker)).unwrap(), Delivery::Parked { until });
    std::thread::sleep(until.saturating_duration_since(Instant::now()));
    let err = m.deliver(2, &h, &mut Untouched, Some(&waker)).expect_err("waited too long");
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    let text = err.to_string();
    for part in ["tag 3", "5242880 bytes", "PLAIT_TIMEOUT", "PLAIT_UNEXPECTED_BYTES", "no receive"] {
        assert!(text.contains(part), "{part:?} not in: {text}");
    }
}

#[test]
fn a_parked_frame_of_a_call_that_ended_is_named_as_a_stray_or_dropped_after_a_refusal() {
    let m = Mailbox::with_limits(MIN_UNEXPECTED_BYTES, Duration::from_secs(60));
    let n = 2 * MIN_UNEXPECTED_BYTES;
    let big = vec![1u8; n as usize];
    let (l, waker) = lane();
    // Call 6 finishes without asking for the frame: the ranks disagree, and it is the evidence.
    let h6 = FrameHeader::data(&data_call(6), 1, 0, 0, n, n);
    assert!(parked(offer(&m, 2, &h6, &big, &waker)));
    let (peer, h) = m.finish(6).expect("the parked frame is a stray");
    assert_eq!((peer, h.seq, h.step), (2, 6, 1));
    assert_eq!(woken(&l), 1);
    assert!(m.deliver(2, &h6, &mut &big[..], Some(&waker)).is_err(), "offered again: late");
    // Call 7 was refused: its parked frame is read and dropped quietly.
    let h7 = FrameHeader::data(&data_call(7), 0, 0, 0, n, n);
    assert!(parked(offer(&m, 2, &h7, &big, &waker)));
    m.refused_by(1, 7, "no".into());
    m.finish_refused(7);
    assert_eq!(woken(&l), 2);
    assert_eq!(offer(&m, 2, &h7, &big, &waker), Delivery::Taken);
    assert_eq!((m.stashed_len(), m.held_total()), (0, 0));
}

#[test]
fn a_failure_wakes_every_parked_lane_and_their_frames_are_dropped() {
    let m = Mailbox::with_limits(MIN_UNEXPECTED_BYTES, Duration::from_secs(60));
    let big = vec![1u8; 2 * MIN_UNEXPECTED_BYTES as usize];
    let (l1, w1) = lane();
    let (l2, w2) = lane();
    assert!(parked(offer(&m, 1, &p2p(1, 0, &big), &big, &w1)));
    assert!(parked(offer(&m, 2, &FrameHeader::data(&data_call(3), 0, 0, 0, big.len() as u64, big.len() as u64), &big, &w2)));
    m.fail(&PlaitError::Broken("gone".into()));
    assert_eq!((woken(&l1), woken(&l2)), (1, 1));
    assert_eq!(offer(&m, 1, &p2p(1, 0, &big), &big, &w1), Delivery::Taken);
}

#[test]
fn frames_no_buffer_could_hold_are_refused_at_once_even_where_frames_may_park() {
    let m = Mailbox::new();
    let (_l, waker) = lane();
    for nbytes in [1u64 << 63, u64::MAX] {
        let h = FrameHeader { nbytes, count: nbytes, ..p2p(3, 0, b"x") };
        let err = m.deliver(1, &h, &mut Untouched, Some(&waker)).expect_err("refused");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
    // A large but possible size waits for its receive, unread.
    let h = FrameHeader { nbytes: 1 << 40, count: 1 << 40, ..p2p(3, 0, b"x") };
    assert!(parked(m.deliver(1, &h, &mut Untouched, Some(&waker)).unwrap()));
    assert!(m.deliver(1, &p2p(RESERVED_TAGS + 1, 0, b"abcd"), &mut &b"abcd"[..], Some(&waker)).is_err(), "reserved tags are still refused");
}

// -- random interleavings (issue 14: the mailbox's invariants hold whatever order frames come in)

mod interleavings {
    use super::*;
    use proptest::prelude::*;

    const TAGS: u64 = 3;

    /// 8 bytes that say who sent the message: (peer, tag, ordinal).
    fn stamp(peer: usize, tag: u64, ordinal: u32) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[..2].copy_from_slice(&(peer as u16).to_le_bytes());
        b[2..4].copy_from_slice(&(tag as u16).to_le_bytes());
        b[4..].copy_from_slice(&ordinal.to_le_bytes());
        b
    }

    fn unstamp(b: &[u8; 8]) -> (usize, u64, u32) {
        (u16::from_le_bytes([b[0], b[1]]) as usize, u16::from_le_bytes([b[2], b[3]]) as u64, u32::from_le_bytes([b[4], b[5], b[6], b[7]]))
    }

    /// What each peer sends ((tag, lane), in order: with several lanes a later message can
    /// overtake an earlier one), which tags are received from any source, and the order in
    /// which frames arrive and receives are posted (each choice picks a queue).
    fn world() -> impl Strategy<Value = (Vec<Vec<(u64, usize)>>, Vec<bool>, Vec<u8>)> {
        (
            prop::collection::vec(prop::collection::vec((0..TAGS, 0..2usize), 0..12), 1..5),
            prop::collection::vec(any::<bool>(), TAGS as usize),
            prop::collection::vec(any::<u8>(), 0..200),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn every_receive_completes_once_in_order_and_nothing_is_left_held((sends, any_source, order) in world()) {
            let m = Mailbox::new();
            let peers = sends.len();
            // Frames each (peer, lane) will deliver, in send order.
            let mut frames: Vec<std::collections::VecDeque<(u64, u32)>> = vec![Default::default(); peers * 2];
            for (p, msgs) in sends.iter().enumerate() {
                let mut next = [0u32; TAGS as usize];
                for &(t, lane) in msgs {
                    frames[p * 2 + lane].push_back((t, next[t as usize]));
                    next[t as usize] += 1;
                }
            }
            // Receives to post: (source or None, tag), one per message.
            let mut recvs: std::collections::VecDeque<(Option<usize>, u64)> = Default::default();
            for (p, msgs) in sends.iter().enumerate() {
                for &(t, _) in msgs {
                    recvs.push_back((if any_source[t as usize] { None } else { Some(p) }, t));
                }
            }
            let mut bufs: Vec<Box<[u8; 8]>> = Vec::new();
            let mut waiting: Vec<(Option<usize>, u64, Receiver<Event>)> = Vec::new();
            let mut choices = order.into_iter();
            loop {
                let live: Vec<usize> = (0..peers * 2).filter(|&q| !frames[q].is_empty()).collect();
                let can_post = !recvs.is_empty();
                if live.is_empty() && !can_post {
                    break;
                }
                let c = choices.next().unwrap_or(0) as usize;
                if can_post && (live.is_empty() || c % (live.len() + 1) == live.len()) {
                    let (src, tag) = recvs.pop_front().unwrap();
                    let mut b = Box::new([0xFFu8; 8]);
                    let (p, rx) = posted(&mut b[..], u8_call(), waiting.len() as u64);
                    bufs.push(b);
                    m.post_p2p(src, tag, p);
                    waiting.push((src, tag, rx));
                } else {
                    let q = live[c % live.len()];
                    let p = q / 2;
                    let (tag, ordinal) = frames[q].pop_front().unwrap();
                    deliver(&m, p, &p2p(tag, ordinal, &stamp(p, tag, ordinal)), &stamp(p, tag, ordinal)).unwrap();
                }
            }
            // Every receive completed exactly once, with a message of its tag from its source.
            let mut seen = std::collections::HashSet::new();
            let mut last: std::collections::HashMap<(usize, u64), u32> = Default::default();
            for (i, (src, tag, rx)) in waiting.iter().enumerate() {
                let ev = rx.try_recv().expect("every receive completes");
                prop_assert!(rx.try_recv().is_err(), "a receive completed twice");
                prop_assert!(ev.result.is_ok());
                let (from, t, ordinal) = unstamp(&bufs[i]);
                prop_assert_eq!(from, ev.source);
                prop_assert_eq!(t, *tag);
                if let Some(s) = src { prop_assert_eq!(from, *s); }
                prop_assert!(seen.insert((from, t, ordinal)), "a message was received twice");
                // Messages from one sender with one tag are received in the order sent, whatever
                // order their frames arrived in.
                if let Some(prev) = last.insert((from, t), ordinal) { prop_assert!(ordinal > prev); }
            }
            prop_assert_eq!(m.stashed_len(), 0);
            prop_assert_eq!(m.held_total(), 0, "bytes still counted against a peer's budget");
            prop_assert_eq!(m.posted_len(), 0);
        }
    }
}

#[test]
fn pieces_of_a_message_land_at_their_own_ordinals_and_any_source_reports_the_ordinal_it_took() {
    use crate::net::frame::PIECE_TAGS;
    let m = Mailbox::new();
    // An any-source receive takes rank 3's message 0 and says which ordinal it was.
    let mut first = [0u8; 2];
    let (p, rx) = posted(&mut first, u8_call(), 1);
    assert_eq!(m.post_p2p(None, 6, p), None);
    deliver(&m, 3, &p2p(6, 0, b"ab"), b"ab").unwrap();
    let ev = rx.try_recv().unwrap();
    assert_eq!((ev.source, ev.token), (3, 0));
    // A receive from a given rank is told its ordinal at once.
    let mut second = [0u8; 2];
    let (p, rx2) = posted(&mut second, u8_call(), 2);
    assert_eq!(m.post_p2p(Some(3), 6, p), Some(1));
    deliver(&m, 3, &p2p(6, 1, b"cd"), b"cd").unwrap();
    ok_from(&rx2);
    // A piece under the piece tag: admitted (not a hostile reserved tag), stashed when early,
    // and taken by the receive posted for exactly its ordinal.
    let tag = PIECE_TAGS | 6;
    deliver(&m, 3, &p2p(tag, 17, b"zz"), b"zz").unwrap();
    let mut piece = [0u8; 2];
    let (p, rx3) = posted(&mut piece, u8_call(), 3);
    m.post_p2p_at(3, tag, 16, p);
    assert!(rx3.try_recv().is_err(), "ordinal 17 is not 16");
    deliver(&m, 3, &p2p(tag, 16, b"yy"), b"yy").unwrap();
    ok_from(&rx3);
    assert_eq!(&piece, b"yy");
    let mut other = [0u8; 2];
    let (p, rx4) = posted(&mut other, u8_call(), 4);
    m.post_p2p_at(3, tag, 17, p);
    ok_from(&rx4);
    assert_eq!((&first, &second, &other), (b"ab", b"cd", b"zz"));
}
