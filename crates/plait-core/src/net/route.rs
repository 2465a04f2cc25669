//! Per-peer route choice for direct-cabled meshes.
//!
//! On a mesh where every pair of hosts has its own cable (its own small subnet) plus a shared,
//! slower LAN, the OS routing table happily sends everything over the LAN. We instead pick, per
//! peer, the local address whose subnet contains one of the peer's addresses, and bind to it
//! before connecting so traffic stays on that cable.

use crate::error::PlaitError;
use crate::net::iface::{in_subnet, max_prefix, IfaceAddr};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Route {
    /// Bind to `local.ip` before connecting. An unspecified address (0.0.0.0 / ::) means "let
    /// the OS choose".
    pub local: IfaceAddr,
    pub peer_ip: IpAddr,
    pub reason: String,
}

/// Candidates in order of preference to reach a peer that published `peer_addrs`.
///
/// 1. `same_host`: 127.0.0.1 -> 127.0.0.1 ("same host"). Not subject to the filter: same-host
///    traffic never leaves the kernel, so there is no network for the filter to protect.
/// 2. Subnet matches: an allowed, non-loopback local address whose subnet contains a peer
///    address, ordered by link speed, then MTU (both the slower end's value when both ends
///    report it; unknown sorts last), then longer prefix; ties keep the local listing order.
/// 3. Peer addresses that no local subnet contains, via the OS routing table: bound to the first
///    allowed local address of the same family when a filter is given (so the user's interface
///    choice is honoured, as NCCL does), unbound otherwise. With a filter that allows no address
///    of that family the candidate is dropped rather than leaking onto an excluded network.
///
/// Loopback addresses are only ever paired with each other, and only for `same_host`. A peer
/// address equal to one of ours is skipped unless `same_host`: it is a bridge every host has
/// (docker0 172.17.0.1, virbr0 192.168.122.1), and connecting to it would reach ourselves.
pub fn candidate_routes(
    local: &[IfaceAddr],
    peer_addrs: &[IfaceAddr],
    same_host: bool,
    iface_filter: Option<&IfaceFilter>,
) -> Vec<Route> {
    let mut out: Vec<Route> = Vec::new();
    let allowed = |a: &IfaceAddr| iface_filter.is_none_or(|f| f.allows(a));

    if same_host {
        let lo_ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let lo = local.iter().find(|a| a.ip == lo_ip).cloned().unwrap_or(IfaceAddr {
            name: "lo".into(),
            ip: lo_ip,
            prefix: 8,
            mtu: None,
            speed_mbps: None,
        });
        out.push(Route { local: lo, peer_ip: lo_ip, reason: "same host".into() });
    }

    let own: HashSet<IpAddr> = local.iter().map(|a| a.ip).collect();
    let peers: Vec<&IfaceAddr> = peer_addrs
        .iter()
        .filter(|p| usable_peer_ip(&p.ip) && (same_host || !own.contains(&p.ip)))
        .collect();

    let mut matched: Vec<(&IfaceAddr, &IfaceAddr)> = Vec::new();
    for l in local.iter().filter(|l| usable_local_ip(&l.ip) && allowed(l)) {
        for p in &peers {
            if l.contains(p.ip) && !matched.iter().any(|(ml, mp)| ml.ip == l.ip && mp.ip == p.ip) {
                matched.push((l, p));
            }
        }
    }
    // Stable sort: equal links keep the order the OS listed them in.
    matched.sort_by_key(|(l, p)| {
        (
            Reverse(path_value(l.speed_mbps, p.speed_mbps)),
            Reverse(path_value(l.mtu, p.mtu)),
            Reverse(l.prefix),
        )
    });
    for (l, p) in &matched {
        out.push(Route {
            local: (*l).clone(),
            peer_ip: p.ip,
            reason: format!("subnet match on {} {}", l.name, l.cidr()),
        });
    }

    for p in &peers {
        if matched.iter().any(|(_, mp)| mp.ip == p.ip) || out.iter().any(|r| r.peer_ip == p.ip) {
            continue;
        }
        let bind = match iface_filter {
            Some(f) => local
                .iter()
                .find(|l| usable_local_ip(&l.ip) && l.ip.is_ipv4() == p.ip.is_ipv4() && f.allows(l))
                .cloned(),
            None => Some(unspecified_like(&p.ip)),
        };
        match bind {
            Some(l) => out.push(Route {
                local: l,
                peer_ip: p.ip,
                reason: "no subnet match; OS route".into(),
            }),
            None => tracing::debug!(
                "route to peer address {} dropped: interface filter allows no local {} address",
                p.ip,
                if p.ip.is_ipv4() { "IPv4" } else { "IPv6" }
            ),
        }
    }
    out
}

