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

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(buf: Buf, index: u32) -> ChunkRef {
        ChunkRef { buf, index }
    }

    #[test]
    fn uneven_allgather_blocks_sit_back_to_back_and_this_ranks_input_is_one_chunk() {
        let counts = counts_for(Collective::AllGather, 3, 1, 0, 5, 2 + 5 + 4, None, Some(&[2, 5, 4])).unwrap();
        let l = Layout::new(Collective::AllGather, 3, 1, 0, 4, counts, 1 << 20);
        assert_eq!(l.chunk(chunk(Buf::Output, 0)).unwrap(), (0, 2));
        assert_eq!(l.chunk(chunk(Buf::Output, 1)).unwrap(), (8, 5));
        assert_eq!(l.chunk(chunk(Buf::Output, 2)).unwrap(), (28, 4));
        assert_eq!(l.chunk(chunk(Buf::Input, 0)).unwrap(), (0, 5));
        assert!(l.chunk(chunk(Buf::Input, 1)).is_err(), "an allgather rank has one input chunk");
        assert!(l.chunk(chunk(Buf::Output, 3)).is_err());
    }

    #[test]
    fn scratch_slots_repeat_the_block_layout() {
        let counts = counts_for(Collective::AllReduce, 2, 0, 0, 7, 7, None, None).unwrap();
        let l = Layout::new(Collective::AllReduce, 2, 0, 0, 2, counts, 1 << 20);
        assert_eq!(l.counts.scratch, vec![3, 4]);
        assert_eq!(l.scratch_slot_bytes, 14);
        // Scratch chunk 3 is slot 1, block 1.
        assert_eq!(l.chunk(chunk(Buf::Scratch, 3)).unwrap(), (14 + 6, 4));
    }

    #[test]
    fn segments_cover_a_chunk_exactly_within_the_segment_size() {
        let counts = counts_for(Collective::AllReduce, 1, 0, 0, 0, 0, None, None).unwrap();
        let l = Layout::new(Collective::AllReduce, 1, 0, 0, 4, counts, 4096);
        for elems in [0usize, 1, 1023, 1024, 1025, 5000, 1 << 20] {
            let k = l.nseg(elems);
            assert!(k >= 1);
            let mut next = 0;
            for s in 0..k {
                let (a, b) = l.seg(elems, s);
                assert_eq!(a, next, "{elems} elements: segment {s} starts where the last ended");
                assert!((b - a) * 4 <= 4096, "{elems} elements: segment {s} is too large");
                next = b;
            }
            assert_eq!(next, elems);
        }
    }

    #[test]
    fn counts_that_do_not_fit_the_call_are_refused_with_the_reason() {
        let err = |r: Result<Counts>| r.unwrap_err().to_string();
        let e = err(counts_for(Collective::AllReduce, 2, 0, 0, 8, 6, None, None));
        assert!(e.contains("output holds 6 elements, expected 8"), "{e}");
        let e = err(counts_for(Collective::AllGather, 3, 0, 0, 1, 4, None, None));
        assert!(e.contains("does not divide into 3 equal blocks"), "{e}");
        let e = err(counts_for(Collective::ReduceScatter, 3, 0, 0, 6, 2, None, Some(&[2, 2])));
        assert!(e.contains("counts has 2 entries, the world has 3 ranks"), "{e}");
        let e = err(counts_for(Collective::AllToAll, 2, 0, 0, 4, 4, Some(&[1, 2]), None));
        assert!(e.contains("input holds 4 elements, expected 3"), "{e}");
        // Ranks other than the root pass only their own part of a gather.
        let c = counts_for(Collective::Gather, 3, 2, 0, 5, 0, None, None).unwrap();
        assert_eq!(c.input, vec![0, 0, 5]);
    }
}
