//! A communicator's configuration, and the one place that reads plait's settings from the
//! environment. Every setting is in [`SETTINGS`] with its name, kind, default and meaning; the
//! bindings hand that table to Python, and the README's table is checked against it.

use super::threads::ThreadUse;
use crate::codec::Wire;
use crate::error::{PlaitError, Result};
use std::time::Duration;

/// One environment setting of the core.
#[derive(Clone, Copy, Debug)]
pub struct Setting {
    pub name: &'static str,
    /// What the value is: `seconds`, `bytes`, `microseconds`, `count`, `text` or `choice`.
    pub kind: &'static str,
    /// The default, as text ("" when unset means none).
    pub default: &'static str,
    pub doc: &'static str,
    /// The values a numeric setting may take; None for text and choices.
    pub range: Option<Range>,
}

/// The values a number plait takes may have, from the environment or as an argument. Settings
/// and arguments are checked against these at the edge (here for Rust callers, through the
/// bindings for Python's own arguments), so that no absurd value reaches a `Duration` or an
/// `Instant` computation, which panic on overflow, infinity and NaN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Range {
    /// What the number counts, for errors: "a number of seconds".
    pub unit: &'static str,
    pub min: f64,
    pub max: f64,
    /// Whole numbers only.
    pub integer: bool,
}

impl Range {
    pub fn contains(&self, v: f64) -> bool {
        v.is_finite() && v >= self.min && v <= self.max && (!self.integer || v.fract() == 0.0)
    }

    /// "must be a number of seconds between 0.001 and 31536000"
    pub fn describe(&self) -> String {
        let whole = if self.integer { "whole " } else { "" };
        format!("must be a {whole}{} between {} and {}", self.unit, show(self.min), show(self.max))
    }

    /// `name=shown: must be ...`, for a value `shown` as the user wrote it.
    fn refusal(&self, name: &str, shown: &str) -> String {
        format!("{name}={shown}: {}", self.describe())
    }
}

/// A number as users write it: whole numbers without a fraction.
fn show(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e16 {
        format!("{v:.0}")
    } else {
        format!("{v:?}")
    }
}

/// A year: a deadline longer than that is a mistake, and every deadline (`Instant::now() +
/// timeout`) stays far from overflow.
pub const TIMEOUT: Range = Range { unit: "number of seconds", min: 0.001, max: 31_536_000.0, integer: false };
/// A full mesh of this many ranks already needs 65 535 sockets per rank (and ranks travel as
/// u32 in hellos).
pub const MAX_WORLD_SIZE: usize = 1 << 16;
pub const WORLD_SIZE: Range = Range { unit: "number of ranks", min: 1.0, max: MAX_WORLD_SIZE as f64, integer: true };
/// Epochs count communicators rebuilt; 2^53 keeps them exact in a Python float.
pub const EPOCH: Range = Range { unit: "number", min: 0.0, max: 9_007_199_254_740_992.0, integer: true };
pub const MAX_SEGMENT_BYTES: usize = 1 << 30;
const SEGMENT_BYTES: Range = Range { unit: "number of bytes", min: 1024.0, max: MAX_SEGMENT_BYTES as f64, integer: true };
const STREAMS: Range = Range { unit: "number of connections per peer", min: 1.0, max: MAX_STREAMS as f64, integer: true };
/// Sizes that only say "up to": anything from a TiB on means "everything".
const BYTES_UP_TO: Range = Range { unit: "number of bytes (0: off)", min: 0.0, max: (1u64 << 40) as f64, integer: true };
const HELLO_TIMEOUT: Range = Range { unit: "number of seconds", min: 0.001, max: 1e6, integer: false };
const UNEXPECTED_BYTES: Range =
    Range { unit: "number of bytes", min: MIN_UNEXPECTED_BYTES as f64, max: (1u64 << 40) as f64, integer: true };
/// A ring holds at least one segment; past a GiB it is memory nobody waits on.
const SHM_BYTES: Range = Range { unit: "number of bytes (0: off)", min: 0.0, max: (1u64 << 30) as f64, integer: true };
const BUSY_POLL_US: Range = Range { unit: "number of microseconds (0: sleep at once)", min: 0.0, max: 1_000_000.0, integer: true };
const STAGING_CACHE: Range = Range { unit: "number of bytes", min: 0.0, max: (1u64 << 48) as f64, integer: true };
const TRACE_ENTRIES: Range = Range { unit: "number of operations (0: off)", min: 0.0, max: 10_000_000.0, integer: true };

