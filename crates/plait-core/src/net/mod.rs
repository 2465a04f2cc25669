//! Links between ranks: local interfaces, per-peer route choice, TCP connections with a
//! handshake, and message framing.

pub mod frame;
pub mod iface;
pub mod link;
pub mod peer;
mod reader;
pub mod route;
