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
//! wire(r,k) = shared:    max over directions of max(bytes / (bandwidth * parallelism),
//!                                                  bytes on one link / bandwidth)
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
//!
//! # Ranks that share hosts
//! With [`Hosts`] (ranks on more than one host, some host holding several: torchrun's k
//! processes per machine) a host's network interface carries what all its ranks send to and
//! receive from other hosts. For each step and interface, the larger of `bytes out` and
//! `bytes in` over `bandwidth` is at least a step's time (with the step's slowest latency, per
//! segment), and each interface's total is at least `T_res`. A byte between two ranks of one
//! host costs `1 / SAME_HOST_SPEEDUP` of a network byte on the ranks' own links. So on 2 hosts
//! x 2 ranks an allreduce is priced by what crosses between the hosts: 1.5 S for `ring`, 2 S
//! for `direct` and `rhd`, S for a hierarchical schedule; without hosts every rank sends 1.5 S
//! in all three and the one with fewest steps wins. With measured links neither rule applies:
//! a host's ranks measured at once, so the rates already carry their sharing.

use super::order::LinkMatrix;
use super::{ChunkRef, LocalOp, Schedule};
use std::collections::HashMap;
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
    /// How many of a shared rank's links run at full rate at once (1: a NIC, whose links take
    /// turns; more on loopback, where each connection is copied by its own thread and core).
    pub parallelism: f64,
    /// Each directed link's latency and bandwidth as measured, for this world size; when set,
    /// it stands for `alpha`'s latency part and for `bandwidth`.
    pub links: Option<Arc<LinkMatrix>>,
    /// Which ranks share a host, when some do and there is more than one host (ranks as
    /// torchrun starts them, k per machine): priced as "Ranks that share hosts" above says,
    /// unless the links were measured.
    pub hosts: Option<Arc<Hosts>>,
}

/// Which ranks share a host, and which network interface each rank's links to another host
/// leave by.
#[derive(Clone, Debug, PartialEq)]
pub struct Hosts {
    /// Each rank's host, numbered 0, 1, ... by first rank.
    pub of_rank: Vec<usize>,
    /// `iface[r * hosts + g]`: the interface (numbered across all hosts) rank r's links to the
    /// ranks of host g use (that of its link to g's first rank), or `None` for r's own host.
    /// Both directions of a link use it. Per host, not per peer, so it stays small for many
    /// ranks per host.
    pub iface: Vec<Option<usize>>,
    /// How many hosts and interfaces there are.
    pub hosts: usize,
    pub ifaces: usize,
}

impl Hosts {
    /// From each rank's host id and a name for the interface rank r uses to reach rank p (another
    /// host's), unique on r's host; `None` unless there is more than one host and one holds more
    /// than one rank (otherwise every rank's links are its own, which the plain model prices).
    pub fn new(host: &[usize], iface_name: impl Fn(usize, usize) -> String) -> Option<Hosts> {
        let mut ids: HashMap<usize, usize> = HashMap::new();
        let mut first: Vec<usize> = Vec::new();
        let of_rank: Vec<usize> = host
            .iter()
            .enumerate()
            .map(|(r, h)| {
                *ids.entry(*h).or_insert_with(|| {
                    first.push(r);
                    first.len() - 1
                })
            })
            .collect();
        let (n, hosts) = (host.len(), first.len());
        if hosts < 2 || hosts == n {
            return None;
        }
        let mut names: HashMap<(usize, String), usize> = HashMap::new();
        let mut iface = vec![None; n * hosts];
        for r in 0..n {
            for (g, &p) in first.iter().enumerate().filter(|&(g, _)| g != of_rank[r]) {
                let next = names.len();
                iface[r * hosts + g] = Some(*names.entry((of_rank[r], iface_name(r, p))).or_insert(next));
            }
        }
        Some(Hosts { of_rank, iface, hosts, ifaces: names.len() })
    }

    /// The same for the ranks `ranks` (a subgroup, its rank i being `ranks[i]`).
    pub fn sub(&self, ranks: &[usize]) -> Option<Hosts> {
        let host: Vec<usize> = ranks.iter().map(|&r| self.of_rank[r]).collect();
        Hosts::new(&host, |i, j| format!("{:?}", self.iface(ranks[i], ranks[j])))
    }

