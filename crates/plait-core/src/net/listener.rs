//! The listening side of link set-up: an accept thread that handshakes each incoming connection
//! on a short-lived thread of its own and hands accepted streams out by rank and lane.

use super::auth::{self, LinkAuth, LinkStream, Rejection};
use super::handshake::{check_hello, read_hello, reply, write_reply, Hello, HsFail};
use super::tuning::tune_stream;
use crate::error::PlaitError;
use parking_lot::{Condvar, Mutex};
use socket2::{Domain, Protocol, Socket, Type};
use std::collections::{HashMap, HashSet};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an accepted connection may take to send its hello.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshakes in progress at once; beyond this, new connections are dropped so a flood cannot
/// exhaust threads (a real peer retries on reset).
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Accept poll period: bounds how long close() waits for the accept thread.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// Listening socket plus an accept thread that handshakes each incoming connection on its own
/// short-lived thread, so a silent or garbage-sending connection never delays the others.
pub struct Listener {
    shared: Arc<Shared>,
    port: u16,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    expect: Hello,
    auth: Arc<LinkAuth>,
    handshake_timeout: Duration,
    stop: AtomicBool,
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
    closed: bool,
}

impl Listener {
    /// Listens on all addresses, ephemeral port. `expect.from` is ignored; connectors must prove
    /// the keys `auth` learns they published.
    pub fn bind(expect: Hello, auth: Arc<LinkAuth>) -> Result<Listener, PlaitError> {
        Listener::bind_with(expect, auth, 0, HANDSHAKE_TIMEOUT)
    }

