//! Deterministic simulation of the view agreement: seeded runs with members proposing at once,
//! messages delayed (delivered in any order), lost, cut by partitions, and members crashing.
//! Checks the invariants of `docs/elastic.md`: one view per epoch; a committed view was accepted
//! by a majority of the previous one; one outcome per operation (`done` is no later than any
//! surviving member's last completed operation, and covers an operation every member completed);
//! and, once the network heals, a view is committed that every live member adopts.

use super::*;
use crate::elastic::sim_rng::Rng;
use std::collections::HashMap;

struct World {
    members: Vec<Member>,
    /// The witness, in runs that have one: an acceptor that is never a member.
    witness: Option<Member>,
    crashed: Vec<bool>,
    /// Messages on their way: (from, to, msg).
    wire: Vec<(MemberId, MemberId, Msg)>,
    /// Members on side A of a partition (None: no partition).
    cut: Option<Vec<bool>>,
    /// What every member committed, per epoch.
    committed: HashMap<u64, View>,
    /// The value and acceptors of every (epoch, ballot).
    accepts: HashMap<(u64, Ballot), (View, BTreeSet<MemberId>)>,
}

/// The last operation member `m` completed in epoch `e`: every member completes operation
/// `1 + e % 3`, except a third of them (chosen by hash), which are one behind when it fails.
fn last_done(m: MemberId, e: u64) -> u64 {
    let all = 1 + e % 3;
    all - ((m.wrapping_mul(31).wrapping_add(e.wrapping_mul(17)) % 3 == 0) as u64)
}

impl World {
    fn new(n: usize, witnessed: bool) -> World {
        let members: Vec<MemberId> = (0..n as u64).collect();
        let contacts = members.iter().map(|&m| (m, format!("m{m}"))).collect();
        let first = View { epoch: 0, members, done: 0, forced: false, contacts, witness: witnessed.then(|| "w".to_string()) };
        let mut committed = HashMap::new();
        committed.insert(0, first.clone());
        World {
            members: (0..n as u64)
                .map(|id| {
                    let mut m = Member::new(id, first.clone());
                    m.last_done = last_done(id, 0);
                    m
                })
                .collect(),
            witness: witnessed.then(|| Member::new(WITNESS, first.clone())),
            crashed: vec![false; n],
            wire: Vec::new(),
            cut: None,
            committed,
            accepts: HashMap::new(),
        }
    }

    fn send(&mut self, from: MemberId, out: Out) {
        for (to, msg) in out {
            if let Msg::Accept { epoch, ballot, view } = &msg {
                self.accepts.entry((*epoch, *ballot)).or_insert_with(|| (view.clone(), BTreeSet::new()));
            }
            self.wire.push((from, to, msg));
        }
    }

    /// Delivers message `i` (or loses it), then checks what changed.
    fn deliver(&mut self, i: usize, lose: bool) {
        let (from, to, msg) = self.wire.swap_remove(i);
        if to == WITNESS {
            // The witness sits on side A of a partition.
            let cut_off = self.cut.as_ref().is_some_and(|side| (from as usize) < side.len() && !side[from as usize]);
            if lose || cut_off {
                return;
            }
            let Some(witness) = self.witness.as_mut() else { return };
            let out = witness.handle(from, msg);
            self.send(WITNESS, out);
            return;
        }
        if to as usize >= self.members.len() {
            return; // a joiner: it only appears in views here
        }
        let side_of = |side: &Vec<bool>, m: MemberId| if m == WITNESS { true } else { side[m as usize] };
        let cut_off = self.cut.as_ref().is_some_and(|side| side_of(side, from) != side_of(side, to));
        if lose || cut_off || self.crashed[to as usize] {
            return;
        }
        if let Msg::Accepted { epoch, ballot } = &msg {
            // Recorded as the acceptor sent it: `from` accepted `ballot`.
            if let Some((_, who)) = self.accepts.get_mut(&(*epoch, *ballot)) {
                who.insert(from);
            }
        }
        let before = self.members[to as usize].view.epoch;
        let out = self.members[to as usize].handle(from, msg);
        self.send(to, out);
        let view = self.members[to as usize].view.clone();
        if view.epoch != before {
            self.members[to as usize].last_done = last_done(to, view.epoch);
            self.check_commit(&view);
        }
    }

    fn check_commit(&mut self, view: &View) {
        if let Some(earlier) = self.committed.get(&view.epoch) {
            assert_eq!(earlier, view, "two views committed for epoch {}", view.epoch);
            return;
        }
        // A majority of the previous view accepted this value under one ballot.
        let previous = self.committed.get(&(view.epoch - 1)).cloned();
        if let Some(previous) = previous {
            let backed = self.accepts.iter().any(|((e, _), (v, who))| {
                *e == view.epoch && v == view && who.iter().filter(|m| previous.votes(**m)).count() >= previous.majority()
            });
            assert!(backed, "epoch {} committed without a majority of {:?}", view.epoch, previous.members);
            let e = previous.epoch;
            for m in view.members.iter().filter(|m| previous.members.contains(m)) {
                assert!(view.done <= last_done(*m, e), "epoch {}: done {} is past member {m}'s last operation", view.epoch, view.done);
            }
            let everywhere = previous.members.iter().map(|&m| last_done(m, e)).min().unwrap_or(0);
            assert!(view.done >= everywhere, "epoch {}: operation {everywhere} completed everywhere but done is {}", view.epoch, view.done);
        }
        self.committed.insert(view.epoch, view.clone());
    }

