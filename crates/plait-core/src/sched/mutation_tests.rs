//! The verifier against thousands of random edits of valid schedules (issue 18, item 6): each
//! mutant is either rejected by the verifier, or run on numbers (a second, concrete interpreter
//! of the step model, with blocks of random sizes, out of place and in place) and found to give
//! the collective's exact result. A mutant the verifier accepts that computes a wrong result
//! fails the test: the verifier would have passed a broken user schedule.

use super::gen::{algorithms, generate};
use super::verify::verify;
use super::{Buf, ChunkRef, Collective, LocalOp, RecvOp, Schedule, SendOp};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Every (rank, step) with at least one operation.
fn busy(s: &Schedule) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for (r, prog) in s.ranks.iter().enumerate() {
        for (k, st) in prog.iter().enumerate() {
            if !(st.sends.is_empty() && st.recvs.is_empty() && st.locals.is_empty()) {
                v.push((r, k));
            }
        }
    }
    v
}

fn other_chunk(rng: &mut Rng, c: ChunkRef, n: usize, slots: usize) -> ChunkRef {
    match rng.below(3) {
        0 => ChunkRef { buf: c.buf, index: ((c.index as usize + 1 + rng.below(n)) % n.max(1)) as u32 },
        1 => ChunkRef { buf: [Buf::Input, Buf::Output, Buf::Scratch][rng.below(3)], index: c.index },
        _ => ChunkRef { buf: Buf::Scratch, index: rng.below((slots.max(1)) * n) as u32 },
    }
}

/// One random edit; None when the picked place has nothing to edit.
fn mutate(s: &Schedule, rng: &mut Rng) -> Option<(Schedule, &'static str)> {
    let n = s.nranks;
    let places = busy(s);
    let &(r, k) = places.get(rng.below(places.len()))?;
    let mut m = s.clone();
    let st = &mut m.ranks[r][k];
    let kind = match rng.below(9) {
        0 if !st.sends.is_empty() => {
            st.sends.remove(rng.below(st.sends.len()));
            "drop a send"
        }
        1 if !st.recvs.is_empty() => {
            st.recvs.remove(rng.below(st.recvs.len()));
            "drop a receive"
        }
        2 if !st.locals.is_empty() => {
            st.locals.remove(rng.below(st.locals.len()));
            "drop a local"
        }
        3 if !st.sends.is_empty() && n > 2 => {
            let i = rng.below(st.sends.len());
            st.sends[i].peer = ((st.sends[i].peer as usize + 1 + rng.below(n - 1)) % n) as u32;
            "change a send's peer"
        }
        4 if st.sends.len() + st.recvs.len() > 0 => {
            let i = rng.below(st.sends.len() + st.recvs.len());
            if i < st.sends.len() {
                st.sends[i].src = other_chunk(rng, st.sends[i].src, n, s.scratch_slots);
            } else {
                let rv = &mut st.recvs[i - st.sends.len()];
                rv.dst = other_chunk(rng, rv.dst, n, s.scratch_slots);
            }
            "change a transfer's chunk"
        }
        5 if !st.recvs.is_empty() => {
            let i = rng.below(st.recvs.len());
            let rv = &mut st.recvs[i];
            rv.reduce_with = match rv.reduce_with {
                Some(_) if rng.below(2) == 0 => None,
                _ => Some(other_chunk(rng, rv.dst, n, s.scratch_slots)),
            };
            "change what a receive reduces with"
        }
        6 if !st.locals.is_empty() => {
            let i = rng.below(st.locals.len());
            st.locals[i] = match st.locals[i] {
                LocalOp::Copy { src, dst } => LocalOp::Reduce { src, dst },
                LocalOp::Reduce { src, dst } => LocalOp::Copy { src, dst },
            };
            "turn a copy into a reduction or back"
        }
        7 if m.nsteps() > 1 => {
            // Move one rank's step elsewhere: data used before it arrives, or a cycle of waits.
            let j = (k + 1 + rng.below(m.nsteps() - 1)) % m.nsteps();
            m.ranks[r].swap(k, j);
            "swap two steps of one rank"
        }
        8 if n > 1 => {
            // A transfer that closes a loop: r sends a chunk it may not have yet to a peer that
            // writes it over something it holds.
            let q = (r + 1 + rng.below(n - 1)) % n;
            let src = other_chunk(rng, ChunkRef::output(0), n, s.scratch_slots);
            let dst = other_chunk(rng, ChunkRef::output(0), n, s.scratch_slots);
            m.ranks[r][k].sends.push(SendOp { peer: q as u32, src });
            m.ranks[q][k].recvs.push(RecvOp { peer: r as u32, dst, reduce_with: None });
            "add a transfer"
        }
        _ => return None,
    };
    Some((m, kind))
}

