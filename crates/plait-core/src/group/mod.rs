//! The communicator: rank, size, epoch, the links to every peer, and the calls users make.
//!
//! Static mode: the ranks meet through a store, publish their interface addresses, and build a
//! full mesh of TCP links, each bound to the local address chosen for that peer. After any
//! failure the communicator is broken and a new one (a new epoch) must be built.

mod inbox;
mod topology;
mod work;

pub use topology::{LinkRecord, Topology};
pub use work::Work;

use crate::codec::Wire;
use crate::dtype::{DType, ReduceOp};
use crate::error::{PlaitError, Result};
use crate::exec::fabric::Fabric;
use crate::exec::layout::{counts_for, Layout};
use crate::exec::mailbox::Mailbox;
use crate::exec::{self, OpSpec, RawBuf};
use crate::net::frame::FrameKind;
use crate::net::iface::{list_interfaces, IfaceAddr};
use crate::net::link::{connect, Hello, Listener};
use crate::net::peer::PeerLink;
use crate::net::route::{candidate_routes, IfaceFilter, Route};
use crate::platform::host::{self, same_host};
use crate::sched::cost::LinkModel;
use crate::sched::select::{parse_algo_spec, Selector};
use crate::sched::Collective;
use crate::store::Store;
use inbox::CommInbox;
use topology::RouteFile;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;
/// Blocking calls this small read their links on the calling thread: saves a thread hand-off
/// per message, while larger transfers keep one receiver thread per link (links in parallel).
pub const DEFAULT_CALLER_READ_BYTES: usize = 64 * 1024;
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// One TCP stream per peer unless told otherwise. Measured with 64 MiB allreduces, two streams
/// were equal on loopback and on 1 Gbit/s cables (one stream fills those) and 5-10 % faster
/// between two network namespaces over an unlimited veth pair; but with 4 ranks on 2 cores the
/// 8-byte allreduce p50 rose about 10 % (0.21-0.24 ms against 0.24-0.27 ms). Links with a large
/// bandwidth-delay product or per-flow limits want more (see the README).
pub const DEFAULT_STREAMS: usize = 1;
pub const MAX_STREAMS: usize = 16;
/// Async operations run on worker threads; a new one starts whenever none is idle, so an
/// operation never waits behind another (an async receive posted before its matching send
/// would otherwise deadlock). Workers beyond this many exit after a while idle.
const ASYNC_WORKERS_KEPT: usize = 2;
const WORKER_IDLE_EXIT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
pub struct CommConfig {
    pub rank: usize,
    pub size: usize,
    /// Names the group in store keys and handshakes; links of other groups are refused.
    pub group: String,
    pub epoch: u64,
    /// Default deadline of every operation (and of set-up).
    pub timeout: Duration,
    /// `PLAIT_ALGO` syntax: `allreduce:ring,allgather:direct`.
    pub algo: Option<String>,
    pub segment_bytes: usize,
    /// Blocking calls up to this many bytes read their links on the calling thread
    /// (`PLAIT_CALLER_READ_BYTES`; 0 turns it off).
    pub caller_read_bytes: usize,
    /// A caller reading its links polls them without sleeping this long before it blocks
    /// (`PLAIT_BUSY_POLL_US`, default 0: off).
    pub busy_poll: Duration,
    /// TCP connections per pair of ranks (`PLAIT_STREAMS`, 1 to 16): large payloads are spread
    /// over them, for links that one stream cannot fill.
    pub streams: usize,
    /// `PLAIT_IFACE` syntax (NCCL_SOCKET_IFNAME-like).
    pub iface: Option<String>,
    /// `PLAIT_ROUTES`: path of an N x N route matrix that overrides subnet matching.
    pub routes_file: Option<String>,
    /// `PLAIT_WIRE_DTYPE`: wire compression for f32 allreduce (bf16, f16, int8).
    pub wire: Wire,
}

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// A numeric setting from the environment: None when unset, a `ConfigError` saying it must be
/// `what` when it does not parse or fails `ok`.
fn env_number<T: std::str::FromStr>(name: &str, ok: impl Fn(&T) -> bool, what: &str) -> Result<Option<T>> {
    env_nonempty(name)
        .map(|v| v.trim().parse::<T>().ok().filter(|n| ok(n)).ok_or_else(|| PlaitError::Config(format!("{name}={v:?} must be {what}"))))
        .transpose()
}

