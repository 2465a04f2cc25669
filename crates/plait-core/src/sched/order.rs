//! The links as measured, and the ring order they call for.
//!
//! A ring-family schedule (the `ring` allreduce, reduce-scatter and allgather, `ring2`) is built
//! over positions 0..n and then [`relabel`]led: position `p` runs on rank `order[p]`. Every
//! step of a ring keeps all n of its edges busy at once, so a step lasts as long as its slowest
//! edge; the order that avoids the slow links is an asymmetric bottleneck travelling-salesman
//! tour over the measured matrix ([`best_ring`]): exact up to [`EXACT_MAX_RANKS`] ranks, local
//! search beyond. Every rank computes it from the same shared matrix, so all pick one order.

use super::{Buf, ChunkRef, LocalOp, Schedule};

/// Up to this many ranks the ring order is found by trying every tour ((n-1)! of them, 40320
/// at 9, a few milliseconds); beyond, by local search from greedy tours.
pub const EXACT_MAX_RANKS: usize = 9;
/// Local search beyond that: greedy tours from this many starts, and at most this many
/// rank-steps of tour evaluation per start (about 10 ms at 64 ranks).
const GREEDY_STARTS: usize = 4;
const SEARCH_BUDGET: usize = 4_000_000;

/// What each directed link costs: one-way latency (seconds) and bandwidth (bytes per second),
/// `[from * n + to]`. Built from the link records every rank shares, so identical on all ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkMatrix {
    pub n: usize,
    latency: Vec<f64>,
    bandwidth: Vec<f64>,
}

impl LinkMatrix {
    /// `latency(i, j)` and `bandwidth(i, j)` for every ordered pair `i != j`; None when one is
    /// missing or not a positive finite number (a link that was not measured).
    pub fn from_fn(n: usize, mut link: impl FnMut(usize, usize) -> Option<(f64, f64)>) -> Option<LinkMatrix> {
        let (mut latency, mut bandwidth) = (vec![0.0; n * n], vec![f64::INFINITY; n * n]);
        for i in 0..n {
            for j in (0..n).filter(|&j| j != i) {
                let (lat, bw) = link(i, j)?;
                if !(lat.is_finite() && lat >= 0.0 && bw.is_finite() && bw > 0.0) {
                    return None;
                }
                latency[i * n + j] = lat;
                bandwidth[i * n + j] = bw;
            }
        }
        Some(LinkMatrix { n, latency, bandwidth })
    }

    pub fn latency(&self, from: usize, to: usize) -> f64 {
        self.latency[from * self.n + to]
    }

    pub fn bandwidth(&self, from: usize, to: usize) -> f64 {
        self.bandwidth[from * self.n + to]
    }

    /// The links among `ranks` (a subgroup: its rank i is rank `ranks[i]` here).
    pub fn sub(&self, ranks: &[usize]) -> LinkMatrix {
        LinkMatrix::from_fn(ranks.len(), |i, j| Some((self.latency(ranks[i], ranks[j]), self.bandwidth(ranks[i], ranks[j]))))
            .expect("measured links stay measured")
    }

    /// Seconds to move `bytes` over `from -> to` on its own.
    pub fn seconds(&self, from: usize, to: usize, bytes: f64) -> f64 {
        self.latency(from, to) + bytes / self.bandwidth(from, to)
    }
}

/// How good a ring is: its slowest edge first (every step waits for it), then the sum of its
/// edges (fewer slow edges), both for one segment of `bytes`.
fn ring_cost(m: &LinkMatrix, order: &[usize], bytes: f64) -> (f64, f64) {
    let n = order.len();
    let (mut worst, mut sum) = (0.0f64, 0.0f64);
    for p in 0..n {
        let t = m.seconds(order[p], order[(p + 1) % n], bytes);
        worst = worst.max(t);
        sum += t;
    }
    (worst, sum)
}