/// The arguments of the API with a range of their own (settings have theirs in [`SETTINGS`]).
pub const ARGUMENTS: &[(&str, Range)] = &[("timeout", TIMEOUT), ("world_size", WORLD_SIZE), ("epoch", EPOCH)];

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
pub const DEFAULT_HELLO_TIMEOUT: Duration = crate::net::listener::HANDSHAKE_TIMEOUT;
const HEARTBEAT_TIMEOUT: Range = Range { unit: "number of seconds", min: 0.5, max: 3600.0, integer: false };
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;
/// Blocking calls this small read their links on the calling thread: saves a thread hand-off
/// per message, while larger transfers keep one receiver thread per link (links in parallel).
pub const DEFAULT_CALLER_READ_BYTES: usize = 64 * 1024;
/// How long a small blocking call polls its links, yielding its core between polls, before it
/// sleeps. A peer's frame then finds this rank awake: no wake-up, no switch back to it. 4-byte
/// allreduce p50 on 2 cores, 3000 calls: 2 ranks 105-113 us against 162-165 us sleeping at once,
/// 3 ranks 307-323 against 376-402, 4 ranks 397-406 against 631-632. A millisecond, because a
/// small call on ranks that share cores often waits that long for its last peer to be scheduled;
/// it is spent once per call, so a rank waiting for a late peer sleeps after it.
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_micros(1000);
/// One TCP stream per peer unless told otherwise. Measured with 64 MiB allreduces, two streams
/// were equal on loopback and on 1 Gbit/s cables (one stream fills those) and 5-10 % faster
/// between two network namespaces over an unlimited veth pair; but with 4 ranks on 2 cores the
/// 8-byte allreduce p50 rose about 10 % (0.21-0.24 ms against 0.24-0.27 ms). Links with a large
/// bandwidth-delay product or per-flow limits want more (see the README).
pub const DEFAULT_STREAMS: usize = 1;
/// Shared memory per direction of a link between ranks of one host (`net::shm`): four default
/// segments in flight.
pub const DEFAULT_SHM_BYTES: usize = 4 << 20;
pub const MAX_STREAMS: usize = crate::net::handshake::MAX_LANES as usize;
/// The most connections start-up opens on its own to a link that one stream cannot fill (its
/// measured rate is what the socket buffers let one stream carry over its round trip): 8 fill a
/// 100 ms, 1 Gbit/s cable with a stock Linux kernel's 4 MiB send buffers, twice over.
pub const DEFAULT_STREAMS_MAX: usize = 8;
use crate::session::{DEFAULT_UNEXPECTED_BYTES, MIN_UNEXPECTED_BYTES};

