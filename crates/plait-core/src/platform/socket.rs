//! Socket calls the link reader needs and neither std nor socket2 offers portably.
//!
//! A link's socket stays in blocking mode, because its sender thread writes to it blocking and
//! the mode is shared by every handle of the socket. So "read what is there, but do not wait" is
//! a per-call choice: `recv(MSG_DONTWAIT)` on Unix; Windows has no such flag, so it asks first
//! whether a read would block (`WSAPoll` with a zero timeout) and only then reads.

use std::io;
use std::net::TcpStream;
use std::time::Duration;

/// One receive into `buf`: `Ok(0)` is the end of the stream (the peer closed). With `wait`
/// false it never blocks: nothing there is `Err(WouldBlock)`.
pub fn recv(stream: &TcpStream, buf: &mut [u8], wait: bool) -> io::Result<usize> {
    imp::recv(stream, buf, wait)
}

/// Waits up to `timeout` for `stream` to have something to read (or to be closed); returns
/// whether it has (an interrupted wait: false). For a thread that already owns the stream's reading and waits for the rest
/// of a message; several sockets, or a wait that another thread must be able to cut short,
/// go through a `polling::Poller` instead.
pub fn wait_readable(stream: &TcpStream, timeout: Duration) -> io::Result<bool> {
    // Round up: a 0.3 ms wait must not become a busy loop of zero-timeout polls.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    imp::wait_readable(stream, ms)
}

/// Sets the receive low-water mark: a blocked receive (and readiness) waits for at least
/// `bytes`, so a thread reading a large payload wakes once per `bytes` instead of once per
/// packet. Returns false where the system refuses it; Windows has no such option (its
/// readers then wake per packet, which costs CPU, not correctness).
pub fn set_recv_lowat(stream: &TcpStream, bytes: usize) -> bool {
    imp::set_recv_lowat(stream, bytes.clamp(1, i32::MAX as usize) as i32)
}

#[cfg(unix)]
mod imp {
    use std::io;
    use std::net::TcpStream;
    use std::os::fd::AsRawFd;

    pub fn recv(stream: &TcpStream, buf: &mut [u8], wait: bool) -> io::Result<usize> {
        let flags = if wait { 0 } else { libc::MSG_DONTWAIT };
        // macOS refuses a length over INT_MAX (EINVAL) where Linux reads less: ask for less.
        let len = buf.len().min(i32::MAX as usize);
        // SAFETY: reads at most len <= buf.len() bytes into buf, from a socket the stream keeps open.
        let n = unsafe { libc::recv(stream.as_raw_fd(), buf.as_mut_ptr().cast(), len, flags) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    pub fn wait_readable(stream: &TcpStream, ms: i32) -> io::Result<bool> {
        let mut fd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd.
        match unsafe { libc::poll(&mut fd, 1, ms) } {
            r if r >= 0 => Ok(r > 0),
            _ => match io::Error::last_os_error() {
                e if e.kind() == io::ErrorKind::Interrupted => Ok(false),
                e => Err(e),
            },
        }
    }

    pub fn set_recv_lowat(stream: &TcpStream, bytes: i32) -> bool {
        // SAFETY: passes a live c_int of the size given.
        let r = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&bytes as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        };
        r == 0
    }
}

#[cfg(windows)]
mod imp {
    use std::io::{self, Read};
    use std::net::TcpStream;
    use std::os::windows::io::AsRawSocket;
    use windows_sys::Win32::Networking::WinSock::{WSAPoll, POLLRDNORM, WSAPOLLFD};

    pub fn recv(stream: &TcpStream, buf: &mut [u8], wait: bool) -> io::Result<usize> {
        if !wait && !wait_readable(stream, 0)? {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        // Readable: this returns data, the end of the stream or an error without blocking.
        let mut s = stream;
        s.read(buf)
    }

    pub fn wait_readable(stream: &TcpStream, ms: i32) -> io::Result<bool> {
        // POLLRDNORM also reports a closed or reset connection (as POLLHUP/POLLERR).
        let mut fd = WSAPOLLFD { fd: stream.as_raw_socket() as usize, events: POLLRDNORM, revents: 0 };
        // SAFETY: one live WSAPOLLFD.
        match unsafe { WSAPoll(&mut fd, 1, ms) } {
            r if r >= 0 => Ok(r > 0),
            _ => Err(io::Error::last_os_error()),
        }
    }

    pub fn set_recv_lowat(_stream: &TcpStream, _bytes: i32) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;
    use std::time::Instant;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn a_receive_that_must_not_wait_returns_would_block_then_the_data_then_the_end() {
        let (mut a, b) = pair();
        let mut buf = [0u8; 16];
        assert_eq!(recv(&b, &mut buf, false).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        assert!(!wait_readable(&b, Duration::from_millis(20)).unwrap());
        a.write_all(b"hello").unwrap();
        assert!(wait_readable(&b, Duration::from_secs(5)).unwrap());
        assert_eq!(recv(&b, &mut buf, false).unwrap(), 5);
        assert_eq!(&buf[..5], b"hello");
        drop(a);
        assert!(wait_readable(&b, Duration::from_secs(5)).unwrap(), "a closed connection counts as readable");
        assert_eq!(recv(&b, &mut buf, false).unwrap(), 0);
    }

    #[test]
    fn a_short_wait_is_not_a_busy_loop() {
        let (_a, b) = pair();
        let t = Instant::now();
        assert!(!wait_readable(&b, Duration::from_micros(300)).unwrap());
        assert!(t.elapsed() >= Duration::from_micros(300), "waited only {:?}", t.elapsed());
    }

    #[test]
    #[cfg(unix)]
    fn the_low_water_mark_can_be_set_on_unix() {
        let (_a, b) = pair();
        assert!(set_recv_lowat(&b, 256 * 1024));
        assert!(set_recv_lowat(&b, 1));
    }
}
