//! The executor: runs any verified schedule over the links, pipelined over segments, with a
//! deadline, abortable from another thread, leaving the caller's output untouched on failure.
//!
//! Each segment walks the schedule's steps on its own: step k+1 of segment s starts as soon as
//! step k of segment s is done, so segments overlap on the links without any pipelining code in
//! the schedules. Transfers complete through one event queue per operation.

pub mod fabric;
pub mod layout;
pub mod mailbox;
pub mod pool;

use crate::codec::{self, Wire};
use crate::dtype::{DType, ReduceOp};
use crate::error::{PlaitError, Result};
use crate::kernels;
use crate::net::frame::{FrameHeader, FrameKind};
use crate::net::peer::{SendBuf, SendReq};
use crate::sched::{Buf, ChunkRef, Collective, LocalOp, Schedule};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use fabric::Fabric;
use layout::Layout;
use mailbox::{Expect, Keep, Landing, Part, Posted};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Completion of one transfer.
pub struct Event {
    pub token: u32,
    pub result: Result<()>,
    /// The peer the transfer was with.
    pub source: usize,
}

/// Caller memory (a pointer and a length in bytes). Null is fine when the length is 0.
#[derive(Clone, Copy, Debug)]
pub struct RawBuf {
    pub ptr: *mut u8,
    pub len: usize,
}
// SAFETY: the caller of the executor keeps the memory alive and unaliased by Rust references
// until the operation completes.
unsafe impl Send for RawBuf {}
unsafe impl Sync for RawBuf {}

impl RawBuf {
    pub const EMPTY: RawBuf = RawBuf { ptr: std::ptr::null_mut(), len: 0 };
}

/// # Safety
/// `p` must be valid for `len` bytes (any pointer is fine when `len == 0`).
pub(crate) unsafe fn bytes_mut<'a>(p: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(p, len)
    }
}

