//! Elastic mode (issue 15; the protocol is in `docs/elastic.md`): members join and leave while
//! the others train, with no process that the group cannot lose.
//!
//! - `agree`: the per-epoch view agreement as a pure state machine (simulated in `agree_sim`;
//!   the per-operation outcome rule of `control` and `comm` over it, in `outcome_sim`);
//! - `link`: control links between members (authenticated with the token);
//! - `control`: one member's control plane: links, heartbeats, suspicion, the agreement driven
//!   over the links, joiners, and each epoch's bootstrap records;
//! - `comm`: the communicator users hold: one static mesh per epoch, every operation with one
//!   outcome on every member.

pub(crate) mod agree;
mod comm;
mod control;
mod link;
#[cfg(test)]
mod sim_rng;
#[cfg(test)]
mod outcome_sim;

pub use agree::View;
pub use comm::{ElasticComm, ElasticConfig, Witness};