fn better(a: (f64, f64), b: (f64, f64)) -> bool {
    // Within a part in a million counts as equal, so that float noise in a sum cannot make ranks
    // disagree: they compute on identical numbers in the same order anyway.
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * x.abs().max(y.abs());
    if close(a.0, b.0) {
        !close(a.1, b.1) && a.1 < b.1
    } else {
        a.0 < b.0
    }
}

/// The ring order (a permutation starting at rank 0: `order[p]` sends to `order[p + 1]`) whose
/// slowest edge, then whose total, is least for segments of `bytes`. Deterministic: every rank
/// gets the same order from the same matrix; among equal rings the first found (rank order
/// first) wins, so equal links keep the rank order.
pub fn best_ring(m: &LinkMatrix, bytes: f64) -> Vec<usize> {
    let n = m.n;
    let identity: Vec<usize> = (0..n).collect();
    if n <= 3 && (n < 3 || ring_cost(m, &[0, 2, 1], bytes) == ring_cost(m, &identity, bytes)) {
        return identity;
    }
    if n <= EXACT_MAX_RANKS {
        exact(m, bytes)
    } else {
        local_search(m, bytes)
    }
}

/// Every tour starting at 0, in lexicographic order (Heap's algorithm would be faster but not in
/// an order that favours rank order on ties).
fn exact(m: &LinkMatrix, bytes: f64) -> Vec<usize> {
    let n = m.n;
    let mut order: Vec<usize> = (0..n).collect();
    let mut best = (order.clone(), ring_cost(m, &order, bytes));
    loop {
        // next lexicographic permutation of order[1..]
        let tail = &mut order[1..];
        let Some(i) = (0..tail.len().saturating_sub(1)).rev().find(|&i| tail[i] < tail[i + 1]) else { break };
        let j = (i + 1..tail.len()).rev().find(|&j| tail[j] > tail[i]).expect("tail[i+1] > tail[i]");
        tail.swap(i, j);
        tail[i + 1..].reverse();
        let c = ring_cost(m, &order, bytes);
        if better(c, best.1) {
            best = (order.clone(), c);
        }
    }
    best.0
}

/// Greedy tours (nearest next edge from a few starts, rotated to begin at 0) improved by moving
/// runs of 1 to 3 ranks elsewhere in the tour (Or-opt, which keeps each run's direction, as an
/// asymmetric matrix needs), until no move helps or [`SEARCH_BUDGET`] is spent. The rank order
/// is a starting tour too. The budget counts work, not time, so every rank stops at the same tour.
fn local_search(m: &LinkMatrix, bytes: f64) -> Vec<usize> {
    let n = m.n;
    let mut starts: Vec<Vec<usize>> = vec![(0..n).collect()];
    let evaluations_per_start = (SEARCH_BUDGET / n).max(1);
    for first in 0..n.min(GREEDY_STARTS) {
        let mut tour = vec![first];
        let mut used = vec![false; n];
        used[first] = true;
        while tour.len() < n {
            let last = *tour.last().unwrap();
            let next = (0..n)
                .filter(|&j| !used[j])
                .min_by(|&a, &b| m.seconds(last, a, bytes).total_cmp(&m.seconds(last, b, bytes)))
                .unwrap();
            used[next] = true;
            tour.push(next);
        }
        let at = tour.iter().position(|&r| r == 0).unwrap();
        tour.rotate_left(at);
        starts.push(tour);
    }
    let mut best: Option<(Vec<usize>, (f64, f64))> = None;
    for mut tour in starts {
        let mut cost = ring_cost(m, &tour, bytes);
        let mut evaluations = 0usize;
        'improve: loop {
            for len in 1..=3.min(n - 2) {
                for from in 1..=n - len {
                    for to in 1..=n - len {
                        if to == from {
                            continue;
                        }
                        evaluations += 1;
                        if evaluations > evaluations_per_start {
                            break 'improve;
                        }
                        let mut t = tour.clone();
                        let run: Vec<usize> = t.drain(from..from + len).collect();
                        t.splice(to..to, run);
                        let c = ring_cost(m, &t, bytes);
                        if better(c, cost) {
                            (tour, cost) = (t, c);
                            continue 'improve;
                        }
                    }
                }
            }
            break;
        }
        if best.as_ref().is_none_or(|(_, b)| better(cost, *b)) {
            best = Some((tour, cost));
        }
    }
    best.expect("at least the rank order").0
}

