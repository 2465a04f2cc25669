//! Transfers of one step between the same two ranks travel as one frame when they are small
//! together. Both sides decide from the same sizes, so they agree.

use crate::raw::bytes;
use crate::session::{Landing, Part};

/// Transfers of one step between the same two ranks travel as one frame when they are small
/// together: one message instead of several (a oneshot allreduce of n blocks would otherwise
/// send n frames to every peer). Both sides decide from the same sizes, so they agree; the
/// frame's element count is the sum of its parts', so a disagreement is a mismatch, not garbage.
const BUNDLE_MAX: usize = 64 * 1024;

fn bundle_ok(wire_lens: impl Iterator<Item = usize> + Clone) -> bool {
    wire_lens.clone().count() > 1 && wire_lens.sum::<usize>() <= BUNDLE_MAX
}

/// The receives from one peer: (first ordinal, landing, whole-chunk elements) per frame.
pub(super) fn bundled(parts: Vec<(u32, Part, usize)>) -> Vec<(u32, Part, usize)> {
    if !bundle_ok(parts.iter().map(|(_, p, _)| p.wire_len)) {
        return parts;
    }
    let first = parts[0].0;
    let (len, wire_len, elems) = parts.iter().fold((0, 0, 0), |a, (_, p, e)| (a.0 + p.len, a.1 + p.wire_len, a.2 + e));
    let landing = Landing::Bundle(parts.into_iter().map(|(_, p, _)| p).collect());
    vec![(first, Part { landing, len, wire_len }, elems)]
}

/// The sends to one peer: (first ordinal, wire bytes, elements, a bundle's payload to keep
/// alive until the send completes) per frame.
#[allow(clippy::type_complexity)]
pub(super) fn bundled_sends(parts: Vec<(u32, (*const u8, usize), usize)>) -> Vec<(u32, (*const u8, usize), usize, Option<Vec<u8>>)> {
    if !bundle_ok(parts.iter().map(|(_, (_, len), _)| *len)) {
        return parts.into_iter().map(|(o, b, e)| (o, b, e, None)).collect();
    }
    let mut payload = Vec::with_capacity(parts.iter().map(|(_, (_, len), _)| len).sum());
    for (_, (ptr, len), _) in &parts {
        payload.extend_from_slice(unsafe { bytes(*ptr, *len) });
    }
    let elems = parts.iter().map(|(_, _, e)| e).sum();
    let data = (payload.as_ptr(), payload.len());
    vec![(parts[0].0, data, elems, Some(payload))]
}

