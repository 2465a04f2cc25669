//! The transfers one operation has under way, and the type that makes the core's raw writes
//! safe: link threads touch an operation's memory (the caller's buffers and the buffers the
//! operation owns) only while that operation's [`Transfers`] lives.
//!
//! Dropping a `Transfers` — when the operation returns, fails, or a panic unwinds through it —
//! withdraws every receive no frame has taken yet and waits until every transfer issued has
//! reported. Only then are the buffers it owns (`memory`) released, and only then can the
//! operation return to its caller, who may free the buffers it lent. A panic also fails the
//! communicator: the peers are told, so they do not wait for the rest of the call.

use super::wait::next_event;
use crate::error::PlaitError;
use crate::session::{BufferPool, Event, Session};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a withdrawal waits for a transfer before it fails the communicator and shuts the
/// links it uses (even a subgroup's, which are its owner's), so blocked reads and writes return.
const DRAIN_PATIENCE: Duration = Duration::from_secs(10);

/// Buffers an operation owns and lends to link threads (scratch, saved output, encoded sends).
pub(crate) trait OpMemory {
    /// Hands the buffers back to the pool; called once every transfer has reported.
    fn give_back(&mut self, pool: &BufferPool);
}

impl OpMemory for () {
    fn give_back(&mut self, _: &BufferPool) {}
}

pub(crate) struct Transfers<M: OpMemory> {
    session: Arc<Session>,
    op_id: u64,
    what: Arc<str>,
    tx: Sender<Event>,
    rx: Receiver<Event>,
    /// Transfers issued and not yet reported (withdrawn receives are subtracted).
    outstanding: Cell<usize>,
    /// Until when a caller reading the links polls them instead of sleeping: the busy-poll
    /// budget counted from the first time the operation would sleep (see `wait::next_event`).
    spin_until: Cell<Option<Instant>>,
    /// The operation's own buffers that transfers point into.
    pub memory: M,
}

impl<M: OpMemory> Transfers<M> {
    pub fn new(session: &Arc<Session>, what: Arc<str>, memory: M) -> Self {
        let (tx, rx) = crossbeam_channel::unbounded();
        Transfers { session: session.clone(), op_id: session.op_id(), what, tx, rx, outstanding: Cell::new(0), spin_until: Cell::new(None), memory }
    }

    /// The id the operation's posted receives carry (so they can be withdrawn together).
    pub fn op_id(&self) -> u64 {
        self.op_id
    }

    /// Counts one more transfer (a posted receive or a queued send) and returns where it reports.
    pub fn issue(&self) -> Sender<Event> {
        self.outstanding.set(self.outstanding.get() + 1);
        self.tx.clone()
    }

    /// The next report of one of these transfers, waiting until `until` (see `wait::next_event`).
    pub fn next_event(&self, until: Instant, frame_deadline: Instant) -> Result<Event, RecvTimeoutError> {
        let ev = next_event(&self.session, &self.rx, until, frame_deadline, &self.spin_until)?;
        self.outstanding.set(self.outstanding.get().saturating_sub(1));
        Ok(ev)
    }

    /// Withdraws the receives no frame has taken and waits until every other transfer has
    /// reported: afterwards no link thread touches this operation's memory. Never gives up while
    /// one is under way: after `DRAIN_PATIENCE` it fails the communicator and shuts the sockets
    /// the stragglers are blocked on.
    pub fn withdraw(&self) {
        if self.outstanding.get() == 0 {
            return;
        }
        let withdrawn = self.session.mailbox.cancel(self.op_id);
        self.outstanding.set(self.outstanding.get().saturating_sub(withdrawn));
        let mut waited = Duration::ZERO;
        while self.outstanding.get() > 0 {
            match self.rx.recv_timeout(DRAIN_PATIENCE) {
                Ok(_) => self.outstanding.set(self.outstanding.get() - 1),
                Err(_) => {
                    waited += DRAIN_PATIENCE;
                    tracing::error!("{}: {} transfers still under way {waited:?} after the operation ended", self.what, self.outstanding.get());
                    self.session.fail(
                        PlaitError::Broken(format!("{}: {} transfers did not finish after the operation ended", self.what, self.outstanding.get())),
                        true,
                    );
                    // A subgroup's failure leaves its owner's links up: shut them too.
                    self.session.shut_links();
                }
            }
        }
    }
}

impl<M: OpMemory> Drop for Transfers<M> {
    fn drop(&mut self) {
        if self.outstanding.get() > 0 && std::thread::panicking() {
            // The rest of the call will never be run here: the peers must not wait for it.
            self.session.fail(PlaitError::Internal(format!("{}: a panic on this rank during the call", self.what)), true);
        }
        self.withdraw();
        self.memory.give_back(&self.session.mailbox.pool);
    }
}

#[cfg(test)]
#[path = "transfers_tests.rs"]
mod tests;
