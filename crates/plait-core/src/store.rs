//! The rendezvous store: torch's c10d Store (or anything with set / get-with-timeout) carries
//! addresses and small control data, never tensors.

use crate::error::{PlaitError, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::time::{Duration, Instant};

pub trait Store: Send + Sync {
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Blocks until `key` exists or `timeout` passes.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
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
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
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
