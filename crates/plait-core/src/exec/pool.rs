//! Reusable byte buffers for snapshots, scratch and early-arriving messages, so that a call
//! after warm-up allocates nothing proportional to its size (fresh pages cost a fault each).

use parking_lot::Mutex;

/// Buffers kept for reuse at most (the largest win; a few suffice for ops in flight).
const KEEP: usize = 8;

#[derive(Default)]
pub struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
}

impl BufferPool {
    pub fn new() -> Self {
        Self::default()
    }

    /// A buffer of exactly `len` bytes with unspecified (initialised) contents.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len == 0 {
            return Vec::new();
        }
        let reused = {
            let mut free = self.free.lock();
            // The smallest buffer that fits, so large ones stay available for large calls.
            let best = free.iter().enumerate().filter(|(_, b)| b.len() >= len).min_by_key(|(_, b)| b.len()).map(|(i, _)| i);
            best.map(|i| free.swap_remove(i))
        };
        match reused {
            Some(mut b) => {
                b.truncate(len);
                b
            }
            None => vec![0u8; len],
        }
    }

    pub fn give(&self, mut buf: Vec<u8>) {
        if buf.capacity() == 0 {
            return;
        }
        // Keep the full capacity initialised so a later `take` never writes to grow it.
        let cap = buf.capacity();
        buf.resize(cap, 0);
        let mut free = self.free.lock();
        free.push(buf);
        if free.len() > KEEP {
            // Drop the smallest: it is the cheapest to make again.
            let smallest = free.iter().enumerate().min_by_key(|(_, b)| b.len()).map(|(i, _)| i).unwrap();
            free.swap_remove(smallest);
        }
    }
}