    /// The interface rank r's link to rank p leaves r's host by (`None`: the same host).
    pub fn iface(&self, r: usize, p: usize) -> Option<usize> {
        self.iface.get(r * self.hosts + *self.of_rank.get(p)?).copied().flatten()
    }
}

/// How much faster two ranks of one host exchange bytes (through its memory: loopback or shared
/// memory) than ranks of different hosts do, where the links were not measured. Loopback TCP
/// moves several GB/s on one core; the NICs of the clusters plait is for move 0.1-1.25 GB/s.
pub const SAME_HOST_SPEEDUP: f64 = 4.0;

impl Default for LinkModel {
    fn default() -> Self {
        LinkModel { alpha: 30e-6, bandwidth: 2e9, gamma: 0.3e-9, shared: true, parallelism: 1.0, links: None, hosts: None }
    }
}

impl LinkModel {
    /// The measured links, if they are for `n` ranks.
    fn links_for(&self, n: usize) -> Option<&LinkMatrix> {
        self.links.as_deref().filter(|m| m.n == n)
    }

    /// The ranks' hosts, if they are for `n` ranks.
    fn hosts_for(&self, n: usize) -> Option<&Hosts> {
        self.hosts.as_deref().filter(|h| h.of_rank.len() == n)
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
        let p = model.parallelism.max(1.0);
        let seconds = if model.shared {
            (sent.sum().max(received.sum()) / p).max(sent.max().max(received.max()))
        } else {
            sent.max().max(received.max())
        };
        return seconds / model.bandwidth;
    };
    let (out_sum, out_max) = sent.seconds(|p| m.bandwidth(r, p));
    let (in_sum, in_max) = received.seconds(|p| m.bandwidth(p, r));
    if model.shared {
        let p = model.parallelism.max(1.0);
        (out_sum.max(in_sum) / p).max(out_max.max(in_max))
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
    // Where ranks share hosts (and the links were not measured: rates measured by a host's ranks
    // at once already carry their sharing): what each host's interfaces carry,
    // [step][interface][out, in] in bytes (a NIC's links take turns), and each step's slowest
    // latency.
    let hosts = model.hosts_for(n).filter(|_| links.is_none());
    let nics = hosts.map_or(0, |h| h.ifaces);
    let mut nic_step = vec![[0.0f64; 2]; nics * nsteps];
    let mut nic_total = vec![[0.0f64; 2]; nics];
    let mut step_lat = vec![0.0f64; nsteps];
    // The bytes that count on rank r's own links for `b` bytes to or from `peer`.
    let mut charge = |k: usize, r: usize, peer: usize, b: f64, dir: usize| -> f64 {
        let Some(h) = hosts else { return b };
        match h.iface(r, peer) {
            Some(i) => {
                nic_step[k * nics + i][dir] += b;
                nic_total[i][dir] += b;
                b
            }
            None => b / SAME_HOST_SPEEDUP,
        }
    };
    for (r, prog) in s.ranks.iter().enumerate() {
        let (mut messages, mut reduced_total) = (0usize, 0.0f64);
        for (k, st) in prog.iter().enumerate().take(nsteps) {
            let mut reduced = 0.0;
            for op in &st.sends {
                let (p, b) = (op.peer as usize, size(r, &op.src));
                let w = charge(k, r, p, b, 0);
                sent.add(p, w);
                total_sent.add(p, w);
            }
            for op in &st.recvs {
                let (p, b) = (op.peer as usize, size(r, &op.dst));
                let w = charge(k, r, p, b, 1);
                received.add(p, w);
                total_received.add(p, w);
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
            step_lat[k] = step_lat[k].max(lat);
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
    for (k, t) in step_time.iter_mut().enumerate() {
        for [out, inn] in &nic_step[k * nics..(k + 1) * nics] {
            *t = t.max(step_lat[k] + out.max(*inn) / model.bandwidth / segs);
        }
    }
    for [out, inn] in &nic_total {
        t_res = t_res.max(out.max(*inn) / model.bandwidth);
    }
    let pipe_max = step_time.iter().copied().fold(0.0, f64::max);
    let t_pipe = step_time.iter().sum::<f64>() + (segs - 1.0) * pipe_max;
    t_pipe.max(t_res)
}

/// The constants `PLAIT_COST_MODEL` sets (`alpha=5e-05,bandwidth=1.2e9,gamma=4e-10`, any of
/// them; what `plait topology --fit` prints), each within [`FIT_BOUNDS`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Constants {
    pub alpha: Option<f64>,
    pub bandwidth: Option<f64>,
    pub gamma: Option<f64>,
    pub parallelism: Option<f64>,
}

const NAMES: [&str; 4] = ["alpha", "bandwidth", "gamma", "parallelism"];

impl Constants {
    pub fn parse(text: &str) -> Result<Constants, String> {
        let mut c = Constants::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, value) = item.split_once('=').ok_or_else(|| format!("{item:?} is not name=value"))?;
            let i = NAMES
                .iter()
                .position(|n| *n == name.trim())
                .ok_or_else(|| format!("{:?} is not one of alpha, bandwidth, gamma, parallelism", name.trim()))?;
            let v: f64 = value.trim().parse().map_err(|_| format!("{name}={:?} is not a number", value.trim()))?;
            let (lo, hi) = FIT_BOUNDS[i];
            if !(lo..=hi).contains(&v) {
                return Err(format!("{name}={v} is outside {lo:e}..{hi:e} ({})", ["seconds", "bytes per second", "seconds per byte", "links"][i]));
            }
            *[&mut c.alpha, &mut c.bandwidth, &mut c.gamma, &mut c.parallelism][i] = Some(v);
        }
        Ok(c)
    }

    /// The constants set, as a setting that reads back to the same numbers ("" when none is):
    /// ranks compare theirs at start-up.
    pub fn canonical(&self) -> String {
        let set = [self.alpha, self.bandwidth, self.gamma, self.parallelism];
        NAMES.iter().zip(set).filter_map(|(n, v)| Some(format!("{n}={:e}", v?))).collect::<Vec<_>>().join(",")
    }

    /// The setting that gives `m`'s constants.
    pub fn text_of(m: &LinkModel) -> String {
        format!("alpha={:.3e},bandwidth={:.3e},gamma={:.3e},parallelism={:.3}", m.alpha, m.bandwidth, m.gamma, m.parallelism)
    }

    /// `m` with these constants where they are set.
    pub fn apply(&self, mut m: LinkModel) -> LinkModel {
        m.alpha = self.alpha.unwrap_or(m.alpha);
        m.bandwidth = self.bandwidth.unwrap_or(m.bandwidth);
        m.gamma = self.gamma.unwrap_or(m.gamma);
        m.parallelism = self.parallelism.unwrap_or(m.parallelism);
        m
    }
}

/// One measured run for [`fit`]: a schedule, the block sizes it ran with, and its measured
/// seconds (the slowest rank's).
#[derive(Clone, Copy)]
pub struct Sample<'a> {
    pub schedule: &'a Schedule,
    pub block_bytes: &'a [usize],
    pub seconds: f64,
}

