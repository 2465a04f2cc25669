//! Built-in algorithm generators: one function per (collective, algorithm) producing a
//! [`Schedule`] for any world size `n >= 1` and any root.
//!
//! Conventions shared by all generators:
//! * Partials are combined on receipt with `RecvOp.reduce_with`, so the first contribution a rank
//!   receives for a block is folded straight into the Output (or Scratch) from its Input: no
//!   separate Input -> Output copy is needed for ring-like algorithms.
//! * Where a copy *is* needed (own block into the Output, or an accumulator seeded before
//!   concurrent accumulating receives), it is a `LocalOp::Copy`; in place the executor skips it.
//! * `n == 1` is a single local Input -> Output copy for every algorithm.
//! * Non-rooted collectives ignore `root` (the schedule records 0).
//!
//! | collective | algorithm | steps (n ranks, p = 2^floor(log2 n)) | scratch slots |
//! |---|---|---|---|
//! | allreduce | ring | 2(n-1) | 0 |
//! | allreduce | direct | 3 (step 0: local seed copy) | 0 |
//! | allreduce | oneshot | 1 | n-1 |
//! | allreduce | rhd | 2 log2 p, + 2 if n != p | 0 |
//! | allreduce | ring2 | 2 ceil((n-1)/2) | 1 if n odd, else 0 |
//! | reduce_scatter | ring | n-1 | 1 (n > 2) |
//! | reduce_scatter | direct | 2 (step 0: local seed copy) | 0 |
//! | allgather | ring / direct | n-1 / 1 | 0 |
//! | broadcast | binomial / chain / direct | ceil(log2 n) / n-1 / 1 | 0 |
//! | reduce | binomial / chain / direct | ceil(log2 n) / n-1 / 2 | 1 (non-roots) / 1 / 0 |
//! | gather, scatter | direct | 1 | 0 |
//! | alltoall | pairwise | n-1 | 0 |
//!
//! Reduction order: every algorithm reduces each block once, on one rank, and then copies the
//! result, so all ranks end bit-identical. The order is fixed (run-to-run reproducible) except
//! for `direct` allreduce / reduce_scatter / reduce, which accumulate in arrival order.
//! `oneshot` reduces on every rank, in rank order 0..n-1, which keeps ranks identical.

use super::{ChunkRef, Collective, LocalOp, RecvOp, Schedule, SendOp, Step};
use crate::error::PlaitError;

/// Algorithm names per collective; the first is the safe default.
pub fn algorithms(coll: Collective) -> &'static [&'static str] {
    match coll {
        Collective::AllReduce => &["ring", "direct", "oneshot", "rhd", "ring2"],
        Collective::ReduceScatter => &["ring", "direct"],
        Collective::AllGather => &["ring", "direct"],
        Collective::Broadcast => &["binomial", "chain", "direct"],
        Collective::Reduce => &["binomial", "chain", "direct"],
        Collective::Gather => &["direct"],
        Collective::Scatter => &["direct"],
        Collective::AllToAll => &["pairwise"],
    }
}

/// Error for an algorithm name `coll` does not have.
pub fn unknown_algorithm(coll: Collective, algo: &str) -> PlaitError {
    PlaitError::Config(format!(
        "unknown {coll} algorithm '{algo}' (valid: {})",
        algorithms(coll).join(", ")
    ))
}

