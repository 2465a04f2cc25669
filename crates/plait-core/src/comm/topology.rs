//! What the links look like once they are up: an explicit route file, the route records every
//! rank shares through the store, and the topology class all ranks derive from them alike.

use crate::error::{PlaitError, Result};
use crate::net::iface::IfaceAddr;
use crate::net::route::Route;
use crate::sched::cost::Hosts;
use crate::sched::order::LinkMatrix;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// How ranks are wired, as far as algorithm choice is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Topology {
    /// One process, no links.
    Single,
    /// Every rank reaches every peer over its own interface (a cable per pair): links are
    /// independent, so direct algorithms use all of them at once.
    FullMesh,
    /// Every rank's links share one interface (a switch, or loopback on one host).
    Shared,
    /// Anything in between.
    PartialMesh,
}

impl Topology {
    pub fn name(self) -> &'static str {
        match self {
            Topology::Single => "single",
            Topology::FullMesh => "full_mesh",
            Topology::Shared => "shared",
            Topology::PartialMesh => "partial_mesh",
        }
    }
}

/// One rank's view of one link, published so every rank sees the whole matrix.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LinkRecord {
    pub peer: usize,
    pub local_iface: String,
    pub local: String,
    pub remote: String,
    pub same_host: bool,
    /// The link's round trip, measured by this rank at start-up (the best of a few pings).
    pub rtt_us: Option<f64>,
    pub reason: String,
    /// TCP connections to this peer (`PLAIT_STREAMS`).
    #[serde(default = "one")]
    pub streams: usize,
    /// Bytes per second from the peer to this rank, measured at start-up (`PLAIT_MEASURE`).
    #[serde(default)]
    pub rx_bytes_per_s: Option<f64>,
    /// The most connections this rank lets start-up open to the peer (`PLAIT_STREAMS_MAX`, and
    /// `streams` for a link kept from an elastic view before).
    #[serde(default = "one")]
    pub max_streams: usize,
    /// The most bytes one connection's socket buffers hold on this side, sending and receiving:
    /// the size set for the link, or how far the system's autotuning grows them (None: unknown).
    #[serde(default)]
    pub send_buffer: Option<u64>,
    #[serde(default)]
    pub recv_buffer: Option<u64>,
    /// The speed of this rank's interface for the link, in bytes per second (None: unknown, as
    /// for loopback).
    #[serde(default)]
    pub iface_bytes_per_s: Option<f64>,
    /// The rank this link's frames go through, for a peer this rank cannot connect to
    /// (`PLAIT_RELAY`); its latency and rate are those of the two hops (see `comm::relay`).
    #[serde(default)]
    pub via: Option<usize>,
    /// Connections of the link whose large payloads go through shared memory (`PLAIT_SHM_BYTES`,
    /// ranks of one host), as this rank found them once the link answered its first probes.
    #[serde(default)]
    pub shm_lanes: usize,
}

impl LinkRecord {
    /// A link as connected, before anything is measured.
    pub fn connected(peer: usize, local_iface: String, local: String, remote: String, same_host: bool, reason: String, streams: usize) -> LinkRecord {
        LinkRecord {
            peer,
            local_iface,
            local,
            remote,
            same_host,
            rtt_us: None,
            reason,
            streams,
            rx_bytes_per_s: None,
            max_streams: streams,
            send_buffer: None,
            recv_buffer: None,
            iface_bytes_per_s: None,
            via: None,
            shm_lanes: 0,
        }
    }
}

fn one() -> usize {
    1
}

/// Every directed link's latency (half the round trip its sender measured) and bandwidth (as its
/// receiver measured it), from every rank's link records; None unless every link was measured.
/// Pure, so every rank builds the same matrix from the same records.
pub fn link_matrix(records: &[Vec<LinkRecord>]) -> Option<LinkMatrix> {
    let rec = |r: usize, peer: usize| records.get(r)?.iter().find(|l| l.peer == peer);
    LinkMatrix::from_fn(records.len(), |i, j| Some((rec(i, j)?.rtt_us? / 2e6, rec(j, i)?.rx_bytes_per_s?)))
}

