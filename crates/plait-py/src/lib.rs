//! `plait._core`: thin PyO3 bindings over plait-core. No logic lives here; every blocking call
//! releases the GIL.

use plait_core::{CollRequest, Collective, CommConfig, Communicator, DType, ElasticComm, ElasticConfig, PlaitError, RawBuf, ReduceOp, Store, ThreadUse, Wire, Work};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBool, PyBytes, PyDict, PyString, PyTuple, PyType};
use std::sync::Arc;
use std::time::Duration;

/// Exception classes, defined in Python so that they can inherit from two bases
/// (`PlaitTimeoutError` is also a `TimeoutError`, `InvalidArgumentError` also a `ValueError`).
const EXCEPTIONS: &str = r#"
class PlaitError(Exception):
    """Base class of every error plait raises."""
class PeerError(PlaitError):
    """A peer died, closed or reset its link, or reported its own failure."""
class PeerLost(PeerError):
    """Elastic mode: a member was lost during this operation; it failed on every member and the
    buffer is as it was. Retry it: it runs over the new view (`comm.world_size` has changed)."""
class EvictedError(PlaitError):
    """Elastic mode: the group went on without this member; join again."""
class PlaitTimeoutError(PlaitError, TimeoutError):
    """An operation passed its deadline."""
class AbortedError(PlaitError):
    """abort() was called while the operation was in flight."""
class MismatchError(PlaitError):
    """Ranks called different collectives, counts, dtypes, ops, roots or algorithms."""
class BrokenError(PlaitError):
    """The communicator failed or was closed earlier; build a new one (a new epoch)."""
class RendezvousError(PlaitError):
    """The ranks could not meet or connect."""
class ConfigError(PlaitError, ValueError):
    """A bad setting (unknown algorithm, malformed environment variable)."""
class InvalidArgumentError(PlaitError, ValueError):
    """A bad argument, detected before anything was sent."""
"#;

static EXC: GILOnceCell<Py<PyDict>> = GILOnceCell::new();

fn exc_class<'py>(py: Python<'py>, name: &str) -> Bound<'py, PyType> {
    let d = EXC.get(py).expect("module initialised").bind(py);
    d.get_item(name).ok().flatten().expect("exception class").downcast_into::<PyType>().expect("a class")
}

fn to_py(err: PlaitError) -> PyErr {
    Python::with_gil(|py| {
        let name = match err {
            PlaitError::InvalidArgument(_) | PlaitError::Refused { .. } => "InvalidArgumentError",
            PlaitError::Config(_) => "ConfigError",
            PlaitError::Peer { .. } | PlaitError::Io(_) => "PeerError",
            PlaitError::PeerLost { .. } => "PeerLost",
            PlaitError::Evicted(_) => "EvictedError",
            PlaitError::Timeout { .. } => "PlaitTimeoutError",
            PlaitError::Mismatch { .. } => "MismatchError",
            PlaitError::Aborted { .. } => "AbortedError",
            PlaitError::Broken(_) => "BrokenError",
            PlaitError::Rendezvous(_) => "RendezvousError",
            PlaitError::Internal(_) => "PlaitError",
        };
        PyErr::from_type(exc_class(py, name), err.to_string())
    })
}

fn invalid(msg: String) -> PyErr {
    to_py(PlaitError::InvalidArgument(msg))
}

/// Any Python object with `set(key, bytes)`, `get(key) -> bytes` and `wait([key], timedelta)`,
/// such as torch's TCPStore or PrefixStore. Each call goes through `call_with_deadline`, since a
/// client whose server stopped answering may block past any timeout it was given.
struct PyStore(PyObject);

impl PyStore {
    /// The Python object for a call on another thread, and its type's name for errors.
    fn handle(&self) -> (PyObject, String) {
        Python::with_gil(|py| {
            let name = self.0.bind(py).get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "store".into());
            (self.0.clone_ref(py), name)
        })
    }
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8], timeout: Duration) -> plait_core::Result<()> {
        let (store, name) = self.handle();
        let (k, v) = (key.to_string(), value.to_vec());
        plait_core::call_with_deadline(&name, &format!("set({key:?})"), timeout, move || {
            Python::with_gil(|py| store.call_method1(py, "set", (&k, PyBytes::new(py, &v))).map(|_| ()))
                .map_err(|e| PlaitError::Rendezvous(format!("store.set({k:?}) failed: {e}")))
        })
    }

    fn get(&self, key: &str, timeout: Duration) -> plait_core::Result<Vec<u8>> {
        let (store, name) = self.handle();
        let k = key.to_string();
        plait_core::call_with_deadline(&name, &format!("wait([{key:?}]) and get"), timeout, move || {
            Python::with_gil(|py| -> PyResult<Vec<u8>> {
                let td = py.import("datetime")?.getattr("timedelta")?.call1((0, timeout.as_secs_f64().max(0.001)))?;
                store.call_method1(py, "wait", (vec![&k], td))?;
                store.call_method1(py, "get", (&k,))?.extract::<Vec<u8>>(py)
            })
            .map_err(|e| PlaitError::Rendezvous(format!("store.get({k:?}) failed: {e}")))
        })
    }
}

/// A timeout argument of call `what`, checked by the core (in range, so the conversion cannot
/// panic).
fn secs(what: &str, t: Option<f64>) -> PyResult<Option<Duration>> {
    t.map(|s| plait_core::check_argument(what, "timeout", s).map(Duration::from_secs_f64).map_err(to_py)).transpose()
}