/// Every setting the core reads, in the order the README lists them.
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: "PLAIT_TIMEOUT",
        kind: "seconds",
        default: "300",
        doc: "Deadline of start-up and of every operation; a peer silent for this long is named in the error.",
        range: Some(TIMEOUT),
    },
    Setting {
        name: "PLAIT_HELLO_TIMEOUT",
        kind: "seconds",
        default: "5",
        doc: "How long an accepted connection may take to send its hello; a connection silent for longer is closed (a real peer sends it at once). It never holds up other connections.",
        range: Some(HELLO_TIMEOUT),
    },
    Setting {
        name: "PLAIT_HEARTBEAT_TIMEOUT",
        kind: "seconds",
        default: "2",
        doc: "Elastic mode: a member silent this long (no heartbeat, no message) is suspected and left out of the next view; heartbeats go every quarter of it. From 0.5 to 3600.",
        range: Some(HEARTBEAT_TIMEOUT),
    },
    Setting {
        name: "PLAIT_JOIN",
        kind: "text",
        default: "",
        doc: "Elastic mode: control addresses (`host:port`, comma-separated) of members of the group to join, for `plait.elastic.join()` called without peers; a name that resolves to several addresses (one DNS name for the group) is tried at each. Empty founds a new group.",
        range: None,
    },
    Setting {
        name: "PLAIT_JOIN_STORE",
        kind: "text",
        default: "",
        doc: "Elastic mode: `host:port` of a store (a torch TCPStore server, such as `plait store`) that keeps the group's addresses, for `plait.elastic.join()` called without peers: the first process to find no group there founds one, the others join it. The group trains on if the store goes away; only joiners need it. Exclusive with PLAIT_JOIN.",
        range: None,
    },
    Setting {
        name: "PLAIT_WITNESS",
        kind: "text",
        default: "",
        doc: "Elastic mode: the address (`host:port`) of the group's witness (`plait witness`), for the member that founds the group; joiners learn it from the group. It votes in every change, so that a group of two survives losing one.",
        range: None,
    },
    Setting {
        name: "PLAIT_LISTEN",
        kind: "text",
        default: "0.0.0.0:0",
        doc: "Elastic mode: where this member's control plane listens (`host:port`; port 0 picks one), for `plait.elastic.join()` called without `listen`.",
        range: None,
    },
    Setting {
        name: "PLAIT_IFACE",
        kind: "text",
        default: "",
        doc: "Interfaces to use, NCCL_SOCKET_IFNAME-like: name prefixes or CIDRs, comma-separated (`eth,10.1.0.0/16`); a leading `^` excludes them, a leading `=` makes names exact.",
        range: None,
    },
    Setting {
        name: "PLAIT_ROUTES",
        kind: "text",
        default: "",
        doc: "Path of an N x N route matrix (JSON) that overrides subnet matching.",
        range: None,
    },
    Setting {
        name: "PLAIT_ALGO",
        kind: "text",
        default: "",
        doc: "Force algorithms per collective: `allreduce:ring,allgather:direct`.",
        range: None,
    },
    Setting {
        name: "PLAIT_SCHEDULES",
        kind: "text",
        default: "",
        doc: "Custom schedules (docs/schedules.md): schedule files and directories of them (every *.json), separated by ':' (';' on Windows). Each is verified when the communicator is created; the cost model weighs it against the built-ins for calls its `when` block covers, and PLAIT_ALGO may name it. Every rank must hold the same ones.",
        range: None,
    },
    Setting {
        name: "PLAIT_MEASURE",
        kind: "choice",
        default: "auto",
        doc: "Measure every directed link's bandwidth at start-up (a train of frames per link, n - 1 rounds of 30 ms to 1 s), for the cost model and the ring order: auto (when every rank has a host of its own, 2 to 32 ranks), 1 (always) or 0 (never); the same decision on every rank.",
        range: None,
    },
    Setting {
        name: "PLAIT_RING_ORDER",
        kind: "text",
        default: "measured",
        doc: "The order ring algorithms pass data in (and chain broadcast and reduce follow from their root): measured (the order whose slowest link is fastest, from the measured links; rank order when they were not measured), rank, or a list of every rank (`0,2,1,3`), the same on every rank.",
        range: None,
    },
    Setting {
        name: "PLAIT_WIRE_DTYPE",
        kind: "choice",
        default: "native",
        doc: "Wire compression of f32 allreduce: native, bf16, f16 or int8.",
        range: None,
    },
    Setting {
        name: "PLAIT_SEGMENT_BYTES",
        kind: "bytes",
        default: "1048576",
        doc: "Pipeline segment size of collectives (at least 1024).",
        range: Some(SEGMENT_BYTES),
    },
    Setting {
        name: "PLAIT_STREAMS",
        kind: "count",
        default: "1",
        doc: "TCP connections per pair of ranks (1 to 16), for links one stream cannot fill.",
        range: Some(STREAMS),
    },
    Setting {
        name: "PLAIT_SHM_BYTES",
        kind: "bytes",
        default: "4194304",
        doc: "Shared memory per direction of each link between ranks of one host: payloads over 64 KiB and up to this size go through it instead of loopback TCP (Linux /dev/shm, macOS shm_open; elsewhere, with PLAIT_ENCRYPT=1, or up to 65536: TCP only).",
        range: Some(SHM_BYTES),
    },
    Setting {
        name: "PLAIT_COST_MODEL",
        kind: "text",
        default: "",
        doc: "The cost model's constants, as `plait topology --fit` prints them: alpha=SECONDS (per message),bandwidth=BYTES_PER_SECOND (per link, where links were not measured),gamma=SECONDS_PER_BYTE (reducing),parallelism=LINKS (how many of a rank's links run at full rate at once where they share a host or NIC, 1 to 64); any of them, the others keep their defaults. Set the same on every rank (a mismatch is refused at start-up): the selectors' choices must agree.",
        range: None,
    },
    Setting {
        name: "PLAIT_STREAMS_MAX",
        kind: "count",
        default: "8",
        doc: "The most TCP connections per pair of ranks start-up opens on its own (1 to 16), on links the start-up measurement (PLAIT_MEASURE) finds one stream's socket buffers cannot fill (a long fat pipe: rate x round trip past the buffers); 1 never adds any. A link gets the smaller of both ends' settings, and never fewer than PLAIT_STREAMS.",
        range: Some(STREAMS),
    },
    Setting {
        name: "PLAIT_RELAY",
        kind: "choice",
        default: "1",
        doc: "1: two ranks that cannot connect to each other (a firewall or NAT refuses, no route, no cable between them, or \"relay\" in PLAIT_ROUTES) send their frames through a rank that reaches both, chosen from the measured links; start-up dials its peers at once and gives each route 10 s (a quarter of PLAIT_TIMEOUT, if less) before it relays; a peer that answers and refuses (token, group, version) is not relayed. 0: start-up fails, naming the pair. Set the same on every rank.",
        range: None,
    },
    Setting {
        name: "PLAIT_CALLER_READ_BYTES",
        kind: "bytes",
        default: "65536",
        doc: "Calls up to this size read their links on the thread that runs them: blocking calls on the calling thread, and an asynchronous collective on its worker when no other asynchronous call is in flight on the links (0: off).",
        range: Some(BYTES_UP_TO),
    },
    Setting {
        name: "PLAIT_BUSY_POLL_US",
        kind: "microseconds",
        default: "1000",
        doc: "A call that reads its links (PLAIT_CALLER_READ_BYTES) polls them this long, yielding its core between polls, before it sleeps until a frame arrives; a wait for a small asynchronous call looks for its end this long before it sleeps (0: sleep at once).",
        range: Some(BUSY_POLL_US),
    },
    Setting {
        name: "PLAIT_UNEXPECTED_BYTES",
        kind: "bytes",
        default: "1073741824",
        doc: "Memory per peer for messages that arrive before their receive is posted (at least 1048576); past it, that peer's message waits unread in the socket (TCP holds the sender back) until its receive is posted or room frees, and fails only after the timeout.",
        range: Some(UNEXPECTED_BYTES),
    },
    Setting {
        name: "PLAIT_TOKEN",
        kind: "text",
        default: "",
        doc: "A secret shared by every rank: links are refused to anyone without it, even a process that can write the store (set the same on every rank, or none).",
        range: None,
    },
    Setting {
        name: "PLAIT_TOKEN_FILE",
        kind: "text",
        default: "",
        doc: "Path of a file holding PLAIT_TOKEN (surrounding whitespace ignored), to keep the secret out of the environment.",
        range: None,
    },
    Setting {
        name: "PLAIT_ENCRYPT",
        kind: "choice",
        default: "0",
        doc: "1 encrypts and authenticates every frame (ChaCha20-Poly1305 with each link's handshake keys); must be the same on every rank.",
        range: None,
    },
    Setting {
        name: "PLAIT_DEBUG",
        kind: "choice",
        default: "error",
        doc: "Log level of the core, to stderr: error, warn, info, debug or trace.",
        range: None,
    },
    // Read by the torch backend (python/plait/torch/options.py), through `setting`.
    Setting {
        name: "PLAIT_TORCH_INLINE",
        kind: "choice",
        default: "auto",
        doc: "torch: blocking calls run on the caller's thread: auto (small ones, when nothing else is in flight), always or never.",
        range: None,
    },
    Setting {
        name: "PLAIT_TORCH_INLINE_BYTES",
        kind: "bytes",
        default: "1048576",
        doc: "torch: the largest blocking call that runs on the caller's thread under `auto`.",
        range: Some(BYTES_UP_TO),
    },
    Setting {
        name: "PLAIT_TORCH_STAGING",
        kind: "choice",
        default: "0",
        doc: "torch: 1 copies CPU tensors through host staging buffers as device tensors are (tests that path).",
        range: None,
    },
    Setting {
        name: "PLAIT_TORCH_STAGING_CACHE",
        kind: "bytes",
        default: "268435456",
        doc: "torch: host staging memory kept for reuse per group.",
        range: Some(STAGING_CACHE),
    },
    Setting {
        name: "PLAIT_TORCH_SUBGROUP_LINKS",
        kind: "choice",
        default: "shared",
        doc: "torch: shared: a group over ranks of an existing plait group (new_group, DeviceMesh) uses its connections (nearly free to create); own: it opens and probes its own.",
        range: None,
    },
    Setting {
        name: "PLAIT_TRACE_ENTRIES",
        kind: "count",
        default: "2000",
        doc: "torch: operations each group keeps in its trace (plait trace; dumped on a failure); 0 turns the trace off.",
        range: Some(TRACE_ENTRIES),
    },
    Setting {
        name: "PLAIT_TRACE_DIR",
        kind: "text",
        default: "<temp dir>/plait-trace",
        doc: "torch: where every rank writes its trace (plait_trace_rank_<R>.json, and plait_fr_rank_<R> for torch's fr_trace) on a timeout or failure.",
        range: None,
    },
];

