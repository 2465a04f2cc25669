//! Errors name the peer, the operation and the time waited, because "it hung" is not a diagnosis.

use std::time::Duration;
use thiserror::Error;

pub type Result<T> = std::result::Result<T, PlaitError>;

#[derive(Debug, Clone, Error)]
pub enum PlaitError {
    /// Bad arguments, detected before anything is sent.
    #[error("{0}")]
    InvalidArgument(String),
    /// Bad configuration (unknown algorithm name, malformed environment variable).
    #[error("{0}")]
    Config(String),
    /// A peer died, closed or reset its connection, or sent something unintelligible.
    #[error("{}peer rank {peer}{} {what}{}", op_prefix(op), addr_part(addr), waited_part(waited))]
    Peer { op: String, peer: usize, addr: String, what: String, waited: Duration },
    /// A deadline passed.
    #[error("{}Timed out after {waited:.3?} waiting for {waiting_on}", op_prefix(op))]
    Timeout { op: String, waiting_on: String, waited: Duration },
    /// Ranks disagree on what they are doing (collective, dtype, count, op, root).
    #[error("{}mismatch with rank {peer}: {detail}", op_prefix(op))]
    Mismatch { op: String, peer: usize, detail: String },
    /// Another rank refused its arguments for this call (so it will never take part); nothing
    /// of the call was kept, and the communicator stays usable.
    #[error("{}rank {peer} refused this call: {reason}", op_prefix(op))]
    Refused { op: String, peer: usize, reason: String },
    /// `abort()` was called.
    #[error("{}aborted ({reason})", op_prefix(op))]
    Aborted { op: String, reason: String },
    /// The communicator already failed (or was closed); it must be rebuilt.
    #[error("communicator is no longer usable: {0}")]
    Broken(String),
    /// Elastic mode: a member was lost while this operation was under way (or the view changed
    /// before it started); it failed on every member, the buffer is as it was, and the group
    /// goes on in `epoch` without `lost`. Retrying runs it over the new view.
    #[error("{}the group lost {lost}; this operation failed on every member and changed nothing; the group goes on in epoch {epoch} with {members} member(s): retry it", op_prefix(op))]
    PeerLost { op: String, epoch: u64, members: usize, lost: String },
    /// Elastic mode: the group went on without this member (it was cut off or too slow); it must
    /// join again.
    #[error("this member is no longer in the group: {0}")]
    Evicted(String),
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    #[error("I/O: {0}")]
    Io(String),
    /// A bug in plait (a panic caught where it would have crossed a thread or the FFI boundary).
    #[error("internal error, please report it: {0}")]
    Internal(String),
}

fn op_prefix(op: &str) -> String {
    if op.is_empty() {
        String::new()
    } else {
        format!("{op}: ")
    }
}

fn addr_part(addr: &str) -> String {
    if addr.is_empty() {
        String::new()
    } else {
        format!(" ({addr})")
    }
}

fn waited_part(waited: &Duration) -> String {
    if waited.is_zero() {
        String::new()
    } else {
        format!(" after {waited:.3?}")
    }
}

impl PlaitError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        PlaitError::InvalidArgument(msg.into())
    }

    /// The same failure, reported for another operation (every op in flight fails with the
    /// reason the communicator broke, under its own name).
    pub fn for_op(&self, op: &str) -> PlaitError {
        match self {
            PlaitError::Peer { peer, addr, what, waited, .. } => PlaitError::Peer {
                op: op.to_string(),
                peer: *peer,
                addr: addr.clone(),
                what: what.clone(),
                waited: *waited,
            },
            PlaitError::Aborted { reason, .. } => {
                PlaitError::Aborted { op: op.to_string(), reason: reason.clone() }
            }
            PlaitError::Mismatch { peer, detail, .. } => {
                PlaitError::Mismatch { op: op.to_string(), peer: *peer, detail: detail.clone() }
            }
            PlaitError::PeerLost { epoch, members, lost, .. } => {
                PlaitError::PeerLost { op: op.to_string(), epoch: *epoch, members: *members, lost: lost.clone() }
            }
            PlaitError::Refused { peer, reason, .. } => {
                PlaitError::Refused { op: op.to_string(), peer: *peer, reason: reason.clone() }
            }
            PlaitError::Timeout { waiting_on, waited, .. } => PlaitError::Timeout {
                op: op.to_string(),
                waiting_on: waiting_on.clone(),
                waited: *waited,
            },
            other => other.clone(),
        }
    }

    /// Short machine-readable kind, used by the Python layer to pick the exception class.
    pub fn kind(&self) -> &'static str {
        match self {
            PlaitError::InvalidArgument(_) | PlaitError::Refused { .. } => "invalid",
            PlaitError::Config(_) => "config",
            PlaitError::Peer { .. } => "peer",
            PlaitError::PeerLost { .. } => "peer_lost",
            PlaitError::Evicted(_) => "evicted",
            PlaitError::Timeout { .. } => "timeout",
            PlaitError::Mismatch { .. } => "mismatch",
            PlaitError::Aborted { .. } => "aborted",
            PlaitError::Broken(_) => "broken",
            PlaitError::Rendezvous(_) => "rendezvous",
            PlaitError::Io(_) => "io",
            PlaitError::Internal(_) => "internal",
        }
    }
}

impl PlaitError {
    /// `what` panicked with `payload` (what `catch_unwind` returns).
    pub fn from_panic(what: &str, payload: Box<dyn std::any::Any + Send>) -> PlaitError {
        PlaitError::Internal(format!("{what} panicked: {}", panic_message(&*payload)))
    }
}

impl From<std::io::Error> for PlaitError {
    fn from(e: std::io::Error) -> Self {
        PlaitError::Io(e.to_string())
    }
}

/// The message a panic carried (`panic!("...")` gives a `&str` or a `String`).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}