/// Parses `PLAIT_RING_ORDER`'s explicit form, `0,2,1,3`: a permutation of 0..n.
pub fn parse_order(text: &str, n: usize) -> Result<Vec<usize>, String> {
    let order: Vec<usize> = text
        .split(',')
        .map(|s| s.trim().parse::<usize>().map_err(|_| format!("'{}' is not a rank", s.trim())))
        .collect::<Result<_, _>>()?;
    let mut seen = vec![false; n];
    if order.len() != n || order.iter().any(|&r| r >= n || std::mem::replace(&mut seen[r], true)) {
        return Err(format!("'{text}' is not an order of the {n} ranks 0..{}, each once", n.saturating_sub(1)));
    }
    Ok(order)
}

/// A tree over the ranks rooted at `root`, as parents (`parent[root] == root`), for data that
/// flows away from the root (broadcast: over links parent -> child) or, with `toward_root`,
/// to it (reduce: child -> parent). Each rank's path to the root is one whose slowest link, for a
/// segment of `bytes`, is least (a widest-path tree, grown like Prim's tree: the rank that can
/// join over the best path joins next); among equal paths, the one with fewer hops, then the
/// lower parent. Equal links give the star from the root; a slow link is used only when no path
/// around it is faster. Deterministic, so every rank builds the same tree from the same matrix.
pub fn widest_tree(m: &LinkMatrix, root: usize, toward_root: bool, bytes: f64) -> Vec<usize> {
    let n = m.n;
    let cost = |parent: usize, child: usize| if toward_root { m.seconds(child, parent, bytes) } else { m.seconds(parent, child, bytes) };
    let mut parent = vec![root; n];
    let mut joined = vec![false; n];
    // Per rank not yet joined: its best path so far (slowest link, hops, parent).
    let mut best: Vec<(f64, usize, usize)> = vec![(f64::INFINITY, usize::MAX, root); n];
    let (mut worst, mut hops) = (vec![0.0f64; n], vec![0usize; n]);
    let mut newest = root;
    joined[root] = true;
    for _ in 1..n {
        for v in (0..n).filter(|&v| !joined[v]) {
            let candidate = (worst[newest].max(cost(newest, v)), hops[newest] + 1, newest);
            if path_better(candidate, best[v]) {
                best[v] = candidate;
            }
        }
        let next = (0..n).filter(|&v| !joined[v]).fold(None, |acc: Option<usize>, v| match acc {
            Some(a) if !path_better(best[v], best[a]) => Some(a),
            _ => Some(v),
        });
        let Some(v) = next else { break };
        (worst[v], hops[v], parent[v]) = best[v];
        joined[v] = true;
        newest = v;
    }
    parent
}

/// Whether path `a` (slowest link, hops, parent) beats `b`: a slower link loses (within a part in
/// a million, as `better`), then more hops, then the higher parent.
fn path_better(a: (f64, usize, usize), b: (f64, usize, usize)) -> bool {
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * x.abs().max(y.abs());
    if !close(a.0, b.0) {
        a.0 < b.0
    } else {
        (a.1, a.2) < (b.1, b.2)
    }
}

