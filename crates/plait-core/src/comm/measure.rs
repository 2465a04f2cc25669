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

use super::config::Measure;
use crate::dtype::DType;
use crate::error::Result;
use crate::platform::host::same_host;
use crate::exec::p2p;
use crate::net::frame::{PROBE_FRAME_BYTES, PROBE_GO_TAG, PROBE_TAG};
use crate::raw::RawBuf;
use crate::session::Session;
use std::sync::Arc;
use std::time::{Duration, Instant};

const FRAME: usize = PROBE_FRAME_BYTES as usize;
/// Frames posted (receiver) or queued (sender) ahead.
const AHEAD: usize = 8;
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

/// The rate of each link into this rank, in bytes per second: `(peer, rate)` for every peer
/// (None where too few frames came to tell). `rtts` is the round trip to each peer.
pub(crate) fn measure_bandwidth(session: &Arc<Session>, rtts: &[(usize, Duration)], deadline: Instant) -> Result<Vec<(usize, Option<f64>)>> {
    let (rank, n) = (session.rank, session.size);
    let rtt = |p: usize| rtts.iter().find(|x| x.0 == p).map_or(Duration::ZERO, |x| x.1);
    let mut rates = Vec::with_capacity(n.saturating_sub(1));
    for k in 1..n {
        let (to, from) = ((rank + k) % n, (rank + n - k) % n);
        let (sent, rate) = std::thread::scope(|scope| {
            let sender = scope.spawn(|| send_train(session, to, train_time(rtt(to)), deadline));
            let rate = receive_train(session, from, deadline);
            (sender.join().expect("the probe sender does not panic"), rate)
        });
        sent?;
        rates.push((from, rate?));
    }
    Ok(rates)
}

fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

/// Waits for `to`'s go, then sends frames for `time` (and at least `MIN_FRAMES`), the last one
/// marked.
fn send_train(session: &Arc<Session>, to: usize, time: Duration, deadline: Instant) -> Result<()> {
    let mut go = [0u8; 8];
    p2p::recv_p2p(session, Some(to), PROBE_GO_TAG, DType::U8, RawBuf::of(&mut go), left(deadline), "bandwidth probe".into())?;
    let body = vec![0u8; FRAME];
    let mut last = vec![0u8; FRAME];
    last[0] = 1;
    let start = Instant::now();
    let mut queued = std::collections::VecDeque::new();
    let mut frames = 0usize;
    loop {
        let done = frames + 1 >= MIN_FRAMES && start.elapsed() >= time;
        let buf = if done { &last } else { &body };
        // SAFETY: the frame only reads `body`/`last`, which outlive every queued send (each is
        // waited for below before this function returns).
        let data = RawBuf { ptr: buf.as_ptr() as *mut u8, len: FRAME };
        queued.push_back(p2p::start_send(session, to, PROBE_TAG, DType::U8, data, "bandwidth probe".into())?);
        frames += 1;
        while queued.len() > AHEAD || (done && !queued.is_empty()) {
            p2p::finish_p2p(session, queued.pop_front().unwrap(), left(deadline))?;
        }
        if done {
            return Ok(());
        }
    }
}

/// Posts receives for `from`'s train, says go, and times each frame's arrival until the marked
/// one; the rate over the second half of the train.
fn receive_train(session: &Arc<Session>, from: usize, deadline: Instant) -> Result<Option<f64>> {
    let mut slots = vec![vec![0u8; FRAME]; AHEAD];
    let mut posted = std::collections::VecDeque::new();
    for (i, slot) in slots.iter_mut().enumerate() {
        posted.push_back((i, p2p::start_recv(session, Some(from), PROBE_TAG, DType::U8, RawBuf::of(slot), "bandwidth probe".into())?));
    }
    let mut go = [0u8; 8];
    p2p::send_p2p(session, from, PROBE_GO_TAG, DType::U8, RawBuf::of(&mut go), left(deadline), "bandwidth probe".into())?;
    let mut arrivals = Vec::new();
    loop {
        let (i, p) = posted.pop_front().expect("a receive is always posted");
        p2p::finish_p2p(session, p, left(deadline))?;
        arrivals.push(Instant::now());
        if slots[i][0] == 1 {
            break; // the receives still posted are withdrawn as `posted` drops
        }
        posted.push_back((i, p2p::start_recv(session, Some(from), PROBE_TAG, DType::U8, RawBuf::of(&mut slots[i]), "bandwidth probe".into())?));
    }
    drop(posted);
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn trains_last_twenty_round_trips_within_bounds() {
        assert_eq!(train_time(Duration::from_micros(50)), MIN_TRAIN);
        assert_eq!(train_time(Duration::from_millis(10)), Duration::from_millis(200));
        assert_eq!(train_time(Duration::from_millis(100)), MAX_TRAIN);
    }
}
