//! TCP connection setup between two ranks, with a handshake.
//!
//! The lower rank listens and the higher rank connects, so two ranks can never both wait for the
//! other to accept. The handshake carries group, epoch and ranks, so a stray process, a stale
//! communicator from an earlier epoch, or a misconfigured peer is refused with a reason both
//! sides can log, instead of being paired with the wrong rank.
//!
//! Wire format (little endian):
//!   hello: b"PLAITHS" | version u8 | epoch u64 | from u32 | to u32 | world u32 | lane u8 | lanes u8
//!          | group_len u16 | group (UTF-8)
//!   reply: b"PLAITHR" | version u8 | status u8 (1 accept, 0 refuse) | reason_len u16 | reason (UTF-8)
//! Lengths are bounded (1 KiB) so garbage cannot make either side allocate much.
//!
//! A pair of ranks may open several connections ("lanes", `PLAIT_STREAMS`): each hello names its
//! lane, and both sides must agree on how many there are.

use crate::error::PlaitError;
use crate::net::route::Route;
use crate::platform::sockbuf;
use parking_lot::{Condvar, Mutex};
use socket2::{Domain, Protocol, SockRef, Socket, TcpKeepalive, Type};
use std::collections::{HashMap, HashSet};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Clone, Debug, PartialEq)]
pub struct Hello {
    pub group: String,
    pub epoch: u64,
    pub from: u32,
    pub to: u32,
    pub world: u32,
    /// Which of the `lanes` connections between the two ranks this is.
    pub lane: u8,
    pub lanes: u8,
}

/// How long an accepted connection may take to send its hello.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

const HELLO_MAGIC: &[u8; 7] = b"PLAITHS";
const REPLY_MAGIC: &[u8; 7] = b"PLAITHR";
const VERSION: u8 = 2;
const HELLO_FIXED_LEN: usize = 7 + 1 + 8 + 4 + 4 + 4 + 1 + 1 + 2;
const REPLY_FIXED_LEN: usize = 7 + 1 + 1 + 2;
const MAX_GROUP_LEN: usize = 1024;
const MAX_REASON_LEN: usize = 1024;
/// Handshakes in progress at once; beyond this, new connections are dropped so a flood cannot
/// exhaust threads (a real peer retries on reset).
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Accept poll period: bounds how long close() waits for the accept thread.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
const LINK_BUF: usize = 4 << 20;

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let g = self.group.as_bytes();
        let mut b = Vec::with_capacity(HELLO_FIXED_LEN + g.len());
        b.extend_from_slice(HELLO_MAGIC);
        b.push(VERSION);
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&self.from.to_le_bytes());
        b.extend_from_slice(&self.to.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.push(self.lane);
        b.push(self.lanes);
        b.extend_from_slice(&(g.len() as u16).to_le_bytes());
        b.extend_from_slice(g);
        b
    }
}

/// Listening socket plus an accept thread that handshakes each incoming connection on its own
/// short-lived thread, so a silent or garbage-sending connection never delays the others.
pub struct Listener {
    shared: Arc<Shared>,
    port: u16,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    expect: Hello,
    handshake_timeout: Duration,
    stop: AtomicBool,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    /// Accepted, not yet taken by accept_lane, by (rank, lane).
    ready: HashMap<(u32, u8), TcpStream>,
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
    closed: bool,
}

impl Listener {
    /// Listens on all addresses, ephemeral port. `expect.from` is ignored.
    pub fn bind(expect: Hello) -> Result<Listener, PlaitError> {
        Listener::bind_with(expect, 0, HANDSHAKE_TIMEOUT)
    }