impl CommConfig {
    /// Defaults, taking `PLAIT_TIMEOUT`, `PLAIT_ALGO`, `PLAIT_SEGMENT_BYTES` and `PLAIT_IFACE`
    /// from the environment.
    pub fn from_env(rank: usize, size: usize) -> Result<CommConfig> {
        let timeout = env_number("PLAIT_TIMEOUT", |s: &f64| *s > 0.0, "a positive number of seconds")?
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64);
        let segment_bytes =
            env_number("PLAIT_SEGMENT_BYTES", |s: &usize| *s >= 1024, "an integer >= 1024")?.unwrap_or(DEFAULT_SEGMENT_BYTES);
        let caller_read_bytes = env_number("PLAIT_CALLER_READ_BYTES", |_: &usize| true, "a number of bytes (0 turns caller reads off)")?
            .unwrap_or(DEFAULT_CALLER_READ_BYTES);
        let busy_poll = env_number("PLAIT_BUSY_POLL_US", |_: &u64| true, "a number of microseconds (0 turns busy polling off)")?
            .map_or(Duration::ZERO, Duration::from_micros);
        let streams = env_number("PLAIT_STREAMS", |n: &usize| (1..=MAX_STREAMS).contains(n), &format!("a number of connections per peer from 1 to {MAX_STREAMS}"))?
            .unwrap_or(DEFAULT_STREAMS);
        Ok(CommConfig {
            rank,
            size,
            streams,
            caller_read_bytes,
            busy_poll,
            group: "default".into(),
            epoch: 0,
            timeout,
            algo: env_nonempty("PLAIT_ALGO"),
            segment_bytes,
            iface: env_nonempty("PLAIT_IFACE"),
            routes_file: env_nonempty("PLAIT_ROUTES"),
            wire: match env_nonempty("PLAIT_WIRE_DTYPE") {
                Some(v) => Wire::from_name(&v).ok_or_else(|| {
                    PlaitError::Config(format!("PLAIT_WIRE_DTYPE={v:?}: one of native, bf16, f16, int8"))
                })?,
                None => Wire::Native,
            },
        })
    }
}

/// What each rank publishes through the store.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct PeerInfo {
    rank: usize,
    port: u16,
    /// For messages only; empty where the system does not say.
    host: String,
    /// `platform::host::host_identity`: one kernel boot and one network stack. A peer with the
    /// same known identity is reached over loopback; `None` (unknown) is never the same host.
    machine: Option<String>,
    addrs: Vec<IfaceAddr>,
}

pub struct CollRequest {
    pub coll: Collective,
    pub dtype: DType,
    pub op: ReduceOp,
    pub root: usize,
    pub input: RawBuf,
    pub output: RawBuf,
    pub send_counts: Option<Vec<usize>>,
    pub recv_counts: Option<Vec<usize>>,
    pub timeout: Option<Duration>,
    pub algo: Option<String>,
    /// Wire compression for this call (None: the communicator's default).
    pub wire: Option<Wire>,
}

/// Compression needs each contribution encoded once and each owner's result encoded once and
/// forwarded unchanged: the direct algorithm does exactly that.
const WIRE_ALGO: &str = "direct";

struct Job {
    run: Box<dyn FnOnce() -> Result<usize> + Send>,
    work: Work,
}

