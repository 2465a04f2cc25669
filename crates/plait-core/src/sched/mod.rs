//! Algorithms as schedules: the one representation that the built-in generators, custom
//! (JSON) algorithms, the verifier/simulator, the cost model and the executor all share.
//!
//! # Model
//! A schedule gives every rank a list of *steps*. Step `k` of every rank runs in the same round:
//! a send in step `k` of rank `p` to `q` is matched by a receive from `p` in step `k` of rank `q`.
//! When a rank lists several transfers to (or from) the same peer in one step, they match in the
//! order listed (the `ordinal`). Within a step all sends and receives proceed concurrently; the
//! step's `locals` (copies and reductions on this rank) run after every transfer of the step has
//! completed. A step may have only locals.
//!
//! # Buffers and chunks
//! Every collective has a *block layout*: `n` blocks (block `i` belongs to rank `i`, or is the
//! `i`-th even part of the buffer), whose sizes the caller supplies at run time.
//! * `Input`: the caller's send buffer. Read only. Chunk `i` is block `i` (when the collective's
//!   input has `n` chunks) or the whole input (chunk 0, when it has one).
//! * `Output`: the caller's receive buffer, likewise `n` chunks or 1 chunk.
//! * `Scratch`: `scratch_slots` copies of the whole layout; chunk `s * n + i` is block `i` of slot `s`.
//!
//! Which of Input/Output have `n` chunks or one, and the post-condition, is given by
//! [`Collective::input_chunks`], [`Collective::output_chunks`] and the verifier.
//! In place, the input aliases the output ([`Collective::alias`]): schedules must stay correct
//! then (the verifier simulates both).
//!
//! # Pipelining
//! The executor splits every chunk into segments and runs the schedule once per segment, each
//! segment moving through the steps independently; authors never write pipelining by hand.

pub mod cost;
pub mod custom;
pub mod gen;
pub mod order;
pub mod select;
pub mod verify;

#[cfg(test)]
mod mutation_tests;

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    // Spelt in files as `name()` spells them (and as PLAIT_ALGO does).
    #[serde(rename = "allreduce", alias = "all_reduce")]
    AllReduce,
    Reduce,
    Broadcast,
    #[serde(rename = "allgather", alias = "all_gather")]
    AllGather,
    ReduceScatter,
    Gather,
    Scatter,
    #[serde(rename = "alltoall", alias = "all_to_all")]
    AllToAll,
}