    /// As `bind`, with an explicit port (0 = ephemeral) and handshake timeout.
    pub fn bind_with(expect: Hello, port: u16, handshake_timeout: Duration) -> Result<Listener, PlaitError> {
        if expect.to >= expect.world {
            return Err(PlaitError::invalid(format!(
                "listener rank {} out of range for world size {}",
                expect.to, expect.world
            )));
        }
        let listener = bind_any(port).map_err(|e| PlaitError::Io(format!("cannot listen on port {port}: {e}")))?;
        let port = listener.local_addr().map_err(PlaitError::from)?.port();
        let shared = Arc::new(Shared {
            expect,
            handshake_timeout,
            stop: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("plait-accept-{port}"))
            .spawn(move || accept_loop(listener, s2))
            .map_err(|e| PlaitError::Io(format!("cannot start accept thread: {e}")))?;
        Ok(Listener { shared, port, thread: Mutex::new(Some(thread)) })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Waits for the accepted connection from rank `from` (any order of arrival) until `deadline`.
    pub fn accept_from(&self, from: u32, deadline: Instant) -> Result<TcpStream, PlaitError> {
        self.accept_lane(from, 0, deadline)
    }

    /// As `accept_from`, for one of several connections from that rank.
    pub fn accept_lane(&self, from: u32, lane: u8, deadline: Instant) -> Result<TcpStream, PlaitError> {
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
        self.shared.cv.notify_all();
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

/// Dual-stack [::] so IPv6 routes work too; plain 0.0.0.0 where IPv6 is unavailable.
fn bind_any(port: u16) -> io::Result<TcpListener> {
    let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port);
    let v4 = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port);
    let try_bind = |addr: SocketAddr| -> io::Result<TcpListener> {
        let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        if addr.is_ipv6() {
            s.set_only_v6(false)?;
        }
        // Lets a fixed port be reused while old connections sit in TIME_WAIT. Not on Windows,
        // where it would let two listeners share the port.
        #[cfg(not(windows))]
        s.set_reuse_address(true)?;
        s.bind(&addr.into())?;
        s.listen(128)?;
        s.set_nonblocking(true)?;
        Ok(s.into())
    };
    try_bind(v6).or_else(|_| try_bind(v4))
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut last_error_log: Option<Instant> = None;
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, addr)) => start_handshake(s, canonical(addr), &shared),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(ACCEPT_POLL),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // E.g. EMFILE: keep trying, but do not flood the log.
                if last_error_log.is_none_or(|t| t.elapsed() > Duration::from_secs(5)) {
                    tracing::warn!("accept on port {} failed: {e}", listener.local_addr().map(|a| a.port()).unwrap_or(0));
                    last_error_log = Some(Instant::now());
                }
                std::thread::sleep(ACCEPT_POLL);
            }
        }
    }
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

fn start_handshake(s: TcpStream, addr: SocketAddr, shared: &Arc<Shared>) {
    // Accepted sockets inherit non-blocking mode on some platforms (BSD, macOS).
    if s.set_nonblocking(false).is_err() {
        return;
    }
    let id = {
        let mut st = shared.state.lock();
        if st.closed {
            return;
        }
        if st.pending.len() >= MAX_PENDING_HANDSHAKES {
            tracing::warn!(remote = %addr, "dropping connection: {MAX_PENDING_HANDSHAKES} handshakes already in progress");
            return;
        }
        let Ok(clone) = s.try_clone() else { return };
        let id = st.next_pending;
        st.next_pending += 1;
        st.pending.insert(id, clone);
        id
    };
    let sh = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("plait-handshake".into())
        .spawn(move || {
            handshake(s, addr, id, &sh);
            sh.state.lock().pending.remove(&id);
        });
    if let Err(e) = spawned {
        tracing::warn!(remote = %addr, "dropping connection: cannot start handshake thread: {e}");
        shared.state.lock().pending.remove(&id);
    }
}

enum HsFail {
    /// Tell the peer why, then close.
    Refuse(String),
    /// The connection itself failed (timeout, reset); nobody to tell.
    Io(String),
}

