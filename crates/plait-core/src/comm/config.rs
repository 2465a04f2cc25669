//! A communicator's configuration, and the one place that reads plait's settings from the
//! environment. Every setting is in [`SETTINGS`] with its name, kind, default and meaning; the
//! bindings hand that table to Python, and the README's table is checked against it.

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
}

pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
pub const DEFAULT_HELLO_TIMEOUT: Duration = crate::net::listener::HANDSHAKE_TIMEOUT;
pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;
/// Blocking calls this small read their links on the calling thread: saves a thread hand-off
/// per message, while larger transfers keep one receiver thread per link (links in parallel).
pub const DEFAULT_CALLER_READ_BYTES: usize = 64 * 1024;
/// One TCP stream per peer unless told otherwise. Measured with 64 MiB allreduces, two streams
/// were equal on loopback and on 1 Gbit/s cables (one stream fills those) and 5-10 % faster
/// between two network namespaces over an unlimited veth pair; but with 4 ranks on 2 cores the
/// 8-byte allreduce p50 rose about 10 % (0.21-0.24 ms against 0.24-0.27 ms). Links with a large
/// bandwidth-delay product or per-flow limits want more (see the README).
pub const DEFAULT_STREAMS: usize = 1;
pub const MAX_STREAMS: usize = 16;

/// Every setting the core reads, in the order the README lists them.
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: "PLAIT_TIMEOUT",
        kind: "seconds",
        default: "300",
        doc: "Deadline of start-up and of every operation; a peer silent for this long is named in the error.",
    },
    Setting {
        name: "PLAIT_HELLO_TIMEOUT",
        kind: "seconds",
        default: "5",
        doc: "How long an accepted connection may take to send its hello; a connection silent for longer is closed (a real peer sends it at once). It never holds up other connections.",
    },
    Setting {
        name: "PLAIT_IFACE",
        kind: "text",
        default: "",
        doc: "Interfaces to use, NCCL_SOCKET_IFNAME-like: name prefixes or CIDRs, comma-separated (`eth,10.1.0.0/16`); a leading `^` excludes them, a leading `=` makes names exact.",
    },
    Setting {
        name: "PLAIT_ROUTES",
        kind: "text",
        default: "",
        doc: "Path of an N x N route matrix (JSON) that overrides subnet matching.",
    },
    Setting {
        name: "PLAIT_ALGO",
        kind: "text",
        default: "",
        doc: "Force algorithms per collective: `allreduce:ring,allgather:direct`.",
    },
    Setting {
        name: "PLAIT_WIRE_DTYPE",
        kind: "choice",
        default: "native",
        doc: "Wire compression of f32 allreduce: native, bf16, f16 or int8.",
    },
    Setting {
        name: "PLAIT_SEGMENT_BYTES",
        kind: "bytes",
        default: "1048576",
        doc: "Pipeline segment size of collectives (at least 1024).",
    },
    Setting {
        name: "PLAIT_STREAMS",
        kind: "count",
        default: "1",
        doc: "TCP connections per pair of ranks (1 to 16), for links one stream cannot fill.",
    },
    Setting {
        name: "PLAIT_CALLER_READ_BYTES",
        kind: "bytes",
        default: "65536",
        doc: "Blocking calls up to this size read their links on the calling thread (0: off).",
    },
    Setting {
        name: "PLAIT_BUSY_POLL_US",
        kind: "microseconds",
        default: "0",
        doc: "A caller reading its links polls without sleeping this long before it blocks (0: off).",
    },
    Setting {
        name: "PLAIT_DEBUG",
        kind: "choice",
        default: "error",
        doc: "Log level of the core, to stderr: error, warn, info, debug or trace.",
    },
    // Read by the torch backend (python/plait/torch/options.py), through `setting`.
    Setting {
        name: "PLAIT_TORCH_INLINE",
        kind: "choice",
        default: "auto",
        doc: "torch: blocking calls run on the caller's thread: auto (small ones, when nothing else is in flight), always or never.",
    },
    Setting {
        name: "PLAIT_TORCH_INLINE_BYTES",
        kind: "bytes",
        default: "1048576",
        doc: "torch: the largest blocking call that runs on the caller's thread under `auto`.",
    },
    Setting {
        name: "PLAIT_TORCH_STAGING",
        kind: "choice",
        default: "0",
        doc: "torch: 1 copies CPU tensors through host staging buffers as device tensors are (tests that path).",
    },
    Setting {
        name: "PLAIT_TORCH_STAGING_CACHE",
        kind: "bytes",
        default: "268435456",
        doc: "torch: host staging memory kept for reuse per group.",
    },
    Setting {
        name: "PLAIT_TORCH_SUBGROUP_LINKS",
        kind: "choice",
        default: "shared",
        doc: "torch: shared: a group over ranks of an existing plait group (new_group, DeviceMesh) uses its connections (nearly free to create); own: it opens and probes its own.",
    },
    Setting {
        name: "PLAIT_TRACE_ENTRIES",
        kind: "count",
        default: "2000",
        doc: "torch: operations each group keeps in its trace (plait trace; dumped on a failure); 0 turns the trace off.",
    },
    Setting {
        name: "PLAIT_TRACE_DIR",
        kind: "text",
        default: "<temp dir>/plait-trace",
        doc: "torch: where every rank writes its trace (plait_trace_rank_<R>.json, and plait_fr_rank_<R> for torch's fr_trace) on a timeout or failure.",
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
    /// `PLAIT_ALGO` syntax: `allreduce:ring,allgather:direct`.
    pub algo: Option<String>,
    pub segment_bytes: usize,
    /// Blocking calls up to this many bytes read their links on the calling thread
    /// (`PLAIT_CALLER_READ_BYTES`; 0 turns it off).
    pub caller_read_bytes: usize,
    /// A caller reading its links polls them without sleeping this long before it blocks
    /// (`PLAIT_BUSY_POLL_US`, default 0: off).
    pub busy_poll: Duration,
    /// TCP connections per pair of ranks (`PLAIT_STREAMS`, 1 to 16): large payloads are spread
    /// over them, for links that one stream cannot fill.
    pub streams: usize,
    /// `PLAIT_IFACE` syntax (NCCL_SOCKET_IFNAME-like).
    pub iface: Option<String>,
    /// `PLAIT_ROUTES`: path of an N x N route matrix that overrides subnet matching.
    pub routes_file: Option<String>,
    /// `PLAIT_WIRE_DTYPE`: wire compression for f32 allreduce (bf16, f16, int8).
    pub wire: Wire,
}

