//! Where a received payload goes: copied into the destination, reduced into it, or split over
//! the parts of a bundle; decoded on the way when it travelled compressed. Whatever a landing
//! overwrites in the caller's output is first kept (`Keep`), so a failed operation can put it
//! back.

use crate::codec::{self, Wire};
use crate::dtype::{DType, ReduceOp};
use crate::kernels;
use crate::raw::{bytes, bytes_mut};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::io::{self, Read};
use std::sync::Arc;

/// Where the bytes of one output region go before anything overwrites them, so that a failed
/// operation can put them back. One per region, shared by everything that writes the region
/// (receives on any receiver thread, the operation's own local steps). Writers keep the region
/// from its start up to the end of what they are about to write, on their own thread, just
/// before writing: a receive never waits for a copy to be posted, a region nobody wrote is never
/// copied, and a receive landing piece by piece copies each piece while it is in the cache it
/// is about to be reduced or received in.
pub struct Keep {
    region: *mut u8,
    copy: *mut u8,
    len: usize,
    /// Bytes of the region kept so far, from its start.
    kept: Mutex<usize>,
}
// SAFETY: both pointers refer to buffers the operation keeps alive until every transfer has
// completed or been cancelled; `kept` serialises the copying.
unsafe impl Send for Keep {}
unsafe impl Sync for Keep {}

