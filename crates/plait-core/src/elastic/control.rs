//! The control plane of one member of an elastic group: control links to every other member,
//! heartbeats and suspicion, the view agreement (`agree`) driven over the links, joiners waiting
//! for an update point, and the bootstrap records of each epoch (the store its mesh is built
//! from, replicated to every member, so no process holds it alone).
//!
//! One driver thread owns every decision: link readers and callers hand it events, and a tick
//! (an eighth of the heartbeat timeout) sends heartbeats, names silent members and moves stalled
//! proposals on. Callers read the state under its lock and wait on its condition variable.

use super::agree::{Member, MemberId, Msg, View, WITNESS};
use super::link::{Ctl, CtlLink};
use crate::error::{PlaitError, Result};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a member's control plane is told at start.
#[derive(Clone)]
pub(crate) struct ControlConfig {
    pub group: String,
    pub token: Option<Vec<u8>>,
    /// A member silent this long is suspected (`PLAIT_HEARTBEAT_TIMEOUT`).
    pub heartbeat_timeout: Duration,
    /// How long a handshake or a dial may take.
    pub connect_timeout: Duration,
}

/// What an epoch's outcome was, for the operations of the epoch before it, and its members.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Decision {
    pub done: u64,
    pub forced: bool,
    pub members: Vec<MemberId>,
}

enum Event {
    /// A link is up; `dialer` is the end that connected (of two links between the same pair, the
    /// one the larger id dialled is kept, on both ends).
    Linked { id: MemberId, link: Arc<CtlLink>, joiner: Option<String>, dialer: MemberId },
    Message(MemberId, Ctl),
    Down { id: MemberId, link: Arc<CtlLink>, why: String },
    Suspect { epoch: u64, who: MemberId, why: String },
    /// An update point found joiners waiting: the leader proposes a change that is not forced.
    Admit { epoch: u64 },
    /// Something failed with no one to blame (a bootstrap that timed out): a forced change.
    Change { epoch: u64, why: String },
    /// This member leaves.
    Leave,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Member,
    Joiner,
    Witness,
}

struct State {
    agree: Member,
    /// Set once this process is in a committed view; a joiner before that ignores views
    /// without itself.
    member: bool,
    /// This process is a witness: it only votes.
    witness: bool,
    links: HashMap<MemberId, Arc<CtlLink>>,
    /// Which end dialled each link.
    dialers: HashMap<MemberId, MemberId>,
    /// When this member last dialled each member (and the witness) it had no link to.
    dialed_at: HashMap<MemberId, Instant>,
    /// When the driver last ticked.
    last_tick: Option<Instant>,
    /// Whether this member's proposal under way is forced (a non-forced one waits for every
    /// member it expects: nobody is suspected, so a late promise is no reason to leave one out).
    proposal_forced: bool,
    /// The freeze hook to call once the state lock is released (`run_deferred`), with its
    /// `Freeze`.
    abort_pending: Option<(String, Freeze)>,
    heard: HashMap<MemberId, Instant>,
    said: HashMap<MemberId, Instant>,
    suspects: BTreeMap<MemberId, String>,
    /// Suspicions already passed to the leader.
    told: BTreeSet<MemberId>,
    /// A change is wanted (Some(forced)) though nobody is suspected.
    wanted: Option<bool>,
    /// Members that said they leave (this one too, once `leave` is called).
    leaving: BTreeSet<MemberId>,
    /// Joiners waiting for an update point, with their contacts.
    pending: BTreeMap<MemberId, String>,
    /// Bootstrap records: key -> (epoch, value).
    kv: HashMap<String, (u64, Vec<u8>)>,
    /// This member promised (or accepted) a change: no operation of this epoch completes here.
    frozen: bool,
    /// The freeze hook was told the change under way is forced (once per epoch).
    forced_told: bool,
    last_done: u64,
    proposed_at: Option<Instant>,
    trouble_since: Option<Instant>,
    /// Decisions of the epochs this member committed, by epoch.
    decisions: BTreeMap<u64, Decision>,
    evicted: Option<String>,
    /// Called when this member freezes its epoch, and again when the change turns out forced:
    /// ends the epoch's operations.
    on_freeze: Option<FreezeHook>,
    closed: bool,
}

/// What the freeze hook is told about the change under way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Freeze {
    /// A change was proposed; whether it is forced (a member lost) is not known yet.
    Proposed,
    /// The change is forced (or this member was left out): the epoch's operations must end.
    Forced,
}

pub(crate) type FreezeHook = Arc<dyn Fn(&str, Freeze) + Send + Sync>;

pub(crate) struct Control {
    pub me: MemberId,
    cfg: ControlConfig,
    contact: String,
    state: Mutex<State>,
    changed: Condvar,
    events: Sender<Event>,
    stop: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn fresh_id() -> MemberId {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).expect("the system's random source");
    u64::from_le_bytes(b) >> 1 // below 2**63: prints the same everywhere (JSON, Python ints)
}

/// The address others should dial for a control plane bound to `bound`.
fn contact_for(bound: SocketAddr) -> String {
    if !bound.ip().is_unspecified() {
        return bound.to_string();
    }
    let ip = crate::net::iface::list_interfaces()
        .into_iter()
        .map(|a| a.ip)
        .find(|ip| ip.is_ipv4() && !ip.is_loopback())
        .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
    SocketAddr::new(ip, bound.port()).to_string()
}

impl Control {
    /// Founds a group: this process is its only member, in epoch 0; `witness`: the address of
    /// the group's witness, if it has one (every later view carries it).
    pub fn found(cfg: ControlConfig, listen: &str, witness: Option<String>) -> Result<Arc<Control>> {
        let listener = bind(listen)?;
        let me = fresh_id();
        let contact = contact_for(listener.local_addr()?);
        let view = View::founded(me, contact.clone(), witness);
        let control = Control::start(cfg, me, contact, view, Role::Member, listener)?;
        control.link_witness();
        Ok(control)
    }

