//! Which threads may call a communicator's collectives.
//!
//! Ranks match collectives by the order each rank calls them (their sequence numbers), as gloo,
//! NCCL and MPI do. Two threads calling collectives on one communicator at once are ordered by
//! the scheduler, differently on each rank, so a call on one rank could pair with another
//! thread's call on the other and return a sum of unrelated values without any error (seen in
//! 37-75 % of runs with four threads). Serialising the calls on each rank would not help: the
//! order would still differ between ranks. Nor can a rank tell which of another rank's threads
//! made a call. So the rule is about threads: by default only the thread that created the
//! communicator calls its collectives (checked exactly, before anything is sent); the
//! `Sequential` rule lets any thread call, one at a time, which is all torch can promise
//! (autograd and comm-hook threads issue collectives too).
//!
//! Point-to-point calls are not restricted: they match per peer and tag, in call order, and
//! threads that use their own tags or peers are safe.

use crate::error::PlaitError;
use parking_lot::Mutex;
use std::sync::Arc;
use std::thread::{self, ThreadId};

/// Which threads may call a communicator's collectives (and `barrier`, `refuse`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ThreadUse {
    /// Only the thread that created the communicator (for a subgroup: the thread that created
    /// the subgroup). Its calls come in its program order, the same on every rank; any other
    /// thread gets an error before anything is sent.
    #[default]
    Creator,
    /// Any thread, one at a time: the program orders its calls, the same on every rank (torch's
    /// contract). A collective started while another thread is starting one, or while another
    /// thread's blocking collective is still running, is refused and breaks the communicator on
    /// every rank, since the running call may already be paired with a different call elsewhere.
    /// An asynchronous call counts only until it is queued: another thread may start the next
    /// call while it runs. Calls from several threads that never overlap cannot be checked.
    Sequential,
}

impl ThreadUse {
    pub const ALL: [ThreadUse; 2] = [ThreadUse::Creator, ThreadUse::Sequential];

    pub fn name(self) -> &'static str {
        match self {
            ThreadUse::Creator => "creator",
            ThreadUse::Sequential => "sequential",
        }
    }

    pub fn from_name(name: &str) -> Option<ThreadUse> {
        ThreadUse::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// How a thread is named in errors: its name when it has one, and its id.
fn describe(id: ThreadId, name: Option<&str>) -> String {
    match name {
        Some(n) => format!("thread {n:?} ({id:?})"),
        None => format!("thread {id:?}"),
    }
}

fn current() -> (ThreadId, String) {
    let t = thread::current();
    (t.id(), describe(t.id(), t.name()))
}

const ADVICE: &str = "plait requires collectives in the same order on every rank, and calls from several threads \
    can pair different calls across ranks; use one thread per communicator or a subgroup per thread";

/// A communicator's thread rule and the collectives running under it.
pub(crate) struct Threads {
    rule: ThreadUse,
    creator: (ThreadId, String),
    running: Mutex<Running>,
}

#[derive(Default)]
struct Running {
    /// Collectives started and not yet finished, all by `thread`.
    count: usize,
    thread: Option<(ThreadId, String)>,
    /// The last of them to start.
    what: String,
}

/// A collective's turn: while it lives, the call counts as running (see `ThreadUse::Sequential`).
/// A blocking call keeps it until it returns; an asynchronous one until it is queued.
pub(crate) struct Turn {
    threads: Option<Arc<Threads>>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(t) = &self.threads {
            let mut r = t.running.lock();
            r.count -= 1;
            if r.count == 0 {
                r.thread = None;
            }
        }
    }
}

/// Why a collective may not start on the calling thread.
pub(crate) enum Refusal {
    /// Not the creator: nothing happened, the communicator is fine.
    NotCreator(PlaitError),
    /// Another thread's collective is running: the communicator must break, since the running
    /// call may already be paired with a different call on another rank.
    Overlap(PlaitError),
}

impl Threads {
    /// The rule `rule`, the calling thread being the creator.
    pub fn new(rule: ThreadUse) -> Arc<Threads> {
        Arc::new(Threads { rule, creator: current(), running: Mutex::new(Running::default()) })
    }

    /// The calling thread starts collective `what` (e.g. "allreduce").
    pub fn start(self: &Arc<Self>, what: &str) -> std::result::Result<Turn, Refusal> {
        let (id, me) = current();
        match self.rule {
            ThreadUse::Creator => {
                if id != self.creator.0 {
                    return Err(Refusal::NotCreator(PlaitError::invalid(format!(
                        "{what} called on {me}, but this communicator's collectives belong to the thread that \
                         created it ({}); {ADVICE} (create the subgroup on the thread that uses it), or create \
                         the communicator with threads=\"sequential\" if your threads take turns",
                        self.creator.1
                    ))));
                }
                Ok(Turn { threads: None })
            }
            ThreadUse::Sequential => {
                let mut r = self.running.lock();
                if let Some((other, other_name)) = &r.thread {
                    if *other != id {
                        return Err(Refusal::Overlap(PlaitError::invalid(format!(
                            "communicator used from two threads at once: {what} on {me} while {} is running on \
                             {other_name}; {ADVICE}",
                            r.what
                        ))));
                    }
                }
                r.count += 1;
                r.thread = Some((id, me));
                r.what = what.to_string();
                Ok(Turn { threads: Some(self.clone()) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_creator_rule_refuses_every_other_thread() {
        let t = Threads::new(ThreadUse::Creator);
        assert!(t.start("allreduce").is_ok());
        let t2 = t.clone();
        let refused = thread::spawn(move || match t2.start("barrier") {
            Err(Refusal::NotCreator(e)) => e.to_string(),
            _ => String::new(),
        });
        let msg = refused.join().unwrap();
        assert!(msg.contains("barrier called on thread") && msg.contains("created it"), "{msg}");
    }

    #[test]
    fn the_sequential_rule_refuses_overlap_only() {
        let t = Threads::new(ThreadUse::Sequential);
        let first = t.start("allreduce").ok().unwrap();
        let second = t.start("broadcast").ok().unwrap(); // the same thread: fine
        let t2 = t.clone();
        let overlap = thread::spawn(move || match t2.start("barrier") {
            Err(Refusal::Overlap(e)) => e.to_string(),
            _ => String::new(),
        });
        let msg = overlap.join().unwrap();
        assert!(msg.contains("two threads at once: barrier on thread") && msg.contains("while broadcast is running"), "{msg}");
        drop((first, second));
        let t2 = t.clone();
        assert!(thread::spawn(move || t2.start("barrier").is_ok()).join().unwrap(), "a turn taken after the others ended");
    }
}
