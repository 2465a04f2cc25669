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

use super::{Schedule, Step};
use std::collections::BTreeMap;

/// Fraction of `alpha` that is per-message overhead and serialises across a rank's messages.
pub const OVERHEAD_SHARE: f64 = 0.125;

#[derive(Clone, Copy, Debug, PartialEq)]
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
}

impl Default for LinkModel {
    fn default() -> Self {
        LinkModel { alpha: 30e-6, bandwidth: 2e9, gamma: 0.3e-9, shared: true }
    }
}

/// Bytes one rank moves, per peer and direction, plus bytes it reduces.
#[derive(Default)]
struct Traffic {
    sent: BTreeMap<u32, f64>,
    received: BTreeMap<u32, f64>,
    reduced: f64,
}

impl Traffic {
    fn peers(&self) -> usize {
        self.sent.len().max(self.received.len())
    }

    fn wire_seconds(&self, model: &LinkModel) -> f64 {
        let bytes = if model.shared {
            self.sent.values().sum::<f64>().max(self.received.values().sum())
        } else {
            self.sent.values().chain(self.received.values()).fold(0.0, |a, &b| a.max(b))
        };
        bytes / model.bandwidth
    }

    fn add(&mut self, other: &Traffic) {
        for (p, b) in &other.sent {
            *self.sent.entry(*p).or_default() += b;
        }
        for (p, b) in &other.received {
            *self.received.entry(*p).or_default() += b;
        }
        self.reduced += other.reduced;
    }
}

/// Estimated seconds to run `s` with block sizes `block_bytes` (missing entries count as 0).
pub fn estimate(s: &Schedule, block_bytes: &[usize], model: &LinkModel, segment_bytes: usize) -> f64 {
    let n = s.nranks;
    let size = |r: usize, c: &super::ChunkRef| {
        block_bytes.get(c.block(s.collective, n, r, s.root)).copied().unwrap_or(0) as f64
    };
    let max_block = block_bytes.iter().copied().max().unwrap_or(0);
    let segs = if segment_bytes == 0 { 1 } else { max_block.div_ceil(segment_bytes).max(1) } as f64;

    let mut totals: Vec<Traffic> = (0..n).map(|_| Traffic::default()).collect();
    let mut messages = vec![0usize; n];
    let (mut pipe_sum, mut pipe_max) = (0.0f64, 0.0f64);
    let empty = Step::default();
    for k in 0..s.nsteps() {
        let mut step_time = 0.0f64;
        for r in 0..n {
            let st = s.ranks.get(r).and_then(|p| p.get(k)).unwrap_or(&empty);
            let mut t = Traffic::default();
            for op in &st.sends {
                *t.sent.entry(op.peer).or_default() += size(r, &op.src);
            }
            for op in &st.recvs {
                let b = size(r, &op.dst);
                *t.received.entry(op.peer).or_default() += b;
                if op.reduce_with.is_some() {
                    t.reduced += b;
                }
            }
            for op in &st.locals {
                if let super::LocalOp::Reduce { dst, .. } = op {
                    t.reduced += size(r, dst);
                }
            }
            let m = t.peers();
            let lat = if m == 0 {
                0.0
            } else {
                model.alpha * (1.0 - OVERHEAD_SHARE + OVERHEAD_SHARE * m as f64)
            };
            let work = t.wire_seconds(model) + t.reduced * model.gamma;
            step_time = step_time.max(lat + work / segs);
            messages[r] += m;
            totals[r].add(&t);
        }
        pipe_sum += step_time;
        pipe_max = pipe_max.max(step_time);
    }
    let t_pipe = pipe_sum + (segs - 1.0) * pipe_max;
    let t_res = (0..n)
        .map(|r| {
            segs * model.alpha * OVERHEAD_SHARE * messages[r] as f64
                + totals[r].wire_seconds(model)
                + totals[r].reduced * model.gamma
        })
        .fold(0.0, f64::max);
    t_pipe.max(t_res)
}