/// Which ranks share a host and which interface each link to another host leaves by, when the
/// ranks sit on more than one host and some host holds more than one (`cost::Hosts`): the cost
/// model then prices a host's memory and its network interfaces apart. Ranks joined by a
/// same-host link share a host. Pure, so every rank reaches the same answer from the same records.
pub fn hosts(records: &[Vec<LinkRecord>]) -> Option<Hosts> {
    let n = records.len();
    let mut host: Vec<usize> = (0..n).collect();
    for (r, links) in records.iter().enumerate() {
        for l in links.iter().filter(|l| l.same_host && l.peer < n) {
            let (a, b) = (host[r].min(host[l.peer]), host[r].max(host[l.peer]));
            for h in host.iter_mut().filter(|h| **h == b) {
                *h = a;
            }
        }
    }
    let by_peer: Vec<std::collections::HashMap<usize, &LinkRecord>> =
        records.iter().map(|links| links.iter().map(|l| (l.peer, l)).collect()).collect();
    let record = |r: usize, p: usize| by_peer.get(r).and_then(|m| m.get(&p)).copied();
    let iface = |r: usize, p: usize| {
        let Some(l) = record(r, p) else { return String::new() };
        match l.via {
            // Relayed through a rank of its own host: the frames leave by the relay's interface.
            Some(v) if v < n && host[v] == host[r] => record(v, p).map_or_else(String::new, |l| l.local_iface.clone()),
            _ => l.local_iface.clone(),
        }
    };
    Hosts::new(&host, iface)
}

/// Derives the topology from every rank's link records (`records[r]` = rank r's links). Pure,
/// so every rank reaches the same answer from the same records.
pub fn classify(records: &[Vec<LinkRecord>]) -> Topology {
    if records.len() <= 1 {
        return Topology::Single;
    }
    let mut dedicated = true;
    let mut shared = true;
    for links in records {
        let mut names: Vec<&str> = links.iter().map(|l| l.local_iface.as_str()).collect();
        // By address, not name: loopback is `lo` on Linux, `lo0` on macOS, a pseudo-adapter on Windows.
        let on_loopback = |l: &LinkRecord| l.local.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
        let loopback = links.iter().any(|l| l.same_host || l.local_iface.is_empty() || on_loopback(l));
        names.sort_unstable();
        let distinct = {
            let mut d = names.clone();
            d.dedup();
            d.len()
        };
        dedicated &= !loopback && distinct == names.len();
        shared &= distinct <= 1;
    }
    match (dedicated, shared) {
        // With two ranks a single link is both; it is a dedicated cable only off-host.
        (true, _) => Topology::FullMesh,
        (false, true) => Topology::Shared,
        _ => Topology::PartialMesh,
    }
}

/// A route file's entry for a pair with no route of its own.
pub const RELAY: &str = "relay";

/// `PLAIT_ROUTES`: an N x N JSON matrix; entry [i][j] is the local IP address (or interface
/// name) rank i uses to reach rank j, or `"relay"`: the two have no route of their own, and
/// their frames go through a rank that reaches both (`PLAIT_RELAY`); null on the diagonal.
#[derive(Clone, Debug)]
pub struct RouteFile {
    pub path: String,
    matrix: Vec<Vec<Option<String>>>,
}