/// Runs a call into the core; a panic (a bug in plait) comes out as a PlaitError naming the call,
/// never as pyo3's PanicException.
fn guarded<T>(what: &str, f: impl FnOnce() -> plait_core::Result<T>) -> plait_core::Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| Err(PlaitError::from_panic(what, p)))
}

/// A dtype, operator or collective as Python passes it: the core's integer code (as listed in
/// `DTYPES`, `OPS` and `COLLECTIVES`) or its name.
enum Named {
    Code(u8),
    Name(String),
}

// By hand, not derived: a derived extraction tries the integer first and pays for a Python
// exception on every name (about 0.9 us per argument, a third of a small inline call).
impl<'py> FromPyObject<'py> for Named {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        match ob.downcast::<PyString>() {
            Ok(_) => Ok(Named::Name(ob.extract()?)),
            Err(_) => Ok(Named::Code(ob.extract()?)),
        }
    }
}

fn dtype(arg: Named) -> PyResult<DType> {
    let found = match &arg {
        Named::Code(c) => DType::from_u8(*c),
        Named::Name(n) => DType::from_name(n),
    };
    found.ok_or_else(|| {
        let all: Vec<_> = DType::ALL.iter().map(|d| d.name()).collect();
        invalid(format!("unknown dtype {}; plait supports {}", arg.describe(), all.join(", ")))
    })
}

fn collective(arg: Named) -> PyResult<Collective> {
    let found = match &arg {
        Named::Code(c) => Collective::from_code(*c),
        Named::Name(n) => Collective::from_name(n),
    };
    found.ok_or_else(|| {
        let all: Vec<_> = Collective::ALL.iter().map(|c| c.name()).collect();
        invalid(format!("unknown collective {}; one of {}", arg.describe(), all.join(", ")))
    })
}

fn reduce_op(arg: Named, factor: Option<f64>) -> PyResult<ReduceOp> {
    let name = match &arg {
        Named::Code(c) => (*c as usize).checked_sub(1).and_then(|i| ReduceOp::NAMES.get(i)).map(|n| n.to_string()),
        Named::Name(n) => Some(n.clone()),
    };
    let name = name.ok_or_else(|| invalid(format!("unknown op {}", arg.describe())))?;
    ReduceOp::parse(&name, factor).map_err(invalid)
}

fn wire(name: Option<String>) -> PyResult<Option<Wire>> {
    name.map(|w| Wire::from_name(&w).ok_or_else(|| invalid(format!("unknown wire dtype {w:?}; one of {}", Wire::ALL.map(|w| w.name()).join(", ")))))
        .transpose()
}

impl Named {
    fn describe(&self) -> String {
        match self {
            Named::Code(c) => format!("code {c}"),
            Named::Name(n) => format!("{n:?}"),
        }
    }
}

/// A collective call as Python passes it (see `Comm.collective`).
#[allow(clippy::too_many_arguments)]
fn request(
    coll: Named,
    send_ptr: usize,
    send_nbytes: usize,
    recv_ptr: usize,
    recv_nbytes: usize,
    dtype: Named,
    op: Option<Named>,
    factor: Option<f64>,
    root: usize,
    send_counts: Option<Vec<usize>>,
    recv_counts: Option<Vec<usize>>,
    timeout: Option<f64>,
    algo: Option<String>,
    wire: Option<String>,
) -> PyResult<CollRequest> {
    let wire = self::wire(wire)?;
    let coll = collective(coll)?;
    let dt = self::dtype(dtype)?;
    let rop = reduce_op(op.unwrap_or(Named::Code(ReduceOp::Sum.code())), factor)?;
    Ok(CollRequest {
        coll,
        dtype: dt,
        op: rop,
        root,
        input: buf(send_ptr, send_nbytes),
        output: buf(recv_ptr, recv_nbytes),
        send_counts,
        recv_counts,
        timeout: secs(coll.name(), timeout)?,
        algo,
        wire,
    })
}

fn buf(ptr: usize, nbytes: usize) -> RawBuf {
    RawBuf { ptr: ptr as *mut u8, len: nbytes }
}

#[pyclass(name = "Work", module = "plait._core")]
struct PyWork {
    work: Work,
}

#[pymethods]
impl PyWork {
    /// Blocks (without the GIL) until the operation completes; True when done, False when
    /// `timeout` seconds passed first. Raises the operation's error.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let t = secs("Work.wait", timeout)?;
        let work = self.work.clone();
        match py.allow_threads(move || guarded("Work.wait", || Ok(work.wait(t)))).map_err(to_py)? {
            None => Ok(false),
            Some(Ok(_)) => Ok(true),
            Some(Err(e)) => Err(to_py(e)),
        }
    }

    fn is_completed(&self) -> bool {
        self.work.is_completed()
    }

    /// For a receive: the rank the message came from (-1 while not complete).
    fn source(&self) -> i64 {
        match self.work.wait(Some(Duration::ZERO)) {
            Some(Ok(s)) => s as i64,
            _ => -1,
        }
    }
}

/// A member of an elastic group (`plait.elastic`): its rank and size are those of the view it is
/// in now, and change between epochs.
#[pyclass(name = "Elastic", module = "plait._core")]
struct PyElastic {
    comm: Arc<ElasticComm>,
}

