//! Alpha-beta-gamma cost model, used to rank algorithms; it only needs to order them sensibly,
//! not to predict wall time.
//!
//! # Formula
//! Let `S = max(1, ceil(max block bytes / segment_bytes))` be the number of pipeline segments
//! (the executor runs the schedule once per segment). For rank `r` in step `k`, with `m` the
//! number of distinct peers it sends to or receives from (the larger of the two counts; several
//! messages to one peer in a step travel as one stream):
//!
//! ```text
//! lat(r,k)  = alpha * (1 - OVERHEAD_SHARE + OVERHEAD_SHARE * m)        (0 if m == 0)
//! wire(r,k) = shared:    max(bytes sent, bytes received) / bandwidth
//!             dedicated: max over peers and directions of bytes on that link / bandwidth
//! red(r,k)  = gamma * bytes reduced (accumulating receives + local reduces)
//! t(k)      = max over r of  lat(r,k) + (wire(r,k) + red(r,k)) / S         (one segment)
//! T_pipe    = sum_k t(k) + (S - 1) * max_k t(k)
//! T_res     = max over r of  S * alpha * OVERHEAD_SHARE * sum_k m(r,k)
//!                            + wire over all steps (same rule, on totals) + red over all steps
//! T         = max(T_pipe, T_res)
//! ```
//! `T_pipe` is a pipeline whose stages overlap (right for a chain, whose steps use different
//! links); `T_res` is the busiest rank's own work, which overlapping cannot hide (a ring's steps
//! all use the same link). With `S == 1`, `T == T_pipe`: the plain BSP sum of step maxima.
//!
//! `alpha` is split: concurrent messages of one step overlap their latency, but the per-message
//! software overhead (system calls, framing, wake-ups), taken as `OVERHEAD_SHARE` of alpha,
//! serialises. Charging full alpha per peer would make a one-step fan-out to n-1 peers look no
//! faster than n-1 sequential steps, which is not what loopback or a LAN shows.
//! Local copies are not charged (memory bandwidth is far above network bandwidth).
//!
//! # Measured links
//! With a [`LinkMatrix`] (links measured at start-up, `PLAIT_MEASURE`) each link has its own
//! latency and bandwidth: a step's latency is that of its slowest-to-answer link plus the
//! per-message overhead (`OVERHEAD_SHARE` of alpha) per peer, and its wire time is each link's
//! bytes at that link's rate (summed over a rank's links when they share a NIC, the slowest
//! link's when they are dedicated). Without one every link is alike, as above.

use super::order::LinkMatrix;
use super::{ChunkRef, LocalOp, Schedule};
use std::sync::Arc;

/// Fraction of `alpha` that is per-message overhead and serialises across a rank's messages.
pub const OVERHEAD_SHARE: f64 = 0.125;

#[derive(Clone, Debug, PartialEq)]
pub struct LinkModel {
    /// Seconds per message (latency plus per-message overhead).
    pub alpha: f64,
    /// Bytes per second per link direction.
    pub bandwidth: f64,
    /// Seconds per byte reduced.
    pub gamma: f64,
    /// All of a rank's links share one NIC (or loopback): its sends in a step serialise, and so
    /// do its receives. `false`: a dedicated link per peer (full mesh).
    pub shared: bool,
    /// Each directed link's latency and bandwidth as measured, for this world size; when set,
    /// it stands for `alpha`'s latency part and for `bandwidth`.
    pub links: Option<Arc<LinkMatrix>>,
}

impl Default for LinkModel {
    fn default() -> Self {
        LinkModel { alpha: 30e-6, bandwidth: 2e9, gamma: 0.3e-9, shared: true, links: None }
    }
}

impl LinkModel {
    /// The measured links, if they are for `n` ranks.
    fn links_for(&self, n: usize) -> Option<&LinkMatrix> {
        self.links.as_deref().filter(|m| m.n == n)
    }
}

/// Per-peer byte counters that reset in O(touched) instead of O(n), so that estimating a
/// schedule costs O(operations) whatever the world size.
struct PeerBytes {
    bytes: Vec<f64>,
    seen: Vec<bool>,
    touched: Vec<usize>,
}

