//! The collective engine: runs any verified schedule over the session's links, pipelined over
//! segments, with a deadline, abortable from another thread, leaving the caller's output
//! untouched on failure.
//!
//! Each segment walks the schedule's steps on its own: step k+1 of segment s starts as soon as
//! step k of segment s is done, so segments overlap on the links without any pipelining code in
//! the schedules. Transfers complete through one event queue per operation.

use super::bundle::{bundled, bundled_sends};
use super::layout::Layout;
use super::spec::OpSpec;
use super::transfers::{OpMemory, Transfers};
use super::wait::{better_explained, with_waited};
use crate::codec::{self, Wire};
use crate::error::{PlaitError, Result};
use crate::kernels;
use crate::net::frame::{CallId, FrameHeader, FrameKind};
use crate::raw::{bytes, bytes_mut, RawBuf};
use crate::sched::{Buf, ChunkRef, Collective, LocalOp, Schedule};
use crate::session::{describe_header, BufferPool, Expect, Keep, Landing, Part, Posted, Session};
use crossbeam_channel::RecvTimeoutError;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs one collective. Returns when every transfer has finished, successfully or not; on
/// failure the output holds exactly what it held before the call.
pub fn run_collective(
    session: &Arc<Session>,
    spec: &OpSpec,
    sched: &Schedule,
    layout: &Layout,
    input: RawBuf,
    output: RawBuf,
) -> Result<()> {
    if let Some(err) = session.broken() {
        return Err(PlaitError::Broken(err.to_string()));
    }
    let start = Instant::now();
    let pool = &session.mailbox.pool;
    let mut memory = RunMemory {
        scratch: pool.take(sched.scratch_slots * layout.scratch_slot_bytes),
        saved: Mutex::new(Saved { copy: pool.take(output.len), regions: HashMap::new() }),
        encoded: Mutex::new(Vec::new()),
    };
    let scratch = RawBuf::of(&mut memory.scratch);
    let run = Run {
        session,
        spec,
        sched,
        layout,
        input,
        output,
        scratch,
        call: spec.call(),
        locks: Arc::new(Mutex::new(())),
        transfers: Transfers::new(session, spec.what.clone(), memory),
    };
    let mut state = State::new(layout.max_nseg(), sched.nsteps());
    let outcome = run.drive(&mut state, start).and_then(|_| match session.mailbox.finish(spec.seq) {
        None => Ok(()),
        Some((peer, h)) => Err(PlaitError::Mismatch {
            op: spec.what.to_string(),
            peer,
            detail: format!(
                "rank {peer} sent {} which this rank's call did not expect: the ranks disagree about the root, the counts or the algorithm",
                describe_header(&h)
            ),
        }),
    });
    match outcome {
        Ok(()) => {
            run.finalize();
            Ok(())
        }
        Err(err @ PlaitError::Refused { .. }) => {
            // Every rank hears of the refusal: the call ends everywhere, the communicator lives.
            run.transfers.withdraw();
            session.mailbox.finish_refused(spec.seq);
            run.restore_output();
            Err(err)
        }
        Err(err) => {
            let err = run.abandon(err, start);
            run.restore_output();
            Err(err)
        }
    }
}

/// The buffers a collective owns and lends to link threads: released by its `Transfers` only
/// once every transfer has reported.
struct RunMemory {
    scratch: Vec<u8>,
    saved: Mutex<Saved>,
    /// Wire-encoded sends of the current step, per (segment, chunk): encoded once, sent to
    /// every peer unchanged, kept until the step's transfers are done.
    encoded: Mutex<Vec<(usize, ChunkRef, Vec<u8>)>>,
}

impl OpMemory for RunMemory {
    fn give_back(&mut self, pool: &BufferPool) {
        pool.give(std::mem::take(&mut self.scratch));
        pool.give(std::mem::take(&mut self.saved.get_mut().copy));
        for (_, _, buf) in self.encoded.get_mut().drain(..) {
            pool.give(buf);
        }
    }
}

struct State {
    /// Next step to run, per segment.
    step: Vec<usize>,
    /// Transfers of the current step still under way, per segment: (peer, is_send).
    pending: Vec<Vec<(usize, bool)>>,
    done: usize,
    nsteps: usize,
}

