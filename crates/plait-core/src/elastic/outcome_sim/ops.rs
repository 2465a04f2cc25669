//! One process's user thread, as `comm.rs` runs its calls: `ElasticComm::collective` (catch_up,
//! the mesh, `complete`, the barrier, `wait_past` and the decision), `update` and `close`, under
//! the same names. A blocking call is a `Step` the world resumes when what it waits for happens
//! (a mesh's completion or failure, a control-plane change, its deadline); every other step takes
//! a moment of its own, so control events interleave with the call as they do between threads.

use super::{Ev, Fault, Local, Time, World, HB, STARTUP, TIMEOUT};
use crate::elastic::agree::MemberId;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Kind {
    Update,
    Allreduce,
    Barrier,
}

/// One member's part of one mesh call: what it contributed, and for which of its operations.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Contribution {
    pub member: MemberId,
    pub epoch: u64,
    pub seq: u64,
    pub kind: Kind,
    pub value: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Returned Ok, with what the allreduce combined.
    Ok(Vec<Contribution>),
    PeerLost,
    /// A joiner's first `update()`, answered at once.
    Admitted,
    /// Any other error (`Evicted`, `Broken`, a timeout): this member stops.
    Failed(&'static str),
}

/// A user call as the user saw it return.
#[derive(Clone, Debug)]
pub(super) struct Record {
    pub kind: Kind,
    /// (epoch, seq) of the operation it was, if it got a number.
    pub op: Option<(u64, u64)>,
    pub outcome: Outcome,
}

/// `comm::Ops`.
pub(super) struct Ops {
    pub epoch: u64,
    pub members: Vec<MemberId>,
    pub seq: u64,
    pub lost_track: bool,
    /// The epoch of this member's mesh, once built.
    pub mesh: Option<u64>,
    pub admitted: bool,
}

/// The call under way.
struct Call {
    kind: Kind,
    value: i64,
    epoch: u64,
    seq: u64,
    /// The output buffer, and the copy `collective` keeps to restore it.
    buffer: i64,
    saved: i64,
    result: Option<Vec<Contribution>>,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Step {
    Joining { deadline: Time },
    Idle,
    Begin,
    Mesh,
    Building { deadline: Time },
    Run { call: usize, deadline: Time },
    Complete,
    Barrier { call: usize, deadline: Time },
    WaitPast { completed: bool, deadline: Time },
    UpdateWait { epoch: u64, deadline: Time },
    Leaving { deadline: Time },
    Done,
}

impl Step {
    /// Whether this step waits on the control plane (a change there may end it).
    pub fn watches_control(&self) -> bool {
        matches!(self, Step::Joining { .. } | Step::Building { .. } | Step::WaitPast { .. } | Step::UpdateWait { .. } | Step::Leaving { .. })
    }
}

pub(super) struct User {
    pub ops: Ops,
    pub step: Step,
    call: Option<Call>,
    /// The mesh the freeze hook aborts (`set_on_freeze`).
    pub hook: Option<u64>,
    pub log: Vec<Record>,
    /// The loop is `update(); allreduce`: whether the last call was the update.
    updated_last: bool,
    /// Inside `update()` (`ElasticComm::in_update`).
    pub in_update: bool,
    /// Set by the chaos driver: this member calls `close()` after this many calls.
    pub leave_after: Option<usize>,
}

impl User {
    pub fn founder(epoch: u64, members: Vec<MemberId>) -> User {
        User::new(Ops { epoch, members, seq: 0, lost_track: false, mesh: None, admitted: false }, Step::Idle)
    }

    pub fn joiner(deadline: Time) -> User {
        User::new(Ops { epoch: 0, members: Vec::new(), seq: 0, lost_track: false, mesh: None, admitted: false }, Step::Joining { deadline })
    }

    /// The witness: no calls.
    pub fn none() -> User {
        User::new(Ops { epoch: 0, members: Vec::new(), seq: 0, lost_track: false, mesh: None, admitted: false }, Step::Done)
    }

