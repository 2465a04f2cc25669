//! Socket options for data links: TCP_NODELAY, keepalive, and send/receive buffers sized past
//! the system's autotuning where a link needs it.

use crate::platform::sockbuf;
use socket2::{SockRef, TcpKeepalive};
use std::io;
use std::net::TcpStream;
use std::time::Duration;

const LINK_BUF: usize = 4 << 20;

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

/// The most bytes one data connection's buffers hold, sending and receiving, as `tune_stream`
/// leaves them: its fixed size where it sets one, else how far autotuning grows them (None:
/// unknown).
pub fn stream_buffer_limits() -> (Option<usize>, Option<usize>) {
    let (auto, cap) = (sockbuf::autotuning_max(), sockbuf::system_cap());
    (fixed_buffer(LINK_BUF, auto.send, cap.send).or(auto.send), fixed_buffer(LINK_BUF, auto.recv, cap.recv).or(auto.recv))
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
}
