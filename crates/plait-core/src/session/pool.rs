//! Reusable byte buffers for snapshots, scratch and early-arriving messages, so that a call
//! after warm-up allocates nothing proportional to its size (fresh pages cost a fault each,
//! and zeroing them costs as much as the copy they are for).

use parking_lot::Mutex;

/// A kept buffer serves requests of at least this fraction of its size, so a 1 MiB early
/// segment never takes (and pins) the 64 MiB snapshot buffer.
const FIT: usize = 2;
/// Buffers kept at most; enough for every segment of a few operations in flight.
const KEEP: usize = 32;
/// Bytes kept beyond twice the largest buffer asked for.
const SLACK: usize = 16 << 20;

#[derive(Default)]
pub struct BufferPool {
    inner: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    /// Every buffer here has `len == capacity`, all of it initialised.
    free: Vec<Vec<u8>>,
    bytes: usize,
    largest: usize,
}

impl BufferPool {
    /// A buffer of exactly `len` bytes with unspecified (initialised) contents.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len == 0 {
            return Vec::new();
        }
        let reused = {
            let mut k = self.inner.lock();
            k.largest = k.largest.max(len);
            // The smallest buffer that fits well, so large ones stay free for large calls.
            let best = k
                .free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len && b.len() / FIT <= len)
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            best.map(|i| {
                let b = k.free.swap_remove(i);
                k.bytes -= b.len();
                b
            })
        };
        match reused {
            Some(mut b) => {
                b.truncate(len);
                b
            }
            None => vec![0u8; len],
        }
    }

    /// Returns a buffer that came from `take`.
    pub fn give(&self, mut buf: Vec<u8>) {
        if buf.capacity() == 0 {
            return;
        }
        // SAFETY: buffers from `take` were initialised to their whole capacity when made
        // (`vec![0; len]`, whose capacity is len) and `truncate` of u8 leaves the bytes as
        // they were, so the full length is initialised without writing it again.
        unsafe { buf.set_len(buf.capacity()) };
        let mut k = self.inner.lock();
        k.bytes += buf.len();
        k.free.push(buf);
        let budget = 2 * k.largest + SLACK;
        while k.free.len() > KEEP || (k.bytes > budget && k.free.len() > 1) {
            // Drop the smallest: it is the cheapest to make again.
            let smallest = k.free.iter().enumerate().min_by_key(|(_, b)| b.len()).map(|(i, _)| i).unwrap();
            let b = k.free.swap_remove(smallest);
            k.bytes -= b.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_buffers_of_a_fitting_size_only() {
        let pool = BufferPool::default();
        let big = pool.take(64 << 20);
        let big_ptr = big.as_ptr();
        pool.give(big);
        let small = pool.take(1 << 20);
        assert_ne!(small.as_ptr(), big_ptr, "a small request must not take the big buffer");
        let small_ptr = small.as_ptr();
        pool.give(small);
        let again = pool.take((1 << 20) - 100);
        assert_eq!(again.as_ptr(), small_ptr);
        assert_eq!(again.len(), (1 << 20) - 100);
        pool.give(again);
        let big2 = pool.take(48 << 20);
        assert_eq!(big2.as_ptr(), big_ptr, "a large request reuses the large buffer");
        assert_eq!(big2.len(), 48 << 20);
    }
}
