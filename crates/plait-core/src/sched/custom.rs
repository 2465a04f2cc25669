//! Users' own algorithms: the schedule file (format version 1), reading and checking one, and
//! writing any schedule (a built-in too) in that format.
//!
//! A file is one JSON object: the [`Schedule`] fields, plus `"version": 1`, and optionally
//! `"format": "plait.schedule"`, `"description"`, `"$schema"` and a `"when"` block that says
//! where the schedule applies (see [`When`]). `docs/schedule.schema.json` is its JSON Schema and
//! `docs/schedules.md` its prose. Unknown fields are errors, so a typo (`"reduce_wth"`) is not
//! silently dropped.

use super::cost::{estimate, Constants, Hosts, LinkModel};
use super::gen::{algorithms, generate};
use super::verify::verify;
use super::{Collective, Schedule};
use crate::error::PlaitError;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::sync::Arc;

/// The `format` a schedule file may name.
pub const FORMAT: &str = "plait.schedule";
/// The newest file version this plait reads (and the one it writes).
pub const VERSION: u64 = 1;

/// Where a custom schedule applies. All bounds are optional; an absent block applies everywhere
/// the schedule's collective and world size fit.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct When {
    /// The smallest call it is for, in bytes of the whole layout (every rank's block together:
    /// an allreduce's buffer, an allgather's output, a reduce_scatter's input).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_bytes: Option<u64>,
    /// The largest call it is for (inclusive), in the same bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    /// The wiring it is for: `shared` (one interface per rank: a switch, or one host),
    /// `full_mesh` (a cable per pair), `partial_mesh`, or `any` (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<String>,
}

/// The topology classes a `when` block may name (`any` matches every one).
pub const TOPOLOGIES: [&str; 4] = ["any", "shared", "full_mesh", "partial_mesh"];

impl When {
    /// Whether a call of `bytes` (the whole layout) on a mesh of class `topology` is in range.
    pub fn covers(&self, bytes: u64, topology: &str) -> bool {
        self.min_bytes.is_none_or(|lo| bytes >= lo)
            && self.max_bytes.is_none_or(|hi| bytes <= hi)
            && self.topology.as_deref().is_none_or(|t| t == "any" || t == topology)
    }

    fn check(&self) -> Result<(), String> {
        if let (Some(lo), Some(hi)) = (self.min_bytes, self.max_bytes) {
            if lo > hi {
                return Err(format!("\"when\": min_bytes {lo} is above max_bytes {hi}"));
            }
        }
        if let Some(t) = &self.topology {
            if !TOPOLOGIES.contains(&t.as_str()) {
                return Err(format!("\"when\": topology {t:?} is not one of {}", TOPOLOGIES.join(", ")));
            }
        }
        Ok(())
    }
}

/// A schedule read from a file, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct CustomSchedule {
    /// Where it came from (a path), for messages.
    pub origin: String,
    pub schedule: Schedule,
    pub when: When,
    pub description: String,
    /// The first 16 hex digits of the BLAKE3 hash of the schedule's steps: ranks whose files
    /// differ in any step disagree on it, and so refuse to run it together.
    pub digest: String,
}

/// Reads and checks one schedule file's text for use as a custom algorithm. `origin` (a path)
/// prefixes every error.
pub fn parse(text: &str, origin: &str) -> Result<CustomSchedule, PlaitError> {
    let c = read(text, origin)?;
    check_name(&c.schedule).map_err(|e| PlaitError::Config(format!("schedule {origin}: {e}")))?;
    Ok(c)
}

