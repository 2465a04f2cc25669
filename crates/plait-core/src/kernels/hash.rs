//! Content hashes of shared state (elastic mode): BLAKE3 of every fixed-size chunk of a buffer,
//! the chunks hashed on several threads at once.

use std::thread;

/// Bytes of one hash.
pub const HASH_BYTES: usize = 32;

/// The BLAKE3 hash of each `chunk`-byte piece of `data` (the last one may be shorter), one after
/// the other (`HASH_BYTES` each). An empty `data` has no chunks.
pub fn chunk_hashes(data: &[u8], chunk: usize) -> Vec<u8> {
    assert!(chunk > 0, "chunk_hashes: chunk size 0");
    let pieces: Vec<&[u8]> = data.chunks(chunk).collect();
    let mut out = vec![0u8; pieces.len() * HASH_BYTES];
    // Small buffers, or one piece, on the caller's thread: a thread would cost more than it saves.
    let threads = if data.len() < (2 << 20) { 1 } else { thread::available_parallelism().map_or(1, |n| n.get()) };
    let per = pieces.len().div_ceil(threads).max(1);
    if per >= pieces.len() {
        hash_into(&mut out, &pieces);
        return out;
    }
    thread::scope(|s| {
        for (slots, mine) in out.chunks_mut(per * HASH_BYTES).zip(pieces.chunks(per)) {
            s.spawn(move || hash_into(slots, mine));
        }
    });
    out
}

fn hash_into(slots: &mut [u8], pieces: &[&[u8]]) {
    for (slot, piece) in slots.chunks_mut(HASH_BYTES).zip(pieces) {
        slot.copy_from_slice(blake3::hash(piece).as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_has_the_hash_of_its_bytes_on_one_thread_or_many() {
        let data: Vec<u8> = (0..(5 << 20) + 123).map(|i: usize| (i * 31 % 251) as u8).collect();
        for chunk in [1 << 20, 4096, (5 << 20) + 123, 10 << 20] {
            let h = chunk_hashes(&data, chunk);
            let pieces: Vec<&[u8]> = data.chunks(chunk).collect();
            assert_eq!(h.len(), pieces.len() * HASH_BYTES);
            for (piece, got) in pieces.iter().zip(h.chunks(HASH_BYTES)) {
                assert_eq!(got, blake3::hash(piece).as_bytes());
            }
        }
        assert!(chunk_hashes(&[], 4096).is_empty());
    }

    #[test]
    fn one_changed_byte_changes_only_its_chunk_hash() {
        let mut data = vec![7u8; 3 * 4096 + 5];
        let before = chunk_hashes(&data, 4096);
        data[4096 + 17] ^= 1;
        let after = chunk_hashes(&data, 4096);
        let differ: Vec<usize> = (0..4).filter(|&i| before[i * 32..(i + 1) * 32] != after[i * 32..(i + 1) * 32]).collect();
        assert_eq!(differ, vec![1]);
    }
}
