//! Links between ranks: local interfaces, per-peer route choice, TCP connections with a
//! handshake, and message framing.

mod admission;
pub mod auth;
mod bind;
pub mod connect;
pub mod frame;
pub mod handshake;
pub mod iface;
pub mod listener;
pub mod peer;
mod reader;
pub mod route;
pub mod seal;
mod shm;
pub mod tuning;
mod wait;
#[cfg(test)]
mod handshake_fuzz;