#[derive(Clone, Debug)]
pub struct CommConfig {
    pub rank: usize,
    pub size: usize,
    /// Names the group in store keys and handshakes; links of other groups are refused.
    pub group: String,
    pub epoch: u64,
    /// Default deadline of every operation (and of set-up).
    pub timeout: Duration,
    /// How long an accepted connection may take to send its hello (`PLAIT_HELLO_TIMEOUT`).
    pub hello_timeout: Duration,
    /// Elastic mode: a member silent this long is suspected (`PLAIT_HEARTBEAT_TIMEOUT`).
    pub heartbeat_timeout: Duration,
    /// `PLAIT_ALGO` syntax: `allreduce:ring,allgather:direct`.
    pub algo: Option<String>,
    /// `PLAIT_SCHEDULES`: users' schedules, read and verified.
    pub schedules: Vec<std::sync::Arc<crate::sched::custom::CustomSchedule>>,
    pub segment_bytes: usize,
    /// Blocking calls up to this many bytes read their links on the calling thread
    /// (`PLAIT_CALLER_READ_BYTES`; 0 turns it off).
    pub caller_read_bytes: usize,
    /// A small blocking call polls its links this long, yielding its core between polls,
    /// before it sleeps (`PLAIT_BUSY_POLL_US`, default [`DEFAULT_BUSY_POLL`]; zero: sleep at once).
    pub busy_poll: Duration,
    /// TCP connections per pair of ranks (`PLAIT_STREAMS`, 1 to 16): large payloads are spread
    /// over them, for links that one stream cannot fill.
    pub streams: usize,
    /// The most connections start-up may open to a link that one stream cannot fill
    /// (`PLAIT_STREAMS_MAX`, 1 to 16; see `measure::lanes_wanted`).
    pub streams_max: usize,
    /// `PLAIT_SHM_BYTES`: the shared-memory ring per direction of a same-host link (0: none).
    pub shm_bytes: usize,
    /// `PLAIT_IFACE` syntax (NCCL_SOCKET_IFNAME-like).
    pub iface: Option<String>,
    /// `PLAIT_ROUTES`: path of an N x N route matrix that overrides subnet matching.
    pub routes_file: Option<String>,
    /// `PLAIT_WIRE_DTYPE`: wire compression for f32 allreduce (bf16, f16, int8).
    pub wire: Wire,
    /// `PLAIT_UNEXPECTED_BYTES`: bytes of early messages held per peer.
    pub unexpected_bytes: u64,
    /// `PLAIT_MEASURE`: whether start-up measures each link's bandwidth.
    pub measure: Measure,
    /// `PLAIT_COST_MODEL`: the cost model's constants, where set.
    pub cost: crate::sched::cost::Constants,
    /// `PLAIT_RING_ORDER`: the order ring algorithms pass data in.
    pub ring_order: RingOrder,
    /// Which threads may call collectives (not a setting: the layer above decides).
    pub threads: ThreadUse,
    /// `PLAIT_TOKEN` or `PLAIT_TOKEN_FILE`: a secret every rank's links must prove.
    pub token: Option<Token>,
    /// `PLAIT_ENCRYPT=1`: every frame is encrypted and authenticated.
    pub encrypt: bool,
    /// `PLAIT_RELAY`: ranks that cannot connect to each other go through a rank that reaches both.
    pub relay: bool,
    /// Start-up's own deadline, when it is not `timeout` (elastic mode: a view's mesh is either
    /// built at once or not at all). Not a setting.
    pub startup_timeout: Option<Duration>,
    /// Start-up gives up as soon as this says so (elastic mode: the group moved on while this
    /// view's mesh was being built). Not a setting.
    pub give_up: Option<GiveUp>,
}

