//! Building the live mesh of one epoch, step by step: publish this rank's addresses and meet the
//! others through the store (`rendezvous`), connect to every peer over the route chosen for it
//! (`connect_mesh`), probe every link (`probe`), size socket buffers to the links
//! (`size_buffers`), share the link records (`share_links`) and classify the topology. Each step
//! has one deadline, the configuration's timeout from the start. Elastic mode calls `bootstrap`
//! again for each new member set.

use super::config::{CommConfig, Measure, MAX_STREAMS};
use super::measure;
use super::relay;
use super::topology::{self, LinkRecord, RouteFile, Topology};
use crate::dtype::DType;
use crate::error::{PlaitError, Result};
use crate::exec::p2p;
use crate::net::auth::{key_from_hex, key_to_hex, LinkAuth, LinkStream, PublicKey};
use crate::net::connect::{connect, HANDSHAKE_OP};
use crate::net::frame::{PING_TAG, PONG_TAG, PROBE_AGAIN_TAG, PROBE_TAG};
use crate::net::handshake::Hello;
use crate::net::iface::{list_interfaces, IfaceAddr};
use crate::net::listener::Listener;
use crate::net::peer::{PeerLink, EAGER_MAX};
use crate::net::route::{candidate_routes, listen_addrs, prefer_dedicated, IfaceFilter, Route};
use crate::platform::host::{self, same_host};
use crate::raw::RawBuf;
use crate::sched::order::LinkMatrix;
use crate::session::{Demux, Groups, Mailbox, Session};
use crate::store::Store;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// The public half of this rank's link key for this epoch (hex): every link to this rank
    /// must prove it holds the private half.
    #[serde(default)]
    key: String,
    /// The world size this rank was started with: a mismatch is named at the rendezvous.
    world: usize,
    /// The ranks whose links this rank keeps from the last epoch (a grown mesh): a link is kept
    /// only if both ends say so.
    #[serde(default)]
    kept: Vec<usize>,
    /// `PLAIT_MEASURE` on this rank: ranks that would decide differently are refused at once
    /// (the ones measuring would wait for the others' probes until the deadline).
    #[serde(default)]
    measure: String,
    /// `PLAIT_RELAY` on this rank: a rank that would fail where the others relay is named at once.
    #[serde(default = "yes")]
    relay: bool,
    /// `PLAIT_COST_MODEL` on this rank (`Constants::canonical`): ranks whose selectors would
    /// choose differently are refused at once, not at their first mismatched call.
    #[serde(default)]
    cost: String,
    /// `PLAIT_SCHEDULES` on this rank (`custom::summary`): ranks holding different custom
    /// schedules would choose (or run) different ones.
    #[serde(default)]
    schedules: String,
}

fn yes() -> bool {
    true
}

/// A pair of ranks with no connection of their own: `a < b`, and why (`b` connects to `a`).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Unreachable {
    a: usize,
    b: usize,
    why: String,
}

/// How long a connection may take before the pair is relayed instead (`PLAIT_RELAY`): a firewall
/// that drops what it refuses leaves nothing to wait for but the deadline. At most a quarter of
/// start-up's time, so the relay still has time to be set up.
const DIAL_BUDGET: Duration = Duration::from_secs(10);

fn dial_budget(cfg: &CommConfig) -> Duration {
    DIAL_BUDGET.min(cfg.startup_timeout.unwrap_or(cfg.timeout).min(cfg.timeout) / 4)
}

/// What a mesh grown from the last epoch's takes over (elastic mode: members added at the end,
/// the others' ranks unchanged, no operation under way): its session's links, mailbox and
/// readers, the demux those links deliver to, and the link records.
pub(crate) struct Kept {
    pub session: Arc<Session>,
    pub demux: Arc<Demux>,
    pub routes: Vec<LinkRecord>,
}

/// The mesh of one epoch, ready for operations.
pub(crate) struct Mesh {
    pub session: Arc<Session>,
    /// Where the links deliver (a grown mesh takes it over).
    pub demux: Arc<Demux>,
    /// Kept open for the communicator's life (None for a single rank).
    pub listener: Option<Listener>,
    /// This rank's link records, by peer.
    pub routes: Vec<LinkRecord>,
    pub topology: Topology,
    /// Every directed link's latency and bandwidth, when they were measured (`PLAIT_MEASURE`).
    pub links: Option<LinkMatrix>,
    /// Which ranks share a host, where some do and there is more than one (`topology::hosts`).
    pub hosts: Option<crate::sched::cost::Hosts>,
}

/// Everything the steps share.
struct Plan<'a> {
    cfg: &'a CommConfig,
    store: &'a dyn Store,
    /// Store keys of this group and epoch.
    prefix: String,
    deadline: Instant,
    hello: Hello,
    auth: Arc<LinkAuth>,
    heartbeat: Duration,
}

impl Plan<'_> {
    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Sets `<prefix>/<key>` by the start-up deadline.
    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        self.store.set(&format!("{}/{key}", self.prefix), value, self.left())
    }
}

