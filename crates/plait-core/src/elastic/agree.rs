//! Agreeing on the next view: single-decree Paxos per epoch (see `docs/elastic.md`, "The view
//! change"). Pure state, no I/O: a `Member` takes a message and returns the messages to send, so
//! the protocol can be simulated with every delay, loss, crash and partition (`agree_sim.rs`).
//!
//! The value decided is the next view together with `done`, the last operation of the previous
//! epoch that stands: built from the members that promised (each promise carries the member's
//! `last_done`, frozen when it promised), so no member of the new view has to undo or redo
//! anything it did not report.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// A member's identity (random; seniority is the order of a view's members).
pub type MemberId = u64;

/// The witness's identity in the agreement: one more acceptor, never a member.
pub const WITNESS: MemberId = u64::MAX;

/// A view: the epoch and its members, most senior first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct View {
    pub epoch: u64,
    pub members: Vec<MemberId>,
    /// Operations of epoch `epoch - 1` numbered up to `done` completed on every member; later
    /// ones failed everywhere.
    pub done: u64,
    /// The change was forced (a failure): the operation after `done` fails on every member of
    /// the old view, whether or not it had started it. A change at an update point, where no
    /// operation is under way, is not forced: that operation is the new epoch's first.
    pub forced: bool,
    /// Where each member's control plane listens ("host:port"); facts carried with the view.
    pub contacts: BTreeMap<MemberId, String>,
    /// Where the witness listens, if the group has one: it votes in every change as one more
    /// acceptor, so that an even split (two members, one lost) still has a majority on one side.
    /// Fixed when the group is founded; every view carries it to joiners.
    #[serde(default)]
    pub witness: Option<String>,
}

impl View {
    /// Strictly more than half of this view's voters (its members, and the witness if any).
    pub fn majority(&self) -> usize {
        (self.members.len() + self.witness.is_some() as usize) / 2 + 1
    }

    /// Whether `id` votes on the change from this view.
    pub fn votes(&self, id: MemberId) -> bool {
        self.members.contains(&id) || (id == WITNESS && self.witness.is_some())
    }

    /// Everyone asked to vote on the change from this view.
    pub fn voters(&self) -> impl Iterator<Item = MemberId> + '_ {
        self.members.iter().copied().chain(self.witness.as_ref().map(|_| WITNESS))
    }

    /// The first view of a group: its founder alone.
    pub fn founded(id: MemberId, contact: String, witness: Option<String>) -> View {
        View { epoch: 0, members: vec![id], done: 0, forced: false, contacts: BTreeMap::from([(id, contact)]), witness }
    }
}

/// Proposals for one epoch are ordered by round, then by the proposer's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Ballot {
    pub round: u64,
    pub proposer: MemberId,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Phase 1a, for epoch `epoch`. `forced`: the proposer leaves a member out (a hint for the
    /// members' freeze, which ends their operations at once for such a change; the value decides).
    Prepare {
        epoch: u64,
        ballot: Ballot,
        #[serde(default)]
        forced: bool,
    },
    /// Phase 1b: the promise, with what this member already accepted for `epoch`, and its last
    /// completed operation of the current epoch (it completes no other once it has promised).
    Promise { epoch: u64, ballot: Ballot, accepted: Option<(Ballot, View)>, last_done: u64 },
    /// Phase 2a.
    Accept { epoch: u64, ballot: Ballot, view: View },
    /// Phase 2b.
    Accepted { epoch: u64, ballot: Ballot },
    /// The decision (or, to a member that is behind, the latest view the sender committed).
    Commit { view: View },
    /// "I am at epoch `epoch`": the answer of a member that missed commits.
    Behind { epoch: u64 },
}

/// A proposal this member is driving.
struct Proposal {
    ballot: Ballot,
    /// The members of the current view the proposer waits for before choosing (those it does
    /// not suspect); with a majority and `decide`, it chooses without the rest.
    expect: BTreeSet<MemberId>,
    /// Members to add, with their contacts.
    joiners: Vec<(MemberId, String)>,
    /// Members leaving: they vote, but the value leaves them out.
    leaving: BTreeSet<MemberId>,
    forced: bool,
    promises: BTreeMap<MemberId, (Option<(Ballot, View)>, u64)>,
    /// The value sent in phase 2, once chosen.
    value: Option<View>,
    accepted: BTreeSet<MemberId>,
}