pub struct Communicator {
    cfg: CommConfig,
    fabric: Arc<Fabric>,
    selector: Selector,
    seq: AtomicU64,
    listener: Mutex<Option<Listener>>,
    routes: Vec<LinkRecord>,
    topology: Topology,
    closed: AtomicBool,
    jobs: Mutex<Option<crossbeam_channel::Sender<Job>>>,
    job_queue: crossbeam_channel::Receiver<Job>,
    idle_workers: Arc<AtomicUsize>,
    live_workers: Arc<AtomicUsize>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

/// Tags at and above this are plait's own (start-up pings); users get the ones below.
pub const RESERVED_TAGS: u64 = 1 << 63;
const PING_TAG: u64 = u64::MAX;
const PONG_TAG: u64 = u64::MAX - 1;

/// Probes every link once it is up: a ping that the peer's receiver thread answers at once,
/// so the round trip measures the link, not how far along the peer is. The best of a few.
fn ping_all(fabric: &Fabric, deadline: Instant) -> Result<Vec<(usize, Duration)>> {
    const ROUNDS: usize = 3;
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut word = [0u8; 8];
    let buf = RawBuf { ptr: word.as_mut_ptr(), len: 8 };
    let mut rtts = Vec::new();
    for p in (0..fabric.size).filter(|&p| p != fabric.rank) {
        let mut best = Duration::MAX;
        for _ in 0..ROUNDS {
            let t0 = Instant::now();
            exec::send_p2p(fabric, p, PING_TAG, DType::U8, buf, left(), "start-up ping".into())?;
            exec::recv_p2p(fabric, Some(p), PONG_TAG, DType::U8, buf, left(), "start-up ping".into())?;
            best = best.min(t0.elapsed());
        }
        rtts.push((p, best));
    }
    Ok(rtts)
}

/// Says that ranks with an unknown host identity count as other hosts. Once per process: every
/// communicator of the job would repeat it.
fn warn_host_identity_unknown(ranks: &[usize]) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::warn!(
            "same-host detection is unavailable on this platform for ranks {ranks:?}: they are treated as \
             ranks on other hosts (no loopback), so ranks that share a host must reach each other over a network"
        )
    });
}