/// Meets the other ranks of `cfg`'s group and epoch through `store` and builds the mesh.
/// How often an idle link says it is alive: often enough that a silent peer is noticed well
/// within the timeout.
pub(crate) fn heartbeat(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

pub(crate) fn bootstrap(store: &dyn Store, cfg: &CommConfig) -> Result<Mesh> {
    bootstrap_from(store, cfg, None)
}

/// `bootstrap`, keeping `kept`'s links: only the ranks it has no link to are connected.
pub(crate) fn bootstrap_from(store: &dyn Store, cfg: &CommConfig, kept: Option<Kept>) -> Result<Mesh> {
    let (rank, size) = (cfg.rank, cfg.size);
    if size == 0 || rank >= size {
        return Err(PlaitError::invalid(format!("rank {rank} is out of range for world size {size}")));
    }
    let filter = cfg.iface.as_deref().map(IfaceFilter::parse).transpose()?;
    let route_file = cfg.routes_file.as_deref().map(|p| RouteFile::load(p, size)).transpose()?;
    // A fresh key per communicator and epoch: nothing outlives the mesh it authenticates.
    let auth = Arc::new(LinkAuth::generate(cfg.token.as_ref().map(|t| t.secret()), cfg.encrypt)?);
    let plan = Plan {
        cfg,
        store,
        prefix: format!("plait/{}/{}", cfg.group, cfg.epoch),
        deadline: Instant::now() + cfg.startup_timeout.unwrap_or(cfg.timeout).min(cfg.timeout),
        hello: Hello {
            group: cfg.group.clone(),
            epoch: cfg.epoch,
            from: rank as u32,
            to: rank as u32,
            world: size as u32,
            lane: 0,
            lanes: cfg.streams.clamp(1, MAX_STREAMS) as u8,
            mode: auth.mode(),
        },
        auth,
        heartbeat: heartbeat(cfg.timeout),
    };
    let addrs = list_interfaces();
    let listener = if size > 1 {
        // Only where a peer's route can end (`PLAIT_IFACE`, `PLAIT_ROUTES`), and only for the
        // peers the rendezvous names (`admit` below).
        let on = match &route_file {
            Some(rf) => Some(rf.listen_addrs(rank, &addrs)),
            None => listen_addrs(&addrs, filter.as_ref()),
        };
        let l = Listener::bind_on(plan.hello.clone(), plan.auth.clone(), on.as_deref(), 0, cfg.hello_timeout, true)?;
        tracing::info!("rank {rank} listens on {:?}", l.local_addrs());
        Some(l)
    } else {
        None
    };
    let me = PeerInfo {
        rank,
        port: listener.as_ref().map(|l| l.port()).unwrap_or(0),
        host: host::hostname().unwrap_or_default(),
        machine: host::host_identity(),
        addrs,
        world: size,
        key: key_to_hex(&plan.auth.public_key()),
        kept: kept.as_ref().map(|k| k.session.direct_peers()).unwrap_or_default(),
        measure: cfg.measure.name().to_string(),
        relay: cfg.relay,
        cost: cfg.cost.canonical(),
        schedules: crate::sched::custom::summary(&cfg.schedules),
    };
    if let Some(k) = &kept {
        // Before the record goes out: no peer sends this epoch's frames before it has it.
        k.session.set_caller_progress(false);
        k.session.mailbox.restart()?;
        k.demux.detach();
    }
    plan.publish(&format!("rank/{rank}"), &serde_json::to_vec(&me).unwrap())?;

    let (demux, mut session, mut routes) = match kept {
        Some(k) => (k.demux, Session::grown(&k.session, size), k.routes.into_iter().filter(|r| r.via.is_none()).collect()),
        None => {
            let mailbox = Arc::new(Mailbox::with_limits(cfg.unexpected_bytes, cfg.timeout));
            let groups = Arc::new(Groups::default());
            let demux = Arc::new(Demux::new(mailbox.clone(), plan.heartbeat, Some(groups.clone())));
            (demux, Session::new(rank, size, mailbox, groups)?, Vec::new())
        }
    };
    session.busy_poll = cfg.busy_poll;
    let kept_peers = session.direct_peers();
    let mut dialed = Vec::new();
    let mut unreachable = Vec::new();
    let watching = std::sync::atomic::AtomicBool::new(true);
    let connected = std::thread::scope(|scope| {
        if let Some(give_up) = &cfg.give_up {
            // Waits on a listener and on connects cannot ask the question themselves: this
            // watcher closes the one and cancels the others when the answer turns to yes.
            let (listener, auth, watching) = (listener.as_ref(), &plan.auth, &watching);
            scope.spawn(move || {
                while watching.load(std::sync::atomic::Ordering::SeqCst) {
                    if (give_up.0)() {
                        auth.cancel();
                        if let Some(l) = listener {
                            l.close();
                        }
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            });
        }
        let r = rendezvous(&plan, &me).and_then(|infos| {
            check_kept(&session, &infos)?;
            check_measure(cfg, &infos)?;
            check_alike_choices(cfg, &infos)?;
            if let Some(l) = &listener {
                let higher: Vec<(u32, Vec<_>)> =
                    infos[rank + 1..].iter().map(|i| (i.rank as u32, i.addrs.iter().map(|a| a.ip).collect())).collect();
                l.admit(&higher);
            }
            let routing = Routing { me: &me, infos: &infos, filter: filter.as_ref(), file: route_file.as_ref() };
            connect_mesh(&plan, &routing, listener.as_ref(), &demux, &mut session, &mut routes, &mut dialed)?;
            unreachable = reach(&plan, &routing, &demux, &mut session)?;
            Ok(infos)
        });
        watching.store(false, std::sync::atomic::Ordering::SeqCst);
        r
    });
    let session = Arc::new(session);
    demux.attach(&session);
    let all_links = connected.and_then(|infos| {
        // A ring no larger than the payloads that always go on the socket would never be used.
        if cfg.shm_bytes > EAGER_MAX {
            for r in routes.iter().filter(|r| r.same_host && r.via.is_none()) {
                session.link(r.peer).offer_shm(cfg.shm_bytes);
            }
        }
        let rtts = probe(&session, plan.deadline)?;
        // The probes went on the first connection after the offers, so their answers mean the
        // offers were read: taken, or declined for good.
        for r in routes.iter_mut() {
            r.shm_lanes = if r.via.is_none() { session.link(r.peer).settle_shm() } else { 0 };
        }
        size_buffers(&session, &me.addrs, &mut routes, &rtts);
        for r in routes.iter_mut() {
            r.max_streams = if kept_peers.contains(&r.peer) { r.streams } else { cfg.streams_max.max(r.streams) };
        }
        if !measure::wanted(cfg.measure, &machines(&infos)) {
            return share_links(&plan, "links", &mut routes);
        }
        // A link kept from the last view keeps its figures: only the new ones hold the view up.
        // A relayed link is not measured: its figures are its two hops' (`relay`).
        let new: Vec<usize> = session.direct_peers().into_iter().filter(|p| !kept_peers.contains(p)).collect();
        measure_links(&session, &new, &rtts, &mut routes, plan.deadline, PROBE_TAG)?;
        let all = share_links(&plan, "links", &mut routes)?;
        let grow = measure::lanes_wanted(&all);
        if grow.is_empty() {
            return Ok(all);
        }
        // Every rank holds the same records, so every rank adds the same connections and measures
        // again, over them.
        add_lanes(&plan, &session, listener.as_ref(), &infos, &dialed, &grow, &mut routes)?;
        let grown: Vec<usize> = grow.iter().filter_map(|&(i, j, _)| (i == rank).then_some(j).or((j == rank).then_some(i))).collect();
        // The added connections' buffers, sized as the first one's were (the product spread
        // over every connection of the link).
        let grown_rtts: Vec<(usize, Duration)> = rtts.iter().copied().filter(|(p, _)| grown.contains(p)).collect();
        size_buffers(&session, &me.addrs, &mut routes, &grown_rtts);
        measure_links(&session, &grown, &rtts, &mut routes, plan.deadline, PROBE_AGAIN_TAG)?;
        share_links(&plan, "links-grown", &mut routes)
    });
    let all_links = all_links.and_then(|mut all| {
        set_relays(&session, &demux, &unreachable, &mut all, &mut routes)?;
        Ok(all)
    });
    let all_links = match all_links {
        Ok(all) => all,
        Err(e) => {
            session.fail(e.clone(), true);
            session.join_links();
            if let Some(l) = listener {
                l.close();
            }
            return Err(e);
        }
    };
    let topology = if size == 1 { Topology::Single } else { topology::classify(&all_links) };
    let links = topology::link_matrix(&all_links);
    let hosts = topology::hosts(&all_links);
    if rank == 0 {
        tracing::info!("topology: {}", topology.name());
        for (r, links) in all_links.iter().enumerate() {
            for l in links {
                tracing::info!("route {r} -> {}: {} ({}) -> {}: {}", l.peer, l.local, l.local_iface, l.remote, l.reason);
            }
        }
    }
    Ok(Mesh { session, demux, listener, routes, topology, links, hosts })
}

fn machines(infos: &[PeerInfo]) -> Vec<Option<&str>> {
    infos.iter().map(|i| i.machine.as_deref()).collect()
}

/// Every rank must decide alike whether to measure the links: a rank that measures waits for
/// probes from its peers, which a rank that does not would never send.
fn check_measure(cfg: &CommConfig, infos: &[PeerInfo]) -> Result<()> {
    let hosts = machines(infos);
    let mine = measure::wanted(cfg.measure, &hosts);
    for info in infos.iter().filter(|i| i.rank != cfg.rank) {
        let theirs = Measure::from_name(&info.measure).map(|m| measure::wanted(m, &hosts));
        if theirs.as_ref().ok() != Some(&mine) {
            let (a, b) = if mine { ("would measure", "would not") } else { ("would not measure", "would") };
            return Err(PlaitError::Config(format!(
                "PLAIT_MEASURE={} on this rank ({}) and {:?} on rank {} ({}): this rank {a} the links and that rank {b}; set it the same on every rank",
                cfg.measure.name(), cfg.rank, info.measure, info.rank, info.host
            )));
        }
    }
    Ok(())
}

/// Every rank must relay alike (a rank that would fail where its peers relay leaves them
/// waiting), price schedules alike and hold the same custom ones (or their selectors choose
/// differently).
fn check_alike_choices(cfg: &CommConfig, infos: &[PeerInfo]) -> Result<()> {
    if let Some(info) = infos.iter().find(|i| i.relay != cfg.relay) {
        return Err(PlaitError::Config(format!(
            "PLAIT_RELAY={} on this rank ({}) and {} on rank {} ({}): set it the same on every rank",
            cfg.relay as u8, cfg.rank, info.relay as u8, info.rank, info.host
        )));
    }
    let mine = cfg.cost.canonical();
    if let Some(info) = infos.iter().find(|i| i.cost != mine) {
        let shown = |s: &str| if s.is_empty() { "unset".to_string() } else { format!("{s:?}") };
        return Err(PlaitError::Config(format!(
            "PLAIT_COST_MODEL {} on this rank ({}) and {} on rank {} ({}): the ranks would choose different algorithms; set it the same on every rank",
            shown(&mine), cfg.rank, shown(&info.cost), info.rank, info.host
        )));
    }
    let mine = crate::sched::custom::summary(&cfg.schedules);
    if let Some(info) = infos.iter().find(|i| i.schedules != mine) {
        let shown = |s: &str| if s.is_empty() { "none".to_string() } else { s.to_string() };
        return Err(PlaitError::Config(format!(
            "custom schedules (PLAIT_SCHEDULES, or schedules=): this rank ({}) holds [{}] and rank {} ({}) holds [{}]: the ranks would choose or run different algorithms; give every rank the same schedule files",
            cfg.rank, shown(&mine), info.rank, info.host, shown(&info.schedules)
        )));
    }
    Ok(())
}

/// A link is kept only if both ends kept it: a rank whose last mesh failed (or that is new)
/// connects afresh, and its peers must not wait on a link it no longer reads.
fn check_kept(session: &Session, infos: &[PeerInfo]) -> Result<()> {
    let rank = session.rank;
    for info in infos.iter().filter(|i| i.rank != rank) {
        let mine = session.links[info.rank].is_some();
        let theirs = info.kept.contains(&rank);
        if mine != theirs {
            let (a, b) = if mine { ("kept", "did not") } else { ("did not keep", "did") };
            return Err(PlaitError::Rendezvous(format!(
                "this rank {a} its link to rank {} ({}) from the last epoch and that rank {b}: the next view builds its mesh afresh",
                info.rank, info.host
            )));
        }
    }
    Ok(())
}

/// Every rank's published record, in rank order. A rank started with another world size is
/// named as soon as its record is read; a rank that never publishes is named at the deadline,
/// with who did publish, since nobody at all means another store, group or epoch.
fn rendezvous(plan: &Plan, me: &PeerInfo) -> Result<Vec<PeerInfo>> {
    let mut infos = Vec::with_capacity(plan.cfg.size);
    for r in 0..plan.cfg.size {
        if r == me.rank {
            infos.push(me.clone());
            continue;
        }
        let raw = plan.store.get(&format!("{}/rank/{r}", plan.prefix), plan.left()).map_err(|e| not_published(plan, me, r, e))?;
        let info: PeerInfo = serde_json::from_slice(&raw)
            .map_err(|e| PlaitError::Rendezvous(format!("rank {r} published an unreadable address record: {e}")))?;
        if info.world != me.world || info.rank != r {
            return Err(PlaitError::Rendezvous(format!(
                "rank {r} has world size {}, this rank ({}) {}: every rank must be started with the same world size \
                 (store keys {}/rank/*)",
                info.world, me.rank, me.world, plan.prefix
            )));
        }
        infos.push(info);
    }
    let keys: Vec<PublicKey> = infos
        .iter()
        .map(|i| {
            key_from_hex(&i.key).ok_or_else(|| {
                PlaitError::Rendezvous(format!("rank {} published no readable link key (a plait of another version?)", i.rank))
            })
        })
        .collect::<Result<_>>()?;
    plan.auth.learn_peers(keys);
    let unknown: Vec<usize> = infos.iter().filter(|i| i.machine.is_none()).map(|i| i.rank).collect();
    if !unknown.is_empty() {
        warn_host_identity_unknown(&unknown);
    }
    Ok(infos)
}

/// The error for rank `missing` not publishing its record: which ranks did, looked up without
/// waiting, unless the store itself stopped answering.
fn not_published(plan: &Plan, me: &PeerInfo, missing: usize, e: PlaitError) -> PlaitError {
    let key = format!("{}/rank/*", plan.prefix);
    if matches!(e, PlaitError::Timeout { .. }) {
        return PlaitError::Rendezvous(format!("waiting for rank {missing}'s address (store key {key}): {e}"));
    }
    let published: Vec<usize> = (0..plan.cfg.size)
        .filter(|&r| r != me.rank && r != missing)
        .filter(|&r| r < missing || plan.store.get(&format!("{}/rank/{r}", plan.prefix), Duration::from_millis(1)).is_ok())
        .collect();
    let absent: Vec<usize> = (0..plan.cfg.size).filter(|&r| r != me.rank && !published.contains(&r)).collect();
    let hint = if published.is_empty() {
        format!(
            "no other rank published to this store under {key}: are all ranks using the same store (address and port), \
             group and epoch, and the same world size ({})?",
            me.world
        )
    } else {
        format!("ranks {published:?} did, so ranks {absent:?} did not start, are using another store, group or epoch, or a smaller world size")
    };
    // Not a timeout (that is the case above): the lookup ended early, and `e` says why.
    PlaitError::Rendezvous(format!("rank {missing} did not publish its address: {hint} ({e})"))
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

/// How this rank picks the route to each peer.
struct Routing<'a> {
    me: &'a PeerInfo,
    infos: &'a [PeerInfo],
    filter: Option<&'a IfaceFilter>,
    file: Option<&'a RouteFile>,
}

impl Routing<'_> {
    fn same_host(&self, peer: usize) -> bool {
        same_host(self.infos[peer].machine.as_deref(), self.me.machine.as_deref())
    }

    /// The routes to try for `peer`, best first.
    fn candidates(&self, peer: usize) -> Result<Vec<Route>> {
        let info = &self.infos[peer];
        if let Some(rf) = self.file {
            return Ok(vec![rf.route(self.me.rank, &self.me.addrs, peer, &info.addrs)?]);
        }
        let others: Vec<&[IfaceAddr]> = self.infos.iter().filter(|i| i.rank != peer).map(|i| &i.addrs[..]).collect();
        Ok(prefer_dedicated(candidate_routes(&self.me.addrs, &info.addrs, self.same_host(peer), self.filter), &others))
    }
}

/// Connects to every peer: lower ranks listen, higher ranks connect, so simultaneous connects
/// cannot deadlock. Each link joins the session as soon as it is up, so a failure later still
/// shuts it down with the others.
fn connect_mesh(
    plan: &Plan,
    routing: &Routing,
    listener: Option<&Listener>,
    demux: &Arc<Demux>,
    session: &mut Session,
    routes: &mut Vec<LinkRecord>,
    dialed: &mut Vec<(usize, Route)>,
) -> Result<()> {
    let (rank, lanes) = (plan.cfg.rank, plan.hello.lanes);
    let mut unreachable = Vec::new();
    let start = |peer: usize, addr: String, streams: Vec<LinkStream>, session: &mut Session| -> Result<()> {
        session.attach_link(peer, PeerLink::start(peer, addr, streams, demux.clone(), plan.heartbeat)?)?;
        Ok(())
    };
    // Every lower rank at once: a peer that cannot be reached costs its dial budget once, not
    // once for each peer after it.
    let lower: Vec<usize> = (0..rank).filter(|&p| session.links[p].is_none()).collect();
    let dials: Vec<(usize, Dial)> = std::thread::scope(|scope| {
        let dialing: Vec<_> = lower.iter().map(|&peer| (peer, scope.spawn(move || dial(plan, routing, peer)))).collect();
        dialing.into_iter().map(|(peer, d)| (peer, d.join().unwrap_or_else(|_| Dial::Failed(PlaitError::Internal(format!("connecting to rank {peer} panicked")), false)))).collect()
    });
    let say_unreachable = |unreachable: &Vec<Unreachable>| {
        // Said before failing, so the peer waiting for this connection fails with the reason too.
        let _ = plan.publish(&format!("reach/{rank}"), &serde_json::to_vec(unreachable).unwrap());
    };
    for (peer, d) in dials {
        let info = &routing.infos[peer];
        let (streams, route) = match d {
            Dial::Connected(streams, route) => (streams, route),
            Dial::Relay(why) => {
                unreachable.push(Unreachable { a: peer, b: rank, why });
                if !plan.cfg.relay {
                    say_unreachable(&unreachable);
                    let path = routing.file.map(|f| f.path.as_str()).unwrap_or_default();
                    return Err(PlaitError::Config(format!("PLAIT_ROUTES={path}: ranks {peer} and {rank} are to be relayed, but PLAIT_RELAY=0")));
                }
                continue;
            }
            // The peer answered and refused, start-up was called off, or the settings are wrong:
            // nothing a relay would mend.
            Dial::Failed(e, false) => return Err(e),
            Dial::Failed(e, true) => {
                let why = e.to_string();
                unreachable.push(Unreachable { a: peer, b: rank, why: why.clone() });
                if !plan.cfg.relay {
                    say_unreachable(&unreachable);
                    return Err(e);
                }
                tracing::warn!(peer, "no connection to rank {peer}: its frames will go through a rank that reaches both: {why}");
                continue;
            }
        };
        routes.push(LinkRecord::connected(
            peer,
            route.local.name.clone(),
            route.local.ip.to_string(),
            route.peer_ip.to_string(),
            routing.same_host(peer),
            route.reason.clone(),
            lanes as usize,
        ));
        start(peer, format!("{}:{}", route.peer_ip, info.port), streams, session)?;
        dialed.push((peer, route));
    }
    plan.publish(&format!("reach/{rank}"), &serde_json::to_vec(&unreachable).unwrap())?;
    for (peer, info) in routing.infos.iter().enumerate().skip(rank + 1) {
        if session.links[peer].is_some() {
            continue;
        }
        let listener = listener.expect("a rank with peers listens");
        let Some(stream) = accept_or_hear(plan, listener, peer)? else { continue };
        let remote = stream.stream.peer_addr().map(|a| a.ip().to_canonical().to_string()).unwrap_or_default();
        let local_ip = stream.stream.local_addr().map(|a| a.ip().to_canonical()).ok();
        let local_iface = routing.me.addrs.iter().find(|a| Some(a.ip) == local_ip).map(|a| a.name.clone()).unwrap_or_default();
        routes.push(LinkRecord::connected(
            peer,
            local_iface,
            local_ip.map(|i| i.to_string()).unwrap_or_default(),
            remote.clone(),
            routing.same_host(peer),
            format!("rank {peer} ({}) connected from {remote}", info.host),
            lanes as usize,
        ));
        let mut streams = vec![stream];
        for lane in 1..lanes {
            streams.push(listener.accept_lane(peer as u32, lane, plan.deadline)?);
        }
        start(peer, format!("{remote}:{}", info.port), streams, session)?;
    }
    Ok(())
}

/// How connecting to a lower rank went.
enum Dial {
    /// Every lane, over this route.
    Connected(Vec<LinkStream>, Route),
    /// The route file says to relay the pair (why).
    Relay(String),
    /// Failed; whether a relay could stand in (the network failed, not the settings or the peer's
    /// answer).
    Failed(PlaitError, bool),
}

/// Connects every lane to lower rank `peer`, trying its routes in order.
fn dial(plan: &Plan, routing: &Routing, peer: usize) -> Dial {
    let (rank, info) = (plan.cfg.rank, &routing.infos[peer]);
    if let Some(file) = routing.file.filter(|f| f.relayed(rank, peer)) {
        return Dial::Relay(format!("the route file {} says \"relay\"", file.path));
    }
    let first = Hello { to: peer as u32, ..plan.hello.clone() };
    let per_route = if plan.cfg.relay { dial_budget(plan.cfg) } else { Duration::MAX };
    let candidates = match routing.candidates(peer) {
        Ok(c) => c,
        Err(e) => return Dial::Failed(e, false),
    };
    let (stream, route) = match connect_first(&candidates, info, &first, &plan.auth, plan.deadline, per_route) {
        Ok(connected) => connected,
        Err((e, answered)) => {
            let relayable = !answered && !matches!(e, PlaitError::Aborted { .. } | PlaitError::Config(_) | PlaitError::InvalidArgument(_));
            return Dial::Failed(e, relayable);
        }
    };
    let mut streams = vec![stream];
    for lane in 1..plan.hello.lanes {
        match connect(&route, info.port, &Hello { lane, ..first.clone() }, &plan.auth, plan.deadline) {
            Ok(s) => streams.push(s),
            Err(e) => return Dial::Failed(e, false),
        }
    }
    Dial::Connected(streams, route)
}

/// Higher rank `peer`'s connection, or None when it says it could not connect to this rank (it
/// publishes which ranks it could not connect to once it has tried them all; its connects do
/// not wait for anyone's accepts). Until the deadline, whose error names the connections that
/// came and said nothing.
fn accept_or_hear(plan: &Plan, listener: &Listener, peer: usize) -> Result<Option<LinkStream>> {
    let (rank, t0) = (plan.cfg.rank, Instant::now());
    let accept = |by: Instant| match listener.accept_from(peer as u32, by) {
        Err(PlaitError::Timeout { op, waiting_on, .. }) => Err(PlaitError::Timeout { op, waiting_on, waited: t0.elapsed() }),
        other => other.map(Some),
    };
    loop {
        // Its list, waited for in slices (a store across a WAN answers in no less than its round
        // trip), with a look at the listener between them.
        let (slice, asked) = (plan.left().min(Duration::from_secs(1)), Instant::now());
        let store_said = match plan.store.get(&format!("{}/reach/{peer}", plan.prefix), slice) {
            Ok(raw) => {
                return match parse_reach(peer, &raw)?.into_iter().find(|u| u.a == rank) {
                    Some(_) if plan.cfg.relay => Ok(None),
                    Some(u) => Err(PlaitError::Rendezvous(format!(
                        "rank {peer} failed: could not connect to rank {rank}, this rank (PLAIT_RELAY=0): {}",
                        u.why
                    ))),
                    // It connected: its connection is here or on its way.
                    None => accept(plan.deadline),
                };
            }
            // Not yet (a store may say so as an error of its own kind: kept for the report).
            Err(e) => e,
        };
        if asked.elapsed() < slice / 2 {
            std::thread::sleep(Duration::from_millis(50)); // a store that fails at once
        }
        match listener.accept_from(peer as u32, Instant::now()) {
            Ok(stream) => return Ok(Some(stream)),
            Err(PlaitError::Timeout { .. }) => {}
            // Closed: start-up was called off (an elastic view the group moved past).
            Err(e) => return Err(e),
        }
        if Instant::now() >= plan.deadline {
            // Names the connections that came and said nothing, if any, and the store's last word.
            return accept(Instant::now()).map_err(|e| match (e, store_said) {
                (PlaitError::Timeout { op, waiting_on, waited }, s) if !matches!(s, PlaitError::Timeout { .. }) => {
                    PlaitError::Timeout { op, waiting_on: format!("{waiting_on}; the store, asked for its list of ranks it could not connect to: {s}"), waited }
                }
                (e, _) => e,
            });
        }
    }
}

/// The pairs rank `peer` could not connect (published once it has tried every lower rank).
fn reach_of(plan: &Plan, peer: usize) -> Result<Vec<Unreachable>> {
    parse_reach(peer, &plan.store.get(&format!("{}/reach/{peer}", plan.prefix), plan.left())?)
}

fn parse_reach(peer: usize, raw: &[u8]) -> Result<Vec<Unreachable>> {
    serde_json::from_slice(raw).map_err(|e| PlaitError::Rendezvous(format!("rank {peer} published an unreadable list of ranks it could not connect to: {e}")))
}

/// Every pair of ranks without a connection of its own, from every rank's list, in order; this
/// rank's links to its peers among them go through a relay, chosen once the links are measured
/// (`set_relays`). A pair no rank connects to both fails here, on every rank alike.
fn reach(plan: &Plan, routing: &Routing, demux: &Arc<Demux>, session: &mut Session) -> Result<Vec<Unreachable>> {
    let (rank, n) = (plan.cfg.rank, plan.cfg.size);
    let mut all = Vec::new();
    for r in 0..n {
        all.extend(reach_of(plan, r)?);
    }
    let cut = |x: usize, y: usize| all.iter().any(|u| (u.a, u.b) == (x.min(y), x.max(y)));
    for u in &all {
        if !(0..n).any(|r| r != u.a && r != u.b && !cut(u.a, r) && !cut(r, u.b)) {
            return Err(PlaitError::Rendezvous(format!(
                "rank {} ({}) could not connect to rank {} ({}): {}; and no other rank connects to both, so none can pass their frames on",
                u.b, routing.infos[u.b].host, u.a, routing.infos[u.a].host, u.why
            )));
        }
    }
    for u in all.iter().filter(|u| u.a == rank || u.b == rank) {
        let peer = u.a + u.b - rank;
        let addr = format!("{} (no connection of its own; relayed)", routing.infos[peer].host);
        session.attach_relayed(peer, PeerLink::relayed(peer, rank, addr, demux.clone(), plan.heartbeat));
    }
    Ok(all)
}

/// Chooses each unreachable pair's relay from the measured links (`relay::choose`), sends this
/// rank's relayed links through theirs, and adds the relayed links to every rank's records.
fn set_relays(session: &Session, demux: &Demux, unreachable: &[Unreachable], all: &mut [Vec<LinkRecord>], routes: &mut Vec<LinkRecord>) -> Result<()> {
    demux.set_relaying(Vec::new());
    if unreachable.is_empty() {
        return Ok(());
    }
    let rank = session.rank;
    let pairs: Vec<(usize, usize)> = unreachable.iter().map(|u| (u.a, u.b)).collect();
    let relays = relay::choose(&pairs, all)
        .map_err(|(a, b)| PlaitError::Rendezvous(format!("no rank connects to both rank {a} and rank {b}, so none can pass their frames on")))?;
    let why = |a: usize, b: usize| unreachable.iter().find(|u| (u.a, u.b) == (a, b)).map(|u| u.why.clone()).unwrap_or_default();
    relay::add_relayed(all, &relays, &why);
    demux.set_relaying(relays.iter().filter(|r| r.2 == rank).map(|r| (r.0, r.1)).collect());
    for &(a, b, via) in relays.iter().filter(|&&(a, b, _)| a == rank || b == rank) {
        let peer = a + b - rank;
        let through = session.links[via].clone().expect("a relay is connected to both ends");
        session.link(peer).set_via(via, through);
        tracing::info!(peer, via, "frames to rank {peer} go through rank {via}");
    }
    for &(a, b, _) in relays.iter().filter(|r| r.2 == rank) {
        session.link(a).keep_receiver_threads();
        session.link(b).keep_receiver_threads();
    }
    *routes = all[rank].clone();
    Ok(())
}

/// Tries the candidate routes in order, each for at most `per_route`; each but the last for at
/// most 5 s. On failure, whether the peer's listener answered on some route (and refused).
fn connect_first(
    candidates: &[Route],
    info: &PeerInfo,
    hello: &Hello,
    auth: &LinkAuth,
    deadline: Instant,
    per_route: Duration,
) -> std::result::Result<(LinkStream, Route), (PlaitError, bool)> {
    if candidates.is_empty() {
        return Err((PlaitError::Rendezvous(format!(
            "no usable route to rank {} ({}): none of its addresses {:?} is reachable from this host's interfaces (check PLAIT_IFACE)",
            info.rank,
            info.host,
            info.addrs.iter().map(|a| a.ip.to_string()).collect::<Vec<_>>()
        )), false));
    }
    let mut errors = Vec::new();
    let mut answered = false;
    for (i, route) in candidates.iter().enumerate() {
        let last = i + 1 == candidates.len();
        let limit = if last { per_route } else { per_route.min(Duration::from_secs(5)) };
        let d = Instant::now().checked_add(limit).map_or(deadline, |t| t.min(deadline));
        match connect(route, info.port, hello, auth, d) {
            Ok(s) => {
                let mut route = route.clone();
                if !errors.is_empty() {
                    route.reason = format!("{} (after {} failed)", route.reason, errors.join("; "));
                }
                return Ok((s, route));
            }
            Err(e @ PlaitError::Aborted { .. }) => return Err((e, false)),
            Err(e) => {
                answered |= matches!(&e, PlaitError::Peer { op, .. } if op == HANDSHAKE_OP);
                tracing::warn!(peer = info.rank, route = %route.peer_ip, "route failed, trying the next: {e}");
                errors.push(format!("{} -> {}: {e}", route.local.ip, route.peer_ip));
            }
        }
        if Instant::now() >= deadline {
            break;
        }
    }
    Err((PlaitError::Rendezvous(format!("could not connect to rank {} ({}): {}", info.rank, info.host, errors.join("; "))), answered))
}

/// The round trip of every link: a ping that the peer's receiver thread answers at once (see
/// `PING_TAG`). The best of a few.
fn probe(session: &Arc<Session>, deadline: Instant) -> Result<Vec<(usize, Duration)>> {
    const ROUNDS: usize = 3;
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let mut word = [0u8; 8];
    let buf = RawBuf::of(&mut word);
    let mut rtts = Vec::new();
    for p in session.direct_peers() {
        let mut best = Duration::MAX;
        for _ in 0..ROUNDS {
            let t0 = Instant::now();
            p2p::send_p2p(session, p, PING_TAG, DType::U8, buf, left(), "start-up ping".into())?;
            p2p::recv_p2p(session, Some(p), PONG_TAG, DType::U8, buf, left(), "start-up ping".into())?;
            best = best.min(t0.elapsed());
        }
        rtts.push((p, best));
    }
    Ok(rtts)
}

/// Records each link's round trip and raises its socket buffers to the bandwidth-delay product
/// where the interface's speed is known. An interface of unknown speed (loopback, virtual, or a
/// system that does not say) keeps the system's buffer autotuning.
fn size_buffers(session: &Session, addrs: &[IfaceAddr], routes: &mut [LinkRecord], rtts: &[(usize, Duration)]) {
    let (send, recv) = crate::net::tuning::stream_buffer_limits();
    for &(peer, rtt) in rtts {
        let Some(r) = routes.iter_mut().find(|r| r.peer == peer) else { continue };
        r.rtt_us = Some(rtt.as_secs_f64() * 1e6);
        (r.send_buffer, r.recv_buffer) = (send.map(|b| b as u64), recv.map(|b| b as u64));
        let speed = addrs.iter().find(|a| a.name == r.local_iface).and_then(|a| a.speed_mbps);
        r.iface_bytes_per_s = speed.map(|mbps| mbps as f64 * 1e6 / 8.0);
        if let Some(mbps) = speed {
            let bdp = (mbps as f64 * 1e6 / 8.0 * rtt.as_secs_f64()) as usize;
            if let Some(size) = session.link(peer).fit_buffers_to_bdp(bdp) {
                tracing::info!(peer, bdp, size, "socket buffers raised to the link's bandwidth-delay product");
                (r.send_buffer, r.recv_buffer) = (Some(size as u64), Some(size as u64));
            }
        }
    }
}

/// The rate into this rank of its links to `peers`, into their records (`measure`).
fn measure_links(session: &Arc<Session>, peers: &[usize], rtts: &[(usize, Duration)], routes: &mut [LinkRecord], deadline: Instant, tag: u64) -> Result<()> {
    let t0 = Instant::now();
    for (peer, rate) in measure::measure_bandwidth(session, peers, rtts, deadline, tag)? {
        if let Some(r) = routes.iter_mut().find(|r| r.peer == peer) {
            r.rx_bytes_per_s = rate;
        }
    }
    tracing::info!("rank {}: links measured in {:.0} ms", session.rank, t0.elapsed().as_secs_f64() * 1e3);
    Ok(())
}

/// Opens the connections `grow` adds to this rank's links (`measure::lanes_wanted`): the rank
/// that connected a link connects its new lanes over the same route, the other accepts them.
/// All of this rank's connects come first, so no two ranks wait on each other.
fn add_lanes(
    plan: &Plan,
    session: &Session,
    listener: Option<&Listener>,
    infos: &[PeerInfo],
    dialed: &[(usize, Route)],
    grow: &[(usize, usize, usize)],
    routes: &mut [LinkRecord],
) -> Result<()> {
    let rank = plan.cfg.rank;
    let mine: Vec<(usize, usize)> = grow
        .iter()
        .filter_map(|&(i, j, lanes)| match rank {
            r if r == i => Some((j, lanes)),
            r if r == j => Some((i, lanes)),
            _ => None,
        })
        .collect();
    let (connects, accepts): (Vec<_>, Vec<_>) = mine.into_iter().partition(|&(peer, _)| peer < rank);
    for (peer, lanes) in connects.into_iter().chain(accepts) {
        let record = routes.iter_mut().find(|r| r.peer == peer).expect("a record for every link");
        let (now, lanes_u8) = (record.streams as u8, lanes.min(MAX_STREAMS) as u8);
        let mut streams = Vec::with_capacity(lanes - record.streams);
        if peer < rank {
            let route = &dialed.iter().find(|d| d.0 == peer).expect("a link grows only if connected this epoch").1;
            for lane in now..lanes_u8 {
                let hello = Hello { to: peer as u32, lane, lanes: lanes_u8, ..plan.hello.clone() };
                streams.push(connect(route, infos[peer].port, &hello, &plan.auth, plan.deadline)?);
            }
        } else {
            let listener = listener.expect("a rank with peers listens");
            for lane in now..lanes_u8 {
                streams.push(listener.accept_lane(peer as u32, lane, plan.deadline)?);
            }
        }
        session.add_lanes(peer, streams).map_err(|e| {
            PlaitError::Rendezvous(format!("could not start the connections added to rank {} ({}): {e}", peer, infos[peer].host))
        })?;
        tracing::info!(peer, from = now, to = lanes, "connections added: one could not fill the link");
        record.streams = lanes;
    }
    Ok(())
}

/// Every rank's link records, in rank order: everyone shares its own, so every rank derives the
/// same topology. `round` names the sharing (records are shared again after connections were
/// added to links).
fn share_links(plan: &Plan, round: &str, routes: &mut [LinkRecord]) -> Result<Vec<Vec<LinkRecord>>> {
    let rank = plan.cfg.rank;
    routes.sort_by_key(|r| r.peer);
    plan.publish(&format!("{round}/{rank}"), &serde_json::to_vec(&routes).unwrap())?;
    let mut all = Vec::with_capacity(plan.cfg.size);
    for r in 0..plan.cfg.size {
        if r == rank {
            // As the others read them: a float does not always come back from JSON to the same
            // bit, and every rank must derive the ring order from identical numbers.
            all.push(serde_json::from_slice(&serde_json::to_vec(&routes).unwrap()).expect("records read back"));
            continue;
        }
        let raw = plan.store.get(&format!("{}/{round}/{r}", plan.prefix), plan.left())?;
        let theirs = serde_json::from_slice(&raw)
            .map_err(|e| PlaitError::Rendezvous(format!("rank {r} published unreadable link records: {e}")))?;
        all.push(theirs);
    }
    Ok(all)
}
