//! Symbolic simulator: runs a schedule on *contents* instead of data and checks that it is
//! well formed, race free and computes its collective, both out of place and in place.
//!
//! A chunk's content is the layout block it carries plus the set of ranks whose contribution
//! it sums; rank p's Input chunk c initially holds (block of c, {p}). Everything else starts
//! uninitialised, except that in place an Input chunk and its aliased Output chunk are one
//! memory location (a write to either is seen through both).

use super::{Buf, ChunkRef, Collective, LocalOp, Schedule};
use crate::error::PlaitError;
use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;

/// Parses a custom (JSON) schedule and verifies it before handing it out. Only tests call it
/// until users can register schedules (the custom-schedules issue).
#[cfg_attr(not(test), allow(dead_code))]
pub fn from_json(text: &str) -> Result<Schedule, PlaitError> {
    let s: Schedule = serde_json::from_str(text)
        .map_err(|e| PlaitError::Config(format!("custom schedule: malformed JSON: {e}")))?;
    verify(&s).map_err(|e| {
        PlaitError::Config(format!("custom schedule '{}' ({}): {e}", s.name, s.collective))
    })?;
    Ok(s)
}

pub fn verify(s: &Schedule) -> Result<(), String> {
    check_shape(s)?;
    Sim::new(s, false).run().map_err(|e| format!("out of place: {e}"))?;
    let n = s.nranks;
    if (0..n).any(|r| !s.collective.alias(n, r, s.root).is_empty()) {
        Sim::new(s, true).run().map_err(|e| format!("in place: {e}"))?;
    }
    Ok(())
}

fn check_shape(s: &Schedule) -> Result<(), String> {
    let n = s.nranks;
    if n == 0 {
        return Err("nranks is 0".into());
    }
    if s.ranks.len() != n {
        return Err(format!("nranks is {n} but {} rank programs are given", s.ranks.len()));
    }
    if s.root >= n {
        return Err(format!("root {} out of range for {n} ranks", s.root));
    }
    let steps = s.nsteps();
    if let Some(r) = (0..n).find(|&r| s.ranks[r].len() != steps) {
        return Err(format!("rank {r} has {} steps, others up to {steps}", s.ranks[r].len()));
    }
    Ok(())
}

/// alltoall moves Input_p block q into Output_q chunk p: its blocks are equal by definition,
/// so chunks of different layout blocks may exchange data.
fn uniform_blocks(coll: Collective) -> bool {
    coll == Collective::AllToAll
}