fn handshake(mut s: TcpStream, addr: SocketAddr, id: u64, shared: &Shared) {
    let deadline = Instant::now() + shared.handshake_timeout;
    let _ = s.set_write_timeout(Some(shared.handshake_timeout.max(Duration::from_millis(1))));
    let hello = match read_hello(&mut s, deadline) {
        Ok(h) => h,
        Err(HsFail::Refuse(why)) => return refuse(s, addr, None, why, shared),
        Err(HsFail::Io(why)) => {
            tracing::warn!(remote = %addr, "handshake failed: {why}");
            shared.state.lock().last_refusal = Some(format!("{addr}: {why}"));
            return;
        }
    };
    if let Some(why) = check_hello(&hello, &shared.expect) {
        return refuse(s, addr, Some(hello.from), why, shared);
    }
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
    let ready = write_reply(&mut s, true, "").and_then(|_| {
        s.set_read_timeout(None)?;
        s.set_write_timeout(None)?;
        Ok(())
    });
    if ready.is_ok() {
        if let Err(e) = tune_stream(&s) {
            tracing::warn!(remote = %addr, "cannot tune link socket from rank {}: {e}", hello.from);
        }
    }
    let mut st = shared.state.lock();
    match ready {
        Ok(()) if !st.closed => {
            tracing::debug!(remote = %addr, "accepted rank {} as rank {}", hello.from, shared.expect.to);
            // Leave `pending` in the same critical section, or a close() right after the owner
            // took the stream would shut down the owner's link.
            st.pending.remove(&id);
            st.refused_rank.remove(&hello.from);
            st.ready.insert(key, s);
            drop(st);
            shared.cv.notify_all();
        }
        Ok(()) => {}
        Err(e) => {
            // The peer will see the failure and retry; let it.
            st.claimed.remove(&key);
            drop(st);
            tracing::warn!(remote = %addr, "handshake with rank {} failed while replying: {e}", hello.from);
        }
    }
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
    let _ = write_reply(&mut s, false, &why);
    let _ = s.shutdown(Shutdown::Both);
}

fn check_hello(h: &Hello, e: &Hello) -> Option<String> {
    let me = e.to;
    Some(if h.group != e.group {
        format!("rank {} of group {:?}, but this listener is group {:?}", h.from, h.group, e.group)
    } else if h.epoch != e.epoch {
        format!("rank {} is at epoch {}, this listener at epoch {} (stale or newer communicator)", h.from, h.epoch, e.epoch)
    } else if h.world != e.world {
        format!("rank {} has world size {}, this listener {}", h.from, h.world, e.world)
    } else if h.to != me {
        format!("rank {} addressed rank {}, but this is rank {me}", h.from, h.to)
    } else if h.from >= e.world {
        format!("sender rank {} out of range for world size {}", h.from, e.world)
    } else if h.from <= me {
        format!("rank {} must listen for rank {me}, not connect to it (the higher rank connects)", h.from)
    } else if h.lanes != e.lanes {
        format!(
            "rank {} opens {} connection(s) per peer, this rank {} (set PLAIT_STREAMS the same on every rank)",
            h.from, h.lanes, e.lanes
        )
    } else if h.lane >= h.lanes {
        format!("rank {} sent connection index {} of {}", h.from, h.lane, h.lanes)
    } else {
        return None;
    })
}

