//! The connecting side of link set-up: the higher rank dials the lower one over a chosen route,
//! retrying until the peer listens, and handshakes.

use super::auth::{self, LinkAuth, LinkStream};
use super::handshake::{read_exact_by, Hello, MAX_GROUP_LEN, MAX_REASON_LEN, REPLY_FIXED_LEN, REPLY_MAGIC, VERSION};
use super::tuning::tune_stream;
use crate::error::PlaitError;
use crate::net::route::Route;
use socket2::{Domain, Protocol, Socket, Type};
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

enum Attempt {
    /// Worth trying again before the deadline (peer not listening yet, connection dropped).
    Retry(String),
    Fatal(String),
    /// The peer's listener answered and refused (or is not plait): the network works, the
    /// settings or keys disagree. Reported with the operation "handshake", not "connect".
    Answered(String),
}

/// The operation a connection's error names when the peer's listener answered and refused it
/// (keys, token, group or version disagree): nothing a relay would mend.
pub const HANDSHAKE_OP: &str = "handshake";

/// Binds to `route.local.ip` (unless unspecified), connects to `(route.peer_ip, port)` and
/// handshakes. Connection refused or reset is retried until `deadline`, since the peer may not
/// be listening yet; a refused handshake or an unreachable network fails at once so the caller
/// can try its next route. Both ends prove the keys their ranks published (see `auth`).
pub fn connect(route: &Route, port: u16, hello: &Hello, auth: &LinkAuth, deadline: Instant) -> Result<LinkStream, PlaitError> {
    let hello = &Hello { mode: auth.mode(), ..hello.clone() };
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
    let mut backoff = Duration::from_millis(10);
    let mut last = String::from("no attempt made before the deadline");
    loop {
        if auth.cancelled() {
            return Err(PlaitError::Aborted { op: "connect".into(), reason: format!("start-up was called off while connecting to rank {}", hello.to) });
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(PlaitError::Timeout {
                op: "connect".into(),
                waiting_on: format!("rank {} at {peer} via {via} (last error: {last})", hello.to),
                waited: start.elapsed(),
            });
        }
        match attempt(local, peer, hello, auth, deadline) {
            Ok(s) => return Ok(s),
            Err(Attempt::Retry(why)) => {
                last = why;
                let left = deadline.saturating_duration_since(Instant::now());
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Err(attempt @ (Attempt::Fatal(_) | Attempt::Answered(_))) => {
                let (op, what) = match attempt {
                    Attempt::Answered(what) => (HANDSHAKE_OP, what),
                    Attempt::Fatal(what) | Attempt::Retry(what) => ("connect", what),
                };
                return Err(PlaitError::Peer {
                    op: op.into(),
                    peer: hello.to as usize,
                    addr: peer.to_string(),
                    what: format!("{what} (via {via})"),
                    waited: start.elapsed(),
                })
            }
        }
    }
}

fn attempt(local: IpAddr, peer: SocketAddr, hello: &Hello, auth: &LinkAuth, deadline: Instant) -> Result<LinkStream, Attempt> {
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
    // The hello and the first Noise message in one write (one packet, no Nagle wait).
    let mut msg = hello.encode();
    let initiator = auth::initiate(auth, hello, deadline, &mut msg).map_err(fatal)?;
    s.write_all(&msg).map_err(|e| classify(e, "sending hello"))?;

    let mut b = [0u8; REPLY_FIXED_LEN];
    read_exact_by(&mut s, &mut b, deadline).map_err(|e| classify(e, "awaiting handshake reply"))?;
    let answered = Attempt::Answered;
    if &b[..7] != REPLY_MAGIC {
        return Err(answered(format!(
            "answered the handshake with something that is not plait ({:02x?}); is another service on port {}?",
            &b[..7],
            peer.port()
        )));
    }
    if b[7] != VERSION {
        return Err(answered(format!("speaks handshake version {}, this side {VERSION}", b[7])));
    }
    let rlen = (u16::from_le_bytes([b[9], b[10]]) as usize).min(MAX_REASON_LEN);
    if b[8] != 1 {
        let mut r = vec![0u8; rlen];
        let _ = read_exact_by(&mut s, &mut r, deadline);
        return Err(answered(format!("refused the handshake: {}", String::from_utf8_lossy(&r))));
    }
    let cipher = match initiator.finish(auth, &mut s, deadline) {
        Ok(Ok(cipher)) => cipher,
        Ok(Err(why)) => return Err(answered(why)),
        Err(e) => return Err(classify(e, "authenticating")),
    };
    s.set_read_timeout(None).map_err(|e| classify(e, "handshake"))?;
    s.set_write_timeout(None).map_err(|e| classify(e, "handshake"))?;
    if let Err(e) = tune_stream(&s) {
        tracing::warn!(remote = %peer, "cannot tune link socket: {e}");
    }
    Ok(LinkStream { stream: s, cipher })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::auth::test_world;
    use crate::net::handshake::testing::{hello, lo_route, soon};
    use crate::net::listener::{Listener, HANDSHAKE_TIMEOUT};

    #[test]
    fn connect_retries_until_the_listener_appears() {
        // A bound but not listening socket holds the port, so connects are refused and no other
        // test's socket can take the port in the meantime.
        let hold = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        hold.bind(&SocketAddr::from(([0, 0, 0, 0], 0)).into()).unwrap();
        let port = hold.local_addr().unwrap().as_socket().unwrap().port();
        let a = test_world(2, None, false);
        let a1 = a[1].clone();
        let c = std::thread::spawn(move || connect(&lo_route(), port, &hello("g", 1, 1, 0, 2), &a1, soon(5000)));
        std::thread::sleep(Duration::from_millis(300));
        drop(hold);
        let l = Listener::bind_with(hello("g", 1, 0, 0, 2), a[0].clone(), port, HANDSHAKE_TIMEOUT).unwrap();
        l.accept_from(1, soon(5000)).unwrap();
        c.join().unwrap().unwrap();
    }

    #[test]
    fn bad_arguments_fail_fast() {
        let a = test_world(2, None, false);
        assert_eq!(connect(&lo_route(), 1, &hello("g", 1, 0, 1, 2), &a[0], soon(1000)).unwrap_err().kind(), "invalid");
        assert_eq!(connect(&lo_route(), 1, &hello("g", 1, 2, 1, 2), &a[1], soon(1000)).unwrap_err().kind(), "invalid");
        let mut r = lo_route();
        r.peer_ip = "::1".parse().unwrap();
        assert_eq!(connect(&r, 1, &hello("g", 1, 1, 0, 2), &a[1], soon(1000)).unwrap_err().kind(), "invalid");
        assert!(Listener::bind(hello("g", 1, 0, 2, 2), a[0].clone()).is_err());
    }
}
