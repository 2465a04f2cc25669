//! How large the system lets a TCP socket's buffers grow: on its own (autotuning), and at most
//! (the cap on what a program may set).
//!
//! Setting SO_RCVBUF or SO_SNDBUF turns autotuning off for that socket on Linux, macOS and
//! Windows alike, so a fixed size helps only where autotuning stops short of what a link needs
//! and the cap lets the program go further. Deciding that takes both figures; neither std nor
//! socket2 reports them, and each system keeps them elsewhere:
//!
//! - Linux: `/proc/sys/net/ipv4/tcp_{r,w}mem` (the third field is the autotuning maximum; it
//!   applies to IPv6 too) and `/proc/sys/net/core/{r,w}mem_max` (the cap).
//! - macOS: `net.inet.tcp.autorcvbufmax` / `autosndbufmax` (or the fixed `recvspace` /
//!   `sendspace` when autotuning is switched off) and `kern.ipc.maxsockbuf` (the cap).
//! - Windows: no figure is published. It autotunes the receive window itself (up to 16 MiB with
//!   window scaling) and grows send buffers on demand ("ideal send backlog"), so plait leaves its
//!   buffers alone there.
//!
//! An unknown figure is `None`; the caller then leaves the system's autotuning alone, because a
//! guessed fixed size would more likely shrink a fast link's window than grow it.

/// One figure for each direction of a socket, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BufferSizes {
    pub recv: Option<usize>,
    pub send: Option<usize>,
}

/// The largest buffers the system grows a TCP socket's buffers to by itself. Read once per
/// process: every connection of every communicator asks, and the settings are the host's.
pub fn autotuning_max() -> BufferSizes {
    static READ: std::sync::OnceLock<BufferSizes> = std::sync::OnceLock::new();
    *READ.get_or_init(imp::autotuning_max)
}

/// The largest buffers a program may set with SO_RCVBUF / SO_SNDBUF (read once, likewise).
pub fn system_cap() -> BufferSizes {
    static READ: std::sync::OnceLock<BufferSizes> = std::sync::OnceLock::new();
    *READ.get_or_init(imp::system_cap)
}

#[cfg(target_os = "linux")]
mod imp {
    use super::BufferSizes;

    pub fn autotuning_max() -> BufferSizes {
        BufferSizes {
            recv: read_value("/proc/sys/net/ipv4/tcp_rmem", parse_tcp_mem_max),
            send: read_value("/proc/sys/net/ipv4/tcp_wmem", parse_tcp_mem_max),
        }
    }

    pub fn system_cap() -> BufferSizes {
        BufferSizes {
            recv: read_value("/proc/sys/net/core/rmem_max", parse_number),
            send: read_value("/proc/sys/net/core/wmem_max", parse_number),
        }
    }

    pub fn read_value(path: &str, parse: fn(&str) -> Option<usize>) -> Option<usize> {
        parse(&std::fs::read_to_string(path).ok()?)
    }

    /// `tcp_rmem` / `tcp_wmem` hold "min default max"; autotuning grows a buffer up to max.
    pub fn parse_tcp_mem_max(text: &str) -> Option<usize> {
        text.split_whitespace().nth(2)?.parse().ok()
    }

    /// `rmem_max` / `wmem_max` hold one number.
    pub fn parse_number(text: &str) -> Option<usize> {
        text.trim().parse().ok()
    }
}

#[cfg(target_os = "macos")]
mod imp {
    use super::BufferSizes;
    use std::ffi::CString;
    use std::ptr;

    pub fn autotuning_max() -> BufferSizes {
        BufferSizes {
            recv: unaided_max("net.inet.tcp.doautorcvbuf", "net.inet.tcp.autorcvbufmax", "net.inet.tcp.recvspace"),
            send: unaided_max("net.inet.tcp.doautosndbuf", "net.inet.tcp.autosndbufmax", "net.inet.tcp.sendspace"),
        }
    }

    pub fn system_cap() -> BufferSizes {
        // sbreserve() refuses (ENOBUFS) a buffer above maxsockbuf * MCLBYTES / (MSIZE +
        // MCLBYTES), not above maxsockbuf itself: part of maxsockbuf is kept for mbuf headers.
        const MSIZE: usize = 256;
        const MCLBYTES: usize = 2048;
        let cap = sysctl_number("kern.ipc.maxsockbuf").map(|max| max.saturating_mul(MCLBYTES) / (MSIZE + MCLBYTES));
        BufferSizes { recv: cap, send: cap }
    }

    /// What a socket grows to without help: the autotuning maximum, or the fixed default
    /// buffer when autotuning is switched off.
    fn unaided_max(autotuning_on: &str, autotuning_max: &str, fixed: &str) -> Option<usize> {
        if sysctl_number(autotuning_on)? != 0 {
            sysctl_number(autotuning_max)
        } else {
            sysctl_number(fixed)
        }
    }

    /// A numeric sysctl; these are 32-bit ints on some releases and 64-bit on others.
    fn sysctl_number(name: &str) -> Option<usize> {
        let c_name = CString::new(name).ok()?;
        let mut value = [0u8; 8];
        let mut len = value.len();
        // SAFETY: the kernel writes at most len bytes into value.
        let r = unsafe { libc::sysctlbyname(c_name.as_ptr(), value.as_mut_ptr().cast(), &mut len, ptr::null_mut(), 0) };
        if r != 0 {
            return None;
        }
        match len {
            4 => Some(u32::from_ne_bytes(value[..4].try_into().ok()?) as usize),
            8 => usize::try_from(u64::from_ne_bytes(value)).ok(),
            _ => None,
        }
    }
}

/// Windows (see the module documentation) and every other system: nothing is known, so plait
/// never fixes a buffer size there.
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
mod imp {
    use super::BufferSizes;

    pub fn autotuning_max() -> BufferSizes {
        BufferSizes::default()
    }

    pub fn system_cap() -> BufferSizes {
        BufferSizes::default()
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::imp::{parse_number, parse_tcp_mem_max, read_value};
    use super::*;

    #[test]
    fn the_autotuning_maximum_is_the_third_field() {
        assert_eq!(parse_tcp_mem_max("4096\t131072\t6291456\n"), Some(6291456));
        assert_eq!(parse_tcp_mem_max("4096 16384 4194304"), Some(4194304));
        assert_eq!(parse_tcp_mem_max("4096\t131072\n"), None, "a field short");
        assert_eq!(parse_tcp_mem_max("4096\t131072\tlots\n"), None);
    }

    #[test]
    fn the_cap_is_one_number() {
        assert_eq!(parse_number("212992\n"), Some(212992));
        assert_eq!(parse_number("\n"), None);
        assert_eq!(parse_number("-1\n"), None);
    }

    #[test]
    fn a_missing_file_is_unknown() {
        assert_eq!(read_value("/proc/sys/net/plait/no_such_setting", parse_number), None);
    }

    #[test]
    fn this_host_publishes_all_four() {
        // Every Linux with IPv4 has these files; the test bed's namespaces do too.
        let (auto, cap) = (autotuning_max(), system_cap());
        assert!(auto.recv.is_some() && auto.send.is_some(), "{auto:?}");
        assert!(cap.recv.is_some() && cap.send.is_some(), "{cap:?}");
    }
}
