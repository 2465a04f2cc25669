//! Ranks that cannot connect to each other (a firewall or NAT refuses one side, no route, no
//! cable between them, `"relay"` in the route file): which rank passes their frames on, and what
//! their link looks like to the cost model. Pure, so every rank decides alike from the same
//! records.
//!
//! A pair's relay is a rank with a connection to both. Among those, the one whose slower hop is
//! fastest (both directions, as measured), then the one relaying the fewest pairs so far, then the
//! lowest rank. The relayed link's round trip is the two hops' together and its rate the slower
//! hop's, so the ring order and the selector see it as the detour it is.

use super::topology::LinkRecord;

/// Rank `from`'s record of its link to `to`, if it has one of its own (not relayed).
fn direct(all: &[Vec<LinkRecord>], from: usize, to: usize) -> Option<&LinkRecord> {
    all.get(from)?.iter().find(|l| l.peer == to && l.via.is_none())
}

/// Bytes per second from `from` into `to`, as `to` measured it.
fn rate(all: &[Vec<LinkRecord>], from: usize, to: usize) -> Option<f64> {
    direct(all, to, from)?.rx_bytes_per_s
}

/// A pair of ranks `(a, b)`, a < b, and the rank that relays their frames.
pub(crate) type Relay = (usize, usize, usize);

/// The relay of each pair `(a, b)` in `pairs` (a < b); `Err((a, b))` names the first pair no
/// rank connects to both.
pub(crate) fn choose(pairs: &[(usize, usize)], all: &[Vec<LinkRecord>]) -> Result<Vec<Relay>, (usize, usize)> {
    let n = all.len();
    let mut load = vec![0usize; n];
    let mut out = Vec::with_capacity(pairs.len());
    for &(a, b) in pairs {
        let slower_hop = |r: usize| -> Option<f64> {
            [rate(all, a, r), rate(all, r, a), rate(all, b, r), rate(all, r, b)].into_iter().try_fold(f64::INFINITY, |m, x| Some(m.min(x?)))
        };
        let best = (0..n)
            .filter(|&r| r != a && r != b && direct(all, a, r).is_some() && direct(all, r, b).is_some())
            .max_by(|&x, &y| {
                let (hx, hy) = (slower_hop(x).unwrap_or(0.0), slower_hop(y).unwrap_or(0.0));
                hx.total_cmp(&hy).then(load[y].cmp(&load[x])).then(y.cmp(&x))
            })
            .ok_or((a, b))?;
        load[best] += 1;
        out.push((a, b, best));
    }
    Ok(out)
}

/// Rank `me`'s record of its link to `peer` through `via`: the two hops' round trips added and
/// the slower hop's rate into `me`.
pub(crate) fn relayed_record(all: &[Vec<LinkRecord>], me: usize, peer: usize, via: usize, why: &str) -> LinkRecord {
    let first = direct(all, me, via).cloned().unwrap_or_else(|| LinkRecord::connected(via, String::new(), String::new(), String::new(), false, String::new(), 1));
    let second = direct(all, via, peer);
    let rtt_us = first.rtt_us.zip(second.and_then(|l| l.rtt_us)).map(|(x, y)| x + y);
    let rx_bytes_per_s = rate(all, via, me).zip(rate(all, peer, via)).map(|(x, y)| x.min(y));
    LinkRecord {
        peer,
        remote: String::new(),
        same_host: false,
        rtt_us,
        reason: format!("no connection of its own ({why}): relayed through rank {via}, which reaches both"),
        streams: 1,
        rx_bytes_per_s,
        max_streams: 1,
        via: Some(via),
        ..first
    }
}

