//! The threads that run a communicator's asynchronous operations. A new one starts whenever
//! none is idle, so an operation never waits behind another (an async receive posted before its
//! matching send would otherwise deadlock); workers beyond a few exit after a while idle.

use super::work::Work;
use crate::error::{PlaitError, Result};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

const KEPT: usize = 2;
const IDLE_EXIT: Duration = Duration::from_secs(10);

pub(crate) type Job = Box<dyn FnOnce() -> Result<usize> + Send>;

struct Queued {
    run: Job,
    work: Work,
}

pub(crate) struct Workers {
    jobs: Mutex<Option<crossbeam_channel::Sender<Queued>>>,
    queue: crossbeam_channel::Receiver<Queued>,
    idle: Arc<AtomicUsize>,
    live: Arc<AtomicUsize>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn closed() -> PlaitError {
    PlaitError::Broken("the communicator was closed".into())
}

impl Workers {
    pub fn new() -> Workers {
        let (tx, rx) = crossbeam_channel::unbounded();
        Workers {
            jobs: Mutex::new(Some(tx)),
            queue: rx,
            idle: Arc::new(AtomicUsize::new(0)),
            live: Arc::new(AtomicUsize::new(0)),
            threads: Mutex::new(Vec::new()),
        }
    }

    /// Runs `run` on a worker; the returned Work completes with its result, and its waits
    /// poll for `poll` before they sleep.
    pub fn submit(&self, run: Job, poll: Duration) -> Result<Work> {
        let work = Work::polling(poll);
        let jobs = self.jobs.lock();
        let tx = jobs.as_ref().ok_or_else(closed)?;
        // Claim an idle worker, or start one: a queued job must never wait for a busy one.
        let claimed = self.idle.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |i| i.checked_sub(1)).is_ok();
        if !claimed {
            self.spawn()?;
        }
        tx.send(Queued { run, work: work.clone() }).map_err(|_| closed())?;
        Ok(work)
    }

    fn spawn(&self) -> Result<()> {
        let (rx, idle, live) = (self.queue.clone(), self.idle.clone(), self.live.clone());
        let id = live.fetch_add(1, Ordering::SeqCst);
        let handle = std::thread::Builder::new()
            .name(format!("plait-op-{id}"))
            .spawn(move || loop {
                let job = match rx.recv_timeout(IDLE_EXIT) {
                    Ok(job) => job,
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                        // Leave only if this worker is still counted idle and enough remain.
                        let leave = live.load(Ordering::SeqCst) > KEPT
                            && idle.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |i| i.checked_sub(1)).is_ok();
                        if leave {
                            live.fetch_sub(1, Ordering::SeqCst);
                            return;
                        }
                        continue;
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
                };
                // `Communicator::submit` turns an operation's panic into its error; this catch
                // only keeps a Work from never completing if a job ever comes another way.
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job.run))
                    .unwrap_or_else(|p| Err(PlaitError::from_panic("an asynchronous operation", p)));
                job.work.complete(result);
                idle.fetch_add(1, Ordering::SeqCst);
            })
            .map_err(|e| PlaitError::Io(format!("cannot start a worker thread: {e}")))?;
        let mut threads = self.threads.lock();
        threads.retain(|h| !h.is_finished());
        threads.push(handle);
        Ok(())
    }

    /// Refuses new jobs and joins every worker once the queued ones have run (they fail fast
    /// on a broken session). A worker closing its own communicator is not joined.
    pub fn close(&self) {
        drop(self.jobs.lock().take());
        let threads: Vec<_> = self.threads.lock().drain(..).collect();
        for t in threads {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}
