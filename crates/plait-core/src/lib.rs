//! plait-core: moves bytes between the ranks of a job. Nothing here knows torch.
//!
//! Layers, bottom to top (see ARCHITECTURE.md at the repository root):
//! - `platform`: OS facts and calls behind one module each; `kernels` and `codec`: reduce ops
//!   per dtype and wire compression;
//! - `net`: interfaces, routes, TCP links with their handshake, the frame codec, the readers;
//! - `session`: the live mesh of one epoch: links, mailbox, frame routing, blame, failure;
//! - `sched`: algorithms as schedules, the verifier, the cost model, the selector;
//! - `exec`: operations (collective engine, point-to-point) run on a session;
//! - `comm`: the communicator users hold: configuration, bootstrap, the calls.
//!
//! The public API is what this file re-exports; every module is internal.

mod codec;
mod comm;
mod dtype;
mod elastic;
mod error;
mod exec;
mod failpoint;
mod kernels;
mod net;
mod platform;
mod raw;
mod sched;
mod session;
mod store;

pub use codec::{round_trip as wire_round_trip, Wire};
pub use comm::{
    argument_range, check_argument, check_setting, refuse_argument, check_timeout, setting, CommConfig, Communicator, LinkRecord, Measure, Range, RingOrder, Setting, ThreadUse, Token, Topology,
    Work, ARGUMENTS, SETTINGS,
};
pub use dtype::{DType, ReduceOp};
pub use elastic::{ElasticComm, ElasticConfig, View, Witness};
pub use error::{PlaitError, Result};
pub use exec::CollRequest;
pub use kernels::hash::{chunk_hashes, HASH_BYTES};
pub use net::frame::RESERVED_TAGS;
pub use net::iface::{list_interfaces, IfaceAddr};
pub use platform::host::host_identity;
pub use raw::RawBuf;
pub use sched::custom::{builtin_file as builtin_schedule_file, load as load_schedules, estimate_sizes as estimate_schedule, parse as parse_schedule_file, read as read_schedule_file, CustomSchedule, When as ScheduleWhen};
pub use sched::{cost::Constants as CostConstants, Schedule, gen::algorithms, order::LinkMatrix, Collective};
pub use store::{call_with_deadline, MemStore, Store};
