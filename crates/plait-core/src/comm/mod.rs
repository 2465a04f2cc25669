//! The communicator users hold: rank, size, epoch, and the calls they make.
//!
//! Static mode: `bootstrap` meets the other ranks through a store and builds the mesh of one
//! epoch (a session over a full mesh of TCP links). Calls are planned (`exec::spec`) and run by
//! the operations of `exec` on that session, here on the caller's thread or on a worker. After
//! any failure the communicator is broken and a new one (a new epoch) must be built.

mod bootstrap;
pub(crate) mod config;
mod measure;
mod relay;
mod threads;
mod topology;
mod work;
mod workers;

pub use config::{argument_range, check_argument, check_setting, refuse_argument, check_timeout, setting, CommConfig, GiveUp, Measure, Range, RingOrder, Setting, Token, ARGUMENTS, SETTINGS};
pub use threads::ThreadUse;
pub use topology::{LinkRecord, Topology};
pub use work::Work;

use crate::dtype::{DType, ReduceOp};
use crate::error::{PlaitError, Result};
use crate::exec::collective::run_collective;
use crate::exec::p2p;
use crate::exec::spec::{check_rank, CollRequest, Plan, Planner};
use crate::net::frame::{FrameKind, RESERVED_TAGS};
use crate::net::listener::Listener;
use crate::raw::RawBuf;
use crate::sched::cost::{Constants, Hosts, LinkModel, Sample};
use crate::sched::order::{best_ring, LinkMatrix};
use crate::sched::select::{parse_algo_spec, Selector};
use crate::sched::Collective;
use crate::session::{group_id, Demux, Mailbox, Session};
use crate::store::Store;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use threads::{Refusal, Threads, Turn};
use workers::{Job, Workers};

pub struct Communicator {
    cfg: CommConfig,
    session: Arc<Session>,
    selector: Selector,
    seq: AtomicU64,
    listener: Mutex<Option<Listener>>,
    routes: Vec<LinkRecord>,
    topology: Topology,
    /// Every directed link's latency and bandwidth, when measured (`PLAIT_MEASURE`).
    links: Option<Arc<LinkMatrix>>,
    /// Which ranks share a host, where some do and there is more than one.
    hosts: Option<Arc<Hosts>>,
    closed: AtomicBool,
    workers: Workers,
    /// Which threads may call collectives (`cfg.threads`), and the collectives running.
    threads: Arc<Threads>,
    /// A subgroup's owner, whose links it uses (kept open while the subgroup lives).
    owner: Option<Owner>,
    /// Where the links deliver (the links' owner only): a grown mesh takes it over.
    demux: Option<Arc<Demux>>,
}

/// What `Communicator::fit_cost_model` found.
#[derive(Clone, Debug)]
pub struct CostFit {
    /// `PLAIT_COST_MODEL` text for the fitted constants.
    pub setting: String,
    pub alpha: f64,
    pub bandwidth: f64,
    pub gamma: f64,
    pub parallelism: f64,
    /// Each run's predicted seconds with the constants in use, and with the fitted ones.
    pub before: Vec<f64>,
    pub after: Vec<f64>,
}

struct Owner {
    comm: Arc<Communicator>,
    /// The owner's rank of each rank of the subgroup.
    ranks: Vec<usize>,
}

/// The algorithm selector of a communicator configured by `cfg` on a mesh of `topology` whose
/// links measured `links`: the cost model takes each link's own latency and bandwidth, and ring
/// algorithms run in the order `PLAIT_RING_ORDER` says.
fn selector(cfg: &CommConfig, topology: Topology, links: Option<Arc<LinkMatrix>>, hosts: Option<Arc<Hosts>>) -> Result<Selector> {
    let overrides = match &cfg.algo {
        Some(spec) => parse_algo_spec(spec, &cfg.schedules)?,
        None => Default::default(),
    };
    let order = match &cfg.ring_order {
        RingOrder::Rank => None,
        RingOrder::Given(order) => Some(order.clone()).filter(|o| o.len() == cfg.size),
        RingOrder::Measured => links.as_deref().filter(|m| m.n == cfg.size).map(|m| best_ring(m, cfg.segment_bytes as f64)),
    };
    let model = cfg.cost.apply(LinkModel { shared: topology != Topology::FullMesh, links, hosts, ..LinkModel::default() });
    let selector = Selector::new(overrides, model, cfg.segment_bytes).with_custom(cfg.schedules.clone(), topology.name());
    Ok(match order {
        Some(order) => selector.with_ring_order(order),
        None => selector,
    })
}