impl PyElastic {
    /// The current view, read without the GIL: the control plane's lock may be held a moment
    /// by its driver, and other Python threads go on meanwhile.
    fn view(&self, py: Python<'_>) -> plait_core::View {
        let comm = self.comm.clone();
        py.allow_threads(move || comm.view())
    }
}

#[pymethods]
impl PyElastic {
    /// Founds a group (no `peers`) or joins the group of a member at one of `peers`; returns once
    /// this member is in a committed view.
    #[new]
    #[pyo3(signature = (*, peers=Vec::new(), listen="0.0.0.0:0".to_string(), group="default".to_string(), timeout=None, heartbeat_timeout=None, witness=None, dial_timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        peers: Vec<String>,
        listen: String,
        group: String,
        timeout: Option<f64>,
        heartbeat_timeout: Option<f64>,
        witness: Option<String>,
        dial_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let mut cfg = CommConfig::from_env(0, 1).map_err(to_py)?;
        cfg.group = group;
        if let Some(t) = secs("elastic", timeout)? {
            cfg.timeout = t;
        }
        if let Some(h) = heartbeat_timeout {
            cfg.heartbeat_timeout = Duration::from_secs_f64(plait_core::check_setting("PLAIT_HEARTBEAT_TIMEOUT", &h.to_string()).map_err(to_py)?);
        }
        let dial_timeout = secs("elastic", dial_timeout)?;
        let comm = py.allow_threads(move || guarded("elastic", || ElasticComm::start(ElasticConfig { listen, peers, dial_timeout, witness, comm: cfg }))).map_err(to_py)?;
        Ok(PyElastic { comm: Arc::new(comm) })
    }

    #[getter]
    fn rank(&self, py: Python<'_>) -> usize {
        let me = self.comm.member_id();
        self.view(py).members.iter().position(|&m| m == me).unwrap_or(usize::MAX)
    }
    #[getter]
    fn size(&self, py: Python<'_>) -> usize {
        self.view(py).members.len()
    }
    #[getter]
    fn epoch(&self, py: Python<'_>) -> u64 {
        self.view(py).epoch
    }
    /// The members of the current view, most senior first (ids as hex).
    #[getter]
    fn members(&self, py: Python<'_>) -> Vec<String> {
        self.view(py).members.iter().map(|m| format!("{m:x}")).collect()
    }
    #[getter]
    fn member_id(&self) -> String {
        format!("{:x}", self.comm.member_id())
    }
    /// The deadline of each operation and view change, in seconds.
    #[getter]
    fn timeout(&self) -> f64 {
        self.comm.timeout().as_secs_f64()
    }
    /// The address joiners may be given.
    #[getter]
    fn contact(&self) -> String {
        self.comm.contact()
    }
    /// Every member's control address in the current view, most senior first.
    #[getter]
    fn contacts(&self, py: Python<'_>) -> Vec<String> {
        let view = self.view(py);
        view.members.iter().filter_map(|m| view.contacts.get(m).cloned()).collect()
    }
    /// Joiners this member knows of (a local answer).
    fn pending(&self) -> usize {
        self.comm.pending()
    }

    /// As `Comm.collective`, always blocking; returns a completed Work.
    #[pyo3(signature = (coll, send_ptr, send_nbytes, recv_ptr, recv_nbytes, dtype, op=None, *, factor=None, root=0, send_counts=None, recv_counts=None, timeout=None, algo=None, inline=true, wire=None))]
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &self,
        py: Python<'_>,
        coll: Named,
        send_ptr: usize,
        send_nbytes: usize,
        recv_ptr: usize,
        recv_nbytes: usize,
        dtype: Named,
        op: Option<Named>,
        factor: Option<f64>,
        root: usize,
        send_counts: Option<Vec<usize>>,
        recv_counts: Option<Vec<usize>>,
        timeout: Option<f64>,
        algo: Option<String>,
        inline: bool,
        wire: Option<String>,
    ) -> PyResult<PyWork> {
        if !inline {
            return Err(invalid("elastic mode runs blocking operations only (async_op=False)".into()));
        }
        let req = request(coll, send_ptr, send_nbytes, recv_ptr, recv_nbytes, dtype, op, factor, root, send_counts, recv_counts, timeout, algo, wire)?;
        let name = req.coll.name();
        let comm = self.comm.clone();
        // SAFETY: as `Comm.collective`: plait.elastic keeps both buffers alive until it returns.
        let r = py.allow_threads(move || guarded(name, || unsafe { comm.collective(req) }));
        Ok(PyWork { work: Work::done(r.map(|_| 0)) })
    }

    /// The update point (every member calls it at the same place in its loop): admits waiting
    /// joiners; True if the view changed.
    fn update(&self, py: Python<'_>) -> PyResult<bool> {
        let comm = self.comm.clone();
        py.allow_threads(move || guarded("update", || comm.update())).map_err(to_py)
    }

    fn close(&self, py: Python<'_>) {
        let comm = self.comm.clone();
        let _ = py.allow_threads(move || guarded("close", || {
            comm.close();
            Ok(())
        }));
    }
}

/// A witness for one elastic group (`plait witness`).
#[pyclass(name = "Witness", module = "plait._core")]
struct PyWitness {
    witness: plait_core::Witness,
}