pub fn generate(
    coll: Collective,
    algo: &str,
    n: usize,
    root: usize,
) -> Result<Schedule, PlaitError> {
    if !algorithms(coll).contains(&algo) {
        return Err(unknown_algorithm(coll, algo));
    }
    if n == 0 {
        return Err(PlaitError::invalid(format!("{coll}: world size must be at least 1")));
    }
    let root = if coll.rooted() { root } else { 0 };
    if root >= n {
        return Err(PlaitError::invalid(format!("{coll}: root {root} out of range for {n} ranks")));
    }
    let mut b = Builder::new(coll, n, root);
    if n == 1 {
        b.copy(0, 0, inp(0), out(0));
        return Ok(b.finish(algo));
    }
    use Collective::*;
    match (coll, algo) {
        (AllReduce, "ring") => allreduce_ring(&mut b),
        (AllReduce, "direct") => allreduce_direct(&mut b),
        (AllReduce, "oneshot") => allreduce_oneshot(&mut b),
        (AllReduce, "rhd") => allreduce_rhd(&mut b),
        (AllReduce, "ring2") => allreduce_ring2(&mut b),
        (ReduceScatter, "ring") => reduce_scatter_ring(&mut b),
        (ReduceScatter, "direct") => reduce_scatter_direct(&mut b),
        (AllGather, "ring") => allgather_ring(&mut b),
        (AllGather, "direct") => allgather_direct(&mut b),
        (Broadcast, "binomial") => broadcast_binomial(&mut b),
        (Broadcast, "chain") => broadcast_chain(&mut b),
        (Broadcast, "direct") => broadcast_direct(&mut b),
        (Reduce, "binomial") => reduce_binomial(&mut b),
        (Reduce, "chain") => reduce_chain(&mut b),
        (Reduce, "direct") => reduce_direct(&mut b),
        (Gather, "direct") => gather_direct(&mut b),
        (Scatter, "direct") => scatter_direct(&mut b),
        (AllToAll, "pairwise") => alltoall_pairwise(&mut b),
        _ => unreachable!("algorithms() and the dispatch table disagree"),
    }
    Ok(b.finish(algo))
}

fn inp(i: usize) -> ChunkRef {
    ChunkRef::input(i as u32)
}
fn out(i: usize) -> ChunkRef {
    ChunkRef::output(i as u32)
}

/// Builds all ranks' programs at once, so every send is created together with its matching
/// receive (same step, same per-pair order) and matching cannot go wrong by construction.
struct Builder {
    coll: Collective,
    n: usize,
    root: usize,
    scratch_slots: usize,
    ranks: Vec<Vec<Step>>,
}

impl Builder {
    fn new(coll: Collective, n: usize, root: usize) -> Self {
        Builder { coll, n, root, scratch_slots: 0, ranks: vec![Vec::new(); n] }
    }

    /// `r + off` on the ring of `n` ranks.
    fn at(&self, r: usize, off: isize) -> usize {
        (r as isize + off).rem_euclid(self.n as isize) as usize
    }

    fn scr(&mut self, slot: usize, block: usize) -> ChunkRef {
        self.scratch_slots = self.scratch_slots.max(slot + 1);
        ChunkRef::scratch(slot as u32, self.n, block as u32)
    }

    fn step(&mut self, r: usize, k: usize) -> &mut Step {
        let prog = &mut self.ranks[r];
        if prog.len() <= k {
            prog.resize_with(k + 1, Step::default);
        }
        &mut prog[k]
    }

    fn xfer(
        &mut self,
        k: usize,
        from: usize,
        src: ChunkRef,
        to: usize,
        dst: ChunkRef,
        reduce_with: Option<ChunkRef>,
    ) {
        self.step(from, k).sends.push(SendOp { peer: to as u32, src });
        self.step(to, k).recvs.push(RecvOp { peer: from as u32, dst, reduce_with });
    }

    fn copy(&mut self, k: usize, r: usize, src: ChunkRef, dst: ChunkRef) {
        self.step(r, k).locals.push(LocalOp::Copy { src, dst });
    }

    fn reduce(&mut self, k: usize, r: usize, src: ChunkRef, dst: ChunkRef) {
        self.step(r, k).locals.push(LocalOp::Reduce { src, dst });
    }

    fn finish(mut self, name: &str) -> Schedule {
        let steps = self.ranks.iter().map(Vec::len).max().unwrap_or(0);
        for prog in &mut self.ranks {
            prog.resize_with(steps, Step::default);
        }
        Schedule {
            name: name.to_string(),
            collective: self.coll,
            nranks: self.n,
            root: self.root,
            scratch_slots: self.scratch_slots,
            ranks: self.ranks,
        }
    }
}

// ---------------------------------------------------------------- allreduce