/// `PLAIT_MEASURE`: when start-up measures each link's bandwidth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Measure {
    /// When every rank is on a host of its own, from 2 to `comm::measure::AUTO_MAX_RANKS` ranks
    /// (see `comm::measure::wanted`).
    Auto,
    Always,
    Never,
}

impl Measure {
    pub fn from_name(v: &str) -> Result<Measure> {
        match v.trim() {
            "auto" | "" => Ok(Measure::Auto),
            "1" => Ok(Measure::Always),
            "0" => Ok(Measure::Never),
            _ => Err(PlaitError::Config(format!("PLAIT_MEASURE={v:?} must be auto, 1 or 0"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Measure::Auto => "auto",
            Measure::Always => "1",
            Measure::Never => "0",
        }
    }
}

/// `PLAIT_RING_ORDER`: the order ring algorithms pass data in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RingOrder {
    /// From the measured links (`sched::order::best_ring`); rank order without measurements.
    Measured,
    Rank,
    /// Every rank, in the order given.
    Given(Vec<usize>),
}

impl RingOrder {
    /// The setting's syntax only: whether a list is an order of the world's ranks is checked
    /// by [`CommConfig::validate`], once the world size is known.
    pub fn from_text(v: &str) -> Result<RingOrder> {
        match v.trim() {
            "measured" | "" => Ok(RingOrder::Measured),
            "rank" => Ok(RingOrder::Rank),
            text => text
                .split(',')
                .map(|r| r.trim().parse::<usize>().map_err(|_| format!("'{}' is not a rank", r.trim())))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(RingOrder::Given)
                .map_err(|e| PlaitError::Config(format!("PLAIT_RING_ORDER={text:?}: {e} (measured, rank, or a list of every rank)"))),
        }
    }
}

/// A question start-up asks while it waits: "should I stop?".
#[derive(Clone)]
pub struct GiveUp(pub std::sync::Arc<dyn Fn() -> bool + Send + Sync>);

impl std::fmt::Debug for GiveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GiveUp(..)")
    }
}

impl PartialEq for GiveUp {
    fn eq(&self, other: &GiveUp) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A shared secret, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Vec<u8>);

impl Token {
    pub fn new(secret: impl Into<Vec<u8>>) -> Token {
        Token(secret.into())
    }

    pub fn secret(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<secret>)")
    }
}

