//! Who is to blame: turns what a rank observes (an Abort frame from a peer, links that closed,
//! links that went quiet) into one error that names the rank most likely at fault. Pure
//! functions of what was observed, so every rule has a test.

use crate::error::PlaitError;
use crate::net::frame::AbortReason;
use std::io;
use std::time::{Duration, Instant};

/// What an Abort frame from `sender` means on rank `me`: the error this rank's operations fail
/// with. `addr` names a peer's address; `silent` lists this rank's links that went quiet.
pub(super) fn explain_abort(
    me: Option<usize>,
    sender: usize,
    reason: &AbortReason,
    addr: &dyn Fn(usize) -> String,
    silent: &[(usize, Duration)],
) -> PlaitError {
    let via = if reason.reporter == sender { String::new() } else { format!(", relayed by rank {sender}") };
    let (mut blamed, mut at, mut what) = if reason.culprit == reason.reporter {
        (reason.reporter, addr(reason.reporter), format!("failed: {}{via}", reason.what))
    } else if Some(reason.culprit) == me {
        // The reporter lost contact with this rank (a dead link between the two): from here,
        // the reporter is the peer that is out of reach.
        (reason.reporter, addr(reason.reporter), format!("lost contact with this rank and gave up ({}){via}", reason.what))
    } else {
        let at = if reason.addr.is_empty() { addr(reason.culprit) } else { reason.addr.clone() };
        (reason.culprit, at, format!("{} (reported by rank {}{via})", reason.what, reason.reporter))
    };
    // A link of this rank that went quiet (a cut cable, a stopped process), other than the ones
    // the report is about.
    let quiet = silent.iter().find(|(p, _)| ![sender, reason.culprit, reason.reporter].contains(p));
    if let Some(&(p, d)) = quiet {
        if blamed == reason.reporter {
            // The reporter most likely gave up because this rank was itself waiting on its
            // silent link: that link is the cause here.
            what = format!("silent for {d:.1?} (cut off, stopped or hung); meanwhile rank {blamed} {what}");
            (blamed, at) = (p, addr(p));
        } else {
            what = format!("{what}; rank {p} ({}) has also been silent for {d:.1?}", addr(p));
        }
    }
    PlaitError::Peer { op: String::new(), peer: blamed, addr: at, what, waited: Duration::ZERO }
}

/// What a link that ended with `error` (and no Close frame) says about its peer.
pub(super) fn link_end(error: &io::Error) -> String {
    if let Some(never) = error.get_ref().and_then(|e| e.downcast_ref::<super::mailbox::NeverReceived>()) {
        return format!("sent data this rank never posted a receive for: {never}");
    }
    match error.kind() {
        io::ErrorKind::UnexpectedEof => "closed the connection (the process exited or was killed)".to_string(),
        io::ErrorKind::ConnectionReset => "reset the connection (the process died or the link dropped)".to_string(),
        io::ErrorKind::InvalidData => format!("sent data this rank cannot read: {error}"),
        _ => format!("link failed: {error}"),
    }
}

/// A link that closed without explanation: the peer, when, and what its end said.
pub(super) type Down = (usize, Instant, String);

/// The error for links that closed without explanation, `downs` in the order they closed: the
/// first to close is blamed (when a rank dies, its own links close first), the others named.
pub(super) fn links_down(downs: &[Down], addr: &dyn Fn(usize) -> String) -> PlaitError {
    let (peer, first_at, what) = &downs[0];
    let mut what = what.clone();
    if downs.len() > 1 {
        let others: Vec<String> = downs[1..]
            .iter()
            .map(|(p, t, _)| format!("rank {p} ({}, {:.0?} later)", addr(*p), t.duration_since(*first_at)))
            .collect();
        what = format!("{what}; the links to {} closed too", others.join(", "));
    }
    PlaitError::Peer { op: String::new(), peer: *peer, addr: addr(*peer), what, waited: Duration::ZERO }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(p: usize) -> String {
        format!("10.0.0.{p}:4000")
    }

    fn blamed(e: &PlaitError) -> (usize, String) {
        match e {
            PlaitError::Peer { peer, what, .. } => (*peer, what.clone()),
            other => panic!("not a peer error: {other}"),
        }
    }

    fn reason(culprit: usize, reporter: usize) -> AbortReason {
        AbortReason { culprit, addr: String::new(), reporter, what: "timed out".into() }
    }

    #[test]
    fn a_rank_that_failed_itself_is_blamed() {
        let (peer, what) = blamed(&explain_abort(Some(0), 2, &reason(2, 2), &addr, &[]));
        assert_eq!(peer, 2);
        assert!(what.starts_with("failed: timed out"), "{what}");
    }

    #[test]
    fn a_relayed_report_names_the_culprit_and_the_relay() {
        let (peer, what) = blamed(&explain_abort(Some(0), 1, &reason(3, 2), &addr, &[]));
        assert_eq!(peer, 3);
        assert!(what.contains("reported by rank 2, relayed by rank 1"), "{what}");
    }

    #[test]
    fn a_reporter_that_lost_this_rank_is_the_peer_out_of_reach() {
        let (peer, what) = blamed(&explain_abort(Some(0), 2, &reason(0, 2), &addr, &[]));
        assert_eq!(peer, 2);
        assert!(what.contains("lost contact with this rank"), "{what}");
    }

    #[test]
    fn a_silent_link_of_this_rank_takes_the_blame_from_the_reporter() {
        let silent = [(3, Duration::from_secs(4))];
        let (peer, what) = blamed(&explain_abort(Some(0), 2, &reason(0, 2), &addr, &silent));
        assert_eq!(peer, 3);
        assert!(what.starts_with("silent for 4.0s"), "{what}");
        // The culprit named by someone else keeps the blame; the silent link is mentioned.
        let (peer, what) = blamed(&explain_abort(Some(0), 1, &reason(2, 1), &addr, &silent));
        assert_eq!(peer, 2);
        assert!(what.contains("rank 3 (10.0.0.3:4000) has also been silent"), "{what}");
    }

    #[test]
    fn the_first_link_to_close_is_blamed_and_the_others_named() {
        let t = Instant::now();
        let downs = vec![(2, t, "closed the connection".to_string()), (3, t + Duration::from_millis(40), "reset".to_string())];
        let (peer, what) = blamed(&links_down(&downs, &addr));
        assert_eq!(peer, 2);
        assert!(what.starts_with("closed the connection; the links to rank 3 (10.0.0.3:4000, 40ms later) closed too"), "{what}");
        assert!(link_end(&io::Error::from(io::ErrorKind::ConnectionReset)).starts_with("reset the connection"));
    }
}