/// The constants a model may be fitted over, in the order [`fit`] tries them.
const FITTED: [fn(&mut LinkModel) -> &mut f64; 4] = [|m| &mut m.alpha, |m| &mut m.bandwidth, |m| &mut m.gamma, |m| &mut m.parallelism];

/// Each constant stays within these bounds (alpha seconds, bandwidth bytes per second, gamma
/// seconds per byte, parallelism links): a fit to a few noisy samples must not drift into
/// nonsense.
pub const FIT_BOUNDS: [(f64, f64); 4] = [(1e-7, 1.0), (1e5, 1e12), (1e-13, 1e-6), (1.0, 64.0)];

/// The mean squared log error of `model` over `samples`: how far off its predictions are, as a
/// ratio either way (a prediction twice too high costs what one half too low does).
pub fn log_error(samples: &[Sample], model: &LinkModel, segment_bytes: usize) -> f64 {
    let n = samples.len().max(1) as f64;
    samples
        .iter()
        .map(|s| (estimate(s.schedule, s.block_bytes, model, segment_bytes) / s.seconds).ln().powi(2))
        .sum::<f64>()
        / n
}

/// The least share by which a step of [`fit`] must lower the error to be taken.
const MIN_GAIN: f64 = 1e-3;

/// `start` with alpha, bandwidth, gamma and parallelism fitted to `samples` (the mean squared log error of
/// the predictions, least), by coordinate descent on a log scale: each constant in turn is
/// multiplied or divided by a step while that lowers the error by `MIN_GAIN` at least, and the
/// step shrinks from 2 to 1.001.
/// Deterministic, and a few thousand estimates. Samples with no positive time are skipped.
/// Constants the samples do not depend on (bandwidth when every link is measured) stay as they
/// were.
pub fn fit(samples: &[Sample], start: &LinkModel, segment_bytes: usize) -> LinkModel {
    let samples: Vec<Sample> = samples.iter().filter(|s| s.seconds > 0.0 && s.seconds.is_finite()).copied().collect();
    let err = |m: &LinkModel| log_error(&samples, m, segment_bytes);
    let mut best = start.clone();
    if samples.is_empty() {
        return best;
    }
    let mut best_err = err(&best);
    let mut step = 2.0f64;
    while step > 1.001 {
        let mut improved = true;
        while improved {
            improved = false;
            for (which, &(lo, hi)) in FITTED.iter().zip(FIT_BOUNDS.iter()) {
                for factor in [step, 1.0 / step] {
                    let mut m = best.clone();
                    let v = which(&mut m);
                    *v = (*v * factor).clamp(lo, hi);
                    let e = err(&m);
                    // A move must pay for itself: along a constant the samples hardly depend on
                    // (alpha over slow links), noise would otherwise walk it to a bound.
                    if e < best_err * (1.0 - MIN_GAIN) {
                        (best, best_err, improved) = (m, e, true);
                    }
                }
            }
        }
        step = step.sqrt();
    }
    best
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

    #[test]
    fn a_fit_recovers_the_constants_that_made_the_times() {
        let truth = LinkModel { alpha: 80e-6, bandwidth: 0.7e9, gamma: 1.1e-9, parallelism: 1.6, ..LinkModel::default() };
        let schedules: Vec<Schedule> = ["ring", "rhd", "direct", "oneshot"]
            .iter()
            .filter_map(|a| generate(Collective::AllReduce, a, 4, 0).ok())
            .collect();
        assert!(schedules.len() >= 3);
        let mut samples = Vec::new();
        for s in &schedules {
            for total in [4 << 10, 256 << 10, 4 * MIB, 64 * MIB] {
                let blocks = vec![total / 4; 4];
                let seconds = estimate(s, &blocks, &truth, MIB);
                samples.push((s, blocks, seconds));
            }
        }
        let samples: Vec<Sample> = samples.iter().map(|(s, b, t)| Sample { schedule: *s, block_bytes: b, seconds: *t }).collect();
        let start = LinkModel::default();
        let before = log_error(&samples, &start, MIB);
        let fitted = fit(&samples, &start, MIB);
        let after = log_error(&samples, &fitted, MIB);
        assert!(before > 0.1 && after < 1e-4, "{before} -> {after}");
        for (got, want) in [(fitted.alpha, truth.alpha), (fitted.bandwidth, truth.bandwidth), (fitted.gamma, truth.gamma), (fitted.parallelism, truth.parallelism)] {
            assert!((got / want - 1.0).abs() < 0.05, "{got} against {want}");
        }
        // Nothing to fit to: the model is left as it was.
        assert_eq!(fit(&[], &start, MIB), start);
        // The setting that carries the fit gives the same constants back (to 4 digits).
        let again = Constants::parse(&Constants::text_of(&fitted)).unwrap().apply(LinkModel::default());
        assert!((again.alpha / fitted.alpha - 1.0).abs() < 1e-3 && (again.gamma / fitted.gamma - 1.0).abs() < 1e-3);
    }

    #[test]
    fn cost_constants_are_read_in_words() {
        let c = Constants::parse("alpha=5e-5, gamma=4e-10").unwrap();
        assert_eq!(c, Constants { alpha: Some(5e-5), bandwidth: None, gamma: Some(4e-10), parallelism: None });
        assert_eq!(c.apply(LinkModel::default()).bandwidth, LinkModel::default().bandwidth);
        assert_eq!(Constants::parse("").unwrap(), Constants::default());
        for (bad, said) in [("alpha", "not name=value"), ("beta=1", "not one of"), ("alpha=fast", "not a number"), ("gamma=1", "outside"), ("bandwidth=-1", "outside"), ("alpha=nan", "outside")] {
            let e = Constants::parse(bad).unwrap_err();
            assert!(e.contains(said), "{bad}: {e}");
        }
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