    fn new(ops: Ops, step: Step) -> User {
        User { ops, step, call: None, hook: None, log: Vec::new(), updated_last: false, in_update: false, leave_after: None }
    }
}

impl World {
    /// Runs `id`'s user thread one step.
    pub(super) fn step(&mut self, id: MemberId) {
        let step = self.user(id).step;
        match step {
            Step::Done => {}
            Step::Joining { deadline } => self.joining(id, deadline),
            Step::Idle => self.next_call(id),
            Step::Begin => self.collective(id),
            Step::Mesh => self.mesh(id),
            Step::Building { deadline } => self.building(id, deadline),
            Step::Run { call, deadline } => self.in_flight(id, call, deadline),
            Step::Complete => self.complete(id),
            Step::Barrier { call, deadline } => self.barrier(id, call, deadline),
            Step::WaitPast { completed, deadline } => self.wait_past(id, completed, deadline),
            Step::UpdateWait { epoch, deadline } => self.update_wait(id, epoch, deadline),
            Step::Leaving { deadline } => self.leaving(id, deadline),
        }
    }

    /// Moves to `step` after a moment.
    fn go(&mut self, id: MemberId, step: Step) {
        self.user(id).step = step;
        let delay = self.sched.rng.below(2);
        self.sched.after(delay, Ev::Step(id));
    }

    /// Blocks in `step`: looked at again at once, when something it waits for happens, and at
    /// `deadline`.
    fn block(&mut self, id: MemberId, step: Step, deadline: Time) {
        self.user(id).step = step;
        self.sched.after(0, Ev::Step(id));
        self.sched.at(deadline, Ev::Step(id));
    }

    /// `Control::join` returned: `ElasticComm::start` numbers this member's calls from its
    /// admitting epoch.
    fn joining(&mut self, id: MemberId, deadline: Time) {
        let ctl = &self.procs[&id].ctl;
        if ctl.member {
            let epoch = ctl.first_epoch();
            let members = ctl.decisions.get(&epoch).map(|d| d.members.clone()).unwrap_or_default();
            let u = self.user(id);
            u.ops = Ops { epoch, members, seq: 0, lost_track: false, mesh: None, admitted: true };
            self.stats.joined += 1;
            self.note(|| format!("{id}: admitted, numbered from epoch {epoch}"));
            self.go(id, Step::Idle);
        } else if self.sched.now >= deadline {
            self.exit(id);
        }
    }

    /// The loop: `update(); allreduce`, until the chaos driver asks this member to leave.
    fn next_call(&mut self, id: MemberId) {
        let u = self.user(id);
        u.in_update = false;
        if u.leave_after.is_some_and(|n| u.log.len() >= n) {
            return self.close(id);
        }
        u.updated_last = !u.updated_last;
        if u.updated_last {
            self.update(id)
        } else {
            self.start(id, Kind::Allreduce, id as i64 + 1)
        }
    }

    /// `ElasticComm::update`, up to its collective.
    fn update(&mut self, id: MemberId) {
        if std::mem::take(&mut self.user(id).ops.admitted) {
            self.user(id).log.push(Record { kind: Kind::Update, op: None, outcome: Outcome::Admitted });
            return self.go(id, Step::Idle);
        }
        self.user(id).in_update = true;
        let ctl = &self.procs[&id].ctl;
        let leads = ctl.view().members.first() == Some(&id);
        let waiting = if leads { ctl.pending.len() as i64 } else { 0 };
        self.start(id, Kind::Update, waiting)
    }

    fn start(&mut self, id: MemberId, kind: Kind, value: i64) {
        self.user(id).call = Some(Call { kind, value, epoch: 0, seq: 0, buffer: value, saved: value, result: None });
        self.go(id, Step::Begin)
    }