pub struct Member {
    pub id: MemberId,
    /// The last view this member committed.
    pub view: View,
    /// The last operation of this epoch this member completed; the runtime freezes it before it
    /// hands over a `Prepare` or an `Accept` (`docs/elastic.md`, "One outcome per operation").
    pub last_done: u64,
    /// For epoch `view.epoch + 1`: the highest ballot promised, and what was accepted.
    promised: Option<Ballot>,
    accepted: Option<(Ballot, View)>,
    /// The highest round seen for the next epoch, so a new proposal goes above it.
    max_round: u64,
    proposal: Option<Proposal>,
}

pub type Out = Vec<(MemberId, Msg)>;

impl Member {
    pub fn new(id: MemberId, view: View) -> Member {
        Member { id, view, last_done: 0, promised: None, accepted: None, max_round: 0, proposal: None }
    }

    fn next_epoch(&self) -> u64 {
        self.view.epoch + 1
    }

    /// Starts (or restarts, with a higher ballot) a proposal for the next view: the members of
    /// this view that promise, in their order, then `joiners`. `expect`: the members it waits
    /// for (see `Proposal::expect`); `leaving`: members left out though they vote; `forced`: see
    /// `View::forced`.
    pub fn propose(&mut self, expect: BTreeSet<MemberId>, joiners: Vec<(MemberId, String)>, leaving: BTreeSet<MemberId>, forced: bool) -> Out {
        self.max_round += 1;
        let ballot = Ballot { round: self.max_round, proposer: self.id };
        self.proposal = Some(Proposal { ballot, expect, joiners, leaving, forced, promises: BTreeMap::new(), value: None, accepted: BTreeSet::new() });
        let epoch = self.next_epoch();
        self.view.voters().map(|m| (m, Msg::Prepare { epoch, ballot, forced })).collect()
    }

    /// Waits for `id`'s promise too before choosing (a member suspected when the proposal
    /// started, heard from again).
    pub fn expect(&mut self, id: MemberId) {
        if let Some(p) = self.proposal.as_mut().filter(|p| p.value.is_none()) {
            p.expect.insert(id);
        }
    }

    /// Whether this member drives a proposal that has not chosen its value yet.
    pub fn proposing(&self) -> bool {
        self.proposal.as_ref().is_some_and(|p| p.value.is_none())
    }

    /// Chooses the value now if a majority promised, without waiting for the rest of `expect`.
    pub fn decide(&mut self) -> Out {
        self.choose(false)
    }

    /// Phase 2a once a majority promised (and, with `wait_for_expected`, every expected member):
    /// the view some majority may already have chosen, or else the promisers and the joiners.
    fn choose(&mut self, wait_for_expected: bool) -> Out {
        let majority = self.view.majority();
        let epoch = self.next_epoch();
        let Some(p) = self.proposal.as_mut().filter(|p| p.value.is_none()) else { return Vec::new() };
        if p.promises.len() < majority || (wait_for_expected && !p.expect.iter().all(|m| p.promises.contains_key(m))) {
            return Vec::new();
        }
        let earlier = p.promises.values().filter_map(|(a, _)| a.as_ref()).max_by_key(|(b, _)| *b).map(|(_, v)| v.clone());
        let value = earlier.unwrap_or_else(|| {
            let mut members: Vec<MemberId> =
                self.view.members.iter().copied().filter(|m| p.promises.contains_key(m) && !p.leaving.contains(m)).collect();
            let mut contacts: BTreeMap<MemberId, String> =
                members.iter().filter_map(|m| self.view.contacts.get(m).map(|c| (*m, c.clone()))).collect();
            for (j, contact) in &p.joiners {
                if !members.contains(j) {
                    members.push(*j);
                    contacts.insert(*j, contact.clone());
                }
            }
            let done = p
                .promises
                .iter()
                .filter(|(m, _)| self.view.members.contains(m) && !p.leaving.contains(m))
                .map(|(_, (_, d))| *d)
                .min()
                .unwrap_or(0);
            View { epoch, members, done, forced: p.forced, contacts, witness: self.view.witness.clone() }
        });
        if value.members.is_empty() {
            // Only leavers (and the witness) promised: a view of nobody would end the group.
            return Vec::new();
        }
        p.value = Some(value.clone());
        let ballot = p.ballot;
        self.view.voters().map(|m| (m, Msg::Accept { epoch, ballot, view: value.clone() })).collect()
    }