/// Runs `s` on numbers: block b of rank p's input holds `p * 1000 + b * 10 + e` in element e
/// (blocks of `sizes[b]` elements). Returns every rank's output, or an error where the step
/// model cannot run it (a mismatched transfer, a chunk out of range or of another size).
fn run(s: &Schedule, sizes: &[usize], in_place: bool) -> Result<Vec<Vec<Vec<f64>>>, String> {
    let (n, coll, root) = (s.nranks, s.collective, s.root);
    let uninit = f64::NAN;
    // Per rank: input chunks, output chunks, scratch chunks; in place, aliased outputs point at inputs.
    struct Mem {
        chunks: Vec<Vec<f64>>,
        inputs: usize,
        outputs: usize,
        out_loc: Vec<usize>,
    }
    let mut mem: Vec<Mem> = (0..n)
        .map(|r| {
            let inputs = coll.input_chunks(n, r, root);
            let outputs = coll.output_chunks(n, r, root);
            let mut chunks = Vec::new();
            for c in 0..inputs {
                let b = ChunkRef::input(c as u32).block(coll, n, r, root);
                chunks.push((0..sizes[b]).map(|e| (r * 1000 + b * 10 + e) as f64).collect());
            }
            for c in 0..outputs {
                let b = ChunkRef::output(c as u32).block(coll, n, r, root);
                chunks.push(vec![uninit; sizes[b]]);
            }
            for c in 0..s.scratch_slots * n {
                chunks.push(vec![uninit; sizes[c % n]]);
            }
            let mut out_loc: Vec<usize> = (inputs..inputs + outputs).collect();
            if in_place {
                for (i, o) in coll.alias(n, r, root) {
                    out_loc[o as usize] = i as usize;
                }
            }
            Mem { chunks, inputs, outputs, out_loc }
        })
        .collect();
    let loc = |m: &Mem, c: ChunkRef| -> Result<usize, String> {
        let i = c.index as usize;
        match c.buf {
            Buf::Input if i < m.inputs => Ok(i),
            Buf::Output if i < m.outputs => Ok(m.out_loc[i]),
            Buf::Scratch if m.inputs + m.outputs + i < m.chunks.len() => Ok(m.inputs + m.outputs + i),
            _ => Err(format!("{c:?} out of range")),
        }
    };
    let write = |m: &mut Mem, c: ChunkRef, v: Vec<f64>| -> Result<(), String> {
        if c.buf == Buf::Input {
            return Err("writes the input".into());
        }
        let l = loc(m, c)?;
        if m.chunks[l].len() != v.len() {
            return Err("size mismatch".into());
        }
        m.chunks[l] = v;
        Ok(())
    };
    for k in 0..s.nsteps() {
        let mut wire: Vec<Vec<std::collections::VecDeque<Vec<f64>>>> = vec![vec![Default::default(); n]; n];
        for p in 0..n {
            for op in &s.ranks[p][k].sends {
                let q = op.peer as usize;
                if q >= n || q == p {
                    return Err("bad peer".into());
                }
                let l = loc(&mem[p], op.src)?;
                wire[p][q].push_back(mem[p].chunks[l].clone());
            }
        }
        for q in 0..n {
            for op in &s.ranks[q][k].recvs {
                let p = op.peer as usize;
                if p >= n || p == q {
                    return Err("bad peer".into());
                }
                let msg = wire[p][q].pop_front().ok_or("unmatched receive")?;
                let v = match op.reduce_with {
                    None => msg,
                    Some(c) => {
                        let base = &mem[q].chunks[loc(&mem[q], c)?];
                        if base.len() != msg.len() {
                            return Err("size mismatch".into());
                        }
                        base.iter().zip(&msg).map(|(a, b)| a + b).collect()
                    }
                };
                write(&mut mem[q], op.dst, v)?;
            }
        }
        if wire.iter().flatten().any(|w| !w.is_empty()) {
            return Err("unmatched send".into());
        }
        for r in 0..n {
            for op in &s.ranks[r][k].locals {
                let (src, dst) = match *op {
                    LocalOp::Copy { src, dst } | LocalOp::Reduce { src, dst } => (src, dst),
                };
                let v = mem[r].chunks[loc(&mem[r], src)?].clone();
                let v = match op {
                    LocalOp::Copy { .. } => v,
                    LocalOp::Reduce { .. } => {
                        let d = &mem[r].chunks[loc(&mem[r], dst)?];
                        if d.len() != v.len() {
                            return Err("size mismatch".into());
                        }
                        d.iter().zip(&v).map(|(a, b)| a + b).collect()
                    }
                };
                write(&mut mem[r], dst, v)?;
            }
        }
    }
    Ok((0..n).map(|r| (0..mem[r].outputs).map(|i| mem[r].chunks[mem[r].out_loc[i]].clone()).collect()).collect())
}

