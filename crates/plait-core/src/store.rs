//! The rendezvous store: torch's c10d Store (or anything with set / get-with-timeout) carries
//! addresses and small control data, never tensors.
//!
//! Every call has a deadline, and start-up's deadline is the caller's: a store client that does
//! not keep its own (torch's TCPStore blocks for good once its server stops answering) is run
//! through [`call_with_deadline`].

use crate::error::{PlaitError, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::time::{Duration, Instant};

pub trait Store: Send + Sync {
    /// Stores `value` under `key`; an error if that is not done within `timeout`.
    fn set(&self, key: &str, value: &[u8], timeout: Duration) -> Result<()>;
    /// Blocks until `key` exists or `timeout` passes.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
}

/// How long past its timeout a store call may take to report that timeout itself, before
/// `call_with_deadline` gives up on it: the store's own answer names the missing key better.
const STORE_GRACE: Duration = Duration::from_millis(250);

/// Runs `call` (one call of the store named `store`, doing `what`) on a thread of its own and
/// waits for it until `timeout` (plus a short grace). If it has not returned by then, the caller
/// gets a timeout naming the store and the call, and the thread is left to end whenever the
/// call does: a client blocked on a stopped server cannot be interrupted, only abandoned.
pub fn call_with_deadline<T: Send + 'static>(
    store: &str,
    what: &str,
    timeout: Duration,
    call: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let start = Instant::now();
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name("plait-store".into())
        .spawn(move || {
            let _ = tx.send(call());
        })
        .map_err(|e| PlaitError::Io(format!("cannot start a thread for the store call {what}: {e}")))?;
    rx.recv_timeout(timeout + STORE_GRACE).unwrap_or_else(|_| {
        Err(PlaitError::Timeout {
            op: "store".into(),
            waiting_on: format!(
                "the store ({store}) to answer {what}; it did not answer at all: is its server running and reachable?"
            ),
            waited: start.elapsed(),
        })
    })
}

/// An in-process store for tests of the core without Python.
#[derive(Default)]
pub struct MemStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8], _timeout: Duration) -> Result<()> {
        self.map.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut map = self.map.lock();
        loop {
            if let Some(v) = map.get(key) {
                return Ok(v.clone());
            }
            if self.changed.wait_until(&mut map, deadline).timed_out() {
                return Err(PlaitError::Rendezvous(format!(
                    "key '{key}' did not appear within {timeout:?}"
                )));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_call_that_never_returns_is_abandoned_at_its_deadline() {
        let t = Instant::now();
        let e = call_with_deadline("TestStore", "wait(['k'])", Duration::from_millis(200), || -> Result<()> {
            std::thread::sleep(Duration::from_secs(30));
            Ok(())
        })
        .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        let m = e.to_string();
        assert!(m.contains("TestStore") && m.contains("wait(['k'])") && m.contains("did not answer"), "{m}");
        // A call that answers, even with its own error, is passed through.
        assert_eq!(call_with_deadline("S", "get", Duration::from_secs(5), || Ok(7)).unwrap(), 7);
        let own = call_with_deadline("S", "get", Duration::from_secs(5), || -> Result<()> { Err(PlaitError::Rendezvous("no key".into())) });
        assert_eq!(own.unwrap_err().to_string(), "rendezvous: no key");
    }
}