/// `PLAIT_TOKEN` or the contents of `PLAIT_TOKEN_FILE`; setting both is an error, as is an
/// empty or unreadable file.
fn token() -> Result<Option<Token>> {
    // Set but blank (`PLAIT_TOKEN=$UNSET`) must not quietly mean "no token".
    if std::env::var_os("PLAIT_TOKEN").is_some() && setting("PLAIT_TOKEN").is_none() {
        return Err(PlaitError::Config("PLAIT_TOKEN is set but blank: give it the shared secret, or unset it".into()));
    }
    match (setting("PLAIT_TOKEN"), setting("PLAIT_TOKEN_FILE")) {
        (Some(_), Some(_)) => Err(PlaitError::Config("set PLAIT_TOKEN or PLAIT_TOKEN_FILE, not both".into())),
        // Trimmed as the file's contents are, so the two ways of giving it agree.
        (Some(t), None) => Ok(Some(Token::new(t.trim()))),
        (None, Some(path)) => {
            let text = std::fs::read(&path).map_err(|e| PlaitError::Config(format!("PLAIT_TOKEN_FILE={path:?} cannot be read: {e}")))?;
            let secret = text.trim_ascii();
            if secret.is_empty() {
                return Err(PlaitError::Config(format!("PLAIT_TOKEN_FILE={path:?} is empty")));
            }
            Ok(Some(Token::new(secret)))
        }
        (None, None) => Ok(None),
    }
}

/// The value of setting `name` when it is set and not blank. Only names in [`SETTINGS`].
pub fn setting(name: &str) -> Option<String> {
    debug_assert!(SETTINGS.iter().any(|s| s.name == name), "{name} is not in SETTINGS");
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The value of numeric setting `name` (see [`Setting::range`]): None when unset, a
/// `ConfigError` saying the range when it does not parse or is out of it.
pub fn setting_number(name: &str) -> Result<Option<f64>> {
    setting(name).map(|v| check_setting(name, &v)).transpose()
}

/// `text` as a value of numeric setting `name`, or a `ConfigError` naming the setting and its
/// range: "PLAIT_TIMEOUT=1e19: must be a number of seconds between 0.001 and 31536000".
pub fn check_setting(name: &str, text: &str) -> Result<f64> {
    let range = SETTINGS
        .iter()
        .find(|s| s.name == name)
        .and_then(|s| s.range)
        .ok_or_else(|| PlaitError::invalid(format!("{name} is not a numeric plait setting")))?;
    let text = text.trim();
    text.parse::<f64>()
        .ok()
        .filter(|v| range.contains(*v))
        .ok_or_else(|| PlaitError::Config(range.refusal(name, text)))
}

/// `value` of argument `name` (one of [`ARGUMENTS`]), or an `InvalidArgument` error naming it,
/// the call (`what`, when not empty) and the range.
pub fn check_argument(what: &str, name: &str, value: f64) -> Result<f64> {
    match argument_range(name)?.contains(value) {
        true => Ok(value),
        false => Err(refuse_argument(what, name, &show(value))),
    }
}

/// The error for argument `name` of `what` given as `shown` (not a number, or out of range).
pub fn refuse_argument(what: &str, name: &str, shown: &str) -> PlaitError {
    let prefix = if what.is_empty() { String::new() } else { format!("{what}: ") };
    match argument_range(name) {
        Ok(range) => PlaitError::invalid(format!("{prefix}{}", range.refusal(name, shown))),
        Err(e) => e,
    }
}

/// The range of argument `name` (one of [`ARGUMENTS`]).
pub fn argument_range(name: &str) -> Result<Range> {
    ARGUMENTS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, r)| *r)
        .ok_or_else(|| PlaitError::invalid(format!("{name} is not an argument plait checks")))
}

/// A timeout given to the Rust API, checked as Python's are.
pub fn check_timeout(what: &str, t: Duration) -> Result<Duration> {
    check_argument(what, "timeout", t.as_secs_f64()).map(|_| t)
}

fn whole(name: &str) -> Result<Option<u64>> {
    // In range means whole and at most 2^53: exact as f64 and as u64.
    Ok(setting_number(name)?.map(|v| v as u64))
}

impl CommConfig {
    /// Checks what a caller may have set by hand (`from_env` checks the environment): each
    /// number within its range, the rank within the world. Errors name the field and the range.
    pub fn validate(&self) -> Result<()> {
        check_argument("", "world_size", self.size as f64)?;
        if self.rank >= self.size {
            return Err(PlaitError::invalid(format!("rank={}: must be between 0 and world_size - 1 ({})", self.rank, self.size - 1)));
        }
        check_argument("", "epoch", self.epoch as f64)?;
        if let RingOrder::Given(order) = &self.ring_order {
            let text: Vec<String> = order.iter().map(|r| r.to_string()).collect();
            crate::sched::order::parse_order(&text.join(","), self.size)
                .map_err(|e| PlaitError::Config(format!("PLAIT_RING_ORDER: {e} (or measured, or rank)")))?;
        }
        check_timeout("", self.timeout)?;
        let fields = [
            ("segment_bytes", SEGMENT_BYTES, self.segment_bytes as f64),
            ("streams", STREAMS, self.streams as f64),
            ("streams_max", STREAMS, self.streams_max as f64),
            ("shm_bytes", SHM_BYTES, self.shm_bytes as f64),
            ("caller_read_bytes", BYTES_UP_TO, self.caller_read_bytes as f64),
            ("busy_poll (microseconds)", BUSY_POLL_US, self.busy_poll.as_micros() as f64),
            ("unexpected_bytes", UNEXPECTED_BYTES, self.unexpected_bytes as f64),
            ("hello_timeout (seconds)", HELLO_TIMEOUT, self.hello_timeout.as_secs_f64()),
            ("heartbeat_timeout (seconds)", HEARTBEAT_TIMEOUT, self.heartbeat_timeout.as_secs_f64()),
        ];
        for (name, range, v) in fields {
            if !range.contains(v) {
                return Err(PlaitError::Config(range.refusal(name, &show(v))));
            }
        }
        Ok(())
    }

