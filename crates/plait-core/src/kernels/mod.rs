//! Reduce kernels (placeholder until the kernels module lands).