/// Reduce-scatter ring (rank r ends owning block r+1) then allgather ring: 2(n-1) steps.
fn allreduce_ring(b: &mut Builder) {
    let n = b.n;
    for s in 0..n - 1 {
        for r in 0..n {
            let (c, next) = (b.at(r, -(s as isize)), b.at(r, 1));
            let src = if s == 0 { inp(c) } else { out(c) };
            // `next` receives block c and folds it into its own contribution.
            b.xfer(s, r, src, next, out(c), Some(inp(c)));
        }
    }
    let base = n - 1;
    for t in 0..n - 1 {
        for r in 0..n {
            let c = b.at(r, 1 - t as isize);
            let next = b.at(r, 1);
            b.xfer(base + t, r, out(c), next, out(c), None);
        }
    }
}

/// Every rank sends block j to rank j, which accumulates; then every owner sends its block to
/// all. The accumulator must hold the owner's contribution before the concurrent accumulating
/// receives, hence the copy in a locals-only step 0.
fn allreduce_direct(b: &mut Builder) {
    let n = b.n;
    for r in 0..n {
        b.copy(0, r, inp(r), out(r));
    }
    for r in 0..n {
        for q in (0..n).filter(|&q| q != r) {
            b.xfer(1, r, inp(q), q, out(q), Some(out(q)));
        }
    }
    for r in 0..n {
        for q in (0..n).filter(|&q| q != r) {
            b.xfer(2, r, out(r), q, out(r), None);
        }
    }
}

/// Everyone sends everything to everyone in one step; each rank then reduces all n
/// contributions locally in rank order 0..n-1, so every rank performs the identical sequence of
/// operations on identical values and the results are bit-identical.
///
/// Scratch slots hold the n-1 received contributions (peer q in slot q, or q-1 above us). Rank 0
/// accumulates straight into its Output; other ranks accumulate in the slot holding rank 0's
/// contribution and copy out at the end, because in place their Output *is* their own
/// contribution, which is needed at position r of the chain.
fn allreduce_oneshot(b: &mut Builder) {
    let n = b.n;
    let slot = |r: usize, q: usize| if q < r { q } else { q - 1 };
    for r in 0..n {
        for q in (0..n).filter(|&q| q != r) {
            for j in 0..n {
                let dst = b.scr(slot(q, r), j);
                b.xfer(0, r, inp(j), q, dst, None);
            }
        }
    }
    for r in 0..n {
        for j in 0..n {
            let acc = if r == 0 {
                b.copy(0, r, inp(j), out(j));
                out(j)
            } else {
                b.scr(slot(r, 0), j)
            };
            for q in 1..n {
                let src = if q == r { inp(j) } else { b.scr(slot(r, q), j) };
                b.reduce(0, r, src, acc);
            }
            if r != 0 {
                b.copy(0, r, acc, out(j));
            }
        }
    }
}

/// Recursive halving (reduce-scatter) then recursive doubling (allgather) among the largest
/// power of two p <= n ranks. The n - p extra ranks r >= p first fold their buffer into rank
/// r - p and get the finished result back from it at the end.
fn allreduce_rhd(b: &mut Builder) {
    let n = b.n;
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let levels = p.trailing_zeros() as usize;
    // cur[r][j]: where rank r's running partial of block j lives.
    let mut cur: Vec<Vec<ChunkRef>> = (0..n).map(|_| (0..n).map(inp).collect()).collect();
    let mut k = 0;
    if n > p {
        for e in p..n {
            for j in 0..n {
                b.xfer(k, e, inp(j), e - p, out(j), Some(inp(j)));
            }
            cur[e - p] = (0..n).map(out).collect();
        }
        k += 1;
    }
    // Blocks rank r is responsible for after `level` halvings; partners agree on it.
    let range = |r: usize, level: usize| {
        let (mut lo, mut hi) = (0, n);
        for l in 0..level {
            let mid = lo + (hi - lo) / 2;
            if r & (p >> (l + 1)) == 0 {
                hi = mid
            } else {
                lo = mid
            }
        }
        lo..hi
    };
    for level in 0..levels {
        let mask = p >> (level + 1);
        for r in 0..p {
            let partner = r ^ mask;
            // What r gives away is exactly the partner's half at the next level.
            for j in range(partner, level + 1) {
                b.xfer(k, r, cur[r][j], partner, out(j), Some(cur[partner][j]));
            }
        }
        for (r, partials) in cur.iter_mut().enumerate().take(p) {
            for j in range(r, level + 1) {
                partials[j] = out(j);
            }
        }
        k += 1;
    }
    for level in (0..levels).rev() {
        let mask = p >> (level + 1);
        for r in 0..p {
            for j in range(r, level + 1) {
                b.xfer(k, r, out(j), r ^ mask, out(j), None);
            }
        }
        k += 1;
    }
    if n > p {
        for e in p..n {
            for j in 0..n {
                b.xfer(k, e - p, out(j), e, out(j), None);
            }
        }
    }
}