/// `0->1 120us 940, 0->2 ...`: one line for the log.
fn describe_links(m: &LinkMatrix) -> String {
    let mut parts = Vec::new();
    for i in 0..m.n {
        for j in (0..m.n).filter(|&j| j != i) {
            parts.push(format!("{i}->{j} {:.0} {:.0}", m.latency(i, j) * 1e6, m.bandwidth(i, j) * 8e-6));
        }
    }
    parts.join(", ")
}

impl Communicator {
    /// Meets the other ranks through `store` and connects to every one of them.
    pub fn new(store: &dyn Store, cfg: CommConfig) -> Result<Arc<Communicator>> {
        cfg.validate()?;
        // Settings are checked before anything is published, so a typo fails every rank at once.
        selector(&cfg, Topology::FullMesh, None, None)?;
        let mesh = bootstrap::bootstrap(store, &cfg)?;
        Ok(Communicator::of_mesh(cfg, mesh)?)
    }

    fn of_mesh(cfg: CommConfig, mesh: bootstrap::Mesh) -> Result<Arc<Communicator>> {
        let cfg_threads = cfg.threads;
        let links = mesh.links.map(Arc::new);
        let hosts = mesh.hosts.map(Arc::new);
        if let (Some(m), 0) = (&links, cfg.rank) {
            tracing::info!("links measured (latency us, Mbit/s): {}", describe_links(m));
        }
        Ok(Arc::new(Communicator {
            selector: selector(&cfg, mesh.topology, links.clone(), hosts.clone())?,
            cfg,
            session: mesh.session,
            seq: AtomicU64::new(1),
            listener: Mutex::new(mesh.listener),
            routes: mesh.routes,
            topology: mesh.topology,
            links,
            hosts,
            closed: AtomicBool::new(false),
            workers: Workers::new(),
            threads: Threads::new(cfg_threads),
            owner: None,
            demux: Some(mesh.demux),
        }))
    }

    /// The next epoch's communicator when ranks were only added at the end (elastic mode, at an
    /// update point): this one's links, mailbox and readers carry on with their ranks, and links
    /// are made to the new ranks only (a link is kept where both ends kept it, see
    /// `bootstrap_from`). This communicator is retired first: its calls are refused from then on,
    /// and closing or aborting it leaves the links alone. It must be idle, unbroken and the owner of
    /// its links, with `cfg` a larger world where this rank keeps its number.
    pub fn grow(&self, store: &dyn Store, cfg: CommConfig) -> Result<Arc<Communicator>> {
        cfg.validate()?;
        self.usable()?;
        let demux = match (&self.owner, &self.demux) {
            (None, Some(d)) if cfg.rank == self.cfg.rank && cfg.size > self.cfg.size => d.clone(),
            _ => return Err(PlaitError::Internal("grow: only an owner communicator grows, to a larger world, keeping its rank".into())),
        };
        if self.closed.swap(true, Ordering::SeqCst) {
            return Err(PlaitError::Broken("the communicator was closed".into()));
        }
        self.workers.close();
        if let Some(l) = self.listener.lock().take() {
            l.close();
        }
        let routes = self
            .routes
            .iter()
            .map(|r| LinkRecord { reason: format!("{} (kept from epoch {})", r.reason.split(" (kept from epoch ").next().unwrap_or(""), self.cfg.epoch), ..r.clone() })
            .collect();
        let kept = bootstrap::Kept { session: self.session.clone(), demux, routes };
        let mesh = bootstrap::bootstrap_from(store, &cfg, Some(kept))?;
        Communicator::of_mesh(cfg, mesh)
    }