/// What rank r's output chunk i must hold.
fn expected(coll: Collective, n: usize, root: usize, r: usize, i: usize, sizes: &[usize]) -> Vec<f64> {
    let block = |p: usize, b: usize| -> Vec<f64> { (0..sizes[b]).map(|e| (p * 1000 + b * 10 + e) as f64).collect() };
    let sum = |b: usize| -> Vec<f64> {
        (0..sizes[b]).map(|e| (0..n).map(|p| (p * 1000 + b * 10 + e) as f64).sum()).collect()
    };
    match coll {
        Collective::AllReduce | Collective::Reduce => sum(i),
        Collective::ReduceScatter => sum(r),
        Collective::Broadcast => block(root, i),
        Collective::AllGather | Collective::Gather => block(i, i),
        Collective::Scatter => block(root, r),
        Collective::AllToAll => block(i, r),
    }
}

fn computes(s: &Schedule, sizes: &[usize]) -> Result<(), String> {
    let (n, coll, root) = (s.nranks, s.collective, s.root);
    for in_place in [false, true] {
        let out = run(s, sizes, in_place)?;
        for (r, chunks) in out.iter().enumerate() {
            for (i, got) in chunks.iter().enumerate() {
                let want = expected(coll, n, root, r, i, sizes);
                // NaN (never written) never equals anything.
                if got != &want {
                    return Err(format!("rank {r} output[{i}] wrong (in place: {in_place})"));
                }
            }
        }
    }
    Ok(())
}

#[test]
fn random_edits_of_valid_schedules_are_rejected_or_compute_the_right_result() {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let (mut total, mut rejected, mut accepted_right) = (0usize, 0usize, 0usize);
    let mut by_kind: std::collections::BTreeMap<&str, (usize, usize)> = Default::default();
    for coll in Collective::ALL {
        for &algo in algorithms(coll) {
            for n in 2..=5 {
                let root = if coll.rooted() { n - 1 } else { 0 };
                let s = generate(coll, algo, n, root).unwrap();
                // Uneven block sizes (alltoall's blocks are equal by definition).
                let sizes: Vec<usize> =
                    (0..n).map(|b| if coll == Collective::AllToAll { 2 } else { 1 + (b * 7 + 3) % 3 }).collect();
                computes(&s, &sizes).unwrap_or_else(|e| panic!("{coll} {algo} n={n} itself: {e}"));
                let mut made = 0;
                while made < 100 {
                    let Some((m, kind)) = mutate(&s, &mut rng) else { continue };
                    made += 1;
                    total += 1;
                    let e = by_kind.entry(kind).or_default();
                    e.0 += 1;
                    if verify(&m).is_err() {
                        rejected += 1;
                        e.1 += 1;
                        continue;
                    }
                    // Accepted: it must compute the collective exactly, on numbers.
                    if let Err(why) = computes(&m, &sizes) {
                        panic!("the verifier accepted a wrong schedule ({kind}) of {coll} {algo} n={n}: {why}");
                    }
                    accepted_right += 1;
                }
            }
        }
    }
    eprintln!("mutation test: {total} mutants, {rejected} rejected, {accepted_right} accepted and computing the right result");
    for (kind, (made, caught)) in &by_kind {
        eprintln!("  {kind}: {caught} of {made} rejected");
    }
    assert_eq!(rejected + accepted_right, total);
    assert!(total >= 8000, "{total}");
}

