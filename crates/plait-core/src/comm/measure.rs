//! Each directed link's bandwidth, measured at start-up (`PLAIT_MEASURE`) so that the cost model
//! and the ring order can follow the links as they are: a slow cable, a WAN hop, an asymmetric
//! line.
//!
//! n - 1 rounds; in round k rank r sends a train to r + k and receives one from r - k, so every
//! rank sends one train and receives one at a time and all n directed links of a round run at
//! once: `(n - 1)` rounds instead of `n (n - 1)` probes one after another. A train lasts
//! [`train_time`] (enough round trips for TCP's slow start to reach the link's rate on most
//! links, at most [`MAX_TRAIN`]) and at least [`MIN_FRAMES`] frames. The receiver says when its
//! receives are posted (`PROBE_GO_TAG`), so frames land as they arrive and their arrival times
//! are the link's; the rate is taken over the second half of the train's frames, after slow start.

use super::config::{Measure, MAX_STREAMS};
use super::topology::LinkRecord;
use crate::dtype::DType;
use crate::error::Result;
use crate::platform::host::same_host;
use crate::exec::p2p;
use crate::net::frame::{PROBE_FRAME_BYTES, PROBE_GO_TAG};
use crate::raw::RawBuf;
use crate::session::Session;
use std::sync::Arc;
use std::time::{Duration, Instant};

const FRAME: usize = PROBE_FRAME_BYTES as usize;
/// Frames posted (receiver) or queued (sender) ahead, per connection of the link: frames take the
/// connections in turn and complete in order, so a link of several connections needs as many
/// more in flight, or its slowest connection holds the others idle.
const AHEAD: usize = 16;
/// At most this many frames ahead (16 MiB), whatever the connections.
const MAX_AHEAD: usize = 64;
const MIN_FRAMES: usize = 8;
pub(crate) const MIN_TRAIN: Duration = Duration::from_millis(30);
pub(crate) const MAX_TRAIN: Duration = Duration::from_secs(1);

/// `auto` measures up to this many ranks: the rounds run one after another, at least 30 ms each.
pub(crate) const AUTO_MAX_RANKS: usize = 32;

/// Whether start-up measures the links, as `setting` decides for ranks on hosts `machines`
/// (`platform::host` identities, None unknown). `auto` measures only when every rank has a
/// host of its own: ranks that share a host share its NIC, and the rounds' concurrent trains
/// would then measure how many of a host's ranks send at once, not the link.
pub(crate) fn wanted(setting: Measure, machines: &[Option<&str>]) -> bool {
    match setting {
        Measure::Always => true,
        Measure::Never => false,
        Measure::Auto => {
            let n = machines.len();
            (2..=AUTO_MAX_RANKS).contains(&n)
                && (0..n).all(|i| (i + 1..n).all(|j| !same_host(machines[i], machines[j])))
        }
    }
}

/// How long a train to a peer `rtt` away lasts: 20 round trips, from 30 ms to 1 s.
pub(crate) fn train_time(rtt: Duration) -> Duration {
    (rtt * 20).clamp(MIN_TRAIN, MAX_TRAIN)
}

/// The rate of each link into this rank, in bytes per second: `(peer, rate)` for every peer in
/// `peers`, each reached directly (None where too few frames came to tell). `peers` must be the same relation on every
/// rank (a link is measured in both directions or neither). `rtts` is the round trip to each
/// peer. `tag`: `PROBE_TAG`, or `PROBE_AGAIN_TAG` for a second measurement (see there).
pub(crate) fn measure_bandwidth(session: &Arc<Session>, peers: &[usize], rtts: &[(usize, Duration)], deadline: Instant, tag: u64) -> Result<Vec<(usize, Option<f64>)>> {
    let (rank, n) = (session.rank, session.size);
    let rtt = |p: usize| rtts.iter().find(|x| x.0 == p).map_or(Duration::ZERO, |x| x.1);
    let mut rates = Vec::with_capacity(n.saturating_sub(1));
    for k in 1..n {
        let (to, from) = ((rank + k) % n, (rank + n - k) % n);
        let (sent, rate) = std::thread::scope(|scope| {
            let sender = scope.spawn(|| if peers.contains(&to) { send_train(session, to, train_time(rtt(to)), deadline, tag) } else { Ok(()) });
            let rate = if peers.contains(&from) { receive_train(session, from, deadline, tag).map(Some) } else { Ok(None) };
            (sender.join().expect("the probe sender does not panic"), rate)
        });
        sent?;
        if let Some(rate) = rate? {
            rates.push((from, rate));
        }
    }
    Ok(rates)
}