/// Bidirectional ring: each block's partial sums travel to its owner along both arcs at once
/// (a = floor((n-1)/2) hops clockwise, b = ceil((n-1)/2) counter-clockwise), and the allgather
/// likewise spreads each block both ways. Each step a rank sends one block to each neighbour,
/// so the total bytes equal the ring's, but in about half the steps and over both links.
/// When a == b the two arcs reach the owner in the same step; the second arrival goes to a
/// Scratch block (two receives may not combine into one chunk unless both accumulate) and is
/// folded in locally.
fn allreduce_ring2(b: &mut Builder) {
    let n = b.n;
    let a = (n - 1) / 2;
    let bb = n - 1 - a;
    let ai = a as isize;
    let bi = bb as isize;
    for s in 0..bb {
        let si = s as isize;
        for r in 0..n {
            if s < a {
                let c = b.at(r, ai - si);
                let src = if s == 0 { inp(c) } else { out(c) };
                // The clockwise arc reaches the owner first or together with the other one, so
                // even its last hop seeds the owner's output from the owner's input.
                let to = b.at(r, 1);
                b.xfer(s, r, src, to, out(c), Some(inp(c)));
            }
            let c = b.at(r, -bi + si);
            let src = if s == 0 { inp(c) } else { out(c) };
            let to = b.at(r, -1);
            if c != to || a == 0 {
                // Not the owner, or the owner has no clockwise arc (n = 2): first arrival.
                b.xfer(s, r, src, to, out(c), Some(inp(c)));
            } else if a < bb {
                // The clockwise arc arrived one step earlier.
                b.xfer(s, r, src, to, out(c), Some(out(c)));
            } else {
                let tmp = b.scr(0, c);
                b.xfer(s, r, src, to, tmp, None);
                b.reduce(s, to, tmp, out(c));
            }
        }
    }
    for t in 0..bb {
        let ti = t as isize;
        for r in 0..n {
            if t < a {
                let c = b.at(r, -ti);
                let to = b.at(r, 1);
                b.xfer(bb + t, r, out(c), to, out(c), None);
            }
            let c = b.at(r, ti);
            let to = b.at(r, -1);
            b.xfer(bb + t, r, out(c), to, out(c), None);
        }
    }
}

// ---------------------------------------------------------------- reduce_scatter

/// Ring arranged so rank r finishes with block r: at step s it sends block r-s-1. Partials live
/// in Scratch slot 0 because the Output holds only the final block.
fn reduce_scatter_ring(b: &mut Builder) {
    let n = b.n;
    for s in 0..n - 1 {
        let si = s as isize;
        for r in 0..n {
            let c = b.at(r, -si - 1);
            let src = if s == 0 { inp(c) } else { b.scr(0, c) };
            let to = b.at(r, 1);
            let dst = if c == to { out(0) } else { b.scr(0, c) };
            b.xfer(s, r, src, to, dst, Some(inp(c)));
        }
    }
}

/// Every rank sends block j to rank j, which accumulates into its Output (seeded in step 0).
fn reduce_scatter_direct(b: &mut Builder) {
    let n = b.n;
    for r in 0..n {
        b.copy(0, r, inp(r), out(0));
    }
    for r in 0..n {
        for q in (0..n).filter(|&q| q != r) {
            b.xfer(1, r, inp(q), q, out(0), Some(out(0)));
        }
    }
}

