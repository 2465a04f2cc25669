//! Who may connect to a listener (`Admission`), and what became of the connections that never
//! sent a hello (`HalfOpen`), for the error that says why a peer is missing.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Addresses kept for the error that names half-open connections.
const NAMED_ADDRS: usize = 8;

/// Who may connect.
pub(super) enum Admission {
    /// Anyone who sends a valid hello.
    Open,
    /// Not known yet: connections are held unread until `admit`.
    Awaiting,
    /// Only the addresses the peers published, each rank from its own.
    Peers { by_rank: HashMap<u32, Vec<IpAddr>>, any: HashSet<IpAddr> },
}

impl Admission {
    /// Whether a connection from `ip` may be read at all.
    pub(super) fn allows(&self, ip: IpAddr) -> bool {
        match self {
            Admission::Open | Admission::Awaiting => true,
            Admission::Peers { any, .. } => any.contains(&ip),
        }
    }

    /// Why rank `from` may not connect from `ip`, if it may not.
    pub(super) fn refuses(&self, from: u32, ip: IpAddr) -> Option<String> {
        let Admission::Peers { by_rank, .. } = self else { return None };
        let theirs = by_rank.get(&from)?;
        (!theirs.contains(&ip)).then(|| {
            format!("rank {from} connected from {ip}, which is not one of the addresses it published {theirs:?}")
        })
    }
}

/// Connections that went away without a hello, and who is waiting now: for the error that says
/// why a peer is missing.
#[derive(Default)]
pub(super) struct HalfOpen {
    /// Still open without a complete hello, by accept thread key.
    pub(super) open: HashMap<usize, SocketAddr>,
    /// Closed at their hello deadline with nothing (or too little) sent.
    pub(super) timed_out: usize,
    /// Closed because `MAX_WAITING` were waiting.
    pub(super) evicted: usize,
    /// Closed because their address is not a peer's.
    pub(super) strangers: usize,
    pub(super) recent: VecDeque<SocketAddr>,
    pub(super) recent_strangers: VecDeque<SocketAddr>,
}

pub(super) fn remember(list: &mut VecDeque<SocketAddr>, addr: SocketAddr) {
    if list.len() == NAMED_ADDRS {
        list.pop_front();
    }
    list.push_back(addr);
}

fn named(list: impl IntoIterator<Item = SocketAddr>) -> String {
    list.into_iter().take(NAMED_ADDRS).map(|a| a.to_string()).collect::<Vec<_>>().join(", ")
}

impl HalfOpen {
    /// "" when there is nothing to say.
    pub(super) fn describe(&self, hello_timeout: Duration, max_waiting: usize) -> String {
        let mut parts = Vec::new();
        if !self.open.is_empty() {
            parts.push(format!(
                "{} connection(s) open that sent no hello yet (from {})",
                self.open.len(),
                named(self.open.values().copied())
            ));
        }
        let closed = self.timed_out + self.evicted;
        if closed > 0 {
            let evicted = if self.evicted > 0 {
                format!(", {} of them closed early because {max_waiting} were waiting", self.evicted)
            } else {
                String::new()
            };
            parts.push(format!(
                "{closed} connection(s) closed that sent no hello within {hello_timeout:?}{evicted} (last from {})",
                named(self.recent.iter().copied())
            ));
        }
        if self.strangers > 0 {
            parts.push(format!(
                "{} connection(s) refused from addresses no peer published (last from {})",
                self.strangers,
                named(self.recent_strangers.iter().copied())
            ));
        }
        parts.join("; ")
    }
}