/// The mutants the verifier accepts, run by the real executor: ranks as threads over loopback,
/// every mutant registered as a custom schedule and forced by name, chunks cut into several
/// segments (the executor's pipelining), blocks of uneven sizes, out of place and in place.
#[test]
fn schedules_the_verifier_accepts_compute_the_right_result_on_the_executor() {
    use crate::comm::Communicator;
    use crate::sched::custom::{digest, CustomSchedule, When};
    use crate::{CollRequest, CommConfig, DType, MemStore, RawBuf, ReduceOp};
    use std::sync::Arc;
    use std::time::Duration;

    let mut rng = Rng(0x2545f4914f6cdd1d);
    let mut ran = 0;
    for coll in [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll] {
        for n in [3usize, 4] {
            let mut accepted: Vec<Arc<CustomSchedule>> = Vec::new();
            for &algo in algorithms(coll) {
                let s = generate(coll, algo, n, 0).unwrap();
                for _ in 0..150 {
                    let Some((mut m, _)) = mutate(&s, &mut rng) else { continue };
                    if verify(&m).is_err() {
                        continue;
                    }
                    m.name = format!("m{}", accepted.len());
                    let d = digest(&m);
                    if accepted.iter().any(|c| c.digest == d) {
                        continue;
                    }
                    accepted.push(Arc::new(CustomSchedule {
                        origin: "mutant".into(),
                        schedule: m,
                        when: When::default(),
                        description: String::new(),
                        digest: d,
                    }));
                }
            }
            ran += accepted.len();
            let names: Vec<String> = accepted.iter().map(|c| c.schedule.name.clone()).collect();
            let store = Arc::new(MemStore::new());
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let (store, accepted, names) = (store.clone(), accepted.clone(), names.clone());
                    std::thread::spawn(move || {
                        let mut cfg = CommConfig::from_env(rank, n).unwrap();
                        cfg.timeout = Duration::from_secs(20);
                        cfg.segment_bytes = 1024; // several segments per chunk
                        cfg.schedules = accepted;
                        let comm = Communicator::new(&*store, cfg).unwrap();
                        // 601 elements (2404 bytes, three segments) per block; an allreduce has one more.
                        let per = 601usize;
                        for name in &names {
                            let value = |r: usize, e: usize| (r * 1000 + e) as f32;
                            let (input, want): (Vec<f32>, Vec<f32>) = match coll {
                                Collective::AllReduce => {
                                    let len = per * n + 1;
                                    ((0..len).map(|e| value(rank, e)).collect(), (0..len).map(|e| (0..n).map(|r| value(r, e)).sum()).collect())
                                }
                                Collective::AllGather => (
                                    (0..per).map(|e| value(rank, e)).collect(),
                                    (0..n).flat_map(|r| (0..per).map(move |e| value(r, e))).collect(),
                                ),
                                Collective::ReduceScatter => (
                                    (0..per * n).map(|e| value(rank, e)).collect(),
                                    (0..per).map(|e| (0..n).map(|r| value(r, rank * per + e)).sum()).collect(),
                                ),
                                _ => (
                                    (0..per * n).map(|e| value(rank, e)).collect(),
                                    (0..n).flat_map(|r| (0..per).map(move |e| value(r, rank * per + e))).collect(),
                                ),
                            };
                            let mut input = input;
                            let mut output = vec![f32::NAN; want.len()];
                            let buf = |v: &mut Vec<f32>| RawBuf { ptr: v.as_mut_ptr() as *mut u8, len: v.len() * 4 };
                            let req = CollRequest {
                                coll,
                                dtype: DType::F32,
                                op: ReduceOp::Sum,
                                root: 0,
                                input: buf(&mut input),
                                output: buf(&mut output),
                                send_counts: None,
                                recv_counts: None,
                                timeout: None,
                                algo: Some(name.clone()),
                                wire: None,
                            };
                            // SAFETY: both buffers outlive the wait below.
                            let w = unsafe { comm.collective(req, true) }.unwrap();
                            w.wait(None).unwrap().unwrap();
                            assert_eq!(output, want, "{coll} mutant {name} on rank {rank}");
                            if coll == Collective::AllReduce {
                                // In place: the input is the output.
                                let mut both: Vec<f32> = (0..want.len()).map(|e| value(rank, e)).collect();
                                let mut req = CollRequest::allreduce(buf(&mut both), DType::F32, ReduceOp::Sum);
                                req.algo = Some(name.clone());
                                // SAFETY: `both` outlives the wait below.
                                let w = unsafe { comm.collective(req, true) }.unwrap();
                                w.wait(None).unwrap().unwrap();
                                assert_eq!(both, want, "{coll} mutant {name} in place on rank {rank}");
                            }
                        }
                        comm.close();
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        }
    }
    eprintln!("executor: {ran} accepted mutants ran and computed the right result");
    assert!(ran >= 50, "{ran}");
}