/// Adds the relayed links of `relays` to every rank's records, in peer order.
pub(crate) fn add_relayed(all: &mut [Vec<LinkRecord>], relays: &[Relay], why: &dyn Fn(usize, usize) -> String) {
    let records: Vec<(usize, LinkRecord)> = relays
        .iter()
        .flat_map(|&(a, b, r)| [(a, relayed_record(all, a, b, r, &why(a, b))), (b, relayed_record(all, b, a, r, &why(a, b)))])
        .collect();
    for (rank, rec) in records {
        all[rank].push(rec);
        all[rank].sort_by_key(|l| l.peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::topology::{classify, link_matrix, Topology};

    /// Rank `me`'s record of its cable to `peer`, `rx_mbit` into `me`.
    fn cable(me: usize, peer: usize, rtt_ms: f64, rx_mbit: f64) -> LinkRecord {
        LinkRecord {
            rtt_us: Some(rtt_ms * 1e3),
            rx_bytes_per_s: Some(rx_mbit * 1e6 / 8.0),
            ..LinkRecord::connected(peer, format!("mesh{peer}"), format!("10.{me}.{peer}.1"), String::new(), false, String::new(), 1)
        }
    }

    /// Every rank's records for `links` (undirected, equal both ways: (a, b, rtt ms, Mbit/s)).
    fn world(n: usize, links: &[(usize, usize, f64, f64)]) -> Vec<Vec<LinkRecord>> {
        let mut all = vec![Vec::new(); n];
        for &(a, b, rtt, mbit) in links {
            all[a].push(cable(a, b, rtt, mbit));
            all[b].push(cable(b, a, rtt, mbit));
        }
        all
    }

    #[test]
    fn a_line_relays_its_ends_through_the_middle_and_the_matrix_sees_the_detour() {
        let mut all = world(3, &[(0, 1, 2.0, 1000.0), (1, 2, 4.0, 400.0)]);
        let relays = choose(&[(0, 2)], &all).unwrap();
        assert_eq!(relays, vec![(0, 2, 1)]);
        add_relayed(&mut all, &relays, &|_, _| "no route".into());
        let r = all[0].iter().find(|l| l.peer == 2).unwrap();
        assert_eq!(r.via, Some(1));
        assert_eq!(r.rtt_us, Some(6000.0), "both hops' round trips");
        assert_eq!(r.rx_bytes_per_s, Some(400e6 / 8.0), "the slower hop's rate");
        assert!(r.reason.contains("no route") && r.reason.contains("through rank 1"), "{}", r.reason);
        assert_eq!(all[2].iter().map(|l| l.peer).collect::<Vec<_>>(), vec![0, 1], "kept in peer order");
        let m = link_matrix(&all).expect("every link has figures");
        assert_eq!(m.bandwidth(0, 2), 400e6 / 8.0);
        // The relayed link shares rank 0's only cable: not a cable per pair.
        assert_eq!(classify(&all), Topology::PartialMesh);
    }

    #[test]
    fn the_relay_is_the_rank_whose_slower_hop_is_fastest_then_the_least_loaded() {
        // A square 0-1-2-3-0 without diagonals: 0-2 can go through 1 or 3; 1-3 through 0 or 2.
        let all = world(4, &[(0, 1, 1.0, 1000.0), (1, 2, 1.0, 1000.0), (2, 3, 1.0, 100.0), (3, 0, 1.0, 1000.0)]);
        let relays = choose(&[(0, 2), (1, 3)], &all).unwrap();
        // 0-2 through 3 would cross the slow 2-3 cable; 1-3 through 2 too.
        assert_eq!(relays, vec![(0, 2, 1), (1, 3, 0)]);
        // Equal cables: the second pair goes to a rank that relays nothing yet.
        let even = world(4, &[(0, 1, 1.0, 1000.0), (1, 2, 1.0, 1000.0), (2, 3, 1.0, 1000.0), (3, 0, 1.0, 1000.0)]);
        assert_eq!(choose(&[(0, 2), (1, 3)], &even).unwrap(), vec![(0, 2, 1), (1, 3, 0)]);
        let mut unmeasured = even.clone();
        unmeasured.iter_mut().flatten().for_each(|l| l.rx_bytes_per_s = None);
        assert_eq!(choose(&[(0, 2), (1, 3)], &unmeasured).unwrap(), vec![(0, 2, 1), (1, 3, 0)], "lowest rank first");
    }

    #[test]
    fn a_pair_no_rank_connects_to_both_is_named() {
        // 0-1 and 2-3 only: nobody reaches both 0 and 2.
        let all = world(4, &[(0, 1, 1.0, 1000.0), (2, 3, 1.0, 1000.0)]);
        assert_eq!(choose(&[(0, 2)], &all), Err((0, 2)));
        // A relay's own links must be direct: 0-2 relayed cannot carry 0-3's frames.
        let mut line = world(4, &[(0, 1, 1.0, 1000.0), (1, 2, 1.0, 1000.0), (2, 3, 1.0, 1000.0)]);
        add_relayed(&mut line, &[(0, 2, 1)], &|_, _| String::new());
        assert_eq!(choose(&[(0, 3)], &line), Err((0, 3)));
    }
}