impl RouteFile {
    pub fn load(path: &str, size: usize) -> Result<RouteFile> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| PlaitError::Config(format!("PLAIT_ROUTES={path}: cannot read it: {e}")))?;
        let matrix: Vec<Vec<Option<String>>> = serde_json::from_str(&text).map_err(|e| {
            PlaitError::Config(format!("PLAIT_ROUTES={path}: not an N x N JSON matrix of strings and nulls: {e}"))
        })?;
        if matrix.len() != size || matrix.iter().any(|row| row.len() != size) {
            return Err(PlaitError::Config(format!(
                "PLAIT_ROUTES={path}: the world has {size} ranks, so the matrix must be {size} x {size}"
            )));
        }
        for (i, row) in matrix.iter().enumerate() {
            for (j, e) in row.iter().enumerate() {
                if i != j && e.is_none() {
                    return Err(PlaitError::Config(format!("PLAIT_ROUTES={path}: entry [{i}][{j}] is null; only the diagonal may be")));
                }
            }
        }
        Ok(RouteFile { path: path.to_string(), matrix })
    }

    fn entry(&self, i: usize, j: usize) -> &str {
        self.matrix[i][j].as_deref().unwrap_or_default()
    }

    /// Whether the file says ranks `i` and `j` reach each other through a relay (either entry).
    pub fn relayed(&self, i: usize, j: usize) -> bool {
        self.entry(i, j) == RELAY || self.entry(j, i) == RELAY
    }

    /// The route rank `me` must use to connect to `peer`, from both ranks' entries.
    pub fn route(&self, me: usize, mine: &[IfaceAddr], peer: usize, theirs: &[IfaceAddr]) -> Result<Route> {
        let local = resolve(self.entry(me, peer), mine).ok_or_else(|| {
            PlaitError::Config(format!(
                "PLAIT_ROUTES={}: rank {me} has no interface or address {:?} (entry [{me}][{peer}]); it has {}",
                self.path,
                self.entry(me, peer),
                describe(mine)
            ))
        })?;
        let remote = resolve(self.entry(peer, me), theirs).ok_or_else(|| {
            PlaitError::Config(format!(
                "PLAIT_ROUTES={}: rank {peer} has no interface or address {:?} (entry [{peer}][{me}]); it has {}",
                self.path,
                self.entry(peer, me),
                describe(theirs)
            ))
        })?;
        Ok(Route { local, peer_ip: remote.ip, reason: format!("route file {}", self.path) })
    }

    /// The addresses rank `me` listens on: 127.0.0.1 and those the file gives it for the higher
    /// ranks, which dial them (entries `[me][peer]`, see `route`); one it cannot resolve fails
    /// later, in `route`, with the error that names it.
    pub fn listen_addrs(&self, me: usize, mine: &[IfaceAddr]) -> Vec<IpAddr> {
        let mut out = vec![IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)];
        for peer in me + 1..self.matrix.len() {
            if let Some(a) = resolve(self.entry(me, peer), mine) {
                if !out.contains(&a.ip) {
                    out.push(a.ip);
                }
            }
        }
        out
    }
}

fn resolve(spec: &str, addrs: &[IfaceAddr]) -> Option<IfaceAddr> {
    match spec.parse::<IpAddr>() {
        Ok(ip) => addrs.iter().find(|a| a.ip == ip).cloned(),
        Err(_) => {
            let on_iface = addrs.iter().filter(|a| a.name == spec);
            let mut v: Vec<&IfaceAddr> = on_iface.collect();
            v.sort_by_key(|a| !a.ip.is_ipv4());
            v.first().map(|a| (*a).clone())
        }
    }
}

