//! The listening sockets of a rank: every address (dual-stack), or one socket per chosen address,
//! all on the one port the rank publishes.

use crate::error::PlaitError;
use socket2::{Domain, Protocol, Socket, Type};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};

/// Attempts to find one port free on every address to bind.
const BIND_ATTEMPTS: usize = 16;

fn listen_socket(addr: SocketAddr) -> io::Result<TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() {
        // Dual-stack only for the unspecified address; a specific IPv6 address is just that.
        s.set_only_v6(!addr.ip().is_unspecified())?;
    }
    // Lets a fixed port be reused while old connections sit in TIME_WAIT. Not on Windows,
    // where it would let two listeners share the port.
    #[cfg(not(windows))]
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    s.listen(128)?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

/// Dual-stack [::] so IPv6 routes work too; plain 0.0.0.0 where IPv6 is unavailable.
pub(super) fn bind_any(port: u16) -> io::Result<TcpListener> {
    let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port);
    let v4 = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port);
    listen_socket(v6).or_else(|_| listen_socket(v4))
}

/// One socket per address, all on one port (the one a rank publishes): the first address picks
/// it (or `port`), the others take the same, and a port taken on a later address starts over
/// with a new one. An address that cannot be bound at all (gone since it was listed) is skipped
/// with a warning; none at all is an error.
pub(super) fn bind_each(addrs: &[IpAddr], port: u16) -> Result<Vec<TcpListener>, PlaitError> {
    let mut last = String::from("no address to listen on");
    for _ in 0..BIND_ATTEMPTS {
        let mut sockets: Vec<TcpListener> = Vec::new();
        let mut chosen = port;
        let mut retry = false;
        for &ip in addrs {
            match listen_socket(SocketAddr::new(ip, chosen)) {
                Ok(s) => {
                    chosen = s.local_addr().map(|a| a.port()).unwrap_or(chosen);
                    sockets.push(s);
                }
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && port == 0 && !sockets.is_empty() => {
                    last = format!("port {chosen} is taken on {ip}");
                    retry = true;
                    break;
                }
                Err(e) => {
                    tracing::warn!("cannot listen on {ip} port {chosen}: {e}; peers cannot reach this rank there");
                    last = format!("{ip} port {chosen}: {e}");
                }
            }
        }
        if !retry && !sockets.is_empty() {
            return Ok(sockets);
        }
        if !retry {
            break;
        }
    }
    Err(PlaitError::Io(format!("cannot listen on any of {addrs:?}: {last}")))
}
