//! One process's control plane, as `control.rs` runs it: the same state and rules under the same
//! names, with links, threads and clocks replaced by the world's messages and virtual time. What
//! is left out: link set-up (any process can message any other; a dial that fails is the world's
//! crash detection), bootstrap records (a mesh is built by the world) and the witness's dialling.

use super::{Local, Out, Time, Wire, HB};
use crate::elastic::agree::{Member, MemberId, Msg, View, WITNESS};
use crate::elastic::control::Freeze;
use std::collections::{BTreeMap, BTreeSet};

/// `control::Decision`: an epoch's outcome for the operations of the epoch before it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Decision {
    pub done: u64,
    pub forced: bool,
    pub members: Vec<MemberId>,
}

pub(super) struct Control {
    pub me: MemberId,
    pub agree: Member,
    pub member: bool,
    pub witness: bool,
    /// A joiner's first link: the member it asked to join.
    pub dialed: Option<MemberId>,
    pub heard: BTreeMap<MemberId, Time>,
    pub suspects: BTreeSet<MemberId>,
    told: BTreeSet<MemberId>,
    wanted: Option<bool>,
    pub leaving: BTreeSet<MemberId>,
    pub pending: BTreeSet<MemberId>,
    pub frozen: bool,
    forced_told: bool,
    last_done: u64,
    pub proposed_at: Option<Time>,
    trouble_since: Option<Time>,
    pub decisions: BTreeMap<u64, Decision>,
    pub evicted: bool,
    /// The freeze hook is due (`run_deferred`), told this: the world aborts this process's mesh
    /// unless it is a proposal that finds the member in `update()`.
    pub abort_pending: Option<Freeze>,
    pub closed: bool,
    next_heartbeat: Time,
}

impl Control {
    fn new(me: MemberId, view: View) -> Control {
        Control {
            me,
            agree: Member::new(me, view),
            member: false,
            witness: false,
            dialed: None,
            heard: BTreeMap::new(),
            suspects: BTreeSet::new(),
            told: BTreeSet::new(),
            wanted: None,
            leaving: BTreeSet::new(),
            pending: BTreeSet::new(),
            frozen: false,
            last_done: 0,
            proposed_at: None,
            trouble_since: None,
            decisions: BTreeMap::new(),
            evicted: false,
            abort_pending: None,
            forced_told: false,
            closed: false,
            next_heartbeat: 0,
        }
    }

    /// A founding member, in `view` from the start.
    pub fn founder(me: MemberId, view: View) -> Control {
        let mut c = Control::new(me, view.clone());
        c.member = true;
        c.decisions.insert(view.epoch, Decision { done: 0, forced: false, members: view.members.clone() });
        c.heard = view.members.iter().map(|&m| (m, 0)).collect();
        c
    }

    pub fn witness(view: View) -> Control {
        let mut c = Control::new(WITNESS, view);
        c.witness = true;
        c
    }

    /// A process that asked `dialed` to let it in (`Control::join`).
    pub fn joiner(me: MemberId, dialed: MemberId) -> Control {
        let nobody = View { epoch: 0, members: Vec::new(), done: 0, forced: false, contacts: BTreeMap::new(), witness: None };
        let mut c = Control::new(me, nobody);
        c.dialed = Some(dialed);
        c
    }

    pub fn view(&self) -> &View {
        &self.agree.view
    }

    /// `Control::complete`.
    pub fn complete(&mut self, epoch: u64, seq: u64) -> bool {
        if self.agree.view.epoch != epoch || self.frozen || self.evicted {
            return false;
        }
        self.last_done = seq;
        true
    }

    /// `Control::moved_past`.
    pub fn moved_past(&self, epoch: u64) -> bool {
        self.agree.view.epoch != epoch || self.frozen || self.evicted
    }

    /// `Control::first_epoch`.
    pub fn first_epoch(&self) -> u64 {
        self.decisions.keys().next().copied().unwrap_or(self.agree.view.epoch)
    }

    /// Whom this process has a control link to (its heartbeats go there).
    fn links(&self) -> BTreeSet<MemberId> {
        let mut to: BTreeSet<MemberId> = self.agree.view.members.iter().copied().collect();
        if self.member {
            to.extend(self.pending.iter().copied());
            if self.agree.view.witness.is_some() {
                to.insert(WITNESS);
            }
        } else if !self.witness {
            // A joiner: the member it dialled, and the members that dialled it once it was in.
            to.extend(self.dialed);
            to.extend(self.heard.keys().copied());
        }
        to.remove(&self.me);
        to
    }

