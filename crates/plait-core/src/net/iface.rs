//! Local interface addresses, as published to peers for route choice.
//!
//! Speed and MTU matter because a direct cable and a shared LAN often both reach the same peer;
//! the route chooser prefers the faster one, so we report what the system knows
//! (`platform::link`). The addresses come from if-addrs.

use crate::platform::link::link_info;
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IfaceAddr {
    pub name: String,
    pub ip: IpAddr,
    pub prefix: u8,
    /// `None`: unknown; routes rank it below any known MTU.
    pub mtu: Option<u32>,
    /// `None`: unknown; routes rank it below any known speed, and the link keeps the system's
    /// buffer autotuning.
    pub speed_mbps: Option<u32>,
}

/// All usable addresses of this host. Errors from the OS yield an empty list (logged), because
/// the caller can still fall back to loopback or the OS route.
pub fn list_interfaces() -> Vec<IfaceAddr> {
    let ifs = match if_addrs::get_if_addrs() {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!("cannot list network interfaces: {e}");
            return Vec::new();
        }
    };
    let mut out: Vec<IfaceAddr> = Vec::new();
    for i in ifs {
        let (ip, prefix) = match &i.addr {
            if_addrs::IfAddr::V4(a) => (IpAddr::V4(a.ip), a.prefixlen),
            if_addrs::IfAddr::V6(a) => (IpAddr::V6(a.ip), a.prefixlen),
        };
        // Link-local v6 needs a scope id to be usable, which peers cannot know for us.
        if is_v6_link_local(&ip) {
            continue;
        }
        let link = link_info(&i.name);
        let a = IfaceAddr {
            mtu: link.mtu,
            speed_mbps: link.speed_mbps,
            name: i.name,
            ip,
            prefix: prefix.min(max_prefix(&ip)),
        };
        if !out.contains(&a) {
            out.push(a);
        }
    }
    out
}

impl IfaceAddr {
    /// True if `ip` is in this address's subnet (same family, same network under `prefix`).
    pub fn contains(&self, ip: IpAddr) -> bool {
        in_subnet(self.ip, self.prefix, ip)
    }

    pub fn is_loopback(&self) -> bool {
        self.ip.is_loopback()
    }

    /// The network address of this subnet, e.g. 10.0.12.0 for 10.0.12.1/24.
    pub fn network(&self) -> IpAddr {
        network_of(self.ip, self.prefix)
    }

    /// "10.0.12.0/24": used in route reasons and logs.
    pub fn cidr(&self) -> String {
        format!("{}/{}", self.network(), self.prefix.min(max_prefix(&self.ip)))
    }
}

pub(crate) fn max_prefix(ip: &IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

pub(crate) fn network_of(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(a) => {
            let p = prefix.min(32) as u32;
            let mask = if p == 0 { 0 } else { u32::MAX << (32 - p) };
            IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask))
        }
        IpAddr::V6(a) => {
            let p = prefix.min(128) as u32;
            let mask = if p == 0 { 0 } else { u128::MAX << (128 - p) };
            IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask))
        }
    }
}

/// Whether `ip` lies in `net/prefix`; addresses of different families never match.
pub(crate) fn in_subnet(net: IpAddr, prefix: u8, ip: IpAddr) -> bool {
    if net.is_ipv4() != ip.is_ipv4() {
        return false;
    }
    network_of(net, prefix) == network_of(ip, prefix)
}

pub(crate) fn is_v6_link_local(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(a) if (a.segments()[0] & 0xffc0) == 0xfe80)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(ip: &str, prefix: u8) -> IfaceAddr {
        IfaceAddr { name: "x".into(), ip: ip.parse().unwrap(), prefix, mtu: None, speed_mbps: None }
    }

    #[test]
    fn subnet_membership() {
        let n = a("10.0.12.1", 24);
        assert!(n.contains("10.0.12.2".parse().unwrap()));
        assert!(n.contains("10.0.12.255".parse().unwrap()));
        assert!(!n.contains("10.0.13.2".parse().unwrap()));
        assert!(!n.contains("::1".parse().unwrap()));
        assert_eq!(n.cidr(), "10.0.12.0/24");
        assert!(a("1.2.3.4", 0).contains("9.9.9.9".parse().unwrap()));
        assert!(a("1.2.3.4", 32).contains("1.2.3.4".parse().unwrap()));
        assert!(!a("1.2.3.4", 32).contains("1.2.3.5".parse().unwrap()));
        let v6 = a("fd00::2", 64);
        assert!(v6.contains("fd00::ffff".parse().unwrap()));
        assert!(!v6.contains("fd01::2".parse().unwrap()));
        assert_eq!(v6.cidr(), "fd00::/64");
        assert!(a("127.0.0.1", 8).is_loopback());
        assert!(a("::1", 128).is_loopback());
        assert!(!n.is_loopback());
    }

    #[test]
    fn link_local_detection() {
        assert!(is_v6_link_local(&"fe80::1".parse().unwrap()));
        assert!(is_v6_link_local(&"febf::1".parse().unwrap()));
        assert!(!is_v6_link_local(&"fec0::1".parse().unwrap()));
        assert!(!is_v6_link_local(&"10.0.0.1".parse().unwrap()));
    }

    #[test]
    fn lists_this_hosts_loopback_without_link_local() {
        let l = list_interfaces();
        assert!(l.iter().any(|x| x.ip == IpAddr::V4(Ipv4Addr::LOCALHOST)), "{l:?}");
        assert!(l.iter().all(|x| !is_v6_link_local(&x.ip)), "{l:?}");
    }
}
