//! Places in an operation where a test can make this thread panic, to check that a panic in the
//! middle of an operation (or of landing a message) leaves no transfer behind and no operation
//! waiting forever. Compiled out of the library: `hit` is empty unless testing.
#[cfg(test)]
thread_local! {
    static ARMED: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// Panics here if a test armed `name` on this thread (once).
#[inline(always)]
pub(crate) fn hit(_name: &'static str) {
    #[cfg(test)]
    if ARMED.with(|a| a.get()) == Some(_name) {
        ARMED.with(|a| a.set(None));
        panic!("failpoint {_name}");
    }
}

#[cfg(test)]
pub(crate) fn arm(name: &'static str) {
    ARMED.with(|a| a.set(Some(name)));
}
