//! Operations: what a call is (`spec`), where its chunks live (`layout`), the engine that runs a
//! collective's schedule over the session's links (`collective`, with `bundle` for small
//! transfers and `wait` for events), and point-to-point transfers (`p2p`). Operations go down
//! through the session (send frames, post receives) and hear back through events.

mod bundle;
pub(crate) mod collective;
pub(crate) mod layout;
pub(crate) mod p2p;
pub(crate) mod spec;
mod transfers;
mod wait;

pub use spec::CollRequest;
