//! Turns what the links report into mailbox deliveries and communicator failures.

use crate::error::PlaitError;
use crate::exec::fabric::Fabric;
use crate::exec::mailbox::Mailbox;
use crate::net::frame::{FrameHeader, FrameKind};
use crate::net::peer::Inbox;
use parking_lot::Mutex;
use std::io::{self, Read};
use std::sync::{Arc, Weak};
use std::time::Duration;

pub(super) struct CommInbox {
    mailbox: Arc<Mailbox>,
    fabric: Mutex<Weak<Fabric>>,
    /// A failure reported before the fabric existed (during set-up).
    early: Mutex<Option<(PlaitError, bool)>>,
}

impl CommInbox {
    pub(super) fn new(mailbox: Arc<Mailbox>) -> Self {
        CommInbox { mailbox, fabric: Mutex::new(Weak::new()), early: Mutex::new(None) }
    }

    pub(super) fn attach(&self, fabric: &Arc<Fabric>) {
        *self.fabric.lock() = Arc::downgrade(fabric);
        if let Some((err, tell)) = self.early.lock().take() {
            fabric.fail(err, tell);
        }
    }

    fn fail(&self, err: PlaitError, tell_peers: bool) {
        let fabric = self.fabric.lock().upgrade();
        match fabric {
            Some(f) => {
                f.fail(err, tell_peers);
            }
            None => {
                self.mailbox.fail(&err);
                self.early.lock().get_or_insert((err, tell_peers));
            }
        }
    }

    fn addr(&self, peer: usize) -> String {
        self.fabric.lock().upgrade().map(|f| f.peer_addr(peer)).unwrap_or_default()
    }
}

fn read_text(payload: &mut dyn Read, max: usize) -> io::Result<String> {
    let mut buf = Vec::new();
    payload.read_to_end(&mut buf)?;
    buf.truncate(max);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

impl Inbox for CommInbox {
    fn deliver(&self, peer: usize, h: &FrameHeader, payload: &mut dyn Read) -> io::Result<()> {
        match FrameKind::from_u8(h.kind) {
            Some(FrameKind::Data) | Some(FrameKind::P2p) => self.mailbox.deliver(peer, h, payload),
            Some(FrameKind::Abort) => {
                let reason = read_text(payload, 4096)?;
                let err = PlaitError::Peer {
                    op: String::new(),
                    peer,
                    addr: self.addr(peer),
                    what: format!("failed and told this rank why: {reason}"),
                    waited: Duration::ZERO,
                };
                self.fail(err, false);
                Ok(())
            }
            Some(FrameKind::Close) => {
                read_text(payload, 0)?;
                let err = PlaitError::Peer {
                    op: String::new(),
                    peer,
                    addr: self.addr(peer),
                    what: "closed its communicator".into(),
                    waited: Duration::ZERO,
                };
                // Operations that no longer need this peer go on; those waiting for it fail.
                self.mailbox.peer_closed(peer, &err);
                Ok(())
            }
            _ => read_text(payload, 0).map(|_| ()),
        }
    }

    fn link_down(&self, peer: usize, error: io::Error, clean: bool) {
        if clean {
            return;
        }
        let what = match error.kind() {
            io::ErrorKind::UnexpectedEof => "closed the connection (the process exited or was killed)".to_string(),
            io::ErrorKind::ConnectionReset => "reset the connection (the process died or the link dropped)".to_string(),
            io::ErrorKind::InvalidData => format!("sent data this rank cannot read: {error}"),
            _ => format!("link failed: {error}"),
        };
        let err = PlaitError::Peer { op: String::new(), peer, addr: self.addr(peer), what, waited: Duration::ZERO };
        self.fail(err, true);
    }
}