impl State {
    fn new(nseg: usize, nsteps: usize) -> State {
        State { step: vec![0; nseg], pending: vec![Vec::new(); nseg], done: 0, nsteps }
    }
}

struct Run<'a> {
    session: &'a Session,
    spec: &'a OpSpec,
    sched: &'a Schedule,
    layout: &'a Layout,
    input: RawBuf,
    output: RawBuf,
    scratch: RawBuf,
    call: CallId,
    /// Serialises accumulating receives of this operation (several peers reducing into one chunk).
    locks: Arc<Mutex<()>>,
    /// Every transfer under way, and the buffers they point into (see `Transfers`).
    transfers: Transfers<RunMemory>,
}

/// What the output held where this operation wrote, so a failed operation leaves it as it
/// was: one `Keep` per region written, each copied by its first writer just before it writes
/// (not all up front), so the copies overlap the transfers and never delay posting a receive.
struct Saved {
    copy: Vec<u8>,
    /// Regions of the output by byte offset.
    regions: HashMap<usize, Arc<Keep>>,
}

impl Run<'_> {
    /// The keeper of the output region at `ptr` (None for scratch and input, and for nothing).
    fn keep_for(&self, ptr: *mut u8, len: usize) -> Option<Arc<Keep>> {
        let (base, p) = (self.output.ptr as usize, ptr as usize);
        if len == 0 || p < base || p + len > base + self.output.len {
            return None;
        }
        let off = p - base;
        let mut saved = self.transfers.memory.saved.lock();
        let copy = saved.copy.as_mut_ptr();
        let keep = saved.regions.entry(off).or_insert_with(|| {
            // SAFETY: the region is inside the output and the copy has the output's length;
            // both outlive every transfer of this operation.
            Arc::new(unsafe { Keep::new(ptr, copy.add(off), len) })
        });
        debug_assert_eq!(keep.len(), len, "output regions of one operation are disjoint segments");
        Some(keep.clone())
    }

    /// Call before this thread writes `len` bytes at `ptr` itself (local steps, encoding).
    fn save_before_write(&self, ptr: *const u8, len: usize) {
        if let Some(k) = self.keep_for(ptr as *mut u8, len) {
            k.before_write(len);
        }
    }

    /// Puts back what the output held wherever this operation wrote.
    fn restore_output(&self) {
        for keep in self.transfers.memory.saved.lock().regions.values() {
            keep.restore();
        }
    }

    /// (pointer, bytes, elements of the whole chunk) of segment `s` of chunk `c`, or None when
    /// the chunk has fewer segments.
    fn seg_ptr(&self, c: ChunkRef, s: usize) -> Result<Option<(*mut u8, usize, usize)>> {
        let (off, elems) = self.layout.chunk(c)?;
        if s >= self.layout.nseg(elems) {
            return Ok(None);
        }
        let (a, b) = self.layout.seg(elems, s);
        let es = self.layout.esize;
        let base = match c.buf {
            Buf::Input => self.input,
            Buf::Output => self.output,
            Buf::Scratch => self.scratch,
        };
        let end = off + b * es;
        if end > base.len {
            return Err(PlaitError::invalid(format!(
                "{}: {:?} chunk {} ends at byte {end}, the buffer has {}",
                self.spec.what, c.buf, c.index, base.len
            )));
        }
        Ok(Some((unsafe { base.ptr.add(off + a * es) }, (b - a) * es, elems)))
    }

    fn drive(&self, st: &mut State, start: Instant) -> Result<()> {
        let deadline = start + self.spec.timeout;
        for s in 0..st.step.len() {
            self.advance(s, st)?;
        }
        crate::failpoint::hit("collective.drive");
        while st.done < st.step.len() {
            let wake = deadline.min(Instant::now() + Duration::from_millis(100));
            match self.transfers.next_event(wake, deadline) {
                Ok(ev) => {
                    if let Err(e) = ev.result {
                        return Err(better_explained(self.session, e));
                    }
                    let s = ev.token as usize;
                    if let Some(i) = st.pending[s].iter().position(|(p, _)| *p == ev.source) {
                        st.pending[s].swap_remove(i);
                    }
                    if st.pending[s].is_empty() {
                        self.release_encoded(s);
                        self.locals(s, st.step[s])?;
                        st.step[s] += 1;
                        self.advance(s, st)?;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(err) = self.session.broken() {
                        return Err(err);
                    }
                    if Instant::now() >= deadline {
                        return Err(self.timeout_error(st, start));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => unreachable!("the run holds a sender"),
            }
        }
        Ok(())
    }

    /// Issues the transfers of segment `s`'s current step, running locals-only steps at once.
    fn advance(&self, s: usize, st: &mut State) -> Result<()> {
        let rank = self.layout.rank;
        while st.step[s] < st.nsteps {
            let k = st.step[s];
            let Some(step) = self.sched.ranks[rank].get(k) else {
                st.step[s] += 1;
                continue;
            };
            // Per peer, in ordinal order: the transfers of this step that segment `s` has.
            let mut recvs: Vec<Vec<(u32, Part, usize)>> = (0..self.session.size).map(|_| Vec::new()).collect();
            let mut ordinal = vec![0u32; self.session.size];
            for r in &step.recvs {
                let peer = r.peer as usize;
                ordinal[peer] += 1;
                let Some((dst, len, elems)) = self.seg_ptr(r.dst, s)? else { continue };
                // The receive itself keeps what it overwrites, on the thread that lands it.
                let keep = self.keep_for(dst, len);
                let landing = match r.reduce_with {
                    None => Landing::Copy { dst, keep },
                    Some(w) => {
                        let (with, _, _) = self.seg_ptr(w, s)?.expect("verified: same block size");
                        let (dtype, op, lock) = (self.spec.dtype, self.spec.op.combiner(), self.locks.clone());
                        Landing::Reduce { dst, with, dtype, op, lock, keep }
                    }
                };
                recvs[peer].push((ordinal[peer] - 1, Part { landing, len, wire_len: self.wire_len(len) }, elems));
            }
            for (peer, parts) in recvs.into_iter().enumerate() {
                for (first, part, elems) in bundled(parts) {
                    st.pending[s].push((peer, false));
                    let key = (peer, FrameKind::Data as u8, self.spec.seq, k as u32, s as u32, first);
                    self.session.mailbox.post(key, Posted {
                        expect: self.expect(elems, part.wire_len),
                        landing: part.landing,
                        len: part.len,
                        wire: self.spec.wire,
                        op_id: self.transfers.op_id(),
                        token: s as u32,
                        events: self.transfers.issue(),
                        reported: false,
                    });
                }
            }
            let mut sends: Vec<Vec<(u32, (*const u8, usize), usize)>> = (0..self.session.size).map(|_| Vec::new()).collect();
            let mut ordinal = vec![0u32; self.session.size];
            for snd in &step.sends {
                let peer = snd.peer as usize;
                ordinal[peer] += 1;
                let Some((src, len, elems)) = self.seg_ptr(snd.src, s)? else { continue };
                let wire_bytes = match self.spec.wire {
                    Wire::Native => (src as *const u8, len),
                    wire => self.encode_once(s, snd.src, src, len, wire),
                };
                sends[peer].push((ordinal[peer] - 1, wire_bytes, elems));
            }
            for (peer, parts) in sends.into_iter().enumerate() {
                for (first, (src, len), elems, owned) in bundled_sends(parts) {
                    let header = FrameHeader::data(&self.call, k as u32, s as u32, first, elems as u64, len as u64);
                    st.pending[s].push((peer, true));
                    self.session.send_frame(peer, header, src, len, owned, self.spec.what.clone(), s as u32, self.transfers.issue());
                }
            }
            if !st.pending[s].is_empty() {
                return Ok(());
            }
            self.locals(s, k)?;
            st.step[s] += 1;
        }
        st.done += 1;
        Ok(())
    }

    /// The wire bytes of segment `s` of chunk `c`, encoding it the first time it is sent in
    /// this step. A chunk of the output is replaced by its decoded value, so the sender holds
    /// exactly what its peers will: every rank ends bit-identical.
    fn encode_once(&self, s: usize, c: ChunkRef, src: *mut u8, len: usize, wire: Wire) -> (*const u8, usize) {
        let mut enc = self.transfers.memory.encoded.lock();
        if let Some((_, _, buf)) = enc.iter().find(|(seg, ch, _)| *seg == s && *ch == c) {
            return (buf.as_ptr(), buf.len());
        }
        let mut buf = self.session.mailbox.pool.take(wire.encoded_len(len / 4));
        codec::encode(wire, unsafe { bytes(src, len) }, &mut buf);
        if c.buf == Buf::Output {
            self.save_before_write(src, len);
            codec::decode(wire, &buf, unsafe { bytes_mut(src, len) });
        }
        let out = (buf.as_ptr(), buf.len());
        enc.push((s, c, buf));
        out
    }

    fn release_encoded(&self, s: usize) {
        let mut enc = self.transfers.memory.encoded.lock();
        let mut i = 0;
        while i < enc.len() {
            if enc[i].0 == s {
                let (_, _, buf) = enc.swap_remove(i);
                self.session.mailbox.pool.give(buf);
            } else {
                i += 1;
            }
        }
    }

    /// Bytes on the wire of `len` bytes of this operation's data.
    fn wire_len(&self, len: usize) -> usize {
        match self.spec.wire {
            Wire::Native => len,
            wire => wire.encoded_len(len / 4),
        }
    }

    fn expect(&self, elems: usize, len: usize) -> Expect {
        Expect { call: self.call, count: elems as u64, nbytes: len as u64, what: self.spec.what.clone() }
    }

    fn locals(&self, s: usize, k: usize) -> Result<()> {
        let Some(step) = self.sched.ranks[self.layout.rank].get(k) else { return Ok(()) };
        for l in &step.locals {
            let (src, dst) = match l {
                LocalOp::Copy { src, dst } | LocalOp::Reduce { src, dst } => (*src, *dst),
            };
            let (Some((sp, len, _)), Some((dp, _, _))) = (self.seg_ptr(src, s)?, self.seg_ptr(dst, s)?) else {
                continue;
            };
            if std::ptr::eq(sp, dp) || len == 0 {
                continue;
            }
            self.save_before_write(dp, len);
            match l {
                // Regions of one caller buffer may overlap in place: copy with memmove semantics.
                LocalOp::Copy { .. } => unsafe { std::ptr::copy(sp, dp, len) },
                LocalOp::Reduce { .. } => {
                    let _g = self.locks.lock();
                    let (d, sr) = unsafe { (bytes_mut(dp, len), bytes(sp, len)) };
                    kernels::reduce_into(d, sr, self.spec.dtype, self.spec.op.combiner());
                }
            }
        }
        Ok(())
    }

    fn finalize(&self) {
        let reduced = match self.spec.coll {
            Collective::AllReduce | Collective::ReduceScatter => true,
            Collective::Reduce => self.layout.rank == self.spec.root,
            _ => false,
        };
        if reduced {
            let out = unsafe { bytes_mut(self.output.ptr, self.output.len) };
            kernels::finalize(out, self.spec.dtype, self.spec.op, self.layout.n);
        }
    }

    fn timeout_error(&self, st: &State, start: Instant) -> PlaitError {
        let mut waiting: Vec<String> = Vec::new();
        for (s, pend) in st.pending.iter().enumerate() {
            for (peer, is_send) in pend {
                let d = format!(
                    "rank {peer} ({}) to {} step {} segment {s}",
                    self.session.peer_addr(*peer),
                    if *is_send { "take what this rank sends in" } else { "send its part of" },
                    st.step[s]
                );
                if !waiting.contains(&d) {
                    waiting.push(d);
                }
            }
            if waiting.len() >= 3 {
                break;
            }
        }
        let quiet = (self.spec.timeout / 2).max(Duration::from_millis(500));
        let silent = self.session.silent_peers(quiet);
        // A peer that sends nothing, not even heartbeats, is the likely culprit: name it first.
        let on = if silent.is_empty() {
            waiting.join("; ")
        } else {
            let names: Vec<String> = silent
                .iter()
                .map(|(p, d)| format!("rank {p} ({}), silent for {:.1?} (stopped, hung or cut off)", self.session.peer_addr(*p), d))
                .collect();
            format!("{}; this rank was waiting for {}", names.join(", "), waiting.join("; "))
        };
        PlaitError::Timeout { op: self.spec.what.to_string(), waiting_on: on, waited: start.elapsed() }
    }

    /// Fails the communicator and withdraws this operation's transfers (until no link thread
    /// touches the caller's memory any more).
    fn abandon(&self, err: PlaitError, start: Instant) -> PlaitError {
        let first = self.session.fail(err, true);
        self.transfers.withdraw();
        with_waited(first.for_op(&self.spec.what), start.elapsed())
    }
}