// ---------------------------------------------------------------- allgather

fn allgather_ring(b: &mut Builder) {
    let n = b.n;
    for r in 0..n {
        b.copy(0, r, inp(0), out(r));
    }
    for s in 0..n - 1 {
        let si = s as isize;
        for r in 0..n {
            let c = b.at(r, -si);
            let src = if s == 0 { inp(0) } else { out(c) };
            let to = b.at(r, 1);
            b.xfer(s, r, src, to, out(c), None);
        }
    }
}

fn allgather_direct(b: &mut Builder) {
    let n = b.n;
    for r in 0..n {
        b.copy(0, r, inp(0), out(r));
        for q in (0..n).filter(|&q| q != r) {
            b.xfer(0, r, inp(0), q, out(r), None);
        }
    }
}

// ---------------------------------------------------------------- broadcast

/// Rank with relative index `v` (0 = root).
fn rel(b: &Builder, v: usize) -> usize {
    (v + b.root) % b.n
}

/// The root sends from its Input (always valid, never written); others forward their Output.
fn bcast_src(b: &Builder, r: usize, j: usize) -> ChunkRef {
    if r == b.root {
        inp(j)
    } else {
        out(j)
    }
}

fn broadcast_whole(b: &mut Builder, k: usize, from: usize, to: usize) {
    for j in 0..b.n {
        let src = bcast_src(b, from, j);
        b.xfer(k, from, src, to, out(j), None);
    }
}

fn root_copy_all(b: &mut Builder) {
    for j in 0..b.n {
        b.copy(0, b.root, inp(j), out(j));
    }
}

fn broadcast_binomial(b: &mut Builder) {
    let n = b.n;
    root_copy_all(b);
    let mut k = 0;
    while (1 << k) < n {
        for v in 0..(1usize << k) {
            if v + (1 << k) < n {
                let (from, to) = (rel(b, v), rel(b, v + (1 << k)));
                broadcast_whole(b, k, from, to);
            }
        }
        k += 1;
    }
}

fn broadcast_chain(b: &mut Builder) {
    root_copy_all(b);
    for v in 0..b.n - 1 {
        let (from, to) = (rel(b, v), rel(b, v + 1));
        broadcast_whole(b, v, from, to);
    }
}

fn broadcast_direct(b: &mut Builder) {
    root_copy_all(b);
    for v in 1..b.n {
        let (from, to) = (b.root, rel(b, v));
        broadcast_whole(b, 0, from, to);
    }
}

// ---------------------------------------------------------------- reduce

/// Where rank r accumulates partials: the root's Output, or Scratch slot 0 elsewhere (non-roots
/// have no Output).
fn reduce_acc(b: &mut Builder, r: usize, j: usize) -> ChunkRef {
    if r == b.root {
        out(j)
    } else {
        b.scr(0, j)
    }
}

fn reduce_binomial(b: &mut Builder) {
    let n = b.n;
    // Whether a rank's partial is in its accumulator yet (else it is still its Input).
    let mut accumulated = vec![false; n];
    let mut k = 0;
    while (1 << k) < n {
        let mask = 1usize << k;
        for v in (mask..n).step_by(2 * mask) {
            let (from, to) = (rel(b, v), rel(b, v - mask));
            for j in 0..n {
                let src = if accumulated[from] { reduce_acc(b, from, j) } else { inp(j) };
                let base = if accumulated[to] { reduce_acc(b, to, j) } else { inp(j) };
                let acc = reduce_acc(b, to, j);
                b.xfer(k, from, src, to, acc, Some(base));
            }
            accumulated[to] = true;
        }
        k += 1;
    }
}

fn reduce_chain(b: &mut Builder) {
    let n = b.n;
    for s in 0..n - 1 {
        let v = n - 1 - s;
        let (from, to) = (rel(b, v), rel(b, v - 1));
        for j in 0..n {
            let src = if s == 0 { inp(j) } else { reduce_acc(b, from, j) };
            let acc = reduce_acc(b, to, j);
            b.xfer(s, from, src, to, acc, Some(inp(j)));
        }
    }
}

