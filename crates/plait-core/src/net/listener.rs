//! The listening side of link set-up: an accept thread that screens each incoming connection by
//! its address, waits (without a thread) until it sends something, handshakes it on a
//! short-lived thread of its own and hands accepted streams out by rank and lane.
//!
//! A connection that never sends a hello costs a socket until its hello deadline, nothing more:
//! silent connections are watched by one poller, so any number of them cannot take the handshake
//! threads a real peer needs. A listener opened for a rendezvous (`bind_on` with `screened`)
//! holds connections unread until `admit` names the expected peers, then closes every connection
//! from another address before reading a byte of it.

use super::admission::{remember, Admission, HalfOpen};
use super::bind::{bind_any, bind_each};
use super::auth::{self, LinkAuth, LinkStream, Rejection};
use super::handshake::{check_hello, read_hello, reply, write_reply, Hello, HsFail};
use super::tuning::tune_stream;
use crate::error::PlaitError;
use parking_lot::{Condvar, Mutex};
use polling::{Event, Events, PollMode, Poller};
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an accepted connection may take to send its hello and finish the handshake (the
/// default of `PLAIT_HELLO_TIMEOUT`). A real peer sends its hello as soon as it connects.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshakes in progress at once (threads). Only connections that sent something take one; the
/// others queue, so a flood of slow senders delays real peers by at most their hello deadline.
const MAX_HANDSHAKE_THREADS: usize = 64;
/// Connections waiting for their first byte (or for `admit`). Beyond this the oldest is closed, so
/// a flood costs a bounded number of sockets and a real peer, which sends its hello at once, is
/// not the one evicted.
const MAX_WAITING: usize = 1024;
/// How `read_hello` says its deadline passed (kept apart from resets and refusals).
const NO_HELLO: &str = "no complete hello";

/// Listening sockets (one per bound address, one port) plus an accept thread; see the module doc.
pub struct Listener {
    shared: Arc<Shared>,
    port: u16,
    addrs: Vec<SocketAddr>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    expect: Hello,
    auth: Arc<LinkAuth>,
    hello_timeout: Duration,
    stop: AtomicBool,
    /// Wakes the accept thread: close, admit, a handshake thread ending.
    poller: Poller,
    handshakes: AtomicUsize,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    /// Accepted, not yet taken by accept_lane, by (rank, lane).
    ready: HashMap<(u32, u8), LinkStream>,
    /// Lanes accepted, being replied to, or taken: a second connection claiming one is refused.
    claimed: HashSet<(u32, u8)>,
    /// Lanes whose stream accept_lane already handed out.
    taken: HashSet<(u32, u8)>,
    /// Clones of sockets mid-handshake, shut down on close so their threads exit at once.
    pending: HashMap<u64, TcpStream>,
    next_pending: u64,
    /// Why the last attempt claiming to be rank r was refused, for accept_from's timeout error.
    refused_rank: HashMap<u32, String>,
    last_refusal: Option<String>,
    half_open: HalfOpen,
    admission: Option<Admission>,
    /// `admission` changed since the accept thread last looked.
    admission_changed: bool,
    closed: bool,
}

impl Listener {
    /// Listens on all addresses, ephemeral port, admitting anyone (who proves the keys `auth`
    /// learns they published). `expect.from` is ignored.
    #[cfg(test)]
    pub fn bind(expect: Hello, auth: Arc<LinkAuth>) -> Result<Listener, PlaitError> {
        Listener::bind_with(expect, auth, 0, HANDSHAKE_TIMEOUT)
    }

    /// As `bind`, with an explicit port (0 = ephemeral) and hello deadline.
    #[cfg(test)]
    pub fn bind_with(expect: Hello, auth: Arc<LinkAuth>, port: u16, hello_timeout: Duration) -> Result<Listener, PlaitError> {
        Listener::bind_on(expect, auth, None, port, hello_timeout, false)
    }

    /// Listens on `addrs` (None: every address, dual-stack) at one port (0 = ephemeral). With
    /// `screened`, connections are held unread until `admit` says who may connect. Connectors
    /// must prove the keys `auth` learns they published.
    pub fn bind_on(
        expect: Hello,
        auth: Arc<LinkAuth>,
        addrs: Option<&[IpAddr]>,
        port: u16,
        hello_timeout: Duration,
        screened: bool,
    ) -> Result<Listener, PlaitError> {
        let expect = Hello { mode: auth.mode(), ..expect };
        if expect.to >= expect.world {
            return Err(PlaitError::invalid(format!(
                "listener rank {} out of range for world size {}",
                expect.to, expect.world
            )));
        }
        let sockets = match addrs {
            None => vec![bind_any(port).map_err(|e| PlaitError::Io(format!("cannot listen on port {port}: {e}")))?],
            Some(addrs) => bind_each(addrs, port)?,
        };
        let bound: Vec<SocketAddr> = sockets.iter().filter_map(|s| s.local_addr().ok()).collect();
        let port = bound.first().map(|a| a.port()).ok_or_else(|| PlaitError::Io("no listening socket".into()))?;
        let admission = if screened { Admission::Awaiting } else { Admission::Open };
        let shared = Arc::new(Shared {
            expect,
            auth,
            hello_timeout,
            stop: AtomicBool::new(false),
            poller: Poller::new().map_err(|e| PlaitError::Io(format!("cannot create a poller: {e}")))?,
            handshakes: AtomicUsize::new(0),
            state: Mutex::new(State { admission: Some(admission), ..State::default() }),
            cv: Condvar::new(),
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("plait-accept-{port}"))
            .spawn(move || Acceptor::new(sockets, s2).run())
            .map_err(|e| PlaitError::Io(format!("cannot start accept thread: {e}")))?;
        Ok(Listener { shared, port, addrs: bound, thread: Mutex::new(Some(thread)) })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The addresses listened on (an unspecified address: all of them).
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Only these ranks, each from the addresses it published, may connect from now on; the
    /// connections held so far from other addresses are closed unread. A rank that published no
    /// address (its system would not list them) may connect from anywhere.
    pub fn admit(&self, peers: &[(u32, Vec<IpAddr>)]) {
        let open = peers.iter().any(|(_, addrs)| addrs.is_empty());
        let admission = if open {
            Admission::Open
        } else {
            let any = peers.iter().flat_map(|(_, a)| a.iter().map(|ip| ip.to_canonical())).collect();
            let by_rank = peers.iter().map(|(r, a)| (*r, a.iter().map(|ip| ip.to_canonical()).collect())).collect();
            Admission::Peers { by_rank, any }
        };
        {
            let mut st = self.shared.state.lock();
            st.admission = Some(admission);
            st.admission_changed = true;
        }
        let _ = self.shared.poller.notify();
    }

    /// Waits for the accepted connection from rank `from` (any order of arrival) until `deadline`.
    pub fn accept_from(&self, from: u32, deadline: Instant) -> Result<LinkStream, PlaitError> {
        self.accept_lane(from, 0, deadline)
    }

    /// As `accept_from`, for one of several connections from that rank.
    pub fn accept_lane(&self, from: u32, lane: u8, deadline: Instant) -> Result<LinkStream, PlaitError> {
        let start = Instant::now();
        let e = &self.shared.expect;
        if from <= e.to || from >= e.world {
            return Err(PlaitError::invalid(format!(
                "rank {} accepts only from ranks {}..{}, not {from} (the higher rank connects)",
                e.to,
                e.to + 1,
                e.world
            )));
        }
        let mut st = self.shared.state.lock();
        loop {
            if st.closed {
                return Err(PlaitError::Broken(format!(
                    "listener on port {} closed while waiting for rank {from}",
                    self.port
                )));
            }
            if let Some(s) = st.ready.remove(&(from, lane)) {
                st.taken.insert((from, lane));
                return Ok(s);
            }
            // `claimed` alone may mean "handshake still replying": only a handed-out stream is taken.
            if st.taken.contains(&(from, lane)) {
                return Err(PlaitError::invalid(format!("connection {lane} from rank {from} was already taken")));
            }
            if Instant::now() >= deadline {
                let which = if e.lanes > 1 { format!(" (connection {} of {})", lane + 1, e.lanes) } else { String::new() };
                let mut waiting_on = format!(
                    "rank {from} to connect to rank {}{which} (port {}, group {:?}, epoch {}, world {})",
                    e.to, self.port, e.group, e.epoch, e.world
                );
                if let Some(why) = st.refused_rank.get(&from) {
                    waiting_on.push_str(&format!("; its last attempt was refused: {why}"));
                } else if let Some(why) = &st.last_refusal {
                    waiting_on.push_str(&format!("; last refused connection: {why}"));
                }
                let half_open = st.half_open.describe(self.shared.hello_timeout, MAX_WAITING);
                if !half_open.is_empty() {
                    waiting_on.push_str(&format!("; {half_open}"));
                }
                return Err(PlaitError::Timeout { op: "connect".into(), waiting_on, waited: start.elapsed() });
            }
            self.shared.cv.wait_until(&mut st, deadline);
        }
    }

    /// Stops and joins the accept thread, aborts handshakes in progress and drops connections
    /// not yet taken. Idempotent.
    pub fn close(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let mut st = self.shared.state.lock();
            st.closed = true;
            for (_, s) in st.pending.drain() {
                let _ = s.shutdown(Shutdown::Both);
            }
            st.ready.clear();
        }
        self.shared.auth.stop_waiting();
        self.shared.cv.notify_all();
        let _ = self.shared.poller.notify();
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.close();
    }
}

/// A connection that has not sent anything yet.
struct Waiting {
    stream: TcpStream,
    addr: SocketAddr,
    /// The hello and handshake must be done by then.
    deadline: Instant,
}

/// The accept thread: listening sockets and silent connections in one poller (keys below
/// `listeners.len()` are listening sockets), connections with bytes to read queued for a
/// handshake thread.
struct Acceptor {
    listeners: Vec<TcpListener>,
    shared: Arc<Shared>,
    /// Registered in the poller, by key.
    watched: HashMap<usize, Waiting>,
    /// Accepted before `admit`: not registered, not read.
    held: VecDeque<(usize, Waiting)>,
    /// Readable, waiting for a handshake thread.
    queued: VecDeque<(usize, Waiting)>,
    next_key: usize,
    last_error_log: Option<Instant>,
}

impl Acceptor {
    fn new(listeners: Vec<TcpListener>, shared: Arc<Shared>) -> Acceptor {
        let next_key = listeners.len();
        Acceptor {
            listeners,
            shared,
            watched: HashMap::new(),
            held: VecDeque::new(),
            queued: VecDeque::new(),
            next_key,
            last_error_log: None,
        }
    }

    fn run(mut self) {
        for (key, l) in self.listeners.iter().enumerate() {
            // SAFETY: every listening socket is deleted from the poller before it closes (below).
            if let Err(e) = unsafe { self.shared.poller.add_with_mode(l, Event::readable(key), PollMode::Level) } {
                tracing::warn!("cannot watch listening socket: {e}");
            }
        }
        let mut events = Events::new();
        while !self.shared.stop.load(Ordering::SeqCst) {
            events.clear();
            let timeout = self.next_deadline().map(|d| d.saturating_duration_since(Instant::now()));
            if let Err(e) = self.shared.poller.wait(&mut events, timeout) {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::warn!("listener poll failed: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            for ev in events.iter() {
                if ev.key < self.listeners.len() {
                    self.accept_all(ev.key);
                } else if let Some(w) = self.watched.remove(&ev.key) {
                    let _ = self.shared.poller.delete(&w.stream);
                    self.queued.push_back((ev.key, w));
                }
            }
            self.apply_admission();
            self.expire();
            self.dispatch();
        }
        for l in &self.listeners {
            let _ = self.shared.poller.delete(l);
        }
        for w in self.watched.values() {
            let _ = self.shared.poller.delete(&w.stream);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let watched = self.watched.values().map(|w| w.deadline);
        let queued = self.queued.iter().map(|(_, w)| w.deadline);
        watched.chain(queued).min()
    }

    fn accept_all(&mut self, key: usize) {
        loop {
            match self.listeners[key].accept() {
                Ok((s, addr)) => self.admit_one(s, canonical(addr)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // E.g. EMFILE: keep trying, but do not flood the log (nor spin: the socket
                    // stays readable).
                    if self.last_error_log.is_none_or(|t| t.elapsed() > Duration::from_secs(5)) {
                        tracing::warn!("accept on port {} failed: {e}", self.listeners[key].local_addr().map(|a| a.port()).unwrap_or(0));
                        self.last_error_log = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    return;
                }
            }
        }
    }

    /// A new connection: closed at once from a stranger's address, else held or watched.
    fn admit_one(&mut self, stream: TcpStream, addr: SocketAddr) {
        let awaiting = {
            let mut st = self.shared.state.lock();
            let admission = st.admission.as_ref().expect("set at bind");
            if st.closed {
                return;
            }
            if !admission.allows(addr.ip()) {
                refuse_stranger(&mut st, addr);
                return;
            }
            matches!(admission, Admission::Awaiting)
        };
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        if self.watched.len() + self.held.len() >= MAX_WAITING {
            self.evict_oldest();
        }
        let key = self.next_key;
        self.next_key += 1;
        let w = Waiting { stream, addr, deadline: Instant::now() + self.shared.hello_timeout };
        self.shared.state.lock().half_open.open.insert(key, addr);
        if awaiting {
            self.held.push_back((key, w));
        } else {
            self.watch(key, w);
        }
    }

    fn watch(&mut self, key: usize, w: Waiting) {
        // SAFETY: deleted from the poller before the stream is dropped (`run`, `expire`,
        // `evict_oldest`, or on its event).
        match unsafe { self.shared.poller.add(&w.stream, Event::readable(key)) } {
            Ok(()) => {
                self.watched.insert(key, w);
            }
            // Cannot wait for it: let a handshake thread read it, bounded by its deadline.
            Err(_) => self.queued.push_back((key, w)),
        }
    }

    fn evict_oldest(&mut self) {
        let oldest_watched = self.watched.iter().min_by_key(|(_, w)| w.deadline).map(|(k, _)| *k);
        let victim = match self.held.pop_front() {
            Some((key, w)) => Some((key, w)),
            None => oldest_watched.and_then(|k| self.watched.remove(&k).map(|w| (k, w))),
        };
        if let Some((key, w)) = victim {
            let _ = self.shared.poller.delete(&w.stream);
            let mut st = self.shared.state.lock();
            st.half_open.open.remove(&key);
            st.half_open.evicted += 1;
            remember(&mut st.half_open.recent, w.addr);
        }
    }

    /// After `admit`: held connections from strangers are closed, the others watched, with
    /// their hello deadline counted from now (the wait so far was this rank's).
    fn apply_admission(&mut self) {
        let held: Vec<(usize, Waiting)> = {
            let mut st = self.shared.state.lock();
            if !std::mem::take(&mut st.admission_changed) {
                return;
            }
            let admission = st.admission.take().expect("set at bind");
            let mut keep = Vec::new();
            for (key, w) in self.held.drain(..) {
                if admission.allows(w.addr.ip()) {
                    keep.push((key, w));
                } else {
                    st.half_open.open.remove(&key);
                    refuse_stranger(&mut st, w.addr);
                }
            }
            st.admission = Some(admission);
            keep
        };
        for (key, mut w) in held {
            w.deadline = Instant::now() + self.shared.hello_timeout;
            self.watch(key, w);
        }
    }

    /// Closes connections whose hello deadline passed with nothing to read.
    fn expire(&mut self) {
        let now = Instant::now();
        let late: Vec<usize> = self.watched.iter().filter(|(_, w)| w.deadline <= now).map(|(k, _)| *k).collect();
        let mut late_queued = Vec::new();
        self.queued.retain(|(k, w)| {
            let keep = w.deadline > now;
            if !keep {
                late_queued.push((*k, w.addr));
            }
            keep
        });
        if late.is_empty() && late_queued.is_empty() {
            return;
        }
        let mut st = self.shared.state.lock();
        for key in late {
            let w = self.watched.remove(&key).expect("listed above");
            let _ = self.shared.poller.delete(&w.stream);
            tracing::warn!(remote = %w.addr, "closed a connection that sent no hello within {:?}", self.shared.hello_timeout);
            st.half_open.open.remove(&key);
            st.half_open.timed_out += 1;
            remember(&mut st.half_open.recent, w.addr);
        }
        for (key, addr) in late_queued {
            st.half_open.open.remove(&key);
            st.half_open.timed_out += 1;
            remember(&mut st.half_open.recent, addr);
        }
    }

    /// Starts handshake threads for queued connections while there are free slots; a thread
    /// ending wakes the poller to start the next.
    fn dispatch(&mut self) {
        while self.shared.handshakes.load(Ordering::SeqCst) < MAX_HANDSHAKE_THREADS {
            let Some((key, w)) = self.queued.pop_front() else { return };
            self.shared.state.lock().half_open.open.remove(&key);
            start_handshake(w, &self.shared);
        }
    }
}

fn refuse_stranger(st: &mut State, addr: SocketAddr) {
    tracing::warn!(remote = %addr, "closed a connection from an address no peer published");
    st.half_open.strangers += 1;
    remember(&mut st.half_open.recent_strangers, addr);
}

/// IPv4 peers of a dual-stack socket appear as ::ffff:a.b.c.d; show them as a.b.c.d.
fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(a) => match a.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => addr,
        },
        v4 => v4,
    }
}

fn start_handshake(w: Waiting, shared: &Arc<Shared>) {
    let Waiting { stream: s, addr, deadline } = w;
    // The handshake reads with timeouts on a blocking socket.
    if s.set_nonblocking(false).is_err() {
        return;
    }
    let id = {
        let mut st = shared.state.lock();
        if st.closed {
            return;
        }
        let Ok(clone) = s.try_clone() else { return };
        let id = st.next_pending;
        st.next_pending += 1;
        st.pending.insert(id, clone);
        id
    };
    shared.handshakes.fetch_add(1, Ordering::SeqCst);
    let sh = shared.clone();
    let spawned = std::thread::Builder::new().name("plait-handshake".into()).spawn(move || {
        handshake(s, addr, id, deadline, &sh);
        sh.state.lock().pending.remove(&id);
        sh.handshakes.fetch_sub(1, Ordering::SeqCst);
        let _ = sh.poller.notify();
    });
    if let Err(e) = spawned {
        tracing::warn!(remote = %addr, "dropping connection: cannot start handshake thread: {e}");
        shared.state.lock().pending.remove(&id);
        shared.handshakes.fetch_sub(1, Ordering::SeqCst);
    }
}

fn handshake(mut s: TcpStream, addr: SocketAddr, id: u64, deadline: Instant, shared: &Shared) {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let _ = s.set_write_timeout(Some(left));
    let hello = match read_hello(&mut s, deadline) {
        Ok(h) => h,
        Err(HsFail::Refuse(why)) => return refuse(s, addr, None, why, shared),
        Err(HsFail::Io(why)) => {
            if why.starts_with(NO_HELLO) {
                let mut st = shared.state.lock();
                st.half_open.timed_out += 1;
                remember(&mut st.half_open.recent, addr);
            }
            return give_up(addr, &why, shared);
        }
    };
    let refused = check_hello(&hello, &shared.expect)
        .or_else(|| shared.state.lock().admission.as_ref().and_then(|a| a.refuses(hello.from, addr.ip())));
    if let Some(why) = refused {
        return refuse(s, addr, Some(hello.from), why, shared);
    }
    // The hello deadline is for strangers; a peer that sent a valid hello gets the usual time for
    // the rest of the handshake (a short PLAIT_HELLO_TIMEOUT or a wait for a handshake thread
    // must not drop a link the connector already counts as up).
    let deadline = deadline.max(Instant::now() + HANDSHAKE_TIMEOUT);
    let _ = s.set_write_timeout(Some(HANDSHAKE_TIMEOUT));
    let msg1 = match auth::read_msg(&mut s, deadline) {
        Ok(m) => m,
        Err(e) => return give_up(addr, &format!("no complete handshake message from rank {}: {e}", hello.from), shared),
    };
    let mut responder = match auth::respond(&shared.auth, &hello, &msg1, deadline) {
        Ok(r) => r,
        Err(Rejection::Refuse(why)) => return refuse(s, addr, Some(hello.from), why, shared),
        Err(Rejection::Drop(why)) => return give_up(addr, &why, shared),
    };
    let key = (hello.from, hello.lane);
    {
        let mut st = shared.state.lock();
        if st.closed {
            return;
        }
        if st.claimed.contains(&key) {
            drop(st);
            let why = if hello.lanes > 1 {
                format!("rank {} is already connected on connection {} of {}", hello.from, hello.lane + 1, hello.lanes)
            } else {
                format!("rank {} is already connected", hello.from)
            };
            return refuse(s, addr, Some(hello.from), why, shared);
        }
        // Claim before replying so two concurrent attempts from one rank cannot both succeed.
        st.claimed.insert(key);
    }
    // The link is up only once the connector proved it holds the handshake's final keys.
    let ready = (|| {
        let mut answer = reply(true, "");
        responder.answer(&mut answer)?;
        s.write_all(&answer)?;
        let cipher = responder.confirm(&shared.auth, hello.from, &mut s, deadline)?;
        s.set_read_timeout(None)?;
        s.set_write_timeout(None)?;
        Ok::<_, io::Error>(cipher)
    })();
    if ready.is_ok() {
        if let Err(e) = tune_stream(&s) {
            tracing::warn!(remote = %addr, "cannot tune link socket from rank {}: {e}", hello.from);
        }
    }
    let mut st = shared.state.lock();
    match ready {
        Ok(cipher) if !st.closed => {
            tracing::debug!(remote = %addr, "accepted rank {} as rank {}", hello.from, shared.expect.to);
            // Leave `pending` in the same critical section, or a close() right after the owner
            // took the stream would shut down the owner's link.
            st.pending.remove(&id);
            st.refused_rank.remove(&hello.from);
            st.ready.insert(key, LinkStream { stream: s, cipher });
            drop(st);
            shared.cv.notify_all();
        }
        Ok(_) => {}
        Err(e) => {
            // The peer will see the failure and retry; let it.
            st.claimed.remove(&key);
            let why = format!("handshake with rank {} failed after its hello: {e}", hello.from);
            st.refused_rank.insert(hello.from, why.clone());
            st.last_refusal = Some(format!("{addr}: {why}"));
            drop(st);
            tracing::warn!(remote = %addr, "{why}");
        }
    }
}

/// Closes a connection that got no reply (it failed, or may be retried), keeping why.
fn give_up(addr: SocketAddr, why: &str, shared: &Shared) {
    tracing::warn!(remote = %addr, "handshake failed: {why}");
    shared.state.lock().last_refusal = Some(format!("{addr}: {why}"));
}

fn refuse(mut s: TcpStream, addr: SocketAddr, from: Option<u32>, why: String, shared: &Shared) {
    tracing::warn!(remote = %addr, "refused connection: {why}");
    {
        let mut st = shared.state.lock();
        // Only in-range ranks, so garbage cannot grow the map.
        if let Some(r) = from.filter(|&r| r < shared.expect.world) {
            st.refused_rank.insert(r, why.clone());
        }
        st.last_refusal = Some(format!("{addr}: {why}"));
    }
    // Bytes left unread (the handshake message sent with the hello) would make closing reset the
    // connection, and the peer could lose the reason: take what has arrived first.
    if s.set_nonblocking(true).is_ok() {
        let mut sink = [0u8; 1024];
        for _ in 0..4 {
            if !matches!(s.read(&mut sink), Ok(n) if n > 0) {
                break;
            }
        }
        let _ = s.set_nonblocking(false);
    }
    let _ = write_reply(&mut s, false, &why);
    let _ = s.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::auth::test_world;
    use crate::net::connect::connect;
    use crate::net::handshake::testing::{hello, lo_route, soon};
    use crate::net::handshake::{HELLO_FIXED_LEN, REPLY_MAGIC};
    use std::io::{Read, Write};
    use std::sync::OnceLock;

    /// Keys of an 8-rank test world (every rank knows them all), shared by the tests here.
    fn keys(rank: u32) -> Arc<LinkAuth> {
        static KEYS: OnceLock<Vec<Arc<LinkAuth>>> = OnceLock::new();
        KEYS.get_or_init(|| test_world(8, None, false))[rank as usize].clone()
    }

    fn bind(h: Hello) -> Result<Listener, PlaitError> {
        let auth = keys(h.to);
        Listener::bind(h, auth)
    }

    fn bind_with(h: Hello, port: u16, hello_timeout: Duration) -> Result<Listener, PlaitError> {
        let auth = keys(h.to);
        Listener::bind_with(h, auth, port, hello_timeout)
    }

    fn bind_on(h: Hello, addrs: Option<&[IpAddr]>, port: u16, hello_timeout: Duration, screened: bool) -> Result<Listener, PlaitError> {
        let auth = keys(h.to);
        Listener::bind_on(h, auth, addrs, port, hello_timeout, screened)
    }

    /// Connects as `h.from`, proving that rank's key; the plain stream.
    fn dial(port: u16, h: &Hello, deadline: Instant) -> Result<TcpStream, PlaitError> {
        connect(&lo_route(), port, h, &keys(h.from), deadline).map(|l| l.stream)
    }

    #[test]
    fn full_mesh_of_four_ranks() {
        let world = 4u32;
        let listeners: Vec<Arc<Listener>> =
            (0..world).map(|r| Arc::new(bind(hello("mesh", 7, 0, r, world)).unwrap())).collect();
        let ports: Vec<u16> = listeners.iter().map(|l| l.port()).collect();
        let threads: Vec<_> = (0..world)
            .map(|me| {
                let l = listeners[me as usize].clone();
                let ports = ports.clone();
                std::thread::spawn(move || {
                    let deadline = soon(5000);
                    let mut links = HashMap::new();
                    // Connect downwards in reverse order and accept upwards in reverse order,
                    // so arrivals are out of order.
                    for peer in (0..me).rev() {
                        let mut s = dial(ports[peer as usize], &hello("mesh", 7, me, peer, world), deadline)
                            .unwrap();
                        s.write_all(&me.to_le_bytes()).unwrap();
                        links.insert(peer, s);
                    }
                    for peer in (me + 1..world).rev() {
                        let mut s = l.accept_from(peer, deadline).unwrap().stream;
                        assert_eq!(s.read_timeout().unwrap(), None);
                        assert!(s.nodelay().unwrap());
                        let mut b = [0u8; 4];
                        s.read_exact(&mut b).unwrap();
                        assert_eq!(u32::from_le_bytes(b), peer, "stream delivered for the wrong rank");
                        s.write_all(&me.to_le_bytes()).unwrap();
                        links.insert(peer, s);
                    }
                    for peer in 0..me {
                        let mut b = [0u8; 4];
                        links.get_mut(&peer).unwrap().read_exact(&mut b).unwrap();
                        assert_eq!(u32::from_le_bytes(b), peer);
                    }
                    links.len()
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), world as usize - 1);
        }
    }

    #[test]
    fn mismatched_hellos_are_refused_and_listener_keeps_working() {
        let l = bind(hello("g", 1, 0, 0, 3)).unwrap();
        let p = l.port();
        let cases = [
            (hello("other", 1, 1, 0, 3), "group"),
            (hello("g", 2, 1, 0, 3), "epoch"),
            (hello("g", 1, 1, 0, 4), "world size"),
        ];
        for (h, what) in cases {
            let t = Instant::now();
            let e = dial(p, &h, soon(3000)).unwrap_err();
            let msg = e.to_string();
            assert_eq!(e.kind(), "peer", "{msg}");
            assert!(msg.contains("refused") && msg.contains(what), "{msg}");
            assert!(msg.contains("rank 0") && msg.contains(&format!("127.0.0.1:{p}")), "{msg}");
            assert!(t.elapsed() < Duration::from_secs(1), "refusal must not wait for the deadline");
        }
        // Hellos connect() would not send: wrong addressee and a lower rank connecting.
        for (h, what) in [(hello("g", 1, 2, 1, 3), "addressed rank 1"), (hello("g", 1, 0, 0, 3), "must listen")] {
            let mut s = TcpStream::connect(("127.0.0.1", p)).unwrap();
            s.write_all(&h.encode()).unwrap();
            let mut r = Vec::new();
            s.read_to_end(&mut r).unwrap();
            assert_eq!(&r[..7], REPLY_MAGIC);
            assert_eq!(r[8], 0);
            assert!(String::from_utf8_lossy(&r[11..]).contains(what), "{:?}", String::from_utf8_lossy(&r));
        }
        let t = std::thread::spawn(move || dial(p, &hello("g", 1, 2, 0, 3), soon(3000)).unwrap());
        let mut s = l.accept_from(2, soon(3000)).unwrap().stream;
        let mut c = t.join().unwrap();
        c.write_all(b"hi").unwrap();
        let mut b = [0u8; 2];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hi");
        // A second connection claiming the same rank is refused, even after it was taken.
        let e = dial(p, &hello("g", 1, 2, 0, 3), soon(3000)).unwrap_err();
        assert!(e.to_string().contains("already connected"), "{e}");
        assert!(l.accept_from(2, soon(10)).is_err());
        // The other rank still gets in.
        let t = std::thread::spawn(move || dial(p, &hello("g", 1, 1, 0, 3), soon(3000)).unwrap());
        l.accept_from(1, soon(3000)).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn garbage_and_silent_connections_do_not_block_a_valid_peer() {
        let l = bind_with(hello("g", 3, 0, 0, 2), 0, Duration::from_millis(800)).unwrap();
        let p = l.port();
        // Random bytes.
        let mut junk = TcpStream::connect(("127.0.0.1", p)).unwrap();
        let mut x: u64 = 0x9e3779b97f4a7c15;
        let bytes: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let _ = junk.write_all(&bytes);
        // Valid magic announcing a huge group id.
        let mut huge = TcpStream::connect(("127.0.0.1", p)).unwrap();
        let mut h = hello("g", 3, 1, 0, 2).encode();
        h[31..33].copy_from_slice(&u16::MAX.to_le_bytes());
        huge.write_all(&h[..HELLO_FIXED_LEN]).unwrap();
        // Silent half-open, and one that stalls mid-hello.
        let mut silent = TcpStream::connect(("127.0.0.1", p)).unwrap();
        let mut stalled = TcpStream::connect(("127.0.0.1", p)).unwrap();
        stalled.write_all(&hello("g", 3, 1, 0, 2).encode()[..10]).unwrap();

        let t0 = Instant::now();
        let c = std::thread::spawn(move || dial(p, &hello("g", 3, 1, 0, 2), soon(3000)).unwrap());
        l.accept_from(1, soon(3000)).unwrap();
        c.join().unwrap();
        assert!(t0.elapsed() < Duration::from_millis(500), "valid peer delayed {:?}", t0.elapsed());

        let mut r = Vec::new();
        let _ = huge.read_to_end(&mut r);
        assert!(String::from_utf8_lossy(&r).contains("exceeds"), "{:?}", String::from_utf8_lossy(&r));
        // The silent connections are dropped after the handshake timeout.
        for s in [&mut silent, &mut stalled] {
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let mut b = [0u8; 1];
            let t = Instant::now();
            let n = s.read(&mut b);
            assert!(matches!(n, Ok(0)) || n.is_err(), "{n:?}");
            assert!(t.elapsed() < Duration::from_secs(2));
        }
        drop(junk);
    }

    #[test]
    fn hundreds_of_silent_connections_do_not_block_a_valid_peer() {
        let l = bind_with(hello("g", 3, 0, 0, 2), 0, Duration::from_secs(20)).unwrap();
        let p = l.port();
        let silent: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(("127.0.0.1", p)).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(200));
        let t0 = Instant::now();
        let c = std::thread::spawn(move || dial(p, &hello("g", 3, 1, 0, 2), soon(3000)));
        let accepted = l.accept_from(1, soon(3000));
        let connected = c.join().unwrap();
        assert!(accepted.is_ok() && connected.is_ok(), "{accepted:?} {connected:?}");
        assert!(t0.elapsed() < Duration::from_secs(1), "valid peer delayed {:?}", t0.elapsed());
        drop(silent);
    }

    #[test]
    fn a_timeout_names_the_connections_that_sent_no_hello() {
        let l = bind_with(hello("g", 3, 0, 0, 3), 0, Duration::from_millis(300)).unwrap();
        let p = l.port();
        let silent: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(("127.0.0.1", p)).unwrap()).collect();
        let from = silent[0].local_addr().unwrap();
        let e = l.accept_from(2, soon(1000)).unwrap_err().to_string();
        assert!(e.contains("3 connection(s)") && e.contains("no hello") && e.contains(&from.to_string()), "{e}");
        // Still open ones are named as such.
        let l = bind_with(hello("g", 3, 0, 0, 3), 0, Duration::from_secs(20)).unwrap();
        let _silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(("127.0.0.1", l.port())).unwrap()).collect();
        let e = l.accept_from(2, soon(300)).unwrap_err().to_string();
        assert!(e.contains("2 connection(s) open") && e.contains("no hello yet"), "{e}");
    }

    #[test]
    fn a_listener_on_chosen_addresses_is_not_reachable_on_others() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let l = bind_on(hello("g", 1, 0, 0, 2), Some(&[lo]), 0, HANDSHAKE_TIMEOUT, false).unwrap();
        assert_eq!(l.local_addrs(), [SocketAddr::new(lo, l.port())]);
        // 127.0.0.2 is this host too (Linux, Windows), but nobody listens there.
        let other = SocketAddr::from(([127, 0, 0, 2], l.port()));
        assert!(TcpStream::connect_timeout(&other, Duration::from_secs(2)).is_err());
        let c = std::thread::spawn({
            let p = l.port();
            move || dial(p, &hello("g", 1, 1, 0, 2), soon(3000))
        });
        l.accept_from(1, soon(3000)).unwrap();
        c.join().unwrap().unwrap();
    }

    #[test]
    fn connections_from_addresses_no_peer_published_are_closed_unread() {
        let l = bind_on(hello("g", 1, 0, 0, 3), None, 0, HANDSHAKE_TIMEOUT, true).unwrap();
        let p = l.port();
        // Held unread until the peers are known: this one comes from 127.0.0.1, which no peer has.
        let mut early = TcpStream::connect(("127.0.0.1", p)).unwrap();
        early.write_all(&hello("g", 1, 1, 0, 3).encode()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let far = |last: u8| vec!["10.255.0.0".parse::<IpAddr>().unwrap(), IpAddr::from([10, 255, 0, last])];
        l.admit(&[(1, far(1)), (2, far(2))]);
        early.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut got = Vec::new();
        let end = early.read_to_end(&mut got);
        assert!(got.is_empty(), "a stranger was answered: {:?}", String::from_utf8_lossy(&got));
        assert!(end.is_ok() || end.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset), "{end:?}");
        // Later ones are closed at accept, and the timeout names them.
        let mut late = TcpStream::connect(("127.0.0.1", p)).unwrap();
        let _ = late.write_all(&hello("g", 1, 1, 0, 3).encode());
        late.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut got = Vec::new();
        let _ = late.read_to_end(&mut got);
        assert!(got.is_empty());
        let e = l.accept_from(1, soon(100)).unwrap_err().to_string();
        assert!(e.contains("2 connection(s) refused from addresses no peer published") && e.contains("127.0.0.1:"), "{e}");

        // Each rank only from its own addresses.
        let l = bind_on(hello("g", 1, 0, 0, 3), None, 0, HANDSHAKE_TIMEOUT, true).unwrap();
        l.admit(&[(1, vec!["127.0.0.1".parse().unwrap()]), (2, far(2))]);
        let e = dial(l.port(), &hello("g", 1, 2, 0, 3), soon(2000)).unwrap_err().to_string();
        assert!(e.contains("rank 2 connected from 127.0.0.1") && e.contains("not one of the addresses it published"), "{e}");
        let c = std::thread::spawn({
            let p = l.port();
            move || dial(p, &hello("g", 1, 1, 0, 3), soon(3000))
        });
        l.accept_from(1, soon(3000)).unwrap();
        c.join().unwrap().unwrap();
    }

    #[test]
    fn accept_from_times_out_naming_the_rank() {
        let l = bind(hello("g", 5, 0, 1, 4)).unwrap();
        let t = Instant::now();
        let e = l.accept_from(3, soon(200)).unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_secs(1));
        assert_eq!(e.kind(), "timeout");
        assert!(e.to_string().contains("rank 3"), "{e}");
        // A refused attempt by that rank is part of the diagnosis.
        let _ = dial(l.port(), &hello("g", 4, 3, 1, 4), soon(2000)).unwrap_err();
        let e = l.accept_from(3, soon(100)).unwrap_err();
        assert!(e.to_string().contains("epoch 4"), "{e}");
        // Ranks that never connect to this one are rejected outright.
        assert_eq!(l.accept_from(1, soon(100)).unwrap_err().kind(), "invalid");
        assert_eq!(l.accept_from(0, soon(100)).unwrap_err().kind(), "invalid");
        assert_eq!(l.accept_from(4, soon(100)).unwrap_err().kind(), "invalid");
    }

    #[test]
    fn close_joins_promptly_and_wakes_waiters() {
        let l = Arc::new(bind(hello("g", 1, 0, 0, 2)).unwrap());
        let p = l.port();
        let _silent = TcpStream::connect(("127.0.0.1", p)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let l2 = l.clone();
        let waiter = std::thread::spawn(move || l2.accept_from(1, soon(30_000)));
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        l.close();
        assert!(t.elapsed() < Duration::from_millis(300), "close took {:?}", t.elapsed());
        assert_eq!(waiter.join().unwrap().unwrap_err().kind(), "broken");
        l.close();
        // Nobody listens any more.
        let e = dial(p, &hello("g", 1, 1, 0, 2), soon(200)).unwrap_err();
        assert_eq!(e.kind(), "timeout", "{e}");
        let m = e.to_string();
        assert!(m.contains("rank 0") && m.contains(&format!("127.0.0.1:{p}")) && m.contains("refused"), "{m}");
    }

    #[test]
    fn streams_taken_before_close_survive_it() {
        for _ in 0..20 {
            let l = bind(hello("g", 1, 0, 0, 2)).unwrap();
            let p = l.port();
            let c = std::thread::spawn(move || dial(p, &hello("g", 1, 1, 0, 2), soon(3000)).unwrap());
            let mut s = l.accept_from(1, soon(3000)).unwrap().stream;
            drop(l);
            let mut c = c.join().unwrap();
            c.write_all(b"ok").unwrap();
            let mut b = [0u8; 2];
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
            c.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"ok");
        }
    }

}
