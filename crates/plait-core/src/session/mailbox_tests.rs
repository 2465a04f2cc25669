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
