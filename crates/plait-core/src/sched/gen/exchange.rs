//! Generators of the other unrooted collectives, where every rank exchanges blocks with every
//! other: reduce_scatter (ring, direct), allgather (ring, direct) and alltoall (pairwise).

use super::{inp, out, Builder};

// ---------------------------------------------------------------- reduce_scatter

/// Ring arranged so rank r finishes with block r: at step s it sends block r-s-1. Partials live
/// in Scratch slot 0 because the Output holds only the final block.
pub(super) fn reduce_scatter_ring(b: &mut Builder) {
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
pub(super) fn reduce_scatter_direct(b: &mut Builder) {
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

pub(super) fn allgather_ring(b: &mut Builder) {
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

pub(super) fn allgather_direct(b: &mut Builder) {
    let n = b.n;
    for r in 0..n {
        b.copy(0, r, inp(0), out(r));
        for q in (0..n).filter(|&q| q != r) {
            b.xfer(0, r, inp(0), q, out(r), None);
        }
    }
}

// ---------------------------------------------------------------- alltoall

/// Step k-1 (k = 1..n): send to r+k, receive from r-k; every pair exchanges exactly once.
pub(super) fn alltoall_pairwise(b: &mut Builder) {
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