impl Communicator {
    /// Meets the other ranks through `store` and connects to every one of them.
    pub fn new(store: &dyn Store, cfg: CommConfig) -> Result<Arc<Communicator>> {
        let (rank, size) = (cfg.rank, cfg.size);
        if size == 0 || rank >= size {
            return Err(PlaitError::invalid(format!("rank {rank} is out of range for world size {size}")));
        }
        let overrides = match &cfg.algo {
            Some(spec) => parse_algo_spec(spec)?,
            None => Default::default(),
        };
        let filter = cfg.iface.as_deref().map(IfaceFilter::parse).transpose()?;
        let route_file = cfg.routes_file.as_deref().map(|p| RouteFile::load(p, size)).transpose()?;
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let prefix = format!("plait/{}/{}", cfg.group, cfg.epoch);

        let lanes = cfg.streams.clamp(1, MAX_STREAMS) as u8;
        let hello = Hello {
            group: cfg.group.clone(),
            epoch: cfg.epoch,
            from: rank as u32,
            to: rank as u32,
            world: size as u32,
            lane: 0,
            lanes,
        };
        let listener = if size > 1 { Some(Listener::bind(hello.clone())?) } else { None };
        let me = PeerInfo {
            rank,
            port: listener.as_ref().map(|l| l.port()).unwrap_or(0),
            host: host::hostname().unwrap_or_default(),
            machine: host::host_identity(),
            addrs: list_interfaces(),
        };
        store.set(&format!("{prefix}/rank/{rank}"), &serde_json::to_vec(&me).unwrap())?;

        let mailbox = Arc::new(Mailbox::new());
        let heartbeat = (cfg.timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let inbox = Arc::new(CommInbox::new(mailbox.clone(), heartbeat));
        let mut fabric = Fabric::new(rank, size, mailbox)?;
        fabric.busy_poll = cfg.busy_poll;
        let mut routes: Vec<LinkRecord> = Vec::new();
        let mut all_links: Vec<Vec<LinkRecord>> = Vec::new();
        let setup = (|| -> Result<()> {
            let mut infos = Vec::with_capacity(size);
            for r in 0..size {
                if r == rank {
                    infos.push(me.clone());
                    continue;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                let raw = store.get(&format!("{prefix}/rank/{r}"), left).map_err(|e| {
                    PlaitError::Rendezvous(format!("rank {r} did not publish its address within {:?}: {e}", cfg.timeout))
                })?;
                let info: PeerInfo = serde_json::from_slice(&raw)
                    .map_err(|e| PlaitError::Rendezvous(format!("rank {r} published an unreadable address record: {e}")))?;
                infos.push(info);
            }
            let unknown: Vec<usize> = infos.iter().filter(|i| i.machine.is_none()).map(|i| i.rank).collect();
            if !unknown.is_empty() {
                warn_host_identity_unknown(&unknown);
            }
            // Lower ranks listen, higher ranks connect: simultaneous connects cannot deadlock.
            for peer in 0..rank {
                let info = &infos[peer];
                let same_host = same_host(info.machine.as_deref(), me.machine.as_deref());
                let candidates = match &route_file {
                    Some(rf) => vec![rf.route(rank, &me.addrs, peer, &info.addrs)?],
                    None => prefer_dedicated(candidate_routes(&me.addrs, &info.addrs, same_host, filter.as_ref()), &infos, peer),
                };
                let first = Hello { to: peer as u32, ..hello.clone() };
                let (stream, route) = connect_first(&candidates, info, &first, deadline)?;
                let mut streams = vec![stream];
                for lane in 1..lanes {
                    streams.push(connect(&route, info.port, &Hello { lane, ..first.clone() }, deadline)?);
                }
                routes.push(LinkRecord {
                    peer,
                    local_iface: route.local.name.clone(),
                    local: route.local.ip.to_string(),
                    remote: route.peer_ip.to_string(),
                    same_host,
                    rtt_us: None,
                    reason: route.reason.clone(),
                    streams: lanes as usize,
                });
                let addr = format!("{}:{}", route.peer_ip, info.port);
                fabric.attach_link(peer, PeerLink::start(peer, addr, streams, inbox.clone(), heartbeat)?)?;
            }
            for (peer, info) in infos.iter().enumerate().skip(rank + 1) {
                let listener = listener.as_ref().unwrap();
                let stream = listener.accept_from(peer as u32, deadline)?;
                let remote = stream.peer_addr().map(|a| a.ip().to_canonical().to_string()).unwrap_or_default();
                let local_ip = stream.local_addr().map(|a| a.ip().to_canonical()).ok();
                let local_iface = me.addrs.iter().find(|a| Some(a.ip) == local_ip).map(|a| a.name.clone()).unwrap_or_default();
                routes.push(LinkRecord {
                    peer,
                    local_iface,
                    local: local_ip.map(|i| i.to_string()).unwrap_or_default(),
                    remote: remote.clone(),
                    same_host: same_host(info.machine.as_deref(), me.machine.as_deref()),
                    rtt_us: None,
                    reason: format!("rank {peer} ({}) connected from {remote}", info.host),
                    streams: lanes as usize,
                });
                let mut streams = vec![stream];
                for lane in 1..lanes {
                    streams.push(listener.accept_lane(peer as u32, lane, deadline)?);
                }
                fabric.attach_link(peer, PeerLink::start(peer, format!("{remote}:{}", info.port), streams, inbox.clone(), heartbeat)?)?;
            }
            Ok(())
        })();
        let fabric = Arc::new(fabric);
        inbox.attach(&fabric);
        let setup = setup.and_then(|_| {
            for (peer, rtt) in ping_all(&fabric, deadline)? {
                if let Some(r) = routes.iter_mut().find(|r| r.peer == peer) {
                    r.rtt_us = Some(rtt.as_secs_f64() * 1e6);
                    // Bandwidth-delay product from the interface's speed and the measured RTT. An
                    // interface of unknown speed (loopback, virtual, or a system that does not
                    // say) keeps the system's buffer autotuning.
                    let speed = me.addrs.iter().find(|a| a.name == r.local_iface).and_then(|a| a.speed_mbps);
                    if let Some(mbps) = speed {
                        let bdp = (mbps as f64 * 1e6 / 8.0 * rtt.as_secs_f64()) as usize;
                        if let Some(size) = fabric.link(peer).fit_buffers_to_bdp(bdp) {
                            tracing::info!(peer, bdp, size, "socket buffers raised to the link's bandwidth-delay product");
                        }
                    }
                }
            }
            // Everyone shares its link records, so every rank derives the same topology.
            routes.sort_by_key(|r| r.peer);
            store.set(&format!("{prefix}/links/{rank}"), &serde_json::to_vec(&routes).unwrap())?;
            for r in 0..size {
                let theirs: Vec<LinkRecord> = if r == rank {
                    routes.clone()
                } else {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let raw = store.get(&format!("{prefix}/links/{r}"), left)?;
                    serde_json::from_slice(&raw).map_err(|e| PlaitError::Rendezvous(format!("rank {r} published unreadable link records: {e}")))?
                };
                all_links.push(theirs);
            }
            Ok(())
        });
        if let Err(e) = setup {
            fabric.fail(e.clone(), true);
            fabric.join_links();
            if let Some(l) = listener {
                l.close();
            }
            return Err(e);
        }
        let topology = if size == 1 { Topology::Single } else { topology::classify(&all_links) };
        let model = LinkModel { shared: topology != Topology::FullMesh, ..LinkModel::default() };
        let selector = Selector::new(overrides, model, cfg.segment_bytes);
        if rank == 0 {
            tracing::info!("topology: {}", topology.name());
            for (r, links) in all_links.iter().enumerate() {
                for l in links {
                    tracing::info!("route {r} -> {}: {} ({}) -> {}: {}", l.peer, l.local, l.local_iface, l.remote, l.reason);
                }
            }
        }
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        Ok(Arc::new(Communicator {
            cfg,
            fabric,
            selector,
            seq: AtomicU64::new(1),
            listener: Mutex::new(listener),
            routes,
            topology,
            closed: AtomicBool::new(false),
            jobs: Mutex::new(Some(tx)),
            job_queue: rx,
            idle_workers: Arc::new(AtomicUsize::new(0)),
            live_workers: Arc::new(AtomicUsize::new(0)),
            workers: Mutex::new(Vec::new()),
        }))
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

    fn usable(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(PlaitError::Broken("the communicator was closed".into()));
        }
        if let Some(err) = self.fabric.broken() {
            return Err(PlaitError::Broken(err.to_string()));
        }
        Ok(())
    }

    fn check_rank(&self, what: &str, r: usize) -> Result<()> {
        if r >= self.cfg.size {
            return Err(PlaitError::invalid(format!("{what} {r} is out of range for world size {}", self.cfg.size)));
        }
        Ok(())
    }

    /// Validates a collective call and prepares it; nothing is sent and no sequence number is
    /// used until every check has passed, so a rejected call cannot desynchronise the ranks.
    fn prepare(&self, req: &CollRequest) -> Result<(OpSpec, Arc<crate::sched::Schedule>, Layout)> {
        self.usable()?;
        let (n, rank) = (self.cfg.size, self.cfg.rank);
        let coll = req.coll;
        if coll.rooted() {
            self.check_rank("root", req.root)?;
        }
        if coll.reduces() && !req.op.supports(req.dtype) {
            return Err(PlaitError::invalid(format!("{}: op {} is not defined for dtype {}", coll, req.op.name(), req.dtype)));
        }
        let es = req.dtype.size();
        for (what, b) in [("input", req.input), ("output", req.output)] {
            if b.len % es != 0 {
                return Err(PlaitError::invalid(format!("{coll}: {what} of {} bytes is not a whole number of {} elements", b.len, req.dtype)));
            }
            if b.len > 0 && b.ptr.is_null() {
                return Err(PlaitError::invalid(format!("{coll}: {what} pointer is null")));
            }
        }
        let root = if coll.rooted() { req.root } else { 0 };
        // Buffers a rank does not use are ignored (a non-root's output of reduce, say).
        let uses_input = coll.input_chunks(n, rank, root) > 0;
        let uses_output = coll.output_chunks(n, rank, root) > 0;
        let in_elems = if uses_input { req.input.len / es } else { 0 };
        let out_elems = if uses_output { req.output.len / es } else { 0 };
        let counts = counts_for(coll, n, rank, root, in_elems, out_elems, req.send_counts.as_deref(), req.recv_counts.as_deref())?;
        let layout = Layout::new(coll, n, rank, root, es, counts, self.cfg.segment_bytes);
        let block_bytes: Vec<usize> = layout.counts.scratch.iter().map(|c| c * es).collect();
        // The communicator's wire default applies where it can; an explicit request must.
        let compressible = coll == Collective::AllReduce && req.dtype == DType::F32;
        let wire = match req.wire {
            Some(w) if w != Wire::Native && !compressible => {
                return Err(PlaitError::invalid(format!(
                    "{coll}: wire compression ({}) applies to f32 allreduce only, not {} {coll}",
                    w.name(),
                    req.dtype
                )))
            }
            Some(w) => w,
            None if compressible => self.cfg.wire,
            None => Wire::Native,
        };
        let algo = match (wire, req.algo.as_deref()) {
            (Wire::Native, a) => a,
            (_, None) => Some(WIRE_ALGO),
            (_, Some(a)) if a == WIRE_ALGO => Some(a),
            (w, Some(a)) => {
                return Err(PlaitError::invalid(format!(
                    "{coll}: wire compression ({}) runs with the {WIRE_ALGO} algorithm, not {a}",
                    w.name()
                )))
            }
        };
        let sched = self.selector.choose(coll, n, root, &block_bytes, algo)?;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let total: usize = layout.counts.scratch.iter().sum();
        let what: Arc<str> = if wire != Wire::Native {
            format!("{coll} #{seq} ({}, {}, {total} elements, {}, {} on the wire)", req.dtype, req.op.name(), sched.name, wire.name())
        } else if coll.reduces() {
            format!("{coll} #{seq} ({}, {}, {total} elements, {})", req.dtype, req.op.name(), sched.name)
        } else if coll.rooted() {
            format!("{coll} #{seq} ({}, root {root}, {total} elements, {})", req.dtype, sched.name)
        } else {
            format!("{coll} #{seq} ({}, {total} elements, {})", req.dtype, sched.name)
        }
        .into();
        let spec = OpSpec {
            coll,
            dtype: req.dtype,
            op: req.op,
            root,
            seq,
            timeout: req.timeout.unwrap_or(self.cfg.timeout),
            sched_id: exec::sched_id(&format!("{}/{}", sched.name, wire.name()), self.cfg.segment_bytes),
            layout_id: exec::layout_id(coll, &layout.counts.scratch),
            wire,
            what,
        };
        Ok((spec, sched, layout))
    }

    /// Runs a collective. `inline` runs it on this thread (the caller waits anyway); otherwise
    /// it runs on a worker and the returned Work completes later. The buffers must stay valid
    /// until the Work completes.
    pub fn collective(self: &Arc<Self>, req: CollRequest, inline: bool) -> Result<Work> {
        let (spec, sched, layout) = self.prepare(&req)?;
        let (input, output) = (req.input, req.output);
        let caller_reads = inline && input.len.max(output.len) <= self.cfg.caller_read_bytes;
        let me = self.clone();
        self.submit(inline, caller_reads, Box::new(move || {
            exec::run_collective(&me.fabric, &spec, &sched, &layout, input, output).map(|_| 0)
        }))
    }

    pub fn send(self: &Arc<Self>, data: RawBuf, dtype: DType, peer: usize, tag: u64, timeout: Option<Duration>, inline: bool) -> Result<Work> {
        self.usable()?;
        self.check_rank("destination rank", peer)?;
        if peer == self.cfg.rank {
            return Err(PlaitError::invalid("send: a rank cannot send to itself"));
        }
        if tag >= RESERVED_TAGS {
            return Err(PlaitError::invalid(format!("send: tag {tag} is reserved; use tags below 2**63")));
        }
        let timeout = timeout.unwrap_or(self.cfg.timeout);
        let what: Arc<str> = format!("send to rank {peer} (tag {tag}, {} bytes)", data.len).into();
        // Queued now, in call order; only the waiting runs later.
        self.fabric.set_caller_progress(inline && data.len <= self.cfg.caller_read_bytes);
        let started = exec::start_send(&self.fabric, peer, tag, dtype, data, what)?;
        let me = self.clone();
        self.submit(inline, inline && data.len <= self.cfg.caller_read_bytes, Box::new(move || exec::finish_p2p(&me.fabric, started, timeout)))
    }

    /// `src = None` receives from any source; the Work's value is the sender's rank.
    pub fn recv(self: &Arc<Self>, data: RawBuf, dtype: DType, src: Option<usize>, tag: u64, timeout: Option<Duration>, inline: bool) -> Result<Work> {
        self.usable()?;
        if tag >= RESERVED_TAGS {
            return Err(PlaitError::invalid(format!("recv: tag {tag} is reserved; use tags below 2**63")));
        }
        if let Some(s) = src {
            self.check_rank("source rank", s)?;
            if s == self.cfg.rank {
                return Err(PlaitError::invalid("recv: a rank cannot receive from itself"));
            }
        }
        let timeout = timeout.unwrap_or(self.cfg.timeout);
        let from = src.map(|s| format!("rank {s}")).unwrap_or_else(|| "any rank".into());
        let what: Arc<str> = format!("recv from {from} (tag {tag}, {} bytes)", data.len).into();
        // Posted now, in call order; only the waiting runs later.
        self.fabric.set_caller_progress(inline && data.len <= self.cfg.caller_read_bytes);
        let started = exec::start_recv(&self.fabric, src, tag, dtype, data, what)?;
        let me = self.clone();
        self.submit(inline, inline && data.len <= self.cfg.caller_read_bytes, Box::new(move || exec::finish_p2p(&me.fabric, started, timeout)))
    }

    /// Every rank waits until every rank has entered the barrier.
    pub fn barrier(self: &Arc<Self>, timeout: Option<Duration>, inline: bool) -> Result<Work> {
        let mut token = Box::new([1u8]);
        let buf = RawBuf { ptr: token.as_mut_ptr(), len: 1 };
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
        let (mut spec, sched, layout) = self.prepare(&req)?;
        spec.what = format!("barrier #{}", spec.seq).into();
        let me = self.clone();
        self.submit(inline, inline, Box::new(move || {
            let r = exec::run_collective(&me.fabric, &spec, &sched, &layout, buf, buf).map(|_| 0);
            drop(token);
            r
        }))
    }

    /// Runs `run` here (`inline`) or on a worker. `caller_reads`: this thread reads the links
    /// while it waits (small blocking calls); otherwise the links' receiver threads read.
    fn submit(&self, inline: bool, caller_reads: bool, run: Box<dyn FnOnce() -> Result<usize> + Send>) -> Result<Work> {
        self.fabric.set_caller_progress(caller_reads);
        let work = Work::new();
        if inline {
            work.complete(run());
            return Ok(work);
        }
        let jobs = self.jobs.lock();
        let Some(tx) = jobs.as_ref() else {
            return Err(PlaitError::Broken("the communicator was closed".into()));
        };
        // Claim an idle worker, or start one: a queued job must never wait for a busy one.
        let claimed = self.idle_workers.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |i| i.checked_sub(1)).is_ok();
        if !claimed {
            self.spawn_worker()?;
        }
        tx.send(Job { run, work: work.clone() }).map_err(|_| PlaitError::Broken("the communicator was closed".into()))?;
        Ok(work)
    }

    fn spawn_worker(&self) -> Result<()> {
        let (rx, idle, live) = (self.job_queue.clone(), self.idle_workers.clone(), self.live_workers.clone());
        let id = live.fetch_add(1, Ordering::SeqCst);
        let handle = std::thread::Builder::new()
            .name(format!("plait-op-{id}"))
            .spawn(move || loop {
                let job = match rx.recv_timeout(WORKER_IDLE_EXIT) {
                    Ok(job) => job,
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                        // Leave only if this worker is still counted idle and enough remain.
                        let leave = live.load(Ordering::SeqCst) > ASYNC_WORKERS_KEPT
                            && idle.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |i| i.checked_sub(1)).is_ok();
                        if leave {
                            live.fetch_sub(1, Ordering::SeqCst);
                            return;
                        }
                        continue;
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
                };
                job.work.complete((job.run)());
                idle.fetch_add(1, Ordering::SeqCst);
            })
            .map_err(|e| PlaitError::Io(format!("cannot start a worker thread: {e}")))?;
        let mut workers = self.workers.lock();
        workers.retain(|h| !h.is_finished());
        workers.push(handle);
        Ok(())
    }