    /// A communicator over `ranks` (ranks of this one; their order gives the new ranks) that
    /// shares this one's links: nothing is sent and no socket opened, so every member can create
    /// it in microseconds. Every member must pass the same `name` and `ranks`; the name must not
    /// have been used for another subgroup of this communicator. It fails when this one fails
    /// (a link down, an abort), but its own failures (a timeout, a mismatch) leave this one and
    /// the other subgroups working. `timeout` and `algo` default to this one's.
    pub fn subgroup(self: &Arc<Self>, name: &str, ranks: &[usize], timeout: Option<Duration>, algo: Option<String>) -> Result<Arc<Communicator>> {
        self.usable()?;
        timeout.map(|t| check_timeout("subgroup", t)).transpose()?;
        if let Some(owner) = &self.owner {
            // A subgroup of a subgroup: a subgroup of the links' owner, with the ranks translated.
            let mut in_owner = Vec::with_capacity(ranks.len());
            for &r in ranks {
                check_rank("subgroup rank", r, self.cfg.size)?;
                in_owner.push(owner.ranks[r]);
            }
            let name = format!("{}/{name}", self.cfg.group.strip_prefix(&format!("{}/", owner.comm.cfg.group)).unwrap_or(&self.cfg.group));
            return owner.comm.subgroup(&name, &in_owner, timeout, algo);
        }
        let mut seen = vec![false; self.cfg.size];
        for &r in ranks {
            check_rank("subgroup rank", r, self.cfg.size)?;
            if std::mem::replace(&mut seen[r], true) {
                return Err(PlaitError::invalid(format!("subgroup {name}: rank {r} is listed twice")));
            }
        }
        if !seen[self.cfg.rank] {
            return Err(PlaitError::invalid(format!("subgroup {name}: this rank ({}) is not in {ranks:?}", self.cfg.rank)));
        }
        let cfg = CommConfig {
            rank: ranks.iter().position(|&r| r == self.cfg.rank).unwrap(),
            size: ranks.len(),
            group: format!("{}/{name}", self.cfg.group),
            timeout: timeout.unwrap_or(self.cfg.timeout),
            algo: algo.or_else(|| self.cfg.algo.clone()),
            // An order given for the whole group names its ranks, not the subgroup's.
            ring_order: if self.cfg.ring_order == RingOrder::Rank { RingOrder::Rank } else { RingOrder::Measured },
            ..self.cfg.clone()
        };
        let links = self.links.as_deref().map(|m| Arc::new(m.sub(ranks)));
        let hosts = self.hosts.as_deref().and_then(|h| h.sub(ranks)).map(Arc::new);
        let id = group_id(&cfg.group);
        let mailbox = Arc::new(Mailbox::with_limits(cfg.unexpected_bytes, cfg.timeout));
        let demux = Arc::new(Demux::new(mailbox.clone(), bootstrap::heartbeat(self.cfg.timeout), None));
        let session = Arc::new(Session::subgroup(&self.session, id, ranks, mailbox));
        demux.attach(&session);
        self.session.groups.register(id, ranks, demux, &session)?;
        let routes = self
            .routes
            .iter()
            .filter_map(|l| {
                // A relay outside the subgroup has no rank in it: the reason still names it.
                let via = l.via.and_then(|v| ranks.iter().position(|&r| r == v));
                Some(LinkRecord { peer: ranks.iter().position(|&r| r == l.peer)?, via, ..l.clone() })
            })
            .collect();
        let threads = cfg.threads;
        Ok(Arc::new(Communicator {
            selector: selector(&cfg, self.topology, links.clone(), hosts.clone())?,
            cfg,
            session,
            seq: AtomicU64::new(1),
            listener: Mutex::new(None),
            routes,
            topology: self.topology,
            links,
            hosts,
            closed: AtomicBool::new(false),
            workers: Workers::new(),
            threads: Threads::new(threads),
            owner: Some(Owner { comm: self.clone(), ranks: ranks.to_vec() }),
            demux: None,
        }))
    }

    #[cfg(test)]
    pub(crate) fn session(&self) -> &Arc<Session> {
        &self.session
    }

    pub fn rank(&self) -> usize {
        self.cfg.rank
    }
    pub fn size(&self) -> usize {
        self.cfg.size
    }
    pub fn config(&self) -> &CommConfig {
        &self.cfg
    }
    pub fn routes(&self) -> &[LinkRecord] {
        &self.routes
    }
    pub fn topology(&self) -> Topology {
        self.topology
    }
    pub fn listen_port(&self) -> Option<u16> {
        self.listener.lock().as_ref().map(|l| l.port())
    }

    /// Neither closed nor failed.
    pub fn is_open(&self) -> bool {
        self.usable().is_ok()
    }