#[pymethods]
impl PyWitness {
    #[new]
    #[pyo3(signature = (*, listen, group="default".to_string(), heartbeat_timeout=None))]
    fn new(listen: String, group: String, heartbeat_timeout: Option<f64>) -> PyResult<Self> {
        let cfg = CommConfig::from_env(0, 1).map_err(to_py)?;
        let hb = match heartbeat_timeout {
            Some(h) => Duration::from_secs_f64(plait_core::check_setting("PLAIT_HEARTBEAT_TIMEOUT", &h.to_string()).map_err(to_py)?),
            None => cfg.heartbeat_timeout,
        };
        let token = cfg.token.as_ref().map(|t| t.secret().to_vec());
        let witness = guarded("witness", || plait_core::Witness::start(&group, &listen, token, hb)).map_err(to_py)?;
        Ok(PyWitness { witness })
    }
    #[getter]
    fn contact(&self) -> String {
        self.witness.contact()
    }
    /// (epoch, number of members) of the last view it learnt.
    fn view(&self) -> (u64, usize) {
        let v = self.witness.view();
        (v.epoch, v.members.len())
    }
    fn close(&self) {
        self.witness.close();
    }
}

#[pyclass(name = "Comm", module = "plait._core")]
struct PyComm {
    comm: Arc<Communicator>,
}

impl PyComm {
    fn work(&self, r: plait_core::Result<Work>) -> PyResult<PyWork> {
        r.map(|work| PyWork { work }).map_err(to_py)
    }
}

