//! Which ranks share a host, and this host's name.
//!
//! Two ranks on one host talk over loopback, which never touches a network. "One host" here
//! means one kernel boot and one network stack: the hostname is no test (two machines may share
//! it, and every clone of an image does), and neither is an address (every host has 127.0.0.1 and
//! often the same docker0 bridge). Each system offers a different identifier:
//!
//! - Linux: the boot id plus the network namespace. The namespace counts because two processes
//!   in different namespaces share no loopback (the test bed emulates hosts exactly that way).
//! - macOS: `kern.bootsessionuuid`, new at every boot; a Mac has one network stack. Not
//!   `kern.uuid`: that is the kernel build's UUID, the same on every Mac of a release.
//! - Windows: the installation's `MachineGuid` plus the hostname. Images cloned without sysprep
//!   share a MachineGuid, and the hostname (which must differ between machines on one network)
//!   tells them apart; clones that share both are taken for one host.
//!
//! Where the identity cannot be read it is `None`, and a peer is on the same host only when both
//! identities are known and equal (`same_host`): a rank on another host mistaken for a local one
//! would be dialled on its loopback address, which is ours.

/// This host's identity, or `None` where the system does not say (the caller then treats every
/// peer as another host).
pub fn host_identity() -> Option<String> {
    imp::host_identity()
}

/// This host's name, for messages and reports only (see the module documentation); `None` where
/// the system does not say.
pub fn hostname() -> Option<String> {
    imp::hostname().filter(|name| !name.is_empty())
}

/// Whether two ranks with these identities share a host: only when both are known and equal.
pub fn same_host(a: Option<&str>, b: Option<&str>) -> bool {
    matches!((a, b), (Some(a), Some(b)) if a == b)
}

#[cfg(target_os = "linux")]
mod imp {
    pub fn host_identity() -> Option<String> {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let boot = boot.trim();
        // "net:[4026531840]": the inode that names the namespace.
        let netns = std::fs::read_link("/proc/self/ns/net").ok()?;
        (!boot.is_empty()).then(|| format!("{boot}/{}", netns.display()))
    }

    pub fn hostname() -> Option<String> {
        std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|s| s.trim().to_string())
    }
}

#[cfg(target_os = "macos")]
mod imp {
    use std::ffi::{CStr, CString};
    use std::ptr;

    pub fn host_identity() -> Option<String> {
        sysctl_string("kern.bootsessionuuid")
    }

    pub fn hostname() -> Option<String> {
        // 256: the largest hostname POSIX allows (255) and its NUL.
        let mut buf = [0u8; 256];
        // SAFETY: gethostname writes at most buf.len() bytes into buf.
        if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
            return None;
        }
        CStr::from_bytes_until_nul(&buf).ok().map(|name| name.to_string_lossy().into_owned())
    }

    fn sysctl_string(name: &str) -> Option<String> {
        let c_name = CString::new(name).ok()?;
        // Room for a UUID string (36 characters and a NUL) and then some.
        let mut buf = [0u8; 64];
        let mut len = buf.len();
        // SAFETY: the kernel writes at most len bytes into buf.
        let r = unsafe { libc::sysctlbyname(c_name.as_ptr(), buf.as_mut_ptr().cast(), &mut len, ptr::null_mut(), 0) };
        if r != 0 {
            return None;
        }
        let value = CStr::from_bytes_until_nul(&buf[..len]).ok()?.to_str().ok()?;
        (!value.is_empty()).then(|| value.to_string())
    }
}

#[cfg(windows)]
mod imp {
    use std::ptr;
    use windows_sys::Win32::Foundation::ERROR_SUCCESS;
    use windows_sys::Win32::System::Registry::{
        RegGetValueW, HKEY_LOCAL_MACHINE, RRF_RT_REG_SZ, RRF_SUBKEY_WOW6464KEY,
    };
    use windows_sys::Win32::System::SystemInformation::{ComputerNamePhysicalDnsHostname, GetComputerNameExW};

    pub fn host_identity() -> Option<String> {
        let guid = machine_guid()?;
        let host = hostname().filter(|name| !name.is_empty())?;
        Some(format!("{guid}/{host}"))
    }