/// All ranks send to the root, which accumulates as messages arrive (order not fixed from run
/// to run; only the root holds the result, so ranks cannot disagree). Accumulating avoids the
/// n-buffer scratch a rank-ordered reduction would need at the root.
fn reduce_direct(b: &mut Builder) {
    let n = b.n;
    root_copy_all(b);
    for v in 1..n {
        let from = rel(b, v);
        for j in 0..n {
            b.xfer(1, from, inp(j), b.root, out(j), Some(out(j)));
        }
    }
}

// ---------------------------------------------------------------- gather / scatter / alltoall

fn gather_direct(b: &mut Builder) {
    b.copy(0, b.root, inp(0), out(b.root));
    for v in 1..b.n {
        let from = rel(b, v);
        b.xfer(0, from, inp(0), b.root, out(from), None);
    }
}

fn scatter_direct(b: &mut Builder) {
    b.copy(0, b.root, inp(b.root), out(0));
    for v in 1..b.n {
        let to = rel(b, v);
        b.xfer(0, b.root, inp(to), to, out(0), None);
    }
}

/// Step k-1 (k = 1..n): send to r+k, receive from r-k; every pair exchanges exactly once.
fn alltoall_pairwise(b: &mut Builder) {
    let n = b.n;
    for r in 0..n {
        b.copy(0, r, inp(r), out(r));
    }
    for k in 1..n {
        for r in 0..n {
            let to = (r + k) % n;
            b.xfer(k - 1, r, inp(to), to, out(r), None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::verify::verify;

    fn roots(n: usize) -> Vec<usize> {
        let mut r = vec![0, n - 1, n / 2];
        r.sort();
        r.dedup();
        r
    }

    #[test]
    fn every_generator_verifies() {
        for coll in Collective::ALL {
            for &algo in algorithms(coll) {
                for n in 1..=16 {
                    let rs = if coll.rooted() { roots(n) } else { vec![0] };
                    for root in rs {
                        let s = generate(coll, algo, n, root).unwrap();
                        assert_eq!((s.collective, s.nranks, s.root), (coll, n, root));
                        if let Err(e) = verify(&s) {
                            panic!("{coll} {algo} n={n} root={root}: {e}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn step_counts() {
        let steps = |coll, algo, n| generate(coll, algo, n, 0).unwrap().nsteps();
        for n in 2..=16usize {
            let p = 1 << (usize::BITS - 1 - n.leading_zeros());
            let fold = if n > p { 2 } else { 0 };
            assert_eq!(steps(Collective::AllReduce, "ring", n), 2 * (n - 1));
            assert_eq!(steps(Collective::AllReduce, "ring2", n), 2 * (n / 2));
            assert_eq!(
                steps(Collective::AllReduce, "rhd", n),
                2 * p.trailing_zeros() as usize + fold
            );
            assert_eq!(steps(Collective::AllReduce, "oneshot", n), 1);
            assert_eq!(
                steps(Collective::Broadcast, "binomial", n),
                n.next_power_of_two().trailing_zeros() as usize
            );
            assert_eq!(steps(Collective::AllToAll, "pairwise", n), n - 1);
        }
    }

    #[test]
    fn non_rooted_ignore_root_and_bad_args_fail() {
        assert_eq!(generate(Collective::AllReduce, "ring", 4, 3).unwrap().root, 0);
        assert!(generate(Collective::Broadcast, "chain", 4, 4).is_err());
        assert!(generate(Collective::Broadcast, "chain", 0, 0).is_err());
        let e = generate(Collective::AllGather, "rhd", 4, 0).unwrap_err();
        assert!(matches!(e, PlaitError::Config(_)));
        let msg = e.to_string();
        assert!(
            msg.contains("allgather") && msg.contains("'rhd'") && msg.contains("ring, direct"),
            "{msg}"
        );
    }
}