/// `s` with position `p` run by rank `order[p]`: programs move, peers and blocks are renamed
/// alike (block `i` of the layout becomes block `order[i]`, so each rank's own block stays its
/// own), and the root is position `s.root`'s rank.
pub fn relabel(s: &Schedule, order: &[usize]) -> Schedule {
    let n = s.nranks;
    assert!(order.len() == n, "relabel: an order of {n} ranks");
    let chunk = |c: ChunkRef| -> ChunkRef {
        match c.buf {
            Buf::Scratch => {
                let (slot, block) = (c.index as usize / n, c.index as usize % n);
                ChunkRef::scratch(slot as u32, n, order[block] as u32)
            }
            // A one-chunk buffer is the rank's own block: it moves with the rank.
            _ => ChunkRef { index: order[c.index as usize] as u32, ..c },
        }
    };
    let single = |buf: Buf, p: usize| match buf {
        Buf::Input => s.collective.input_chunks(n, p, s.root) == 1,
        Buf::Output => s.collective.output_chunks(n, p, s.root) == 1,
        Buf::Scratch => false,
    };
    let mut ranks = vec![Vec::new(); n];
    for (p, prog) in s.ranks.iter().enumerate() {
        let map = |c: ChunkRef| if single(c.buf, p) { c } else { chunk(c) };
        ranks[order[p]] = prog
            .iter()
            .map(|st| {
                let mut st = st.clone();
                for op in &mut st.sends {
                    op.peer = order[op.peer as usize] as u32;
                    op.src = map(op.src);
                }
                for op in &mut st.recvs {
                    op.peer = order[op.peer as usize] as u32;
                    op.dst = map(op.dst);
                    op.reduce_with = op.reduce_with.map(map);
                }
                for op in &mut st.locals {
                    match op {
                        LocalOp::Copy { src, dst } | LocalOp::Reduce { src, dst } => {
                            (*src, *dst) = (map(*src), map(*dst));
                        }
                    }
                }
                st
            })
            .collect();
    }
    let shown: Vec<String> = order.iter().map(|r| r.to_string()).collect();
    let root = if s.collective.rooted() { order[s.root] } else { 0 };
    Schedule { ranks, root, variant: format!("order {}", shown.join(">")), ..s.clone() }
}

