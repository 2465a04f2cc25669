//! Unit tests of the mailbox: matching, stashing, ordering, failure and keeping.

use super::*;
use crate::session::landing::Keep;
use crossbeam_channel::Receiver;

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

fn deliver(m: &Mailbox, peer: usize, h: &FrameHeader, payload: &[u8]) -> io::Result<()> {
    m.deliver(peer, h, &mut &payload[..])
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
    m.deliver(1, &FrameHeader::data(&other, 0, 0, 0, 4, 4), &mut (&mut stream).take(4)).unwrap();
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
            let err = m.deliver(1, &h, &mut endless()).expect_err("refused");
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
            let text = err.to_string();
            assert!(text.contains(&nbytes.to_string()) && text.contains("PLAIT_UNEXPECTED_BYTES"), "{text}");
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
    let m = Mailbox::with_budget(budget);
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
    let m = Mailbox::with_budget(budget);
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
    for tag in [RESERVED_TAGS, RESERVED_TAGS + 17, PONG_TAG - 1] {
        let err = deliver(&m, 1, &p2p(tag, 0, b"abcd"), b"abcd").expect_err("refused");
        assert!(err.to_string().contains("reserved tag"), "{err}");
    }
    // The start-up probe's answer is still accepted.
    deliver(&m, 1, &p2p(PONG_TAG, 0, &[0u8; 8]), &[0u8; 8]).unwrap();
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
