//! Built-in algorithm generators: one function per (collective, algorithm) producing a
//! [`Schedule`] for any world size `n >= 1` and any root. Here: the registry (`algorithms`,
//! `generate`) and the `Builder` they all use; the generators live by collective in
//! `allreduce`, `exchange` (reduce_scatter, allgather, alltoall) and `rooted`.
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
//! | broadcast | binomial / chain / direct / tree | ceil(log2 n) / n-1 / 1 / depth | 0 |
//! | reduce | binomial / chain / direct / tree | ceil(log2 n) / n-1 / 2 / depth + 1 | 1 (non-roots) / 1 / 0 / 1 |
//!
//! `tree` follows a tree given by its parents ([`tree_schedule`]); the selector builds the tree
//! from the measured links (`order::widest_tree`). Without them it is the star from the root,
//! which moves what `direct` does.
//! | gather, scatter | direct | 1 | 0 |
//! | alltoall | pairwise | n-1 | 0 |
//!
//! Reduction order: every algorithm reduces each block once, on one rank, and then copies the
//! result, so all ranks end bit-identical. The order is fixed (run-to-run reproducible) except
//! for `direct` allreduce / reduce_scatter / reduce, which accumulate in arrival order.
//! `oneshot` reduces on every rank, in rank order 0..n-1, which keeps ranks identical.

mod allreduce;
mod exchange;
mod rooted;

use super::{ChunkRef, Collective, LocalOp, RecvOp, Schedule, SendOp, Step};
use crate::error::PlaitError;
use allreduce::{allreduce_direct, allreduce_oneshot, allreduce_rhd, allreduce_ring, allreduce_ring2};
use exchange::{allgather_direct, allgather_ring, alltoall_pairwise, reduce_scatter_direct, reduce_scatter_ring};
use rooted::{
    broadcast_binomial, broadcast_chain, broadcast_direct, broadcast_tree, gather_direct, reduce_binomial, reduce_chain,
    reduce_direct, reduce_tree, scatter_direct,
};

/// Algorithm names per collective; the first is the safe default.
pub fn algorithms(coll: Collective) -> &'static [&'static str] {
    match coll {
        Collective::AllReduce => &["ring", "direct", "oneshot", "rhd", "ring2"],
        Collective::ReduceScatter => &["ring", "direct"],
        Collective::AllGather => &["ring", "direct"],
        Collective::Broadcast => &["binomial", "chain", "direct", "tree"],
        Collective::Reduce => &["binomial", "chain", "direct", "tree"],
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
        (Broadcast, "tree") => broadcast_tree(&mut b, &vec![root; n]),
        (Reduce, "binomial") => reduce_binomial(&mut b),
        (Reduce, "chain") => reduce_chain(&mut b),
        (Reduce, "direct") => reduce_direct(&mut b),
        (Reduce, "tree") => reduce_tree(&mut b, &vec![root; n]),
        (Gather, "direct") => gather_direct(&mut b),
        (Scatter, "direct") => scatter_direct(&mut b),
        (AllToAll, "pairwise") => alltoall_pairwise(&mut b),
        _ => unreachable!("algorithms() and the dispatch table disagree"),
    }
    Ok(b.finish(algo))
}

/// The `tree` schedule of a broadcast or reduce along the tree `parent` (`parent[v]` is rank v's
/// parent, the root's is itself): data flows from parents to children (broadcast) or from
/// children to parents (reduce). Its variant names the tree's edges, so ranks that built
/// different trees fail on the schedule id instead of mixing data.
pub fn tree_schedule(coll: Collective, n: usize, root: usize, parent: &[usize]) -> Result<Schedule, PlaitError> {
    if !matches!(coll, Collective::Broadcast | Collective::Reduce) {
        return Err(unknown_algorithm(coll, "tree"));
    }
    if n == 0 || root >= n || parent.len() != n || parent[root] != root {
        return Err(PlaitError::invalid(format!("{coll} tree: {parent:?} is not a tree of {n} ranks rooted at {root}")));
    }
    for start in 0..n {
        let (mut v, mut hops) = (start, 0);
        while v != root {
            v = *parent.get(v).filter(|&&p| p < n).ok_or_else(|| PlaitError::invalid(format!("{coll} tree: parent of {v} out of range")))?;
            hops += 1;
            if hops > n {
                return Err(PlaitError::invalid(format!("{coll} tree: rank {start} never reaches the root {root} (a cycle)")));
            }
        }
    }
    let mut s = if n == 1 {
        generate(coll, "tree", 1, 0)?
    } else {
        let mut b = Builder::new(coll, n, root);
        match coll {
            Collective::Broadcast => broadcast_tree(&mut b, parent),
            _ => reduce_tree(&mut b, parent),
        }
        b.finish("tree")
    };
    let edges: Vec<String> = (0..n).filter(|&v| v != root).map(|v| format!("{}>{v}", parent[v])).collect();
    s.variant = format!("edges {}", edges.join(","));
    Ok(s)
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
            variant: String::new(),
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
