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
use super::control::{Control, ControlConfig, Decision, Freeze};
use crate::comm::{CommConfig, Communicator, GiveUp, Measure, RingOrder};
use crate::dtype::{DType, ReduceOp};
use crate::error::{PlaitError, Result};
use crate::exec::CollRequest;
use crate::raw::{bytes, bytes_mut, RawBuf};
use crate::store::Store;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// How long a joiner keeps dialling `peers` before it gives up on them (an address list
    /// read from a directory may name a group that is gone); `None`: until `comm.timeout`.
    /// Waiting to be admitted, once a member answered, still has all of `comm.timeout`.
    pub dial_timeout: Option<Duration>,
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
    /// The members of `epoch`.
    members: Vec<MemberId>,
    seq: u64,
    /// Set when a wait for the group's next view failed: this member no longer knows where its
    /// calls stand, so every later call fails until it joins again.
    lost_track: Option<String>,
    mesh: Option<(Arc<Communicator>, Vec<MemberId>)>,
    /// The last epoch's mesh, kept when the next view only adds members (a join): the next
    /// mesh grows from it, so its links carry on (`Communicator::grow`).
    grow_from: Option<Arc<Communicator>>,
    /// A joiner's first `update()` is the one that admitted it, already done by the members.
    admitted: bool,
    /// The memory of the last operation's saved output, reused (`SavedOutput`).
    saved: Vec<u8>,
}

