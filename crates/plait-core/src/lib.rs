//! plait-core: moves bytes between the ranks of a job.
//!
//! Layers, bottom to top: `platform` (OS facts and calls behind one module each), `kernels` (reduce ops per dtype), `net` (interfaces, routes, TCP links,
//! framing), `sched` (algorithms as schedules, the verifier and the cost model), `exec` (runs a
//! schedule over links), `group` (the communicator users hold). Nothing here knows torch.

pub mod codec;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod group;
pub mod kernels;
pub mod net;
pub mod platform;
pub mod sched;
pub mod store;

pub use dtype::{DType, ReduceOp};
pub use error::{PlaitError, Result};
pub use group::{CommConfig, Communicator};
pub use sched::Collective;