/// As [`parse`], but a built-in algorithm's name is allowed: a built-in written out by
/// [`builtin_file`] reads back, to be shown or estimated.
pub fn read(text: &str, origin: &str) -> Result<CustomSchedule, PlaitError> {
    let fail = |e: String| PlaitError::Config(format!("schedule {origin}: {e}"));
    let value: Value = serde_json::from_str(text).map_err(|e| fail(format!("not valid JSON: {e}")))?;
    let Value::Object(mut fields) = value else {
        return Err(fail("the file must hold one JSON object".into()));
    };
    match fields.remove("version") {
        None => return Err(fail(format!("no \"version\": add \"version\": {VERSION} (the format this plait reads)"))),
        Some(Value::Number(v)) if v.as_u64() == Some(VERSION) => {}
        Some(v) => {
            return Err(fail(format!(
                "\"version\" is {v}, but this plait reads version {VERSION} (a newer plait wrote it, or it is mistyped)"
            )))
        }
    }
    match fields.remove("format") {
        None => {}
        Some(Value::String(f)) if f == FORMAT => {}
        Some(f) => return Err(fail(format!("\"format\" is {f}, expected \"{FORMAT}\""))),
    }
    fields.remove("$schema");
    let description = match fields.remove("description") {
        None => String::new(),
        Some(Value::String(d)) => d,
        Some(_) => return Err(fail("\"description\" must be a string".into())),
    };
    let when: When = match fields.remove("when") {
        None => When::default(),
        Some(w) => serde_json::from_value(w).map_err(|e| fail(format!("\"when\": {e}")))?,
    };
    when.check().map_err(fail)?;
    if fields.contains_key("variant") {
        return Err(fail("\"variant\" is plait's own field (built-in variants); leave it out".into()));
    }
    let schedule: Schedule =
        serde_json::from_value(Value::Object(fields)).map_err(|e| fail(format!("{e}")))?;
    if !schedule.collective.rooted() && schedule.root != 0 {
        return Err(fail(format!("\"root\" is {}, but {} has no root: leave it out", schedule.root, schedule.collective)));
    }
    verify(&schedule).map_err(|e| {
        fail(format!("'{}' ({} for {} ranks) is wrong: {e}", schedule.name, schedule.collective, schedule.nranks))
    })?;
    let digest = digest(&schedule);
    Ok(CustomSchedule { origin: origin.to_string(), schedule, when, description, digest })
}

fn check_name(s: &Schedule) -> Result<(), String> {
    let ok = !s.name.is_empty()
        && s.name.len() <= 64
        && s.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
    if !ok {
        return Err(format!(
            "name {:?}: use 1 to 64 letters, digits, '_', '-' or '.' (it is how PLAIT_ALGO names it)",
            s.name
        ));
    }
    if algorithms(s.collective).contains(&s.name.as_str()) {
        return Err(format!(
            "name {:?} is a built-in {} algorithm; give yours another name",
            s.name, s.collective
        ));
    }
    Ok(())
}

/// The schedules `PLAIT_SCHEDULES` names: files, and directories (every `*.json` in them, in
/// name order), separated by the platform's path-list separator (`:`, or `;` on Windows). Each
/// is read and verified; two for the same collective, world size and root with one name are
/// refused, naming both files.
pub fn load(spec: &str) -> Result<Vec<Arc<CustomSchedule>>, PlaitError> {
    let mut files = Vec::new();
    for part in std::env::split_paths(spec).filter(|p| !p.as_os_str().is_empty()) {
        let shown = part.display().to_string();
        let meta = std::fs::metadata(&part)
            .map_err(|e| PlaitError::Config(format!("PLAIT_SCHEDULES: {shown}: {e}")))?;
        if meta.is_dir() {
            let mut found: Vec<_> = std::fs::read_dir(&part)
                .map_err(|e| PlaitError::Config(format!("PLAIT_SCHEDULES: {shown}: {e}")))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect();
            found.sort();
            files.extend(found);
        } else {
            files.push(part);
        }
    }
    let mut out: Vec<Arc<CustomSchedule>> = Vec::new();
    for f in files {
        let shown = f.display().to_string();
        let text = std::fs::read_to_string(&f)
            .map_err(|e| PlaitError::Config(format!("PLAIT_SCHEDULES: {shown}: {e}")))?;
        let c = parse(&text, &shown)?;
        if let Some(other) = out.iter().find(|o| same_slot(&o.schedule, &c.schedule)) {
            return Err(PlaitError::Config(format!(
                "PLAIT_SCHEDULES: {shown} and {} both define {} '{}' for {} ranks (root {}): rename one",
                other.origin, c.schedule.collective, c.schedule.name, c.schedule.nranks, c.schedule.root
            )));
        }
        out.push(Arc::new(c));
    }
    Ok(out)
}

fn same_slot(a: &Schedule, b: &Schedule) -> bool {
    a.name == b.name && a.collective == b.collective && a.nranks == b.nranks && a.root == b.root
}

