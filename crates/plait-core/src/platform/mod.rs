//! What the operating system knows that std and socket2 do not say portably: one module per fact,
//! each with a Linux, a macOS and a Windows implementation and a documented fallback for anything
//! else. Nothing outside this folder calls a platform-specific API; where a fact is unknown, the
//! function says so (`None`) and the caller uses its documented default, never a guess.
//!
//! - `socket`: a receive that never waits, and the receive low-water mark.
//! - `link`: an interface's link speed and MTU.
//! - `sockbuf`: the socket-buffer autotuning maxima and the system cap.
//! - `host`: an identity of this host (one kernel boot, one network stack) for same-host routes.
//! - `shm`: memory two processes of one host share, under a name one gives the other.

pub mod host;
pub mod link;
pub mod shm;
pub mod sockbuf;
pub mod socket;