/// The local addresses a listener binds so that every route a peer may choose to this rank
/// reaches it, and nothing else: `None` (every address, dual-stack) without a filter, else
/// 127.0.0.1 (same-host routes ignore the filter, see `candidate_routes`) and every usable local
/// address the filter allows. A peer's route ends at one of our published addresses that its own
/// subnet match or the OS route picked; with the same `PLAIT_IFACE` on every rank those are the
/// allowed ones.
pub fn listen_addrs(local: &[IfaceAddr], iface_filter: Option<&IfaceFilter>) -> Option<Vec<IpAddr>> {
    let f = iface_filter?;
    let mut out = vec![IpAddr::V4(Ipv4Addr::LOCALHOST)];
    for a in local.iter().filter(|a| usable_local_ip(&a.ip) && f.allows(a)) {
        if !out.contains(&a.ip) {
            out.push(a.ip);
        }
    }
    Some(out)
}

/// Value of a path property limited by its slower end; 0 when neither end knows.
fn path_value(a: Option<u32>, b: Option<u32>) -> u32 {
    match (a, b) {
        (Some(x), Some(y)) => x.min(y),
        (Some(x), None) | (None, Some(x)) => x,
        (None, None) => 0,
    }
}

fn usable_peer_ip(ip: &IpAddr) -> bool {
    !ip.is_loopback() && !ip.is_unspecified() && !ip.is_multicast()
}

fn usable_local_ip(ip: &IpAddr) -> bool {
    usable_peer_ip(ip)
}

fn unspecified_like(ip: &IpAddr) -> IfaceAddr {
    let any = match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    IfaceAddr { name: "*".into(), ip: any, prefix: 0, mtu: None, speed_mbps: None }
}

/// Interface selection in NCCL_SOCKET_IFNAME syntax, plus CIDR entries.
///
/// `eth,en` name prefixes; `=eth0` exact names (a leading `=` makes the whole list exact, as in
/// NCCL; `=` on later entries makes just that entry exact); a leading `^` turns the list into
/// exclusions (`^docker,lo`, `^=docker0`); `10.0.0.0/8` or a bare address matches by address.
#[derive(Clone, Debug, PartialEq)]
pub struct IfaceFilter {
    exclude: bool,
    entries: Vec<FilterEntry>,
}

#[derive(Clone, Debug, PartialEq)]
enum FilterEntry {
    Prefix(String),
    Exact(String),
    Net(IpAddr, u8),
}