    /// `ElasticComm::collective`, up to the mesh: lost track, `catch_up`, the numbering.
    fn collective(&mut self, id: MemberId) {
        self.user(id).ops.admitted = false;
        if self.user(id).ops.lost_track {
            return self.finish(id, None, Outcome::Failed("broken"));
        }
        // catch_up
        loop {
            let p = self.procs.get_mut(&id).expect("a running member");
            if p.ctl.evicted {
                return self.finish(id, None, Outcome::Failed("evicted"));
            }
            if p.ctl.view().epoch == p.user.ops.epoch {
                break;
            }
            let Some(d) = p.ctl.decisions.get(&(p.user.ops.epoch + 1)).cloned() else {
                let e = p.user.ops.epoch + 1;
                self.violation(format!("member {id}: epoch {e} was passed without its decision"));
                return self.finish(id, None, Outcome::Failed("internal"));
            };
            let call = p.user.ops.seq + 1;
            if d.forced && call == d.done + 1 {
                let op = (p.user.ops.epoch, call);
                self.stats.lost_unstarted += 1;
                self.lost(id);
                return self.finish(id, Some(op), Outcome::PeerLost);
            }
            self.next_epoch(id);
        }
        let u = self.user(id);
        u.ops.seq += 1;
        let (epoch, seq) = (u.ops.epoch, u.ops.seq);
        let c = u.call.as_mut().expect("a call under way");
        (c.epoch, c.seq) = (epoch, seq);
        self.go(id, Step::Mesh)
    }

    /// `ElasticComm::mesh`: this epoch's mesh, built on first use; then the operation is issued.
    fn mesh(&mut self, id: MemberId) {
        let epoch = self.user(id).ops.epoch;
        if self.user(id).ops.mesh.is_some() {
            return self.issue(id, false);
        }
        let view = self.procs[&id].ctl.view().clone();
        if view.epoch != epoch {
            return self.local_failed(id, Fault::Aborted);
        }
        if !view.members.contains(&id) {
            return self.local_failed(id, Fault::Evicted);
        }
        self.join_mesh(epoch, id, &view.members);
        let deadline = self.sched.now + STARTUP;
        self.block(id, Step::Building { deadline }, deadline)
    }

    /// `Communicator::new` under way: built once every member is in, unless the group moves on
    /// (`give_up`), a member's start-up fails, or the start-up deadline passes.
    fn building(&mut self, id: MemberId, deadline: Time) {
        let epoch = self.user(id).ops.epoch;
        let mesh = &self.meshes[&epoch];
        if mesh.built.contains(&id) && !mesh.broken.contains_key(&id) {
            let u = self.user(id);
            u.ops.mesh = Some(epoch);
            u.hook = Some(epoch);
            if self.procs[&id].ctl.moved_past(epoch) {
                // "the group moved on while this mesh was being built": no VIEW_CHANGE in it.
                self.abort_mesh(epoch, id, false);
            }
            return self.issue(id, false);
        }
        let fault = if let Some(f) = mesh.broken.get(&id) {
            f.clone()
        } else if self.procs[&id].ctl.moved_past(epoch) || self.sched.now >= deadline {
            Fault::Other
        } else {
            return;
        };
        // Its half-built links close: the others' start-up or mesh fails, naming it.
        self.close_mesh(epoch, id);
        self.local_failed(id, fault)
    }

    /// Issues this call's operation (or its barrier) on the mesh.
    fn issue(&mut self, id: MemberId, barrier: bool) {
        let u = self.user(id);
        let epoch = u.ops.mesh.expect("a mesh");
        let c = u.call.as_ref().expect("a call under way");
        let kind = if barrier { Kind::Barrier } else { c.kind };
        let mine = Contribution { member: id, epoch: c.epoch, seq: c.seq, kind, value: c.value };
        if let Some(f) = self.meshes[&epoch].broken.get(&id).cloned() {
            // A failed session fails every later call at once.
            return if barrier { self.barrier_failed(id, f) } else { self.local_failed(id, f) };
        }
        let call = self.contribute(epoch, id, mine);
        let deadline = self.sched.now + TIMEOUT;
        let step = if barrier { Step::Barrier { call, deadline } } else { Step::Run { call, deadline } };
        self.block(id, step, deadline)
    }

    /// The operation, in flight: it completes here once every member contributed (and the
    /// completion reached this member before any failure did).
    fn in_flight(&mut self, id: MemberId, call: usize, deadline: Time) {
        match self.mesh_result(id, call, deadline) {
            None => {}
            Some(Ok(result)) => {
                let c = self.user(id).call.as_mut().expect("a call under way");
                c.buffer = result.iter().map(|x| x.value).sum();
                c.result = Some(result);
                self.go(id, Step::Complete)
            }
            Some(Err(f)) => self.local_failed(id, f),
        }
    }

