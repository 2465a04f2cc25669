//! Where each chunk of a schedule lives in memory for one call, and how chunks split into
//! pipeline segments.

use crate::error::{PlaitError, Result};
use crate::sched::{Buf, ChunkRef, Collective};

/// Element counts of one call, as the caller gave them.
#[derive(Clone, Debug)]
pub struct Counts {
    /// Block sizes (elements) of the input's n chunks (alltoall: send splits).
    pub input: Vec<usize>,
    /// Block sizes of the output's n chunks (alltoall: receive splits).
    pub output: Vec<usize>,
    /// Block sizes scratch slots are made of.
    pub scratch: Vec<usize>,
}

#[derive(Clone, Debug)]
pub struct Layout {
    pub coll: Collective,
    pub n: usize,
    pub rank: usize,
    pub root: usize,
    pub esize: usize,
    pub counts: Counts,
    in_off: Vec<usize>,
    out_off: Vec<usize>,
    scratch_off: Vec<usize>,
    pub scratch_slot_bytes: usize,
    pub seg_bytes: usize,
}

fn prefix(v: &[usize]) -> Vec<usize> {
    let mut acc = 0;
    let mut out = Vec::with_capacity(v.len() + 1);
    for x in v {
        out.push(acc);
        acc += x;
    }
    out.push(acc);
    out
}

pub fn even_split(count: usize, n: usize) -> Vec<usize> {
    (0..n).map(|i| (i + 1) * count / n - i * count / n).collect()
}

impl Layout {
    pub fn new(coll: Collective, n: usize, rank: usize, root: usize, esize: usize, counts: Counts, seg_bytes: usize) -> Layout {
        let in_off = prefix(&counts.input);
        let out_off = prefix(&counts.output);
        let scratch_off = prefix(&counts.scratch);
        let scratch_slot_bytes = scratch_off[n] * esize;
        Layout { coll, n, rank, root, esize, counts, in_off, out_off, scratch_off, scratch_slot_bytes, seg_bytes: seg_bytes.max(esize) }
    }

    /// (byte offset in its buffer, elements) of a chunk on this rank.
    pub fn chunk(&self, c: ChunkRef) -> Result<(usize, usize)> {
        let (n, rank, root) = (self.n, self.rank, self.root);
        let bad = || PlaitError::invalid(format!("schedule refers to {:?} chunk {} which this rank does not have", c.buf, c.index));
        let i = c.index as usize;
        let (off, elems) = match c.buf {
            Buf::Input => match self.coll.input_chunks(n, rank, root) {
                1 if i == 0 => (0, self.counts.input[rank]),
                k if k == n && i < n => (self.in_off[i], self.counts.input[i]),
                _ => return Err(bad()),
            },
            Buf::Output => match self.coll.output_chunks(n, rank, root) {
                1 if i == 0 => (0, self.counts.output[rank]),
                k if k == n && i < n => (self.out_off[i], self.counts.output[i]),
                _ => return Err(bad()),
            },
            Buf::Scratch => {
                let (slot, block) = (i / n, i % n);
                (slot * self.scratch_off[n] + self.scratch_off[block], self.counts.scratch[block])
            }
        };
        Ok((off * self.esize, elems))
    }

    /// Segments a chunk of `elems` elements is cut into (at least one, so that zero-length
    /// chunks still send one empty message and both sides agree).
    pub fn nseg(&self, elems: usize) -> usize {
        (elems * self.esize).div_ceil(self.seg_bytes).max(1)
    }

    /// Element range of segment `s` of a chunk.
    pub fn seg(&self, elems: usize, s: usize) -> (usize, usize) {
        let k = self.nseg(elems);
        (s * elems / k, (s + 1) * elems / k)
    }

    pub fn max_nseg(&self) -> usize {
        let all = self.counts.input.iter().chain(&self.counts.output).chain(&self.counts.scratch);
        all.map(|&e| self.nseg(e)).max().unwrap_or(1)
    }
}

/// Builds the block counts for a call from buffer sizes and optional split lists, checking
/// every size before anything is sent.
#[allow(clippy::too_many_arguments)]
pub fn counts_for(
    coll: Collective,
    n: usize,
    rank: usize,
    root: usize,
    in_elems: usize,
    out_elems: usize,
    send_counts: Option<&[usize]>,
    recv_counts: Option<&[usize]>,
) -> Result<Counts> {
    let name = coll.name();
    let check_len = |what: &str, v: &[usize]| -> Result<()> {
        if v.len() != n {
            return Err(PlaitError::invalid(format!("{name}: {what} has {} entries, the world has {n} ranks", v.len())));
        }
        Ok(())
    };
    let equal = |total: usize, what: &str| -> Result<Vec<usize>> {
        if total % n != 0 {
            return Err(PlaitError::invalid(format!(
                "{name}: {what} of {total} elements does not divide into {n} equal blocks; pass counts"
            )));
        }
        Ok(vec![total / n; n])
    };
    let expect = |what: &str, have: usize, want: usize| -> Result<()> {
        if have != want {
            return Err(PlaitError::invalid(format!("{name}: {what} holds {have} elements, expected {want}")));
        }
        Ok(())
    };
    // The caller's split, or an equal one of `total` elements.
    let given_or_equal = |given: Option<&[usize]>, what: &str, total: usize, of: &str| -> Result<Vec<usize>> {
        match given {
            Some(c) => {
                check_len(what, c)?;
                Ok(c.to_vec())
            }
            None => equal(total, of),
        }
    };
    let same = |v: Vec<usize>| Counts { input: v.clone(), output: v.clone(), scratch: v };
    Ok(match coll {
        Collective::AllReduce => {
            expect("output", out_elems, in_elems)?;
            same(even_split(in_elems, n))
        }
        Collective::Reduce => {
            if rank == root {
                expect("output at the root", out_elems, in_elems)?;
            }
            same(even_split(in_elems, n))
        }
        Collective::Broadcast => {
            if rank == root {
                expect("input at the root", in_elems, out_elems)?;
            }
            same(even_split(out_elems, n))
        }
        Collective::AllGather => {
            let c = given_or_equal(recv_counts, "counts", out_elems, "output")?;
            expect("input", in_elems, c[rank])?;
            expect("output", out_elems, c.iter().sum())?;
            same(c)
        }
        Collective::ReduceScatter => {
            let c = given_or_equal(recv_counts, "counts", in_elems, "input")?;
            expect("input", in_elems, c.iter().sum())?;
            expect("output", out_elems, c[rank])?;
            same(c)
        }
        Collective::Gather => {
            let c = if rank == root {
                let c = given_or_equal(recv_counts, "counts", out_elems, "output at the root")?;
                expect("output at the root", out_elems, c.iter().sum())?;
                c
            } else {
                let mut c = vec![0; n];
                c[rank] = in_elems;
                c
            };
            expect("input", in_elems, c[rank])?;
            same(c)
        }
        Collective::Scatter => {
            let c = if rank == root {
                let c = given_or_equal(send_counts, "counts", in_elems, "input at the root")?;
                expect("input at the root", in_elems, c.iter().sum())?;
                c
            } else {
                let mut c = vec![0; n];
                c[rank] = out_elems;
                c
            };
            expect("output", out_elems, c[rank])?;
            same(c)
        }
        Collective::AllToAll => {
            let s = given_or_equal(send_counts, "send counts", in_elems, "input")?;
            let r = given_or_equal(recv_counts, "receive counts", out_elems, "output")?;
            expect("input", in_elems, s.iter().sum())?;
            expect("output", out_elems, r.iter().sum())?;
            Counts { input: s, output: r.clone(), scratch: r }
        }
    })
}