#[pymethods]
impl PyComm {
    #[new]
    #[pyo3(signature = (store, rank, size, *, timeout=None, group="default".to_string(), epoch=0, algo=None, threads="creator".to_string(), schedules=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(py: Python<'_>, store: PyObject, rank: usize, size: usize, timeout: Option<f64>, group: String, epoch: u64, algo: Option<String>, threads: String, schedules: Option<String>) -> PyResult<Self> {
        let mut cfg = CommConfig::from_env(rank, size).map_err(to_py)?;
        cfg.threads = ThreadUse::from_name(&threads).ok_or_else(|| {
            invalid(format!("threads={threads:?}: one of {}", ThreadUse::ALL.map(|t| t.name()).join(", ")))
        })?;
        if let Some(t) = secs("Comm", timeout)? {
            cfg.timeout = t;
        }
        cfg.group = group;
        cfg.epoch = epoch;
        if let Some(spec) = schedules {
            cfg.schedules = plait_core::load_schedules(&spec).map_err(to_py)?;
        }
        if algo.is_some() {
            cfg.algo = algo;
        }
        let store = PyStore(store);
        let comm = py.allow_threads(move || guarded("Comm", || Communicator::new(&store, cfg))).map_err(to_py)?;
        Ok(PyComm { comm })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    #[getter]
    fn size(&self) -> usize {
        self.comm.size()
    }
    #[getter]
    fn epoch(&self) -> u64 {
        self.comm.config().epoch
    }
    #[getter]
    fn group(&self) -> String {
        self.comm.config().group.clone()
    }
    #[getter]
    fn timeout(&self) -> f64 {
        self.comm.config().timeout.as_secs_f64()
    }
    /// Which threads may call collectives: "creator" or "sequential".
    #[getter]
    fn threads(&self) -> &'static str {
        self.comm.config().threads.name()
    }

    /// Starts a collective over raw host memory. `inline=True` runs it on this thread (GIL
    /// released) and returns a completed Work; otherwise it runs in the background.
    #[pyo3(signature = (coll, send_ptr, send_nbytes, recv_ptr, recv_nbytes, dtype, op=None, *, factor=None, root=0, send_counts=None, recv_counts=None, timeout=None, algo=None, inline=false, wire=None))]
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &self,
        py: Python<'_>,
        coll: Named,
        send_ptr: usize,
        send_nbytes: usize,
        recv_ptr: usize,
        recv_nbytes: usize,
        dtype: Named,
        op: Option<Named>,
        factor: Option<f64>,
        root: usize,
        send_counts: Option<Vec<usize>>,
        recv_counts: Option<Vec<usize>>,
        timeout: Option<f64>,
        algo: Option<String>,
        inline: bool,
        wire: Option<String>,
    ) -> PyResult<PyWork> {
        let req = request(coll, send_ptr, send_nbytes, recv_ptr, recv_nbytes, dtype, op, factor, root, send_counts, recv_counts, timeout, algo, wire)?;
        let coll = req.coll;
        let comm = self.comm.clone();
        // SAFETY: the Python caller (plait.comm, plait.torch) keeps both buffers alive and
        // untouched until the returned Work has completed: the contract of `plait_core::RawBuf`.
        let name = coll.name();
        let r = if inline {
            py.allow_threads(move || guarded(name, || unsafe { comm.collective(req, true) }))
        } else {
            guarded(name, || unsafe { comm.collective(req, false) })
        };
        self.work(r)
    }

    #[pyo3(signature = (ptr, nbytes, dtype, dst, tag=0, *, timeout=None, inline=false))]
    #[allow(clippy::too_many_arguments)]
    fn send(&self, py: Python<'_>, ptr: usize, nbytes: usize, dtype: Named, dst: usize, tag: u64, timeout: Option<f64>, inline: bool) -> PyResult<PyWork> {
        let (dt, t, comm) = (self::dtype(dtype)?, secs("send", timeout)?, self.comm.clone());
        let data = buf(ptr, nbytes);
        // SAFETY: as in `collective`: the caller keeps the buffer until the Work completes.
        let r = py.allow_threads(move || guarded("send", || unsafe { comm.send(data, dt, dst, tag, t, inline) }));
        self.work(r)
    }

    #[pyo3(signature = (ptr, nbytes, dtype, src, tag=0, *, timeout=None, inline=false))]
    #[allow(clippy::too_many_arguments)]
    fn recv(&self, py: Python<'_>, ptr: usize, nbytes: usize, dtype: Named, src: i64, tag: u64, timeout: Option<f64>, inline: bool) -> PyResult<PyWork> {
        let (dt, t, comm) = (self::dtype(dtype)?, secs("recv", timeout)?, self.comm.clone());
        let src = if src < 0 { None } else { Some(src as usize) };
        let data = buf(ptr, nbytes);
        // SAFETY: as in `collective`: the caller keeps the buffer until the Work completes.
        let r = py.allow_threads(move || guarded("recv", || unsafe { comm.recv(data, dt, src, tag, t, inline) }));
        self.work(r)
    }

    #[pyo3(signature = (*, timeout=None, inline=false))]
    fn barrier(&self, py: Python<'_>, timeout: Option<f64>, inline: bool) -> PyResult<PyWork> {
        let (t, comm) = (secs("barrier", timeout)?, self.comm.clone());
        let r = py.allow_threads(move || guarded("barrier", || comm.barrier(t, inline)));
        self.work(r)
    }

    /// A communicator over `ranks` of this one (their order gives the new ranks) on this one's
    /// links: no socket is opened and nothing is sent. Every member passes the same name and
    /// ranks; a name serves one subgroup of this communicator only.
    #[pyo3(signature = (name, ranks, *, timeout=None, algo=None))]
    fn subgroup(&self, py: Python<'_>, name: String, ranks: Vec<usize>, timeout: Option<f64>, algo: Option<String>) -> PyResult<Self> {
        let timeout = secs("subgroup", timeout)?;
        let comm = self.comm.clone();
        let sub = py.allow_threads(move || guarded("subgroup", || comm.subgroup(&name, &ranks, timeout, algo))).map_err(to_py)?;
        Ok(PyComm { comm: sub })
    }

    /// Refuses this rank's next collective (bad arguments: `reason`), so the other ranks' part of
    /// it fails with that reason instead of waiting. Returns its sequence number.
    fn refuse(&self, py: Python<'_>, reason: String) -> PyResult<u64> {
        let comm = self.comm.clone();
        py.allow_threads(move || guarded("refuse", || comm.refuse(&reason))).map_err(to_py)
    }

    #[pyo3(signature = (reason="abort() called".to_string()))]
    fn abort(&self, py: Python<'_>, reason: String) {
        let comm = self.comm.clone();
        let _ = py.allow_threads(move || guarded("abort", || {
            comm.abort(&reason);
            Ok(())
        }));
    }

    fn close(&self, py: Python<'_>) {
        let comm = self.comm.clone();
        let _ = py.allow_threads(move || guarded("close", || {
            comm.close();
            Ok(())
        }));
    }

    #[pyo3(signature = (coll, nbytes, root=0))]
    fn algorithm_for(&self, coll: Named, nbytes: usize, root: usize) -> PyResult<String> {
        self.comm.algorithm_for(collective(coll)?, nbytes, root).map_err(to_py)
    }

    /// The cost model's estimate in seconds for coll over nbytes (even blocks) with algo (the
    /// selector's choice when None), and the schedule it priced ("ring (order 0>2>1>3)").
    #[pyo3(signature = (coll, nbytes, root=0, algo=None))]
    fn predict(&self, coll: Named, nbytes: usize, root: usize, algo: Option<String>) -> PyResult<(f64, String)> {
        self.comm.predict(collective(coll)?, nbytes, root, algo.as_deref()).map_err(to_py)
    }

    /// The cost model's constants fitted to measured runs, a list of (coll, algo, nbytes, root,
    /// seconds): {"setting": PLAIT_COST_MODEL text, "alpha", "bandwidth", "gamma", "parallelism",
    /// "before", "after": each run's prediction with the constants in use and with the fitted ones}.
    fn fit_cost_model<'py>(&self, py: Python<'py>, runs: Vec<(Named, String, usize, usize, f64)>) -> PyResult<Bound<'py, PyDict>> {
        let runs = runs.into_iter().map(|(c, a, n, r, t)| Ok((collective(c)?, a, n, r, t))).collect::<PyResult<Vec<_>>>()?;
        let fit = py.allow_threads(|| self.comm.fit_cost_model(&runs)).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("setting", fit.setting)?;
        d.set_item("alpha", fit.alpha)?;
        d.set_item("bandwidth", fit.bandwidth)?;
        d.set_item("gamma", fit.gamma)?;
        d.set_item("parallelism", fit.parallelism)?;
        d.set_item("before", fit.before)?;
        d.set_item("after", fit.after)?;
        Ok(d)
    }

    fn routes<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.comm
            .routes()
            .iter()
            .map(|r| {
                let d = PyDict::new(py);
                d.set_item("peer", r.peer)?;
                d.set_item("local", &r.local)?;
                d.set_item("remote", &r.remote)?;
                d.set_item("reason", &r.reason)?;
                d.set_item("local_iface", &r.local_iface)?;
                d.set_item("same_host", r.same_host)?;
                d.set_item("rtt_us", r.rtt_us)?;
                d.set_item("streams", r.streams)?;
                d.set_item("max_streams", r.max_streams)?;
                d.set_item("rx_bytes_per_s", r.rx_bytes_per_s)?;
                d.set_item("via", r.via)?;
                d.set_item("shm_lanes", r.shm_lanes)?;
                Ok(d)
            })
            .collect()
    }

    /// The order ring algorithms pass data in: position p is rank order[p], which sends to
    /// order[p + 1] (PLAIT_RING_ORDER; rank order unless the links were measured).
    fn ring_order(&self) -> Vec<usize> {
        self.comm.ring_order()
    }

    /// Each directed link as measured at start-up (PLAIT_MEASURE): (latency in seconds,
    /// bandwidth in bytes per second), each as [from][to] with None on the diagonal; None when
    /// the links were not measured.
    #[allow(clippy::type_complexity)]
    fn link_matrix(&self) -> Option<(Vec<Vec<Option<f64>>>, Vec<Vec<Option<f64>>>)> {
        let m = self.comm.link_matrix()?;
        let table = |f: &dyn Fn(usize, usize) -> f64| -> Vec<Vec<Option<f64>>> {
            (0..m.n).map(|i| (0..m.n).map(|j| (i != j).then(|| f(i, j))).collect()).collect()
        };
        Some((table(&|i, j| m.latency(i, j)), table(&|i, j| m.bandwidth(i, j))))
    }

    /// How the ranks are wired, as every rank sees it: "single", "full_mesh" (a dedicated
    /// interface per peer), "shared" (one interface or loopback) or "partial_mesh".
    fn topology(&self) -> &'static str {
        self.comm.topology().name()
    }

    /// The TCP port this rank listens on for its peers (None in a world of one).
    fn listen_port(&self) -> Option<u16> {
        self.comm.listen_port()
    }
}

