//! Memory two processes of one host share: a region one creates under a fresh name and the other
//! opens by that name (what `net::shm` builds its rings on).
//!
//! - Linux: a file in `/dev/shm` (tmpfs, so never written to a disk), created with mode 0600 and
//!   its pages reserved at once (`posix_fallocate`): a full tmpfs is an error here, at set-up,
//!   instead of a SIGBUS at the first write. A region that would leave less than half of
//!   `/dev/shm` free is refused too: other programs of the host use it (a container's is 64 MiB,
//!   and torch's DataLoader workers pass their batches through it).
//! - macOS: a POSIX shared-memory object (`shm_open`, mode 0600).
//! - Windows and anything else: unsupported (`create` fails), and links between processes of one
//!   host stay on loopback TCP, which every platform has.
//!
//! A thread that waits for the other process to change a word of the region sleeps on a futex
//! on Linux (`wait_while`, `wake`); elsewhere it polls with short sleeps.
//!
//! The name is random (64 bits from the OS), so nothing guesses it and two regions never collide.
//! Whoever holds the name may remove it (`unlink`) once both ends have mapped the region: the
//! mapping outlives the name, and a crash leaves nothing behind after that.

use std::io;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Whether `wake` ends another process's `wait_while` (Linux: a futex). Elsewhere a wait is a
/// plain sleep of its timeout, and the caller polls.
pub const CAN_WAKE: bool = cfg!(target_os = "linux");

/// Sleeps while `word` (in shared memory) holds `seen`, until `wake` on it, or `timeout`; may
/// return early for no reason (callers look again). Linux: a futex (one the other process can
/// wake, not a private one). Elsewhere: a sleep of `timeout`.
pub fn wait_while(word: &AtomicU32, seen: u32, timeout: Duration) {
    imp::wait_while(word, seen, timeout)
}

/// Wakes every thread in `wait_while` on `word`, in any process.
pub fn wake(word: &AtomicU32) {
    imp::wake(word)
}

/// A mapped region of shared memory.
pub struct Region {
    map: memmap2::MmapRaw,
    name: String,
}

impl Region {
    /// A new region of `len` bytes (zeroed) under a fresh name.
    pub fn create(len: usize) -> io::Result<Region> {
        let mut id = [0u8; 8];
        getrandom::fill(&mut id).map_err(|e| io::Error::other(format!("no random name for shared memory: {e}")))?;
        let name = format!("plait-{:016x}", u64::from_le_bytes(id));
        let map = imp::create(&name, len)?;
        Ok(Region { map, name })
    }

    /// Maps the region `name` another process created; it must hold at least `len` bytes.
    pub fn open(name: &str, len: usize) -> io::Result<Region> {
        if !name.starts_with("plait-") || name.len() > 31 || !name[6..].bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a plait shared-memory name")));
        }
        let map = imp::open(name, len)?;
        Ok(Region { map, name: name.to_string() })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Removes the name (the mapping stays); a name already gone is no error.
    pub fn unlink(&self) {
        imp::unlink(&self.name)
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use std::fs::{File, OpenOptions};
    use std::io;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    use std::path::PathBuf;
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    fn path(name: &str) -> PathBuf {
        PathBuf::from("/dev/shm").join(name)
    }

    pub fn create(name: &str, len: usize) -> io::Result<memmap2::MmapRaw> {
        keeps_half_free(len)?;
        let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path(name))?;
        // SAFETY: a plain call on an fd we own.
        let err = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if err != 0 {
            unlink(name);
            return Err(io::Error::from_raw_os_error(err));
        }
        map(&file, len).inspect_err(|_| unlink(name))
    }

    pub fn open(name: &str, len: usize) -> io::Result<memmap2::MmapRaw> {
        let file = OpenOptions::new().read(true).write(true).open(path(name))?;
        if file.metadata()?.len() < len as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("shared memory {name} is smaller than {len} bytes")));
        }
        map(&file, len)
    }

    /// Refuses a region that would leave less than half of /dev/shm free (see the module doc).
    fn keeps_half_free(len: usize) -> io::Result<()> {
        let dir = std::ffi::CString::new("/dev/shm").unwrap();
        // SAFETY: a NUL-terminated path and a zeroed struct the call fills in.
        let mut fs: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(dir.as_ptr(), &mut fs) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let block = fs.f_frsize as u64;
        let (total, free) = (fs.f_blocks as u64 * block, fs.f_bavail as u64 * block);
        if free.saturating_sub(len as u64) < total / 2 {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("/dev/shm has {} MiB free of {} MiB, and {} MiB more would leave less than half of it free", free >> 20, total >> 20, len >> 20),
            ));
        }
        Ok(())
    }

    fn map(file: &File, len: usize) -> io::Result<memmap2::MmapRaw> {
        memmap2::MmapOptions::new().len(len).map_raw(file)
    }

    pub fn unlink(name: &str) {
        let _ = std::fs::remove_file(path(name));
    }

    pub fn wait_while(word: &AtomicU32, seen: u32, timeout: Duration) {
        let ts = libc::timespec { tv_sec: timeout.as_secs() as _, tv_nsec: timeout.subsec_nanos() as _ };
        // SAFETY: the word is a live, aligned u32; FUTEX_WAIT only reads it. Errors (EAGAIN: the
        // word changed; EINTR; ETIMEDOUT) all mean "look again".
        unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, seen, &ts as *const libc::timespec, 0usize, 0u32) };
    }

    pub fn wake(word: &AtomicU32) {
        // SAFETY: as above; FUTEX_WAKE does not touch the word.
        unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32) };
    }
}