    /// Defaults, with every setting of [`SETTINGS`] that is set in the environment.
    pub fn from_env(rank: usize, size: usize) -> Result<CommConfig> {
        // In range, so none of these conversions can overflow or panic.
        let timeout = setting_number("PLAIT_TIMEOUT")?.map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64);
        let segment_bytes = whole("PLAIT_SEGMENT_BYTES")?.map_or(DEFAULT_SEGMENT_BYTES, |v| v as usize);
        let caller_read_bytes = whole("PLAIT_CALLER_READ_BYTES")?.map_or(DEFAULT_CALLER_READ_BYTES, |v| v as usize);
        let busy_poll = whole("PLAIT_BUSY_POLL_US")?.map_or(DEFAULT_BUSY_POLL, Duration::from_micros);
        let streams = whole("PLAIT_STREAMS")?.map_or(DEFAULT_STREAMS, |v| v as usize);
        let streams_max = whole("PLAIT_STREAMS_MAX")?.map_or(DEFAULT_STREAMS_MAX, |v| v as usize);
        let shm_bytes = whole("PLAIT_SHM_BYTES")?.map_or(DEFAULT_SHM_BYTES, |v| v as usize);
        let hello_timeout = setting_number("PLAIT_HELLO_TIMEOUT")?.map_or(DEFAULT_HELLO_TIMEOUT, Duration::from_secs_f64);
        let heartbeat_timeout = setting_number("PLAIT_HEARTBEAT_TIMEOUT")?.map_or(DEFAULT_HEARTBEAT_TIMEOUT, Duration::from_secs_f64);
        let unexpected_bytes = whole("PLAIT_UNEXPECTED_BYTES")?.unwrap_or(DEFAULT_UNEXPECTED_BYTES);
        let wire = match setting("PLAIT_WIRE_DTYPE") {
            Some(v) => Wire::from_name(&v)
                .ok_or_else(|| PlaitError::Config(format!("PLAIT_WIRE_DTYPE={v:?}: one of native, bf16, f16, int8")))?,
            None => Wire::Native,
        };
        let measure = setting("PLAIT_MEASURE").map_or(Ok(Measure::Auto), |v| Measure::from_name(&v))?;
        let cost = setting("PLAIT_COST_MODEL")
            .map_or(Ok(Default::default()), |v| crate::sched::cost::Constants::parse(&v))
            .map_err(|e| PlaitError::Config(format!("PLAIT_COST_MODEL: {e}")))?;
        let ring_order = setting("PLAIT_RING_ORDER").map_or(Ok(RingOrder::Measured), |v| RingOrder::from_text(&v))?;
        let encrypt = match setting("PLAIT_ENCRYPT").as_deref().map(str::trim) {
            None | Some("0") => false,
            Some("1") => true,
            Some(v) => return Err(PlaitError::Config(format!("PLAIT_ENCRYPT={v:?} must be 0 or 1"))),
        };
        let relay = match setting("PLAIT_RELAY").as_deref().map(str::trim) {
            None | Some("1") => true,
            Some("0") => false,
            Some(v) => return Err(PlaitError::Config(format!("PLAIT_RELAY={v:?} must be 0 or 1"))),
        };
        Ok(CommConfig {
            token: token()?,
            encrypt,
            relay,
            rank,
            size,
            group: "default".into(),
            epoch: 0,
            timeout,
            hello_timeout,
            heartbeat_timeout,
            startup_timeout: None,
            give_up: None,
            algo: setting("PLAIT_ALGO"),
            schedules: match setting("PLAIT_SCHEDULES") {
                Some(spec) => crate::sched::custom::load(&spec)?,
                None => Vec::new(),
            },
            segment_bytes,
            caller_read_bytes,
            busy_poll,
            streams,
            streams_max,
            shm_bytes,
            iface: setting("PLAIT_IFACE"),
            routes_file: setting("PLAIT_ROUTES"),
            wire,
            unexpected_bytes,
            measure,
            cost,
            ring_order,
            threads: ThreadUse::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_is_documented_once_and_its_default_parses() {
        let mut names: Vec<&str> = SETTINGS.iter().map(|s| s.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), SETTINGS.len(), "a setting is listed twice");
        for s in SETTINGS {
            assert!(s.name.starts_with("PLAIT_") && !s.doc.is_empty(), "{s:?}");
        }
        let default_of = |n: &str| SETTINGS.iter().find(|s| s.name == n).unwrap().default;
        assert_eq!(default_of("PLAIT_TIMEOUT").parse::<u64>().unwrap(), DEFAULT_TIMEOUT.as_secs());
        assert_eq!(default_of("PLAIT_HELLO_TIMEOUT").parse::<u64>().unwrap(), DEFAULT_HELLO_TIMEOUT.as_secs());
        assert_eq!(default_of("PLAIT_HEARTBEAT_TIMEOUT").parse::<u64>().unwrap(), DEFAULT_HEARTBEAT_TIMEOUT.as_secs());
        assert_eq!(default_of("PLAIT_SEGMENT_BYTES").parse::<usize>().unwrap(), DEFAULT_SEGMENT_BYTES);
        assert_eq!(default_of("PLAIT_CALLER_READ_BYTES").parse::<usize>().unwrap(), DEFAULT_CALLER_READ_BYTES);
        assert_eq!(default_of("PLAIT_BUSY_POLL_US").parse::<u128>().unwrap(), DEFAULT_BUSY_POLL.as_micros());
        assert_eq!(default_of("PLAIT_STREAMS").parse::<usize>().unwrap(), DEFAULT_STREAMS);
        assert_eq!(default_of("PLAIT_STREAMS_MAX").parse::<usize>().unwrap(), DEFAULT_STREAMS_MAX);
        assert_eq!(default_of("PLAIT_UNEXPECTED_BYTES").parse::<u64>().unwrap(), DEFAULT_UNEXPECTED_BYTES);
        assert_eq!(Wire::from_name(default_of("PLAIT_WIRE_DTYPE")), Some(Wire::Native));
    }

    #[test]
    fn absurd_values_are_refused_with_their_range_and_never_panic() {
        let refused = |name: &str, text: &str| match check_setting(name, text) {
            Err(PlaitError::Config(msg)) => msg,
            other => panic!("{name}={text}: {other:?}"),
        };
        for text in ["1e19", "inf", "-inf", "nan", "NaN", "-1", "0", "0.0001", "1e400", "soon", ""] {
            let msg = refused("PLAIT_TIMEOUT", text);
            assert_eq!(msg, format!("PLAIT_TIMEOUT={text}: must be a number of seconds between 0.001 and 31536000"));
        }
        assert_eq!(check_setting("PLAIT_TIMEOUT", " 2.5 ").unwrap(), 2.5);
        for (name, texts) in [
            ("PLAIT_SEGMENT_BYTES", &["0", "1023", "1.5", "1e30", "18446744073709551616"][..]),
            ("PLAIT_STREAMS", &["0", "17", "1000", "-1"][..]),
            ("PLAIT_STREAMS_MAX", &["0", "17", "2.5"][..]),
            ("PLAIT_CALLER_READ_BYTES", &["-1", "1e20"][..]),
            ("PLAIT_BUSY_POLL_US", &["-1", "18446744073709551615"][..]),
            ("PLAIT_TRACE_ENTRIES", &["-1", "2.5"][..]),
        ] {
            for text in texts {
                assert!(refused(name, text).contains(" between "), "{name}={text}");
            }
        }
        assert!(check_setting("PLAIT_ALGO", "ring").is_err(), "a text setting has no range");

        let arg = |name: &str, v: f64| check_argument("allreduce", name, v);
        for v in [1e19, f64::INFINITY, f64::NAN, -1.0, 0.0, 1e-9] {
            let msg = arg("timeout", v).unwrap_err().to_string();
            assert!(msg.starts_with("allreduce: timeout=") && msg.ends_with("between 0.001 and 31536000"), "{msg}");
        }
        assert_eq!(arg("world_size", 4294967298.0).unwrap_err().to_string(), "allreduce: world_size=4294967298: must be a whole number of ranks between 1 and 65536");
        assert!(arg("world_size", 2.5).is_err() && arg("world_size", 65536.0).is_ok() && arg("epoch", -1.0).is_err());
        assert!(check_timeout("x", Duration::MAX).is_err() && check_timeout("x", Duration::from_secs(1)).is_ok());
    }

    #[test]
    fn a_config_set_by_hand_is_validated() {
        let ok = CommConfig::from_env(0, 2).unwrap();
        ok.validate().unwrap();
        let bad = [
            CommConfig { timeout: Duration::MAX, ..ok.clone() },
            CommConfig { size: (1 << 32) + 2, ..ok.clone() },
            CommConfig { size: 0, rank: 0, ..ok.clone() },
            CommConfig { rank: 2, ..ok.clone() },
            CommConfig { segment_bytes: 0, ..ok.clone() },
            CommConfig { streams: 1000, ..ok.clone() },
            CommConfig { streams_max: 0, ..ok.clone() },
            CommConfig { busy_poll: Duration::MAX, ..ok.clone() },
        ];
        for cfg in bad {
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains('='), "{err}");
        }
    }
}