impl Collective {
    pub const ALL: [Collective; 8] = [
        Collective::AllReduce,
        Collective::Reduce,
        Collective::Broadcast,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::Gather,
        Collective::Scatter,
        Collective::AllToAll,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::Reduce => "reduce",
            Collective::Broadcast => "broadcast",
            Collective::AllGather => "allgather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
            Collective::AllToAll => "alltoall",
        }
    }

    pub fn from_name(s: &str) -> Option<Collective> {
        Collective::ALL.iter().copied().find(|c| c.name() == s)
    }

    pub fn code(self) -> u8 {
        Collective::ALL.iter().position(|c| *c == self).unwrap() as u8 + 1
    }

    pub fn from_code(code: u8) -> Option<Collective> {
        Collective::ALL.get((code as usize).checked_sub(1)?).copied()
    }

    pub fn reduces(self) -> bool {
        matches!(self, Collective::AllReduce | Collective::Reduce | Collective::ReduceScatter)
    }

    pub fn rooted(self) -> bool {
        matches!(
            self,
            Collective::Reduce | Collective::Broadcast | Collective::Gather | Collective::Scatter
        )
    }

    /// How many chunks rank `rank`'s input has (n = world size). 0 means the rank passes no input.
    pub fn input_chunks(self, n: usize, rank: usize, root: usize) -> usize {
        match self {
            Collective::AllReduce | Collective::Reduce | Collective::ReduceScatter => n,
            Collective::AllToAll => n,
            Collective::Broadcast | Collective::Scatter => {
                if rank == root {
                    n
                } else {
                    0
                }
            }
            Collective::AllGather | Collective::Gather => 1,
        }
    }

    /// How many chunks rank `rank`'s output has.
    pub fn output_chunks(self, n: usize, rank: usize, root: usize) -> usize {
        match self {
            Collective::AllReduce | Collective::AllGather | Collective::AllToAll => n,
            Collective::Broadcast => n,
            Collective::Reduce | Collective::Gather => {
                if rank == root {
                    n
                } else {
                    0
                }
            }
            Collective::ReduceScatter | Collective::Scatter => 1,
        }
    }

    /// For a one-chunk buffer, which block of the layout it is on `rank`.
    pub fn single_chunk_block(self, rank: usize) -> usize {
        rank
    }

    /// In-place aliasing: `(input chunk, output chunk)` pairs that share memory when the caller
    /// passes the same buffer for both, on rank `rank`.
    pub fn alias(self, n: usize, rank: usize, root: usize) -> Vec<(u32, u32)> {
        match self {
            Collective::AllReduce => (0..n as u32).map(|i| (i, i)).collect(),
            Collective::Broadcast if rank == root => (0..n as u32).map(|i| (i, i)).collect(),
            Collective::Reduce if rank == root => (0..n as u32).map(|i| (i, i)).collect(),
            Collective::AllGather => vec![(0, rank as u32)],
            Collective::Gather if rank == root => vec![(0, rank as u32)],
            Collective::ReduceScatter => vec![(rank as u32, 0)],
            Collective::Scatter if rank == root => vec![(rank as u32, 0)],
            _ => vec![],
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Buf {
    Input,
    Output,
    Scratch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkRef {
    pub buf: Buf,
    pub index: u32,
}

impl ChunkRef {
    pub fn input(index: u32) -> Self {
        ChunkRef { buf: Buf::Input, index }
    }
    pub fn output(index: u32) -> Self {
        ChunkRef { buf: Buf::Output, index }
    }
    pub fn scratch(slot: u32, n: usize, block: u32) -> Self {
        ChunkRef { buf: Buf::Scratch, index: slot * n as u32 + block }
    }

    /// The layout block this chunk has the size of, on `rank` for collective `coll`.
    pub fn block(&self, coll: Collective, n: usize, rank: usize, root: usize) -> usize {
        let single = match self.buf {
            Buf::Input => coll.input_chunks(n, rank, root) == 1,
            Buf::Output => coll.output_chunks(n, rank, root) == 1,
            Buf::Scratch => false,
        };
        if single {
            coll.single_chunk_block(rank)
        } else {
            self.index as usize % n.max(1)
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendOp {
    pub peer: u32,
    pub src: ChunkRef,
}

/// Receive one message from `peer` into `dst`. With `reduce_with = Some(c)`, `dst = c (+) message`
/// (`c` may be `dst` itself: accumulate); otherwise a plain copy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecvOp {
    pub peer: u32,
    pub dst: ChunkRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduce_with: Option<ChunkRef>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum LocalOp {
    /// `dst = src`
    Copy { src: ChunkRef, dst: ChunkRef },
    /// `dst = dst (+) src`
    Reduce { src: ChunkRef, dst: ChunkRef },
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sends: Vec<SendOp>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recvs: Vec<RecvOp>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub locals: Vec<LocalOp>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Algorithm name as `PLAIT_ALGO` spells it (`ring`, `direct`, ...).
    pub name: String,
    pub collective: Collective,
    pub nranks: usize,
    /// Root rank for rooted collectives, 0 otherwise.
    #[serde(default)]
    pub root: usize,
    /// Number of full-layout scratch slots each rank needs.
    #[serde(default)]
    pub scratch_slots: usize,
    /// `ranks[r]` is rank r's program; all have the same number of steps.
    pub ranks: Vec<Vec<Step>>,
    /// How this schedule differs from the algorithm's plain one (`order 0>2>1>3`: a ring run in
    /// that order, see [`order::relabel`]); empty for the plain one. Ranks must agree on it as on
    /// the name: both go into the call's schedule id.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub variant: String,
}

impl Schedule {
    /// The name, with the variant when there is one: `ring (order 0>2>1>3)`.
    pub fn label(&self) -> String {
        if self.variant.is_empty() {
            self.name.clone()
        } else {
            format!("{} ({})", self.name, self.variant)
        }
    }

    pub fn nsteps(&self) -> usize {
        self.ranks.iter().map(|p| p.len()).max().unwrap_or(0)
    }
}