pub struct ElasticComm {
    control: Arc<Control>,
    template: CommConfig,
    ops: Mutex<Ops>,
    /// Set while this member is in `update()`: there a proposal is most likely a join, which
    /// keeps the mesh (its links carry on into the next view's), so the freeze does not abort it;
    /// a forced change still does, once it is known to be forced.
    in_update: Arc<AtomicBool>,
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
            let deadline = Instant::now() + cfg.comm.timeout;
            let dial_until = cfg.dial_timeout.map_or(deadline, |d| deadline.min(Instant::now() + d));
            Control::join(control_cfg, &cfg.listen, &cfg.peers, dial_until, deadline)?
        } else {
            Control::found(control_cfg, &cfg.listen, cfg.witness.clone())?
        };
        // Not the view now: the group may have moved on since this member was admitted, and its
        // calls pair with the members' from the admitting epoch on.
        let epoch = control.first_epoch();
        let members = control.decision(epoch).map(|d| d.members).unwrap_or_default();
        let ops = Ops { epoch, members, seq: 0, lost_track: None, mesh: None, grow_from: None, admitted: joining, saved: Vec::new() };
        Ok(ElasticComm { control, template: cfg.comm, ops: Mutex::new(ops), in_update: Arc::new(AtomicBool::new(false)) })
    }

    /// The view this member is in now.
    pub fn view(&self) -> View {
        self.control.view()
    }

    pub fn member_id(&self) -> MemberId {
        self.control.me
    }

    /// The deadline of each operation and view change.
    pub fn timeout(&self) -> Duration {
        self.template.timeout
    }

    /// Where this member's control plane can be reached (give it to joiners).
    pub fn contact(&self) -> String {
        self.control.contact().to_string()
    }

    /// The link records of the current view's mesh, once it is built (empty before).
    pub fn routes(&self) -> Vec<crate::comm::LinkRecord> {
        self.ops.lock().mesh.as_ref().map(|(c, _)| c.routes().to_vec()).unwrap_or_default()
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
        if self.control.is_closed() {
            return Err(PlaitError::Broken(format!("{what}: this member left its elastic group (close() was called)")));
        }
        if let Some(why) = &ops.lost_track {
            return Err(PlaitError::Broken(format!("{why}; join the group again")));
        }
        self.catch_up(&mut ops, what)?;
        ops.seq += 1;
        let (epoch, seq) = (ops.epoch, ops.seq);
        let output = req.output;
        // Restored if the operation does not stand (the mesh restores a failed one itself, but
        // one that completed here and failed elsewhere has already overwritten it). The copy's
        // memory is kept from call to call: a fresh allocation of a large buffer costs more in
        // page faults than the copy itself.
        let mut saved = std::mem::take(&mut ops.saved);
        saved.clear();
        saved.extend_from_slice(bytes(output.ptr, output.len));
        let local = self.mesh(&mut ops).and_then(|(comm, _)| {
            comm.collective(req, true)?.wait(None).expect("an inline operation has completed")?;
            Ok(comm)
        });
        // The members' calls differ (a program error): no retry can pair them, so that is the
        // error the caller gets, not PeerLost (which `allreduce_with_retry` would retry forever).
        let calls_differ = local.as_ref().err().filter(|e| calls_differ(e)).map(|e| e.for_op(what));
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
                Ok(_) => {
                    ops.saved = saved;
                    return Ok(());
                }
                Err(e) => self.blame(&ops, epoch, &e),
            }
        }
        let decided = self.control.wait_past(epoch, Instant::now() + self.template.timeout).and_then(|_| self.decision(epoch + 1));
        let restore = |saved: &[u8]| bytes_mut(output.ptr, output.len).copy_from_slice(saved);
        let d = match decided {
            Ok(d) => d,
            Err(e) => {
                restore(&saved);
                ops.saved = saved;
                if !matches!(e, PlaitError::Evicted(_)) {
                    // Its peers may yet agree that this operation stands: this member can no
                    // longer tell, so it stops here rather than pair its next call wrongly.
                    ops.lost_track = Some(format!("epoch {epoch}'s operation {seq} has no known outcome ({e})"));
                }
                return Err(e.for_op(what));
            }
        };
        if !(completed && d.done >= seq) {
            restore(&saved);
        }
        ops.saved = saved;
        if completed && d.done >= seq {
            return Ok(());
        }
        let lost = self.lost(&mut ops, what);
        Err(calls_differ.unwrap_or(lost))
    }

    /// The update point: every member calls it at the same place in its loop. Admits the joiners
    /// any member knows of (all members wait for the new view); returns whether the view changed
    /// (also when a member was lost during it: that is not an error here).
    pub fn update(&self) -> Result<bool> {
        if std::mem::take(&mut self.ops.lock().admitted) {
            return Ok(true);
        }
        self.in_update.store(true, Ordering::SeqCst);
        let changed = self.update_point();
        self.in_update.store(false, Ordering::SeqCst);
        changed
    }

    fn update_point(&self) -> Result<bool> {
        // Only the leader's count: it admits the joiners it knows, and another member's stale
        // entry (a joiner that went away) must not turn every update into a view change.
        let leads = self.control.view().members.first() == Some(&self.control.me);
        let mut waiting = (if leads { self.control.pending() as i64 } else { 0 }).to_ne_bytes();
        let req = CollRequest::allreduce(RawBuf::of(&mut waiting[..]), DType::I64, ReduceOp::Sum);
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
        if let Err(e) = self.control.wait_past(epoch, Instant::now() + self.template.timeout) {
            if !matches!(e, PlaitError::Evicted(_)) {
                self.ops.lock().lost_track = Some(format!("the update point of epoch {epoch} never ended ({e})"));
            }
            return Err(e.for_op("update"));
        }
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
        if let Some(unused) = ops.grow_from.take() {
            unused.close();
        }
        let last = ops.mesh.take();
        ops.epoch += 1;
        ops.seq = 0;
        let decision = self.control.decision(ops.epoch);
        ops.members = decision.as_ref().map(|d| d.members.clone()).unwrap_or_default();
        if let Some((comm, members)) = last {
            // Members only added (at the end, so every other rank stays) and nobody lost: the
            // members' links carry on into the next mesh. Every member decides alike from the
            // decision; a member whose mesh failed anyway says so at the next rendezvous.
            let grows = decision.is_some_and(|d| !d.forced && d.members.len() > members.len() && d.members.starts_with(&members));
            if grows && comm.is_open() {
                ops.grow_from = Some(comm);
            } else {
                comm.close();
            }
        }
    }

    /// `PeerLost` for this member's current operation, moving its numbering to the next epoch.
    fn lost(&self, ops: &mut Ops, what: &str) -> PlaitError {
        let before = ops.members.clone();
        self.next_epoch(ops);
        let gone: Vec<String> = before.iter().filter(|m| !ops.members.contains(m)).map(|m| format!("member {m:x}")).collect();
        PlaitError::PeerLost {
            op: what.to_string(),
            epoch: ops.epoch,
            members: ops.members.len(),
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
        // Any thread may call (an async DiLoCo average runs on its own); `ops`'s lock already
        // orders the calls, one at a time, so the creator-thread check would only refuse them.
        cfg.threads = crate::comm::ThreadUse::Sequential;
        // A view's mesh is built at once or not at all: start-up stops as soon as the group
        // moves on, and in any case long before an operation's deadline.
        cfg.startup_timeout = Some((self.template.heartbeat_timeout * 10).max(Duration::from_secs(10)));
        // Measuring the links holds every view change up by n - 1 trains (recovery is a mesh
        // build of 12-25 ms on loopback): only when asked for, not by default.
        if cfg.measure == Measure::Auto {
            cfg.measure = Measure::Never;
        }
        // A list names the ranks of one world size; views change size and rank numbers.
        if matches!(cfg.ring_order, RingOrder::Given(_)) {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| tracing::warn!("PLAIT_RING_ORDER lists ranks, which elastic views renumber: rings follow the measured or rank order"));
            cfg.ring_order = RingOrder::Measured;
        }
        let control = self.control.clone();
        let epoch = view.epoch;
        cfg.give_up = Some(GiveUp(Arc::new(move || control.moved_past(epoch))));
        let store = ViewStore { control: self.control.clone(), epoch: view.epoch };
        let started = Instant::now();
        let comm = match ops.grow_from.take() {
            Some(last) => last.grow(&store, cfg)?,
            None => Communicator::new(&store, cfg)?,
        };
        tracing::info!("elastic: the mesh of epoch {} ({} members) took {:.1} ms", view.epoch, view.members.len(), started.elapsed().as_secs_f64() * 1e3);
        let weak = Arc::downgrade(&comm);
        let in_update = self.in_update.clone();
        self.control.set_on_freeze(Some(Arc::new(move |why: &str, freeze: Freeze| {
            if freeze == Freeze::Proposed && in_update.load(Ordering::SeqCst) {
                return;
            }
            if let Some(c) = weak.upgrade() {
                c.abort(&format!("{VIEW_CHANGE}: {why}"));
            }
        })));
        if self.control.moved_past(view.epoch) {
            comm.abort(&format!("{VIEW_CHANGE}: the group moved on while this mesh was being built"));
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

/// Whether `e` says that members made different calls (another collective, dtype, count, op or
/// root), here or as a peer relayed it.
fn calls_differ(e: &PlaitError) -> bool {
    match e {
        PlaitError::Mismatch { .. } => true,
        PlaitError::Peer { what, .. } => what.contains("mismatch with rank"),
        _ => false,
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