/// Frames in flight for a train over the link to `peer` (`AHEAD`).
fn ahead(session: &Session, peer: usize) -> usize {
    (AHEAD * session.link(peer).lanes()).min(MAX_AHEAD)
}

fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

/// Waits for `to`'s go, then sends frames for `time` (and at least `MIN_FRAMES`), the last one
/// marked.
fn send_train(session: &Arc<Session>, to: usize, time: Duration, deadline: Instant, tag: u64) -> Result<()> {
    let mut go = [0u8; 8];
    p2p::recv_p2p(session, Some(to), PROBE_GO_TAG, DType::U8, RawBuf::of(&mut go), left(deadline), "bandwidth probe".into())?;
    let body = vec![0u8; FRAME];
    let mut last = vec![0u8; FRAME];
    last[0] = 1;
    let (start, ahead) = (Instant::now(), ahead(session, to));
    let mut queued = std::collections::VecDeque::new();
    let mut frames = 0usize;
    loop {
        let done = frames + 1 >= MIN_FRAMES && start.elapsed() >= time;
        let buf = if done { &last } else { &body };
        // SAFETY: the frame only reads `body`/`last`, which outlive every queued send (each is
        // waited for below before this function returns).
        let data = RawBuf { ptr: buf.as_ptr() as *mut u8, len: FRAME };
        queued.push_back(p2p::start_send(session, to, tag, DType::U8, data, "bandwidth probe".into())?);
        frames += 1;
        while queued.len() > ahead || (done && !queued.is_empty()) {
            p2p::finish_p2p(session, queued.pop_front().unwrap(), left(deadline))?;
        }
        if done {
            return Ok(());
        }
    }
}

/// Posts receives for `from`'s train, says go, and notes when each frame landed until the marked
/// one; the rate over the second half of the train (by landing time).
fn receive_train(session: &Arc<Session>, from: usize, deadline: Instant, tag: u64) -> Result<Option<f64>> {
    let mut slots = vec![vec![0u8; FRAME]; ahead(session, from)];
    let mut posted = std::collections::VecDeque::new();
    for (i, slot) in slots.iter_mut().enumerate() {
        posted.push_back((i, p2p::start_recv(session, Some(from), tag, DType::U8, RawBuf::of(slot), "bandwidth probe".into())?));
    }
    let mut go = [0u8; 8];
    p2p::send_p2p(session, from, PROBE_GO_TAG, DType::U8, RawBuf::of(&mut go), left(deadline), "bandwidth probe".into())?;
    let mut arrivals = Vec::new();
    loop {
        let (i, p) = posted.pop_front().expect("a receive is always posted");
        // When it landed, not when this thread got to it: over several connections frames land
        // out of order, and one that lags would bunch up the times of those that passed it.
        arrivals.push(p2p::finish_p2p_landed(session, p, left(deadline))?.1);
        if slots[i][0] == 1 {
            break; // the receives still posted are withdrawn as `posted` drops
        }
        posted.push_back((i, p2p::start_recv(session, Some(from), tag, DType::U8, RawBuf::of(&mut slots[i]), "bandwidth probe".into())?));
    }
    drop(posted);
    arrivals.sort_unstable();
    Ok(rate_of(&arrivals, FRAME))
}