/// The algorithm names `PLAIT_ALGO` accepts for a collective, the default first.
#[pyfunction]
fn algorithms(coll: Named) -> PyResult<Vec<String>> {
    Ok(plait_core::algorithms(collective(coll)?).iter().map(|s| s.to_string()).collect())
}

/// A built-in algorithm's schedule as a version-1 schedule file (JSON text).
#[pyfunction]
#[pyo3(signature = (coll, algo, nranks, root=0, name=None))]
fn schedule_file(coll: Named, algo: &str, nranks: usize, root: usize, name: Option<&str>) -> PyResult<String> {
    plait_core::builtin_schedule_file(collective(coll)?, algo, nranks, root, name).map_err(to_py)
}

/// Reads and checks a schedule file's text (`origin` names it in errors); returns its facts.
/// Raises ConfigError saying what is wrong. `custom=False` also reads a built-in's own file.
#[pyfunction]
#[pyo3(signature = (text, origin="<schedule>", custom=true))]
fn check_schedule<'py>(py: Python<'py>, text: &str, origin: &str, custom: bool) -> PyResult<Bound<'py, PyDict>> {
    let read = if custom { plait_core::parse_schedule_file } else { plait_core::read_schedule_file };
    let c = read(text, origin).map_err(to_py)?;
    let s = &c.schedule;
    let d = PyDict::new(py);
    d.set_item("name", &s.name)?;
    d.set_item("collective", s.collective.name())?;
    d.set_item("nranks", s.nranks)?;
    d.set_item("root", s.root)?;
    d.set_item("scratch_slots", s.scratch_slots)?;
    d.set_item("steps", s.nsteps())?;
    d.set_item("transfers", s.ranks.iter().flatten().map(|st| st.sends.len()).sum::<usize>())?;
    d.set_item("locals", s.ranks.iter().flatten().map(|st| st.locals.len()).sum::<usize>())?;
    d.set_item("digest", &c.digest)?;
    d.set_item("description", &c.description)?;
    let w = PyDict::new(py);
    w.set_item("min_bytes", c.when.min_bytes)?;
    w.set_item("max_bytes", c.when.max_bytes)?;
    w.set_item("topology", c.when.topology.as_deref().unwrap_or("any"))?;
    d.set_item("when", w)?;
    Ok(d)
}

/// The cost model's predicted seconds for a schedule file at each size (bytes of the whole
/// layout), on links of class `topology`, with `cost_model` constants (PLAIT_COST_MODEL's form;
/// default: the built-in constants), with the ranks on `hosts` hosts as torchrun numbers them.
/// Built-in algorithms' own files are read too.
#[pyfunction]
#[pyo3(signature = (text, sizes, *, topology="shared", hosts=1, cost_model=None, segment_bytes=1048576, origin="<schedule>"))]
fn estimate_schedule(text: &str, sizes: Vec<u64>, topology: &str, hosts: usize, cost_model: Option<&str>, segment_bytes: usize, origin: &str) -> PyResult<Vec<f64>> {
    let s = plait_core::read_schedule_file(text, origin).map_err(to_py)?.schedule;
    let constants = match cost_model.filter(|t| !t.trim().is_empty()) {
        Some(t) => plait_core::CostConstants::parse(t).map_err(|e| to_py(PlaitError::Config(format!("PLAIT_COST_MODEL: {e}"))))?,
        None => plait_core::CostConstants::default(),
    };
    plait_core::estimate_schedule(&s, &sizes, topology, hosts, &constants, segment_bytes).map_err(to_py)
}

