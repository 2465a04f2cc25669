//! Frames that arrived before their receive was posted, indexed so that nothing scans them all:
//! by call (frame kind and sequence number or tag), then by (sender, step, segment, ordinal).
//! Finishing a call drops its strays with one lookup, and an any-source receive finds the
//! next message of each sender with one ordered lookup per sender. The bytes held per sender
//! are counted against the mailbox's budget.

use super::mailbox::Key;
use crate::net::frame::FrameHeader;
use std::collections::{BTreeMap, HashMap};

pub(super) struct Stashed {
    pub header: FrameHeader,
    pub data: Vec<u8>,
    /// When it was read: a receive posted later completes as of then (`Event::at`).
    pub arrived: std::time::Instant,
}

/// (kind, seq or tag)
type CallKey = (u8, u64);
/// (peer, step, segment, ordinal)
type PartKey = (usize, u32, u32, u32);

fn split(k: Key) -> (CallKey, PartKey) {
    ((k.1, k.2), (k.0, k.3, k.4, k.5))
}

fn join(c: CallKey, p: PartKey) -> Key {
    (p.0, c.0, c.1, p.1, p.2, p.3)
}

#[derive(Default)]
pub(super) struct Stash {
    calls: HashMap<CallKey, BTreeMap<PartKey, Stashed>>,
    /// Payload bytes held, per sender.
    held: HashMap<usize, u64>,
}

impl Stash {
    /// Payload bytes held from `peer`.
    pub fn held(&self, peer: usize) -> u64 {
        self.held.get(&peer).copied().unwrap_or(0)
    }

    /// Counts `n` bytes about to be read from `peer` (until `release`), so two lanes of one
    /// peer cannot both pass the budget check with the same room.
    pub fn reserve(&mut self, peer: usize, n: u64) {
        *self.held.entry(peer).or_insert(0) += n;
    }

    pub fn release(&mut self, peer: usize, n: u64) {
        self.sub(peer, n);
    }

    pub fn insert(&mut self, key: Key, s: Stashed) {
        let (c, p) = split(key);
        *self.held.entry(key.0).or_insert(0) += s.data.len() as u64;
        if let Some(old) = self.calls.entry(c).or_default().insert(p, s) {
            self.forget(key.0, &old);
        }
    }

    pub fn remove(&mut self, key: &Key) -> Option<Stashed> {
        let (c, p) = split(*key);
        let parts = self.calls.get_mut(&c)?;
        let s = parts.remove(&p)?;
        if parts.is_empty() {
            self.calls.remove(&c);
        }
        self.forget(key.0, &s);
        Some(s)
    }

    /// Takes every frame of call (`kind`, `seq`): the first key, and the frames.
    pub fn remove_call(&mut self, kind: u8, seq: u64) -> Vec<(Key, Stashed)> {
        let Some(parts) = self.calls.remove(&(kind, seq)) else { return Vec::new() };
        let out: Vec<(Key, Stashed)> = parts.into_iter().map(|(p, s)| (join((kind, seq), p), s)).collect();
        for (k, s) in &out {
            self.forget(k.0, s);
        }
        out
    }

    /// The lowest sender whose next message (ordinal `next(sender)`) of `kind` and `tag` is
    /// here, and that message's key: one ordered lookup per sender present, not a scan.
    pub fn next_in_line(&self, kind: u8, tag: u64, next: impl Fn(usize) -> u32) -> Option<Key> {
        let parts = self.calls.get(&(kind, tag))?;
        let mut from = 0usize;
        while let Some((&(peer, _, _, _), _)) = parts.range((from, 0, 0, 0)..).next() {
            let want = (peer, 0, 0, next(peer));
            if parts.contains_key(&want) {
                return Some(join((kind, tag), want));
            }
            from = peer + 1;
        }
        None
    }

    /// Drops everything; returns the buffers.
    pub fn clear(&mut self) -> Vec<Vec<u8>> {
        self.held.clear();
        self.calls.drain().flat_map(|(_, parts)| parts.into_values().map(|s| s.data)).collect()
    }

    #[cfg(test)]
    pub fn held_total(&self) -> u64 {
        self.held.values().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.calls.values().all(BTreeMap::is_empty)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.calls.values().map(BTreeMap::len).sum()
    }

    fn forget(&mut self, peer: usize, s: &Stashed) {
        self.sub(peer, s.data.len() as u64);
    }

    fn sub(&mut self, peer: usize, n: u64) {
        if let Some(h) = self.held.get_mut(&peer) {
            *h = h.saturating_sub(n);
            if *h == 0 {
                self.held.remove(&peer);
            }
        }
    }
}