impl Keep {
    /// # Safety
    /// `region` and `copy` must be valid for `len` bytes for as long as the Keep is used.
    pub unsafe fn new(region: *mut u8, copy: *mut u8, len: usize) -> Keep {
        Keep { region, copy, len, kept: Mutex::new(0) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Call before writing anything below byte `end` of the region.
    pub fn before_write(&self, end: usize) {
        let end = end.min(self.len);
        let mut kept = self.kept.lock();
        if *kept < end {
            let (a, n) = (*kept, end - *kept);
            // Streaming stores: the copy is only read back after a failure.
            // SAFETY: a..a + n lies inside both buffers (see `new`).
            kernels::copy_streaming(unsafe { bytes_mut(self.copy.add(a), n) }, unsafe { bytes(self.region.add(a), n) });
            *kept = end;
        }
    }

    /// Puts back what was kept (everything anybody was about to overwrite).
    pub fn restore(&self) {
        let kept = *self.kept.lock();
        unsafe { bytes_mut(self.region, kept) }.copy_from_slice(unsafe { bytes(self.copy, kept) });
    }
}

fn before_write(keep: &Option<Arc<Keep>>, end: usize) {
    if let Some(k) = keep {
        k.before_write(end);
    }
}

pub enum Landing {
    /// Read the payload into `dst`.
    Copy { dst: *mut u8, keep: Option<Arc<Keep>> },
    /// `dst = with (+) payload`; `with` may equal `dst` (accumulate). `lock` serialises
    /// accumulations into the same destination by different receiver threads.
    Reduce { dst: *mut u8, with: *const u8, dtype: DType, op: ReduceOp, lock: Arc<Mutex<()>>, keep: Option<Arc<Keep>> },
    /// Several small transfers of one step from the same peer, sent as one frame: the payload
    /// is their wire bytes back to back, in ordinal order.
    Bundle(Vec<Part>),
}

/// One transfer inside a bundle: where it lands, its size there and on the wire.
pub struct Part {
    pub landing: Landing,
    pub len: usize,
    pub wire_len: usize,
}

/// Receives land this much at a time: each piece is kept (see `Keep`) and, for a reducing
/// receive, reduced while it is still in cache (a multiple of every element size).
const LANDING_PIECE: usize = 256 * 1024;

thread_local! {
    static REDUCE_TMP: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static DECODE_TMP: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}


impl Landing {
    /// Reads `len` destination bytes' worth of payload (`wire_len` bytes on the wire, encoded
    /// with `wire`) from the stream into the landing place. Fails only when the stream does.
    pub(crate) fn from_stream(&self, len: usize, wire: Wire, wire_len: usize, payload: &mut dyn Read) -> io::Result<()> {
        match (self, wire) {
            (Landing::Copy { dst, keep }, Wire::Native) => {
                // SAFETY: the posted receive covers `len` bytes at dst (see `Posted`).
                let dst = unsafe { bytes_mut(*dst, len) };
                // Piece by piece: each piece is kept just before the socket overwrites it.
                for at in (0..len).step_by(LANDING_PIECE) {
                    let end = (at + LANDING_PIECE).min(len);
                    before_write(keep, end);
                    payload.read_exact(&mut dst[at..end])?;
                }
                Ok(())
            }
            (Landing::Reduce { .. }, Wire::Native) => REDUCE_TMP.with(|tmp| {
                let mut tmp = tmp.borrow_mut();
                tmp.resize(LANDING_PIECE.min(len), 0);
                for at in (0..len).step_by(LANDING_PIECE) {
                    let piece = &mut tmp[..LANDING_PIECE.min(len - at)];
                    payload.read_exact(piece)?;
                    self.reduce_at(at, piece);
                }
                Ok(())
            }),
            _ => REDUCE_TMP.with(|tmp| {
                let mut tmp = tmp.borrow_mut();
                tmp.resize(wire_len, 0);
                payload.read_exact(&mut tmp[..])?;
                self.from_memory(len, wire, &tmp[..]);
                Ok(())
            }),
        }
    }

    /// Puts a whole (wire-encoded) payload in the landing place: decoded, then copied or reduced.
    pub(crate) fn from_memory(&self, len: usize, wire: Wire, wire_bytes: &[u8]) {
        match self {
            Landing::Bundle(parts) => {
                let mut at = 0;
                for part in parts {
                    part.landing.from_memory(part.len, wire, &wire_bytes[at..at + part.wire_len]);
                    at += part.wire_len;
                }
            }
            Landing::Copy { dst, keep } if wire == Wire::Native => {
                before_write(keep, len);
                unsafe { bytes_mut(*dst, len) }.copy_from_slice(wire_bytes)
            }
            Landing::Copy { dst, keep } => {
                before_write(keep, len);
                codec::decode(wire, wire_bytes, unsafe { bytes_mut(*dst, len) })
            }
            Landing::Reduce { .. } if wire == Wire::Native => self.reduce_at(0, wire_bytes),
            Landing::Reduce { dst, with, dtype, op, lock, keep } if *dtype == DType::F32 && op.combiner() == ReduceOp::Sum => {
                // Decoded and added in one pass, no temporary.
                let _guard = lock.lock();
                before_write(keep, len);
                let d = unsafe { bytes_mut(*dst, len) };
                if std::ptr::eq(*dst as *const u8, *with) {
                    codec::decode_add_into(wire, wire_bytes, d);
                } else {
                    codec::decode_add_from(wire, wire_bytes, unsafe { bytes(*with, len) }, d);
                }
            }
            Landing::Reduce { .. } => DECODE_TMP.with(|t| {
                let mut t = t.borrow_mut();
                t.resize(len, 0);
                codec::decode(wire, wire_bytes, &mut t[..]);
                self.reduce_at(0, &t[..]);
            }),
        }
    }

    /// Reduces `incoming` into the landing's bytes `at..at + incoming.len()`.
    fn reduce_at(&self, at: usize, incoming: &[u8]) {
        if let Landing::Reduce { dst, with, dtype, op, lock, keep } = self {
            let _guard = lock.lock();
            let len = incoming.len();
            before_write(keep, at + len);
            // SAFETY: the posted receive covers `at + len` bytes of dst and with.
            let d = unsafe { bytes_mut(dst.add(at), len) };
            if std::ptr::eq(*dst as *const u8, *with) {
                kernels::reduce_into(d, incoming, *dtype, *op);
            } else {
                let w = unsafe { bytes(with.add(at), len) };
                kernels::reduce_from(d, w, incoming, *dtype, *op);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_puts_back_only_what_writers_kept() {
        let mut region = *b"abcdefgh";
        let mut copy = [0u8; 8];
        // SAFETY: both buffers outlive the keep, used on this thread only.
        let keep = unsafe { Keep::new(region.as_mut_ptr(), copy.as_mut_ptr(), 8) };
        keep.before_write(3);
        region[..3].copy_from_slice(b"XYZ");
        keep.before_write(2); // already kept: no second copy over the written bytes
        region[5] = b'!'; // written without keeping: not the keep's to restore
        keep.restore();
        assert_eq!(&region, b"abcde!gh");
    }

    #[test]
    fn a_reducing_landing_adds_and_keeps_the_output() {
        let mut out = [1.0f32, 2.0, 3.0];
        let mut copy = [0u8; 12];
        let dst = out.as_mut_ptr() as *mut u8;
        // SAFETY: both buffers outlive the keep and the landing, used on this thread only.
        let keep = Arc::new(unsafe { Keep::new(dst, copy.as_mut_ptr(), 12) });
        let lock = Arc::new(Mutex::new(()));
        let landing = Landing::Reduce { dst, with: dst, dtype: DType::F32, op: ReduceOp::Sum, lock, keep: Some(keep.clone()) };
        let incoming: Vec<u8> = [10.0f32, 20.0, 30.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        landing.from_stream(12, Wire::Native, 12, &mut &incoming[..]).unwrap();
        assert_eq!(out, [11.0, 22.0, 33.0]);
        keep.restore();
        assert_eq!(out, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn a_bundle_splits_its_payload_over_its_parts_in_order() {
        let (mut a, mut b) = ([0u8; 2], [0u8; 3]);
        let parts = vec![
            Part { landing: Landing::Copy { dst: a.as_mut_ptr(), keep: None }, len: 2, wire_len: 2 },
            Part { landing: Landing::Copy { dst: b.as_mut_ptr(), keep: None }, len: 3, wire_len: 3 },
        ];
        Landing::Bundle(parts).from_memory(5, Wire::Native, b"hello");
        assert_eq!((&a, &b), (b"he", b"llo"));
    }

    #[test]
    fn a_stream_ending_early_is_an_error_not_a_short_landing() {
        let mut dst = [0u8; 8];
        let landing = Landing::Copy { dst: dst.as_mut_ptr(), keep: None };
        let err = landing.from_stream(8, Wire::Native, 8, &mut &b"short"[..]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