/// This host's interface addresses as plait sees them (what each rank publishes).
#[pyfunction]
fn interfaces(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    plait_core::list_interfaces()
        .into_iter()
        .map(|a| {
            let d = PyDict::new(py);
            d.set_item("name", &a.name)?;
            d.set_item("ip", a.ip.to_string())?;
            d.set_item("prefix", a.prefix)?;
            d.set_item("mtu", a.mtu)?;
            d.set_item("speed_mbps", a.speed_mbps)?;
            Ok(d)
        })
        .collect()
}

/// This host's identity as the core uses it to decide which ranks share a host (one kernel boot
/// and one network stack); None where the system does not say.
#[pyfunction]
fn host_identity() -> Option<String> {
    plait_core::host_identity()
}

/// The BLAKE3 hash of each `chunk`-byte piece of the `nbytes` bytes at `ptr` (32 bytes each, one
/// after the other), hashed on several threads without the GIL. The caller keeps the memory
/// alive and unchanged meanwhile.
#[pyfunction]
fn chunk_hashes(py: Python<'_>, ptr: usize, nbytes: usize, chunk: usize) -> PyResult<PyObject> {
    if chunk == 0 {
        return Err(invalid("chunk_hashes: the chunk size must be positive".into()));
    }
    let data = buf(ptr, nbytes);
    // SAFETY: the caller keeps the buffer alive and unchanged until this returns.
    let hashes = py.allow_threads(move || plait_core::chunk_hashes(unsafe { data.as_slice() }, chunk));
    Ok(pyo3::types::PyBytes::new(py, &hashes).into())
}

/// Replaces the f32 values in the `nbytes` bytes at `ptr` by what they become on the wire `wire`
/// ("bf16", "f16", "int8"): decode(encode(x)), in place and without the GIL. Returns the bytes
/// they take on that wire.
#[pyfunction]
fn wire_round_trip(py: Python<'_>, wire: String, ptr: usize, nbytes: usize) -> PyResult<usize> {
    let w = self::wire(Some(wire))?.expect("a name was given");
    if nbytes % 4 != 0 {
        return Err(invalid(format!("wire_round_trip: {nbytes} bytes are not whole f32 values")));
    }
    let data = buf(ptr, nbytes);
    // SAFETY: the caller keeps the buffer alive, and nothing else touches it, until this returns.
    py.allow_threads(move || plait_core::wire_round_trip(w, unsafe { data.as_slice_mut() }));
    Ok(w.encoded_len(nbytes / 4))
}

/// Bytes that `elems` f32 values take on the wire `wire` ("native", "bf16", "f16", "int8").
#[pyfunction]
fn wire_bytes(wire: String, elems: usize) -> PyResult<usize> {
    Ok(self::wire(Some(wire))?.expect("a name was given").encoded_len(elems))
}

/// Checks an operator for a dtype as the core will: returns the operator's name and factor
/// normalised, or raises InvalidArgumentError saying what is wrong.
#[pyfunction]
#[pyo3(signature = (op, dtype, factor=None))]
fn check_op(op: Named, dtype: Named, factor: Option<f64>) -> PyResult<(String, Option<f64>)> {
    let (op, dt) = (reduce_op(op, factor)?, self::dtype(dtype)?);
    if let Some(why) = op.refusal(dt) {
        return Err(invalid(why));
    }
    Ok((op.name().to_string(), factor))
}

/// The value of a setting listed in SETTINGS, None when unset or blank: the one reader of
/// plait's environment.
#[pyfunction]
fn setting(name: &str) -> PyResult<Option<String>> {
    if !plait_core::SETTINGS.iter().any(|s| s.name == name) {
        return Err(invalid(format!("{name} is not a plait setting (see plait._core.SETTINGS)")));
    }
    Ok(plait_core::setting(name))
}

/// A number argument `name` of call `what` ("timeout", "world_size", "epoch": `ARGUMENTS`), as
/// the core checks its own: returned (an int for whole-number ranges) when within range, else
/// InvalidArgumentError naming the call, the argument and the range.
#[pyfunction]
#[pyo3(signature = (name, value, what=""))]
fn check_argument<'py>(py: Python<'py>, name: &str, value: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyAny>> {
    let range = plait_core::argument_range(name).map_err(to_py)?;
    // A bool is not a number here; an int too large for a float is out of range like any other.
    let number = if value.is_instance_of::<PyBool>() { None } else { value.extract::<f64>().ok() };
    let Some(v) = number else {
        let mut shown = value.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
        if shown.len() > 40 {
            shown = format!("{}...", shown.chars().take(37).collect::<String>());
        }
        return Err(to_py(plait_core::refuse_argument(what, name, &shown)));
    };
    let v = plait_core::check_argument(what, name, v).map_err(to_py)?;
    if range.integer {
        Ok((v as i64).into_pyobject(py)?.into_any())
    } else {
        Ok(v.into_pyobject(py)?.into_any())
    }
}

/// The value of numeric setting `name` written as `text`, as the core parses it (ConfigError
/// naming the setting and its range when it is not a number in range).
#[pyfunction]
fn check_setting(name: &str, text: &str) -> PyResult<f64> {
    plait_core::check_setting(name, text).map_err(to_py)
}

/// The core's settings as the core parses them from the environment (raises ConfigError, naming
/// the setting, when one is malformed): timeout (seconds), algo, wire, segment_bytes, streams,
/// caller_read_bytes, busy_poll_us.
#[pyfunction]
fn env_config(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = CommConfig::from_env(0, 1).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("timeout", c.timeout.as_secs_f64())?;
    d.set_item("algo", c.algo)?;
    d.set_item("wire", c.wire.name())?;
    d.set_item("segment_bytes", c.segment_bytes)?;
    d.set_item("streams", c.streams)?;
    d.set_item("caller_read_bytes", c.caller_read_bytes)?;
    d.set_item("busy_poll_us", c.busy_poll.as_micros() as u64)?;
    Ok(d)
}

