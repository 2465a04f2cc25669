//! Picks the algorithm for a call: per-call override > `PLAIT_ALGO` > cheapest by the cost model.
//!
//! Every rank must pick the same schedule, so the choice depends only on the call's arguments
//! and the (identically configured) model: no timing, no per-rank state, candidates scanned in
//! the fixed order of [`algorithms`] with ties going to the earlier one.

use super::cost::{estimate, LinkModel};
use super::gen::{algorithms, generate, unknown_algorithm};
use super::verify::verify;
use super::{Collective, Schedule};
use crate::error::PlaitError;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// Above this world size `oneshot` is only used when asked for: its schedule has n^3 operations.
pub const ONESHOT_MAX_AUTO_RANKS: usize = 32;

/// Decision-cache entries kept before it is cleared (call shapes are usually few and repeat).
const MAX_DECISIONS: usize = 4096;

/// Parses `PLAIT_ALGO` syntax: `allreduce:ring,allgather:direct` (whitespace and empty items
/// are ignored).
pub fn parse_algo_spec(spec: &str) -> Result<HashMap<Collective, String>, PlaitError> {
    let mut map = HashMap::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((coll, algo)) = item.split_once(':') else {
            return Err(PlaitError::Config(format!(
                "PLAIT_ALGO: '{item}' is not of the form collective:algorithm"
            )));
        };
        let (coll, algo) = (coll.trim(), algo.trim());
        let c = Collective::from_name(&coll.to_ascii_lowercase()).ok_or_else(|| {
            let names: Vec<&str> = Collective::ALL.iter().map(|c| c.name()).collect();
            PlaitError::Config(format!(
                "PLAIT_ALGO: unknown collective '{coll}' (valid: {})",
                names.join(", ")
            ))
        })?;
        if !algorithms(c).contains(&algo) {
            let PlaitError::Config(msg) = unknown_algorithm(c, algo) else { unreachable!() };
            return Err(PlaitError::Config(format!("PLAIT_ALGO: {msg}")));
        }
        map.insert(c, algo.to_string());
    }
    Ok(map)
}

type ScheduleKey = (Collective, String, usize, usize);
type DecisionKey = (Collective, usize, usize, Vec<usize>);

pub struct Selector {
    overrides: HashMap<Collective, String>,
    model: LinkModel,
    segment_bytes: usize,
    schedules: Mutex<HashMap<ScheduleKey, Arc<Schedule>>>,
    decisions: Mutex<HashMap<DecisionKey, Arc<Schedule>>>,
}

impl Selector {
    pub fn new(
        overrides: HashMap<Collective, String>,
        model: LinkModel,
        segment_bytes: usize,
    ) -> Self {
        Selector {
            overrides,
            model,
            segment_bytes,
            schedules: Mutex::new(HashMap::new()),
            decisions: Mutex::new(HashMap::new()),
        }
    }

    /// The generated and verified schedule for `algo`, built once per (coll, algo, n, root).
    pub fn schedule(
        &self,
        coll: Collective,
        algo: &str,
        n: usize,
        root: usize,
    ) -> Result<Arc<Schedule>, PlaitError> {
        let root = if coll.rooted() { root } else { 0 };
        let key = (coll, algo.to_string(), n, root);
        if let Some(s) = self.schedules.lock().get(&key) {
            return Ok(s.clone());
        }
        // Generated outside the lock: other collectives need not wait; a racing duplicate
        // generation is harmless (same result).
        let s = generate(coll, algo, n, root)?;
        verify(&s).map_err(|e| {
            PlaitError::Config(format!(
                "built-in {coll} schedule '{algo}' for {n} ranks is wrong: {e}"
            ))
        })?;
        let s = Arc::new(s);
        Ok(self.schedules.lock().entry(key).or_insert(s).clone())
    }

    pub fn choose(
        &self,
        coll: Collective,
        n: usize,
        root: usize,
        block_bytes: &[usize],
        algo_override: Option<&str>,
    ) -> Result<Arc<Schedule>, PlaitError> {
        if let Some(algo) = algo_override.or(self.overrides.get(&coll).map(String::as_str)) {
            return self.schedule(coll, algo, n, root);
        }
        let root = if coll.rooted() { root } else { 0 };
        let key = (coll, n, root, block_bytes.to_vec());
        if let Some(s) = self.decisions.lock().get(&key) {
            return Ok(s.clone());
        }
        let mut best: Option<(f64, Arc<Schedule>)> = None;
        for algo in self.auto_candidates(coll, n) {
            let s = self.schedule(coll, algo, n, root)?;
            let t = estimate(&s, block_bytes, &self.model, self.segment_bytes);
            if best.as_ref().is_none_or(|(bt, _)| t < *bt) {
                best = Some((t, s));
            }
        }
        let (_, s) = best.expect("every collective has at least one algorithm");
        let mut decisions = self.decisions.lock();
        if decisions.len() >= MAX_DECISIONS {
            decisions.clear();
        }
        decisions.insert(key, s.clone());
        Ok(s)
    }