impl IfaceFilter {
    pub fn parse(spec: &str) -> Result<Self, PlaitError> {
        let bad = |why: String| PlaitError::Config(format!("interface filter {spec:?}: {why}"));
        let mut rest = spec.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = rest[1..].trim_start();
        }
        let all_exact = rest.starts_with('=');
        if all_exact {
            rest = &rest[1..];
        }
        let mut entries = Vec::new();
        // Empty entries (a trailing comma) are tolerated; a list with none is an error.
        for tok in rest.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            if let Some(name) = tok.strip_prefix('=') {
                if name.is_empty() {
                    return Err(bad("'=' must be followed by an interface name".into()));
                }
                entries.push(FilterEntry::Exact(name.to_string()));
            } else if let Some((addr, len)) = tok.split_once('/') {
                let ip: IpAddr =
                    addr.trim().parse().map_err(|_| bad(format!("{tok:?} is not a CIDR (bad address)")))?;
                let len: u8 =
                    len.trim().parse().map_err(|_| bad(format!("{tok:?} is not a CIDR (bad prefix length)")))?;
                if len > max_prefix(&ip) {
                    return Err(bad(format!("{tok:?}: prefix length {len} is too long for this address family")));
                }
                entries.push(FilterEntry::Net(ip, len));
            } else if let Ok(ip) = tok.parse::<IpAddr>() {
                entries.push(FilterEntry::Net(ip, max_prefix(&ip)));
            } else if tok.contains('^') || tok.contains('=') {
                return Err(bad(format!("{tok:?}: '^' and '=' are only allowed at the start")));
            } else if all_exact {
                entries.push(FilterEntry::Exact(tok.to_string()));
            } else {
                entries.push(FilterEntry::Prefix(tok.to_string()));
            }
        }
        if entries.is_empty() {
            return Err(bad("no interface names or CIDRs given".into()));
        }
        Ok(IfaceFilter { exclude, entries })
    }

    pub fn allows(&self, a: &IfaceAddr) -> bool {
        let hit = self.entries.iter().any(|e| match e {
            FilterEntry::Prefix(p) => a.name.starts_with(p.as_str()),
            FilterEntry::Exact(n) => a.name == *n,
            FilterEntry::Net(net, len) => in_subnet(*net, *len, a.ip),
        });
        hit != self.exclude
    }
}