fn read_hello(s: &mut TcpStream, deadline: Instant) -> Result<Hello, HsFail> {
    let io = |e: io::Error| HsFail::Io(describe_read_error(&e));
    let mut b = [0u8; HELLO_FIXED_LEN];
    // Check the magic before waiting for the rest, so a non-plait client gets a clear answer.
    read_exact_by(s, &mut b[..7], deadline).map_err(io)?;
    if &b[..7] != HELLO_MAGIC {
        return Err(HsFail::Refuse(format!("not a plait handshake (starts with {:02x?})", &b[..7])));
    }
    read_exact_by(s, &mut b[7..], deadline).map_err(io)?;
    if b[7] != VERSION {
        return Err(HsFail::Refuse(format!("handshake version {}, this side speaks {VERSION}", b[7])));
    }
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let epoch = u64::from_le_bytes(b[8..16].try_into().unwrap());
    let (from, to, world) = (u32_at(16), u32_at(20), u32_at(24));
    let (lane, lanes) = (b[28], b[29]);
    let glen = u16::from_le_bytes([b[30], b[31]]) as usize;
    if glen > MAX_GROUP_LEN {
        return Err(HsFail::Refuse(format!("group id of {glen} bytes exceeds {MAX_GROUP_LEN}")));
    }
    let mut g = vec![0u8; glen];
    read_exact_by(s, &mut g, deadline).map_err(io)?;
    let group = String::from_utf8(g).map_err(|_| HsFail::Refuse("group id is not UTF-8".into()))?;
    Ok(Hello { group, epoch, from, to, world, lane, lanes })
}

fn describe_read_error(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "no complete hello within the handshake timeout".into(),
        io::ErrorKind::UnexpectedEof => "connection closed before a complete hello".into(),
        _ => e.to_string(),
    }
}

fn write_reply(s: &mut TcpStream, accept: bool, reason: &str) -> io::Result<()> {
    let mut r = reason.as_bytes();
    if r.len() > MAX_REASON_LEN {
        let mut n = MAX_REASON_LEN;
        while !reason.is_char_boundary(n) {
            n -= 1;
        }
        r = &r[..n];
    }
    let mut b = Vec::with_capacity(REPLY_FIXED_LEN + r.len());
    b.extend_from_slice(REPLY_MAGIC);
    b.push(VERSION);
    b.push(accept as u8);
    b.extend_from_slice(&(r.len() as u16).to_le_bytes());
    b.extend_from_slice(r);
    s.write_all(&b)
}

