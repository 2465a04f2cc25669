//! Agreeing on the next view: single-decree Paxos per epoch (see `docs/elastic.md`, "The view
//! change"). Pure state, no I/O: a `Member` takes a message and returns the messages to send, so
//! the protocol can be simulated with every delay, loss, crash and partition (`agree_sim.rs`).

use std::collections::{BTreeMap, BTreeSet};

/// A member's identity; lower is more senior (joined earlier).
pub type MemberId = u64;

/// A view: the epoch and its members, most senior first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    pub epoch: u64,
    pub members: Vec<MemberId>,
}

impl View {
    /// Strictly more than half of this view's members.
    pub fn majority(&self) -> usize {
        self.members.len() / 2 + 1
    }
}

/// Proposals for one epoch are ordered by round, then by the proposer's id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ballot {
    pub round: u64,
    pub proposer: MemberId,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Phase 1a, for epoch `epoch`.
    Prepare { epoch: u64, ballot: Ballot },
    /// Phase 1b: the promise, with what this member already accepted for `epoch`.
    Promise { epoch: u64, ballot: Ballot, accepted: Option<(Ballot, View)> },
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
    wanted: View,
    promises: BTreeMap<MemberId, Option<(Ballot, View)>>,
    /// The value sent in phase 2, once chosen.
    value: Option<View>,
    accepted: BTreeSet<MemberId>,
}

pub struct Member {
    pub id: MemberId,
    /// The last view this member committed.
    pub view: View,
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
        Member { id, view, promised: None, accepted: None, max_round: 0, proposal: None }
    }

    fn next_epoch(&self) -> u64 {
        self.view.epoch + 1
    }

    /// Starts (or restarts, with a higher ballot) a proposal for the next view; `wanted` is what
    /// this member would like if nothing was accepted yet. Its epoch must be the next one.
    pub fn propose(&mut self, wanted: View) -> Out {
        assert_eq!(wanted.epoch, self.next_epoch(), "a proposal is for the next epoch");
        self.max_round += 1;
        let ballot = Ballot { round: self.max_round, proposer: self.id };
        self.proposal = Some(Proposal { ballot, wanted, promises: BTreeMap::new(), value: None, accepted: BTreeSet::new() });
        let epoch = self.next_epoch();
        self.view.members.iter().map(|&m| (m, Msg::Prepare { epoch, ballot })).collect()
    }

    /// Handles `msg` from `from`; returns what to send.
    pub fn handle(&mut self, from: MemberId, msg: Msg) -> Out {
        let next = self.next_epoch();
        match msg {
            Msg::Commit { view } => {
                if view.epoch > self.view.epoch {
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
                vec![(from, Msg::Promise { epoch: next, ballot, accepted: self.accepted.clone() })]
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
            Msg::Promise { epoch, ballot, accepted } => {
                if epoch != next || !self.view.members.contains(&from) {
                    return Vec::new();
                }
                let majority = self.view.majority();
                let members = self.view.members.clone();
                let Some(p) = self.proposal.as_mut().filter(|p| p.ballot == ballot && p.value.is_none()) else { return Vec::new() };
                p.promises.insert(from, accepted);
                if p.promises.len() < majority {
                    return Vec::new();
                }
                // A view some majority may already have chosen must be proposed again.
                let value = p.promises.values().flatten().max_by_key(|(b, _)| *b).map(|(_, v)| v.clone()).unwrap_or_else(|| p.wanted.clone());
                p.value = Some(value.clone());
                members.into_iter().map(|m| (m, Msg::Accept { epoch, ballot, view: value.clone() })).collect()
            }
            Msg::Accepted { epoch, ballot } => {
                if epoch != next || !self.view.members.contains(&from) {
                    return Vec::new();
                }
                let majority = self.view.majority();
                let Some(p) = self.proposal.as_mut().filter(|p| p.ballot == ballot && p.value.is_some()) else { return Vec::new() };
                p.accepted.insert(from);
                if p.accepted.len() < majority {
                    return Vec::new();
                }
                let view = p.value.clone().expect("checked above");
                let mut to: BTreeSet<MemberId> = self.view.members.iter().copied().collect();
                to.extend(view.members.iter().copied());
                self.adopt(view.clone());
                to.into_iter().filter(|&m| m != self.id).map(|m| (m, Msg::Commit { view: view.clone() })).collect()
            }
        }
    }

    fn adopt(&mut self, view: View) {
        self.view = view;
        self.promised = None;
        self.accepted = None;
        self.max_round = 0;
        self.proposal = None;
    }
}

#[cfg(test)]
#[path = "agree_sim.rs"]
mod sim;