fn describe(addrs: &[IfaceAddr]) -> String {
    addrs.iter().map(|a| format!("{}={}", a.name, a.ip)).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(peer: usize, iface: &str, same_host: bool) -> LinkRecord {
        LinkRecord::connected(peer, iface.into(), String::new(), String::new(), same_host, String::new(), 1)
    }

    #[test]
    fn classifies_triangle_loopback_and_mixed() {
        let triangle = vec![
            vec![rec(1, "c01", false), rec(2, "c02", false)],
            vec![rec(0, "c01", false), rec(2, "c12", false)],
            vec![rec(0, "c02", false), rec(1, "c12", false)],
        ];
        assert_eq!(classify(&triangle), Topology::FullMesh);
        let local = vec![vec![rec(1, "lo", true), rec(2, "lo", true)]; 3];
        assert_eq!(classify(&local), Topology::Shared);
        let lan = vec![vec![rec(1, "eth0", false), rec(2, "eth0", false)]; 3];
        assert_eq!(classify(&lan), Topology::Shared);
        let mut mixed = triangle.clone();
        mixed[2] = vec![rec(0, "eth0", false), rec(1, "eth0", false)];
        assert_eq!(classify(&mixed), Topology::PartialMesh);
        assert_eq!(classify(&[vec![]]), Topology::Single);
        // macOS names loopback lo0: two distinct "interfaces" on loopback are no cable mesh.
        let lo0 = |peer| LinkRecord { local: "127.0.0.1".into(), ..rec(peer, "lo0", false) };
        let mac_local = vec![vec![lo0(1), LinkRecord { local: "::1".into(), ..rec(2, "lo1", false) }]; 3];
        assert_eq!(classify(&mac_local), Topology::PartialMesh);
    }

    #[test]
    fn hosts_group_ranks_joined_by_same_host_links_and_name_each_hosts_interfaces() {
        // Two hosts of two ranks, one cable between them: ranks 0, 1 and 2, 3 share a host.
        let two_by_two = vec![
            vec![rec(1, "lo", true), rec(2, "c", false), rec(3, "c", false)],
            vec![rec(0, "lo", true), rec(2, "c", false), rec(3, "c", false)],
            vec![rec(0, "c", false), rec(1, "c", false), rec(3, "lo", true)],
            vec![rec(0, "c", false), rec(1, "c", false), rec(2, "lo", true)],
        ];
        let h = hosts(&two_by_two).expect("two hosts of two ranks");
        assert_eq!(h.of_rank, vec![0, 0, 1, 1]);
        // Both ranks of a host leave it by the same interface; each host has its own.
        assert_eq!(h.iface(0, 2), h.iface(1, 3));
        assert!(h.iface(0, 3).is_some());
        assert_ne!(h.iface(0, 2), h.iface(2, 0));
        assert_eq!(h.iface(0, 1), None);
        assert_eq!((h.hosts, h.ifaces), (2, 2));
        // Every rank on its own host, or all on one: nothing to add to the plain model.
        let triangle = vec![
            vec![rec(1, "c01", false), rec(2, "c02", false)],
            vec![rec(0, "c01", false), rec(2, "c12", false)],
            vec![rec(0, "c02", false), rec(1, "c12", false)],
        ];
        assert!(hosts(&triangle).is_none());
        assert!(hosts(&vec![vec![rec(1, "lo", true), rec(2, "lo", true)]; 3]).is_none());
        // A subgroup of one rank per host is back to the plain model; one that keeps a pair is not.
        assert!(h.sub(&[0, 2]).is_none());
        assert_eq!(h.sub(&[1, 2, 3]).unwrap().of_rank, vec![0, 1, 1]);
    }

    #[test]
    fn route_file_resolves_addresses_and_names_and_rejects_bad_shapes() {
        let dir = std::env::temp_dir().join(format!("plait-routes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("r.json");
        std::fs::write(&p, r#"[[null, "10.0.1.1"], ["cable0", null]]"#).unwrap();
        let f = RouteFile::load(p.to_str().unwrap(), 2).unwrap();
        let a = |name: &str, ip: &str| IfaceAddr { name: name.into(), ip: ip.parse().unwrap(), prefix: 24, mtu: None, speed_mbps: None };
        let rank0 = vec![a("eth0", "10.9.0.1"), a("cable1", "10.0.1.1")];
        let rank1 = vec![a("eth0", "10.9.0.2"), a("cable0", "10.0.1.2")];
        let r = f.route(1, &rank1, 0, &rank0).unwrap();
        assert_eq!(r.local.ip.to_string(), "10.0.1.2");
        assert_eq!(r.peer_ip.to_string(), "10.0.1.1");
        assert!(f.route(1, &rank0, 0, &rank0).is_err(), "rank 1 has no cable0 in this list");
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(f.listen_addrs(0, &rank0), [ip("127.0.0.1"), ip("10.0.1.1")], "rank 0 listens where rank 1 dials");
        assert_eq!(f.listen_addrs(1, &rank1), [ip("127.0.0.1")], "nobody dials the last rank");
        std::fs::write(&p, r#"[[null, "x"]]"#).unwrap();
        assert!(RouteFile::load(p.to_str().unwrap(), 2).is_err());
        std::fs::write(&p, r#"[[null, null], [null, null]]"#).unwrap();
        assert!(RouteFile::load(p.to_str().unwrap(), 2).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }
}
