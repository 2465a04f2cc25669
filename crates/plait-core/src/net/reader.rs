//! The reading side of a peer link, which two kinds of thread can drive:
//!
//! - the link's own receiver thread (the default), which waits in `poll` and reads frames as
//!   they come, so bulk transfers on every link proceed at once;
//! - the thread that waits for a small operation ("caller progress"): it reads the frames its
//!   operation waits for itself, so a small message costs one thread wake-up instead of two
//!   (the receiver's, then the caller's). On an oversubscribed machine that hand-off is most of
//!   a small allreduce's time.
//!
//! Whoever reads holds `frame_lock` for whole frames, so the stream never interleaves. In
//! caller mode the receiver thread parks and only drains what is waiting once per heartbeat
//! period, so heartbeats, Abort frames and closed connections are still noticed while the
//! caller is busy elsewhere.

use super::frame::{FrameHeader, FrameKind};
use super::peer::Inbox;
use parking_lot::{Condvar, Mutex};
use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) struct ReadSide {
    pub peer: usize,
    stream: TcpStream,
    inbox: Arc<dyn Inbox>,
    heartbeat: Duration,
    frame_lock: Mutex<()>,
    caller_mode: AtomicBool,
    park: Mutex<()>,
    unpark: Condvar,
    /// Wakes the receiver thread out of `poll` when the caller takes over.
    kick: OwnedFd,
    /// Nanoseconds since `epoch_start` when the last byte arrived from this peer.
    pub last_rx: Arc<AtomicU64>,
    pub epoch_start: Instant,
    /// Set when this side stops reading on purpose: nobody reports the link's end.
    pub deaf: Arc<AtomicBool>,
    /// The link ended (reported once) or the peer said Close.
    ended: AtomicBool,
    closed_cleanly: AtomicBool,
}

impl ReadSide {
    pub fn new(
        peer: usize,
        stream: TcpStream,
        inbox: Arc<dyn Inbox>,
        heartbeat: Duration,
        last_rx: Arc<AtomicU64>,
        epoch_start: Instant,
        deaf: Arc<AtomicBool>,
    ) -> io::Result<ReadSide> {
        // SAFETY: eventfd returns a new descriptor (or -1), owned from here on.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let kick = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(ReadSide {
            peer,
            stream,
            inbox,
            heartbeat,
            frame_lock: Mutex::new(()),
            caller_mode: AtomicBool::new(false),
            park: Mutex::new(()),
            unpark: Condvar::new(),
            kick,
            last_rx,
            epoch_start,
            deaf,
            ended: AtomicBool::new(false),
            closed_cleanly: AtomicBool::new(false),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Whether a caller may poll and read this link now.
    pub fn readable_by_caller(&self) -> bool {
        self.caller_mode.load(Ordering::Acquire) && !self.ended.load(Ordering::Acquire) && !self.deaf.load(Ordering::Acquire)
    }

    /// Hands reading to callers (true) or back to the receiver thread (false).
    pub fn set_caller_mode(&self, on: bool) {
        if self.caller_mode.swap(on, Ordering::AcqRel) == on {
            return;
        }
        if on {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to our eventfd.
            unsafe { libc::write(self.kick.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
        } else {
            let _g = self.park.lock();
            self.unpark.notify_all();
        }
    }

    /// Wakes the receiver thread so it sees the link was shut down.
    pub fn wake(&self) {
        let _g = self.park.lock();
        self.unpark.notify_all();
        let one: u64 = 1;
        // SAFETY: as in set_caller_mode.
        unsafe { libc::write(self.kick.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
    }

    /// The receiver thread's loop.
    pub fn run(&self) {
        loop {
            if self.deaf.load(Ordering::Acquire) || self.ended.load(Ordering::Acquire) {
                return;
            }
            if self.caller_mode.load(Ordering::Acquire) {
                {
                    let mut g = self.park.lock();
                    if self.caller_mode.load(Ordering::Acquire) && !self.deaf.load(Ordering::Acquire) {
                        self.unpark.wait_for(&mut g, self.heartbeat);
                    }
                }
                if self.caller_mode.load(Ordering::Acquire) {
                    // Nobody may be waiting on this link: keep liveness and control frames flowing.
                    if let Some(_g) = self.frame_lock.try_lock() {
                        self.read_waiting(None);
                    }
                }
                continue;
            }
            let (sock, kick) = poll_two(self.fd(), self.kick.as_raw_fd(), None);
            if kick {
                let mut word = 0u64;
                // SAFETY: reads 8 bytes into a live u64 (non-blocking eventfd).
                unsafe { libc::read(self.kick.as_raw_fd(), &mut word as *mut u64 as *mut libc::c_void, 8) };
            }
            if sock {
                let _g = self.frame_lock.lock();
                // A caller may have read the frame while this thread waited for the lock.
                if readable_now(self.fd()) {
                    if let Err(e) = self.read_frame(None) {
                        self.end(e);
                    }
                }
            }
        }
    }

    /// Reads every frame already waiting (under `frame_lock`, held by the caller). A frame
    /// begun is read to its end, waiting until `deadline` at most for the rest of it.
    /// Returns false when the link ended.
    pub fn read_waiting(&self, deadline: Option<Instant>) -> bool {
        while !self.ended.load(Ordering::Acquire) && !self.deaf.load(Ordering::Acquire) && readable_now(self.fd()) {
            if let Err(e) = self.read_frame(deadline) {
                self.end(e);
                return false;
            }
        }
        !self.ended.load(Ordering::Acquire)
    }

    /// Reads what is waiting on behalf of a caller, taking the frame lock by `deadline`.
    pub fn caller_read(&self, deadline: Instant) -> bool {
        match self.frame_lock.try_lock_until(deadline) {
            Some(_g) => self.read_waiting(Some(deadline)),
            None => true,
        }
    }

    fn read_frame(&self, deadline: Option<Instant>) -> io::Result<()> {
        let mut r = FdReader { fd: self.fd(), deadline };
        let header = FrameHeader::read_from(&mut r)?;
        self.touch();
        match FrameKind::from_u8(header.kind) {
            Some(FrameKind::Heartbeat) => return Ok(()),
            Some(FrameKind::Close) => self.closed_cleanly.store(true, Ordering::Release),
            _ => {}
        }
        let mut payload = CountingReader { inner: r, left: header.nbytes, side: self };
        self.inbox.deliver(self.peer, &header, &mut payload)?;
        if payload.left != 0 {
            // Only a read that failed part-way leaves payload behind: the link went down mid-frame.
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection closed in the middle of a message"));
        }
        Ok(())
    }

    fn touch(&self) {
        self.last_rx.store(self.epoch_start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// The link ended with `err`: report it once, unless this side stopped reading on purpose.
    fn end(&self, err: io::Error) {
        if self.ended.swap(true, Ordering::AcqRel) || self.deaf.load(Ordering::Acquire) {
            return;
        }
        self.wake();
        self.inbox.link_down(self.peer, err, self.closed_cleanly.load(Ordering::Acquire));
    }
}

/// Reads from a socket descriptor; with a deadline, never blocks past it (a peer that stops
/// in the middle of a frame cannot hold the reading thread forever).
struct FdReader {
    fd: RawFd,
    deadline: Option<Instant>,
}

impl Read for FdReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let flags = if self.deadline.is_some() { libc::MSG_DONTWAIT } else { 0 };
        loop {
            // SAFETY: reads at most buf.len() bytes into buf.
            let n = unsafe { libc::recv(self.fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), flags) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {
                    let deadline = self.deadline.expect("blocking reads do not return EAGAIN");
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "the peer stopped sending in the middle of a message"));
                    }
                    poll_two(self.fd, -1, Some(left));
                }
                _ => return Err(err),
            }
        }
    }
}

/// Reads at most the frame's payload, refreshing the liveness clock as bytes arrive.
struct CountingReader<'a> {
    inner: FdReader,
    left: u64,
    side: &'a ReadSide,
}