/// Bytes per second over the second half of the frames (of `frame` bytes) that arrived at
/// `arrivals`: slow start sends ever more frames per round trip, so its slow early part is few
/// frames. The whole train when that half holds fewer than 4 frames.
pub(crate) fn rate_of(arrivals: &[Instant], frame: usize) -> Option<f64> {
    let last = *arrivals.last()?;
    let j = arrivals.len() / 2;
    let j = if arrivals.len() - 1 - j >= 4 { j } else { 0 };
    let (frames, secs) = (arrivals.len() - 1 - j, (last - arrivals[j]).as_secs_f64());
    (frames >= 2 && secs > 0.0).then(|| (frames * frame) as f64 / secs)
}

/// A connection counts as held back by its socket buffers when this share of the smaller of
/// them is in flight (its rate times the round trip): the kernel keeps part of a buffer for its
/// own bookkeeping (Linux about a quarter to a half), so a connection at its buffers' limit shows
/// 0.5 to 0.75 of them in flight, and one limited by the link itself far less on any link whose
/// bandwidth-delay product the buffers hold.
const BUFFER_BOUND_SHARE: f64 = 0.4;

/// A link within this factor of its interfaces' speed gains too little from more connections.
const NEAR_SPEED: f64 = 1.2;

/// Without an interface speed to stop at, a link held back by its buffers gets this many times
/// its connections (within `PLAIT_STREAMS_MAX`).
const UNKNOWN_SPEED_GROWTH: f64 = 4.0;

/// The links whose connections are held back by their socket buffers (a long fat pipe: the
/// bandwidth-delay product is past what one connection's buffers hold), with the connections
/// each should have: `(i, j, lanes)` for ranks i < j. Enough connections for the slower of the
/// two interfaces' speeds at the rate one connection reached, within both ends' `max_streams`.
/// Pure, so every rank reaches the same plan from the same records.
pub(crate) fn lanes_wanted(records: &[Vec<LinkRecord>]) -> Vec<(usize, usize, usize)> {
    let rec = |r: usize, peer: usize| records.get(r)?.iter().find(|l| l.peer == peer);
    let mut plan = Vec::new();
    for i in 0..records.len() {
        for j in i + 1..records.len() {
            let (Some(a), Some(b)) = (rec(i, j), rec(j, i)) else { continue };
            if a.same_host || b.same_host {
                continue; // no socket buffers between them worth more connections; a loaded host's noisy round trips could look like one
            }
            let now = a.streams.max(b.streams).max(1);
            let most = a.max_streams.min(b.max_streams).min(MAX_STREAMS);
            let want = [(a, b), (b, a)].into_iter().filter_map(|(tx, rx)| direction_lanes(tx, rx, now)).max();
            if let Some(want) = want.map(|w| w.min(most)).filter(|&w| w > now) {
                plan.push((i, j, want));
            }
        }
    }
    plan
}