/// One line that two ranks compare: equal exactly when their registries hold the same
/// schedules (by collective, name, world size, root, digest and `when` block: ranks whose
/// blocks differ would choose differently).
pub fn summary(list: &[Arc<CustomSchedule>]) -> String {
    let mut items: Vec<String> = list
        .iter()
        .map(|c| {
            let s = &c.schedule;
            let w = &c.when;
            let bound = |b: Option<u64>| b.map_or("-".to_string(), |b| b.to_string());
            format!(
                "{} {} n={} root={} {} when={}..{}/{}",
                s.collective,
                s.name,
                s.nranks,
                s.root,
                c.digest,
                bound(w.min_bytes),
                bound(w.max_bytes),
                w.topology.as_deref().unwrap_or("any")
            )
        })
        .collect();
    items.sort();
    items.join("; ")
}

/// A short hash of everything that decides what the schedule does.
pub fn digest(s: &Schedule) -> String {
    let canonical = serde_json::to_vec(s).expect("a schedule serialises");
    let h = blake3::hash(&canonical);
    h.to_hex()[..16].to_string()
}

/// `s` as a version-1 schedule file, with `when` and `description` if given: pretty JSON,
/// except that each step stays on one line, so a schedule of many small steps reads step by
/// step, rank by rank.
pub fn to_file(s: &Schedule, when: Option<&When>, description: &str) -> String {
    let mut head: Vec<(&str, String)> = vec![("format", json(&FORMAT)), ("version", json(&VERSION))];
    if !description.is_empty() {
        head.push(("description", json(&description)));
    }
    if let Some(w) = when.filter(|w| **w != When::default()) {
        head.push(("when", json(w)));
    }
    head.extend([
        ("name", json(&s.name)),
        ("collective", json(&s.collective)),
        ("nranks", json(&s.nranks)),
        ("root", json(&s.root)),
        ("scratch_slots", json(&s.scratch_slots)),
    ]);
    let mut out = String::from("{\n");
    for (k, v) in head {
        out.push_str(&format!("  \"{k}\": {v},\n"));
    }
    out.push_str("  \"ranks\": [\n");
    for (r, prog) in s.ranks.iter().enumerate() {
        out.push_str("    [\n");
        for (k, st) in prog.iter().enumerate() {
            out.push_str("      ");
            out.push_str(&json(st));
            out.push_str(if k + 1 < prog.len() { ",\n" } else { "\n" });
        }
        out.push_str(if r + 1 < s.ranks.len() { "    ],\n" } else { "    ]\n" });
    }
    out.push_str("  ]\n}\n");
    out
}

/// Anything serde can write, as one line of JSON (struct fields in declaration order).
fn json<T: Serialize + ?Sized>(v: &T) -> String {
    serde_json::to_string(v).expect("serialises")
}

/// A built-in algorithm's schedule (rank order, no measured links) as a version-1 file named
/// `name` (the algorithm's own name if None: such a file documents the built-in but is refused
/// as a custom one until renamed).
pub fn builtin_file(coll: Collective, algo: &str, n: usize, root: usize, name: Option<&str>) -> Result<String, PlaitError> {
    if n == 0 {
        return Err(PlaitError::InvalidArgument("a schedule needs at least 1 rank".into()));
    }
    if root >= n {
        return Err(PlaitError::InvalidArgument(format!("root {root} is out of range for {n} ranks")));
    }
    let mut s = generate(coll, algo, n, if coll.rooted() { root } else { 0 })?;
    if let Some(name) = name {
        s.name = name.to_string();
    }
    Ok(to_file(&s, None, ""))
}