impl PeerBytes {
    fn new(n: usize) -> Self {
        PeerBytes { bytes: vec![0.0; n], seen: vec![false; n], touched: Vec::new() }
    }

    fn add(&mut self, peer: usize, b: f64) {
        if peer < self.bytes.len() {
            if !self.seen[peer] {
                self.seen[peer] = true;
                self.touched.push(peer);
            }
            self.bytes[peer] += b;
        }
    }

    fn peers(&self) -> usize {
        self.touched.len()
    }

    fn sum(&self) -> f64 {
        self.touched.iter().map(|&p| self.bytes[p]).sum()
    }

    fn max(&self) -> f64 {
        self.touched.iter().map(|&p| self.bytes[p]).fold(0.0, f64::max)
    }

    /// Seconds per link, `bytes / rate(peer)`: their sum and their maximum.
    fn seconds(&self, rate: impl Fn(usize) -> f64) -> (f64, f64) {
        self.touched.iter().map(|&p| self.bytes[p] / rate(p)).fold((0.0, 0.0), |(s, m), t| (s + t, m.max(t)))
    }

    fn clear(&mut self) {
        for &p in &self.touched {
            self.bytes[p] = 0.0;
            self.seen[p] = false;
        }
        self.touched.clear();
    }
}

/// Seconds rank `r` spends on the wire for what it sends and receives.
fn wire_seconds(r: usize, sent: &PeerBytes, received: &PeerBytes, model: &LinkModel, links: Option<&LinkMatrix>) -> f64 {
    let Some(m) = links else {
        let bytes = if model.shared { sent.sum().max(received.sum()) } else { sent.max().max(received.max()) };
        return bytes / model.bandwidth;
    };
    let (out_sum, out_max) = sent.seconds(|p| m.bandwidth(r, p));
    let (in_sum, in_max) = received.seconds(|p| m.bandwidth(p, r));
    if model.shared {
        out_sum.max(in_sum)
    } else {
        out_max.max(in_max)
    }
}

/// The latency of a step in which rank `r` talks to the peers in `sent` and `received`.
fn step_latency(r: usize, sent: &PeerBytes, received: &PeerBytes, model: &LinkModel, links: Option<&LinkMatrix>) -> f64 {
    let m = sent.peers().max(received.peers());
    if m == 0 {
        return 0.0;
    }
    let overhead = model.alpha * OVERHEAD_SHARE * m as f64;
    match links {
        None => model.alpha * (1.0 - OVERHEAD_SHARE) + overhead,
        Some(l) => {
            let out = sent.touched.iter().map(|&p| l.latency(r, p));
            let inn = received.touched.iter().map(|&p| l.latency(p, r));
            out.chain(inn).fold(0.0, f64::max) + overhead
        }
    }
}