    /// Every automatic candidate with its estimated seconds, in [`algorithms`] order.
    #[cfg(test)]
    pub fn candidates(
        &self,
        coll: Collective,
        n: usize,
        root: usize,
        block_bytes: &[usize],
    ) -> Vec<(String, f64)> {
        self.auto_candidates(coll, n)
            .filter_map(|algo| {
                let s = self.schedule(coll, algo, n, root).ok()?;
                Some((algo.to_string(), estimate(&s, block_bytes, &self.model, self.segment_bytes)))
            })
            .collect()
    }

    fn auto_candidates(&self, coll: Collective, n: usize) -> impl Iterator<Item = &'static str> {
        algorithms(coll)
            .iter()
            .copied()
            .filter(move |a| !(*a == "oneshot" && n > ONESHOT_MAX_AUTO_RANKS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_spec() {
        assert!(parse_algo_spec("").unwrap().is_empty());
        assert!(parse_algo_spec(" , ").unwrap().is_empty());
        let m = parse_algo_spec("allreduce:ring, allgather:direct").unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[&Collective::AllReduce], "ring");
        assert_eq!(m[&Collective::AllGather], "direct");
        let e = parse_algo_spec("allreduce:nope").unwrap_err().to_string();
        assert!(e.contains("'nope'") && e.contains("ring, direct, oneshot, rhd, ring2"), "{e}");
        let e = parse_algo_spec("allredux:ring").unwrap_err().to_string();
        assert!(e.contains("'allredux'") && e.contains("reduce_scatter"), "{e}");
        assert!(matches!(parse_algo_spec("allreduce"), Err(PlaitError::Config(_))));
    }

    #[test]
    fn overrides_and_cache() {
        let env = parse_algo_spec("allreduce:direct").unwrap();
        let sel = Selector::new(env, LinkModel::default(), 1 << 20);
        let blocks = [1usize; 4];
        let s = sel.choose(Collective::AllReduce, 4, 0, &blocks, None).unwrap();
        assert_eq!(s.name, "direct");
        let s = sel.choose(Collective::AllReduce, 4, 0, &blocks, Some("rhd")).unwrap();
        assert_eq!(s.name, "rhd");
        assert!(sel.choose(Collective::AllReduce, 4, 0, &blocks, Some("bogus")).is_err());
        let a = sel.choose(Collective::Broadcast, 4, 1, &blocks, Some("chain")).unwrap();
        let b = sel.choose(Collective::Broadcast, 4, 1, &blocks, Some("chain")).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.root, 1);
    }

    #[test]
    fn automatic_choice_is_cheapest_and_stable() {
        let sel = Selector::new(HashMap::new(), LinkModel::default(), 1 << 20);
        let small = [1usize; 8];
        let s = sel.choose(Collective::AllReduce, 8, 0, &small, None).unwrap();
        assert_eq!(s.name, "oneshot");
        let again = sel.choose(Collective::AllReduce, 8, 0, &small, None).unwrap();
        assert!(Arc::ptr_eq(&s, &again));
        let big = [8usize << 20; 8];
        let s = sel.choose(Collective::AllReduce, 8, 0, &big, None).unwrap();
        let c = sel.candidates(Collective::AllReduce, 8, 0, &big);
        assert_eq!(c.len(), algorithms(Collective::AllReduce).len());
        let min = c.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
        assert_eq!(c.iter().find(|x| x.0 == s.name).unwrap().1, min);
        assert_ne!(s.name, "oneshot");
        // A fresh selector (another rank) makes the same choice.
        let other = Selector::new(HashMap::new(), LinkModel::default(), 1 << 20);
        assert_eq!(other.choose(Collective::AllReduce, 8, 0, &big, None).unwrap().name, s.name);
        let many = sel.candidates(Collective::AllReduce, ONESHOT_MAX_AUTO_RANKS + 1, 0, &[4; 33]);
        assert!(many.iter().all(|x| x.0 != "oneshot"));
    }
}
