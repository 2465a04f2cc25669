//! Caller memory as the core sees it: a pointer and a length, and the two helpers that turn one
//! into a slice. Every raw pointer in the core comes from a [`RawBuf`] handed to an `unsafe fn`
//! entry point (`Communicator::collective`, `send`, `recv`) or from a buffer the core owns.
//!
//! # The one safety contract
//! Memory named by a `RawBuf` stays valid for its `len` bytes, and nothing else reads or writes
//! it through a Rust reference, from the call that hands it to the core until the operation
//! using it has completed (its `Work` is done, successfully or not). The core keeps its side:
//! an operation returns only after every link thread has stopped touching the memory (finished,
//! failed or cancelled), so no write lands after completion.

/// Caller memory (a pointer and a length in bytes). Null is fine when the length is 0.
#[derive(Clone, Copy, Debug)]
pub struct RawBuf {
    pub ptr: *mut u8,
    pub len: usize,
}
// SAFETY: see the module's contract: the memory outlives the operation and is not aliased by
// Rust references while the core uses it, so link threads may touch it.
unsafe impl Send for RawBuf {}
unsafe impl Sync for RawBuf {}

impl RawBuf {
    pub const EMPTY: RawBuf = RawBuf { ptr: std::ptr::null_mut(), len: 0 };

    /// The bytes of a buffer the caller owns: `RawBuf::of(&mut v[..])`.
    pub fn of(bytes: &mut [u8]) -> RawBuf {
        RawBuf { ptr: bytes.as_mut_ptr(), len: bytes.len() }
    }

    /// The memory as a slice, for a caller outside the core that only reads it (hashing).
    ///
    /// # Safety
    /// The memory must be valid for reads of `len` bytes and not written while the slice lives.
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        bytes(self.ptr, self.len)
    }

    /// The memory as a mutable slice, for a caller outside the core that rewrites it in place.
    ///
    /// # Safety
    /// The memory must be valid for writes of `len` bytes and not touched by anything else while
    /// the slice lives.
    pub unsafe fn as_slice_mut<'a>(&self) -> &'a mut [u8] {
        bytes_mut(self.ptr, self.len)
    }
}

/// # Safety
/// `p` must be valid for writes of `len` bytes and not aliased meanwhile (any pointer is fine
/// when `len == 0`).
pub(crate) unsafe fn bytes_mut<'a>(p: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(p, len)
    }
}

/// # Safety
/// `p` must be valid for reads of `len` bytes, not written meanwhile (any pointer is fine when
/// `len == 0`).
pub(crate) unsafe fn bytes<'a>(p: *const u8, len: usize) -> &'a [u8] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(p, len)
    }
}