    fn usable(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(PlaitError::Broken("the communicator was closed".into()));
        }
        if let Some(err) = self.session.broken() {
            return Err(PlaitError::Broken(err.to_string()));
        }
        Ok(())
    }

    /// The calling thread's turn to run collective `what`, under `cfg.threads`. Another thread's
    /// collective running at the same time breaks the communicator: the running one may already
    /// be paired with a different call on another rank, and every rank must hear so.
    fn turn(&self, what: &str) -> Result<Turn> {
        self.threads.start(what).map_err(|refusal| match refusal {
            Refusal::NotCreator(e) => e,
            Refusal::Overlap(e) => {
                self.abort(&e.to_string());
                e
            }
        })
    }

    fn plan(&self, req: &CollRequest) -> Result<Plan> {
        self.usable()?;
        let planner = Planner {
            rank: self.cfg.rank,
            size: self.cfg.size,
            segment_bytes: self.cfg.segment_bytes,
            timeout: self.cfg.timeout,
            wire: self.cfg.wire,
            selector: &self.selector,
            seq: &self.seq,
        };
        planner.plan(req)
    }

    /// Whether a call of `nbytes` is small: run blocking, it reads the links on the calling
    /// thread; waited for, its waits poll before they sleep.
    fn small(&self, nbytes: usize) -> bool {
        nbytes <= self.cfg.caller_read_bytes
    }

    /// Runs a collective. `inline` runs it on this thread (the caller waits anyway); otherwise
    /// it runs on a worker and the returned Work completes later.
    ///
    /// # Safety
    /// `req.input` and `req.output` must follow the contract of [`crate::raw`]: valid, and not
    /// touched by anything else, until the returned Work has completed.
    pub unsafe fn collective(self: &Arc<Self>, req: CollRequest, inline: bool) -> Result<Work> {
        let turn = self.turn(req.coll.name())?;
        req.timeout.map(|t| check_timeout(req.coll.name(), t)).transpose()?;
        let Plan { spec, sched, layout } = self.plan(&req)?;
        let (input, output) = (req.input, req.output);
        let me = self.clone();
        let (run_turn, start_turn) = held_while(inline, turn);
        let work = self.submit(inline, self.small(input.len.max(output.len)), Background::MayRead, Box::new(move || {
            let _turn = run_turn;
            run_collective(&me.session, &spec, &sched, &layout, input, output).map(|_| 0)
        }));
        drop(start_turn);
        work
    }

    /// This rank refuses its next collective (its arguments were bad; `reason` says how): the
    /// call takes its sequence number here as everywhere, and the other ranks' part of it ends
    /// with a `Refused` error naming this rank and the reason, instead of waiting for this rank
    /// until the deadline. Nothing is kept of the call anywhere and the communicator stays
    /// usable. Returns the refused call's sequence number.
    pub fn refuse(&self, reason: &str) -> Result<u64> {
        let _turn = self.turn("a refused call")?;
        self.usable()?;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        self.session.mailbox.finish_refused(seq);
        self.session.send_refusal(seq, reason);
        Ok(seq)
    }

    fn check_tag(&self, call: &str, tag: u64) -> Result<()> {
        if tag >= RESERVED_TAGS {
            return Err(PlaitError::invalid(format!("{call}: tag {tag} is reserved; use tags below 2**63")));
        }
        Ok(())
    }

    /// Sends `data` to `peer` with `tag`. The message is queued now, in call order; only the
    /// waiting runs later.
    ///
    /// # Safety
    /// `data` must follow the contract of [`crate::raw`] until the returned Work has completed.
    pub unsafe fn send(self: &Arc<Self>, data: RawBuf, dtype: DType, peer: usize, tag: u64, timeout: Option<Duration>, inline: bool) -> Result<Work> {
        self.usable()?;
        check_rank("destination rank", peer, self.cfg.size)?;
        if peer == self.cfg.rank {
            return Err(PlaitError::invalid("send: a rank cannot send to itself"));
        }
        self.check_tag("send", tag)?;
        let timeout = check_timeout("send", timeout.unwrap_or(self.cfg.timeout))?;
        let what: Arc<str> = format!("send to rank {peer} (tag {tag}, {} bytes)", data.len).into();
        let small = self.small(data.len);
        self.session.set_caller_progress(inline && small);
        let started = p2p::start_send(&self.session, peer, tag, dtype, data, what)?;
        let me = self.clone();
        self.submit(inline, small, Background::Threads, Box::new(move || p2p::finish_p2p(&me.session, started, timeout)))
    }

    /// Receives into `data` from `src` (any source when None) with `tag`; the Work's value is
    /// the sender's rank. The receive is posted now, in call order; only the waiting runs later.
    ///
    /// # Safety
    /// `data` must follow the contract of [`crate::raw`] until the returned Work has completed.
    pub unsafe fn recv(self: &Arc<Self>, data: RawBuf, dtype: DType, src: Option<usize>, tag: u64, timeout: Option<Duration>, inline: bool) -> Result<Work> {
        self.usable()?;
        self.check_tag("recv", tag)?;
        if let Some(s) = src {
            check_rank("source rank", s, self.cfg.size)?;
            if s == self.cfg.rank {
                return Err(PlaitError::invalid("recv: a rank cannot receive from itself"));
            }
        }
        let timeout = check_timeout("recv", timeout.unwrap_or(self.cfg.timeout))?;
        let from = src.map(|s| format!("rank {s}")).unwrap_or_else(|| "any rank".into());
        let what: Arc<str> = format!("recv from {from} (tag {tag}, {} bytes)", data.len).into();
        let small = self.small(data.len);
        self.session.set_caller_progress(inline && small);
        let started = p2p::start_recv(&self.session, src, tag, dtype, data, what)?;
        let me = self.clone();
        self.submit(inline, small, Background::Threads, Box::new(move || p2p::finish_p2p(&me.session, started, timeout)))
    }

    /// Every rank waits until every rank has entered the barrier.
    pub fn barrier(self: &Arc<Self>, timeout: Option<Duration>, inline: bool) -> Result<Work> {
        let turn = self.turn("barrier")?;
        timeout.map(|t| check_timeout("barrier", t)).transpose()?;
        let mut token = Box::new([1u8]);
        let buf = RawBuf::of(&mut token[..]);
        let req = CollRequest {
            coll: Collective::AllReduce,
            dtype: DType::U8,
            op: ReduceOp::Max,
            root: 0,
            input: buf,
            output: buf,
            send_counts: None,
            recv_counts: None,
            timeout,
            algo: None,
            wire: None,
        };
        let Plan { mut spec, sched, layout } = self.plan(&req)?;
        spec.what = format!("barrier #{}", spec.seq).into();
        let me = self.clone();
        let (run_turn, start_turn) = held_while(inline, turn);
        let work = self.submit(inline, self.small(buf.len), Background::MayRead, Box::new(move || {
            let _turn = run_turn;
            let r = run_collective(&me.session, &spec, &sched, &layout, buf, buf).map(|_| 0);
            drop(token);
            r
        }));
        drop(start_turn);
        work
    }

    /// Runs `run` here (`inline`) or on a worker. A `small` call run here reads the links on this
    /// thread while it waits; on a worker, `background` says whether it may (see
    /// `Session::start_in_background`), and waits for its Work poll before they sleep. Otherwise
    /// the links' receiver threads read.
    fn submit(&self, inline: bool, small: bool, background: Background, run: Job) -> Result<Work> {
        let session = self.session.clone();
        // A panic inside an operation must not cross into the caller (or kill a worker and leave
        // its Work pending forever): its transfers have been withdrawn by then (`Transfers`), and
        // the communicator fails with an error that says what happened.
        let run: Job = Box::new(move || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|panic| {
                let err = PlaitError::from_panic("an operation", panic);
                tracing::error!("{err}");
                session.fail(err.clone(), true);
                Err(err)
            })
        });
        if inline {
            self.session.set_caller_progress(small);
            let work = Work::new();
            work.complete(run());
            return Ok(work);
        }
        // Why a small collective alone in flight reads on its worker: the worker then finds the
        // peers' frames itself instead of being woken by a receiver thread for each. A 4-byte
        // allreduce with async_op=True then wait() took 198-214 us instead of 316-352 at 2 ranks
        // on 2 cores, 498-535 instead of 584-602 at 3 (interleaved runs, only this changed).
        let in_background = self.session.start_in_background(small && background == Background::MayRead);
        let run: Job = Box::new(move || {
            let _in_background = in_background;
            run()
        });
        self.workers.submit(run, if small { self.session.busy_poll } else { Duration::ZERO })
    }

    /// The algorithm the selector picks for a call of `nbytes` (per rank buffer).
    pub fn algorithm_for(&self, coll: Collective, nbytes: usize, root: usize) -> Result<String> {
        Ok(self.selector.choose(coll, self.cfg.size, root, &self.even_blocks(nbytes), None)?.name.clone())
    }

    /// The cost model's seconds for `coll` over `nbytes` in all (even blocks) with `algo` (the
    /// selector's choice when None), and the schedule's label: what the selector compares.
    pub fn predict(&self, coll: Collective, nbytes: usize, root: usize, algo: Option<&str>) -> Result<(f64, String)> {
        let blocks = self.even_blocks(nbytes);
        let s = self.selector.choose(coll, self.cfg.size, root, &blocks, algo)?;
        Ok((self.selector.estimate(&s, &blocks), s.label()))
    }

    /// The cost model's constants fitted to measured runs `(collective, algorithm, bytes, root,
    /// seconds)` (`plait topology --fit`): the `PLAIT_COST_MODEL` text that gives them, and each
    /// run's prediction before and after.
    pub fn fit_cost_model(&self, runs: &[(Collective, String, usize, usize, f64)]) -> Result<CostFit> {
        let built = runs
            .iter()
            .map(|(coll, algo, nbytes, root, secs)| {
                let blocks = self.even_blocks(*nbytes);
                Ok((self.selector.choose(*coll, self.cfg.size, *root, &blocks, Some(algo))?, blocks, *secs))
            })
            .collect::<Result<Vec<_>>>()?;
        let samples: Vec<Sample> = built.iter().map(|(s, b, secs)| Sample { schedule: s, block_bytes: b, seconds: *secs }).collect();
        let fitted = self.selector.fitted(&samples);
        let before = samples.iter().map(|s| self.selector.estimate(s.schedule, s.block_bytes)).collect();
        let after = samples.iter().map(|s| self.selector.estimate_with(&fitted, s.schedule, s.block_bytes)).collect();
        Ok(CostFit {
            setting: Constants::text_of(&fitted),
            alpha: fitted.alpha,
            bandwidth: fitted.bandwidth,
            gamma: fitted.gamma,
            parallelism: fitted.parallelism,
            before,
            after,
        })
    }

    fn even_blocks(&self, nbytes: usize) -> Vec<usize> {
        let n = self.cfg.size;
        (0..n).map(|i| (i + 1) * nbytes / n - i * nbytes / n).collect()
    }

    /// The order ring algorithms pass data in: position p is rank `order[p]`, which sends to
    /// `order[p + 1]` (`PLAIT_RING_ORDER`; the rank order unless the links were measured).
    pub fn ring_order(&self) -> Vec<usize> {
        let n = self.cfg.size;
        self.selector.ring_order(n).map_or_else(|| (0..n).collect(), <[usize]>::to_vec)
    }

    /// Every directed link's latency (seconds) and bandwidth (bytes per second) as measured at
    /// start-up, `[from][to]`; None when they were not measured (`PLAIT_MEASURE`).
    pub fn link_matrix(&self) -> Option<&LinkMatrix> {
        self.links.as_deref()
    }

    /// Ends every operation in flight (they fail with `Aborted`) and breaks the communicator.
    /// Safe from any thread.
    pub fn abort(&self, reason: &str) {
        if self.closed.load(Ordering::SeqCst) {
            return; // closed (its session has ended) or grown (its links are the next one's)
        }
        self.session.fail(PlaitError::Aborted { op: String::new(), reason: reason.to_string() }, true);
    }

    /// Says goodbye to the peers, closes every socket and joins every thread. Idempotent.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        if self.session.broken().is_none() {
            self.session.broadcast_control(FrameKind::Close, String::new(), Duration::from_secs(1));
            if let Some(demux) = &self.demux {
                // Ranks this one relays for may still be sending each other what they need.
                demux.wait_relayed_closes(Instant::now() + self.cfg.timeout);
            }
        }
        self.session.close(PlaitError::Broken("the communicator was closed".into()));
        self.workers.close();
        if self.owner.is_some() {
            self.session.groups.unregister(self.session.group);
        }
        self.session.join_links();
        if let Some(l) = self.listener.lock().take() {
            l.close();
        }
    }
}

/// Whether an asynchronous call may read the links on its worker.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Background {
    /// A collective: it may, when small and alone in flight.
    MayRead,
    /// Point-to-point: never; the receiver threads read. Switching the links between callers
    /// and receiver threads at every message cost more than the hand-off saves (see
    /// `runs_inline` in plait.torch).
    Threads,
}

/// How long a collective's turn lasts (see `ThreadUse::Sequential`): a blocking call holds it
/// until it returns, since nothing its thread does can order another thread's call after it; an
/// asynchronous one only until it is queued, in order, so that another thread may start the next
/// call while it runs (torch's contract). Returns (the run's turn, the start's turn).
fn held_while(inline: bool, turn: Turn) -> (Option<Turn>, Option<Turn>) {
    if inline {
        (Some(turn), None)
    } else {
        (None, Some(turn))
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.close();
    }
}
