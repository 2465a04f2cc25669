//! Allreduce generators: ring, direct, oneshot, rhd (recursive halving and doubling) and ring2
//! (bidirectional ring).

use super::{inp, out, Builder};
use crate::sched::ChunkRef;

/// Reduce-scatter ring (rank r ends owning block r+1) then allgather ring: 2(n-1) steps.
pub(super) fn allreduce_ring(b: &mut Builder) {
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
pub(super) fn allreduce_direct(b: &mut Builder) {
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
pub(super) fn allreduce_oneshot(b: &mut Builder) {
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
pub(super) fn allreduce_rhd(b: &mut Builder) {
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
pub(super) fn allreduce_ring2(b: &mut Builder) {
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