/// The cost model's seconds for `s` at each call size in `sizes` (bytes of the whole layout,
/// split evenly over the ranks' blocks), on links of class `topology` (`shared` or
/// `full_mesh`), with `constants` (as `PLAIT_COST_MODEL`) over the defaults.
///
/// `hosts` > 1 puts the ranks on that many hosts as torchrun numbers them (`nranks / hosts` per
/// host, one network interface each), as a communicator models ranks that share hosts.
pub fn estimate_sizes(s: &Schedule, sizes: &[u64], topology: &str, hosts: usize, constants: &Constants, segment_bytes: usize) -> Result<Vec<f64>, PlaitError> {
    if !TOPOLOGIES.contains(&topology) {
        return Err(PlaitError::InvalidArgument(format!("topology {topology:?} is not one of {}", TOPOLOGIES.join(", "))));
    }
    let n = s.nranks.max(1);
    if hosts == 0 || n % hosts != 0 {
        return Err(PlaitError::InvalidArgument(format!("{n} ranks do not split evenly over {hosts} hosts")));
    }
    // As a communicator models its mesh: only a cable per pair has independent links.
    let shared = topology != "full_mesh";
    let of_rank: Vec<usize> = (0..n).map(|r| r / (n / hosts)).collect();
    let hosts = Hosts::new(&of_rank, |_, _| String::new()).map(Arc::new);
    let model = constants.apply(LinkModel { shared, hosts, ..LinkModel::default() });
    Ok(sizes
        .iter()
        .map(|&bytes| {
            let blocks: Vec<usize> = (0..n).map(|i| (bytes as usize / n) + usize::from(i < bytes as usize % n)).collect();
            estimate(s, &blocks, &model, segment_bytes.max(1))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_in_written_as_a_file_reads_back_as_the_same_schedule() {
        for coll in Collective::ALL {
            for &a in algorithms(coll) {
                let mut s = generate(coll, a, 4, 1).unwrap();
                s.name = format!("my_{a}");
                let text = to_file(&s, None, "");
                let c = parse(&text, "t.json").unwrap();
                assert_eq!(c.schedule, s, "{coll} {a}");
                assert_eq!(c.digest, digest(&s));
                assert_eq!(c.digest.len(), 16);
            }
        }
    }

    #[test]
    fn errors_say_what_to_change() {
        let mut s = generate(Collective::AllGather, "ring", 3, 0).unwrap();
        s.name = "mine".into();
        let good = to_file(&s, Some(&When { min_bytes: Some(4096), max_bytes: Some(1 << 20), topology: Some("shared".into()) }), "d");
        let c = parse(&good, "g.json").unwrap();
        assert!(c.when.covers(4096, "shared") && c.when.covers(1 << 20, "shared"));
        assert!(!c.when.covers(4095, "shared") && !c.when.covers((1 << 20) + 1, "shared") && !c.when.covers(8192, "full_mesh"));
        assert_eq!(c.description, "d");
        let err = |text: &str| parse(text, "f.json").unwrap_err().to_string();
        let e = err(&good.replace("\"version\": 1", "\"version\": 2"));
        assert!(e.contains("schedule f.json") && e.contains("reads version 1"), "{e}");
        let e = err(&good.replace("\"version\": 1,", ""));
        assert!(e.contains("add \"version\": 1"), "{e}");
        let e = err(&good.replace("\"peer\"", "\"per\""));
        assert!(e.contains("unknown field `per`"), "{e}");
        let e = err(&good.replace("\"topology\":\"shared\"", "\"topology\":\"ring\""));
        assert!(e.contains("\"ring\" is not one of any, shared"), "{e}");
        let e = err(&good.replace("\"min_bytes\":4096", "\"min_bytes\":4194304"));
        assert!(e.contains("above max_bytes"), "{e}");
        let e = err(&good.replace("\"mine\"", "\"ring\""));
        assert!(e.contains("is a built-in allgather algorithm"), "{e}");
        let e = err(&good.replace("\"mine\"", "\"my ring\""));
        assert!(e.contains("letters, digits"), "{e}");
        let e = err("[1]");
        assert!(e.contains("one JSON object"), "{e}");
        let mut broken = s.clone();
        broken.ranks[1][0].sends.clear();
        let e = err(&to_file(&broken, None, ""));
        assert!(e.contains("'mine' (allgather for 3 ranks) is wrong") && e.contains("no matching send"), "{e}");
    }

    #[test]
    fn ranks_compare_the_when_block_too_and_unrooted_files_have_no_root() {
        let mut s = generate(Collective::AllGather, "ring", 3, 0).unwrap();
        s.name = "mine".into();
        let a = Arc::new(parse(&to_file(&s, None, ""), "a").unwrap());
        let w = When { max_bytes: Some(4096), ..When::default() };
        let b = Arc::new(parse(&to_file(&s, Some(&w), ""), "b").unwrap());
        assert_eq!(a.digest, b.digest);
        assert_ne!(summary(&[a]), summary(&[b]), "ranks whose when blocks differ choose differently");
        let e = parse(&to_file(&s, None, "").replace("\"root\": 0", "\"root\": 2"), "r").unwrap_err().to_string();
        assert!(e.contains("allgather has no root"), "{e}");
    }

    #[test]
    fn the_digest_changes_with_any_step() {
        let mut s = generate(Collective::AllReduce, "ring", 4, 0).unwrap();
        s.name = "r".into();
        let mut t = s.clone();
        t.ranks[0].swap(0, 1);
        assert_ne!(digest(&s), digest(&t));
    }
}