    /// The algorithm the selector picks for a call of `nbytes` (per rank buffer).
    pub fn algorithm_for(&self, coll: Collective, nbytes: usize, root: usize) -> Result<String> {
        let n = self.cfg.size;
        let block_bytes: Vec<usize> = (0..n).map(|i| (i + 1) * nbytes / n - i * nbytes / n).collect();
        Ok(self.selector.choose(coll, n, root, &block_bytes, None)?.name.clone())
    }

    /// Ends every operation in flight (they fail with `Aborted`) and breaks the communicator.
    /// Safe from any thread.
    pub fn abort(&self, reason: &str) {
        self.fabric.fail(PlaitError::Aborted { op: String::new(), reason: reason.to_string() }, true);
    }

    /// Says goodbye to the peers, closes every socket and joins every thread. Idempotent.
    pub fn close(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        if self.fabric.broken().is_none() {
            self.fabric.broadcast_control(FrameKind::Close, String::new(), Duration::from_secs(1));
        }
        self.fabric.fail(PlaitError::Broken("the communicator was closed".into()), false);
        // Queued async jobs fail fast on the broken fabric; then the workers exit.
        drop(self.jobs.lock().take());
        let workers: Vec<_> = self.workers.lock().drain(..).collect();
        for w in workers {
            if w.thread().id() != std::thread::current().id() {
                let _ = w.join();
            }
        }
        self.fabric.join_links();
        if let Some(l) = self.listener.lock().take() {
            l.close();
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.close();
    }
}

/// Among subnet matches, a subnet this peer alone shares with us (a cable) goes before one that
/// other ranks are on too (a LAN or switch), whatever the interfaces report as speed: a shared
/// medium divides its bandwidth, a cable does not. The order is otherwise kept.
fn prefer_dedicated(mut candidates: Vec<Route>, infos: &[PeerInfo], peer: usize) -> Vec<Route> {
    let sharing = |r: &Route| -> usize {
        if r.local.is_loopback() || !r.reason.starts_with("subnet match") {
            return 0;
        }
        infos.iter().filter(|i| i.rank != peer && i.addrs.iter().any(|a| r.local.contains(a.ip) && a.ip != r.local.ip)).count()
    };
    let keyed: Vec<(bool, usize)> = candidates.iter().map(|r| (r.reason.starts_with("subnet match"), sharing(r))).collect();
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    // Only subnet matches move, and only among themselves.
    let subnet_slots: Vec<usize> = order.iter().copied().filter(|&i| keyed[i].0).collect();
    let mut sorted = subnet_slots.clone();
    sorted.sort_by_key(|&i| keyed[i].1);
    for (slot, i) in subnet_slots.iter().zip(sorted) {
        order[*slot] = i;
    }
    let mut taken: Vec<Option<Route>> = candidates.drain(..).map(Some).collect();
    order.into_iter().map(|i| taken[i].take().unwrap()).collect()
}

/// Tries the candidate routes in order; each but the last gets a bounded share of the time.
fn connect_first(candidates: &[Route], info: &PeerInfo, hello: &Hello, deadline: Instant) -> Result<(std::net::TcpStream, Route)> {
    if candidates.is_empty() {
        return Err(PlaitError::Rendezvous(format!(
            "no usable route to rank {} ({}): none of its addresses {:?} is reachable from this host's interfaces (check PLAIT_IFACE)",
            info.rank,
            info.host,
            info.addrs.iter().map(|a| a.ip.to_string()).collect::<Vec<_>>()
        )));
    }
    let mut errors = Vec::new();
    for (i, route) in candidates.iter().enumerate() {
        let last = i + 1 == candidates.len();
        let d = if last { deadline } else { deadline.min(Instant::now() + Duration::from_secs(5)) };
        match connect(route, info.port, hello, d) {
            Ok(s) => {
                let mut route = route.clone();
                if !errors.is_empty() {
                    route.reason = format!("{} (after {} failed)", route.reason, errors.join("; "));
                }
                return Ok((s, route));
            }
            Err(e) => {
                tracing::warn!(peer = info.rank, route = %route.peer_ip, "route failed, trying the next: {e}");
                errors.push(format!("{} -> {}: {e}", route.local.ip, route.peer_ip));
            }
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    Err(PlaitError::Rendezvous(format!("could not connect to rank {} ({}): {}", info.rank, info.host, errors.join("; "))))
}
