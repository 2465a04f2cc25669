//! An interface's link speed and MTU.
//!
//! The route chooser prefers the faster of two links that reach the same peer (a direct cable
//! next to a shared LAN), and the link setup sizes socket buffers from the speed; neither std nor
//! if-addrs reports these, and every system keeps them somewhere else:
//!
//! - Linux: `/sys/class/net/<name>/{speed,mtu}`.
//! - macOS: the routing socket's interface dump (`NET_RT_IFLIST2`), whose `if_data64` carries a
//!   64-bit baud rate. getifaddrs' `if_data` has only a 32-bit one, which tops out at 4.29 Gbit/s
//!   and so cannot describe the 10 and 40 Gbit/s Thunderbolt links plait is meant for.
//! - Windows: `GetAdaptersAddresses`, matched by the adapter's friendly name, because that is
//!   the name if-addrs reports (and so the name in `IfaceAddr`).
//!
//! A value the system does not know is `None`: the route chooser then ranks that link below any
//! link of known speed (or MTU), and the link setup leaves the socket buffers to the system's
//! autotuning.

/// What the system says about one interface's link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkInfo {
    /// Negotiated speed in Mbit/s. Virtual interfaces (loopback, bridges, tunnels) and links that
    /// are down have none.
    pub speed_mbps: Option<u32>,
    pub mtu: Option<u32>,
}

/// Speed and MTU of the interface called `name` (as `if_addrs` names it); both `None` when no
/// such interface exists.
pub fn link_info(name: &str) -> LinkInfo {
    imp::link_info(name)
}

#[cfg(target_os = "linux")]
mod imp {
    use super::LinkInfo;

    pub fn link_info(name: &str) -> LinkInfo {
        // The name becomes a path component: one that could climb out of the interface's
        // directory is not an interface.
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            return LinkInfo::default();
        }
        let read = |what: &str| std::fs::read_to_string(format!("/sys/class/net/{name}/{what}")).ok();
        LinkInfo {
            speed_mbps: read("speed").as_deref().and_then(parse_sysfs_value),
            mtu: read("mtu").as_deref().and_then(parse_sysfs_value),
        }
    }

    /// A sysfs number. Virtual and down interfaces report a speed of -1 (or fail to read with
    /// EINVAL); zero and below mean unknown.
    pub fn parse_sysfs_value(text: &str) -> Option<u32> {
        let v: i64 = text.trim().parse().ok()?;
        u32::try_from(v).ok().filter(|&v| v > 0)
    }
}

#[cfg(target_os = "macos")]
mod imp {
    use super::LinkInfo;
    use std::ffi::CString;
    use std::mem::size_of;
    use std::ptr;

    pub fn link_info(name: &str) -> LinkInfo {
        let Some(data) = if_data64(name) else { return LinkInfo::default() };
        // Fields of a packed struct: copied out, never borrowed.
        let (baud, mtu) = (data.ifi_baudrate, data.ifi_mtu);
        LinkInfo {
            // A baud rate of 0 is what virtual interfaces report: unknown.
            speed_mbps: u32::try_from(baud / 1_000_000).ok().filter(|&m| m > 0),
            mtu: Some(mtu).filter(|&m| m > 0),
        }
    }

    /// The interface's statistics from a routing-socket dump restricted to that interface.
    fn if_data64(name: &str) -> Option<libc::if_data64> {
        let c_name = CString::new(name).ok()?;
        // SAFETY: a NUL-terminated string that outlives the call.
        let index = unsafe { libc::if_nametoindex(c_name.as_ptr()) };
        if index == 0 {
            return None;
        }
        // The last element restricts the dump to this interface index.
        let mut mib = [libc::CTL_NET, libc::PF_ROUTE, 0, 0, libc::NET_RT_IFLIST2, index as libc::c_int];
        let dump = sysctl_bytes(&mut mib)?;
        // The dump is a sequence of messages, each starting with its length (u16) and, at byte
        // 3, its type; the interface's own message is RTM_IFINFO2 (an if_msghdr2).
        let mut rest = &dump[..];
        while rest.len() >= 4 {
            let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
            if len < 4 || len > rest.len() {
                return None;
            }
            if rest[3] as libc::c_int == libc::RTM_IFINFO2 && len >= size_of::<libc::if_msghdr2>() {
                // SAFETY: at least size_of::<if_msghdr2>() bytes; read_unaligned because
                // messages are packed one after another in a byte buffer.
                let msg: libc::if_msghdr2 = unsafe { ptr::read_unaligned(rest.as_ptr().cast()) };
                let msg_index = msg.ifm_index;
                if u32::from(msg_index) == index {
                    return Some(msg.ifm_data);
                }
            }
            rest = &rest[len..];
        }
        None
    }

    /// The bytes of a sysctl whose size is only known at run time.
    fn sysctl_bytes(mib: &mut [libc::c_int]) -> Option<Vec<u8>> {
        // The table can grow between asking for its size and reading it: then ask again.
        for _ in 0..3 {
            let mut len = 0usize;
            // SAFETY: a size query (no output buffer) on a live mib array.
            let r = unsafe {
                libc::sysctl(mib.as_mut_ptr(), mib.len() as u32, ptr::null_mut(), &mut len, ptr::null_mut(), 0)
            };
            if r != 0 {
                return None;
            }
            let mut buf = vec![0u8; len];
            // SAFETY: the kernel writes at most len bytes into buf.
            let r = unsafe {
                libc::sysctl(mib.as_mut_ptr(), mib.len() as u32, buf.as_mut_ptr().cast(), &mut len, ptr::null_mut(), 0)
            };
            if r == 0 {
                buf.truncate(len);
                return Some(buf);
            }
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOMEM) {
                return None;
            }
        }
        None
    }
}

