//! Subgroups that share the links of the communicator that owns them.
//!
//! A subgroup (torch's `new_group`, a DeviceMesh dimension) is a session of its own (its own
//! mailbox, sequence numbers, failure switch), but it sends on the owner's links: its frames carry
//! its group id, and the owner's `Demux` hands them here to be routed to the subgroup, with the
//! sender's rank translated to its rank in the subgroup. Creating one opens no socket and sends
//! nothing: a few microseconds instead of a rendezvous, connections and probes.
//!
//! Frames can arrive for a group this rank has not created yet (a peer created it first and sent
//! at once). They wait here, up to `PENDING_MAX` bytes, and are delivered, in order, when the
//! group is registered. Frames for a group that has ended are read and dropped.

use super::blame;
use super::demux::Demux;
use super::Session;
use crate::error::PlaitError;
use crate::net::frame::FrameHeader;
use crate::net::peer::{Delivery, Inbox, LaneWaker};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::io::{self, Read};
use std::sync::{Arc, Weak};

/// Bytes of frames held for groups not created yet. Torch makes every member create a group
/// before any uses it (a store barrier ends `new_group`), so little waits here; the bound stops
/// a confused peer from filling memory.
const PENDING_MAX: usize = 64 << 20;

/// The stable id of the group named `name`: every member computes the same one, and 0 (the
/// owner's own frames) is never produced.
pub(crate) fn group_id(name: &str) -> u64 {
    // FNV-1a: stable across runs and platforms, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.as_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}

struct Route {
    demux: Arc<Demux>,
    session: Weak<Session>,
    /// Owner rank -> rank in the group, for the members.
    rank_of: HashMap<usize, usize>,
}

#[derive(Default)]
struct Inner {
    live: HashMap<u64, Arc<Route>>,
    /// Frames for groups not created yet: (group, owner rank of the sender, header, payload).
    pending: Vec<(u64, usize, FrameHeader, Vec<u8>)>,
    pending_bytes: usize,
    ended: HashSet<u64>,
}

#[derive(Default)]
pub(crate) struct Groups {
    inner: Mutex<Inner>,
}

impl Groups {
    /// Starts routing frames of group `id` (members `ranks`, in group-rank order) to `demux`,
    /// after the frames that were waiting for it.
    pub(crate) fn register(&self, id: u64, ranks: &[usize], demux: Arc<Demux>, session: &Arc<Session>) -> Result<(), PlaitError> {
        let route = Arc::new(Route {
            demux,
            session: Arc::downgrade(session),
            rank_of: ranks.iter().enumerate().map(|(g, &r)| (r, g)).collect(),
        });
        let mut inner = self.inner.lock();
        if inner.live.contains_key(&id) || inner.ended.contains(&id) {
            return Err(PlaitError::invalid(format!(
                "a group with id {id:#x} exists or existed on this communicator: give each group a new name"
            )));
        }
        // Delivered under the lock, so a frame arriving meanwhile waits and keeps its place.
        let (ours, others): (Vec<_>, Vec<_>) = std::mem::take(&mut inner.pending).into_iter().partition(|p| p.0 == id);
        inner.pending = others;
        for (_, sender, header, payload) in ours {
            inner.pending_bytes -= payload.len();
            // Already read: no lane to hold back (the group's mailbox refuses what it cannot hold).
            let _ = route_to(&route, id, sender, &header, &mut payload.as_slice(), None);
        }
        inner.live.insert(id, route);
        Ok(())
    }

    /// Stops routing group `id`; its later frames are dropped.
    pub(crate) fn unregister(&self, id: u64) {
        let mut inner = self.inner.lock();
        inner.live.remove(&id);
        inner.ended.insert(id);
    }

    /// Hands a frame of group `h.group` from `sender` (an owner rank) to that group.
    pub(crate) fn deliver(&self, sender: usize, h: &FrameHeader, payload: &mut dyn Read, lane: Option<&LaneWaker>) -> io::Result<Delivery> {
        let route = {
            let mut inner = self.inner.lock();
            match inner.live.get(&h.group) {
                Some(r) => r.clone(),
                None if inner.ended.contains(&h.group) => {
                    drop(inner);
                    return io::copy(payload, &mut io::sink()).map(|_| Delivery::Taken);
                }
                None => {
                    let n = h.nbytes as usize;
                    if n > PENDING_MAX.saturating_sub(inner.pending_bytes) {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("sent more than {} MiB for group {:#x}, which this rank has not created", PENDING_MAX >> 20, h.group),
                        ));
                    }
                    // Read under the lock: registration must not overtake this frame.
                    let mut data = Vec::with_capacity(n);
                    payload.take(n as u64).read_to_end(&mut data)?;
                    inner.pending_bytes += data.len();
                    inner.pending.push((h.group, sender, *h, data));
                    return Ok(Delivery::Taken);
                }
            }
        };
        route_to(&route, h.group, sender, h, payload, lane)
    }

    /// The owner failed: so does every group on its links.
    pub(crate) fn fail_all(&self, err: &PlaitError) {
        let sessions: Vec<_> = self.inner.lock().live.values().filter_map(|r| r.session.upgrade()).collect();
        for s in sessions {
            s.fail(err.clone(), false);
        }
    }

    /// `sender` closed the owner's communicator: the groups it is in hear nothing more from it.
    pub(crate) fn peer_closed(&self, sender: usize, err: &PlaitError) {
        let routes: Vec<_> = self.inner.lock().live.values().cloned().collect();
        for r in routes {
            if let (Some(&g), Some(s)) = (r.rank_of.get(&sender), r.session.upgrade()) {
                let err = match err {
                    PlaitError::Peer { op, addr, what, waited, .. } => {
                        PlaitError::Peer { op: op.clone(), peer: g, addr: addr.clone(), what: what.clone(), waited: *waited }
                    }
                    other => other.clone(),
                };
                s.mailbox.peer_closed(g, &err);
            }
        }
    }
}

