//! Links between ranks: local interfaces, per-peer route choice, TCP connections with a
//! handshake, and message framing.

mod admission;
mod bind;
pub mod connect;
pub mod frame;
pub mod handshake;
pub mod iface;
pub mod listener;
pub mod peer;
mod reader;
pub mod route;
mod tuning;
mod wait;
