//! The communicator an elastic member holds. Each committed view gets a mesh of its own, built by
//! the static bootstrap (`Communicator::new`) from records the members replicate to each other
//! (`ViewStore`). Every operation has one outcome on every member (`docs/elastic.md`, "One
//! outcome per operation"):
//!
//! - an operation completes here only after a barrier on its mesh: a member returns it only
//!   once every member completed it locally;
//! - an operation that fails (a lost member, a view change) waits for the next view, whose
//!   `done` says whether it completed everywhere (then it stands) or not (then the buffer is
//!   restored here and on every member, and it raises `PeerLost`);
//! - after a forced change, the operation after `done` raises `PeerLost` on every member, even
//!   one that had not started it yet, so that every member's calls stay paired.

use super::agree::{MemberId, View};
use super::control::{Control, ControlConfig, Decision};
use crate::comm::{CommConfig, Communicator};
use crate::dtype::{DType, ReduceOp};
use crate::error::{PlaitError, Result};
use crate::exec::CollRequest;
use crate::raw::{bytes, bytes_mut, RawBuf};
use crate::sched::Collective;
use crate::store::Store;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The reason every mesh aborted for a view change gives (its peers' errors quote it).
const VIEW_CHANGE: &str = "elastic view change";

/// How an elastic member starts.
#[derive(Clone, Debug)]
pub struct ElasticConfig {
    /// Where this member's control plane listens ("host:port"; port 0 picks one).
    pub listen: String,
    /// Control addresses of members to ask for admission; empty founds a new group.
    pub peers: Vec<String>,
    /// For a founder: the group's witness ("host:port" of `plait witness`), if any. Joiners learn
    /// it from the view.
    pub witness: Option<String>,
    /// The settings of every epoch's mesh (`group`, `timeout`, `token`...); its rank, size and
    /// epoch are the view's. `timeout` also bounds joining and each wait for a new view;
    /// `heartbeat_timeout` is the control plane's.
    pub comm: CommConfig,
}

/// The operations of this member are numbered within an epoch, as every member numbers them.
struct Ops {
    epoch: u64,
    seq: u64,
    mesh: Option<(Arc<Communicator>, Vec<MemberId>)>,
    /// A joiner's first `update()` is the one that admitted it, already done by the members.
    admitted: bool,
}

pub struct ElasticComm {
    control: Arc<Control>,
    template: CommConfig,
    ops: Mutex<Ops>,
}

/// The store of one epoch's bootstrap: records replicated over the control links.
struct ViewStore {
    control: Arc<Control>,
    epoch: u64,
}

impl Store for ViewStore {
    fn set(&self, key: &str, value: &[u8], _timeout: Duration) -> Result<()> {
        self.control.kv_set(self.epoch, key, value);
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.control.kv_get(self.epoch, key, timeout)
    }
}

impl ElasticComm {
    /// Founds a group (no `peers`) or joins one: returns once this member is in a committed view.
    pub fn start(cfg: ElasticConfig) -> Result<ElasticComm> {
        cfg.comm.validate()?;
        let control_cfg = ControlConfig {
            group: cfg.comm.group.clone(),
            token: cfg.comm.token.as_ref().map(|t| t.secret().to_vec()),
            heartbeat_timeout: cfg.comm.heartbeat_timeout,
            connect_timeout: cfg.comm.hello_timeout,
        };
        let joining = !cfg.peers.is_empty();
        let control = if joining {
            Control::join(control_cfg, &cfg.listen, &cfg.peers, Instant::now() + cfg.comm.timeout)?
        } else {
            Control::found(control_cfg, &cfg.listen, cfg.witness.clone())?
        };
        // Not the view now: the group may have moved on since this member was admitted, and its
        // calls pair with the members' from the admitting epoch on.
        let epoch = control.first_epoch();
        Ok(ElasticComm { control, template: cfg.comm, ops: Mutex::new(Ops { epoch, seq: 0, mesh: None, admitted: joining }) })
    }

    /// The view this member is in now.
    pub fn view(&self) -> View {
        self.control.view()
    }

    pub fn member_id(&self) -> MemberId {
        self.control.me
    }

    /// Where this member's control plane can be reached (give it to joiners).
    pub fn contact(&self) -> String {
        self.control.contact().to_string()
    }

    /// Joiners this member knows of (a local answer: `update` asks every member).
    pub fn pending(&self) -> usize {
        self.control.pending()
    }

    /// Runs `req` (any collective) on the current view, with one outcome on every member.
    ///
    /// # Safety
    /// As `Communicator::collective`: the buffers must stay valid and untouched until it returns.
    pub unsafe fn collective(&self, req: CollRequest) -> Result<()> {
        let what = req.coll.name();
        let mut ops = self.ops.lock();
        ops.admitted = false;
        self.catch_up(&mut ops, what)?;
        ops.seq += 1;
        let (epoch, seq) = (ops.epoch, ops.seq);
        let output = req.output;
        // Restored if the operation does not stand (the mesh restores a failed one itself, but
        // one that completed here and failed elsewhere has already overwritten it).
        let saved = bytes(output.ptr, output.len).to_vec();
        let local = self.mesh(&mut ops).and_then(|(comm, _)| {
            comm.collective(req, true)?.wait(None).expect("an inline operation has completed")?;
            Ok(comm)
        });
        let completed = match &local {
            Ok(_) => self.control.complete(epoch, seq),
            Err(e) => {
                self.blame(&ops, epoch, e);
                false
            }
        };
        if completed {
            let comm = local.as_ref().expect("completed");
            match comm.barrier(None, true).and_then(|w| w.wait(None).expect("an inline barrier has completed")) {
                Ok(_) => return Ok(()),
                Err(e) => self.blame(&ops, epoch, &e),
            }
        }
        let decided = self.control.wait_past(epoch, Instant::now() + self.template.timeout).and_then(|_| self.decision(epoch + 1));
        let restore = || bytes_mut(output.ptr, output.len).copy_from_slice(&saved);
        let d = match decided {
            Ok(d) => d,
            Err(e) => {
                restore();
                return Err(e.for_op(what));
            }
        };
        if completed && d.done >= seq {
            return Ok(());
        }
        restore();
        Err(self.lost(&mut ops, what))
    }

    /// The update point: every member calls it at the same place in its loop. Admits the joiners
    /// any member knows of (all members wait for the new view); returns whether the view changed
    /// (also when a member was lost during it: that is not an error here).
    pub fn update(&self) -> Result<bool> {
        if std::mem::take(&mut self.ops.lock().admitted) {
            return Ok(true);
        }
        let mut waiting = (self.control.pending() as i64).to_ne_bytes();
        let buf = RawBuf::of(&mut waiting[..]);
        let req = CollRequest {
            coll: Collective::AllReduce,
            dtype: DType::I64,
            op: ReduceOp::Sum,
            root: 0,
            input: buf,
            output: buf,
            send_counts: None,
            recv_counts: None,
            timeout: None,
            algo: None,
            wire: None,
        };
        // SAFETY: `waiting` lives on this frame until the call returns.
        match unsafe { self.collective(req) } {
            Ok(()) => {}
            // Every member lost it alike: the view changed, which is what an update point is for;
            // the joiners wait for the next one.
            Err(PlaitError::PeerLost { .. }) => return Ok(true),
            Err(e) => return Err(e.for_op("update")),
        }
        if i64::from_ne_bytes(waiting) == 0 {
            return Ok(false);
        }
        let epoch = self.ops.lock().epoch;
        let view = self.control.view();
        if view.epoch == epoch && view.members.first() == Some(&self.control.me) {
            self.control.admit(epoch);
        }
        self.control.wait_past(epoch, Instant::now() + self.template.timeout).map_err(|e| e.for_op("update"))?;
        Ok(true)
    }

    /// Leaves the group: this member votes for a view without itself (so even two members can
    /// part), then closes its links; the others go on at once.
    pub fn close(&self) {
        self.control.leave(Instant::now() + self.control.heartbeat_timeout() * 2);
        if let Some((comm, _)) = self.ops.lock().mesh.take() {
            comm.abort("this member left the group");
            comm.close();
        }
    }

    /// Moves this member's numbering to the view the group is in, epoch by epoch: after a
    /// forced change, the call that would have been the operation after `done` raises
    /// `PeerLost` here as on every member.
    fn catch_up(&self, ops: &mut Ops, what: &str) -> Result<()> {
        loop {
            if let Some(e) = self.control.evicted() {
                return Err(PlaitError::Evicted(e));
            }
            if self.control.view().epoch == ops.epoch {
                return Ok(());
            }
            let d = self.decision(ops.epoch + 1)?;
            let call = ops.seq + 1;
            if d.forced && call == d.done + 1 {
                return Err(self.lost(ops, what));
            }
            self.next_epoch(ops);
        }
    }

    fn decision(&self, epoch: u64) -> Result<Decision> {
        self.control.decision(epoch).ok_or_else(|| PlaitError::Internal(format!("elastic: epoch {epoch} was passed without its decision")))
    }

    fn next_epoch(&self, ops: &mut Ops) {
        if let Some((comm, _)) = ops.mesh.take() {
            comm.close();
        }
        ops.epoch += 1;
        ops.seq = 0;
    }

    /// `PeerLost` for this member's current operation, moving its numbering to the next epoch.
    fn lost(&self, ops: &mut Ops, what: &str) -> PlaitError {
        let before: Vec<MemberId> = ops.mesh.as_ref().map(|(_, m)| m.clone()).unwrap_or_default();
        self.next_epoch(ops);
        let view = self.control.view();
        let gone: Vec<String> = before.iter().filter(|m| !view.members.contains(m)).map(|m| format!("member {m:x}")).collect();
        PlaitError::PeerLost {
            op: what.to_string(),
            epoch: ops.epoch,
            members: view.members.len(),
            lost: if gone.is_empty() { "no member, but the view changed".into() } else { gone.join(", ") },
        }
    }

    /// This epoch's mesh, built on first use.
    fn mesh(&self, ops: &mut Ops) -> Result<(Arc<Communicator>, Vec<MemberId>)> {
        if let Some(m) = &ops.mesh {
            return Ok(m.clone());
        }
        let view = self.control.view();
        if view.epoch != ops.epoch {
            return Err(PlaitError::Aborted { op: String::new(), reason: format!("the group moved past epoch {}", ops.epoch) });
        }
        let rank = view.members.iter().position(|&m| m == self.control.me).ok_or_else(|| PlaitError::Evicted(format!("not in epoch {}", view.epoch)))?;
        let mut cfg = self.template.clone();
        cfg.rank = rank;
        cfg.size = view.members.len();
        cfg.epoch = view.epoch;
        let store = ViewStore { control: self.control.clone(), epoch: view.epoch };
        let comm = Communicator::new(&store, cfg)?;
        let weak = Arc::downgrade(&comm);
        self.control.set_on_freeze(Some(Box::new(move |why: &str| {
            if let Some(c) = weak.upgrade() {
                c.abort(&format!("{VIEW_CHANGE}: {why}"));
            }
        })));
        if self.control.moved_past(view.epoch) {
            comm.abort("the group moved on while this mesh was being built");
        }
        ops.mesh = Some((comm, view.members.clone()));
        Ok(ops.mesh.clone().expect("just set"))
    }

    /// Tells the control plane who (if anyone) an error points at. Errors that a view change
    /// caused (this member's or another's mesh aborted for it) blame no one: a live member
    /// wrongly suspected would be left out of the next view.
    fn blame(&self, ops: &Ops, epoch: u64, e: &PlaitError) {
        if self.control.moved_past(epoch) || e.to_string().contains(VIEW_CHANGE) {
            return;
        }
        let members = ops.mesh.as_ref().map(|(_, m)| m.as_slice()).unwrap_or(&[]);
        match e {
            PlaitError::Peer { peer, .. } if *peer < members.len() => {
                self.control.suspect(epoch, members[*peer], e.to_string());
            }
            PlaitError::Aborted { .. } | PlaitError::Evicted(_) => {}
            _ => self.control.want_change(epoch, e.to_string()),
        }
    }
}

/// A witness for one group: it votes in every view change as one more acceptor, so that a group
/// split in two equal halves (two members, one lost) still has a majority on one side. It holds
/// no data and takes part in no operation; it may run anywhere both halves can reach.
pub struct Witness {
    control: Arc<Control>,
}

impl Witness {
    pub fn start(group: &str, listen: &str, token: Option<Vec<u8>>, heartbeat_timeout: Duration) -> Result<Witness> {
        let cfg = ControlConfig { group: group.to_string(), token, heartbeat_timeout, connect_timeout: Duration::from_secs(5) };
        Ok(Witness { control: Control::witness(cfg, listen)? })
    }

    /// Where members reach it (`ElasticConfig::witness`).
    pub fn contact(&self) -> String {
        self.control.contact().to_string()
    }

    /// The epoch and members of the last view it learnt.
    pub fn view(&self) -> View {
        self.control.view()
    }

    pub fn close(&self) {
        self.control.close();
    }
}

impl Drop for Witness {
    fn drop(&mut self) {
        self.control.close();
    }
}

impl Drop for ElasticComm {
    fn drop(&mut self) {
        self.close();
    }
}