fn route_to(route: &Route, id: u64, sender: usize, h: &FrameHeader, payload: &mut dyn Read, lane: Option<&LaneWaker>) -> io::Result<Delivery> {
    match route.rank_of.get(&sender) {
        Some(&g) => match route.demux.deliver(g, h, payload, lane) {
            // The group's mailbox read the frame whole and could not use it (the ranks disagree
            // about a call): that breaks the group, not the links the other groups share.
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                if let Some(s) = route.session.upgrade() {
                    let addr = s.peer_addr(g);
                    s.fail(PlaitError::Peer { op: String::new(), peer: g, addr, what: blame::link_end(&e), waited: Default::default() }, true);
                }
                Ok(Delivery::Taken)
            }
            other => other,
        },
        None => {
            // Read and dropped: the stream stays in sync, and the group hears why.
            io::copy(payload, &mut io::sink())?;
            if let Some(s) = route.session.upgrade() {
                s.fail(
                    PlaitError::Broken(format!("rank {sender} of the owning communicator sent a frame for group {id:#x}, of which it is not a member")),
                    false,
                );
            }
            Ok(Delivery::Taken)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_ids_are_stable_and_never_the_owners() {
        // Every member, on every platform and build, must compute the same id for a name.
        assert_eq!(group_id("torch/1/0"), group_id("torch/1/0"));
        assert_ne!(group_id("torch/1/0"), group_id("torch/2/0"));
        assert_eq!(group_id(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(group_id("a"), 0xaf63_dc4c_8601_ec8c);
        assert!(group_id("") != 0);
    }

    #[test]
    fn frames_for_a_group_not_created_yet_are_bounded_even_with_absurd_sizes() {
        let groups = Groups::default();
        let frame = |nbytes: u64| FrameHeader { kind: crate::net::frame::FrameKind::Data as u8, group: 42, nbytes, ..Default::default() };
        groups.deliver(1, &frame(3), &mut &b"abc"[..], None).expect("a small early frame is kept");
        for nbytes in [u64::MAX, u64::MAX - 2, 1 << 63, PENDING_MAX as u64] {
            // An endless stream: a check that reads first would never return.
            let err = groups.deliver(1, &frame(nbytes), &mut io::repeat(0), None).expect_err("refused");
            assert!(err.to_string().contains("which this rank has not created"), "{err}");
        }
    }
}