/// Estimated seconds to run `s` with block sizes `block_bytes` (missing entries count as 0).
pub fn estimate(
    s: &Schedule,
    block_bytes: &[usize],
    model: &LinkModel,
    segment_bytes: usize,
) -> f64 {
    let n = s.nranks;
    let links = model.links_for(n);
    let size = |r: usize, c: &ChunkRef| {
        block_bytes.get(c.block(s.collective, n, r, s.root)).copied().unwrap_or(0) as f64
    };
    let max_block = block_bytes.iter().copied().max().unwrap_or(0);
    let segs = if segment_bytes == 0 { 1 } else { max_block.div_ceil(segment_bytes).max(1) } as f64;

    let nsteps = s.nsteps();
    let mut step_time = vec![0.0f64; nsteps];
    let mut t_res = 0.0f64;
    let (mut sent, mut received) = (PeerBytes::new(n), PeerBytes::new(n));
    let (mut total_sent, mut total_received) = (PeerBytes::new(n), PeerBytes::new(n));
    for (r, prog) in s.ranks.iter().enumerate() {
        let (mut messages, mut reduced_total) = (0usize, 0.0f64);
        for (k, st) in prog.iter().enumerate().take(nsteps) {
            let mut reduced = 0.0;
            for op in &st.sends {
                let b = size(r, &op.src);
                sent.add(op.peer as usize, b);
                total_sent.add(op.peer as usize, b);
            }
            for op in &st.recvs {
                let b = size(r, &op.dst);
                received.add(op.peer as usize, b);
                total_received.add(op.peer as usize, b);
                if op.reduce_with.is_some() {
                    reduced += b;
                }
            }
            for op in &st.locals {
                if let LocalOp::Reduce { dst, .. } = op {
                    reduced += size(r, dst);
                }
            }
            let m = sent.peers().max(received.peers());
            let lat = step_latency(r, &sent, &received, model, links);
            let work = wire_seconds(r, &sent, &received, model, links) + reduced * model.gamma;
            step_time[k] = step_time[k].max(lat + work / segs);
            messages += m;
            reduced_total += reduced;
            sent.clear();
            received.clear();
        }
        let busy = segs * model.alpha * OVERHEAD_SHARE * messages as f64
            + wire_seconds(r, &total_sent, &total_received, model, links)
            + reduced_total * model.gamma;
        t_res = t_res.max(busy);
        total_sent.clear();
        total_received.clear();
    }
    let pipe_max = step_time.iter().copied().fold(0.0, f64::max);
    let t_pipe = step_time.iter().sum::<f64>() + (segs - 1.0) * pipe_max;
    t_pipe.max(t_res)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::gen::{algorithms, generate};
    use crate::sched::Collective;

    const MIB: usize = 1 << 20;

    fn costs(
        coll: Collective,
        n: usize,
        total: usize,
        model: &LinkModel,
        seg: usize,
    ) -> Vec<(&'static str, f64)> {
        let blocks = vec![total / n; n];
        algorithms(coll)
            .iter()
            .map(|&a| (a, estimate(&generate(coll, a, n, 0).unwrap(), &blocks, model, seg)))
            .collect()
    }

    fn cheapest(c: &[(&'static str, f64)]) -> &'static str {
        c.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0
    }

    fn of(c: &[(&'static str, f64)], name: &str) -> f64 {
        c.iter().find(|x| x.0 == name).unwrap().1
    }

    #[test]
    fn small_allreduce_prefers_oneshot() {
        let c = costs(Collective::AllReduce, 8, 8, &LinkModel::default(), MIB);
        assert_eq!(cheapest(&c), "oneshot", "{c:?}");
    }

    #[test]
    fn large_allreduce_avoids_oneshot() {
        for seg in [0, MIB, 4 * MIB] {
            let c = costs(Collective::AllReduce, 8, 64 * MIB, &LinkModel::default(), seg);
            assert!(of(&c, "ring") < of(&c, "oneshot"), "{c:?}");
            assert!(of(&c, "direct") < of(&c, "oneshot"), "{c:?}");
        }
        // Full mesh: direct uses every link at once.
        let mesh = LinkModel { shared: false, ..LinkModel::default() };
        let c = costs(Collective::AllReduce, 8, 64 * MIB, &mesh, MIB);
        assert!(of(&c, "direct") < of(&c, "ring"), "{c:?}");
        assert!(of(&c, "ring2") < of(&c, "ring"), "{c:?}");
    }

    #[test]
    fn pipelined_chain_beats_binomial_for_large_broadcast() {
        let c = costs(Collective::Broadcast, 8, 256 * MIB, &LinkModel::default(), MIB);
        assert!(of(&c, "chain") < of(&c, "binomial"), "{c:?}");
        let c = costs(Collective::Broadcast, 8, 64, &LinkModel::default(), MIB);
        assert!(of(&c, "binomial") < of(&c, "chain"), "{c:?}");
    }

    #[test]
    fn grows_with_bytes() {
        for coll in Collective::ALL {
            for &a in algorithms(coll) {
                let s = generate(coll, a, 6, 2).unwrap();
                let mut last = 0.0;
                for total in [0, 6, 6 << 10, 6 << 20, 6 << 26] {
                    let t = estimate(&s, &[total / 6; 6], &LinkModel::default(), MIB);
                    assert!(t > last || (total == 0 && t >= 0.0), "{coll} {a}: {t} after {last}");
                    last = t;
                }
            }
        }
    }
}
