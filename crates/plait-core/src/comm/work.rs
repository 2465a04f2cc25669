//! A handle on an operation in flight.

use crate::error::Result;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Default)]
pub struct Work {
    state: Arc<(Mutex<Option<Result<usize>>>, Condvar)>,
}

impl Work {
    pub fn new() -> Work {
        Work::default()
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
        let mut g = m.lock();
        // A wait too long to have a deadline (overflow) is a wait without one.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
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