#[cfg(windows)]
mod imp {
    use super::LinkInfo;
    use std::ptr;
    use windows_sys::Win32::Foundation::{ERROR_BUFFER_OVERFLOW, ERROR_SUCCESS};
    use windows_sys::Win32::NetworkManagement::IpHelper::{
        GetAdaptersAddresses, GAA_FLAG_SKIP_ANYCAST, GAA_FLAG_SKIP_DNS_SERVER, GAA_FLAG_SKIP_MULTICAST,
        GAA_FLAG_SKIP_UNICAST, IP_ADAPTER_ADDRESSES_LH,
    };
    use windows_sys::Win32::Networking::WinSock::AF_UNSPEC;

    pub fn link_info(name: &str) -> LinkInfo {
        let Some(list) = adapters() else { return LinkInfo::default() };
        let mut next = list.as_ptr() as *const IP_ADAPTER_ADDRESSES_LH;
        while !next.is_null() {
            // SAFETY: a node of the list GetAdaptersAddresses wrote into `list`, which lives on.
            let adapter = unsafe { &*next };
            // SAFETY: FriendlyName is a NUL-terminated UTF-16 string inside `list`.
            if unsafe { wide_eq(adapter.FriendlyName, name) } {
                return LinkInfo {
                    // Bit/s; u64::MAX and 0 are what adapters without a known speed report.
                    speed_mbps: Some(adapter.TransmitLinkSpeed)
                        .filter(|&b| b != 0 && b != u64::MAX)
                        .and_then(|b| u32::try_from(b / 1_000_000).ok())
                        .filter(|&m| m > 0),
                    // The loopback adapter reports u32::MAX: no MTU.
                    mtu: Some(adapter.Mtu).filter(|&m| m != 0 && m != u32::MAX),
                };
            }
            next = adapter.Next;
        }
        LinkInfo::default()
    }

    /// Every adapter, without addresses (if-addrs lists those), as the buffer holding the list.
    fn adapters() -> Option<Vec<u64>> {
        let flags = GAA_FLAG_SKIP_UNICAST | GAA_FLAG_SKIP_ANYCAST | GAA_FLAG_SKIP_MULTICAST | GAA_FLAG_SKIP_DNS_SERVER;
        // Microsoft's advice: start at 15 KB, and grow to what the call asks for, which can
        // change between calls when an adapter appears.
        let mut bytes: u32 = 15 * 1024;
        for _ in 0..3 {
            // u64 elements: the list's nodes need 8-byte alignment.
            let mut buf = vec![0u64; (bytes as usize).div_ceil(8)];
            // SAFETY: buf has room for `bytes` bytes, and the call writes at most that many.
            let r = unsafe {
                GetAdaptersAddresses(AF_UNSPEC as u32, flags, ptr::null(), buf.as_mut_ptr().cast(), &mut bytes)
            };
            match r {
                ERROR_SUCCESS => return Some(buf),
                ERROR_BUFFER_OVERFLOW => continue,
                _ => return None,
            }
        }
        None
    }

    /// Whether the NUL-terminated UTF-16 string at `p` is `name`. Stops at the first unit that
    /// differs, so it never reads past the terminator.
    unsafe fn wide_eq(p: *const u16, name: &str) -> bool {
        !p.is_null()
            && name.encode_utf16().chain(std::iter::once(0)).enumerate().all(|(i, unit)| unsafe { *p.add(i) } == unit)
    }
}

/// Elsewhere nothing is read: every link is of unknown speed and MTU.
#[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
mod imp {
    use super::LinkInfo;

    pub fn link_info(_name: &str) -> LinkInfo {
        LinkInfo::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interface_that_does_not_exist_is_unknown() {
        assert_eq!(link_info("plait-no-such-if0"), LinkInfo::default());
        assert_eq!(link_info(""), LinkInfo::default());
    }

    #[test]
    fn names_that_would_leave_the_interface_directory_are_unknown() {
        assert_eq!(link_info("../lo"), LinkInfo::default());
        assert_eq!(link_info("lo/../lo"), LinkInfo::default());
        assert_eq!(link_info(".."), LinkInfo::default());
        assert_eq!(link_info(".hidden"), LinkInfo::default());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn loopback_has_an_mtu_but_no_speed() {
        let lo = link_info("lo");
        assert_eq!(lo.mtu, Some(65536), "{lo:?}");
        assert_eq!(lo.speed_mbps, None, "{lo:?}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn sysfs_values_at_and_below_zero_or_unreadable_are_unknown() {
        use super::imp::parse_sysfs_value;
        assert_eq!(parse_sysfs_value("-1\n"), None);
        assert_eq!(parse_sysfs_value("0\n"), None);
        assert_eq!(parse_sysfs_value("junk\n"), None);
        assert_eq!(parse_sysfs_value(""), None);
        assert_eq!(parse_sysfs_value("99999999999\n"), None, "beyond u32");
        assert_eq!(parse_sysfs_value("10000\n"), Some(10000));
        assert_eq!(parse_sysfs_value("1500"), Some(1500));
    }
}
