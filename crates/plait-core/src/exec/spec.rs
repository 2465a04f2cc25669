//! What a collective call is: the request as the caller makes it, its validation, and the plan
//! the engine runs (the operation's spec, the schedule the selector chose, the buffer layout).

use super::layout::{counts_for, Layout};
use crate::codec::Wire;
use crate::dtype::{DType, ReduceOp};
use crate::error::{PlaitError, Result};
use crate::net::frame::CallId;
use crate::raw::RawBuf;
use crate::sched::select::Selector;
use crate::sched::{Collective, Schedule};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A collective call as the caller makes it.
pub struct CollRequest {
    pub coll: Collective,
    pub dtype: DType,
    pub op: ReduceOp,
    pub root: usize,
    pub input: RawBuf,
    pub output: RawBuf,
    pub send_counts: Option<Vec<usize>>,
    pub recv_counts: Option<Vec<usize>>,
    pub timeout: Option<Duration>,
    pub algo: Option<String>,
    /// Wire compression for this call (None: the communicator's default).
    pub wire: Option<Wire>,
}

impl CollRequest {
    /// An in-place allreduce of `buf` (the request most callers make), with every option at its
    /// default; set the fields for the rest.
    pub fn allreduce(buf: RawBuf, dtype: DType, op: ReduceOp) -> CollRequest {
        CollRequest {
            coll: Collective::AllReduce,
            dtype,
            op,
            root: 0,
            input: buf,
            output: buf,
            send_counts: None,
            recv_counts: None,
            timeout: None,
            algo: None,
            wire: None,
        }
    }
}

/// Compression needs each contribution encoded once and each owner's result encoded once and
/// forwarded unchanged: the direct algorithm does exactly that.
const WIRE_ALGO: &str = "direct";

/// What planning a call needs from its communicator.
pub(crate) struct Planner<'a> {
    pub rank: usize,
    pub size: usize,
    pub segment_bytes: usize,
    pub timeout: Duration,
    /// The communicator's wire default (f32 allreduce only).
    pub wire: Wire,
    pub selector: &'a Selector,
    /// The communicator's collective sequence numbers.
    pub seq: &'a AtomicU64,
}

/// A validated call, ready to run.
pub(crate) struct Plan {
    pub spec: OpSpec,
    pub sched: Arc<Schedule>,
    pub layout: Layout,
}

pub(crate) fn check_rank(what: &str, r: usize, size: usize) -> Result<()> {
    if r >= size {
        return Err(PlaitError::invalid(format!("{what} {r} is out of range for world size {size}")));
    }
    Ok(())
}

/// What is being run, for headers, checks and messages.
#[derive(Clone, Debug)]
pub struct OpSpec {
    pub coll: Collective,
    pub dtype: DType,
    pub op: ReduceOp,
    pub root: usize,
    pub seq: u64,
    pub timeout: Duration,
    pub sched_id: u32,
    pub layout_id: u32,
    /// Wire encoding of the payloads (f32 allreduce with the direct algorithm only).
    pub wire: Wire,
    pub what: Arc<str>,
}

impl OpSpec {
    /// How the call is named on the wire.
    pub fn call(&self) -> CallId {
        CallId {
            coll: self.coll.code(),
            dtype: self.dtype as u8,
            op: if self.coll.reduces() { self.op.code() } else { 0 },
            root: self.root as u32,
            seq: self.seq,
            sched_id: self.sched_id,
            layout_id: self.layout_id,
        }
    }
}

fn fnv1a(bytes: impl Iterator<Item = u8>) -> u32 {
    let mut h: u32 = 0x811c9dc5;
    for b in bytes {
        h = (h ^ b as u32).wrapping_mul(0x01000193);
    }
    h
}

/// Identifies (algorithm, segment size): ranks must agree on both.
pub fn sched_id(name: &str, seg_bytes: usize) -> u32 {
    fnv1a(name.bytes().chain(seg_bytes.to_le_bytes()))
}

/// Identifies the counts of a call where every rank knows all of them; 0 (unchecked) for
/// gather, scatter and alltoall, where each rank knows only its own part.
pub fn layout_id(coll: Collective, counts: &[usize]) -> u32 {
    match coll {
        Collective::Gather | Collective::Scatter | Collective::AllToAll => 0,
        _ => fnv1a(counts.iter().flat_map(|c| (*c as u64).to_le_bytes())).max(1),
    }
}