    /// An event from this process's own threads (`Control::handle`).
    pub fn on_local(&mut self, now: Time, ev: Local, out: &mut Out) {
        if self.closed {
            return;
        }
        match ev {
            Local::Suspect { epoch, who } => {
                if epoch == self.agree.view.epoch && self.agree.view.members.contains(&who) && who != self.me {
                    self.suspects.insert(who);
                }
            }
            Local::JoinerGone { id } => {
                if self.pending.remove(&id) {
                    for m in self.links() {
                        out.push((m, Wire::Withdrawn { id }));
                    }
                }
            }
            Local::Admit { epoch } => {
                if epoch == self.agree.view.epoch && self.wanted.is_none() {
                    self.wanted = Some(false);
                }
            }
            Local::Leave => {
                self.leaving.insert(self.me);
                for m in self.links() {
                    out.push((m, Wire::Leave));
                }
            }
            Local::Change { epoch } => {
                if epoch == self.agree.view.epoch {
                    self.wanted = Some(true);
                }
            }
        }
        self.maybe_propose(now, out);
    }

    /// A message from another process (`Control::handle`, `Event::Message`, and `on_message`).
    pub fn on_message(&mut self, now: Time, from: MemberId, wire: Wire, out: &mut Out) {
        if self.closed {
            return;
        }
        self.heard.insert(from, now);
        match wire {
            Wire::Heartbeat { epoch } => {
                let mine = self.agree.view.epoch;
                if self.member && epoch < mine && !self.pending.contains(&from) {
                    out.push((from, Wire::Agree(Msg::Commit { view: self.agree.view.clone() })));
                } else if epoch > mine && self.member {
                    out.push((from, Wire::Agree(Msg::Behind { epoch: mine })));
                }
            }
            Wire::Agree(m) => self.agree(now, from, m, out),
            Wire::Suspect { epoch, who } => {
                if epoch == self.agree.view.epoch && self.agree.view.members.contains(&who) && who != self.me {
                    self.suspects.insert(who);
                }
            }
            Wire::Leave => {
                if self.agree.view.members.contains(&from) {
                    self.leaving.insert(from);
                }
            }
            Wire::Withdrawn { id } => {
                self.pending.remove(&id);
            }
            Wire::Pending { id } => {
                if !self.agree.view.members.contains(&id) {
                    self.pending.insert(id);
                }
            }
            Wire::Join => {
                // `Event::Linked` with a joiner: queued here and told to every member.
                self.pending.insert(from);
                for m in self.links() {
                    if m != from {
                        out.push((m, Wire::Pending { id: from }));
                    }
                }
            }
        }
        self.maybe_propose(now, out);
    }

    /// `Control::agree`: freezes this epoch before taking part in a change, adopts a committed view.
    fn agree(&mut self, now: Time, from: MemberId, msg: Msg, out: &mut Out) {
        let mut queue = vec![(from, msg)];
        while let Some((from, msg)) = queue.pop() {
            if let Msg::Commit { view } = &msg {
                if !self.member && !self.witness && !view.members.contains(&self.me) {
                    continue;
                }
            }
            let next = self.agree.view.epoch + 1;
            if matches!(&msg, Msg::Prepare { epoch, .. } | Msg::Accept { epoch, .. } if *epoch == next) && self.agree.view.members.contains(&from) {
                let forced = matches!(&msg, Msg::Prepare { forced: true, .. }) || matches!(&msg, Msg::Accept { view, .. } if view.forced);
                self.freeze(if forced { Freeze::Forced } else { Freeze::Proposed });
            }
            let before = self.agree.view.clone();
            for (to, m) in self.agree.handle(from, msg) {
                if to == self.me {
                    queue.push((self.me, m));
                } else {
                    out.push((to, Wire::Agree(m)));
                }
            }
            if self.agree.view.epoch != before.epoch {
                self.adopted(now, &before, out);
            }
        }
    }

    fn freeze(&mut self, kind: Freeze) {
        if !self.member || (self.frozen && (kind == Freeze::Proposed || self.forced_told)) {
            return;
        }
        self.frozen = true;
        self.agree.last_done = self.last_done;
        self.forced_told |= kind == Freeze::Forced;
        self.abort_pending = Some(kind);
    }