/// The canonical name of a wire encoding as the core reads it ("native" for none, "fp16" ->
/// "f16"...); ConfigError when the core has no such encoding.
#[pyfunction]
fn wire_name(name: &str) -> PyResult<&'static str> {
    Wire::from_name(name).map(|w| w.name()).ok_or_else(|| {
        to_py(PlaitError::Config(format!("unknown wire dtype {name:?}; one of {}", Wire::ALL.map(|w| w.name()).join(", "))))
    })
}

/// The core's tables, read by the Python layers instead of keeping copies.
fn add_tables(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let tuple_of_dicts = |rows: Vec<Vec<(&str, Bound<'_, PyAny>)>>| -> PyResult<Bound<'_, PyTuple>> {
        let dicts = rows
            .into_iter()
            .map(|row| {
                let d = PyDict::new(py);
                for (k, v) in row {
                    d.set_item(k, v)?;
                }
                Ok(d)
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, dicts)
    };
    let mut rows = Vec::new();
    for d in DType::ALL {
        rows.push(vec![
            ("name", d.name().into_pyobject(py)?.into_any()),
            ("code", (d as u8).into_pyobject(py)?.into_any()),
            ("size", d.size().into_pyobject(py)?.into_any()),
            ("float", PyBool::new(py, d.is_float()).to_owned().into_any()),
        ]);
    }
    m.add("DTYPES", tuple_of_dicts(rows)?)?;
    let mut rows = Vec::new();
    for (i, name) in ReduceOp::NAMES.iter().enumerate() {
        rows.push(vec![("name", name.into_pyobject(py)?.into_any()), ("code", (i + 1).into_pyobject(py)?.into_any())]);
    }
    m.add("OPS", tuple_of_dicts(rows)?)?;
    let mut rows = Vec::new();
    for c in Collective::ALL {
        rows.push(vec![("name", c.name().into_pyobject(py)?.into_any()), ("code", c.code().into_pyobject(py)?.into_any())]);
    }
    m.add("COLLECTIVES", tuple_of_dicts(rows)?)?;
    m.add("WIRES", PyTuple::new(py, Wire::ALL.map(|w| w.name()))?)?;
    let mut rows = Vec::new();
    for s in plait_core::SETTINGS {
        rows.push(vec![
            ("name", s.name.into_pyobject(py)?.into_any()),
            ("kind", s.kind.into_pyobject(py)?.into_any()),
            ("default", s.default.into_pyobject(py)?.into_any()),
            ("doc", s.doc.into_pyobject(py)?.into_any()),
            ("min", s.range.map(|r| r.min).into_pyobject(py)?.into_any()),
            ("max", s.range.map(|r| r.max).into_pyobject(py)?.into_any()),
        ]);
    }
    m.add("SETTINGS", tuple_of_dicts(rows)?)?;
    m.add("RESERVED_TAGS", plait_core::RESERVED_TAGS)?;
    Ok(())
}

/// The core's logs on stderr: `PLAIT_DEBUG`'s level (errors only when unset), coloured only when
/// stderr is a terminal, so that a log file gets plain text.
fn init_logging() {
    use std::io::IsTerminal;
    let filter = match plait_core::setting("PLAIT_DEBUG") {
        Some(level) => tracing_subscriber::EnvFilter::try_new(format!("plait_core={}", level.to_lowercase()))
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("plait_core=info")),
        None => tracing_subscriber::EnvFilter::new("plait_core=error"),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    init_logging();
    let ns = PyDict::new(py);
    py.run(&std::ffi::CString::new(EXCEPTIONS).unwrap(), Some(&ns), Some(&ns))?;
    for name in [
        "PlaitError", "PeerError", "PeerLost", "EvictedError", "PlaitTimeoutError", "AbortedError", "MismatchError", "BrokenError",
        "RendezvousError", "ConfigError", "InvalidArgumentError",
    ] {
        let cls = ns.get_item(name)?.expect("defined above");
        cls.setattr("__module__", "plait")?;
        m.add(name, cls)?;
    }
    let _ = EXC.set(py, ns.unbind());
    m.add_class::<PyComm>()?;
    m.add_class::<PyElastic>()?;
    m.add_class::<PyWitness>()?;
    m.add_class::<PyWork>()?;
    m.add_function(wrap_pyfunction!(algorithms, m)?)?;
    m.add_function(wrap_pyfunction!(schedule_file, m)?)?;
    m.add_function(wrap_pyfunction!(check_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(estimate_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(interfaces, m)?)?;
    m.add_function(wrap_pyfunction!(host_identity, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(wire_round_trip, m)?)?;
    m.add_function(wrap_pyfunction!(wire_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(check_op, m)?)?;
    m.add_function(wrap_pyfunction!(setting, m)?)?;
    m.add_function(wrap_pyfunction!(env_config, m)?)?;
    m.add_function(wrap_pyfunction!(wire_name, m)?)?;
    m.add_function(wrap_pyfunction!(check_argument, m)?)?;
    m.add_function(wrap_pyfunction!(check_setting, m)?)?;
    add_tables(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
