//! A handle on an operation in flight.

use crate::error::Result;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Default)]
pub struct Work {
    state: Arc<(Mutex<Option<Result<usize>>>, Condvar)>,
    /// How long a wait looks for completion, yielding its core between looks, before it sleeps.
    poll: Duration,
}

impl Work {
    pub fn new() -> Work {
        Work::default()
    }

    /// A Work whose waits poll for `poll` before they sleep (`PLAIT_BUSY_POLL_US`): an
    /// operation on a worker that ends soon after the wait begins is then seen at once, where a
    /// sleeping waiter would pay a wake-up, tens of microseconds on an idle core of a VM.
    pub(crate) fn polling(poll: Duration) -> Work {
        Work { poll, ..Work::default() }
    }

    /// A Work already completed with `r` (an operation that ran to its end before returning).
    pub fn done(r: Result<usize>) -> Work {
        let w = Work::new();
        w.complete(r);
        w
    }

    pub(crate) fn complete(&self, r: Result<usize>) {
        let (m, cv) = &*self.state;
        *m.lock() = Some(r);
        cv.notify_all();
    }

    pub fn is_completed(&self) -> bool {
        self.state.0.lock().is_some()
    }

    /// Blocks until done (or `timeout` passes: then `None`). The operation's own deadline
    /// still applies; this one only bounds how long the caller waits now.
    pub fn wait(&self, timeout: Option<Duration>) -> Option<Result<usize>> {
        let (m, cv) = &*self.state;
        // A wait too long to have a deadline (overflow) is a wait without one.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        if !self.poll.is_zero() {
            let budget = Instant::now() + self.poll;
            let end = deadline.map_or(budget, |d| d.min(budget));
            while m.lock().is_none() && Instant::now() < end {
                std::thread::yield_now();
            }
        }
        let mut g = m.lock();
        while g.is_none() {
            match deadline {
                Some(d) => {
                    if cv.wait_until(&mut g, d).timed_out() && g.is_none() {
                        return None;
                    }
                }
                None => cv.wait(&mut g),
            }
        }
        g.clone()
    }
}