    pub fn hostname() -> Option<String> {
        // The name of this machine itself, not a cluster's virtual name.
        let mut buf = [0u16; 256];
        let mut len = buf.len() as u32;
        // SAFETY: writes at most len UTF-16 units into buf, and sets len to the name's length.
        if unsafe { GetComputerNameExW(ComputerNamePhysicalDnsHostname, buf.as_mut_ptr(), &mut len) } == 0 {
            return None;
        }
        String::from_utf16(&buf[..len as usize]).ok()
    }

    fn machine_guid() -> Option<String> {
        let key: Vec<u16> = "SOFTWARE\\Microsoft\\Cryptography".encode_utf16().chain([0]).collect();
        let value: Vec<u16> = "MachineGuid".encode_utf16().chain([0]).collect();
        let mut buf = [0u16; 128];
        let mut bytes = std::mem::size_of_val(&buf) as u32;
        // WOW6464KEY: a 32-bit process would otherwise be sent to the WOW6432Node copy of the
        // key, which has no MachineGuid.
        // SAFETY: NUL-terminated key and value names; the call writes at most `bytes` bytes
        // into buf and sets `bytes` to what it wrote, the NUL included.
        let r = unsafe {
            RegGetValueW(
                HKEY_LOCAL_MACHINE,
                key.as_ptr(),
                value.as_ptr(),
                RRF_RT_REG_SZ | RRF_SUBKEY_WOW6464KEY,
                ptr::null_mut(),
                buf.as_mut_ptr().cast(),
                &mut bytes,
            )
        };
        if r != ERROR_SUCCESS {
            return None;
        }
        let units = &buf[..(bytes as usize / 2).min(buf.len())];
        let guid = String::from_utf16(units).ok()?;
        let guid = guid.trim_end_matches('\0');
        (!guid.is_empty()).then(|| guid.to_string())
    }
}

/// Elsewhere nothing is read: every peer counts as another host, and messages show no hostname.
#[cfg(not(any(target_os = "linux", target_os = "macos", windows)))]
mod imp {
    pub fn host_identity() -> Option<String> {
        None
    }

    pub fn hostname() -> Option<String> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_on_either_side_is_another_host() {
        assert!(same_host(Some("a"), Some("a")));
        assert!(!same_host(Some("a"), Some("b")));
        assert!(!same_host(Some("a"), None));
        assert!(!same_host(None, Some("a")));
        assert!(!same_host(None, None), "two unknowns are not one host");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn linux_identity_is_known_stable_and_names_the_network_namespace() {
        let id = host_identity().expect("boot id and network namespace are readable on Linux");
        assert_eq!(host_identity().as_deref(), Some(id.as_str()));
        let netns = std::fs::read_link("/proc/self/ns/net").unwrap();
        assert!(id.ends_with(&format!("/{}", netns.display())), "{id}");
        assert!(hostname().is_some());
    }

    /// Prints this process's identity; run by the next test inside another network namespace.
    #[test]
    #[ignore = "a helper: run by another_network_namespace_is_another_host"]
    fn print_host_identity() {
        println!("identity={}", host_identity().unwrap_or_default());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn another_network_namespace_is_another_host() {
        let me = std::env::current_exe().unwrap();
        let out = std::process::Command::new("unshare")
            .arg("-n")
            .arg(me)
            .args(["--ignored", "--exact", "--nocapture", "platform::host::tests::print_host_identity"])
            .output();
        let out = match out {
            Ok(out) if out.status.success() => out,
            Ok(out) => {
                println!("skipped: `unshare -n` failed: {}", String::from_utf8_lossy(&out.stderr).trim());
                return;
            }
            Err(e) => {
                println!("skipped: cannot run `unshare`: {e}");
                return;
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let theirs = stdout.lines().find_map(|l| l.strip_prefix("identity=")).expect("the child printed its identity");
        let mine = host_identity().unwrap();
        assert!(!theirs.is_empty(), "{stdout}");
        assert_ne!(theirs, mine);
        // Same boot, so only the namespace differs.
        assert_eq!(theirs.split('/').next(), mine.split('/').next());
    }
}