/// # Safety
/// As [`bytes_mut`].
pub(crate) unsafe fn bytes<'a>(p: *const u8, len: usize) -> &'a [u8] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(p, len)
    }
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
    fn op_code(&self) -> u8 {
        if self.coll.reduces() {
            self.op.code()
        } else {
            0
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

/// Runs one collective. Returns when every transfer has finished, successfully or not; on
/// failure the output holds exactly what it held before the call.
pub fn run_collective(
    fabric: &Fabric,
    spec: &OpSpec,
    sched: &Schedule,
    layout: &Layout,
    input: RawBuf,
    output: RawBuf,
) -> Result<()> {
    if let Some(err) = fabric.broken() {
        return Err(PlaitError::Broken(err.to_string()));
    }
    let start = Instant::now();
    let pool = &fabric.mailbox.pool;
    let mut scratch = pool.take(sched.scratch_slots * layout.scratch_slot_bytes);
    let run = Run {
        fabric,
        spec,
        sched,
        layout,
        input,
        output,
        scratch: RawBuf { ptr: scratch.as_mut_ptr(), len: scratch.len() },
        op_id: fabric.op_id(),
        locks: Arc::new(Mutex::new(())),
        encoded: Mutex::new(Vec::new()),
        saved: Mutex::new(Saved { copy: pool.take(output.len), regions: HashMap::new() }),
    };
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut state = State::new(layout.max_nseg(), sched.nsteps());
    let outcome = run.drive(&tx, &rx, &mut state, start).and_then(|_| match fabric.mailbox.finish(spec.seq) {
        None => Ok(()),
        Some((peer, h)) => Err(PlaitError::Mismatch {
            op: spec.what.to_string(),
            peer,
            detail: format!(
                "rank {peer} sent {} which this rank's call did not expect: the ranks disagree about the root, the counts or the algorithm",
                mailbox::describe_header(&h)
            ),
        }),
    });
    let result = match outcome {
        Ok(()) => {
            run.finalize();
            Ok(())
        }
        Err(err) => {
            let err = run.abandon(err, &rx, &mut state, start);
            run.restore_output();
            Err(err)
        }
    };
    pool.give(std::mem::take(&mut run.saved.lock().copy));
    pool.give(scratch);
    for (_, _, buf) in run.encoded.lock().drain(..) {
        pool.give(buf);
    }
    result
}

struct State {
    /// Next step to run, per segment.
    step: Vec<usize>,
    /// Transfers of the current step still under way, per segment: (peer, is_send).
    pending: Vec<Vec<(usize, bool)>>,
    /// Transfers issued and not yet reported (cancelled receives are subtracted).
    outstanding: usize,
    done: usize,
    nsteps: usize,
}

impl State {
    fn new(nseg: usize, nsteps: usize) -> State {
        State { step: vec![0; nseg], pending: vec![Vec::new(); nseg], outstanding: 0, done: 0, nsteps }
    }
}

struct Run<'a> {
    fabric: &'a Fabric,
    spec: &'a OpSpec,
    sched: &'a Schedule,
    layout: &'a Layout,
    input: RawBuf,
    output: RawBuf,
    scratch: RawBuf,
    op_id: u64,
    /// Serialises accumulating receives of this operation (several peers reducing into one chunk).
    locks: Arc<Mutex<()>>,
    /// Wire-encoded sends of the current step, per (segment, chunk): encoded once, sent to
    /// every peer unchanged, kept until the step's transfers are done.
    encoded: Mutex<Vec<(usize, ChunkRef, Vec<u8>)>>,
    /// What the output held where this operation wrote, so a failed operation leaves it as it
    /// was: one `Keep` per region written, each copied by its first writer just before it writes
    /// (not all up front), so the copies overlap the transfers and never delay posting a receive.
    saved: Mutex<Saved>,
}

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
        let mut saved = self.saved.lock();
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
        for keep in self.saved.lock().regions.values() {
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

    fn drive(&self, tx: &Sender<Event>, rx: &Receiver<Event>, st: &mut State, start: Instant) -> Result<()> {
        let deadline = start + self.spec.timeout;
        for s in 0..st.step.len() {
            self.advance(s, tx, st)?;
        }
        while st.done < st.step.len() {
            let wake = deadline.min(Instant::now() + Duration::from_millis(100));
            match next_event(self.fabric, rx, wake, deadline) {
                Ok(ev) => {
                    st.outstanding -= 1;
                    if let Err(e) = ev.result {
                        return Err(better_explained(self.fabric, e));
                    }
                    let s = ev.token as usize;
                    if let Some(i) = st.pending[s].iter().position(|(p, _)| *p == ev.source) {
                        st.pending[s].swap_remove(i);
                    }
                    if st.pending[s].is_empty() {
                        self.release_encoded(s);
                        self.locals(s, st.step[s])?;
                        st.step[s] += 1;
                        self.advance(s, tx, st)?;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(err) = self.fabric.broken() {
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
    fn advance(&self, s: usize, tx: &Sender<Event>, st: &mut State) -> Result<()> {
        let rank = self.layout.rank;
        while st.step[s] < st.nsteps {
            let k = st.step[s];
            let Some(step) = self.sched.ranks[rank].get(k) else {
                st.step[s] += 1;
                continue;
            };
            // Per peer, in ordinal order: the transfers of this step that segment `s` has.
            let mut recvs: Vec<Vec<(u32, Part, usize)>> = (0..self.fabric.size).map(|_| Vec::new()).collect();
            let mut ordinal = vec![0u32; self.fabric.size];
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
                    st.outstanding += 1;
                    let key = (peer, FrameKind::Data as u8, self.spec.seq, k as u32, s as u32, first);
                    self.fabric.mailbox.post(key, Posted {
                        expect: self.expect(elems, part.wire_len),
                        landing: part.landing,
                        len: part.len,
                        wire: self.spec.wire,
                        op_id: self.op_id,
                        token: s as u32,
                        events: tx.clone(),
                    });
                }
            }
            let mut sends: Vec<Vec<(u32, (*const u8, usize), usize)>> = (0..self.fabric.size).map(|_| Vec::new()).collect();
            let mut ordinal = vec![0u32; self.fabric.size];
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
                    let header = FrameHeader {
                        kind: FrameKind::Data as u8,
                        coll: self.spec.coll.code(),
                        dtype: self.spec.dtype as u8,
                        op: self.spec.op_code(),
                        seq: self.spec.seq,
                        step: k as u32,
                        segment: s as u32,
                        ordinal: first,
                        root: self.spec.root as u32,
                        count: elems as u64,
                        nbytes: len as u64,
                        sched_id: self.spec.sched_id,
                        layout_id: self.spec.layout_id,
                    };
                    st.pending[s].push((peer, true));
                    st.outstanding += 1;
                    let tx = tx.clone();
                    let what = self.spec.what.clone();
                    let addr = self.fabric.peer_addr(peer);
                    self.fabric.link(peer).send(SendReq {
                        header,
                        data: SendBuf { ptr: src, len },
                        done: Some(Box::new(move |r| {
                            drop(owned);
                            let result = r.map_err(|e| PlaitError::Peer {
                                op: what.to_string(),
                                peer,
                                addr,
                                what: format!("could not be sent to: {e}"),
                                waited: Duration::ZERO,
                            });
                            let _ = tx.send(Event { token: s as u32, result, source: peer });
                        })),
                    });
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
        let mut enc = self.encoded.lock();
        if let Some((_, _, buf)) = enc.iter().find(|(seg, ch, _)| *seg == s && *ch == c) {
            return (buf.as_ptr(), buf.len());
        }
        let mut buf = self.fabric.mailbox.pool.take(wire.encoded_len(len / 4));
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
        let mut enc = self.encoded.lock();
        let mut i = 0;
        while i < enc.len() {
            if enc[i].0 == s {
                let (_, _, buf) = enc.swap_remove(i);
                self.fabric.mailbox.pool.give(buf);
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
        Expect {
            coll: self.spec.coll.code(),
            dtype: self.spec.dtype as u8,
            op: self.spec.op_code(),
            root: self.spec.root as u32,
            count: elems as u64,
            nbytes: len as u64,
            sched_id: self.spec.sched_id,
            layout_id: self.spec.layout_id,
            what: self.spec.what.clone(),
        }
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
                    self.fabric.peer_addr(*peer),
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
        let silent = self.fabric.silent_peers(quiet);
        // A peer that sends nothing, not even heartbeats, is the likely culprit: name it first.
        let on = if silent.is_empty() {
            waiting.join("; ")
        } else {
            let names: Vec<String> = silent
                .iter()
                .map(|(p, d)| format!("rank {p} ({}), silent for {:.1?} (stopped, hung or cut off)", self.fabric.peer_addr(*p), d))
                .collect();
            format!("{}; this rank was waiting for {}", names.join(", "), waiting.join("; "))
        };
        PlaitError::Timeout { op: self.spec.what.to_string(), waiting_on: on, waited: start.elapsed() }
    }

    /// Fails the communicator, withdraws this operation's receives and waits until no link
    /// thread touches the caller's memory any more.
    fn abandon(&self, err: PlaitError, rx: &Receiver<Event>, st: &mut State, start: Instant) -> PlaitError {
        let first = self.fabric.fail(err, true);
        st.outstanding -= self.fabric.mailbox.cancel(self.op_id).min(st.outstanding);
        let drain_deadline = Instant::now() + Duration::from_secs(10);
        while st.outstanding > 0 {
            match rx.recv_deadline(drain_deadline) {
                Ok(_) => st.outstanding -= 1,
                Err(_) => {
                    tracing::error!("{}: {} transfers did not finish after the failure", self.spec.what, st.outstanding);
                    break;
                }
            }
        }
        with_waited(first.for_op(&self.spec.what), start.elapsed())
    }
}

/// Transfers of one step between the same two ranks travel as one frame when they are small
/// together: one message instead of several (a oneshot allreduce of n blocks would otherwise
/// send n frames to every peer). Both sides decide from the same sizes, so they agree; the
/// frame's element count is the sum of its parts', so a disagreement is a mismatch, not garbage.
const BUNDLE_MAX: usize = 64 * 1024;

fn bundle_ok(wire_lens: impl Iterator<Item = usize> + Clone) -> bool {
    wire_lens.clone().count() > 1 && wire_lens.sum::<usize>() <= BUNDLE_MAX
}

/// The receives from one peer: (first ordinal, landing, whole-chunk elements) per frame.
fn bundled(parts: Vec<(u32, Part, usize)>) -> Vec<(u32, Part, usize)> {
    if !bundle_ok(parts.iter().map(|(_, p, _)| p.wire_len)) {
        return parts;
    }
    let first = parts[0].0;
    let (len, wire_len, elems) = parts.iter().fold((0, 0, 0), |a, (_, p, e)| (a.0 + p.len, a.1 + p.wire_len, a.2 + e));
    let landing = Landing::Bundle(parts.into_iter().map(|(_, p, _)| p).collect());
    vec![(first, Part { landing, len, wire_len }, elems)]
}

/// The sends to one peer: (first ordinal, wire bytes, elements, a bundle's payload to keep
/// alive until the send completes) per frame.
#[allow(clippy::type_complexity)]
fn bundled_sends(parts: Vec<(u32, (*const u8, usize), usize)>) -> Vec<(u32, (*const u8, usize), usize, Option<Vec<u8>>)> {
    if !bundle_ok(parts.iter().map(|(_, (_, len), _)| *len)) {
        return parts.into_iter().map(|(o, b, e)| (o, b, e, None)).collect();
    }
    let mut payload = Vec::with_capacity(parts.iter().map(|(_, (_, len), _)| len).sum());
    for (_, (ptr, len), _) in &parts {
        payload.extend_from_slice(unsafe { bytes(*ptr, *len) });
    }
    let elems = parts.iter().map(|(_, _, e)| e).sum();
    let data = (payload.as_ptr(), payload.len());
    vec![(parts[0].0, data, elems, Some(payload))]
}

/// The next event of an operation, waiting until `until`. While callers read the links (a
/// small operation run on the waiting thread), this thread reads frames itself meanwhile and
/// finishes a frame it began by `frame_deadline` (the operation's deadline).
fn next_event(fabric: &Fabric, rx: &Receiver<Event>, until: Instant, frame_deadline: Instant) -> std::result::Result<Event, RecvTimeoutError> {
    loop {
        if !fabric.caller_progress() {
            return rx.recv_deadline(until);
        }
        match rx.try_recv() {
            Ok(ev) => return Ok(ev),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        let now = Instant::now();
        if now >= until {
            return Err(RecvTimeoutError::Timeout);
        }
        // Short waits: a send finished by a link's sender thread reports through `rx`, not a socket.
        fabric.progress((until - now).min(Duration::from_millis(2)), frame_deadline);
    }
}

/// A transfer that failed because its peer's socket closed says little about why: the peer may
/// have closed it because a third rank failed. Give the communicator a moment to learn the real
/// cause (an Abort frame, or the dead rank's own link closing) before blaming that peer.
fn better_explained(fabric: &Fabric, err: PlaitError) -> PlaitError {
    if !matches!(err, PlaitError::Peer { .. }) {
        return err;
    }
    let until = Instant::now() + Duration::from_millis(250);
    while Instant::now() < until {
        if let Some(first) = fabric.broken() {
            return first;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    err
}

fn with_waited(err: PlaitError, waited: Duration) -> PlaitError {
    match err {
        PlaitError::Peer { op, peer, addr, what, .. } => PlaitError::Peer { op, peer, addr, what, waited },
        other => other,
    }
}

/// A point-to-point transfer that has been started (its ordinal taken, its frame queued or its
/// receive posted) and not yet waited for. Starting happens on the caller's thread, in call
/// order, so transfers with the same peer and tag match in the order they were called.
pub struct P2pStarted {
    rx: Receiver<Event>,
    start: Instant,
    what: Arc<str>,
    peer: usize,
    kind: P2pKind,
}

enum P2pKind {
    Send,
    /// `keep` holds what the receive overwrote (in `copy`), to put back if it fails.
    Recv { keep: Arc<Keep>, copy: Vec<u8>, op_id: u64 },
}

/// Queues `data` for `peer` with `tag`.
pub fn start_send(fabric: &Fabric, peer: usize, tag: u64, dtype: DType, data: RawBuf, what: Arc<str>) -> Result<P2pStarted> {
    if let Some(err) = fabric.broken() {
        return Err(PlaitError::Broken(err.to_string()));
    }
    let start = Instant::now();
    let (tx, rx) = crossbeam_channel::bounded(1);
    let header = FrameHeader {
        kind: FrameKind::P2p as u8,
        dtype: dtype as u8,
        seq: tag,
        ordinal: fabric.p2p_ordinal(peer, tag),
        count: (data.len / dtype.size()) as u64,
        nbytes: data.len as u64,
        ..Default::default()
    };
    let addr = fabric.peer_addr(peer);
    let w = what.clone();
    fabric.link(peer).send(SendReq {
        header,
        data: SendBuf { ptr: data.ptr, len: data.len },
        done: Some(Box::new(move |r| {
            let result = r.map_err(|e| PlaitError::Peer { op: w.to_string(), peer, addr, what: format!("could not be sent to: {e}"), waited: Duration::ZERO });
            let _ = tx.send(Event { token: 0, result, source: peer });
        })),
    });
    Ok(P2pStarted { rx, start, what, peer, kind: P2pKind::Send })
}

/// Posts a receive into `dst` from `src` (any peer when None) with `tag`.
pub fn start_recv(fabric: &Fabric, src: Option<usize>, tag: u64, dtype: DType, dst: RawBuf, what: Arc<str>) -> Result<P2pStarted> {
    if let Some(err) = fabric.broken() {
        return Err(PlaitError::Broken(err.to_string()));
    }
    let start = Instant::now();
    let mut copy = fabric.mailbox.pool.take(dst.len);
    // SAFETY: dst is the caller's buffer and copy ours, both dst.len bytes, alive until the
    // receive has completed or been cancelled (finish_p2p).
    let keep = Arc::new(unsafe { Keep::new(dst.ptr, copy.as_mut_ptr(), dst.len) });
    let (tx, rx) = crossbeam_channel::bounded(1);
    let op_id = fabric.op_id();
    let expect = Expect {
        coll: 0,
        dtype: dtype as u8,
        op: 0,
        root: 0,
        count: (dst.len / dtype.size()) as u64,
        nbytes: dst.len as u64,
        sched_id: 0,
        layout_id: 0,
        what: what.clone(),
    };
    fabric.mailbox.post_p2p(src, tag, Posted { landing: Landing::Copy { dst: dst.ptr, keep: Some(keep.clone()) }, len: dst.len, wire: Wire::Native, expect, op_id, token: 0, events: tx });
    Ok(P2pStarted { rx, start, what, peer: src.unwrap_or(usize::MAX), kind: P2pKind::Recv { keep, copy, op_id } })
}

/// Waits for a started transfer; returns the peer it was with. On failure a receive's buffer
/// holds what it held before.
pub fn finish_p2p(fabric: &Fabric, p: P2pStarted, timeout: Duration) -> Result<usize> {
    let doing = match p.kind {
        P2pKind::Send => "take this message",
        P2pKind::Recv { .. } => "send",
    };
    let waited_for = if p.peer == usize::MAX { 0 } else { p.peer };
    let outcome = wait_one(fabric, &p.rx, p.start, timeout, &p.what, waited_for, doing);
    let result = match outcome {
        Ok(source) => Ok(source),
        Err((err, under_way)) => {
            let first = fabric.fail(err, true);
            let still_posted = match &p.kind {
                P2pKind::Recv { op_id, .. } => fabric.mailbox.cancel(*op_id) == 0,
                P2pKind::Send => true,
            };
            if under_way && still_posted {
                // The link thread reports once the shut socket fails it; only then is the
                // caller's memory free of it.
                let _ = p.rx.recv_timeout(Duration::from_secs(10));
            }
            if let P2pKind::Recv { keep, .. } = &p.kind {
                keep.restore();
            }
            Err(with_waited(first.for_op(&p.what), p.start.elapsed()))
        }
    };
    if let P2pKind::Recv { copy, .. } = p.kind {
        fabric.mailbox.pool.give(copy);
    }
    result
}

/// Sends `data` to `peer` with `tag`; returns once it is on the wire.
pub fn send_p2p(fabric: &Fabric, peer: usize, tag: u64, dtype: DType, data: RawBuf, timeout: Duration, what: Arc<str>) -> Result<()> {
    finish_p2p(fabric, start_send(fabric, peer, tag, dtype, data, what)?, timeout).map(|_| ())
}

/// Receives into `dst` from `src` (any peer when None) with `tag`; returns the sender.
pub fn recv_p2p(fabric: &Fabric, src: Option<usize>, tag: u64, dtype: DType, dst: RawBuf, timeout: Duration, what: Arc<str>) -> Result<usize> {
    finish_p2p(fabric, start_recv(fabric, src, tag, dtype, dst, what)?, timeout)
}

/// Waits for the single event of a point-to-point transfer. On error, says whether the
/// transfer is still under way (its event not yet received).
fn wait_one(fabric: &Fabric, rx: &Receiver<Event>, start: Instant, timeout: Duration, what: &str, peer: usize, doing: &str) -> std::result::Result<usize, (PlaitError, bool)> {
    let deadline = start + timeout;
    loop {
        match next_event(fabric, rx, deadline.min(Instant::now() + Duration::from_millis(100)), deadline) {
            Ok(ev) => return ev.result.map(|_| ev.source).map_err(|e| (e, false)),
            Err(_) => {
                if let Some(err) = fabric.broken() {
                    return Err((err, true));
                }
                if Instant::now() >= deadline {
                    return Err((PlaitError::Timeout {
                        op: what.to_string(),
                        waiting_on: format!("rank {peer} ({}) to {doing}", fabric.peer_addr(peer)),
                        waited: start.elapsed(),
                    }, true));
                }
            }
        }
    }
}