/// The connections the direction from `tx`'s rank to `rx`'s wants, if its `lanes` connections
/// are held back by their buffers (`BUFFER_BOUND_SHARE`).
fn direction_lanes(tx: &LinkRecord, rx: &LinkRecord, lanes: usize) -> Option<usize> {
    let rate = rx.rx_bytes_per_s?;
    let rtt = tx.rtt_us.into_iter().chain(rx.rtt_us).fold(f64::NAN, f64::max) / 1e6;
    let buffer = tx.send_buffer?.min(rx.recv_buffer?) as f64;
    if !(rate > 0.0 && rtt > 0.0 && buffer > 0.0) {
        return None;
    }
    let per_lane = rate / lanes as f64;
    if per_lane * rtt < BUFFER_BOUND_SHARE * buffer {
        return None;
    }
    let speed = match (tx.iface_bytes_per_s, rx.iface_bytes_per_s) {
        (Some(a), Some(b)) => a.min(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => rate * UNKNOWN_SPEED_GROWTH,
    };
    if speed < rate * NEAR_SPEED {
        return None; // the link is about as fast as its interfaces already
    }
    Some((speed / per_lane).ceil().min(MAX_STREAMS as f64) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank `from`'s record of its link to `peer`: `rx_mbit` measured into `from`.
    fn link(peer: usize, rtt_ms: f64, rx_mbit: f64, buffers: u64, iface_mbit: Option<f64>, max_streams: usize) -> LinkRecord {
        LinkRecord {
            rtt_us: Some(rtt_ms * 1e3),
            rx_bytes_per_s: Some(rx_mbit * 1e6 / 8.0),
            max_streams,
            send_buffer: Some(buffers),
            recv_buffer: Some(buffers),
            iface_bytes_per_s: iface_mbit.map(|m| m * 1e6 / 8.0),
            ..LinkRecord::connected(peer, "eth0".into(), String::new(), String::new(), false, String::new(), 1)
        }
    }

    #[test]
    fn a_long_fat_pipe_held_back_by_its_buffers_gets_connections() {
        let mib = 1u64 << 20;
        // 100 ms, 1 Gbit/s interfaces, 4 MiB buffers: one stream carries about 200 Mbit/s
        // (2.5 MB in flight, 0.6 of the buffers). Enough streams for 1 Gbit/s at that rate: 5.
        let wan = |max| vec![vec![link(1, 100.0, 200.0, 4 * mib, Some(1000.0), max)], vec![link(0, 100.0, 200.0, 4 * mib, Some(1000.0), max)]];
        assert_eq!(lanes_wanted(&wan(8)), vec![(0, 1, 5)]);
        assert_eq!(lanes_wanted(&wan(3)), vec![(0, 1, 3)], "held to PLAIT_STREAMS_MAX");
        assert_eq!(lanes_wanted(&wan(1)), vec![], "PLAIT_STREAMS_MAX=1 adds none");
        // The smaller of both ends' settings.
        let mut mixed = wan(8);
        mixed[1][0].max_streams = 2;
        assert_eq!(lanes_wanted(&mixed), vec![(0, 1, 2)]);
        // Only one direction held back is enough.
        let mut one_way = wan(8);
        one_way[0][0].rx_bytes_per_s = Some(10e6 / 8.0);
        assert_eq!(lanes_wanted(&one_way), vec![(0, 1, 5)]);
        // An unknown interface speed: four times the connections.
        let mut unknown = wan(8);
        unknown[0][0].iface_bytes_per_s = None;
        unknown[1][0].iface_bytes_per_s = None;
        assert_eq!(lanes_wanted(&unknown), vec![(0, 1, 4)]);
    }

    #[test]
    fn links_their_buffers_hold_keep_one_connection() {
        let mib = 1u64 << 20;
        let pair = |rtt, mbit, buffers, iface| vec![vec![link(1, rtt, mbit, buffers, iface, 8)], vec![link(0, rtt, mbit, buffers, iface, 8)]];
        // A slow WAN link: 50 Mbit/s at 100 ms is 625 KB in flight, far below 4 MiB.
        assert_eq!(lanes_wanted(&pair(100.0, 50.0, 4 * mib, Some(1000.0))), vec![]);
        // A LAN: 1 Gbit/s at 0.2 ms.
        assert_eq!(lanes_wanted(&pair(0.2, 940.0, 4 * mib, Some(1000.0))), vec![]);
        // Held back, but already at the interface's speed.
        assert_eq!(lanes_wanted(&pair(100.0, 950.0, 16 * mib, Some(1000.0))), vec![]);
        // Unknown buffers (Windows) or nothing measured: left alone.
        let mut unknown = pair(100.0, 200.0, 4 * mib, Some(1000.0));
        unknown[0][0].recv_buffer = None;
        unknown[1][0].recv_buffer = None;
        assert_eq!(lanes_wanted(&unknown), vec![]);
        let mut unmeasured = pair(100.0, 200.0, 4 * mib, Some(1000.0));
        unmeasured[0][0].rx_bytes_per_s = None;
        unmeasured[1][0].rx_bytes_per_s = None;
        assert_eq!(lanes_wanted(&unmeasured), vec![]);
        // A link that already has the connections it wants.
        let mut grown = pair(100.0, 1000.0, 4 * mib, Some(10_000.0));
        grown[0][0].streams = 8;
        grown[1][0].streams = 8;
        assert_eq!(lanes_wanted(&grown), vec![]);
    }

    #[test]
    fn the_rate_is_taken_after_slow_start() {
        let t0 = Instant::now();
        // 10 frames 10 ms apart (slow start), then 20 frames 1 ms apart (the link's rate).
        let mut at: Vec<Instant> = (0..10).map(|i| t0 + Duration::from_millis(10 * i)).collect();
        at.extend((1..=20).map(|i| t0 + Duration::from_millis(90 + i)));
        let r = rate_of(&at, 1000).unwrap();
        // The second half of the frames is all at the link's rate: 1000 B per ms.
        assert!((r - 1e6).abs() < 0.1e6, "{r}");
        assert_eq!(rate_of(&at[..1], 1000), None);
        assert_eq!(rate_of(&[], 1000), None);
    }

    #[test]
    fn auto_measures_only_worlds_of_one_rank_per_host() {
        let hosts = |names: &[&'static str]| names.iter().map(|&n| Some(n)).collect::<Vec<_>>();
        assert!(wanted(Measure::Auto, &hosts(&["a", "b", "c"])));
        assert!(!wanted(Measure::Auto, &hosts(&["a", "b", "a"])), "two ranks share host a");
        assert!(!wanted(Measure::Auto, &hosts(&["a"])));
        assert!(wanted(Measure::Auto, &[None, None]), "unknown hosts are never the same");
        let many: Vec<String> = (0..=AUTO_MAX_RANKS).map(|i| format!("h{i}")).collect();
        let many: Vec<Option<&str>> = many.iter().map(|s| Some(s.as_str())).collect();
        assert!(!wanted(Measure::Auto, &many) && wanted(Measure::Always, &many));
        assert!(!wanted(Measure::Never, &hosts(&["a", "b"])) && wanted(Measure::Always, &hosts(&["a", "a"])));
    }

    /// Was: the second measurement (after connections were added) reused `PROBE_TAG`, whose
    /// ordinals the first train's withdrawn receives had put out of step, and left 15 frames per
    /// link stashed for the rest of the session (and an elastic view's next mesh refused them).
    #[test]
    fn measuring_again_leaves_nothing_behind() {
        use crate::net::frame::{PROBE_AGAIN_TAG, PROBE_TAG};
        use crate::{CommConfig, Communicator, MemStore};
        let store = Arc::new(MemStore::new());
        let handles: Vec<_> = (0..2)
            .map(|r| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut cfg = CommConfig::from_env(r, 2).unwrap();
                    cfg.timeout = Duration::from_secs(20);
                    cfg.measure = Measure::Never;
                    cfg.group = "measure-again".into();
                    let comm = Communicator::new(&*store, cfg).unwrap();
                    let session = comm.session();
                    let rtts = [(1 - r, Duration::from_millis(1))];
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let first = measure_bandwidth(session, &[1 - r], &rtts, deadline, PROBE_TAG).unwrap();
                    let again = measure_bandwidth(session, &[1 - r], &rtts, deadline, PROBE_AGAIN_TAG).unwrap();
                    comm.barrier(None, true).unwrap().wait(None).unwrap().unwrap();
                    let left = session.mailbox.stashed_len();
                    comm.close();
                    (first[0].1.is_some() && again[0].1.is_some(), left)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), (true, 0), "both measurements read a rate and left no frame stashed");
        }
    }

    #[test]
    fn trains_last_twenty_round_trips_within_bounds() {
        assert_eq!(train_time(Duration::from_micros(50)), MIN_TRAIN);
        assert_eq!(train_time(Duration::from_millis(10)), Duration::from_millis(200));
        assert_eq!(train_time(Duration::from_millis(100)), MAX_TRAIN);
    }
}