    /// The operation completed here: `control.complete`, then the barrier.
    fn complete(&mut self, id: MemberId) {
        let (epoch, seq) = self.op(id);
        if self.procs.get_mut(&id).expect("a running member").ctl.complete(epoch, seq) {
            self.issue(id, true)
        } else {
            let deadline = self.sched.now + TIMEOUT;
            self.block(id, Step::WaitPast { completed: false, deadline }, deadline)
        }
    }

    fn barrier(&mut self, id: MemberId, call: usize, deadline: Time) {
        match self.mesh_result(id, call, deadline) {
            None => {}
            Some(Ok(_)) => {
                let result = self.user(id).call.as_ref().and_then(|c| c.result.clone()).expect("completed");
                self.finish_call(id, Outcome::Ok(result))
            }
            Some(Err(f)) => self.barrier_failed(id, f),
        }
    }

    fn barrier_failed(&mut self, id: MemberId, f: Fault) {
        let (epoch, _) = self.op(id);
        self.blame(id, epoch, &f);
        let deadline = self.sched.now + TIMEOUT;
        self.block(id, Step::WaitPast { completed: true, deadline }, deadline)
    }

    /// The operation failed here (`local` is an error): blame, then wait for the next view.
    fn local_failed(&mut self, id: MemberId, f: Fault) {
        let (epoch, _) = self.op(id);
        self.blame(id, epoch, &f);
        let deadline = self.sched.now + TIMEOUT;
        self.block(id, Step::WaitPast { completed: false, deadline }, deadline)
    }

    /// `control.wait_past`, then the decision: the operation stands if this member completed it
    /// and `done` covers it; otherwise the buffer is restored and it raises `PeerLost`.
    fn wait_past(&mut self, id: MemberId, completed: bool, deadline: Time) {
        let (epoch, seq) = self.op(id);
        let ctl = &self.procs[&id].ctl;
        if ctl.evicted {
            self.restore(id);
            return self.finish_call(id, Outcome::Failed("evicted"));
        }
        if ctl.view().epoch > epoch {
            let Some(d) = ctl.decisions.get(&(epoch + 1)).cloned() else {
                self.violation(format!("member {id}: epoch {} was passed without its decision", epoch + 1));
                self.restore(id);
                return self.finish_call(id, Outcome::Failed("internal"));
            };
            if completed && d.done >= seq {
                self.stats.ok_decided += 1;
                let result = self.user(id).call.as_ref().and_then(|c| c.result.clone()).expect("completed");
                return self.finish_call(id, Outcome::Ok(result));
            }
            self.restore(id);
            self.lost(id);
            return self.finish_call(id, Outcome::PeerLost);
        }
        if self.sched.now >= deadline {
            self.restore(id);
            self.user(id).ops.lost_track = true;
            return self.finish_call(id, Outcome::Failed("no view in time"));
        }
    }

    /// The rest of `update` once its collective returned with a count of joiners: the leader
    /// admits them and every member waits for the view that does.
    fn update_wait(&mut self, id: MemberId, epoch: u64, deadline: Time) {
        let ctl = &self.procs[&id].ctl;
        if ctl.evicted {
            return self.exit(id);
        }
        if ctl.view().epoch > epoch {
            return self.go(id, Step::Idle);
        }
        if self.sched.now >= deadline {
            self.user(id).ops.lost_track = true;
            return self.exit(id);
        }
    }

    /// `ElasticComm::close` (`Control::leave`): vote for a view without this member, then go.
    fn close(&mut self, id: MemberId) {
        let ctl = &self.procs[&id].ctl;
        if !ctl.member || ctl.closed || ctl.evicted || ctl.view().members.len() <= 1 {
            return self.exit(id);
        }
        self.local(id, Local::Leave);
        let deadline = self.sched.now + 2 * HB;
        self.block(id, Step::Leaving { deadline }, deadline)
    }

    fn leaving(&mut self, id: MemberId, deadline: Time) {
        let ctl = &self.procs[&id].ctl;
        if ctl.evicted || ctl.closed || self.sched.now >= deadline {
            if ctl.evicted {
                self.stats.left += 1;
            }
            self.exit(id);
        }
    }

