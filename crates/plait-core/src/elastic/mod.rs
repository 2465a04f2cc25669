//! Elastic mode (issue 15; the protocol is in `docs/elastic.md`). Built so far: the per-epoch view
//! agreement as a pure state machine (`agree`), checked by a deterministic simulation. Nothing
//! calls it yet: the session layer will carry its messages as control frames.
#![cfg_attr(not(test), allow(dead_code))]

pub(crate) mod agree;