/// read_exact with an overall deadline (a per-read timeout alone would let a peer trickle one
/// byte at a time forever).
fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        match s.read(&mut buf[filled..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

enum Attempt {
    /// Worth trying again before the deadline (peer not listening yet, connection dropped).
    Retry(String),
    Fatal(String),
}

/// Binds to `route.local.ip` (unless unspecified), connects to `(route.peer_ip, port)` and
/// handshakes. Connection refused or reset is retried until `deadline`, since the peer may not
/// be listening yet; a refused handshake or an unreachable network fails at once so the caller
/// can try its next route.
pub fn connect(route: &Route, port: u16, hello: &Hello, deadline: Instant) -> Result<TcpStream, PlaitError> {
    let start = Instant::now();
    if hello.from <= hello.to || hello.from >= hello.world {
        return Err(PlaitError::invalid(format!(
            "rank {} cannot connect to rank {} in a world of {} (the higher rank connects to the lower)",
            hello.from, hello.to, hello.world
        )));
    }
    if hello.group.len() > MAX_GROUP_LEN {
        return Err(PlaitError::invalid(format!("group id longer than {MAX_GROUP_LEN} bytes")));
    }
    let peer = SocketAddr::new(route.peer_ip, port);
    let local = route.local.ip;
    if local.is_ipv4() != peer.is_ipv4() {
        return Err(PlaitError::invalid(format!(
            "route to rank {} pairs local {local} with peer {peer} of another address family",
            hello.to
        )));
    }
    let via = if local.is_unspecified() {
        "OS route".to_string()
    } else {
        format!("{} {local}", route.local.name)
    };
    let msg = hello.encode();
    let mut backoff = Duration::from_millis(10);
    let mut last = String::from("no attempt made before the deadline");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(PlaitError::Timeout {
                op: "connect".into(),
                waiting_on: format!("rank {} at {peer} via {via} (last error: {last})", hello.to),
                waited: start.elapsed(),
            });
        }
        match attempt(local, peer, &msg, deadline) {
            Ok(s) => return Ok(s),
            Err(Attempt::Retry(why)) => {
                last = why;
                let left = deadline.saturating_duration_since(Instant::now());
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Err(Attempt::Fatal(what)) => {
                return Err(PlaitError::Peer {
                    op: "connect".into(),
                    peer: hello.to as usize,
                    addr: peer.to_string(),
                    what: format!("{what} (via {via})"),
                    waited: start.elapsed(),
                })
            }
        }
    }
}

fn attempt(local: IpAddr, peer: SocketAddr, hello: &[u8], deadline: Instant) -> Result<TcpStream, Attempt> {
    let fatal = Attempt::Fatal;
    let retryable = |e: &io::Error| {
        matches!(
            e.kind(),
            io::ErrorKind::ConnectionRefused
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::UnexpectedEof
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::TimedOut
                | io::ErrorKind::WouldBlock
                | io::ErrorKind::Interrupted
        )
    };
    let classify = |e: io::Error, during: &str| {
        if retryable(&e) {
            Attempt::Retry(format!("{during}: {e}"))
        } else {
            fatal(format!("{during}: {e}"))
        }
    };
    let sock = Socket::new(Domain::for_address(peer), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| fatal(format!("cannot create socket: {e}")))?;
    if !local.is_unspecified() {
        sock.bind(&SocketAddr::new(local, 0).into())
            .map_err(|e| fatal(format!("cannot bind to local address {local}: {e}")))?;
    }
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    sock.connect_timeout(&peer.into(), left).map_err(|e| classify(e, "connect"))?;
    let mut s: TcpStream = sock.into();
    // With nobody listening, a local connect can land on its own ephemeral port (TCP
    // simultaneous open) and would then read back its own hello.
    if s.local_addr().ok() == s.peer_addr().ok() {
        return Err(Attempt::Retry("connected to itself (nobody listening yet)".into()));
    }
    let _ = s.set_nodelay(true);
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_write_timeout(Some(left)).map_err(|e| classify(e, "handshake"))?;
    s.write_all(hello).map_err(|e| classify(e, "sending hello"))?;

    let mut b = [0u8; REPLY_FIXED_LEN];
    read_exact_by(&mut s, &mut b, deadline).map_err(|e| classify(e, "awaiting handshake reply"))?;
    if &b[..7] != REPLY_MAGIC {
        return Err(fatal(format!(
            "answered the handshake with something that is not plait ({:02x?}); is another service on port {}?",
            &b[..7],
            peer.port()
        )));
    }
    if b[7] != VERSION {
        return Err(fatal(format!("speaks handshake version {}, this side {VERSION}", b[7])));
    }
    let rlen = (u16::from_le_bytes([b[9], b[10]]) as usize).min(MAX_REASON_LEN);
    if b[8] != 1 {
        let mut r = vec![0u8; rlen];
        let _ = read_exact_by(&mut s, &mut r, deadline);
        return Err(fatal(format!("refused the handshake: {}", String::from_utf8_lossy(&r))));
    }
    s.set_read_timeout(None).map_err(|e| classify(e, "handshake"))?;
    s.set_write_timeout(None).map_err(|e| classify(e, "handshake"))?;
    if let Err(e) = tune_stream(&s) {
        tracing::warn!(remote = %peer, "cannot tune link socket: {e}");
    }
    Ok(s)
}

/// Socket options for data links: TCP_NODELAY (schedules send many small messages), keepalive
/// (a dead host is noticed even if heartbeats stall), and 4 MiB buffers where that helps
/// (`fixed_buffer`).
pub fn tune_stream(s: &TcpStream) -> io::Result<()> {
    s.set_nodelay(true)?;
    let sock = SockRef::from(s);
    let ka = TcpKeepalive::new().with_time(Duration::from_secs(30));
    #[cfg(any(target_os = "linux", target_os = "macos", target_os = "android", target_os = "freebsd"))]
    let ka = ka.with_interval(Duration::from_secs(5)).with_retries(4);
    sock.set_keepalive(true)?;
    let _ = sock.set_tcp_keepalive(&ka);
    let (auto_max, cap) = (sockbuf::autotuning_max(), sockbuf::system_cap());
    if let Some(size) = fixed_buffer(LINK_BUF, auto_max.recv, cap.recv) {
        let _ = sock.set_recv_buffer_size(size);
    }
    if let Some(size) = fixed_buffer(LINK_BUF, auto_max.send, cap.send) {
        let _ = sock.set_send_buffer_size(size);
    }
    Ok(())
}

/// Raises both socket buffers of a data link to twice its bandwidth-delay product where the
/// system's autotuning could not reach that and its cap allows more (`fixed_buffer`, with the
/// smaller of the two directions' limits). Returns the buffer size set, if any. A link whose
/// window is smaller than its bandwidth-delay product cannot be filled by one stream (see also
/// `PLAIT_STREAMS`).
pub fn fit_buffers_to_bdp(s: &TcpStream, bdp_bytes: usize) -> Option<usize> {
    let smaller = |b: sockbuf::BufferSizes| b.recv.zip(b.send).map(|(r, s)| r.min(s));
    let size = buffer_for_bdp(bdp_bytes, smaller(sockbuf::autotuning_max()), smaller(sockbuf::system_cap()))?;
    let sock = SockRef::from(s);
    (sock.set_recv_buffer_size(size).is_ok() && sock.set_send_buffer_size(size).is_ok()).then_some(size)
}

/// The buffer a link with this bandwidth-delay product needs: twice the product (`fixed_buffer`).
fn buffer_for_bdp(bdp_bytes: usize, auto_max: Option<usize>, cap: Option<usize>) -> Option<usize> {
    fixed_buffer(bdp_bytes.saturating_mul(2), auto_max, cap)
}

/// The fixed size worth giving a socket buffer that should hold `want` bytes, given how far the
/// system's autotuning grows it (`auto_max`) and the most a program may set (`cap`); `None`:
/// leave autotuning alone.
///
/// One rule on every system: setting SO_RCVBUF/SO_SNDBUF turns autotuning off (Linux, macOS
/// and Windows alike) and the system silently holds the size to its cap, so a fixed size helps
/// only when autotuning stops short of `want` and the cap reaches past autotuning; then it is
/// `want`, within the cap. Where either figure is unknown (`platform::sockbuf`), a guess would
/// more likely shrink a fast link's window than grow it, so nothing is set.
fn fixed_buffer(want: usize, auto_max: Option<usize>, cap: Option<usize>) -> Option<usize> {
    let (auto_max, cap) = (auto_max?, cap?);
    (want > auto_max && cap > auto_max).then(|| want.min(cap))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::iface::IfaceAddr;

    fn lo_route() -> Route {
        Route {
            local: IfaceAddr { name: "lo".into(), ip: "127.0.0.1".parse().unwrap(), prefix: 8, mtu: None, speed_mbps: None },
            peer_ip: "127.0.0.1".parse().unwrap(),
            reason: "test".into(),
        }
    }

    fn hello(group: &str, epoch: u64, from: u32, to: u32, world: u32) -> Hello {
        Hello { group: group.into(), epoch, from, to, world, lane: 0, lanes: 1 }
    }

    fn soon(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    #[test]
    fn full_mesh_of_four_ranks() {
        let world = 4u32;
        let listeners: Vec<Arc<Listener>> =
            (0..world).map(|r| Arc::new(Listener::bind(hello("mesh", 7, 0, r, world)).unwrap())).collect();
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
                        let mut s = connect(&lo_route(), ports[peer as usize], &hello("mesh", 7, me, peer, world), deadline)
                            .unwrap();
                        s.write_all(&me.to_le_bytes()).unwrap();
                        links.insert(peer, s);
                    }
                    for peer in (me + 1..world).rev() {
                        let mut s = l.accept_from(peer, deadline).unwrap();
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
        let l = Listener::bind(hello("g", 1, 0, 0, 3)).unwrap();
        let p = l.port();
        let cases = [
            (hello("other", 1, 1, 0, 3), "group"),
            (hello("g", 2, 1, 0, 3), "epoch"),
            (hello("g", 1, 1, 0, 4), "world size"),
        ];
        for (h, what) in cases {
            let t = Instant::now();
            let e = connect(&lo_route(), p, &h, soon(3000)).unwrap_err();
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
        let t = std::thread::spawn(move || connect(&lo_route(), p, &hello("g", 1, 2, 0, 3), soon(3000)).unwrap());
        let mut s = l.accept_from(2, soon(3000)).unwrap();
        let mut c = t.join().unwrap();
        c.write_all(b"hi").unwrap();
        let mut b = [0u8; 2];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hi");
        // A second connection claiming the same rank is refused, even after it was taken.
        let e = connect(&lo_route(), p, &hello("g", 1, 2, 0, 3), soon(3000)).unwrap_err();
        assert!(e.to_string().contains("already connected"), "{e}");
        assert!(l.accept_from(2, soon(10)).is_err());
        // The other rank still gets in.
        let t = std::thread::spawn(move || connect(&lo_route(), p, &hello("g", 1, 1, 0, 3), soon(3000)).unwrap());
        l.accept_from(1, soon(3000)).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn garbage_and_silent_connections_do_not_block_a_valid_peer() {
        let l = Listener::bind_with(hello("g", 3, 0, 0, 2), 0, Duration::from_millis(800)).unwrap();
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
        h[30..32].copy_from_slice(&u16::MAX.to_le_bytes());
        huge.write_all(&h[..HELLO_FIXED_LEN]).unwrap();
        // Silent half-open, and one that stalls mid-hello.
        let mut silent = TcpStream::connect(("127.0.0.1", p)).unwrap();
        let mut stalled = TcpStream::connect(("127.0.0.1", p)).unwrap();
        stalled.write_all(&hello("g", 3, 1, 0, 2).encode()[..10]).unwrap();

        let t0 = Instant::now();
        let c = std::thread::spawn(move || connect(&lo_route(), p, &hello("g", 3, 1, 0, 2), soon(3000)).unwrap());
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
    fn accept_from_times_out_naming_the_rank() {
        let l = Listener::bind(hello("g", 5, 0, 1, 4)).unwrap();
        let t = Instant::now();
        let e = l.accept_from(3, soon(200)).unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_secs(1));
        assert_eq!(e.kind(), "timeout");
        assert!(e.to_string().contains("rank 3"), "{e}");
        // A refused attempt by that rank is part of the diagnosis.
        let _ = connect(&lo_route(), l.port(), &hello("g", 4, 3, 1, 4), soon(2000)).unwrap_err();
        let e = l.accept_from(3, soon(100)).unwrap_err();
        assert!(e.to_string().contains("epoch 4"), "{e}");
        // Ranks that never connect to this one are rejected outright.
        assert_eq!(l.accept_from(1, soon(100)).unwrap_err().kind(), "invalid");
        assert_eq!(l.accept_from(0, soon(100)).unwrap_err().kind(), "invalid");
        assert_eq!(l.accept_from(4, soon(100)).unwrap_err().kind(), "invalid");
    }

    #[test]
    fn close_joins_promptly_and_wakes_waiters() {
        let l = Arc::new(Listener::bind(hello("g", 1, 0, 0, 2)).unwrap());
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
        let e = connect(&lo_route(), p, &hello("g", 1, 1, 0, 2), soon(200)).unwrap_err();
        assert_eq!(e.kind(), "timeout", "{e}");
        let m = e.to_string();
        assert!(m.contains("rank 0") && m.contains(&format!("127.0.0.1:{p}")) && m.contains("refused"), "{m}");
    }

    #[test]
    fn streams_taken_before_close_survive_it() {
        for _ in 0..20 {
            let l = Listener::bind(hello("g", 1, 0, 0, 2)).unwrap();
            let p = l.port();
            let c = std::thread::spawn(move || connect(&lo_route(), p, &hello("g", 1, 1, 0, 2), soon(3000)).unwrap());
            let mut s = l.accept_from(1, soon(3000)).unwrap();
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

    #[test]
    fn connect_retries_until_the_listener_appears() {
        // A bound but not listening socket holds the port, so connects are refused and no other
        // test's socket can take the port in the meantime.
        let hold = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        hold.bind(&SocketAddr::from(([0, 0, 0, 0], 0)).into()).unwrap();
        let port = hold.local_addr().unwrap().as_socket().unwrap().port();
        let c = std::thread::spawn(move || connect(&lo_route(), port, &hello("g", 1, 1, 0, 2), soon(5000)));
        std::thread::sleep(Duration::from_millis(300));
        drop(hold);
        let l = Listener::bind_with(hello("g", 1, 0, 0, 2), port, HANDSHAKE_TIMEOUT).unwrap();
        l.accept_from(1, soon(5000)).unwrap();
        c.join().unwrap().unwrap();
    }

    #[test]
    fn buffers_grow_to_the_bandwidth_delay_product_only_past_autotuning() {
        let mib = 1 << 20;
        // 10 Gbit/s at 40 ms: 50 MB in flight; autotuning stops at 6 MiB.
        assert_eq!(buffer_for_bdp(50_000_000, Some(6 * mib), Some(256 * mib)), Some(100_000_000));
        assert_eq!(buffer_for_bdp(50_000_000, Some(6 * mib), Some(64 * mib)), Some(64 * mib), "held to the cap");
        assert_eq!(buffer_for_bdp(1_000_000, Some(6 * mib), Some(256 * mib)), None, "autotuning reaches it");
        assert_eq!(buffer_for_bdp(50_000_000, Some(6 * mib), Some(4 * mib)), None, "the cap would shrink it");
    }

    #[test]
    fn a_fixed_buffer_only_where_both_limits_are_known_and_it_helps() {
        let mib = 1 << 20;
        // Autotuning stops at 2 MiB, programs may set 16 MiB: 4 MiB helps.
        assert_eq!(fixed_buffer(LINK_BUF, Some(2 * mib), Some(16 * mib)), Some(LINK_BUF));
        assert_eq!(fixed_buffer(LINK_BUF, Some(2 * mib), Some(3 * mib)), Some(3 * mib), "within the cap");
        assert_eq!(fixed_buffer(LINK_BUF, Some(6 * mib), Some(16 * mib)), None, "autotuning goes further");
        assert_eq!(fixed_buffer(LINK_BUF, Some(2 * mib), Some(208 * 1024)), None, "the cap is below autotuning");
        // Unknown limits (Windows, or unreadable settings): autotuning is left alone.
        assert_eq!(fixed_buffer(LINK_BUF, None, Some(16 * mib)), None);
        assert_eq!(fixed_buffer(LINK_BUF, Some(2 * mib), None), None);
        assert_eq!(fixed_buffer(LINK_BUF, None, None), None);
        assert_eq!(buffer_for_bdp(50_000_000, None, None), None);
    }

    #[test]
    fn bad_arguments_fail_fast() {
        assert_eq!(connect(&lo_route(), 1, &hello("g", 1, 0, 1, 2), soon(1000)).unwrap_err().kind(), "invalid");
        assert_eq!(connect(&lo_route(), 1, &hello("g", 1, 2, 1, 2), soon(1000)).unwrap_err().kind(), "invalid");
        let mut r = lo_route();
        r.peer_ip = "::1".parse().unwrap();
        assert_eq!(connect(&r, 1, &hello("g", 1, 1, 0, 2), soon(1000)).unwrap_err().kind(), "invalid");
        assert!(Listener::bind(hello("g", 1, 0, 2, 2)).is_err());
    }
}