/// The value of setting `name` when it is set and not blank. Only names in [`SETTINGS`].
pub fn setting(name: &str) -> Option<String> {
    debug_assert!(SETTINGS.iter().any(|s| s.name == name), "{name} is not in SETTINGS");
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// A numeric setting: None when unset, a `ConfigError` saying it must be `what` when it does
/// not parse or fails `ok`.
fn number<T: std::str::FromStr>(name: &str, ok: impl Fn(&T) -> bool, what: &str) -> Result<Option<T>> {
    setting(name)
        .map(|v| v.trim().parse::<T>().ok().filter(|n| ok(n)).ok_or_else(|| PlaitError::Config(format!("{name}={v:?} must be {what}"))))
        .transpose()
}

impl CommConfig {
    /// Defaults, with every setting of [`SETTINGS`] that is set in the environment.
    pub fn from_env(rank: usize, size: usize) -> Result<CommConfig> {
        let timeout = number("PLAIT_TIMEOUT", |s: &f64| *s > 0.0, "a positive number of seconds")?
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs_f64);
        let hello_timeout = number("PLAIT_HELLO_TIMEOUT", |s: &f64| *s > 0.0 && *s <= 1e6, "a positive number of seconds (at most 1e6)")?
            .map_or(DEFAULT_HELLO_TIMEOUT, Duration::from_secs_f64);
        let segment_bytes =
            number("PLAIT_SEGMENT_BYTES", |s: &usize| *s >= 1024, "an integer >= 1024")?.unwrap_or(DEFAULT_SEGMENT_BYTES);
        let caller_read_bytes = number("PLAIT_CALLER_READ_BYTES", |_: &usize| true, "a number of bytes (0 turns caller reads off)")?
            .unwrap_or(DEFAULT_CALLER_READ_BYTES);
        let busy_poll = number("PLAIT_BUSY_POLL_US", |_: &u64| true, "a number of microseconds (0 turns busy polling off)")?
            .map_or(Duration::ZERO, Duration::from_micros);
        let streams = number(
            "PLAIT_STREAMS",
            |n: &usize| (1..=MAX_STREAMS).contains(n),
            &format!("a number of connections per peer from 1 to {MAX_STREAMS}"),
        )?
        .unwrap_or(DEFAULT_STREAMS);
        let wire = match setting("PLAIT_WIRE_DTYPE") {
            Some(v) => Wire::from_name(&v)
                .ok_or_else(|| PlaitError::Config(format!("PLAIT_WIRE_DTYPE={v:?}: one of native, bf16, f16, int8")))?,
            None => Wire::Native,
        };
        Ok(CommConfig {
            rank,
            size,
            group: "default".into(),
            epoch: 0,
            timeout,
            hello_timeout,
            algo: setting("PLAIT_ALGO"),
            segment_bytes,
            caller_read_bytes,
            busy_poll,
            streams,
            iface: setting("PLAIT_IFACE"),
            routes_file: setting("PLAIT_ROUTES"),
            wire,
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
        assert_eq!(default_of("PLAIT_SEGMENT_BYTES").parse::<usize>().unwrap(), DEFAULT_SEGMENT_BYTES);
        assert_eq!(default_of("PLAIT_CALLER_READ_BYTES").parse::<usize>().unwrap(), DEFAULT_CALLER_READ_BYTES);
        assert_eq!(default_of("PLAIT_STREAMS").parse::<usize>().unwrap(), DEFAULT_STREAMS);
        assert_eq!(Wire::from_name(default_of("PLAIT_WIRE_DTYPE")), Some(Wire::Native));
    }
}
