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
    let threads = thread::available_parallelism().map_or(1, |n| n.get()).min(pieces.len()).max(1);
    if threads == 1 || data.len() < (2 << 20) {
        for (piece, slot) in pieces.iter().zip(out.chunks_mut(HASH_BYTES)) {
            slot.copy_from_slice(blake3::hash(piece).as_bytes());
        }
        return out;
    }
    // Piece i goes to thread i % threads: neighbours on different threads, so an uneven last
    // piece costs one thread little.
    let mut slots: Vec<Vec<(usize, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, slot) in out.chunks_mut(HASH_BYTES).enumerate() {
        slots[i % threads].push((i, slot));
    }
    thread::scope(|s| {
        for mine in slots {
            let pieces = &pieces;
            s.spawn(move || {
                for (i, slot) in mine {
                    slot.copy_from_slice(blake3::hash(pieces[i]).as_bytes());
                }
            });
        }
    });
    out
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