    /// As `bind`, with an explicit port (0 = ephemeral) and handshake timeout.
    pub fn bind_with(expect: Hello, auth: Arc<LinkAuth>, port: u16, handshake_timeout: Duration) -> Result<Listener, PlaitError> {
        let expect = Hello { mode: auth.mode(), ..expect };
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
            auth,
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

fn handshake(mut s: TcpStream, addr: SocketAddr, id: u64, shared: &Shared) {
    let deadline = Instant::now() + shared.handshake_timeout;
    let _ = s.set_write_timeout(Some(shared.handshake_timeout.max(Duration::from_millis(1))));
    let hello = match read_hello(&mut s, deadline) {
        Ok(h) => h,
        Err(HsFail::Refuse(why)) => return refuse(s, addr, None, why, shared),
        Err(HsFail::Io(why)) => return give_up(addr, &why, shared),
    };
    if let Some(why) = check_hello(&hello, &shared.expect) {
        return refuse(s, addr, Some(hello.from), why, shared);
    }
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

    #[test]
    fn full_mesh_of_four_ranks() {
        let world = 4u32;
        let auth = test_world(world as usize, None, false);
        let listeners: Vec<Arc<Listener>> =
            (0..world).map(|r| Arc::new(Listener::bind(hello("mesh", 7, 0, r, world), auth[r as usize].clone()).unwrap())).collect();
        let ports: Vec<u16> = listeners.iter().map(|l| l.port()).collect();
        let threads: Vec<_> = (0..world)
            .map(|me| {
                let l = listeners[me as usize].clone();
                let ports = ports.clone();
                let auth = auth[me as usize].clone();
                std::thread::spawn(move || {
                    let deadline = soon(5000);
                    let mut links = HashMap::new();
                    // Connect downwards in reverse order and accept upwards in reverse order,
                    // so arrivals are out of order.
                    for peer in (0..me).rev() {
                        let mut s = connect(&lo_route(), ports[peer as usize], &hello("mesh", 7, me, peer, world), &auth, deadline)
                            .unwrap()
                            .stream;
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
        let a = test_world(3, None, false);
        let l = Listener::bind(hello("g", 1, 0, 0, 3), a[0].clone()).unwrap();
        let p = l.port();
        let cases = [
            (hello("other", 1, 1, 0, 3), "group"),
            (hello("g", 2, 1, 0, 3), "epoch"),
            (hello("g", 1, 1, 0, 4), "world size"),
        ];
        for (h, what) in cases {
            let t = Instant::now();
            let e = connect(&lo_route(), p, &h, &a[1], soon(3000)).unwrap_err();
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
        let a2 = a[2].clone();
        let t = std::thread::spawn(move || connect(&lo_route(), p, &hello("g", 1, 2, 0, 3), &a2, soon(3000)).unwrap());
        let mut s = l.accept_from(2, soon(3000)).unwrap().stream;
        let mut c = t.join().unwrap().stream;
        c.write_all(b"hi").unwrap();
        let mut b = [0u8; 2];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hi");
        // A second connection claiming the same rank is refused, even after it was taken.
        let e = connect(&lo_route(), p, &hello("g", 1, 2, 0, 3), &a[2], soon(3000)).unwrap_err();
        assert!(e.to_string().contains("already connected"), "{e}");
        assert!(l.accept_from(2, soon(10)).is_err());
        // The other rank still gets in.
        let a1 = a[1].clone();
        let t = std::thread::spawn(move || connect(&lo_route(), p, &hello("g", 1, 1, 0, 3), &a1, soon(3000)).unwrap());
        l.accept_from(1, soon(3000)).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn garbage_and_silent_connections_do_not_block_a_valid_peer() {
        let a = test_world(2, None, false);
        let l = Listener::bind_with(hello("g", 3, 0, 0, 2), a[0].clone(), 0, Duration::from_millis(800)).unwrap();
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
        let a1 = a[1].clone();
        let c = std::thread::spawn(move || connect(&lo_route(), p, &hello("g", 3, 1, 0, 2), &a1, soon(3000)).unwrap());
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
        let a = test_world(4, None, false);
        let l = Listener::bind(hello("g", 5, 0, 1, 4), a[1].clone()).unwrap();
        let t = Instant::now();
        let e = l.accept_from(3, soon(200)).unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_secs(1));
        assert_eq!(e.kind(), "timeout");
        assert!(e.to_string().contains("rank 3"), "{e}");
        // A refused attempt by that rank is part of the diagnosis.
        let _ = connect(&lo_route(), l.port(), &hello("g", 4, 3, 1, 4), &a[3], soon(2000)).unwrap_err();
        let e = l.accept_from(3, soon(100)).unwrap_err();
        assert!(e.to_string().contains("epoch 4"), "{e}");
        // Ranks that never connect to this one are rejected outright.
        assert_eq!(l.accept_from(1, soon(100)).unwrap_err().kind(), "invalid");
        assert_eq!(l.accept_from(0, soon(100)).unwrap_err().kind(), "invalid");
        assert_eq!(l.accept_from(4, soon(100)).unwrap_err().kind(), "invalid");
    }

    #[test]
    fn close_joins_promptly_and_wakes_waiters() {
        let a = test_world(2, None, false);
        let l = Arc::new(Listener::bind(hello("g", 1, 0, 0, 2), a[0].clone()).unwrap());
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
        let e = connect(&lo_route(), p, &hello("g", 1, 1, 0, 2), &a[1], soon(200)).unwrap_err();
        assert_eq!(e.kind(), "timeout", "{e}");
        let m = e.to_string();
        assert!(m.contains("rank 0") && m.contains(&format!("127.0.0.1:{p}")) && m.contains("refused"), "{m}");
    }

    #[test]
    fn streams_taken_before_close_survive_it() {
        let a = test_world(2, None, false);
        for _ in 0..20 {
            let l = Listener::bind(hello("g", 1, 0, 0, 2), a[0].clone()).unwrap();
            let p = l.port();
            let a1 = a[1].clone();
            let c = std::thread::spawn(move || connect(&lo_route(), p, &hello("g", 1, 1, 0, 2), &a1, soon(3000)).unwrap());
            let mut s = l.accept_from(1, soon(3000)).unwrap().stream;
            drop(l);
            let mut c = c.join().unwrap().stream;
            c.write_all(b"ok").unwrap();
            let mut b = [0u8; 2];
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
            c.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"ok");
        }
    }

}