    fn live(&self) -> Vec<usize> {
        (0..self.members.len()).filter(|&i| !self.crashed[i]).collect()
    }

    /// Member `i` proposes, waiting for the members it does not know crashed, and with `extra`
    /// (a joiner, or a member it wrongly suspects, by the caller's choice) added or not waited
    /// for, so that rival proposals carry different values.
    fn propose(&mut self, i: usize, extra: Option<MemberId>) {
        let m = &self.members[i];
        let mut expect: BTreeSet<MemberId> = m.view.members.iter().copied().filter(|&x| (x as usize) >= self.crashed.len() || !self.crashed[x as usize]).collect();
        let mut joiners = Vec::new();
        if let Some(x) = extra {
            if !expect.remove(&x) && !m.view.members.contains(&x) {
                joiners.push((x, format!("m{x}")));
            }
        }
        let forced = extra.is_none();
        let out = self.members[i].propose(expect, joiners, BTreeSet::new(), forced);
        self.send(i as u64, out);
    }

    /// Member `i` stops waiting for promises beyond a majority.
    fn decide(&mut self, i: usize) {
        let out = self.members[i].decide();
        self.send(i as u64, out);
    }
}

/// One seeded run of chaos; returns the world for the caller's liveness phase.
/// `rivals`: proposals differ (joiners added, members wrongly suspected), as when several
/// members propose different changes at once.
fn chaos(seed: u64, crashes: bool, rivals: bool) -> World {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    // A third of the runs have a witness, and start from two members (the case it is for).
    let witnessed = seed % 3 == 0;
    let n = if witnessed { 2 + rng.below(5) as usize } else { 3 + rng.below(5) as usize };
    let mut w = World::new(n, witnessed);
    for _ in 0..600 {
        match rng.below(100) {
            0..=64 if !w.wire.is_empty() => {
                let i = rng.below(w.wire.len() as u64) as usize;
                let lose = rng.chance(10);
                w.deliver(i, lose);
            }
            65..=79 => {
                let live = w.live();
                if !live.is_empty() {
                    let i = live[rng.below(live.len() as u64) as usize];
                    // Joiners (ids from 100) never run here: they only appear in views.
                    let extra = if rivals && rng.chance(40) { Some(if rng.chance(50) { 100 + rng.below(3) } else { rng.below(n as u64) }) } else { None };
                    w.propose(i, extra);
                }
            }
            88..=91 => {
                let live = w.live();
                if !live.is_empty() {
                    w.decide(live[rng.below(live.len() as u64) as usize]);
                }
            }
            80..=82 if crashes => {
                // Never all of them: someone must be left to check.
                let live = w.live();
                if live.len() > 1 {
                    w.crashed[live[rng.below(live.len() as u64) as usize]] = true;
                }
            }
            83..=87 => {
                w.cut = if w.cut.is_some() { None } else { Some((0..n).map(|_| rng.chance(50)).collect()) };
            }
            _ => {}
        }
    }
    w
}

/// 30 000 runs (a fraction of a second): a proposer that ignores what a majority already accepted
/// is caught within the first few thousand, a majority of half the view at once.
#[test]
fn no_two_views_for_one_epoch_under_delays_losses_partitions_and_crashes() {
    for seed in 0..30000 {
        let w = chaos(seed, true, true);
        assert!(!w.committed.is_empty(), "seed {seed}");
    }
}

#[test]
fn once_the_network_heals_every_live_member_commits_the_same_new_view() {
    let mut progressed = 0;
    for seed in 0..1000 {
        let mut w = chaos(seed, false, false);
        w.cut = None;
        let start = w.members.iter().map(|m| m.view.epoch).max().unwrap();
        // The most senior member of the newest view proposes until its members are past `start`;
        // nothing is lost now. A member left out while it was cut off (evicted) is not waited for.
        let newest = |w: &World| w.members.iter().map(|m| m.view.clone()).max_by_key(|v| v.epoch).unwrap();
        for _ in 0..20 {
            let leader = newest(&w).members[0] as usize;
            w.propose(leader, None);
            while !w.wire.is_empty() {
                w.deliver(0, false);
            }
            w.decide(leader);
            while !w.wire.is_empty() {
                w.deliver(0, false);
            }
            let v = newest(&w);
            if v.epoch > start && v.members.iter().all(|&m| w.members[m as usize].view == v) {
                break;
            }
        }
        let first = newest(&w);
        assert!(first.epoch > start, "seed {seed}: no view committed after the network healed");
        for m in w.members.iter().filter(|m| first.members.contains(&m.id)) {
            assert_eq!(m.view, first, "seed {seed}: member {} did not adopt the new view", m.id);
        }
        progressed += (start > 0) as usize;
    }
    assert!(progressed > 100, "the chaos phase rarely committed anything ({progressed} of 1000 runs): the test is too gentle");
}