    /// `Control::adopted`: a new view was committed here.
    fn adopted(&mut self, now: Time, before: &View, out: &mut Out) {
        let view = self.agree.view.clone();
        if self.witness {
            return;
        }
        if !view.members.contains(&self.me) {
            if self.member {
                self.evicted = true;
                self.abort_pending = Some(Freeze::Forced);
            }
            return;
        }
        if view.forced && self.member && !self.forced_told {
            self.abort_pending = Some(Freeze::Forced);
        }
        self.member = true;
        self.frozen = false;
        self.forced_told = false;
        self.last_done = 0;
        self.suspects.clear();
        self.told.clear();
        self.wanted = None;
        self.proposed_at = None;
        self.trouble_since = None;
        self.decisions.insert(view.epoch, Decision { done: view.done, forced: view.forced, members: view.members.clone() });
        self.pending.retain(|id| !view.members.contains(id));
        self.leaving.retain(|id| view.members.contains(id));
        let commit = || Wire::Agree(Msg::Commit { view: view.clone() });
        // Members left out hear the view before their links close; members linked hear it at once.
        for &m in before.members.iter().filter(|m| !view.members.contains(m) && **m != self.me) {
            out.push((m, commit()));
        }
        for &m in view.members.iter().filter(|m| **m != self.me) {
            out.push((m, commit()));
        }
        for &m in &view.members {
            self.heard.insert(m, now);
        }
    }

    /// `Control::on_tick`: heartbeats, silent members suspected, a stalled proposal decided.
    pub fn on_tick(&mut self, now: Time, out: &mut Out) {
        if self.closed {
            return;
        }
        if now >= self.next_heartbeat {
            self.next_heartbeat = now + HB / 4;
            let epoch = self.agree.view.epoch;
            for m in self.links() {
                out.push((m, Wire::Heartbeat { epoch }));
            }
        }
        if self.member && !self.evicted {
            for &m in self.agree.view.members.iter().filter(|m| **m != self.me) {
                let silent = self.heard.get(&m).map(|t| now - t).unwrap_or(HB);
                if silent >= HB {
                    self.suspects.insert(m);
                }
            }
        }
        if self.agree.proposing() && self.proposed_at.is_some_and(|t| now - t >= HB / 4) {
            let decided = self.agree.decide();
            self.dispatch(now, decided, out);
        }
        self.maybe_propose(now, out);
    }

    fn dispatch(&mut self, now: Time, msgs: Vec<(MemberId, Msg)>, out: &mut Out) {
        for (to, m) in msgs {
            if to == self.me {
                self.agree(now, self.me, m, out);
            } else {
                out.push((to, Wire::Agree(m)));
            }
        }
    }

    /// `Control::maybe_propose`: the leader proposes; the others tell it, and take over late.
    fn maybe_propose(&mut self, now: Time, out: &mut Out) {
        if !self.member || self.evicted || self.closed {
            return;
        }
        let view = &self.agree.view;
        let suspects: BTreeSet<MemberId> = self.suspects.iter().copied().filter(|m| view.members.contains(m)).collect();
        if suspects.is_empty() && self.wanted.is_none() && self.leaving.is_empty() {
            return;
        }
        let since = *self.trouble_since.get_or_insert(now);
        let alive: Vec<MemberId> = view.members.iter().copied().filter(|m| !suspects.contains(m)).collect();
        let Some(&leader) = alive.iter().find(|m| !self.leaving.contains(m)).or(alive.first()) else { return };
        let rank = alive.iter().position(|&m| m == self.me).unwrap_or(0) as u64;
        let takeover = now - since >= HB * (1 + rank);
        if leader != self.me && !takeover {
            let epoch = view.epoch;
            let untold: Vec<MemberId> = self.suspects.iter().copied().filter(|m| !self.told.contains(m)).collect();
            for who in untold {
                self.told.insert(who);
                out.push((leader, Wire::Suspect { epoch, who }));
            }
            return;
        }
        if self.proposed_at.is_some_and(|t| now - t < HB) {
            return;
        }
        let forced = !suspects.is_empty() || self.wanted == Some(true) || !self.leaving.is_empty();
        self.freeze(if forced { Freeze::Forced } else { Freeze::Proposed });
        let expect: BTreeSet<MemberId> = alive.into_iter().collect();
        let joiners: Vec<(MemberId, String)> = if forced { Vec::new() } else { self.pending.iter().map(|m| (*m, format!("m{m}"))).collect() };
        self.proposed_at = Some(now);
        let leaving = self.leaving.clone();
        let msgs = self.agree.propose(expect, joiners, leaving, forced);
        self.dispatch(now, msgs, out);
    }
}