#[cfg(target_vendor = "apple")]
mod imp {
    use std::ffi::CString;
    use std::fs::File;
    use std::io;
    use std::os::fd::FromRawFd;

    fn c_name(name: &str) -> CString {
        CString::new(format!("/{name}")).expect("names are hex digits")
    }

    fn shm_open(name: &str, flags: libc::c_int) -> io::Result<File> {
        // SAFETY: a NUL-terminated name; the fd returned is ours alone.
        let fd = unsafe { libc::shm_open(c_name(name).as_ptr(), flags, 0o600 as libc::c_uint) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just opened and nothing else owns it.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    pub fn create(name: &str, len: usize) -> io::Result<memmap2::MmapRaw> {
        let file = shm_open(name, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL)?;
        let mapped = file.set_len(len as u64).and_then(|()| memmap2::MmapOptions::new().len(len).map_raw(&file));
        if mapped.is_err() {
            unlink(name);
        }
        mapped
    }

    pub fn open(name: &str, len: usize) -> io::Result<memmap2::MmapRaw> {
        let file = shm_open(name, libc::O_RDWR)?;
        if file.metadata()?.len() < len as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("shared memory {name} is smaller than {len} bytes")));
        }
        memmap2::MmapOptions::new().len(len).map_raw(&file)
    }

    pub fn unlink(name: &str) {
        // SAFETY: a NUL-terminated name.
        unsafe { libc::shm_unlink(c_name(name).as_ptr()) };
    }

    pub fn wait_while(_word: &std::sync::atomic::AtomicU32, _seen: u32, timeout: std::time::Duration) {
        // No futex another process can wake: a sleep, which the caller keeps short.
        std::thread::sleep(timeout)
    }

    pub fn wake(_word: &std::sync::atomic::AtomicU32) {}
}

#[cfg(not(any(target_os = "linux", target_vendor = "apple")))]
mod imp {
    use std::io;

    fn unsupported() -> io::Error {
        io::Error::new(io::ErrorKind::Unsupported, "plait has no shared memory between processes on this platform")
    }

    pub fn create(_name: &str, _len: usize) -> io::Result<memmap2::MmapRaw> {
        Err(unsupported())
    }

    pub fn open(_name: &str, _len: usize) -> io::Result<memmap2::MmapRaw> {
        Err(unsupported())
    }

    pub fn unlink(_name: &str) {}

    pub fn wait_while(_word: &std::sync::atomic::AtomicU32, _seen: u32, timeout: std::time::Duration) {
        // No futex another process can wake: a sleep, which the caller keeps short.
        std::thread::sleep(timeout)
    }

    pub fn wake(_word: &std::sync::atomic::AtomicU32) {}
}

#[cfg(all(test, any(target_os = "linux", target_vendor = "apple")))]
mod tests {
    use super::*;

    #[test]
    fn a_region_created_by_one_side_is_the_memory_the_other_opens() {
        let a = Region::create(1 << 16).unwrap();
        // SAFETY: both mappings cover 64 KiB; one thread writes, then reads.
        unsafe { a.as_ptr().add(4000).write(42) };
        let b = Region::open(a.name(), 1 << 16).unwrap();
        assert_eq!(unsafe { b.as_ptr().add(4000).read() }, 42);
        a.unlink();
        unsafe { b.as_ptr().add(9).write(7) };
        assert_eq!(unsafe { a.as_ptr().add(9).read() }, 7, "the mapping outlives its name");
        assert!(Region::open(a.name(), 1 << 16).is_err(), "the name is gone");
    }

    #[test]
    fn names_that_are_not_ours_and_short_regions_are_refused() {
        assert_eq!(Region::open("../etc/passwd", 8).err().unwrap().kind(), io::ErrorKind::InvalidInput);
        let a = Region::create(4096).unwrap();
        assert!(Region::open(a.name(), 8192).is_err());
        a.unlink();
    }
}