fn chunk_name(c: ChunkRef, n: usize) -> String {
    match c.buf {
        Buf::Input => format!("input[{}]", c.index),
        Buf::Output => format!("output[{}]", c.index),
        Buf::Scratch => {
            let n = n.max(1) as u32;
            format!("scratch[slot {} block {}]", c.index / n, c.index % n)
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Content {
    block: usize,
    /// Bitset of contributing ranks.
    ranks: Vec<u64>,
}

impl Content {
    fn one(block: usize, rank: usize, n: usize) -> Self {
        let mut ranks = vec![0u64; n.div_ceil(64)];
        ranks[rank / 64] |= 1 << (rank % 64);
        Content { block, ranks }
    }

    fn all(block: usize, n: usize) -> Self {
        let mut c = Content { block, ranks: vec![0u64; n.div_ceil(64)] };
        for r in 0..n {
            c.ranks[r / 64] |= 1 << (r % 64);
        }
        c
    }

    fn combine(&self, other: &Content) -> Result<Content, String> {
        if self.block != other.block {
            return Err(format!("combines {self} with {other}: different blocks"));
        }
        if self.ranks.iter().zip(&other.ranks).any(|(a, b)| a & b != 0) {
            return Err(format!("combines {self} with {other}: a contribution counted twice"));
        }
        let ranks = self.ranks.iter().zip(&other.ranks).map(|(a, b)| a | b).collect();
        Ok(Content { block: self.block, ranks })
    }
}

impl Content {
    fn has(&self, rank: usize) -> bool {
        self.ranks.get(rank / 64).is_some_and(|w| w & (1 << (rank % 64)) != 0)
    }

    fn members(&self) -> Vec<usize> {
        (0..self.ranks.len() * 64).filter(|&q| self.has(q)).collect()
    }

    /// "block 3 from rank 1", "block 0 reduced over all 4 ranks", "block 0 reduced over ranks 0, 2".
    fn words(&self, n: usize) -> String {
        let m = self.members();
        match m.len() {
            1 => format!("block {} from rank {}", self.block, m[0]),
            k if k == n => format!("block {} reduced over all {n} ranks", self.block),
            _ => format!(
                "block {} reduced over ranks {}",
                self.block,
                m.iter().map(|q| q.to_string()).collect::<Vec<_>>().join(", ")
            ),
        }
    }
}

impl std::fmt::Display for Content {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut list = String::new();
        for (w, bits) in self.ranks.iter().enumerate() {
            for b in 0..64 {
                if bits & (1 << b) != 0 {
                    let _ =
                        write!(list, "{}{}", if list.is_empty() { "" } else { "," }, w * 64 + b);
                }
            }
        }
        write!(f, "block {} of ranks {{{list}}}", self.block)
    }
}

/// One rank's memory: Input chunks, then Output chunks, then Scratch; in place an aliased
/// Output chunk maps to its Input chunk's location.
struct Mem {
    inputs: usize,
    outputs: usize,
    scratch: usize,
    out_loc: Vec<usize>,
    cells: Vec<Option<Content>>,
}

struct Sim<'a> {
    s: &'a Schedule,
    n: usize,
    mem: Vec<Mem>,
}

impl<'a> Sim<'a> {
    fn new(s: &'a Schedule, in_place: bool) -> Self {
        let (n, coll, root) = (s.nranks, s.collective, s.root);
        let mem = (0..n)
            .map(|r| {
                let inputs = coll.input_chunks(n, r, root);
                let outputs = coll.output_chunks(n, r, root);
                let scratch = s.scratch_slots * n;
                let mut out_loc: Vec<usize> = (inputs..inputs + outputs).collect();
                if in_place {
                    for (i, o) in coll.alias(n, r, root) {
                        out_loc[o as usize] = i as usize;
                    }
                }
                let mut cells = vec![None; inputs + outputs + scratch];
                for (c, cell) in cells.iter_mut().enumerate().take(inputs) {
                    let block = ChunkRef::input(c as u32).block(coll, n, r, root);
                    *cell = Some(Content::one(block, r, n));
                }
                Mem { inputs, outputs, scratch, out_loc, cells }
            })
            .collect();
        Sim { s, n, mem }
    }

    fn loc(&self, r: usize, c: ChunkRef) -> Result<usize, String> {
        let m = &self.mem[r];
        let i = c.index as usize;
        let (ok, loc) = match c.buf {
            Buf::Input => (i < m.inputs, i),
            Buf::Output => (i < m.outputs, m.out_loc.get(i).copied().unwrap_or(0)),
            Buf::Scratch => (i < m.scratch, m.inputs + m.outputs + i),
        };
        if !ok {
            let have = match c.buf {
                Buf::Input => format!("{} input chunks", m.inputs),
                Buf::Output => format!("{} output chunks", m.outputs),
                Buf::Scratch => format!("{} scratch slots", self.s.scratch_slots),
            };
            return Err(format!("{} out of range (rank has {have})", chunk_name(c, self.n)));
        }
        Ok(loc)
    }

    fn writable(&self, r: usize, c: ChunkRef) -> Result<usize, String> {
        if c.buf == Buf::Input {
            return Err(format!("writes {}, but the input is read-only", chunk_name(c, self.n)));
        }
        self.loc(r, c)
    }

    fn read(&self, r: usize, c: ChunkRef) -> Result<Content, String> {
        let loc = self.loc(r, c)?;
        self.mem[r].cells[loc]
            .clone()
            .ok_or_else(|| format!("reads uninitialised {}", chunk_name(c, self.n)))
    }

    fn block(&self, r: usize, c: ChunkRef) -> usize {
        c.block(self.s.collective, self.n, r, self.s.root)
    }

    fn same_size(&self, r: usize, a: ChunkRef, q: usize, b: ChunkRef) -> Result<(), String> {
        let (ba, bb) = (self.block(r, a), self.block(q, b));
        if ba != bb && !uniform_blocks(self.s.collective) {
            return Err(format!(
                "{} (block {ba}) and {} (block {bb}) have different sizes",
                chunk_name(a, self.n),
                chunk_name(b, self.n)
            ));
        }
        Ok(())
    }

    fn run(mut self) -> Result<(), String> {
        for k in 0..self.s.nsteps() {
            self.step(k)?;
        }
        self.check_result()
    }

    fn step(&mut self, k: usize) -> Result<(), String> {
        let (s, n) = (self.s, self.n);
        let at = |r: usize, e: String| format!("rank {r} step {k}: {e}");
        // Messages are read from the state before the step: all transfers are concurrent.
        let mut wire: HashMap<(usize, usize), VecDeque<(ChunkRef, Content)>> = HashMap::new();
        for p in 0..n {
            for (i, op) in s.ranks[p][k].sends.iter().enumerate() {
                let q = op.peer as usize;
                if q >= n || q == p {
                    return Err(at(p, format!("send #{i} to invalid peer {q}")));
                }
                let content =
                    self.read(p, op.src).map_err(|e| at(p, format!("send to {q} {e}")))?;
                wire.entry((p, q)).or_default().push_back((op.src, content));
            }
        }
        for r in 0..n {
            self.hazards(r, k).map_err(|e| at(r, e))?;
        }
        for q in 0..n {
            for op in &s.ranks[q][k].recvs {
                let p = op.peer as usize;
                if p >= n || p == q {
                    return Err(at(q, format!("receive from invalid peer {p}")));
                }
                let dst = op.dst;
                let Some((src, msg)) = wire.get_mut(&(p, q)).and_then(|w| w.pop_front()) else {
                    let sent = s.ranks[p][k].sends.iter().filter(|o| o.peer as usize == q).count();
                    let want = s.ranks[q][k].recvs.iter().filter(|o| o.peer as usize == p).count();
                    return Err(at(
                        q,
                        format!(
                            "receive into {} from rank {p} has no matching send \
                             (rank {p} sends {sent} message(s) to {q}, {q} expects {want})",
                            chunk_name(dst, n)
                        ),
                    ));
                };
                self.same_size(p, src, q, dst)
                    .map_err(|e| at(q, format!("message from rank {p}: {e}")))?;
                let loc = self.writable(q, dst).map_err(|e| at(q, e))?;
                let value = match op.reduce_with {
                    None => msg,
                    Some(c) => {
                        self.same_size(q, c, q, dst).map_err(|e| at(q, e))?;
                        let base = self.read(q, c).map_err(|e| at(q, format!("receive {e}")))?;
                        base.combine(&msg).map_err(|e| {
                            at(q, format!("receive from {p} into {}: {e}", chunk_name(dst, n)))
                        })?
                    }
                };
                self.mem[q].cells[loc] = Some(value);
            }
        }
        if let Some((&(p, q), w)) = wire.iter().filter(|(_, w)| !w.is_empty()).min_by_key(|e| e.0) {
            return Err(at(
                p,
                format!(
                    "send of {} to rank {q} has no matching receive ({} unmatched)",
                    chunk_name(w[0].0, n),
                    w.len()
                ),
            ));
        }
        for r in 0..n {
            for op in &s.ranks[r][k].locals {
                self.local(r, op).map_err(|e| at(r, e))?;
            }
        }
        Ok(())
    }

    /// Within a step, transfers run concurrently: a chunk a receive writes may not be read by
    /// another transfer of the step, and only accumulating receives may share a destination.
    fn hazards(&self, r: usize, k: usize) -> Result<(), String> {
        let st = &self.s.ranks[r][k];
        let mut reads: HashMap<usize, ChunkRef> = HashMap::new();
        for op in &st.sends {
            reads.insert(self.loc(r, op.src)?, op.src);
        }
        // location -> (chunk, every writer accumulates)
        let mut writes: HashMap<usize, (ChunkRef, bool)> = HashMap::new();
        let mut base_reads: Vec<(usize, ChunkRef)> = Vec::new();
        for op in &st.recvs {
            let d = self.writable(r, op.dst)?;
            let base = op.reduce_with.map(|c| self.loc(r, c)).transpose()?;
            let accumulates = base == Some(d);
            if let (Some(b), Some(c)) = (base, op.reduce_with) {
                if b != d {
                    base_reads.push((b, c));
                }
            }
            match writes.get_mut(&d) {
                None => {
                    writes.insert(d, (op.dst, accumulates));
                }
                Some((_, all_acc)) => {
                    if !(*all_acc && accumulates) {
                        return Err(format!(
                            "two receives write {} in the same step (only accumulating \
                             receives, reduce_with == dst, may share a destination)",
                            chunk_name(op.dst, self.n)
                        ));
                    }
                }
            }
        }
        for (loc, (c, _)) in &writes {
            if let Some(src) = reads.get(loc) {
                return Err(format!(
                    "a receive writes {} while a send of the same step reads {}",
                    chunk_name(*c, self.n),
                    chunk_name(*src, self.n)
                ));
            }
        }
        for (loc, c) in base_reads {
            if let Some((w, _)) = writes.get(&loc) {
                return Err(format!(
                    "a receive reduces with {} while another receive of the same step writes {}",
                    chunk_name(c, self.n),
                    chunk_name(*w, self.n)
                ));
            }
        }
        Ok(())
    }

    fn local(&mut self, r: usize, op: &LocalOp) -> Result<(), String> {
        let (src, dst) = match *op {
            LocalOp::Copy { src, dst } | LocalOp::Reduce { src, dst } => (src, dst),
        };
        self.same_size(r, src, r, dst)?;
        let loc = self.writable(r, dst)?;
        let v = self.read(r, src).map_err(|e| format!("local op {e}"))?;
        let value = match op {
            LocalOp::Copy { .. } => v,
            LocalOp::Reduce { .. } => {
                let d = self.read(r, dst).map_err(|e| format!("local reduce {e}"))?;
                d.combine(&v).map_err(|e| {
                    format!(
                        "local reduce of {} into {}: {e}",
                        chunk_name(src, self.n),
                        chunk_name(dst, self.n)
                    )
                })?
            }
        };
        self.mem[r].cells[loc] = Some(value);
        Ok(())
    }

    fn check_result(&self) -> Result<(), String> {
        let (n, root, coll) = (self.n, self.s.root, self.s.collective);
        for r in 0..n {
            for i in 0..self.mem[r].outputs {
                let want = expected(coll, n, root, r, i);
                let c = ChunkRef::output(i as u32);
                let got = &self.mem[r].cells[self.loc(r, c)?];
                if got.as_ref() != Some(&want) {
                    return Err(wrong_result(r, &chunk_name(c, n), got.as_ref(), &want, n));
                }
            }
        }
        Ok(())
    }
}

/// Why rank `r`'s output chunk `name` is not what the collective promises, in words that say
/// what is missing: "rank 2 never receives output[3] (block 3 from rank 1)".
fn wrong_result(r: usize, name: &str, got: Option<&Content>, want: &Content, n: usize) -> String {
    let Some(got) = got else {
        return format!("rank {r} never receives {name}: no step writes it (it should end with {})", want.words(n));
    };
    if got.block != want.block {
        return format!("rank {r} ends with {} in {name}, where {} belongs", got.words(n), want.words(n));
    }
    let missing: Vec<usize> = want.members().into_iter().filter(|q| !got.has(*q)).collect();
    let extra: Vec<usize> = got.members().into_iter().filter(|q| !want.has(*q)).collect();
    let list = |v: &[usize]| v.iter().map(|q| q.to_string()).collect::<Vec<_>>().join(", ");
    match (missing.is_empty(), extra.is_empty()) {
        (false, true) if got.members().len() > 1 || want.members().len() > 1 => format!(
            "rank {r} ends with {} in {name}: the contribution of rank(s) {} never reaches it (it should end with {})",
            got.words(n),
            list(&missing),
            want.words(n)
        ),
        _ => format!("rank {r} ends with {} in {name}, but it should end with {}", got.words(n), want.words(n)),
    }
}

/// The post-condition: what rank r's Output chunk i must hold.
fn expected(coll: Collective, n: usize, root: usize, r: usize, i: usize) -> Content {
    match coll {
        Collective::AllReduce | Collective::Reduce => Content::all(i, n),
        Collective::ReduceScatter => Content::all(r, n),
        Collective::Broadcast => Content::one(i, root, n),
        Collective::AllGather | Collective::Gather => Content::one(i, i, n),
        Collective::Scatter => Content::one(r, root, n),
        Collective::AllToAll => Content::one(r, i, n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::gen::{algorithms, generate};
    use crate::sched::{RecvOp, SendOp, Step};

    fn gen(coll: Collective, algo: &str, n: usize) -> Schedule {
        generate(coll, algo, n, 0).unwrap()
    }

    fn fails(s: &Schedule, needle: &str) -> String {
        let e = verify(s).expect_err("broken schedule passed");
        assert!(e.contains(needle), "expected '{needle}' in: {e}");
        e
    }

    #[test]
    fn dropped_send() {
        let mut s = gen(Collective::AllReduce, "ring", 4);
        s.ranks[2][1].sends.clear();
        let e = fails(&s, "no matching send");
        assert!(e.contains("rank 3 step 1"), "{e}");
    }

    #[test]
    fn dropped_recv() {
        let mut s = gen(Collective::AllGather, "direct", 3);
        s.ranks[1][0].recvs.remove(0);
        fails(&s, "no matching receive");
    }

    #[test]
    fn double_count() {
        let mut s = gen(Collective::AllReduce, "oneshot", 3);
        let extra = LocalOp::Reduce { src: ChunkRef::input(1), dst: ChunkRef::output(1) };
        s.ranks[0][0].locals.push(extra);
        fails(&s, "counted twice");
    }

    #[test]
    fn uninitialised_read() {
        let mut s = gen(Collective::AllGather, "ring", 4);
        s.ranks[1][0].sends[0].src = ChunkRef::output(1);
        let e = fails(&s, "uninitialised output[1]");
        assert!(e.starts_with("out of place: rank 1 step 0"), "{e}");
    }

    #[test]
    fn missing_result() {
        let mut s = gen(Collective::Broadcast, "chain", 3);
        s.ranks[0][0].locals.clear();
        fails(&s, "rank 0 never receives output[0]: no step writes it (it should end with block 0 from rank 0)");
    }

    #[test]
    fn result_errors_say_what_never_arrives() {
        // An allreduce that forgets one reduction: a contribution is missing at the end.
        let mut s = gen(Collective::AllReduce, "ring", 3);
        let (r, k, i) = (0..3)
            .flat_map(|r| (0..s.nsteps()).map(move |k| (r, k)))
            .find_map(|(r, k)| s.ranks[r][k].recvs.iter().position(|o| o.reduce_with.is_some()).map(|i| (r, k, i)))
            .expect("ring reduces as it receives");
        s.ranks[r][k].recvs[i].reduce_with = None;
        let e = verify(&s).unwrap_err();
        assert!(e.contains("never reaches it") || e.contains("reduced over"), "{e}");
        // An allgather that never delivers rank 1's block to rank 2.
        let mut s = gen(Collective::AllGather, "direct", 3);
        let k = (0..s.nsteps()).find(|&k| s.ranks[1][k].sends.iter().any(|o| o.peer == 2)).unwrap();
        s.ranks[1][k].sends.retain(|o| o.peer != 2);
        s.ranks[2][k].recvs.retain(|o| o.peer != 1);
        let e = fails(&s, "rank 2 never receives output[1]");
        assert!(e.contains("block 1 from rank 1"), "{e}");
    }

    #[test]
    fn receive_over_chunk_being_sent() {
        let mut s = gen(Collective::AllGather, "ring", 3);
        // Step 1: rank 0 forwards output[2] and receives output[1]; redirect the receive.
        s.ranks[0][1].recvs[0].dst = ChunkRef::output(2);
        fails(&s, "while a send of the same step reads output[2]");
    }

    #[test]
    fn two_plain_receives_into_one_chunk() {
        let mut s = gen(Collective::AllGather, "direct", 3);
        s.ranks[0][0].recvs[1].dst = s.ranks[0][0].recvs[0].dst;
        fails(&s, "two receives write");
    }

    #[test]
    fn reduce_base_written_concurrently() {
        let mut s = gen(Collective::AllReduce, "direct", 3);
        // Step 2 receives plain copies; make one reduce with a chunk another one writes.
        let other = s.ranks[0][2].recvs[1].dst;
        s.ranks[0][2].recvs[0].reduce_with = Some(other);
        fails(&s, "reduces with");
    }

    #[test]
    fn writes_to_input_and_bad_refs() {
        let mut s = gen(Collective::AllGather, "direct", 2);
        s.ranks[0][0].recvs[0].dst = ChunkRef::input(0);
        fails(&s, "read-only");
        let mut s = gen(Collective::AllReduce, "ring", 2);
        s.ranks[0][0].sends[0].src = ChunkRef::input(7);
        fails(&s, "out of range");
        let mut s = gen(Collective::AllReduce, "ring", 2);
        s.ranks[0].pop();
        fails(&s, "steps");
    }

    #[test]
    fn block_size_mismatch() {
        let mut s = gen(Collective::AllReduce, "direct", 3);
        s.ranks[1][2].recvs[0].dst = ChunkRef::output(2);
        s.ranks[1][2].recvs[1].dst = ChunkRef::output(0);
        fails(&s, "different sizes");
    }

    /// Correct out of place, wrong in place: the own contribution is overwritten before use.
    #[test]
    fn in_place_only_bug() {
        let n = 2;
        let mut ranks = vec![vec![Step::default()]; n];
        for (r, prog) in ranks.iter_mut().enumerate() {
            let st = &mut prog[0];
            for j in 0..n as u32 {
                st.sends.push(SendOp { peer: (1 - r) as u32, src: ChunkRef::input(j) });
                let tmp = ChunkRef::scratch(0, n, j);
                st.recvs.push(RecvOp { peer: (1 - r) as u32, dst: tmp, reduce_with: None });
                st.locals.push(LocalOp::Copy { src: tmp, dst: ChunkRef::output(j) });
                st.locals
                    .push(LocalOp::Reduce { src: ChunkRef::input(j), dst: ChunkRef::output(j) });
            }
        }
        let s = Schedule {
            name: "naive".into(),
            collective: Collective::AllReduce,
            nranks: n,
            root: 0,
            scratch_slots: 1,
            ranks,
            variant: String::new(),
        };
        let e = fails(&s, "counted twice");
        assert!(e.starts_with("in place:"), "{e}");
    }

    #[test]
    fn json_round_trip_and_rejection() {
        let s = gen(Collective::ReduceScatter, "ring", 5);
        let text = serde_json::to_string(&s).unwrap();
        assert_eq!(from_json(&text).unwrap(), s);
        let mut broken = s.clone();
        broken.ranks[0][0].sends.clear();
        let e = from_json(&serde_json::to_string(&broken).unwrap()).unwrap_err();
        assert!(matches!(e, PlaitError::Config(_)) && e.to_string().contains("no matching"), "{e}");
        assert!(matches!(from_json("{\"name\":"), Err(PlaitError::Config(_))));
        // Hand-written: defaults for omitted fields.
        let text = r#"{"name":"mine","collective":"broadcast","nranks":2,"ranks":[
            [{"sends":[{"peer":1,"src":{"buf":"input","index":0}},{"peer":1,"src":{"buf":"input","index":1}}],
              "locals":[{"copy":{"src":{"buf":"input","index":0},"dst":{"buf":"output","index":0}}},
                        {"copy":{"src":{"buf":"input","index":1},"dst":{"buf":"output","index":1}}}]}],
            [{"recvs":[{"peer":0,"dst":{"buf":"output","index":0}},{"peer":0,"dst":{"buf":"output","index":1}}]}]]}"#;
        from_json(text).unwrap();
    }

    /// The generators contain no redundant operation and the verifier is strict enough to
    /// notice any single one missing (copies that are no-ops in place still matter out of
    /// place).
    #[test]
    fn every_single_deletion_is_caught() {
        let mut checked = 0;
        for coll in Collective::ALL {
            for &a in algorithms(coll) {
                for (n, root) in (1..=6).flat_map(|n| [(n, 0), (n, n - 1)]) {
                    let s = generate(coll, a, n, root).unwrap();
                    for (r, k) in (0..n).flat_map(|r| (0..s.nsteps()).map(move |k| (r, k))) {
                        let st = &s.ranks[r][k];
                        let mut mutants = Vec::new();
                        for i in 0..st.locals.len() {
                            let mut m = s.clone();
                            m.ranks[r][k].locals.remove(i);
                            mutants.push(m);
                        }
                        for i in 0..st.sends.len() {
                            let mut m = s.clone();
                            m.ranks[r][k].sends.remove(i);
                            mutants.push(m);
                        }
                        for i in (0..st.recvs.len()).filter(|&i| st.recvs[i].reduce_with.is_some())
                        {
                            let mut m = s.clone();
                            m.ranks[r][k].recvs[i].reduce_with = None;
                            mutants.push(m);
                        }
                        for m in mutants {
                            assert!(
                                verify(&m).is_err(),
                                "{coll} {a} n={n} root={root} r={r} k={k}"
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 5000, "{checked}");
    }
}