/// Among subnet matches, a subnet this peer alone shares with us (a cable) goes before one that
/// other ranks are on too (a LAN or switch), whatever the interfaces report as speed: a shared
/// medium divides its bandwidth, a cable does not. The order is otherwise kept.
/// `others` holds the addresses of every rank except the peer.
pub fn prefer_dedicated(mut candidates: Vec<Route>, others: &[&[IfaceAddr]]) -> Vec<Route> {
    let sharing = |r: &Route| -> usize {
        if r.local.is_loopback() || !r.reason.starts_with("subnet match") {
            return 0;
        }
        others.iter().filter(|addrs| addrs.iter().any(|a| r.local.contains(a.ip) && a.ip != r.local.ip)).count()
    };
    let keyed: Vec<(bool, usize)> = candidates.iter().map(|r| (r.reason.starts_with("subnet match"), sharing(r))).collect();
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    // Only subnet matches move, and only among themselves.
    let subnet_slots: Vec<usize> = order.iter().copied().filter(|&i| keyed[i].0).collect();
    let mut sorted = subnet_slots.clone();
    sorted.sort_by_key(|&i| keyed[i].1);
    for (slot, i) in subnet_slots.iter().zip(sorted) {
        order[*slot] = i;
    }
    let mut taken: Vec<Option<Route>> = candidates.drain(..).map(Some).collect();
    order.into_iter().map(|i| taken[i].take().unwrap()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ifa(name: &str, cidr: &str, speed: Option<u32>, mtu: Option<u32>) -> IfaceAddr {
        let (ip, p) = cidr.split_once('/').unwrap();
        IfaceAddr { name: name.into(), ip: ip.parse().unwrap(), prefix: p.parse().unwrap(), mtu, speed_mbps: speed }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Three hosts, each pair on its own /24 cable (10G, jumbo frames), all on a 1G LAN, and all
    /// with docker0 at the same 172.17.0.1. The LAN is listed first, as it often is.
    fn host(n: u8) -> Vec<IfaceAddr> {
        let mut v = vec![
            ifa("lo", "127.0.0.1/8", None, Some(65536)),
            ifa("eno1", &format!("192.168.1.{}/24", 10 + n), Some(1000), Some(1500)),
            ifa("docker0", "172.17.0.1/16", None, Some(1500)),
        ];
        for m in 1..=3u8 {
            if m != n {
                let (lo, hi) = (n.min(m), n.max(m));
                v.push(ifa(
                    &format!("enp{m}s0"),
                    &format!("10.0.{lo}{hi}.{n}/24"),
                    Some(10000),
                    Some(9000),
                ));
            }
        }
        v
    }

    #[test]
    fn filter_parses_nccl_syntax() {
        let a = |name: &str, addr: &str| ifa(name, &format!("{addr}/24"), None, None);
        let f = IfaceFilter::parse("eth,en").unwrap();
        assert!(f.allows(&a("eth0", "1.1.1.1")));
        assert!(f.allows(&a("enp1s0", "1.1.1.1")));
        assert!(!f.allows(&a("docker0", "1.1.1.1")));

        let f = IfaceFilter::parse("^docker,lo").unwrap();
        assert!(!f.allows(&a("docker0", "1.1.1.1")));
        assert!(!f.allows(&a("lo", "127.0.0.1")));
        assert!(f.allows(&a("eth0", "1.1.1.1")));

        let f = IfaceFilter::parse("=eth0").unwrap();
        assert!(f.allows(&a("eth0", "1.1.1.1")));
        assert!(!f.allows(&a("eth01", "1.1.1.1")));

        let f = IfaceFilter::parse("^=eth0, eth1").unwrap();
        assert!(!f.allows(&a("eth0", "1.1.1.1")));
        assert!(!f.allows(&a("eth1", "1.1.1.1")));
        assert!(f.allows(&a("eth10", "1.1.1.1")), "whole list is exact after a leading '='");

        let f = IfaceFilter::parse("eth,=ib0").unwrap();
        assert!(f.allows(&a("eth7", "1.1.1.1")));
        assert!(f.allows(&a("ib0", "1.1.1.1")));
        assert!(!f.allows(&a("ib01", "1.1.1.1")));

        let f = IfaceFilter::parse("10.0.0.0/8,fd00::/64").unwrap();
        assert!(f.allows(&a("whatever", "10.200.3.4")));
        assert!(!f.allows(&a("whatever", "11.0.0.1")));
        assert!(f.allows(&ifa("x", "fd00::5/64", None, None)));
        assert!(!f.allows(&ifa("x", "fd01::5/64", None, None)));

        let f = IfaceFilter::parse("^192.168.1.0/24,").unwrap();
        assert!(!f.allows(&a("eno1", "192.168.1.9")));
        assert!(f.allows(&a("eno1", "192.168.2.9")));

        let f = IfaceFilter::parse("10.0.12.1").unwrap();
        assert!(f.allows(&a("x", "10.0.12.1")));
        assert!(!f.allows(&a("x", "10.0.12.2")));

        for bad in ["", "  ", "^", "^=", ",", "10.0.0.0/33", "::/129", "10.0.0/8", "10.0.0.0/x", "eth,^lo", "a=b", "="] {
            let e = IfaceFilter::parse(bad);
            assert!(matches!(e, Err(PlaitError::Config(_))), "{bad:?} -> {e:?}");
        }
    }

    #[test]
    fn triangle_each_peer_gets_its_cable() {
        let hosts = [host(1), host(2), host(3)];
        for me in 1..=3u8 {
            for peer in 1..=3u8 {
                if me == peer {
                    continue;
                }
                let r = candidate_routes(&hosts[me as usize - 1], &hosts[peer as usize - 1], false, None);
                let (lo, hi) = (me.min(peer), me.max(peer));
                let first = &r[0];
                assert_eq!(first.local.ip, ip(&format!("10.0.{lo}{hi}.{me}")), "{me}->{peer}: {r:#?}");
                assert_eq!(first.peer_ip, ip(&format!("10.0.{lo}{hi}.{peer}")));
                assert_eq!(first.reason, format!("subnet match on enp{peer}s0 10.0.{lo}{hi}.0/24"));
                // Then the LAN, then the peer's other cable via the OS route, nothing else.
                assert_eq!(r[1].local.name, "eno1");
                assert_eq!(r[1].peer_ip, ip(&format!("192.168.1.{}", 10 + peer)));
                assert!(r[1].reason.starts_with("subnet match on eno1 192.168.1.0/24"));
                assert_eq!(r.len(), 3, "{r:#?}");
                assert_eq!(r[2].reason, "no subnet match; OS route");
                assert!(r[2].local.ip.is_unspecified());
                let other = 6 - me - peer;
                let (olo, ohi) = (peer.min(other), peer.max(other));
                assert_eq!(r[2].peer_ip, ip(&format!("10.0.{olo}{ohi}.{peer}")));
                for x in &r {
                    assert!(!x.peer_ip.is_loopback() && !x.local.is_loopback());
                    assert_ne!(x.peer_ip, ip("172.17.0.1"), "own docker bridge is not the peer");
                    assert_ne!(x.local.name, format!("enp{other}s0"), "never the cable to the third host");
                }
            }
        }
    }

    #[test]
    fn same_host_prefers_loopback() {
        let h = host(1);
        let r = candidate_routes(&h, &h, true, None);
        assert_eq!(r[0].reason, "same host");
        assert_eq!(r[0].local.ip, ip("127.0.0.1"));
        assert_eq!(r[0].peer_ip, ip("127.0.0.1"));
        assert!(r[1..].iter().all(|x| !x.peer_ip.is_loopback() && !x.local.is_loopback()));
        // Loopback even when the filter excludes lo, and when no local loopback was listed.
        let f = IfaceFilter::parse("^lo").unwrap();
        let nolo: Vec<_> = h.iter().filter(|a| !a.is_loopback()).cloned().collect();
        let r = candidate_routes(&nolo, &h, true, Some(&f));
        assert_eq!((r[0].local.ip, r[0].peer_ip), (ip("127.0.0.1"), ip("127.0.0.1")));
    }

    #[test]
    fn listeners_bind_only_what_the_filter_allows() {
        let h = host(1);
        assert_eq!(listen_addrs(&h, None), None, "no filter: every address");
        let f = IfaceFilter::parse("lo").unwrap();
        assert_eq!(listen_addrs(&h, Some(&f)).unwrap(), [ip("127.0.0.1")]);
        let f = IfaceFilter::parse("enp").unwrap();
        assert_eq!(listen_addrs(&h, Some(&f)).unwrap(), [ip("127.0.0.1"), ip("10.0.12.1"), ip("10.0.13.1")]);
        // Exclusions keep loopback (same-host routes) and drop the excluded.
        let f = IfaceFilter::parse("^docker,enp").unwrap();
        assert_eq!(listen_addrs(&h, Some(&f)).unwrap(), [ip("127.0.0.1"), ip("192.168.1.11")]);
        // IPv6 addresses the filter allows are bound too; link-local and multicast never are.
        let v6 = vec![ifa("eth0", "fd00::1/64", None, None), ifa("eth0", "192.0.2.1/24", None, None)];
        let f = IfaceFilter::parse("eth0").unwrap();
        assert_eq!(listen_addrs(&v6, Some(&f)).unwrap(), [ip("127.0.0.1"), ip("fd00::1"), ip("192.0.2.1")]);
        let f = IfaceFilter::parse("=nonexistent").unwrap();
        assert_eq!(listen_addrs(&h, Some(&f)).unwrap(), [ip("127.0.0.1")]);
    }

    #[test]
    fn loopback_never_paired_across_hosts() {
        let mine = vec![ifa("lo", "127.0.0.1/8", None, None)];
        let peer = vec![ifa("lo", "127.0.0.1/8", None, None), ifa("lo", "::1/128", None, None)];
        assert!(candidate_routes(&mine, &peer, false, None).is_empty());
        let mine = vec![ifa("lo", "127.0.0.1/8", None, None), ifa("eth0", "10.1.1.1/24", None, None)];
        let r = candidate_routes(&mine, &peer, false, None);
        assert!(r.is_empty(), "{r:?}");
    }

    #[test]
    fn filter_excludes_interfaces() {
        let hosts = [host(1), host(2)];
        // Excluding the cables leaves the LAN, and the OS-route fallback binds to an allowed
        // address rather than leaking onto a cable.
        let f = IfaceFilter::parse("^enp").unwrap();
        let r = candidate_routes(&hosts[0], &hosts[1], false, Some(&f));
        assert_eq!(r[0].local.name, "eno1");
        assert_eq!(r[0].peer_ip, ip("192.168.1.12"));
        assert!(r.iter().all(|x| !x.local.name.starts_with("enp")), "{r:#?}");
        assert!(r.iter().all(|x| !x.local.ip.is_unspecified()), "{r:#?}");
        assert!(r.iter().any(|x| x.peer_ip == ip("10.0.12.2") && x.reason == "no subnet match; OS route"));

        // Docker bridges at different addresses on each host would otherwise match.
        let mut b = hosts[1].clone();
        b.iter_mut().find(|a| a.name == "docker0").unwrap().ip = ip("172.17.0.2");
        let r = candidate_routes(&hosts[0], &b, false, None);
        assert!(r.iter().any(|x| x.local.name == "docker0"));
        let f = IfaceFilter::parse("^docker,lo").unwrap();
        let r = candidate_routes(&hosts[0], &b, false, Some(&f));
        assert!(r.iter().all(|x| x.local.name != "docker0"), "{r:#?}");
        assert_eq!(r[0].local.name, "enp2s0");

        // Include list by CIDR: only the cable.
        let f = IfaceFilter::parse("10.0.0.0/16").unwrap();
        let r = candidate_routes(&hosts[0], &hosts[1], false, Some(&f));
        assert_eq!(r[0].local.ip, ip("10.0.12.1"));
        assert!(r.iter().all(|x| x.local.ip.to_string().starts_with("10.0.")), "{r:#?}");

        // A filter allowing nothing of the peer's family drops the fallback instead of leaking.
        let f = IfaceFilter::parse("=nonexistent").unwrap();
        assert!(candidate_routes(&hosts[0], &hosts[1], false, Some(&f)).is_empty());
    }

    #[test]
    fn ordering_speed_then_mtu_then_prefix() {
        let peer = vec![
            ifa("p", "10.1.0.2/16", None, None),
            ifa("p", "10.2.0.2/24", None, None),
            ifa("p", "10.3.0.2/24", None, None),
            ifa("p", "10.4.0.2/24", None, None),
        ];
        let mine = vec![
            ifa("unknown", "10.4.0.1/24", None, None),
            ifa("wide", "10.1.0.1/16", Some(1000), Some(1500)),
            ifa("narrow", "10.1.0.3/24", Some(1000), Some(1500)),
            ifa("jumbo", "10.2.0.1/24", Some(1000), Some(9000)),
            ifa("fast", "10.3.0.1/24", Some(25000), Some(1500)),
        ];
        let r = candidate_routes(&mine, &peer, false, None);
        let names: Vec<&str> = r.iter().map(|x| x.local.name.as_str()).collect();
        assert_eq!(names, ["fast", "jumbo", "narrow", "wide", "unknown"]);

        // The slower end limits the path: a 100G local port to a 1G peer port is a 1G link.
        let peer = vec![ifa("a", "10.5.0.2/24", Some(1000), None), ifa("b", "10.6.0.2/24", Some(10000), None)];
        let mine = vec![ifa("big", "10.5.0.1/24", Some(100000), None), ifa("mid", "10.6.0.1/24", Some(10000), None)];
        let r = candidate_routes(&mine, &peer, false, None);
        assert_eq!(r[0].local.name, "mid");
    }

    #[test]
    fn ipv6_subnet_and_fallback() {
        let mine = vec![ifa("eth0", "fd00::1/64", Some(10000), None), ifa("eth0", "192.0.2.1/24", Some(10000), None)];
        let peer = vec![ifa("eth0", "fd00::2/64", None, None), ifa("eth1", "2001:db8::7/64", None, None)];
        let r = candidate_routes(&mine, &peer, false, None);
        assert_eq!(r[0].peer_ip, ip("fd00::2"));
        assert_eq!(r[0].local.ip, ip("fd00::1"));
        assert_eq!(r[1].peer_ip, ip("2001:db8::7"));
        assert_eq!(r[1].local.ip, ip("::"));
        let f = IfaceFilter::parse("eth").unwrap();
        let r = candidate_routes(&mine, &peer, false, Some(&f));
        assert_eq!(r[1].local.ip, ip("fd00::1"), "fallback binds to an allowed address of the same family");
    }
}