/// The ring order turned to start at `root`: a chain from the root along the ring.
pub fn from_root(order: &[usize], root: usize) -> Vec<usize> {
    let mut rotated = order.to_vec();
    if let Some(at) = order.iter().position(|&r| r == root) {
        rotated.rotate_left(at);
    }
    rotated
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::gen::{generate, tree_schedule};
    use crate::sched::verify::verify;
    use crate::sched::Collective;

    const GBIT: f64 = 1e9 / 8.0;

    /// Every link at `fast` except the ones listed (both directions) at their own rate.
    fn matrix(n: usize, fast: f64, slow: &[(usize, usize, f64)]) -> LinkMatrix {
        LinkMatrix::from_fn(n, |i, j| {
            let bw = slow.iter().find(|&&(a, b, _)| (a, b) == (i, j) || (a, b) == (j, i)).map_or(fast, |s| s.2);
            Some((1e-3, bw))
        })
        .unwrap()
    }

    fn edges(order: &[usize]) -> Vec<(usize, usize)> {
        (0..order.len()).map(|p| (order[p], order[(p + 1) % order.len()])).collect()
    }

    #[test]
    fn equal_links_keep_the_rank_order() {
        for n in 1..=12 {
            let m = matrix(n, GBIT, &[]);
            assert_eq!(best_ring(&m, 1e6), (0..n).collect::<Vec<_>>(), "n={n}");
        }
    }

    #[test]
    fn a_slow_link_is_left_out_of_the_ring() {
        for n in [4, 5, 8, 9, 10, 16] {
            for (a, b) in [(1, 2), (0, n - 1), (2, 3)] {
                let m = matrix(n, GBIT, &[(a, b, 0.05 * GBIT)]);
                let order = best_ring(&m, 1e6);
                assert_eq!(order[0], 0);
                let e = edges(&order);
                assert!(!e.contains(&(a, b)) && !e.contains(&(b, a)), "n={n} slow {a}-{b}: {order:?}");
            }
        }
    }

    #[test]
    fn the_ring_follows_the_fast_direction_of_asymmetric_links() {
        // 0->1->2->3->0 fast, every other direction slow: the ring must run that way round.
        let n = 4;
        let m = LinkMatrix::from_fn(n, |i, j| Some((1e-3, if j == (i + 1) % n { GBIT } else { 0.1 * GBIT }))).unwrap();
        assert_eq!(best_ring(&m, 1e6), vec![0, 1, 2, 3]);
        let m = LinkMatrix::from_fn(n, |i, j| Some((1e-3, if i == (j + 1) % n { GBIT } else { 0.1 * GBIT }))).unwrap();
        assert_eq!(best_ring(&m, 1e6), vec![0, 3, 2, 1]);
    }

    #[test]
    fn local_search_finds_the_one_fast_ring_among_slow_links() {
        // A hidden Hamiltonian cycle of fast links in a graph of slow ones, beyond the exact size.
        for n in [10, 13, 20] {
            let hidden: Vec<usize> = (0..n).map(|p| (p * 7 + 3) % n).collect();
            let fast: Vec<(usize, usize)> = edges(&hidden);
            let m = LinkMatrix::from_fn(n, |i, j| {
                Some((1e-4, if fast.contains(&(i, j)) || fast.contains(&(j, i)) { GBIT } else { 0.01 * GBIT }))
            })
            .unwrap();
            let order = best_ring(&m, 1e6);
            let worst = ring_cost(&m, &order, 1e6).0;
            assert!(worst < m.seconds(0, 1, 0.0) + 1e6 / (0.5 * GBIT), "n={n}: {order:?} keeps a slow edge");
        }
    }

    #[test]
    fn relabelled_ring_schedules_stay_correct() {
        for coll in [Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather] {
            for algo in crate::sched::gen::algorithms(coll) {
                for n in 2..=7 {
                    let s = generate(coll, algo, n, 0).unwrap();
                    let order: Vec<usize> = (0..n).map(|p| (n + 1 - p) % n).collect();
                    let r = relabel(&s, &order);
                    verify(&r).unwrap_or_else(|e| panic!("{coll} {algo} n={n} order {order:?}: {e}"));
                    // rank order[p] talks to order[p+1] where position p talked to p+1
                    for (p, prog) in s.ranks.iter().enumerate() {
                        let a: Vec<u32> = prog.iter().flat_map(|st| st.sends.iter().map(|o| order[o.peer as usize] as u32)).collect();
                        let b: Vec<u32> = r.ranks[order[p]].iter().flat_map(|st| st.sends.iter().map(|o| o.peer)).collect();
                        assert_eq!(a, b);
                    }
                }
            }
        }
    }

    #[test]
    fn large_worlds_get_their_order_quickly_and_alike() {
        let n = 96;
        let m = LinkMatrix::from_fn(n, |i, j| Some((1e-4, GBIT * (1.0 + ((i * 31 + j * 17) % 13) as f64 / 13.0)))).unwrap();
        let t0 = std::time::Instant::now();
        let a = best_ring(&m, 1e6);
        assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{:?}", t0.elapsed());
        assert_eq!(a, best_ring(&m, 1e6));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..n).collect::<Vec<_>>());
        assert!(!better(ring_cost(&m, &(0..n).collect::<Vec<_>>(), 1e6), ring_cost(&m, &a, 1e6)), "no worse than rank order");
    }

    #[test]
    fn chains_from_any_root_along_the_ring_stay_correct() {
        for coll in [Collective::Broadcast, Collective::Reduce] {
            for n in 2..=7 {
                let order: Vec<usize> = (0..n).map(|p| (n + 1 - p) % n).collect();
                for root in 0..n {
                    let chain = from_root(&order, root);
                    assert_eq!(chain[0], root);
                    let r = relabel(&generate(coll, "chain", n, 0).unwrap(), &chain);
                    assert_eq!(r.root, root);
                    verify(&r).unwrap_or_else(|e| panic!("{coll} chain n={n} root {root} along {order:?}: {e}"));
                    let first: Vec<u32> = r.ranks[root].iter().flat_map(|st| st.sends.iter().map(|o| o.peer)).collect();
                    if coll == Collective::Broadcast {
                        assert!(first.iter().all(|&p| p as usize == chain[1]), "the root sends to the next on the ring");
                    }
                }
            }
        }
    }

    #[test]
    fn orders_are_parsed_and_refused_in_words() {
        assert_eq!(parse_order("0, 2,1,3", 4).unwrap(), vec![0, 2, 1, 3]);
        assert!(parse_order("0,1,1,3", 4).unwrap_err().contains("each once"));
        assert!(parse_order("0,1,2", 4).unwrap_err().contains("the 4 ranks"));
        assert!(parse_order("0,1,x,3", 4).unwrap_err().contains("'x' is not a rank"));
        assert!(parse_order("0,1,2,4", 4).is_err());
    }

    #[test]
    fn equal_links_give_the_star_from_the_root_both_ways() {
        for n in 1..=9 {
            let m = matrix(n, GBIT, &[]);
            for root in 0..n {
                for toward in [false, true] {
                    assert_eq!(widest_tree(&m, root, toward, 1e6), vec![root; n], "n={n} root={root}");
                }
            }
        }
    }

    #[test]
    fn the_tree_goes_around_slow_links_and_its_schedules_verify() {
        // Rank 0 reaches only rank 1 fast; rank 1 reaches 2 and 3 fast; every other link is slow.
        let slow = [(0, 2, GBIT / 50.0), (0, 3, GBIT / 50.0), (2, 3, GBIT / 50.0)];
        let m = matrix(4, GBIT, &slow);
        assert_eq!(widest_tree(&m, 0, false, 1e6), vec![0, 0, 1, 1]);
        assert_eq!(widest_tree(&m, 0, true, 1e6), vec![0, 0, 1, 1]);
        // From rank 2: its fast link is to 1, and 1's to 0 and 3.
        assert_eq!(widest_tree(&m, 2, false, 1e6), vec![1, 2, 2, 1]);
        // One direction slow only: a broadcast avoids 0 -> 2, a reduce avoids 2 -> 0.
        let one_way = LinkMatrix::from_fn(3, |i, j| Some((1e-3, if (i, j) == (0, 2) { GBIT / 50.0 } else { GBIT }))).unwrap();
        assert_eq!(widest_tree(&one_way, 0, false, 1e6), vec![0, 0, 1]);
        assert_eq!(widest_tree(&one_way, 0, true, 1e6), vec![0, 0, 0]);
        for coll in [Collective::Broadcast, Collective::Reduce] {
            for root in 0..4 {
                let s = tree_schedule(coll, 4, root, &widest_tree(&m, root, coll == Collective::Reduce, 1e6)).unwrap();
                verify(&s).unwrap_or_else(|e| panic!("{coll} root {root}: {e}"));
            }
        }
    }

    #[test]
    fn every_tree_of_small_worlds_gives_a_correct_schedule() {
        // Every parent array of up to 5 ranks that is a tree rooted at `root` (and some that are not).
        for n in 1..=5usize {
            for root in 0..n {
                let total = n.pow(n as u32);
                for code in 0..total {
                    let mut c = code;
                    let parent: Vec<usize> = (0..n).map(|_| { let p = c % n; c /= n; p }).collect();
                    let is_tree = parent[root] == root
                        && (0..n).all(|v| { let (mut u, mut k) = (v, 0); while u != root && k <= n { u = parent[u]; k += 1; } u == root });
                    for coll in [Collective::Broadcast, Collective::Reduce] {
                        match tree_schedule(coll, n, root, &parent) {
                            Ok(s) => {
                                assert!(is_tree, "{parent:?} accepted");
                                verify(&s).unwrap_or_else(|e| panic!("{coll} n={n} root={root} {parent:?}: {e}"));
                            }
                            Err(_) => assert!(!is_tree, "{coll} {parent:?} refused"),
                        }
                    }
                }
            }
        }
        assert!(tree_schedule(Collective::AllReduce, 2, 0, &[0, 0]).is_err());
    }
}