impl Read for CountingReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let max = buf.len().min(self.left as usize);
        let n = self.inner.read(&mut buf[..max])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed mid-frame"));
        }
        self.left -= n as u64;
        self.side.touch();
        Ok(n)
    }
}

fn to_poll_ms(wait: Option<Duration>) -> libc::c_int {
    match wait {
        None => -1,
        // Round up: a 0.3 ms wait must not become a busy loop of zero-timeout polls.
        Some(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int,
    }
}

/// Waits until `a` or `b` (-1: none) is readable (or closed); returns which are.
fn poll_two(a: RawFd, b: RawFd, wait: Option<Duration>) -> (bool, bool) {
    let mut fds = [
        libc::pollfd { fd: a, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: b, events: libc::POLLIN, revents: 0 },
    ];
    let n = if b < 0 { 1 } else { 2 };
    // SAFETY: fds is a live array of n pollfd.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), n, to_poll_ms(wait)) };
    if r <= 0 {
        return (false, false);
    }
    (fds[0].revents != 0, n == 2 && fds[1].revents != 0)
}

fn readable_now(fd: RawFd) -> bool {
    poll_two(fd, -1, Some(Duration::ZERO)).0
}

/// Waits up to `wait` until one of `sides` has something to read, then reads what every ready
/// one has waiting (frames begun are finished by `deadline`). Returns whether anything was read.
pub(super) fn caller_progress(sides: &[&ReadSide], wait: Duration, deadline: Instant) -> bool {
    if sides.is_empty() {
        std::thread::sleep(wait.min(Duration::from_millis(1)));
        return false;
    }
    let mut fds: Vec<libc::pollfd> = sides.iter().map(|s| libc::pollfd { fd: s.fd(), events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: fds is a live array of pollfd of the given length.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, to_poll_ms(Some(wait))) };
    if r <= 0 {
        return false;
    }
    for (side, fd) in sides.iter().zip(&fds) {
        if fd.revents != 0 {
            side.caller_read(deadline);
        }
    }
    true
}
