//! Generators of the rooted collectives: broadcast and reduce (binomial, chain, direct), gather
//! and scatter (direct), with the helpers they share for ranks relative to the root.

use super::{inp, out, Builder};
use crate::sched::ChunkRef;

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

pub(super) fn broadcast_binomial(b: &mut Builder) {
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

pub(super) fn broadcast_chain(b: &mut Builder) {
    root_copy_all(b);
    for v in 0..b.n - 1 {
        let (from, to) = (rel(b, v), rel(b, v + 1));
        broadcast_whole(b, v, from, to);
    }
}

pub(super) fn broadcast_direct(b: &mut Builder) {
    root_copy_all(b);
    for v in 1..b.n {
        let (from, to) = (b.root, rel(b, v));
        broadcast_whole(b, 0, from, to);
    }
}

/// Along a tree (`parent[v]`, the root its own parent): each rank gets the data from its parent
/// in the step after its parent got it, and a rank with several children sends to all of them in
/// one step.
pub(super) fn broadcast_tree(b: &mut Builder, parent: &[usize]) {
    let (n, root) = (b.n, b.root);
    let depth = depths(parent, root);
    root_copy_all(b);
    for v in (0..n).filter(|&v| v != root) {
        broadcast_whole(b, depth[v] - 1, parent[v], v);
    }
}

/// Each rank's distance from the root in the tree `parent` (checked to be one by the caller).
fn depths(parent: &[usize], root: usize) -> Vec<usize> {
    (0..parent.len())
        .map(|mut v| {
            let mut d = 0;
            while v != root {
                v = parent[v];
                d += 1;
            }
            d
        })
        .collect()
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

pub(super) fn reduce_binomial(b: &mut Builder) {
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

pub(super) fn reduce_chain(b: &mut Builder) {
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
pub(super) fn reduce_direct(b: &mut Builder) {
    let n = b.n;
    root_copy_all(b);
    for v in 1..n {
        let from = rel(b, v);
        for j in 0..n {
            b.xfer(1, from, inp(j), b.root, out(j), Some(out(j)));
        }
    }
}

/// Up a tree (`parent[v]`, the root its own parent): step 0 seeds every rank with children (its
/// accumulator from its Input); then the deepest ranks send first, each rank to its parent one
/// step after its children sent to it, and a parent folds its children's partials into its
/// accumulator as they arrive (like `direct`, only the root holds the result).
pub(super) fn reduce_tree(b: &mut Builder, parent: &[usize]) {
    let (n, root) = (b.n, b.root);
    let depth = depths(parent, root);
    let deepest = depth.iter().copied().max().unwrap_or(0);
    let has_children: Vec<bool> = (0..n).map(|u| (0..n).any(|v| v != root && parent[v] == u)).collect();
    for u in (0..n).filter(|&u| has_children[u] || u == root) {
        for j in 0..n {
            let acc = reduce_acc(b, u, j);
            b.copy(0, u, inp(j), acc);
        }
    }
    for v in (0..n).filter(|&v| v != root) {
        let (to, step) = (parent[v], 1 + deepest - depth[v]);
        for j in 0..n {
            let src = if has_children[v] { reduce_acc(b, v, j) } else { inp(j) };
            let acc = reduce_acc(b, to, j);
            b.xfer(step, v, src, to, acc, Some(acc));
        }
    }
}

// ---------------------------------------------------------------- gather / scatter

pub(super) fn gather_direct(b: &mut Builder) {
    b.copy(0, b.root, inp(0), out(b.root));
    for v in 1..b.n {
        let from = rel(b, v);
        b.xfer(0, from, inp(0), b.root, out(from), None);
    }
}

pub(super) fn scatter_direct(b: &mut Builder) {
    b.copy(0, b.root, inp(b.root), out(0));
    for v in 1..b.n {
        let to = rel(b, v);
        b.xfer(0, b.root, inp(to), to, out(0), None);
    }
}