    /// A witness: it votes in every view change of `cfg.group` as one more acceptor, and holds
    /// nothing else (`plait witness`).
    pub fn witness(cfg: ControlConfig, listen: &str) -> Result<Arc<Control>> {
        let listener = bind(listen)?;
        let contact = contact_for(listener.local_addr()?);
        let nobody = View { epoch: 0, members: Vec::new(), done: 0, forced: false, contacts: BTreeMap::new(), witness: Some(contact.clone()) };
        Control::start(cfg, WITNESS, contact, nobody, Role::Witness, listener)
    }

    /// Joins the group that a member at one of `peers` belongs to: returns once a view with
    /// this process in it is committed (at the members' next update point), or fails by
    /// `deadline`.
    /// Joins through `peers`, dialled until `dial_until`; admission is awaited until `deadline`.
    pub fn join(cfg: ControlConfig, listen: &str, peers: &[String], dial_until: Instant, deadline: Instant) -> Result<Arc<Control>> {
        let listener = bind(listen)?;
        let me = fresh_id();
        let port = listener.local_addr()?.port();
        let contact = contact_for(listener.local_addr()?);
        let nobody = View { epoch: 0, members: Vec::new(), done: 0, forced: false, contacts: BTreeMap::new(), witness: None };
        let control = Control::start(cfg.clone(), me, contact, nobody, Role::Joiner, listener)?;
        // Members come and go: every address is tried in turn until one answers or the
        // deadline passes. A refusal (another token or group) ends it at once.
        let mut why: Vec<String> = Vec::new();
        let linked = 'dial: loop {
            for peer in peers {
                // Each address of a name in turn: one of them may be a process that is not (or no
                // longer) a member, or this joiner itself, and the members are behind the others.
                let addrs: Vec<String> = match peer.to_socket_addrs() {
                    Ok(a) => a.map(|a| a.to_string()).collect(),
                    Err(e) => {
                        why.retain(|w| !w.starts_with(&format!("{peer}:")));
                        why.push(format!("{peer}: cannot resolve it: {e}"));
                        continue;
                    }
                };
                for addr in &addrs {
                    match control.dial_join(addr, port) {
                        Ok(()) => break 'dial true,
                        Err(e @ PlaitError::Config(_)) => {
                            control.close();
                            return Err(e);
                        }
                        Err(e) => {
                            let at = if addr == peer { peer.clone() } else { format!("{peer} ({addr})") };
                            why.retain(|w| !w.starts_with(&format!("{at}:")));
                            why.push(format!("{at}: {e}"));
                        }
                    }
                    if Instant::now() >= dial_until {
                        break;
                    }
                }
            }
            if Instant::now() + Duration::from_millis(100) >= dial_until {
                break false;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if !linked {
            control.close();
            return Err(PlaitError::Rendezvous(format!("no member of group '{}' answered: {}", cfg.group, why.join("; "))));
        }
        let waiting_since = Instant::now();
        let mut st = control.state.lock();
        while !st.member {
            if let Some(e) = &st.evicted {
                let e = e.clone();
                drop(st);
                control.close();
                return Err(PlaitError::Rendezvous(e));
            }
            if control.changed.wait_until(&mut st, deadline).timed_out() {
                drop(st);
                control.close();
                return Err(PlaitError::Timeout {
                    op: "join".into(),
                    waiting_on: format!("the members of group '{}' to admit this process at their next update point (do they call update()?)", cfg.group),
                    waited: waiting_since.elapsed(),
                });
            }
        }
        drop(st);
        Ok(control)
    }

    fn start(cfg: ControlConfig, me: MemberId, contact: String, view: View, role: Role, listener: TcpListener) -> Result<Arc<Control>> {
        let member = role == Role::Member;
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut decisions = BTreeMap::new();
        if member {
            decisions.insert(view.epoch, Decision { done: 0, forced: false, members: view.members.clone() });
        }
        let state = State {
            agree: Member::new(me, view),
            member,
            witness: role == Role::Witness,
            links: HashMap::new(),
            dialers: HashMap::new(),
            dialed_at: HashMap::new(),
            abort_pending: None,
            last_tick: None,
            proposal_forced: false,
            heard: HashMap::new(),
            said: HashMap::new(),
            suspects: BTreeMap::new(),
            told: BTreeSet::new(),
            wanted: None,
            leaving: BTreeSet::new(),
            pending: BTreeMap::new(),
            kv: HashMap::new(),
            frozen: false,
            forced_told: false,
            last_done: 0,
            proposed_at: None,
            trouble_since: None,
            decisions,
            evicted: None,
            on_freeze: None,
            closed: false,
        };
        let control = Arc::new(Control {
            me,
            cfg,
            contact,
            state: Mutex::new(state),
            changed: Condvar::new(),
            events: tx,
            stop: Arc::new(AtomicBool::new(false)),
            threads: Mutex::new(Vec::new()),
        });
        listener.set_nonblocking(true)?;
        let c = control.clone();
        let accept = std::thread::Builder::new().name("plait-ctl-accept".into()).spawn(move || c.accept_loop(listener))?;
        let c = control.clone();
        let driver = std::thread::Builder::new().name("plait-ctl".into()).spawn(move || c.drive(rx))?;
        control.threads.lock().extend([accept, driver]);
        Ok(control)
    }

    pub fn heartbeat_timeout(&self) -> Duration {
        self.cfg.heartbeat_timeout
    }

    pub fn contact(&self) -> &str {
        &self.contact
    }

    pub fn view(&self) -> View {
        self.state.lock().agree.view.clone()
    }

    /// Joiners this member knows of (a local answer; the update point asks everyone).
    pub fn pending(&self) -> usize {
        self.state.lock().pending.len()
    }

    pub fn set_on_freeze(&self, f: Option<FreezeHook>) {
        self.state.lock().on_freeze = f;
    }

    /// Calls the freeze hook if the last event froze this epoch: outside the state lock, since
    /// aborting a mesh may wait on its sockets (up to a second for a stopped peer).
    fn run_deferred(&self) {
        let (hook, why) = {
            let mut st = self.state.lock();
            match st.abort_pending.take() {
                Some(pending) => (st.on_freeze.clone(), pending),
                None => return,
            }
        };
        if let Some(f) = hook {
            f(&why.0, why.1);
        }
    }

    /// Operation `seq` of `epoch` completed here; false if the epoch is frozen (then it does
    /// not count: the view change decides it).
    pub fn complete(&self, epoch: u64, seq: u64) -> bool {
        let mut st = self.state.lock();
        if st.agree.view.epoch != epoch || st.frozen || st.evicted.is_some() {
            return false;
        }
        st.last_done = seq;
        true
    }

    /// The first epoch this member was in (a joiner's admission), while still recorded: its
    /// operations are numbered from there, even if the group has moved on since.
    pub fn first_epoch(&self) -> u64 {
        let st = self.state.lock();
        st.decisions.keys().next().copied().unwrap_or(st.agree.view.epoch)
    }

    /// The decision of epoch `epoch` (about the operations of `epoch - 1`), once committed.
    pub fn decision(&self, epoch: u64) -> Option<Decision> {
        self.state.lock().decisions.get(&epoch).cloned()
    }

    /// Whether the group has moved past `epoch`, or is moving (this member froze it).
    pub fn moved_past(&self, epoch: u64) -> bool {
        let st = self.state.lock();
        st.agree.view.epoch != epoch || st.frozen || st.evicted.is_some()
    }

    pub fn evicted(&self) -> Option<String> {
        self.state.lock().evicted.clone()
    }

    /// Whether this member left (`leave`) or was closed.
    pub fn is_closed(&self) -> bool {
        self.state.lock().closed
    }

    pub fn suspect(&self, epoch: u64, who: MemberId, why: String) {
        let _ = self.events.send(Event::Suspect { epoch, who, why });
    }

    pub fn want_change(&self, epoch: u64, why: String) {
        let _ = self.events.send(Event::Change { epoch, why });
    }

    pub fn admit(&self, epoch: u64) {
        let _ = self.events.send(Event::Admit { epoch });
    }

    /// Waits until a view after `epoch` is committed here; returns it. Fails if this member is
    /// evicted, or by `deadline` (no majority reachable).
    pub fn wait_past(&self, epoch: u64, deadline: Instant) -> Result<View> {
        let start = Instant::now();
        let mut st = self.state.lock();
        loop {
            if let Some(e) = &st.evicted {
                return Err(PlaitError::Evicted(e.clone()));
            }
            if st.closed {
                return Err(PlaitError::Broken("the elastic communicator was closed".into()));
            }
            if st.agree.view.epoch > epoch {
                return Ok(st.agree.view.clone());
            }
            if self.changed.wait_until(&mut st, deadline).timed_out() {
                let silent: Vec<String> = st.suspects.iter().map(|(m, why)| format!("member {m:x} ({why})")).collect();
                return Err(PlaitError::Timeout {
                    op: "view change".into(),
                    waiting_on: format!(
                        "a majority of epoch {epoch}'s {} members to agree on the next view; unreachable: {}",
                        st.agree.view.members.len(),
                        if silent.is_empty() { "none known".into() } else { silent.join(", ") }
                    ),
                    waited: start.elapsed(),
                });
            }
        }
    }

    /// Sets a bootstrap record of `epoch` here and on every member.
    pub fn kv_set(&self, epoch: u64, key: &str, value: &[u8]) {
        let links: Vec<Arc<CtlLink>> = {
            let mut st = self.state.lock();
            st.kv.insert(key.to_string(), (epoch, value.to_vec()));
            self.changed.notify_all();
            st.links.values().cloned().collect()
        };
        let msg = Ctl::Kv { epoch, key: key.to_string(), value: value.to_vec() };
        for l in links {
            let _ = l.send(&msg); // a failed link is named by its reader
        }
    }

    /// A bootstrap record of `epoch`; fails at once if the group moves past `epoch`.
    pub fn kv_get(&self, epoch: u64, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock();
        loop {
            if let Some((e, v)) = st.kv.get(key) {
                if *e == epoch {
                    return Ok(v.clone());
                }
            }
            if st.agree.view.epoch != epoch || st.frozen || st.evicted.is_some() || st.closed {
                return Err(PlaitError::Rendezvous(format!("the group moved past epoch {epoch} while its mesh was being built")));
            }
            if self.changed.wait_until(&mut st, deadline).timed_out() {
                return Err(PlaitError::Timeout { op: "elastic bootstrap".into(), waiting_on: format!("record {key} of epoch {epoch}"), waited: timeout });
            }
        }
    }

    /// Leaves the group: this member asks for a view without itself and votes for it, waiting
    /// until `deadline` at most (without a majority alive the others learn it from its closed
    /// links instead). Then `close`.
    pub fn leave(&self, deadline: Instant) {
        let solo = {
            let st = self.state.lock();
            !st.member || st.closed || st.evicted.is_some() || st.agree.view.members.len() <= 1
        };
        if !solo {
            let _ = self.events.send(Event::Leave);
            let mut st = self.state.lock();
            while st.evicted.is_none() && !st.closed {
                if self.changed.wait_until(&mut st, deadline).timed_out() {
                    break;
                }
            }
        }
        self.close();
    }

    /// Stops the control plane: links closed (the other members see this member go), threads
    /// joined.
    pub fn close(&self) {
        {
            let mut st = self.state.lock();
            if st.closed {
                return;
            }
            st.closed = true;
            st.on_freeze = None;
            for l in st.links.values() {
                l.shutdown();
            }
            self.changed.notify_all();
        }
        self.stop.store(true, Ordering::SeqCst);
        let threads: Vec<JoinHandle<()>> = self.threads.lock().drain(..).collect();
        for t in threads {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }

    // ---- links -------------------------------------------------------------------------

    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        while !self.stop.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((s, _)) => {
                    let c = self.clone();
                    let _ = std::thread::Builder::new().name("plait-ctl-hello".into()).spawn(move || c.greet(s));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(10)),
                Err(e) => {
                    tracing::warn!("elastic: accepting a control link failed: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// An accepted connection: handshake, then its first message says who it is.
    fn greet(self: Arc<Self>, s: TcpStream) {
        let _ = s.set_nonblocking(false);
        let link = match CtlLink::establish(s, &self.cfg.group, self.cfg.token.as_deref(), false, self.cfg.connect_timeout) {
            Ok(l) => Arc::new(l),
            Err(e) => {
                tracing::warn!("elastic: a control connection failed its handshake: {e}");
                return;
            }
        };
        let first = link.recv();
        let (id, joiner) = match first {
            Ok(Ctl::Hello { id, group, .. }) if group == self.cfg.group => (id, None),
            Ok(Ctl::Join { id, group, port, .. }) if group == self.cfg.group => {
                let ip = link.peer_addr.map(|a| a.ip().to_string()).unwrap_or_else(|| "127.0.0.1".into());
                let contact = if ip.contains(':') { format!("[{ip}]:{port}") } else { format!("{ip}:{port}") };
                (id, Some(contact))
            }
            Ok(Ctl::Hello { group, .. }) | Ok(Ctl::Join { group, .. }) => {
                let _ = link.send(&Ctl::Refused { why: format!("this member belongs to group '{}', not '{group}'", self.cfg.group) });
                return;
            }
            _ => return,
        };
        let (epoch, member) = {
            let st = self.state.lock();
            (st.agree.view.epoch, st.member && st.evicted.is_none() && !st.closed)
        };
        if joiner.is_some() && !member {
            // Left out, leaving, or not admitted itself: the joiner must ask another member.
            let _ = link.send(&Ctl::NotMember);
            return;
        }
        if link.send(&Ctl::Hello { id: self.me, group: self.cfg.group.clone(), contact: self.contact.clone(), epoch }).is_err() {
            return;
        }
        let _ = self.events.send(Event::Linked { id, link, joiner, dialer: id });
    }

    /// Dials member `id` at `contact`. `suspect_if_not`: the link to it just closed; if it cannot
    /// be reached again, it is suspected (a crash: refused at once), otherwise the new link
    /// replaces the old one (a reset on a live member).
    fn dial(self: &Arc<Self>, id: MemberId, contact: String, suspect_if_not: Option<String>) {
        let c = self.clone();
        let _ = std::thread::Builder::new().name("plait-ctl-dial".into()).spawn(move || {
            let epoch = c.state.lock().agree.view.epoch;
            let hello = Ctl::Hello { id: c.me, group: c.cfg.group.clone(), contact: c.contact.clone(), epoch };
            match c.connect(&contact, &hello) {
                Ok((their, link)) if their == id => {
                    let _ = c.events.send(Event::Linked { id, link, joiner: None, dialer: c.me });
                    return;
                }
                Ok((their, _)) => tracing::warn!("elastic: {contact} answered as member {their:x}, not {id:x}"),
                Err(e) => tracing::info!("elastic: cannot reach member {id:x} at {contact}: {e}"),
            }
            if let Some(why) = suspect_if_not {
                let _ = c.events.send(Event::Suspect { epoch, who: id, why });
            }
        });
    }

    /// Dials the group's witness, if it has one and no link to it is open.
    fn link_witness(self: &Arc<Self>) {
        let addr = {
            let st = self.state.lock();
            if st.links.contains_key(&WITNESS) {
                return;
            }
            st.agree.view.witness.clone()
        };
        if let Some(addr) = addr {
            self.dial(WITNESS, addr, None);
        }
    }

    fn connect(&self, contact: &str, first: &Ctl) -> Result<(MemberId, Arc<CtlLink>)> {
        let s = self.connect_any(contact)?;
        // A handshake that fails on what it read (another token, another group) is a refusal;
        // a connection that ends is a member going away.
        let failed = |e: std::io::Error| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                PlaitError::Config(format!("{contact} refused this process: {e}"))
            } else {
                PlaitError::Rendezvous(format!("{contact}: {e}"))
            }
        };
        let link = CtlLink::establish(s, &self.cfg.group, self.cfg.token.as_deref(), true, self.cfg.connect_timeout).map_err(failed)?;
        link.send(first).map_err(failed)?;
        match link.recv().map_err(failed)? {
            Ctl::Hello { id, .. } => Ok((id, Arc::new(link))),
            Ctl::Refused { why } => Err(PlaitError::Config(format!("{contact} refused this process: {why}"))),
            Ctl::NotMember => Err(PlaitError::Rendezvous(format!("{contact} is no longer a member of the group"))),
            other => Err(PlaitError::Rendezvous(format!("{contact} answered {other:?}"))),
        }
    }

    fn connect_any(&self, contact: &str) -> Result<TcpStream> {
        let addrs: Vec<SocketAddr> =
            contact.to_socket_addrs().map_err(|e| PlaitError::Rendezvous(format!("cannot resolve {contact}: {e}")))?.collect();
        connect_first(contact, &addrs, self.cfg.connect_timeout)
    }

    fn dial_join(self: &Arc<Self>, peer: &str, port: u16) -> Result<()> {
        let join = Ctl::Join { id: self.me, group: self.cfg.group.clone(), port };
        let (id, link) = self.connect(peer, &join)?;
        let _ = self.events.send(Event::Linked { id, link, joiner: None, dialer: self.me });
        Ok(())
    }

    fn read_loop(self: Arc<Self>, id: MemberId, link: Arc<CtlLink>) {
        loop {
            match link.recv() {
                Ok(msg) => {
                    if self.events.send(Event::Message(id, msg)).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = self.events.send(Event::Down { id, link, why: e.to_string() });
                    return;
                }
            }
        }
    }

    // ---- the driver ----------------------------------------------------------------------

    fn tick(&self) -> Duration {
        (self.cfg.heartbeat_timeout / 8).max(Duration::from_millis(5))
    }

    fn drive(self: Arc<Self>, rx: Receiver<Event>) {
        let tick = self.tick();
        let mut next_tick = Instant::now() + tick;
        while !self.stop.load(Ordering::SeqCst) {
            match rx.recv_deadline(next_tick) {
                Ok(ev) => self.handle(ev),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                Err(_) => return,
            }
            self.run_deferred();
            if Instant::now() >= next_tick {
                self.on_tick();
                self.run_deferred();
                next_tick = Instant::now() + tick;
            }
        }
    }

    fn handle(self: &Arc<Self>, ev: Event) {
        let mut st = self.state.lock();
        if st.closed {
            return;
        }
        match ev {
            Event::Linked { id, link, joiner, dialer } => {
                let winner = id.max(self.me);
                if let Some(old) = st.links.get(&id) {
                    if st.dialers.get(&id) == Some(&winner) && dialer != winner {
                        link.shutdown(); // the pair's other end keeps the older link too
                        return;
                    }
                    old.shutdown();
                }
                st.links.insert(id, link.clone());
                st.dialers.insert(id, dialer);
                let _ = link.set_timeouts(None, self.cfg.heartbeat_timeout);
                let now = Instant::now();
                st.heard.insert(id, now);
                if id == WITNESS && st.member {
                    // The witness learns the group's view from its members.
                    let _ = link.send(&Ctl::Agree(Msg::Commit { view: st.agree.view.clone() }));
                }
                if let Some(contact) = joiner {
                    st.pending.insert(id, contact.clone());
                    let msg = Ctl::Pending { id, contact };
                    for (m, l) in &st.links {
                        if *m != id {
                            let _ = l.send(&msg);
                        }
                    }
                    self.changed.notify_all();
                }
                // A member linked late gets this epoch's records it may have missed.
                let epoch = st.agree.view.epoch;
                for (key, (e, value)) in &st.kv {
                    if *e >= epoch {
                        let _ = link.send(&Ctl::Kv { epoch: *e, key: key.clone(), value: value.clone() });
                    }
                }
                let c = self.clone();
                let reader = std::thread::Builder::new().name("plait-ctl-read".into()).spawn(move || c.read_loop(id, link));
                if let Ok(t) = reader {
                    let mut threads = self.threads.lock();
                    threads.retain(|t| !t.is_finished());
                    threads.push(t);
                }
            }
            Event::Down { id, link, why } => {
                if st.links.get(&id).is_some_and(|l| Arc::ptr_eq(l, &link)) {
                    st.links.remove(&id);
                    st.dialers.remove(&id);
                    if st.agree.view.members.contains(&id) && st.member {
                        // A crashed member refuses the new connection at once (then it is
                        // suspected); a live one whose link was reset is linked again.
                        if let Some(contact) = st.agree.view.contacts.get(&id).cloned() {
                            self.dial(id, contact, Some(format!("its control link closed ({why}) and it cannot be reached again")));
                        } else {
                            st.suspects.entry(id).or_insert_with(|| format!("its control link closed: {why}"));
                        }
                    } else if st.pending.remove(&id).is_some() {
                        // A joiner that went away: nobody should admit it any more.
                        let ids: Vec<MemberId> = st.links.keys().copied().collect();
                        for m in ids {
                            self.send(&mut st, m, Ctl::Withdrawn { id });
                        }
                    }
                }
            }
            Event::Message(from, msg) => {
                st.heard.insert(from, Instant::now());
                if st.suspects.remove(&from).is_some() {
                    // Alive after all (a healed partition, a slow moment): a proposal under way
                    // waits for it too, rather than leave it out.
                    st.told.remove(&from);
                    st.agree.expect(from);
                }
                self.on_message(&mut st, from, msg);
            }
            Event::Suspect { epoch, who, why } => {
                if epoch == st.agree.view.epoch && st.agree.view.members.contains(&who) && who != self.me && !st.suspects.contains_key(&who) {
                    tracing::info!("elastic: member {:x} suspects {who:x}: {why}", self.me);
                    st.suspects.insert(who, why);
                }
            }
            Event::Admit { epoch } => {
                if epoch == st.agree.view.epoch && st.wanted.is_none() {
                    st.wanted = Some(false);
                }
            }
            Event::Leave => {
                st.leaving.insert(self.me);
                let ids: Vec<MemberId> = st.links.keys().copied().collect();
                for id in ids {
                    self.send(&mut st, id, Ctl::Leave);
                }
            }
            Event::Change { epoch, why } => {
                if epoch == st.agree.view.epoch {
                    tracing::info!("elastic: a new view is wanted: {why}");
                    st.wanted = Some(true);
                }
            }
        }
        self.maybe_propose(&mut st);
    }

    fn on_message(self: &Arc<Self>, st: &mut State, from: MemberId, msg: Ctl) {
        match msg {
            Ctl::Heartbeat { epoch } => {
                let mine = st.agree.view.epoch;
                // Behind: a member that missed a commit, the witness, or a member that was left
                // out and does not know it yet (it learns so from the view).
                if st.member && epoch < mine && !st.pending.contains_key(&from) {
                    self.send(st, from, Ctl::Agree(Msg::Commit { view: st.agree.view.clone() }));
                } else if epoch > mine && st.member {
                    self.send(st, from, Ctl::Agree(Msg::Behind { epoch: mine }));
                }
            }
            Ctl::Agree(m) => self.agree(st, from, m),
            Ctl::Suspect { epoch, who, why } => {
                if epoch == st.agree.view.epoch && st.agree.view.members.contains(&who) && who != self.me {
                    st.suspects.entry(who).or_insert(format!("member {from:x} lost it: {why}"));
                }
            }
            Ctl::Leave => {
                // The sender leaves (never another member on its word).
                if st.agree.view.members.contains(&from) {
                    st.leaving.insert(from);
                }
            }
            Ctl::Withdrawn { id } => {
                st.pending.remove(&id);
            }
            Ctl::Pending { id, contact } => {
                if !st.agree.view.members.contains(&id) {
                    st.pending.insert(id, contact);
                    self.changed.notify_all();
                }
            }
            Ctl::Kv { epoch, key, value } => {
                // A member: this epoch's records, or the next one's (a member that committed it
                // first). A joiner: any later epoch's, since it learns the epoch that admits it
                // only when that commit reaches it, maybe after the members' records did (they
                // are not sent again); its commit drops those of earlier epochs.
                let joining = !st.member && !st.witness;
                if epoch >= st.agree.view.epoch && (epoch <= st.agree.view.epoch + 1 || joining) {
                    st.kv.insert(key, (epoch, value));
                    self.changed.notify_all();
                }
            }
            Ctl::Hello { .. } | Ctl::Join { .. } | Ctl::Refused { .. } | Ctl::NotMember => {}
        }
    }

    /// Hands `msg` to the agreement (freezing this epoch first if it asks this member to take
    /// part in a change) and sends what it answers; adopts a committed view.
    fn agree(self: &Arc<Self>, st: &mut State, from: MemberId, msg: Msg) {
        let mut queue = vec![(from, msg)];
        while let Some((from, msg)) = queue.pop() {
            if let Msg::Commit { view } = &msg {
                if !st.member && !st.witness && !view.members.contains(&self.me) {
                    continue; // not admitted yet: a view without this joiner says nothing to it
                }
            }
            let next = st.agree.view.epoch + 1;
            if matches!(&msg, Msg::Prepare { epoch, .. } | Msg::Accept { epoch, .. } if *epoch == next) && st.agree.view.members.contains(&from) {
                let forced = matches!(&msg, Msg::Prepare { forced: true, .. }) || matches!(&msg, Msg::Accept { view, .. } if view.forced);
                self.freeze(st, "a member proposes the next view", if forced { Freeze::Forced } else { Freeze::Proposed });
            }
            let before = st.agree.view.epoch;
            let out = st.agree.handle(from, msg);
            for (to, m) in out {
                if to == self.me {
                    queue.push((self.me, m));
                } else {
                    self.send(st, to, Ctl::Agree(m));
                }
            }
            if st.agree.view.epoch != before {
                self.adopted(st);
            }
        }
    }

    fn freeze(&self, st: &mut State, why: &str, kind: Freeze) {
        if !st.member || (st.frozen && (kind == Freeze::Proposed || st.forced_told)) {
            return;
        }
        st.frozen = true;
        st.agree.last_done = st.last_done;
        st.forced_told |= kind == Freeze::Forced;
        st.abort_pending = Some((why.to_string(), kind));
        self.changed.notify_all();
    }

    /// A new view was committed here.
    fn adopted(self: &Arc<Self>, st: &mut State) {
        let view = st.agree.view.clone();
        if st.witness {
            tracing::info!("elastic witness: group '{}' is at epoch {} with {} members", self.cfg.group, view.epoch, view.members.len());
            // Links of members that left the group close.
            st.links.retain(|id, l| {
                let kept = view.members.contains(id);
                if !kept {
                    l.shutdown();
                }
                kept
            });
            return;
        }
        if !view.members.contains(&self.me) {
            if st.member {
                st.evicted = Some(format!(
                    "epoch {} was agreed without it (it was cut off or silent for longer than the heartbeat timeout); join again",
                    view.epoch
                ));
                st.abort_pending = Some(("this member was evicted".into(), Freeze::Forced));
            }
            self.changed.notify_all();
            return;
        }
        tracing::info!("elastic: member {:x} commits epoch {} with {} members (done {}, forced {})", self.me, view.epoch, view.members.len(), view.done, view.forced);
        if view.forced && st.member && !st.forced_told {
            // A member that kept its mesh through the proposal (at an update point, where only
            // a join is proposed without a failure) ends it now.
            st.abort_pending = Some((format!("epoch {} was agreed without a member", view.epoch), Freeze::Forced));
        }
        st.member = true;
        st.frozen = false;
        st.forced_told = false;
        st.last_done = 0;
        st.suspects.clear();
        st.told.clear();
        st.wanted = None;
        st.proposed_at = None;
        st.trouble_since = None;
        st.decisions.insert(view.epoch, Decision { done: view.done, forced: view.forced, members: view.members.clone() });
        // A member's operations lag the group's views by a few epochs at most; thousands is
        // far past that and still a few hundred kilobytes.
        while st.decisions.len() > 4096 {
            st.decisions.pop_first();
        }
        st.pending.retain(|id, _| !view.members.contains(id));
        st.leaving.retain(|id| view.members.contains(id));
        st.kv.retain(|_, (e, _)| *e >= view.epoch);
        let mut keep: BTreeSet<MemberId> = view.members.iter().chain(st.pending.keys()).copied().collect();
        if view.witness.is_some() {
            keep.insert(WITNESS);
        }
        let commit = Ctl::Agree(Msg::Commit { view: view.clone() });
        st.links.retain(|id, l| {
            let kept = keep.contains(id);
            if !kept {
                // A member left out learns so before its link closes (`EvictedError`).
                let _ = l.send(&commit);
                l.shutdown();
            }
            kept
        });
        let State { links, dialers, heard, said, dialed_at, .. } = &mut *st;
        dialers.retain(|id, _| links.contains_key(id));
        dialed_at.retain(|id, _| keep.contains(id));
        heard.retain(|id, _| keep.contains(id));
        said.retain(|id, _| links.contains_key(id));
        let now = Instant::now();
        // A joiner linked to this member learns at once that it is in (it has no other way).
        let joined: Vec<MemberId> = view.members.iter().copied().filter(|m| *m != self.me && st.links.contains_key(m)).collect();
        for m in joined {
            self.send(st, m, Ctl::Agree(Msg::Commit { view: view.clone() }));
        }
        for &m in &view.members {
            st.heard.insert(m, now);
            if m != self.me && !st.links.contains_key(&m) && self.me > m {
                if let Some(contact) = view.contacts.get(&m) {
                    self.dial(m, contact.clone(), None);
                }
            }
        }
        self.changed.notify_all();
    }

    fn send(&self, st: &mut State, to: MemberId, msg: Ctl) {
        let Some(link) = st.links.get(&to).cloned() else { return };
        if let Err(e) = link.send(&msg) {
            st.links.remove(&to);
            link.shutdown();
            if st.agree.view.members.contains(&to) {
                st.suspects.entry(to).or_insert_with(|| format!("a control message to it failed: {e}"));
            }
        } else {
            st.said.insert(to, Instant::now());
        }
    }

    fn on_tick(self: &Arc<Self>) {
        let mut st = self.state.lock();
        if st.closed {
            return;
        }
        let now = Instant::now();
        let hb = self.cfg.heartbeat_timeout;
        if st.last_tick.is_some_and(|t| now - t >= hb / 2) {
            // This member was stalled itself (stopped, swapped out): what it has not read yet
            // is queued, not missing, so nobody is judged silent on this tick.
            let ids: Vec<MemberId> = st.heard.keys().copied().collect();
            for id in ids {
                st.heard.insert(id, now);
            }
        }
        st.last_tick = Some(now);
        let epoch = st.agree.view.epoch;
        let ids: Vec<MemberId> = st.links.keys().copied().collect();
        for id in ids {
            if st.said.get(&id).is_none_or(|t| now - *t >= hb / 4) {
                self.send(&mut st, id, Ctl::Heartbeat { epoch });
            }
        }
        if st.member && st.evicted.is_none() {
            let members = st.agree.view.members.clone();
            for m in members {
                if m == self.me {
                    continue;
                }
                let silent = st.heard.get(&m).map(|t| now - *t).unwrap_or(hb);
                if silent >= hb {
                    st.suspects.entry(m).or_insert_with(|| format!("silent for {silent:.2?} (heartbeat timeout {hb:.2?})"));
                    // Its connection may be stuck in TCP's retransmission backoff (a cut cable):
                    // a fresh one gets through as soon as the path does. The larger id dials.
                    if self.me > m && st.dialed_at.get(&m).is_none_or(|t| now - *t >= hb) {
                        if let Some(contact) = st.agree.view.contacts.get(&m).cloned() {
                            st.dialed_at.insert(m, now);
                            self.dial(m, contact, None);
                        }
                    }
                }
            }
        }
        // A member of the view without a link is dialled again (once per heartbeat timeout): a
        // link lost to a reset or a healed partition comes back, and a member left out without
        // hearing it (its side of a partition had no majority) is told the view by whoever
        // answers, so it learns it was evicted.
        if st.member && st.evicted.is_none() {
            let unlinked: Vec<(MemberId, String)> = st
                .agree
                .view
                .members
                .iter()
                .filter(|m| **m != self.me && !st.links.contains_key(m))
                .filter_map(|m| st.agree.view.contacts.get(m).map(|c| (*m, c.clone())))
                .collect();
            for (m, contact) in unlinked {
                if st.dialed_at.get(&m).is_none_or(|t| now - *t >= hb) {
                    st.dialed_at.insert(m, now);
                    self.dial(m, contact, None);
                }
            }
        }
        if st.member && st.agree.view.witness.is_some() && !st.links.contains_key(&WITNESS)
            && st.dialed_at.get(&WITNESS).is_none_or(|t| now - *t >= hb)
        {
            st.dialed_at.insert(WITNESS, now);
            drop(st);
            self.link_witness();
            st = self.state.lock();
        }
        if st.agree.proposing() && st.proposal_forced && st.proposed_at.is_some_and(|t| now - t >= self.grace()) {
            let out = st.agree.decide();
            self.dispatch(&mut st, out);
        }
        self.maybe_propose(&mut st);
    }

    /// How long a proposer waits for promises beyond a majority.
    fn grace(&self) -> Duration {
        (self.cfg.heartbeat_timeout / 4).max(Duration::from_millis(20))
    }

    fn dispatch(self: &Arc<Self>, st: &mut State, out: Vec<(MemberId, Msg)>) {
        for (to, m) in out {
            if to == self.me {
                self.agree(st, self.me, m);
            } else {
                self.send(st, to, Ctl::Agree(m));
            }
        }
    }

    /// The leader (the oldest member not suspected) proposes when a change is wanted; the others
    /// tell it their suspicions, and take over if nothing is committed for a while.
    fn maybe_propose(self: &Arc<Self>, st: &mut State) {
        if !st.member || st.evicted.is_some() || st.closed {
            return;
        }
        let suspects: BTreeSet<MemberId> = st.suspects.keys().copied().filter(|m| st.agree.view.members.contains(m)).collect();
        if suspects.is_empty() && st.wanted.is_none() && st.leaving.is_empty() {
            return;
        }
        let now = Instant::now();
        let since = *st.trouble_since.get_or_insert(now);
        let alive: Vec<MemberId> = st.agree.view.members.iter().copied().filter(|m| !suspects.contains(m)).collect();
        // A leaving member votes but does not lead, unless nobody else is left to.
        let Some(&leader) = alive.iter().find(|m| !st.leaving.contains(m)).or(alive.first()) else { return };
        let hb = self.cfg.heartbeat_timeout;
        let takeover = now - since >= hb * (1 + alive.iter().position(|&m| m == self.me).unwrap_or(0) as u32);
        let leaving_myself = st.leaving.contains(&self.me);
        if leaving_myself && leader != self.me {
            // A leaver votes; it proposes only when nobody who stays is left to.
            return;
        }
        if leader != self.me && !takeover {
            let epoch = st.agree.view.epoch;
            let untold: Vec<(MemberId, String)> = st.suspects.iter().filter(|(m, _)| !st.told.contains(m)).map(|(m, w)| (*m, w.clone())).collect();
            for (who, why) in untold {
                st.told.insert(who);
                self.send(st, leader, Ctl::Suspect { epoch, who, why });
            }
            return;
        }
        if st.proposed_at.is_some_and(|t| now - t < hb) {
            return; // a proposal of ours is under way
        }
        let forced = !suspects.is_empty() || st.wanted == Some(true) || !st.leaving.is_empty();
        self.freeze(st, "this member proposes the next view", if forced { Freeze::Forced } else { Freeze::Proposed });
        let expect: BTreeSet<MemberId> = alive.into_iter().collect();
        // Joiners come in only at an update point, where no operation is under way: after a
        // failure, the members' next calls are the lost operation's, not the joiner's first.
        let joiners: Vec<(MemberId, String)> = if forced { Vec::new() } else { st.pending.iter().map(|(m, c)| (*m, c.clone())).collect() };
        tracing::info!(
            "elastic: member {:x} proposes epoch {} (suspects {:?}, joiners {}, forced {forced})",
            self.me,
            st.agree.view.epoch + 1,
            st.suspects,
            joiners.len()
        );
        st.proposed_at = Some(now);
        st.proposal_forced = forced;
        let leaving = st.leaving.clone();
        let out = st.agree.propose(expect, joiners, leaving, forced);
        self.dispatch(st, out);
    }
}

/// A name may resolve to several machines (one DNS name for the whole group): each address is
/// tried in turn, and the first that accepts is the one dialled.
fn connect_first(contact: &str, addrs: &[SocketAddr], timeout: Duration) -> Result<TcpStream> {
    let mut failed = Vec::new();
    for addr in addrs {
        match TcpStream::connect_timeout(addr, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => failed.push(format!("{addr}: {e}")),
        }
    }
    Err(PlaitError::Rendezvous(match failed.len() {
        0 => format!("{contact} resolves to no address"),
        1 => format!("cannot connect to {contact} ({})", failed[0]),
        _ => format!("cannot connect to any address of {contact} ({})", failed.join("; ")),
    }))
}

fn bind(listen: &str) -> Result<TcpListener> {
    TcpListener::bind(listen).map_err(|e| PlaitError::Config(format!("elastic: cannot listen on {listen}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_joiner_keeps_the_records_of_the_epoch_that_admits_it_when_they_arrive_before_its_commit() {
        let cfg = ControlConfig { group: "test".into(), token: None, heartbeat_timeout: Duration::from_secs(2), connect_timeout: Duration::from_secs(2) };
        let nobody = View { epoch: 0, members: Vec::new(), done: 0, forced: false, contacts: BTreeMap::new(), witness: None };
        let listener = bind("127.0.0.1:0").unwrap();
        let contact = contact_for(listener.local_addr().unwrap());
        let joiner = Control::start(cfg.clone(), fresh_id(), contact, nobody, Role::Joiner, listener).unwrap();
        joiner.handle(Event::Message(7, Ctl::Kv { epoch: 15, key: "g/15/rank/0".into(), value: b"addr".to_vec() }));
        assert_eq!(joiner.state.lock().kv.get("g/15/rank/0"), Some(&(15, b"addr".to_vec())));
        joiner.close();
        // A member keeps only its epoch's records and the next one's.
        let member = Control::found(cfg, "127.0.0.1:0", None).unwrap();
        member.handle(Event::Message(7, Ctl::Kv { epoch: 15, key: "g/15/rank/0".into(), value: b"addr".to_vec() }));
        member.handle(Event::Message(7, Ctl::Kv { epoch: 1, key: "g/1/rank/0".into(), value: b"addr".to_vec() }));
        let st = member.state.lock();
        assert!(st.kv.get("g/15/rank/0").is_none() && st.kv.get("g/1/rank/0").is_some());
        drop(st);
        member.close();
    }

    #[test]
    fn a_name_with_several_addresses_is_dialled_at_the_first_that_answers() {
        let closed = TcpListener::bind("127.0.0.1:0").unwrap();
        let dead = closed.local_addr().unwrap();
        drop(closed);
        let live = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = connect_first("group.example:1", &[dead, live.local_addr().unwrap()], Duration::from_secs(2)).unwrap();
        assert_eq!(s.peer_addr().unwrap(), live.local_addr().unwrap());
        let e = connect_first("group.example:1", &[dead, dead], Duration::from_secs(2)).unwrap_err().to_string();
        assert!(e.contains("any address of group.example:1") && e.contains(&dead.to_string()), "{e}");
        let e = connect_first("nowhere:1", &[], Duration::from_secs(2)).unwrap_err().to_string();
        assert!(e.contains("nowhere:1 resolves to no address"), "{e}");
    }
}