impl Planner<'_> {
    /// Validates a collective call and plans it; nothing is sent and no sequence number is
    /// taken until every check has passed, so a rejected call cannot desynchronise the ranks.
    pub fn plan(&self, req: &CollRequest) -> Result<Plan> {
        let (n, rank) = (self.size, self.rank);
        let coll = req.coll;
        if coll.rooted() {
            check_rank("root", req.root, n)?;
        }
        if let Some(why) = req.op.refusal(req.dtype).filter(|_| coll.reduces()) {
            return Err(PlaitError::invalid(format!("{coll}: {why}")));
        }
        let es = req.dtype.size();
        for (what, b) in [("input", req.input), ("output", req.output)] {
            if b.len % es != 0 {
                return Err(PlaitError::invalid(format!("{coll}: {what} of {} bytes is not a whole number of {} elements", b.len, req.dtype)));
            }
            if b.len > 0 && b.ptr.is_null() {
                return Err(PlaitError::invalid(format!("{coll}: {what} pointer is null")));
            }
        }
        let root = if coll.rooted() { req.root } else { 0 };
        // Buffers a rank does not use are ignored (a non-root's output of reduce, say).
        let uses_input = coll.input_chunks(n, rank, root) > 0;
        let uses_output = coll.output_chunks(n, rank, root) > 0;
        let in_elems = if uses_input { req.input.len / es } else { 0 };
        let out_elems = if uses_output { req.output.len / es } else { 0 };
        let counts = counts_for(coll, n, rank, root, in_elems, out_elems, req.send_counts.as_deref(), req.recv_counts.as_deref())?;
        let layout = Layout::new(coll, n, rank, root, es, counts, self.segment_bytes);
        let block_bytes: Vec<usize> = layout.counts.scratch.iter().map(|c| c * es).collect();
        // The communicator's wire default applies where it can; an explicit request must.
        let compressible = coll == Collective::AllReduce && req.dtype == DType::F32;
        let wire = match req.wire {
            Some(w) if w != Wire::Native && !compressible => {
                return Err(PlaitError::invalid(format!(
                    "{coll}: wire compression ({}) applies to f32 allreduce only, not {} {coll}",
                    w.name(),
                    req.dtype
                )))
            }
            Some(w) => w,
            None if compressible => self.wire,
            None => Wire::Native,
        };
        let algo = match (wire, req.algo.as_deref()) {
            (Wire::Native, a) => a,
            (_, None) => Some(WIRE_ALGO),
            (_, Some(a)) if a == WIRE_ALGO => Some(a),
            (w, Some(a)) => {
                return Err(PlaitError::invalid(format!(
                    "{coll}: wire compression ({}) runs with the {WIRE_ALGO} algorithm, not {a}",
                    w.name()
                )))
            }
        };
        let sched = self.selector.choose(coll, n, root, &block_bytes, algo)?;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let total: usize = layout.counts.scratch.iter().sum();
        let what: Arc<str> = if wire != Wire::Native {
            format!("{coll} #{seq} ({}, {}, {total} elements, {}, {} on the wire)", req.dtype, req.op.name(), sched.label(), wire.name())
        } else if coll.reduces() {
            format!("{coll} #{seq} ({}, {}, {total} elements, {})", req.dtype, req.op.name(), sched.label())
        } else if coll.rooted() {
            format!("{coll} #{seq} ({}, root {root}, {total} elements, {})", req.dtype, sched.label())
        } else {
            format!("{coll} #{seq} ({}, {total} elements, {})", req.dtype, sched.label())
        }
        .into();
        let spec = OpSpec {
            coll,
            dtype: req.dtype,
            op: req.op,
            root,
            seq,
            timeout: req.timeout.unwrap_or(self.timeout),
            sched_id: sched_id(&format!("{}{}/{}", sched.name, sched.variant, wire.name()), self.segment_bytes),
            layout_id: layout_id(coll, &layout.counts.scratch),
            wire,
            what,
        };
        Ok(Plan { spec, sched, layout })
    }
}