    /// Handles `msg` from `from`; returns what to send.
    pub fn handle(&mut self, from: MemberId, msg: Msg) -> Out {
        let next = self.next_epoch();
        match msg {
            Msg::Commit { view } => {
                // A witness that has not heard of the group yet takes its first view as it is.
                if view.epoch > self.view.epoch || (self.id == WITNESS && self.view.members.is_empty()) {
                    self.adopt(view);
                }
                Vec::new()
            }
            Msg::Behind { epoch } => {
                if epoch < self.view.epoch {
                    vec![(from, Msg::Commit { view: self.view.clone() })]
                } else {
                    Vec::new()
                }
            }
            Msg::Prepare { epoch, .. } | Msg::Accept { epoch, .. } if epoch > next => vec![(from, Msg::Behind { epoch: self.view.epoch })],
            Msg::Prepare { epoch, .. } | Msg::Accept { epoch, .. } if epoch < next => {
                // The sender is behind: it gets the view this member committed.
                vec![(from, Msg::Commit { view: self.view.clone() })]
            }
            Msg::Prepare { ballot, .. } => {
                self.max_round = self.max_round.max(ballot.round);
                if !self.view.members.contains(&from) || self.promised.is_some_and(|p| p > ballot) {
                    return Vec::new();
                }
                self.promised = Some(ballot);
                let last_done = if self.id == WITNESS { u64::MAX } else { self.last_done };
                vec![(from, Msg::Promise { epoch: next, ballot, accepted: self.accepted.clone(), last_done })]
            }
            Msg::Accept { ballot, view, .. } => {
                self.max_round = self.max_round.max(ballot.round);
                if !self.view.members.contains(&from) || self.promised.is_some_and(|p| p > ballot) {
                    return Vec::new();
                }
                self.promised = Some(ballot);
                self.accepted = Some((ballot, view));
                vec![(from, Msg::Accepted { epoch: next, ballot })]
            }
            Msg::Promise { epoch, ballot, accepted, last_done } => {
                if epoch != next || !self.view.votes(from) {
                    return Vec::new();
                }
                let Some(p) = self.proposal.as_mut().filter(|p| p.ballot == ballot && p.value.is_none()) else { return Vec::new() };
                p.promises.insert(from, (accepted, last_done));
                self.choose(true)
            }
            Msg::Accepted { epoch, ballot } => {
                if epoch != next || !self.view.votes(from) {
                    return Vec::new();
                }
                let majority = self.view.majority();
                let Some(p) = self.proposal.as_mut().filter(|p| p.ballot == ballot && p.value.is_some()) else { return Vec::new() };
                p.accepted.insert(from);
                if p.accepted.len() < majority {
                    return Vec::new();
                }
                let view = p.value.clone().expect("checked above");
                let mut to: BTreeSet<MemberId> = self.view.voters().collect();
                to.extend(view.members.iter().copied());
                self.adopt(view.clone());
                to.into_iter().filter(|&m| m != self.id).map(|m| (m, Msg::Commit { view: view.clone() })).collect()
            }
        }
    }

    fn adopt(&mut self, view: View) {
        self.view = view;
        self.last_done = 0;
        self.promised = None;
        self.accepted = None;
        self.max_round = 0;
        self.proposal = None;
    }
}

#[cfg(test)]
#[path = "agree_sim.rs"]
mod sim;