    /// `ElasticComm::blame`: who, if anyone, the control plane should suspect.
    fn blame(&mut self, id: MemberId, epoch: u64, f: &Fault) {
        if self.procs[&id].ctl.moved_past(epoch) {
            return;
        }
        let mesh = self.procs[&id].user.ops.mesh;
        let in_mesh = match f {
            Fault::Peer { who, .. } => mesh.is_some_and(|e| self.meshes[&e].members.contains(who)),
            _ => false,
        };
        match f {
            Fault::Peer { view_change: true, .. } => {}
            Fault::Peer { who, .. } if in_mesh => self.local(id, Local::Suspect { epoch, who: *who }),
            Fault::Aborted | Fault::Evicted => {}
            _ => self.local(id, Local::Change { epoch }),
        }
    }

    /// `ElasticComm::next_epoch`: the old mesh closes, the numbering moves on.
    fn next_epoch(&mut self, id: MemberId) {
        if let Some(e) = self.user(id).ops.mesh.take() {
            self.close_mesh(e, id);
        }
        let p = self.procs.get_mut(&id).expect("a running member");
        p.user.ops.epoch += 1;
        p.user.ops.seq = 0;
        p.user.ops.members = p.ctl.decisions.get(&p.user.ops.epoch).map(|d| d.members.clone()).unwrap_or_default();
    }

    /// `ElasticComm::lost`: `PeerLost` for the call under way, numbering moved to the next epoch.
    fn lost(&mut self, id: MemberId) {
        self.next_epoch(id);
    }

    fn restore(&mut self, id: MemberId) {
        let c = self.user(id).call.as_mut().expect("a call under way");
        c.buffer = c.saved;
    }

    fn op(&mut self, id: MemberId) -> (u64, u64) {
        let c = self.user(id).call.as_ref().expect("a call under way");
        (c.epoch, c.seq)
    }

    /// The call returned after it was numbered.
    fn finish_call(&mut self, id: MemberId, outcome: Outcome) {
        let op = self.op(id);
        self.finish(id, Some(op), outcome)
    }

    /// The collective returned `outcome`: recorded (its buffer checked), then the caller goes
    /// on: `update` with its count, the loop with its next call, or the member stops.
    fn finish(&mut self, id: MemberId, op: Option<(u64, u64)>, outcome: Outcome) {
        let now = self.sched.now;
        let c = self.user(id).call.take().expect("a call under way");
        let buffer_ok = match &outcome {
            Outcome::Ok(result) => c.buffer == result.iter().map(|x| x.value).sum::<i64>(),
            _ => c.buffer == c.saved,
        };
        if !buffer_ok {
            self.violation(format!("member {id}: op {op:?} returned {outcome:?} with buffer {} (saved {})", c.buffer, c.saved));
        }
        self.note(|| format!("{now}: {id}: {:?} {op:?} -> {}", c.kind, short(&outcome)));
        match &outcome {
            Outcome::Ok(_) => self.stats.ok += 1,
            Outcome::PeerLost => self.stats.peer_lost += 1,
            Outcome::Failed("evicted") => self.stats.evicted += 1,
            _ => self.stats.failed += 1,
        }
        self.user(id).log.push(Record { kind: c.kind, op, outcome: outcome.clone() });
        match (c.kind, outcome) {
            (Kind::Update, Outcome::Ok(result)) => {
                if result.iter().map(|x| x.value).sum::<i64>() == 0 {
                    return self.go(id, Step::Idle);
                }
                let epoch = self.user(id).ops.epoch;
                let view = self.procs[&id].ctl.view();
                if view.epoch == epoch && view.members.first() == Some(&id) {
                    self.local(id, Local::Admit { epoch });
                }
                let deadline = now + TIMEOUT;
                self.block(id, Step::UpdateWait { epoch, deadline }, deadline)
            }
            (_, Outcome::Ok(_) | Outcome::PeerLost) => self.go(id, Step::Idle),
            _ => self.exit(id),
        }
    }
}

fn short(o: &Outcome) -> String {
    match o {
        Outcome::Ok(r) => format!("Ok over {:?}", r.iter().map(|c| c.member).collect::<Vec<_>>()),
        other => format!("{other:?}"),
    }
}
