//! Integration tests of the pure core: architecture rules, and property tests that
//! random command streams keep every invariant and replay deterministically.

use std::collections::BTreeMap;

use gangway_core::command::{Command, JobChange, NodeStateChange, Placement};
use gangway_core::spec::{Dependency, DependencyKind, GpuSpec, TopologyConstraint};
use gangway_core::state::UseKey;
use gangway_core::*;
use proptest::prelude::*;

/// Architecture Invariant: the core depends on nothing that does I/O. The allowed
/// dependencies are listed here; adding any other one fails this test.
/// The core does no I/O: its manifest names only these dependencies, in
/// every table a build uses (`[dependencies]`, `[build-dependencies]`, any
/// `[target.*.dependencies]`, and `[dependencies.NAME]` forms). Tests
/// (`[dev-dependencies]`) may read files.
#[test]
fn core_has_no_io_dependencies() {
    let manifest = include_str!("../Cargo.toml");
    let allowed = ["serde", "bincode", "thiserror"];
    let mut section = String::new();
    let mut checked = 0;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            section = line.trim_matches(|c| c == '[' || c == ']').to_string();
            // `[dependencies.NAME]` and `[target.X.dependencies.NAME]` name a dependency.
            for table in ["dependencies.", "build-dependencies."] {
                if let Some(i) = section.find(table).filter(|_| !section.contains("dev-dependencies")) {
                    let name = &section[i + table.len()..];
                    assert!(allowed.contains(&name), "core must not depend on `{name}` (no I/O in the core)");
                }
            }
            continue;
        }
        let builds_with = section == "dependencies"
            || section == "build-dependencies"
            || (section.starts_with("target.")
                && (section.ends_with(".dependencies") || section.ends_with(".build-dependencies")));
        if builds_with && !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['=', '.', ' ']).next().unwrap().trim();
            assert!(allowed.contains(&name), "core must not depend on `{name}` (no I/O in the core)");
            checked += 1;
        }
    }
    assert_eq!(checked, allowed.len(), "the manifest's dependencies were not all read");
}

/// Every `.rs` file of the workspace (not build output), with its path from
/// the repository root.
fn workspace_sources() -> Vec<(String, String)> {
    let root = manifest_dir().join("..").canonicalize().unwrap();
    let mut out = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !name.starts_with('.') && name != "target" && name != "corpus" && name != "artifacts" {
                    dirs.push(path);
                }
            } else if name.ends_with(".rs") {
                let rel = path.strip_prefix(&root).unwrap().to_string_lossy().into_owned();
                out.push((rel, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    out
}

/// openraft's types stay in the layers that adapt it (rust-analyzer's tidy
/// tests): `raft-store` and `controller/src/raft`. Everything else speaks
/// Gangway's own types, so an openraft upgrade touches those two places.
#[test]
fn openraft_types_stay_in_the_raft_layers() {
    let sources = workspace_sources();
    assert!(sources.len() > 50, "the workspace was not found: {} files", sources.len());
    let allowed = |path: &str| path.starts_with("raft-store/") || path.starts_with("controller/src/raft/");
    // Spelt in two parts, so this file does not name what it looks for.
    let needle = ["openraft", "::"].concat();
    let strays: Vec<&str> =
        sources.iter().filter(|(p, text)| !allowed(p) && text.contains(&needle)).map(|(p, _)| p.as_str()).collect();
    assert!(strays.is_empty(), "openraft types outside raft-store/ and controller/src/raft/: {strays:?}");
    assert!(sources.iter().any(|(p, t)| allowed(p) && t.contains(&needle)), "the check found no openraft use at all");
}

/// The lints that keep panics out of the core, denied outside tests in
/// `lib.rs`: a panic in `apply` is replayed by every replica (a committed
/// entry stays in the log), and one in the scheduling pass stops each
/// leader in turn.
const PANIC_LINTS: [&str; 7] = [
    "clippy::expect_used",
    "clippy::unwrap_used",
    "clippy::indexing_slicing",
    "clippy::string_slice",
    "clippy::panic",
    "clippy::unreachable",
    "clippy::unimplemented",
];

/// The exceptions to [`PANIC_LINTS`] the core's code makes, each with the
/// reason it cannot panic. A new one must be added here, where a reviewer
/// sees it: (file, lint).
const PANIC_EXCEPTIONS: &[(&str, &str)] = &[
    ("core/src/format.rs", "clippy::expect_used"),
    ("core/src/format.rs", "clippy::indexing_slicing"),
    ("core/src/format.rs", "clippy::indexing_slicing"),
];

/// Architecture Invariant: the core cannot panic outside its tests, but for
/// the counted exceptions above, each with a reason. `lib.rs` denies the
/// lints (so clippy finds every `expect`, `unwrap`, index, slice, `panic!`
/// and `unreachable!`); this test pins that, counts every `expect`/`allow`
/// of them, and finds the assertions clippy does not (`assert!` and its
/// kin: only compile-time ones, in a `const`, are allowed).
#[test]
fn the_core_cannot_panic_but_for_counted_reasoned_exceptions() {
    let sources = workspace_sources();
    let core: Vec<&(String, String)> = sources.iter().filter(|(p, _)| p.starts_with("core/src/")).collect();
    assert!(core.len() > 20, "the core's sources were not found: {}", core.len());
    let lib = &core.iter().find(|(p, _)| p.ends_with("/lib.rs")).expect("lib.rs").1;
    let deny =
        lib.split("#![cfg_attr(").find(|a| a.trim_start().starts_with("not(test),") && a.contains("expect_used"));
    let deny = deny.and_then(|a| a.split(")]").next()).expect("lib.rs denies the panic lints outside tests");
    for lint in PANIC_LINTS {
        assert!(deny.contains(lint), "lib.rs does not deny {lint}: {deny}");
    }
    // Files that are test modules of their own (`#[cfg(test)] mod NAME;`).
    let test_files: Vec<String> = core
        .iter()
        .flat_map(|(_, text)| text.split("#[cfg(test)]\nmod ").skip(1))
        .filter_map(|rest| {
            rest.split_once(';').filter(|(name, _)| !name.contains(' ')).map(|(n, _)| format!("/{n}.rs"))
        })
        .collect();
    assert!(test_files.iter().any(|f| f == "/idempotency_tests.rs"), "test modules not found: {test_files:?}");
    let mut found: Vec<(String, String)> = Vec::new();
    for (path, text) in &core {
        if test_files.iter().any(|f| path.ends_with(f.as_str())) {
            continue;
        }
        // Unit tests sit at the end of a file, in `#[cfg(test)] mod tests {`.
        let code = text.split("\n#[cfg(test)]\nmod tests {").next().unwrap_or(text);
        assert!(code.len() * 2 > text.len(), "{path}: most of it was taken for tests");
        let mut rest = code;
        while let Some(at) = rest.find('#') {
            let attr = &rest[at..];
            let end = attr.find(")]").map_or(attr.len(), |e| e + 2);
            let attr: String = attr[..end].split_whitespace().collect();
            let lints = attr.starts_with("#[") || attr.starts_with("#![");
            if lints && (attr.contains("expect(") || attr.contains("allow(")) {
                let named = PANIC_LINTS.iter().filter(|l| attr.contains(*l)).map(|l| l.to_string());
                let group = ["clippy::restriction", "clippy::all"].iter().find(|g| attr.contains(*g));
                assert!(group.is_none(), "{path}: a lint group is allowed, hiding the panic lints: {attr}");
                for lint in named {
                    assert!(
                        attr.contains("reason=\"") && !attr.contains("reason=\"\""),
                        "{path}: an exception to {lint} gives no reason: {attr}"
                    );
                    found.push((path.clone(), lint));
                }
            }
            rest = &rest[at + 1..];
        }
        for (n, line) in code.lines().enumerate() {
            let line = line.trim_start();
            let asserts = ["assert!(", "assert_eq!(", "assert_ne!("].iter().any(|m| line.contains(m));
            let at_compile_time = line.starts_with("const _: () = assert!(");
            assert!(
                !asserts || at_compile_time || line.starts_with("//"),
                "{path}:{}: an assertion outside tests panics a replica: {line}",
                n + 1
            );
        }
    }
    found.sort();
    let mut pinned: Vec<(String, String)> =
        PANIC_EXCEPTIONS.iter().map(|(p, l)| (p.to_string(), l.to_string())).collect();
    pinned.sort();
    assert_eq!(found, pinned, "the core's exceptions to the panic lints changed: list them in PANIC_EXCEPTIONS");
}

/// Every named limit is named by a test: a test that goes
/// one past it (or, for a limit on work rather than input, one that fills it
/// and one more). Tests are the files under a `tests/` directory, test
/// modules of their own (`#[cfg(test)] mod NAME;`, found beside the file
/// that declares them) and inline ones (`#[cfg(test)] mod NAME {` to the
/// file's end); comments in them do not count, nor do the fuzz targets.
/// Limits are told apart by file: two crates' `HOSTS_MAX` are two limits,
/// each to be named by its own crate's tests (a name defined once may be
/// named by any crate's).
#[test]
fn every_named_limit_is_named_by_a_test() {
    let sources: Vec<(String, String)> =
        workspace_sources().into_iter().filter(|(p, _)| !p.starts_with("fuzz/")).collect();
    let root = manifest_dir().join("..");
    // A file's crate: the nearest directory above it with a Cargo.toml.
    let crate_of = |path: &str| {
        let mut dir = std::path::Path::new(path).parent();
        while let Some(d) = dir {
            if root.join(d).join("Cargo.toml").exists() {
                return d.to_string_lossy().into_owned();
            }
            dir = d.parent();
        }
        String::new()
    };
    // The modules under `#[cfg(test)]`: (where in the file, the line after).
    let test_mods = |text: &str| -> Vec<(usize, String)> {
        let attr = "#[cfg(test)]\n";
        let mods = text.match_indices(attr).filter_map(|(at, _)| {
            let line = text[at + attr.len()..].lines().next()?;
            let line = line.trim_start_matches("pub(crate) ").trim_start_matches("pub ");
            line.strip_prefix("mod ").map(|m| (at, m.to_string()))
        });
        mods.collect()
    };
    // `#[cfg(test)] mod NAME;` in DIR/FILE.rs: DIR/NAME.rs or DIR/FILE/NAME.rs.
    let mut test_files = std::collections::BTreeSet::new();
    for (path, text) in &sources {
        let dir = std::path::Path::new(path).parent().map(|d| d.to_string_lossy().into_owned()).unwrap_or_default();
        let stem = path.trim_end_matches(".rs");
        for (_, m) in test_mods(text) {
            if let Some(name) = m.strip_suffix(';') {
                test_files.insert(format!("{dir}/{name}.rs"));
                test_files.insert(format!("{stem}/{name}.rs"));
            }
        }
    }
    let mut tests: BTreeMap<String, String> = BTreeMap::new();
    let mut limits: Vec<(String, String, String)> = Vec::new();
    for (path, text) in &sources {
        let whole_test = path.contains("/tests/") || test_files.contains(path);
        let inline = test_mods(text).into_iter().find(|(_, m)| m.ends_with(" {")).map(|(at, _)| at);
        let (code, test) = match inline {
            _ if whole_test => ("", text.as_str()),
            Some(at) => text.split_at(at),
            None => (text.as_str(), ""),
        };
        let uncommented: String =
            test.lines().map(|l| l.split_once("//").map_or(l, |(code, _)| code)).collect::<Vec<_>>().join("\n");
        tests.entry(crate_of(path)).or_default().push_str(&uncommented);
        for line in code.lines() {
            let Some((_, rest)) = line.trim_start().split_once("const ") else { continue };
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let limit = ["_MAX", "_MIN", "_LIMIT", "_CAP"].iter().any(|s| name.ends_with(s));
            if limit && name.chars().all(|c| !c.is_ascii_lowercase()) && rest[name.len()..].starts_with(':') {
                limits.push((path.clone(), name, crate_of(path)));
            }
        }
    }
    limits.sort();
    limits.dedup();
    assert!(limits.len() > 250, "the named limits were not found: {}", limits.len());
    // One crate's test naming a limit cannot tell two of its files' limits
    // of the same name apart: they are named apart.
    let mut in_crate: Vec<(&str, &str)> = limits.iter().map(|(_, n, k)| (n.as_str(), k.as_str())).collect();
    in_crate.sort();
    let twice: Vec<_> = in_crate.windows(2).filter(|w| w[0] == w[1]).map(|w| w[0]).collect();
    assert!(twice.is_empty(), "limits of one name in two files of a crate (name them apart): {twice:?}");
    assert!(tests.len() > 6, "the crates' tests were not found: {:?}", tests.keys());
    let named = |text: &str, name: &str| {
        text.match_indices(name).any(|(at, _)| {
            let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            !word(text[..at].chars().next_back()) && !word(text[at + name.len()..].chars().next())
        })
    };
    // A name defined once in the workspace may be named by any crate's tests
    // (the API's message limits are the controller's to test); one defined
    // in several files, only by its own crate's.
    let defined = |name: &str| limits.iter().filter(|(_, n, _)| n == name).count();
    let untested: Vec<(&str, &str)> = limits
        .iter()
        .filter(|(_, name, krate)| {
            let own = tests.get(krate).is_some_and(|t| named(t, name));
            !own && (defined(name) > 1 || !tests.values().any(|t| named(t, name)))
        })
        .map(|(path, name, _)| (path.as_str(), name.as_str()))
        .collect();
    let untested: Vec<String> = untested.iter().map(|(p, n)| format!("{p}: {n}")).collect();
    assert!(
        untested.is_empty(),
        "named limits that no test of their crate names (go one past each):\n{}",
        untested.join("\n")
    );
}

/// Protobuf meets the core's types in one file (rust-analyzer's tidy tests):
/// `controller/src/api/convert.rs` builds wire messages from the model and
/// specs from wire messages, and maps their enums. Anywhere else in the
/// controller, building one of those messages or specs, mapping a wire
/// state, or a `From` between the two is a second conversion that can drift.
#[test]
fn protobuf_meets_core_types_only_in_convert_rs() {
    let sources = workspace_sources();
    let convert = "controller/src/api/convert.rs";
    // Spelt in parts, so this file does not name what it looks for.
    let needles: Vec<String> = [
        ["pb::Job", " {"],
        ["pb::JobSpec", " {"],
        ["pb::Node", " {"],
        ["pb::Allocation", " {"],
        ["pb::JobState", "::"],
        ["pb::NodeState", "::"],
        ["JobSpec", " {"],
        ["NodeSpec", " {"],
        ["impl From<", "pb::"],
        ["impl TryFrom<", "pb::"],
    ]
    .iter()
    .map(|p| p.concat())
    .collect();
    // The accounting database's rows become protobuf jobs with no core type
    // in between (they hold what a finished job's record held): its modules
    // may build protobuf, and must never touch the core.
    let accounting = "controller/src/accounting/";
    let mut strays = Vec::new();
    for (path, text) in sources.iter().filter(|(p, _)| p.starts_with("controller/src/") && p != convert) {
        if path.starts_with(accounting) {
            if text.contains(["gangway", "_core"].concat().as_str()) {
                strays.push(format!("{path}: the core, in the accounting module"));
            }
            continue;
        }
        for n in needles.iter().filter(|n| text.contains(n.as_str())) {
            strays.push(format!("{path}: `{n}`"));
        }
    }
    assert!(strays.is_empty(), "protobuf and core types converted outside {convert}: {strays:?}");
    assert!(sources.iter().any(|(p, _)| p.starts_with(accounting)), "the accounting module moved: {accounting}");
    let (_, text) = sources.iter().find(|(p, _)| p == convert).expect("convert.rs exists");
    assert!(
        needles.iter().filter(|n| text.contains(n.as_str())).count() >= 6,
        "the check no longer finds the conversions"
    );
}

/// The controller's modules do not talk through a hub: `replica.rs` wires a
/// replica together and nothing in the crate imports it, and `shared.rs`
/// (what handlers, duties and telemetry share) imports none of them.
#[test]
fn the_controller_has_no_hub_module() {
    let sources = workspace_sources();
    let wiring = ["crate::", "replica::"].concat();
    let importers: Vec<&str> = sources
        .iter()
        .filter(|(p, t)| p.starts_with("controller/src/") && t.contains(&wiring))
        .map(|(p, _)| p.as_str())
        .collect();
    assert!(importers.is_empty(), "modules importing the replica's wiring: {importers:?}");
    let (_, shared) = sources.iter().find(|(p, _)| p == "controller/src/shared.rs").expect("shared.rs exists");
    for module in ["api", "leader", "telemetry", "replica"] {
        let path = ["crate::", module, "::"].concat();
        assert!(!shared.contains(&path), "shared.rs imports `{module}`");
    }
}

/// ARCHITECTURE.md: the web console never reads or changes the state
/// itself; it calls the API's handlers, so it shows and allows exactly what
/// the API decides. The three numbers it reads (the newest job id, the
/// oldest event kept, the history events count in) are the only state it
/// touches.
#[test]
fn the_console_only_calls_the_api() {
    let sources = workspace_sources();
    let allowed =
        ["node.state().read().next_job_id", "node.state().oldest_event_index()", "node.state().read().history"];
    let banned = ["node.state()", ".read()", "propose", "forward(", "gangway_core::"];
    let mut found = Vec::new();
    let ui: Vec<_> = sources.iter().filter(|(p, _)| p.starts_with("controller/src/ui/")).collect();
    assert!(ui.len() >= 3, "the console's sources moved: {:?}", ui.iter().map(|(p, _)| p).collect::<Vec<_>>());
    for (path, text) in ui {
        let mut t = text.clone();
        for a in allowed {
            t = t.replace(a, "");
        }
        for b in banned.iter().filter(|b| t.contains(**b)) {
            found.push(format!("{path}: `{b}`"));
        }
    }
    assert!(found.is_empty(), "the console touches the state or the core itself: {found:?}");
}

fn node_spec(i: usize, gpus: usize) -> NodeSpec {
    NodeSpec {
        name: format!("n{i}"),
        addr: String::new(),
        cpus: 16,
        mem_mb: 65536,
        gpus: (0..gpus)
            .map(|g| GpuSpec {
                uuid: format!("GPU-{i}-{g}"),
                model: "h100-80gb".into(),
                mem_mb: 81920,
                nvlink_island: (g / 4) as u32,
            })
            .collect(),
        topology: vec!["zone-a".into(), format!("rack-{}", i / 2)],
        labels: BTreeMap::new(),
    }
}

fn job_spec(nodes: u32, gpus: u32, cpus: u32) -> JobSpec {
    JobSpec {
        user: "alice".into(),
        command: vec!["sleep".into(), "1".into()],
        nodes,
        cpus_per_task: cpus,
        gpus_per_node: gpus,
        ..JobSpec::default()
    }
}

/// A first-fit placement built from the current state, so that property tests
/// produce plans that are often (but not always) valid.
fn first_fit(state: &State, job_id: JobId, attempt_skew: u32) -> Option<Placement> {
    let job = state.jobs.get(&job_id)?;
    let spec = &job.spec;
    let mut nodes = Vec::new();
    for node in state.nodes.values() {
        if nodes.len() == spec.nodes as usize {
            break;
        }
        let free: Vec<u32> = node.gpus.iter().filter(|g| g.allocated_to.is_none()).map(|g| g.index).collect();
        if node.state == NodeState::Up
            && node.cpus - node.cpus_alloc >= spec.cpus_per_node()
            && free.len() >= spec.gpus_per_node as usize
        {
            nodes.push(NodeAllocation {
                node: node.name.clone(),
                cpus: spec.cpus_per_node(),
                mem_mb: spec.mem_per_node_mb,
                gpus: free[..spec.gpus_per_node as usize].to_vec(),
            });
        }
    }
    Some(Placement { job_id, attempt: job.attempt + 1 + attempt_skew, nodes })
}

#[derive(Debug, Clone)]
enum Op {
    Register(usize, usize),
    Submit(u32, u32, u32, Option<u8>),
    BadSubmit,
    Cancel(u64),
    Plan(u64, u32),
    Finish(u64, bool),
    Drain(usize),
    Resume(usize),
    Down(usize),
    Power(usize, bool),
    /// The next few ops proposed together as one batch entry.
    Batch(Vec<Op>),
    /// The node at this position of the job's allocation reports its task's end.
    TaskExit(u64, usize, bool),
    /// The leader's scheduler plans.
    Schedule,
    /// GPU `1` of node `0` turns unhealthy or healthy.
    GpuHealth(usize, u32, bool),
    /// One of a few policies (quotas, QOS with preemption, partitions).
    Policy(u8),
    /// A submission using policy features: (qos, dependency on job, array, hold, topology).
    RichSubmit(u8, Option<u64>, bool, bool, bool),
    /// Hold / release / requeue / nice / priority on a job.
    Update(u64, u8),
    Checkpoint(u64),
    /// The cluster moves to a data format (refused unless newer).
    Format(u32),
    /// Format 9: a reservation `r{first}` of `count` nodes from `n{first}`,
    /// starting `start` ms from now for `len` ms, repeating daily or not,
    /// for alice or only maintenance.
    Reserve(usize, usize, u64, u64, bool, bool),
    Unreserve(usize),
    /// Format 9: a policy with licenses.
    Licenses,
    /// Format 9's job options: 0 licenses, 1 a reservation, 2 --time-min,
    /// 3 --deadline, 4 a node list shorter than the gang, 5 expedite.
    SlurmSubmit(u8, usize),
    /// Format 10: a step of a job starts on all of its nodes, or its newest
    /// step ends (with a failure or not).
    Step(u64, bool, bool),
}

/// Preset policies for property tests: all valid, so updates apply unless a
/// quota is below current use.
fn preset_policy(i: u8) -> gangway_core::policy::ClusterPolicy {
    use gangway_core::policy::*;
    let mut p = ClusterPolicy::default();
    if i.is_multiple_of(4) {
        return p;
    }
    p.topology_levels = vec!["zone".into(), "rack".into()];
    p.accounts.insert(
        "ml".into(),
        Account {
            quota: Quota { max_running_gpus: Some(4 + u32::from(i % 3) * 4), ..Quota::default() },
            ..Account::default()
        },
    );
    p.users.insert("alice".into(), User { accounts: vec!["ml".into()], ..User::default() });
    // Low jobs are suspended when preempted under some presets (format 12).
    let preempt_mode = if i % 4 == 2 { PreemptMode::Suspend } else { PreemptMode::Requeue };
    // And an elastic pool of nodes the ops also register (format 12).
    if i % 4 == 2 {
        let pool = NodePool { nodes: vec!["n4".into(), "n5".into()], cpus: 16, gpus: 4, ..NodePool::default() };
        p.pools.insert("elastic".into(), pool);
    }
    p.qos.insert("low".into(), Qos { preempt_mode, ..Qos::default() });
    p.qos.insert("high".into(), Qos { priority: 10, preempt: vec!["low".into()], ..Qos::default() });
    if i % 4 == 3 {
        p.partitions.insert("all".into(), Partition { default: true, ..Partition::default() });
        p.partitions.insert("half".into(), Partition { nodes: vec!["n[0-2]".into()], ..Partition::default() });
    }
    p
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..6, 0usize..9).prop_map(|(i, g)| Op::Register(i, g)),
        (1u32..4, 0u32..5, 1u32..9, proptest::option::of(0u8..5)).prop_map(|(n, g, c, k)| Op::Submit(n, g, c, k)),
        Just(Op::BadSubmit),
        (0u64..30).prop_map(Op::Cancel),
        (0u64..30, 0u32..2).prop_map(|(j, s)| Op::Plan(j, s)),
        (0u64..30, any::<bool>()).prop_map(|(j, ok)| Op::Finish(j, ok)),
        (0usize..6).prop_map(Op::Drain),
        (0usize..6).prop_map(Op::Resume),
        (0usize..6).prop_map(Op::Down),
        (0usize..6, any::<bool>()).prop_map(|(i, up)| Op::Power(i, up)),
        (0u64..30, 0usize..3, any::<bool>()).prop_map(|(j, n, ok)| Op::TaskExit(j, n, ok)),
        Just(Op::Schedule),
        (0usize..6, 0u32..9, any::<bool>()).prop_map(|(n, g, h)| Op::GpuHealth(n, g, h)),
        (0u8..8).prop_map(Op::Policy),
        (0u8..3, proptest::option::of(0u64..30), any::<bool>(), any::<bool>(), any::<bool>())
            .prop_map(|(q, d, a, h, t)| Op::RichSubmit(q, d, a, h, t)),
        (0u64..30, 0u8..9).prop_map(|(j, k)| Op::Update(j, k)),
        (0u64..30).prop_map(Op::Checkpoint),
        (5u32..=gangway_core::format::FORMAT_NEWEST).prop_map(Op::Format),
        (0usize..6, 1usize..4, 0u64..400, 1u64..400, any::<bool>(), any::<bool>())
            .prop_map(|(f, c, s, l, d, u)| Op::Reserve(f, c, s, l, d, u)),
        (0usize..6).prop_map(Op::Unreserve),
        Just(Op::Licenses),
        (0u8..6, 0usize..6).prop_map(|(k, r)| Op::SlurmSubmit(k, r)),
        (0u64..30, any::<bool>(), any::<bool>()).prop_map(|(j, e, ok)| Op::Step(j, e, ok)),
    ]
}

fn op_or_batch() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => op(),
        1 => proptest::collection::vec(op(), 0..6).prop_map(Op::Batch),
    ]
}

fn to_command(state: &State, op: &Op, now_ms: u64) -> Command {
    match op {
        Op::Register(i, g) => Command::RegisterNode { spec: node_spec(*i, *g), now_ms },
        Op::Submit(n, g, c, key) => Command::SubmitJob {
            spec: job_spec(*n, *g, *c),
            identity: "dev:alice".into(),
            idempotency_key: key.map(|k| format!("key-{k}")).unwrap_or_default(),
            now_ms,
        },
        Op::BadSubmit => {
            Command::SubmitJob { spec: job_spec(0, 1, 1), identity: "x".into(), idempotency_key: String::new(), now_ms }
        }
        Op::Cancel(j) => Command::CancelJob { job_id: *j, identity: "dev:alice".into(), now_ms },
        Op::Plan(j, skew) => Command::ApplySchedule {
            preemptions: vec![],
            placements: first_fit(state, *j, *skew).into_iter().collect(),
            now_ms,
        },
        Op::Finish(j, ok) => Command::JobFinished {
            job_id: *j,
            attempt: state.jobs.get(j).map(|j| j.attempt).unwrap_or(1),
            state: if *ok { JobState::Completed } else { JobState::Failed },
            exit_code: Some(if *ok { 0 } else { 1 }),
            reason: String::new(),
            now_ms,
        },
        Op::Drain(i) => Command::SetNodeState {
            name: format!("n{i}"),
            change: NodeStateChange::Drain,
            reason: "test".into(),
            now_ms,
        },
        Op::Resume(i) => Command::SetNodeState {
            name: format!("n{i}"),
            change: NodeStateChange::Resume,
            reason: String::new(),
            now_ms,
        },
        Op::Down(i) => Command::SetNodeState {
            name: format!("n{i}"),
            change: NodeStateChange::Down,
            reason: "lost".into(),
            now_ms,
        },
        Op::Power(i, up) => Command::SetNodeState {
            name: format!("n{i}"),
            change: if *up { NodeStateChange::PowerUp } else { NodeStateChange::PowerDown },
            reason: "power".into(),
            now_ms,
        },
        Op::Batch(ops) => Command::Batch(ops.iter().map(|o| to_command(state, o, now_ms)).collect()),
        Op::TaskExit(j, n, ok) => {
            let job = state.jobs.get(j);
            let node = job
                .and_then(|job| job.allocation.as_ref())
                .and_then(|a| a.nodes.get(*n))
                .map(|na| na.node.clone())
                .unwrap_or_else(|| format!("n{n}"));
            Command::TaskExited {
                job_id: *j,
                attempt: job.map(|j| j.attempt).unwrap_or(1),
                node,
                exit_code: Some(if *ok { 0 } else { 3 }),
                signal: None,
                reason: String::new(),
                lost: *n == 2,
                peak_mem_mb: None,
                usage: ok.then_some(gangway_core::model::TaskUsage {
                    cpu_ms: now_ms % 10_000,
                    mem_peak_mb: 64,
                    gpu_samples: 2,
                    gpu_util_pct_sum: 150,
                    gpu_mem_peak_mb: 1024,
                }),
                now_ms,
            }
        }
        Op::Schedule => {
            use gangway_core::sched::{plan, Options, Policy};
            let p = plan(state, &Options::new(Policy::Easy, now_ms));
            Command::ApplySchedule { preemptions: p.preemptions, placements: p.placements, now_ms }
        }
        Op::Policy(i) => Command::UpdatePolicy {
            policy: preset_policy(*i),
            expected_version: None,
            force: false,
            identity: "server:1".into(),
            now_ms,
        },
        Op::RichSubmit(q, dep, array, hold, topo) => {
            let mut spec = job_spec(1 + u32::from(*topo), u32::from(*q) * 2, 1);
            spec.batch = *hold;
            spec.qos = ["", "low", "high"][*q as usize].to_string();
            if let Some(d) = dep {
                let kind =
                    [DependencyKind::AfterOk, DependencyKind::AfterAny, DependencyKind::AfterNotOk][(*d % 3) as usize];
                // Repeated and whole-array dependencies, as users write them.
                spec.dependencies = vec![
                    Dependency { kind, job_id: *d, array_index: None },
                    Dependency { kind, job_id: *d, array_index: None },
                    Dependency { kind: DependencyKind::AfterAny, job_id: d / 2, array_index: None },
                ];
                spec.kill_on_invalid_dep = d % 2 == 0;
            }
            if *array {
                spec.array = "0-3%2".into();
            }
            spec.hold = *hold;
            if *topo {
                spec.topology = TopologyConstraint { level: "rack".into(), required: true, wait_s: 0 };
            }
            spec.time_limit_s = 60;
            Command::SubmitJob { spec, identity: "dev:alice".into(), idempotency_key: String::new(), now_ms }
        }
        Op::Update(j, k) => {
            let change = match k {
                0 => JobChange::Hold { admin: false },
                1 => JobChange::Release,
                2 => JobChange::Requeue { hold: false },
                3 => JobChange::SetNice(10),
                4 => JobChange::SetPriority(Some(5)),
                5 => JobChange::SetTimeLimit(30),
                6 => JobChange::Suspend,
                7 => JobChange::Resume,
                _ => JobChange::Signal { signal: 10, target: gangway_core::command::SignalTarget::Steps },
            };
            // An operator's suspensions; the owner's other changes.
            let identity = if (6..=7).contains(k) { "server:ops" } else { "dev:alice" };
            Command::UpdateJob { job_id: *j, change, identity: identity.into(), now_ms }
        }
        Op::Step(j, end, ok) => {
            let job = state.jobs.get(j);
            let attempt = job.map_or(1, |j| j.attempt);
            if *end {
                let step_id = job.map_or(0, |j| j.next_step_id.saturating_sub(1));
                let exit_code = Some(if *ok { 0 } else { 1 });
                Command::StepEnded { job_id: *j, attempt, step_id, exit_code, signal: None, now_ms }
            } else {
                Command::StepStarted { job_id: *j, attempt, name: "python".into(), nodes: vec![], tasks: 1, now_ms }
            }
        }
        Op::Checkpoint(j) => {
            Command::JobCheckpointed { job_id: *j, attempt: state.jobs.get(j).map(|j| j.attempt).unwrap_or(1), now_ms }
        }
        Op::GpuHealth(n, g, healthy) => {
            Command::SetGpuHealth { node: format!("n{n}"), gpu: *g, healthy: *healthy, reason: "xid 79".into(), now_ms }
        }
        Op::Format(format) => Command::SetDataFormat { format: *format, now_ms },
        Op::Reserve(first, count, start, len, daily, users) => {
            use gangway_core::reservation::*;
            let request = ReservationRequest {
                name: format!("r{first}"),
                start_ms: now_ms + start,
                end_ms: now_ms + start + len,
                nodes: (*first..first + count).map(|i| format!("n{i}")).collect(),
                users: if *users { vec!["alice".into()] } else { Vec::new() },
                flags: ReservationFlags {
                    maint: !users,
                    ignore_jobs: *daily,
                    repeat: if *daily { Repeat::Daily } else { Repeat::Once },
                },
                ..Default::default()
            };
            Command::ChangeReservation {
                change: ReservationChange::Create(request),
                identity: "server:1".into(),
                now_ms,
            }
        }
        Op::Unreserve(i) => Command::ChangeReservation {
            change: gangway_core::reservation::ReservationChange::Delete { name: format!("r{i}") },
            identity: "server:1".into(),
            now_ms,
        },
        Op::Licenses => {
            let mut policy = preset_policy(3);
            policy.licenses = BTreeMap::from([("wandb".into(), 2)]);
            Command::UpdatePolicy { policy, expected_version: None, force: false, identity: "server:1".into(), now_ms }
        }
        Op::SlurmSubmit(kind, r) => {
            let mut spec = job_spec(1 + u32::from(*kind == 4 || *kind == 5), 1, 1);
            spec.time_limit_s = 60;
            match kind {
                0 => spec.licenses = BTreeMap::from([("wandb".into(), 1 + (*r as u32 % 2))]),
                1 => spec.reservation = format!("r{r}"),
                2 => spec.time_min_s = 1 + *r as u64 * 10,
                3 => spec.deadline_ms = now_ms + 30_000 + *r as u64 * 10_000,
                4 => spec.nodelist = vec![format!("n{r}")],
                _ => {
                    spec.requeue_expedite = true;
                    spec.requeue = true;
                }
            }
            Command::SubmitJob { spec, identity: "dev:alice".into(), idempotency_key: String::new(), now_ms }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random command streams keep every invariant; a second replica applying the
    /// same commands reaches a byte-identical snapshot; refusals change nothing.
    #[test]
    fn random_commands_keep_invariants_and_replay_identically(ops in proptest::collection::vec(op_or_batch(), 1..120)) {
        let mut a = State::default();
        let mut commands = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let cmd = to_command(&a, op, 1_000 + i as u64 * 10);
            let before = a.clone();
            let applied = a.apply(i as u64 + 1, &cmd);
            if let Outcome::Refused(_) = applied.outcome {
                // Only the replicated clock and idempotency expiry may move.
                let mut b = before.clone();
                b.clock_ms = a.clock_ms;
                b.idempotency = a.idempotency.clone();
                b.idempotency_expiry = a.idempotency_expiry.clone();
                b.rebuild_derived();
                prop_assert_eq!(&b, &a, "a refused {} changed state", cmd.name());
            }
            if let (Op::Schedule, Outcome::ScheduleApplied { rejected, preempted, started }) = (op, &applied.outcome) {
                prop_assert!(rejected.is_empty(), "the scheduler planned gangs apply refused: {rejected:?}");
                // A victim is evicted only for a placement that started.
                if let (Command::ApplySchedule { preemptions, .. }, true) =
                    (&cmd, before.format >= gangway_core::format::PLAN_APPLY_FORMAT)
                {
                    for v in preemptions.iter().filter(|v| preempted.contains(&v.job_id)) {
                        prop_assert!(started.contains(&v.for_job), "job {} evicted for job {}, which did not start", v.job_id, v.for_job);
                    }
                }
            }
            // Quotas are never exceeded (policies here are never forced).
            for (name, acct) in &a.policy.accounts {
                if let Some(max) = acct.quota.max_running_gpus {
                    let used = a.running_use.get(&UseKey::Account(name.clone())).map_or(0, |u| u.gpus);
                    prop_assert!(used <= u64::from(max), "account {name} runs {used} GPUs over its quota {max}");
                }
            }
            if let Err(e) = a.check_invariants() {
                return Err(TestCaseError::fail(format!("after {cmd:?}: {e}")));
            }
            commands.push(cmd);
        }
        let mut b = State::default();
        for (i, cmd) in commands.iter().enumerate() {
            b.apply(i as u64 + 1, cmd);
        }
        prop_assert_eq!(snapshot::encode(&a), snapshot::encode(&b));
        prop_assert_eq!(snapshot::decode(&snapshot::encode(&a)).unwrap(), a);
    }
}

#[test]
fn idempotent_submit_returns_same_job() {
    let mut s = State::default();
    let cmd = Command::SubmitJob {
        spec: job_spec(1, 0, 1),
        identity: "dev:bob".into(),
        idempotency_key: "k1".into(),
        now_ms: 5,
    };
    let first = s.apply(1, &cmd).outcome;
    let second = s.apply(2, &cmd).outcome;
    assert_eq!(first, Outcome::Submitted { job_id: 1, duplicate: false });
    assert_eq!(second, Outcome::Submitted { job_id: 1, duplicate: true });
    // Another identity with the same key is another submission.
    let other = Command::SubmitJob {
        spec: job_spec(1, 0, 1),
        identity: "dev:eve".into(),
        idempotency_key: "k1".into(),
        now_ms: 6,
    };
    assert_eq!(s.apply(3, &other).outcome, Outcome::Submitted { job_id: 2, duplicate: false });
    assert_eq!(s.jobs.len(), 2);
}

#[test]
fn gang_is_placed_whole_or_not_at_all() {
    let mut s = State::default();
    for i in 0..2 {
        s.apply(1, &Command::RegisterNode { spec: node_spec(i, 4), now_ms: 1 });
    }
    s.apply(
        3,
        &Command::SubmitJob {
            spec: job_spec(2, 4, 1),
            identity: "a".into(),
            idempotency_key: String::new(),
            now_ms: 2,
        },
    );
    // n1 drained: the plan placing on both nodes must be refused whole.
    let plan = first_fit(&s, 1, 0).unwrap();
    s.apply(
        4,
        &Command::SetNodeState { name: "n1".into(), change: NodeStateChange::Drain, reason: String::new(), now_ms: 3 },
    );
    let out =
        s.apply(5, &Command::ApplySchedule { preemptions: vec![], placements: vec![plan.clone()], now_ms: 4 }).outcome;
    assert!(
        matches!(out, Outcome::ScheduleApplied { ref started, ref rejected, .. } if started.is_empty() && rejected.len() == 1),
        "{out:?}"
    );
    assert_eq!(s.nodes["n0"].gpus_free(), 4, "no GPU of the refused gang may stay allocated");
    s.apply(
        6,
        &Command::SetNodeState { name: "n1".into(), change: NodeStateChange::Resume, reason: String::new(), now_ms: 5 },
    );
    let out = s.apply(7, &Command::ApplySchedule { preemptions: vec![], placements: vec![plan], now_ms: 6 }).outcome;
    assert_eq!(out, Outcome::ScheduleApplied { preempted: vec![], started: vec![1], rejected: vec![] });
    s.check_invariants().unwrap();
    // Node n0 goes down: the gang is requeued whole (Slurm's default) and frees n1 too.
    s.apply(
        8,
        &Command::SetNodeState { name: "n0".into(), change: NodeStateChange::Down, reason: "lost".into(), now_ms: 7 },
    );
    assert_eq!(s.jobs[&1].state, JobState::Pending);
    assert_eq!(s.jobs[&1].attempt, 1, "the next placement will be attempt 2");
    assert_eq!(s.nodes["n1"].gpus_free(), 4);
    s.check_invariants().unwrap();
    // A job that asked not to be requeued ends NODE_FAIL instead.
    let no_requeue = JobSpec { requeue: false, ..job_spec(1, 4, 1) };
    s.apply(
        9,
        &Command::SubmitJob { spec: no_requeue, identity: "a".into(), idempotency_key: String::new(), now_ms: 8 },
    );
    let plan = first_fit(&s, 2, 0).unwrap();
    assert_eq!(plan.nodes[0].node, "n1");
    s.apply(10, &Command::ApplySchedule { preemptions: vec![], placements: vec![plan], now_ms: 9 });
    s.apply(
        11,
        &Command::SetNodeState { name: "n1".into(), change: NodeStateChange::Down, reason: "lost".into(), now_ms: 10 },
    );
    assert_eq!(s.jobs[&2].state, JobState::NodeFail);
    s.check_invariants().unwrap();
}

/// A plan whose placement apply refuses evicts nobody (Nomad's plan apply):
/// the scheduler planned to cancel job 1 to start job 2, job 2 was cancelled
/// before the plan committed, and job 1 keeps running. Format 6 applied the
/// old rule (victims first) and cancelled job 1 for nothing; a replica
/// replaying such a log must still do that.
#[test]
fn a_stale_plan_evicts_nobody_for_a_placement_apply_refuses() {
    use gangway_core::policy::{ClusterPolicy, PreemptMode, Qos};
    let run = |format: u32| {
        let mut s = State::default();
        let mut index = 0;
        let mut apply = |s: &mut State, cmd: Command| {
            index += 1;
            s.apply(index, &cmd)
        };
        apply(&mut s, Command::SetDataFormat { format, now_ms: 1 });
        let mut policy = ClusterPolicy::default();
        policy.qos.insert("low".into(), Qos { preempt_mode: PreemptMode::Cancel, ..Qos::default() });
        policy.qos.insert("high".into(), Qos { priority: 10, preempt: vec!["low".into()], ..Qos::default() });
        let update = Command::UpdatePolicy {
            policy,
            expected_version: None,
            force: true,
            identity: "server:1".into(),
            now_ms: 2,
        };
        assert!(matches!(apply(&mut s, update).outcome, Outcome::PolicyUpdated { .. }));
        apply(&mut s, Command::RegisterNode { spec: node_spec(0, 8), now_ms: 3 });
        let submit = |qos: &str| {
            let mut spec = job_spec(1, 8, 1);
            spec.qos = qos.into();
            Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 4 }
        };
        apply(&mut s, submit("low"));
        let opts = gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, 5);
        let first = gangway_core::sched::plan(&s, &opts);
        apply(&mut s, Command::ApplySchedule { preemptions: vec![], placements: first.placements, now_ms: 5 });
        assert_eq!(s.jobs[&1].state, JobState::Running);
        apply(&mut s, submit("high"));
        let stale = gangway_core::sched::plan(&s, &opts);
        assert_eq!(stale.preemptions.len(), 1, "the plan evicts job 1 for job 2: {stale:?}");
        apply(&mut s, Command::CancelJob { job_id: 2, identity: "alice".into(), now_ms: 6 });
        let cmd = Command::ApplySchedule { preemptions: stale.preemptions, placements: stale.placements, now_ms: 7 };
        let applied = apply(&mut s, cmd);
        s.check_invariants().unwrap();
        (s, applied.outcome)
    };
    let (s, outcome) = run(gangway_core::format::PLAN_APPLY_FORMAT);
    let Outcome::ScheduleApplied { preempted, started, rejected } = outcome else { panic!("{outcome:?}") };
    assert!(preempted.is_empty() && started.is_empty(), "{preempted:?} {started:?}");
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert!(rejected[0].1.contains("not pending"), "{rejected:?}");
    assert_eq!(s.jobs[&1].state, JobState::Running, "job 1 was evicted for nothing");

    let (s, outcome) = run(6);
    let Outcome::ScheduleApplied { preempted, .. } = outcome else { panic!("{outcome:?}") };
    assert_eq!(preempted, vec![1], "format 6 keeps its rule: victims first");
    assert_eq!(s.jobs[&1].state, JobState::Cancelled);
}

/// A plan naming a victim twice (the same entry, or a stale attempt beside
/// the running one) evicts it once and never panics: apply is total, and a
/// hostile or buggy entry must not stop every replica. A placement that fits
/// without its victims (space freed since the plan) evicts nobody.
#[test]
fn a_victim_named_twice_is_evicted_once() {
    use gangway_core::command::Preemption;
    use gangway_core::policy::{ClusterPolicy, PreemptMode, Qos};
    for mode in [PreemptMode::Requeue, PreemptMode::Cancel] {
        for stale_first in [false, true] {
            let mut s = State::default();
            s.apply(1, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 1 });
            let mut policy = ClusterPolicy::default();
            policy.qos.insert("low".into(), Qos { preempt_mode: mode, ..Qos::default() });
            policy.qos.insert("high".into(), Qos { priority: 10, preempt: vec!["low".into()], ..Qos::default() });
            let update = Command::UpdatePolicy {
                policy,
                expected_version: None,
                force: true,
                identity: "server:1".into(),
                now_ms: 2,
            };
            s.apply(2, &update);
            s.apply(3, &Command::RegisterNode { spec: node_spec(0, 8), now_ms: 3 });
            let opts = gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, 5);
            let mut index = 3;
            for qos in ["low", "high"] {
                let mut spec = job_spec(1, 8, 1);
                spec.qos = qos.into();
                index += 1;
                s.apply(
                    index,
                    &Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 4 },
                );
                let p = gangway_core::sched::plan(&s, &opts);
                if qos == "low" {
                    index += 1;
                    s.apply(
                        index,
                        &Command::ApplySchedule { preemptions: vec![], placements: p.placements, now_ms: 5 },
                    );
                    continue;
                }
                let v = p.preemptions[0].clone();
                let stale = Preemption { attempt: v.attempt.wrapping_sub(1), ..v.clone() };
                let victims = if stale_first { vec![stale, v.clone(), v] } else { vec![v.clone(), v] };
                index += 1;
                let cmd = Command::ApplySchedule { preemptions: victims, placements: p.placements, now_ms: 6 };
                let out = s.apply(index, &cmd).outcome;
                s.check_invariants().unwrap();
                assert_eq!(
                    out,
                    Outcome::ScheduleApplied { preempted: vec![1], started: vec![2], rejected: vec![] },
                    "{mode:?} stale first {stale_first}"
                );
            }
        }
    }
}

/// A victim and its preemptor share a node: the placement is accepted only
/// as if the victim's CPUs, memory, GPUs and quota use were free, and both
/// happen in one apply; the same placement without the victim is refused.
#[test]
fn a_preemptor_is_checked_as_if_its_victims_had_stopped() {
    use gangway_core::policy::{Account, ClusterPolicy, Qos, Quota, User};
    let mut s = State::default();
    s.apply(1, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 1 });
    let mut policy = ClusterPolicy::default();
    policy.qos.insert("low".into(), Qos::default());
    policy.qos.insert("high".into(), Qos { priority: 10, preempt: vec!["low".into()], ..Qos::default() });
    policy.users.insert("alice".into(), User { accounts: vec!["ml".into()], ..User::default() });
    policy.accounts.insert("ml".into(), Account::default());
    let update = Command::UpdatePolicy {
        policy: policy.clone(),
        expected_version: None,
        force: true,
        identity: "server:1".into(),
        now_ms: 2,
    };
    assert!(matches!(s.apply(2, &update).outcome, Outcome::PolicyUpdated { .. }));
    s.apply(3, &Command::RegisterNode { spec: node_spec(0, 8), now_ms: 3 });
    for (i, qos) in ["low", "high"].into_iter().enumerate() {
        let mut spec = job_spec(1, 8, 1);
        (spec.qos, spec.account) = (qos.into(), "ml".into());
        s.apply(
            4 + i as u64,
            &Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 4 },
        );
        let opts = gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, 6);
        let p = gangway_core::sched::plan(&s, &opts);
        let cmd = Command::ApplySchedule { preemptions: p.preemptions, placements: p.placements, now_ms: 6 };
        let out = s.apply(6 + i as u64, &cmd).outcome;
        s.check_invariants().unwrap();
        let want_started = vec![i as u64 + 1];
        let Outcome::ScheduleApplied { preempted, started, rejected } = out else { panic!("{out:?}") };
        assert!(rejected.is_empty(), "{rejected:?}");
        assert_eq!(started, want_started);
        assert_eq!(preempted, if i == 0 { vec![] } else { vec![1] });
    }
    // The account's quota fills up with job 2 running: only its release makes room.
    policy.accounts.insert(
        "ml".into(),
        Account { quota: Quota { max_running_gpus: Some(8), ..Quota::default() }, ..Account::default() },
    );
    let update =
        Command::UpdatePolicy { policy, expected_version: None, force: true, identity: "server:1".into(), now_ms: 8 };
    assert!(matches!(s.apply(8, &update).outcome, Outcome::PolicyUpdated { .. }));
    // Without its victim, the same placement is refused: GPUs taken.
    let mut spec = job_spec(1, 8, 1);
    (spec.qos, spec.account) = ("high".into(), "ml".into());
    s.apply(9, &Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 9 });
    let placement = gangway_core::command::Placement {
        job_id: 3,
        attempt: 1,
        nodes: s.jobs[&2].allocation.as_ref().unwrap().nodes.clone(),
    };
    let err = s.check_placement(&placement).unwrap_err();
    assert!(err.contains("lacks free CPUs") || err.contains("not free") || err.contains("AssocGrpLimit"), "{err}");
    let freed = std::collections::BTreeMap::from([(2, gangway_core::policy::PreemptMode::Requeue)]);
    s.check_placement_freeing(&placement, &freed).unwrap();
    // A victim suspended instead keeps its quota use: the account's quota is still full.
    let suspended = std::collections::BTreeMap::from([(2, gangway_core::policy::PreemptMode::Suspend)]);
    let err = s.check_placement_freeing(&placement, &suspended).unwrap_err();
    assert!(err.contains("AssocGrpLimit") || err.contains("quota") || err.contains("GPU"), "{err}");
}

/// Slurm's batch semantics: a batch job ends with its script on the first
/// node; the other nodes' step hosts do not decide it unless they fail.
#[test]
fn batch_jobs_end_with_their_first_node() {
    let exit = |s: &mut State, index: u64, job_id: JobId, node: &str, code: Option<i32>, signal: Option<i32>| {
        let attempt = s.jobs[&job_id].attempt;
        let cmd = Command::TaskExited {
            job_id,
            attempt,
            node: node.into(),
            exit_code: code,
            signal,
            reason: String::new(),
            lost: false,
            peak_mem_mb: None,
            usage: None,
            now_ms: index,
        };
        s.apply(index, &cmd).outcome
    };
    let mut s = State::default();
    for i in 0..2 {
        s.apply(1, &Command::RegisterNode { spec: node_spec(i, 4), now_ms: 1 });
    }
    let mut index = 2;
    let mut start = |s: &mut State, batch: bool| {
        index += 1;
        let spec = JobSpec { batch, ..job_spec(2, 1, 1) };
        let cmd = Command::SubmitJob { spec, identity: "a".into(), idempotency_key: String::new(), now_ms: index };
        let Outcome::Submitted { job_id, .. } = s.apply(index, &cmd).outcome else { panic!("submit refused") };
        let plan = first_fit(s, job_id, 0).unwrap();
        index += 1;
        s.apply(index, &Command::ApplySchedule { preemptions: vec![], placements: vec![plan], now_ms: index });
        assert_eq!(s.jobs[&job_id].state, JobState::Running);
        let nodes: Vec<String> =
            s.jobs[&job_id].allocation.as_ref().unwrap().nodes.iter().map(|n| n.node.clone()).collect();
        (job_id, nodes)
    };
    // The script's clean exit on the first node completes the job and frees
    // the step host too.
    let (job, nodes) = start(&mut s, true);
    exit(&mut s, 100, job, &nodes[0], Some(0), None);
    assert_eq!(s.jobs[&job].state, JobState::Completed);
    assert_eq!(s.nodes[&nodes[1]].gpus_free(), 4, "the step host's GPU is released with the job");
    s.check_invariants().unwrap();
    // A failing script fails the job with its exit code.
    let (job, nodes) = start(&mut s, true);
    exit(&mut s, 101, job, &nodes[0], Some(7), None);
    assert_eq!((s.jobs[&job].state, s.jobs[&job].exit_code), (JobState::Failed, Some(7)));
    // A step host killed while the script runs fails the job, named as such.
    let (job, nodes) = start(&mut s, true);
    exit(&mut s, 102, job, &nodes[1], None, Some(9));
    assert_eq!(s.jobs[&job].state, JobState::Failed);
    assert!(s.jobs[&job].reason.contains("step host on"), "{}", s.jobs[&job].reason);
    // Without batch semantics every node's exit is waited for.
    let (job, nodes) = start(&mut s, false);
    exit(&mut s, 103, job, &nodes[0], Some(0), None);
    assert_eq!(s.jobs[&job].state, JobState::Running, "the second node's task is still running");
    exit(&mut s, 104, job, &nodes[1], Some(0), None);
    assert_eq!(s.jobs[&job].state, JobState::Completed);
    s.check_invariants().unwrap();
}

/// srun's steps in the history (format 10): each gets the attempt's next
/// id; a step names nodes of its job only (none: all of them) and a sane
/// task count; its end records its exit; the steps still running end
/// CANCELLED with their job; a requeued job starts its next attempt with
/// none; a suspended job records no step; older formats refuse them.
#[test]
fn srun_steps_are_recorded_and_end_with_their_job() {
    use gangway_core::state::RefusalKind;
    let mut s = State::default();
    for i in 0..3 {
        s.apply(1, &Command::RegisterNode { spec: node_spec(i, 4), now_ms: 1 });
    }
    let submit = Command::SubmitJob {
        spec: JobSpec { batch: true, ..job_spec(2, 1, 1) },
        identity: "a".into(),
        idempotency_key: String::new(),
        now_ms: 2,
    };
    let Outcome::Submitted { job_id, .. } = s.apply(2, &submit).outcome else { panic!("submit refused") };
    let plan = first_fit(&s, job_id, 0).unwrap();
    s.apply(3, &Command::ApplySchedule { preemptions: vec![], placements: vec![plan], now_ms: 3 });
    let nodes: Vec<String> =
        s.jobs[&job_id].allocation.as_ref().unwrap().nodes.iter().map(|n| n.node.clone()).collect();
    let other = s.nodes.keys().find(|n| !nodes.contains(n)).unwrap().clone();
    let step = |attempt: u32, name: &str, nodes: Vec<String>, tasks: u32, now_ms: u64| Command::StepStarted {
        job_id,
        attempt,
        name: name.into(),
        nodes,
        tasks,
        now_ms,
    };
    let start = |nodes: Vec<String>, tasks: u32, now_ms: u64| step(1, "python", nodes, tasks, now_ms);
    let end = |step_id: u32, exit_code: Option<i32>, signal: Option<i32>| Command::StepEnded {
        job_id,
        attempt: 1,
        step_id,
        exit_code,
        signal,
        now_ms: 20,
    };
    let refused = |o: Outcome| match o {
        Outcome::Refused(r) => r,
        other => panic!("not refused: {other:?}"),
    };
    assert_eq!(refused(s.apply(4, &start(vec![], 2, 4)).outcome).kind, RefusalKind::FailedPrecondition);
    s.apply(5, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 5 });
    assert_eq!(s.apply(6, &start(vec![], 2, 6)).outcome, Outcome::StepStarted { job_id, step_id: 0 });
    assert_eq!(s.apply(7, &start(vec![nodes[1].clone()], 1, 7)).outcome, Outcome::StepStarted { job_id, step_id: 1 });
    use gangway_core::limits::{STEP_NAME_BYTES_MAX, STEP_TASKS_PER_NODE_MAX};
    let at_limits = step(1, &"x".repeat(STEP_NAME_BYTES_MAX), vec![], 2 * STEP_TASKS_PER_NODE_MAX, 7);
    assert_eq!(s.apply(7, &at_limits).outcome, Outcome::StepStarted { job_id, step_id: 2 });
    for (bad, why) in [
        (start(vec![other.clone()], 1, 8), "nodes:"),
        (start(vec![nodes[0].clone(), nodes[0].clone()], 2, 8), "nodes:"),
        (start(vec![], 0, 8), "tasks:"),
        // One past STEP_TASKS_PER_NODE_MAX on each of the job's two nodes,
        // and one past STEP_NAME_BYTES_MAX (both taken at their values below).
        (start(vec![], 2 * STEP_TASKS_PER_NODE_MAX + 1, 8), "tasks:"),
        (step(1, &"x".repeat(STEP_NAME_BYTES_MAX + 1), vec![], 1, 8), "name:"),
        // One past STEP_NODES_LISTED_MAX: refused before the names are looked at.
        (start(vec![nodes[0].clone(); gangway_core::limits::STEP_NODES_LISTED_MAX + 1], 1, 8), "at most 64 listed"),
        (step(2, "python", vec![], 1, 8), "not running"),
    ] {
        let r = refused(s.apply(8, &bad).outcome);
        assert!(r.message.contains(why), "{why}: {}", r.message);
    }
    assert_eq!(s.apply(9, &end(0, Some(0), None)).outcome, Outcome::StepEnded { job_id, step_id: 0 });
    assert_eq!(refused(s.apply(10, &end(0, Some(0), None)).outcome).kind, RefusalKind::Stale, "ended once");
    assert_eq!(refused(s.apply(10, &end(9, Some(0), None)).outcome).kind, RefusalKind::NotFound);
    let steps = &s.jobs[&job_id].steps;
    assert_eq!((steps[0].state, steps[0].nodes.len(), steps[0].exit_code), (JobState::Completed, 0, Some(0)));
    assert_eq!((steps[1].state, steps[1].nodes.clone()), (JobState::Running, vec![nodes[1].clone()]));
    // Past the most kept, the oldest that ended makes way, then the oldest
    // of all (sruns that died without saying so never block new steps).
    for i in 0..70 {
        assert!(matches!(s.apply(10, &start(vec![], 1, 10 + i)).outcome, Outcome::StepStarted { .. }));
    }
    let kept = &s.jobs[&job_id].steps;
    assert_eq!(kept.len(), gangway_core::limits::STEPS_PER_JOB_MAX);
    assert_eq!((kept[0].id, kept[63].id), (9, 72), "the newest are kept");
    assert!(refused(s.apply(10, &step(1, "a\nb", vec![], 1, 10)).outcome).message.contains("control"));
    // Suspended: no step starts.
    let suspend = |change| Command::UpdateJob { job_id, change, identity: "server:1".into(), now_ms: 11 };
    s.apply(11, &suspend(JobChange::Suspend));
    assert!(refused(s.apply(12, &start(vec![], 2, 12)).outcome).message.contains("suspended"));
    s.apply(13, &suspend(JobChange::Resume));
    // A requeue starts the next attempt with no steps; its own count from 0.
    s.apply(
        14,
        &Command::UpdateJob { job_id, change: JobChange::Requeue { hold: false }, identity: "a".into(), now_ms: 14 },
    );
    assert!(s.jobs[&job_id].steps.is_empty());
    let plan = first_fit(&s, job_id, 0).unwrap();
    s.apply(15, &Command::ApplySchedule { preemptions: vec![], placements: vec![plan], now_ms: 15 });
    let again = step(2, "python", vec![], 2, 16);
    assert_eq!(s.apply(16, &again).outcome, Outcome::StepStarted { job_id, step_id: 0 });
    s.apply(17, &Command::CancelJob { job_id, identity: "a".into(), now_ms: 17 });
    let step = &s.jobs[&job_id].steps[0];
    assert_eq!((step.state, step.end_ms), (JobState::Cancelled, Some(s.clock_ms)), "a running step ends with its job");
    s.check_invariants().unwrap();
}

/// A job makes at most ATTEMPTS_MAX attempts: an operator's requeue of
/// the last one is refused, naming the limit, and a node failure in the
/// last one ends the job instead of requeueing it.
#[test]
fn a_job_makes_at_most_attempts_max_attempts() {
    use gangway_core::limits::ATTEMPTS_MAX;
    let mut s = State::default();
    for i in 0..2 {
        s.apply(1, &Command::RegisterNode { spec: node_spec(i, 0), now_ms: 1 });
    }
    let submit = Command::SubmitJob {
        spec: JobSpec { requeue: true, ..job_spec(1, 0, 1) },
        identity: "alice".into(),
        idempotency_key: String::new(),
        now_ms: 2,
    };
    let Outcome::Submitted { job_id, .. } = s.apply(2, &submit).outcome else { panic!("submit refused") };
    let mut index = 3;
    let place = |s: &mut State, index: &mut u64| {
        let plan = first_fit(s, job_id, 0).unwrap();
        s.apply(*index, &Command::ApplySchedule { preemptions: vec![], placements: vec![plan], now_ms: *index });
        *index += 1;
        assert_eq!(s.jobs[&job_id].state, JobState::Running);
    };
    let requeue = Command::UpdateJob {
        job_id,
        change: JobChange::Requeue { hold: false },
        identity: "server:1".into(),
        now_ms: 100,
    };
    place(&mut s, &mut index);
    while s.jobs[&job_id].attempt < ATTEMPTS_MAX {
        let attempt = s.jobs[&job_id].attempt;
        assert!(!matches!(s.apply(index, &requeue).outcome, Outcome::Refused(_)), "attempt {attempt} refused");
        index += 1;
        place(&mut s, &mut index);
        assert_eq!(s.jobs[&job_id].attempt, attempt + 1);
    }
    match s.apply(index, &requeue).outcome {
        Outcome::Refused(r) => assert_eq!(r.message, format!("job {job_id} made {ATTEMPTS_MAX} attempts, its limit")),
        other => panic!("one past ATTEMPTS_MAX: {other:?}"),
    }
    index += 1;
    // Its node fails in the last attempt: the job ends, it is not requeued.
    let node = s.jobs[&job_id].allocation.as_ref().unwrap().nodes[0].node.clone();
    let down =
        Command::SetNodeState { name: node, change: NodeStateChange::Down, reason: "gone".into(), now_ms: index };
    s.apply(index, &down);
    assert_eq!(s.jobs[&job_id].state, JobState::NodeFail);
    assert_eq!(s.jobs[&job_id].attempt, ATTEMPTS_MAX);
    s.check_invariants().unwrap();
}

/// Reservations hold RESERVED_NODE_ENTRIES_MAX node entries in all (every
/// node, in four windows one after another); a fifth is refused, naming
/// the limit, and replacing one of the four is not counted twice.
/// The queue's head gets a start time from a sweep over future job ends,
/// a trial placement at each: RESERVATION_TRIES_MAX of them at most. Here
/// an advance reservation (for someone else) blocks every start before its
/// end, so the head's start is found on the try after the last job end:
/// with RESERVATION_TRIES_MAX - 1 ends it is found, with one more it is not.
#[test]
fn a_reservation_is_sought_over_reservation_tries_max_trial_placements() {
    use gangway_core::reservation::{ReservationChange, ReservationRequest};
    use gangway_core::sched::{plan, Options, Policy, RESERVATION_TRIES_MAX};
    let hour = 3_600_000;
    for (ends, found) in [(RESERVATION_TRIES_MAX - 1, true), (RESERVATION_TRIES_MAX, false)] {
        let mut s = State::default();
        s.apply(1, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 1 });
        let node = NodeSpec { cpus: 1024, ..node_spec(0, 0) };
        s.apply(2, &Command::RegisterNode { spec: node, now_ms: 2 });
        let mut index = 3;
        // Jobs ending a second apart, all before the advance reservation.
        for k in 0..ends {
            let spec = JobSpec { time_limit_s: 60 + k as u64, ..job_spec(1, 0, 1) };
            s.apply(index, &submit_cmd(spec));
            index += 1;
        }
        let p = plan(&s, &Options::new(Policy::Easy, 10));
        assert_eq!(p.placements.len(), ends);
        s.apply(index, &Command::ApplySchedule { preemptions: p.preemptions, placements: p.placements, now_ms: 10 });
        index += 1;
        let resv = ReservationRequest {
            name: "maint".into(),
            start_ms: 2 * hour,
            end_ms: 3 * hour,
            nodes: vec!["n0".into()],
            users: vec!["bob".into()],
            ..Default::default()
        };
        let created = Command::ChangeReservation {
            change: ReservationChange::Create(resv),
            identity: "server:1".into(),
            now_ms: 11,
        };
        assert_eq!(s.apply(index, &created).outcome, Outcome::ReservationChanged { name: "maint".into() });
        index += 1;
        // Two hours long: it cannot start before the advance reservation ends.
        let head = JobSpec { time_limit_s: 7_200, ..job_spec(1, 0, 1) };
        let Outcome::Submitted { job_id, .. } = s.apply(index, &submit_cmd(head)).outcome else { panic!("submit") };
        let p = plan(&s, &Options::new(Policy::Easy, 20));
        assert!(p.placements.is_empty(), "{:?}", p.placements);
        let start = p.reservations.iter().find(|(id, _)| *id == job_id).map(|(_, t)| *t);
        assert_eq!(start, found.then_some(3 * hour), "{ends} job ends before the start");
    }
}

/// A preemptor looks at the VICTIM_CANDIDATES_MAX cheapest running jobs
/// (by work lost) and no more. Here an account reclaims the one GPU its
/// sibling borrowed: the cheapest candidates (2-GPU jobs just started) give
/// back more than was borrowed and are passed over, and the one that fits
/// (a 1-GPU job running since long before) is candidate N + 1: found with
/// N = VICTIM_CANDIDATES_MAX - 1, past the candidates with one more.
#[test]
fn a_preemptor_considers_victim_candidates_max_candidates() {
    use gangway_core::policy::{Account, ClusterPolicy, Quota, User};
    use gangway_core::sched::{plan, Options, Policy, VICTIM_CANDIDATES_MAX};
    for (cheaper, found) in [(VICTIM_CANDIDATES_MAX - 1, true), (VICTIM_CANDIDATES_MAX, false)] {
        let mut s = State::default();
        s.apply(1, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 1 });
        let gpus = |n: usize| Quota { max_running_gpus: Some(n as u32), ..Quota::default() };
        let mut policy = ClusterPolicy::default();
        let lender = Account { quota: gpus(2 * cheaper), borrow_gpus: 1, ..Account::default() };
        policy.accounts.insert("a".into(), lender);
        policy.accounts.insert("b".into(), Account { quota: gpus(1), ..Account::default() });
        policy.users.insert("alice".into(), User { accounts: vec!["a".into()], ..User::default() });
        policy.users.insert("bob".into(), User { accounts: vec!["b".into()], ..User::default() });
        let update = Command::UpdatePolicy {
            policy,
            expected_version: None,
            force: true,
            identity: "server:1".into(),
            now_ms: 2,
        };
        assert!(matches!(s.apply(2, &update).outcome, Outcome::PolicyUpdated { .. }));
        let index = std::cell::Cell::new(3);
        let next = || {
            index.set(index.get() + 1);
            index.get()
        };
        let run = |s: &mut State, user: &str, gpus: u32, now_ms: u64| {
            let spec = JobSpec { user: user.into(), account: String::new(), ..job_spec(1, gpus, 1) };
            let cmd = Command::SubmitJob { spec, identity: user.into(), idempotency_key: String::new(), now_ms };
            assert!(matches!(s.apply(next(), &cmd).outcome, Outcome::Submitted { .. }));
        };
        // The 1-GPU job first, on the only node then.
        s.apply(next(), &Command::RegisterNode { spec: node_spec(0, 1), now_ms: 3 });
        run(&mut s, "alice", 1, 1_000);
        let p = plan(&s, &Options::new(Policy::Easy, 1_000));
        s.apply(next(), &Command::ApplySchedule { preemptions: vec![], placements: p.placements, now_ms: 1_000 });
        for i in 1..=cheaper {
            s.apply(next(), &Command::RegisterNode { spec: node_spec(i, 2), now_ms: 3 });
        }
        let now = 3_600_000;
        for _ in 0..cheaper {
            run(&mut s, "alice", 2, now);
        }
        let p = plan(&s, &Options::new(Policy::Easy, now));
        assert_eq!(p.placements.len(), cheaper);
        s.apply(next(), &Command::ApplySchedule { preemptions: vec![], placements: p.placements, now_ms: now });
        assert_eq!(s.running.len(), cheaper + 1, "a runs one GPU past its quota, borrowed from b");
        run(&mut s, "bob", 1, now);
        let p = plan(&s, &Options::new(Policy::Easy, now));
        let victims: Vec<u64> = p.preemptions.iter().map(|v| v.job_id).collect();
        assert_eq!(victims, if found { vec![1] } else { vec![] }, "{cheaper} cheaper candidates");
        assert_eq!(p.placements.len(), usize::from(found));
    }
}

/// PENDING_EXAMINED_PER_PASS_MAX never cuts the queue short: a pass may
/// examine every pending job the state can hold (ACTIVE_JOBS_MAX, which a
/// submit cannot go past), so no job waits unseen behind the limit.
#[test]
fn a_pass_may_examine_every_pending_job() {
    use gangway_core::limits::ACTIVE_JOBS_MAX;
    use gangway_core::sched::PENDING_EXAMINED_PER_PASS_MAX;
    const { assert!(PENDING_EXAMINED_PER_PASS_MAX >= ACTIVE_JOBS_MAX) };
}

/// Finished jobs keep FINISHED_BYTES_RETAINED_MAX bytes of specs at most:
/// at the limit every one is kept; one job past it, the oldest goes.
#[test]
fn finished_jobs_keep_finished_bytes_retained_max_bytes() {
    use gangway_core::limits::{FINISHED_BYTES_RETAINED_MAX, JOB_SPEC_BYTES_MAX};
    let mut s = State::default();
    s.apply(1, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 1 });
    let mut index = 2;
    let mut finish = |s: &mut State, spec: JobSpec| -> JobId {
        let Outcome::Submitted { job_id, .. } = s.apply(index, &submit_cmd(spec)).outcome else { panic!("submit") };
        s.apply(index + 1, &Command::CancelJob { job_id, identity: "alice".into(), now_ms: 20 });
        index += 2;
        job_id
    };
    let retained = |s: &State| -> u64 { s.finished.iter().map(|id| s.jobs[id].retained_bytes() as u64).sum() };
    // A submitted spec holds a few bytes more than it was sent with (its
    // account, resolved): the first job tells how many.
    let sent = JOB_SPEC_BYTES_MAX - 64;
    let first = finish(&mut s, spec_of_size(sent));
    let added = retained(&s) - sent as u64;
    let of = |bytes: u64| spec_of_size((bytes - added) as usize);
    let each = JOB_SPEC_BYTES_MAX as u64;
    // Whole jobs, then two of the rest, to the byte.
    let whole = (FINISHED_BYTES_RETAINED_MAX - retained(&s)) / each - 1;
    for _ in 0..whole {
        finish(&mut s, of(each));
    }
    let rest = FINISHED_BYTES_RETAINED_MAX - retained(&s);
    finish(&mut s, of(rest / 2));
    finish(&mut s, of(rest - rest / 2));
    assert_eq!(retained(&s), FINISHED_BYTES_RETAINED_MAX);
    assert!(s.jobs.contains_key(&first), "at the limit every finished job is kept");
    let kept = s.finished.len();
    // One more, however small: past the limit, the oldest goes.
    finish(&mut s, of(4096));
    assert!(!s.jobs.contains_key(&first), "past FINISHED_BYTES_RETAINED_MAX the oldest goes");
    assert!(retained(&s) <= FINISHED_BYTES_RETAINED_MAX);
    assert_eq!(s.finished.len(), kept);
    s.check_invariants().unwrap();
}

#[test]
fn reservations_hold_at_most_reserved_node_entries_max_entries() {
    use gangway_core::limits::{NODES_MAX, RESERVED_NODE_ENTRIES_MAX};
    use gangway_core::reservation::{ReservationChange, ReservationRequest};
    let mut s = State::default();
    s.apply(1, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 1 });
    for i in 0..NODES_MAX {
        s.apply(2, &Command::RegisterNode { spec: node_spec(i, 0), now_ms: 2 });
    }
    let names: Vec<String> = s.nodes.keys().cloned().collect();
    let hour = 3_600_000;
    let change = |k: u64, change: fn(ReservationRequest) -> ReservationChange| Command::ChangeReservation {
        change: change(ReservationRequest {
            name: format!("r{k}"),
            start_ms: (k + 1) * hour,
            end_ms: (k + 2) * hour,
            nodes: names.clone(),
            users: vec!["alice".into()],
            ..Default::default()
        }),
        identity: "server:1".into(),
        now_ms: 3,
    };
    let windows = (RESERVED_NODE_ENTRIES_MAX / NODES_MAX) as u64;
    for k in 0..windows {
        assert_eq!(
            s.apply(3, &change(k, ReservationChange::Create)).outcome,
            Outcome::ReservationChanged { name: format!("r{k}") }
        );
    }
    match s.apply(4, &change(windows, ReservationChange::Create)).outcome {
        Outcome::Refused(r) => assert_eq!(
            r.message,
            format!(
                "nodes: reservations would hold {} node entries, over {RESERVED_NODE_ENTRIES_MAX}",
                RESERVED_NODE_ENTRIES_MAX + NODES_MAX
            )
        ),
        other => panic!("one reservation past RESERVED_NODE_ENTRIES_MAX entries: {other:?}"),
    }
    assert!(matches!(
        s.apply(5, &change(windows - 1, ReservationChange::Update)).outcome,
        Outcome::ReservationChanged { .. }
    ));
}

#[path = "support/scenario.rs"]
mod scenario;

/// This package's directory, as the test runner says at run time: the
/// compile-time path can name another checkout when a shared target directory
/// reuses a binary built there.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()).into()
}

/// Every scheduler scenario file (tests/scenarios/*.toml) passes.
#[test]
fn scheduler_scenarios() {
    let dir = manifest_dir().join("tests/scenarios");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.retain(|p| p.extension().is_some_and(|e| e == "toml"));
    files.sort();
    assert!(files.len() >= 10, "expected the scenario files in {}", dir.display());
    for f in files {
        scenario::run_file(&f);
    }
    // A misspelt expectation fails the run instead of checking nothing.
    let dir = tempfile_dir();
    let typo = dir.join("typo.toml");
    let text =
        "[[node]]\nnames = \"n1\"\n[[step]]\nsubmit = { nodes = 1 }\n[[step]]\nschedule = \"easy\"\nstrated = [1]\n";
    std::fs::write(&typo, text).unwrap();
    let failed = std::panic::catch_unwind(|| scenario::run_file(&typo)).unwrap_err();
    let message = failed.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("unknown key `strated`"), "{message}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A fresh directory under the system's temporary directory (the core's
/// tests take no dependency for it).
fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("gangway-core-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The example policy shipped in deploy/ parses and validates.
#[test]
fn example_policy_is_valid() {
    let path = manifest_dir().join("../deploy/policy.example.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let policy: gangway_core::policy::ClusterPolicy = toml::from_str(&text).unwrap();
    policy.validate().unwrap();
    assert_eq!(policy.topology_levels, vec!["zone", "block", "rack"]);
    assert!(policy.partitions["gpu"].default);
    assert_eq!(policy.operators, vec!["oncall"]);
    assert_eq!(policy.coordinators["research"], vec!["carol"]);
    assert_eq!(policy.unix_user("ci-bot"), "builder");
    assert_eq!(policy.unix_user("alice@corp.example"), "alice");
    assert!(!policy.enforce_users && !policy.allow_root_jobs);
    assert_eq!(policy.lineage("vision"), vec!["vision", "research"]);
}

/// FNV-1a, to pin encodings in a line.
fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// Golden encodings of data format 4: a state holding a policy (admins,
/// accounts, QOS), a node and a job, and a replicated policy command. bincode
/// is positional, so a field added, removed or moved in any of these types
/// changes the bytes: bump the format versions (with a migration) and then
/// these values. (They were computed on the build before the security work
/// and hold unchanged after it.)
#[test]
fn replicated_encodings_keep_their_bytes() {
    let mut policy = preset_policy(3);
    policy.admins = vec!["ops".into()];
    let update = Command::UpdatePolicy {
        policy,
        expected_version: None,
        force: false,
        identity: "server:golden".into(),
        now_ms: 2,
    };
    let mut s = State::default();
    s.apply(1, &Command::RegisterNode { spec: node_spec(0, 8), now_ms: 1 });
    s.apply(2, &update);
    let submit = Command::SubmitJob {
        spec: job_spec(1, 1, 1),
        identity: "client:alice".into(),
        idempotency_key: "k".into(),
        now_ms: 3,
    };
    s.apply(3, &submit);
    assert_eq!(s.policy.admins, vec!["ops".to_string()], "the policy did not apply");
    assert_eq!(s.jobs.len(), 1, "the job was not submitted");
    let snap = snapshot::encode(&s);
    // Format 4's entries are the bare commands as that format had them.
    let v4 = |c: &Command| gangway_core::format::to_bytes(&gangway_core::payload::Payload::new(c.clone(), 4));
    let (cmd, job) = (v4(&update), v4(&submit));
    let got = [(snap.len(), fnv64(&snap)), (cmd.len(), fnv64(&cmd)), (job.len(), fnv64(&job))];
    assert_eq!(got, GOLDEN_FORMAT4, "format 4's bytes changed");
}

/// (bytes, FNV-1a) of the snapshot, the policy command and the submit above,
/// computed on the build before the security work (format 4, which this
/// build still writes until the cluster moves to format 5).
const GOLDEN_FORMAT4: [(usize, u64); 3] =
    [(587, 12837966146749691398), (157, 1692682061728110456), (71, 3020520779667525184)];

/// A job spec with every field set to something other than its default.
fn full_spec() -> JobSpec {
    JobSpec {
        name: "train".into(),
        user: "alice".into(),
        command: vec!["python".into(), "train.py".into()],
        script: "#!/bin/sh\nsrun python train.py\n".into(),
        workdir: "/home/alice".into(),
        partition: "gpu".into(),
        nodes: 2,
        tasks_per_node: 8,
        cpus_per_task: 4,
        mem_per_node_mb: 65_536,
        gpus_per_node: 8,
        gpu_type: "h100".into(),
        time_limit_s: 3_600,
        env: BTreeMap::from([("WANDB_MODE".into(), "offline".into())]).into(),
        requeue: true,
        output: "%x-%j.out".into(),
        error: "%x-%j.err".into(),
        warn_signal: 10,
        warn_before_s: 120,
        warn_batch_shell: true,
        account: "ml".into(),
        qos: "high".into(),
        nodes_max: 4,
        mem_per_cpu_mb: 2_048,
        constraints: vec!["ib".into()],
        exclusive: true,
        topology: TopologyConstraint { level: "rack".into(), required: true, wait_s: 60 },
        dependencies: vec![Dependency { kind: DependencyKind::AfterOk, job_id: 3, array_index: Some(1) }],
        singleton: true,
        kill_on_invalid_dep: true,
        array: "0-3%2".into(),
        nice: 5,
        hold: true,
        begin_ms: 1_700_000_000_000,
        comment: "golden".into(),
        batch: true,
        truncate_output: true,
        nodelist: vec!["n1".into()],
        exclude: vec!["n9".into()],
        // Format 9's fields: empty, so the spec encodes in every format.
        licenses: BTreeMap::new(),
        reservation: String::new(),
        time_min_s: 0,
        deadline_ms: 0,
        requeue_expedite: false,
        // Format 11's: empty too.
        components: Vec::new(),
    }
}

/// [`full_spec_v9`] made heterogeneous (format 11), its component with
/// every field set.
fn full_spec_v11() -> JobSpec {
    let mut spec = full_spec_v9();
    spec.array = String::new();
    spec.nodes_max = 0;
    spec.components = vec![gangway_core::spec::HetComponent {
        partition: "cpu".into(),
        nodes: 3,
        tasks_per_node: 2,
        cpus_per_task: 8,
        mem_per_node_mb: 4_096,
        mem_per_cpu_mb: 0,
        gpus_per_node: 1,
        gpu_type: "a100".into(),
        constraints: vec!["ssd".into()],
        exclusive: true,
        nodelist: vec!["n2".into()],
        exclude: vec!["n8".into()],
    }];
    spec
}

/// [`full_spec`] with format 9's fields set too.
fn full_spec_v9() -> JobSpec {
    let mut spec = full_spec();
    spec.licenses = BTreeMap::from([("wandb".into(), 2)]);
    spec.reservation = "train".into();
    spec.time_min_s = 600;
    spec.deadline_ms = 1_700_000_900_000;
    spec.requeue_expedite = true;
    spec
}

/// A reservation request with every field set.
fn full_reservation() -> gangway_core::reservation::ReservationRequest {
    use gangway_core::reservation::{Repeat, ReservationFlags, ReservationRequest};
    ReservationRequest {
        name: "train".into(),
        start_ms: 10_000,
        end_ms: 20_000,
        nodes: vec!["n0".into()],
        gpus: 0,
        partition: "gpu".into(),
        users: vec!["alice".into()],
        accounts: vec!["ml".into()],
        flags: ReservationFlags { maint: true, ignore_jobs: true, repeat: Repeat::Weekly },
    }
}

/// One command of every variant, every field set.
fn every_command() -> Vec<Command> {
    use gangway_core::command::Preemption;
    use gangway_core::policy::PreemptMode;
    let alloc = NodeAllocation { node: "n0".into(), cpus: 4, mem_mb: 1024, gpus: vec![0, 1] };
    let placement = Placement { job_id: 1, attempt: 1, nodes: vec![alloc] };
    vec![
        Command::SubmitJob { spec: full_spec(), identity: "alice".into(), idempotency_key: "k1".into(), now_ms: 1 },
        Command::CancelJob { job_id: 1, identity: "alice".into(), now_ms: 2 },
        Command::RegisterNode { spec: node_spec(0, 2), now_ms: 3 },
        Command::SetNodeState { name: "n0".into(), change: NodeStateChange::Drain, reason: "fix".into(), now_ms: 4 },
        Command::ApplyPlan { placements: vec![placement.clone()], now_ms: 5 },
        Command::JobFinished {
            job_id: 1,
            attempt: 1,
            state: JobState::TimedOut,
            exit_code: Some(143),
            reason: "time".into(),
            now_ms: 6,
        },
        Command::Batch(vec![Command::CancelJob { job_id: 2, identity: "bob".into(), now_ms: 7 }]),
        Command::TaskExited {
            job_id: 1,
            attempt: 1,
            node: "n0".into(),
            exit_code: None,
            signal: Some(9),
            reason: "oom".into(),
            lost: true,
            peak_mem_mb: Some(512),
            usage: None,
            now_ms: 8,
        },
        Command::SetGpuHealth { node: "n0".into(), gpu: 1, healthy: false, reason: "xid 79".into(), now_ms: 9 },
        Command::UpdatePolicy {
            policy: preset_policy(3),
            expected_version: Some(1),
            force: true,
            identity: "ops".into(),
            now_ms: 10,
        },
        Command::UpdateJob { job_id: 1, change: JobChange::SetNice(-5), identity: "ops".into(), now_ms: 11 },
        Command::UpdateJob { job_id: 1, change: JobChange::Suspend, identity: "ops".into(), now_ms: 11 },
        Command::UpdateJob { job_id: 1, change: JobChange::Resume, identity: "ops".into(), now_ms: 11 },
        Command::UpdateJob {
            job_id: 1,
            change: JobChange::Signal { signal: 10, target: gangway_core::command::SignalTarget::Batch },
            identity: "ops".into(),
            now_ms: 11,
        },
        Command::StepStarted {
            job_id: 1,
            attempt: 1,
            name: "python".into(),
            nodes: vec!["n0".into()],
            tasks: 8,
            now_ms: 11,
        },
        Command::StepEnded { job_id: 1, attempt: 1, step_id: 0, exit_code: Some(3), signal: None, now_ms: 11 },
        Command::ApplySchedule {
            preemptions: vec![Preemption { job_id: 2, attempt: 1, mode: PreemptMode::Cancel, for_job: 1 }],
            placements: vec![placement.clone()],
            now_ms: 12,
        },
        Command::ApplySchedule {
            preemptions: vec![Preemption { job_id: 2, attempt: 1, mode: PreemptMode::Suspend, for_job: 1 }],
            placements: vec![placement],
            now_ms: 12,
        },
        Command::SetNodeState {
            name: "n0".into(),
            change: NodeStateChange::PowerDown,
            reason: "idle".into(),
            now_ms: 12,
        },
        Command::JobCheckpointed { job_id: 1, attempt: 1, now_ms: 13 },
        Command::SetDataFormat { format: 5, now_ms: 14 },
        Command::SetDataFormat { format: 6, now_ms: 15 },
        Command::UpdatePolicy {
            policy: roles_policy(),
            expected_version: None,
            force: false,
            identity: "ops".into(),
            now_ms: 16,
        },
        Command::SetDataFormat { format: 7, now_ms: 17 },
        Command::SetDataFormat { format: 9, now_ms: 18 },
        Command::SubmitJob { spec: full_spec_v9(), identity: "alice".into(), idempotency_key: "k9".into(), now_ms: 19 },
        Command::SubmitJob {
            spec: full_spec_v11(),
            identity: "alice".into(),
            idempotency_key: "k11".into(),
            now_ms: 20,
        },
        Command::UpdatePolicy {
            policy: licenses_policy(),
            expected_version: None,
            force: false,
            identity: "ops".into(),
            now_ms: 20,
        },
        Command::UpdatePolicy {
            policy: license_limits_policy(),
            expected_version: None,
            force: false,
            identity: "ops".into(),
            now_ms: 21,
        },
        Command::ChangeReservation {
            change: gangway_core::reservation::ReservationChange::Create(full_reservation()),
            identity: "ops".into(),
            now_ms: 21,
        },
        Command::ChangeReservation {
            change: gangway_core::reservation::ReservationChange::Delete { name: "train".into() },
            identity: "ops".into(),
            now_ms: 22,
        },
        Command::JobFinished {
            job_id: 1,
            attempt: 0,
            state: JobState::Deadline,
            exit_code: None,
            reason: "deadline".into(),
            now_ms: 23,
        },
        task_exit_with_usage(1, 1, "n0", 24),
        restore_usage_cmd(25),
        Command::AccountingStored { index: 40, identity: "accounting".into(), now_ms: 27 },
        Command::DrawHistory { history: 0x0005_eed0_fa11, now_ms: 28 },
        Command::SetNodeInventory {
            inventory: full_inventory(),
            expected_version: Some(3),
            identity: "ops".into(),
            now_ms: 29,
        },
        Command::UpdatePolicy {
            policy: gangway_core::policy::ClusterPolicy { finished_jobs_kept: Some(1_000), ..license_limits_policy() },
            expected_version: None,
            force: false,
            identity: "ops".into(),
            now_ms: 26,
        },
        // The variants of the enums entries carry that the commands above
        // do not (`golden_encodings_cover_every_variant`).
        update_job(JobChange::Hold { admin: true }),
        update_job(JobChange::Release),
        update_job(JobChange::SetPriority(Some(7))),
        update_job(JobChange::Requeue { hold: true }),
        update_job(JobChange::SetTimeLimit(7_200)),
        update_job(JobChange::Signal { signal: 15, target: gangway_core::command::SignalTarget::Steps }),
        update_job(JobChange::Signal { signal: 9, target: gangway_core::command::SignalTarget::Full }),
        Command::SetNodeState { name: "n0".into(), change: NodeStateChange::Resume, reason: String::new(), now_ms: 28 },
        Command::SetNodeState { name: "n0".into(), change: NodeStateChange::Down, reason: "gone".into(), now_ms: 28 },
        Command::SetNodeState {
            name: "n0".into(),
            change: NodeStateChange::PowerUp,
            reason: "work".into(),
            now_ms: 28,
        },
        Command::ApplySchedule {
            preemptions: vec![Preemption { job_id: 2, attempt: 1, mode: PreemptMode::Requeue, for_job: 1 }],
            placements: Vec::new(),
            now_ms: 29,
        },
        Command::ChangeReservation {
            change: gangway_core::reservation::ReservationChange::Update(full_reservation()),
            identity: "ops".into(),
            now_ms: 29,
        },
        job_finished(JobState::Completed, Some(0)),
        job_finished(JobState::Failed, Some(1)),
        job_finished(JobState::Cancelled, None),
        job_finished(JobState::NodeFail, None),
        Command::SubmitJob {
            spec: every_dependency_spec(),
            identity: "alice".into(),
            idempotency_key: "kd".into(),
            now_ms: 31,
        },
        reservation_repeating(gangway_core::reservation::Repeat::Once),
        reservation_repeating(gangway_core::reservation::Repeat::Daily),
    ]
}

/// A spec depending on one job by each kind of dependency.
fn every_dependency_spec() -> JobSpec {
    let mut spec = full_spec();
    spec.dependencies = [
        DependencyKind::After,
        DependencyKind::AfterOk,
        DependencyKind::AfterNotOk,
        DependencyKind::AfterAny,
        DependencyKind::AfterCorr,
    ]
    .into_iter()
    .zip(1..)
    .map(|(kind, job_id)| Dependency { kind, job_id, array_index: None })
    .collect();
    spec
}

fn reservation_repeating(repeat: gangway_core::reservation::Repeat) -> Command {
    let mut request = full_reservation();
    request.flags.repeat = repeat;
    Command::ChangeReservation {
        change: gangway_core::reservation::ReservationChange::Create(request),
        identity: "ops".into(),
        now_ms: 32,
    }
}

fn update_job(change: JobChange) -> Command {
    Command::UpdateJob { job_id: 1, change, identity: "ops".into(), now_ms: 28 }
}

fn job_finished(state: JobState, exit_code: Option<i32>) -> Command {
    Command::JobFinished { job_id: 1, attempt: 1, state, exit_code, reason: String::new(), now_ms: 30 }
}

// Every variant of every enum a log entry carries, by name. The exhaustive
// matches in `variants_named` index these lists, so a new variant fails to
// compile until it is named here (a constant index past an array is a
// compile error), and then fails `golden_encodings_cover_every_variant`
// until `every_command` holds one (and the golden file pins its bytes).
const COMMANDS: [&str; 21] = [
    "SubmitJob",
    "CancelJob",
    "RegisterNode",
    "SetNodeState",
    "ApplyPlan",
    "JobFinished",
    "Batch",
    "TaskExited",
    "SetGpuHealth",
    "UpdatePolicy",
    "UpdateJob",
    "ApplySchedule",
    "JobCheckpointed",
    "SetDataFormat",
    "ChangeReservation",
    "StepStarted",
    "StepEnded",
    "RestoreUsage",
    "AccountingStored",
    "DrawHistory",
    "SetNodeInventory",
];
const JOB_CHANGES: [&str; 9] = [
    "JobChange::Hold",
    "JobChange::Release",
    "JobChange::SetPriority",
    "JobChange::SetNice",
    "JobChange::Requeue",
    "JobChange::SetTimeLimit",
    "JobChange::Suspend",
    "JobChange::Resume",
    "JobChange::Signal",
];
const SIGNAL_TARGETS: [&str; 3] = ["SignalTarget::Steps", "SignalTarget::Batch", "SignalTarget::Full"];
const NODE_STATE_CHANGES: [&str; 5] = [
    "NodeStateChange::Drain",
    "NodeStateChange::Resume",
    "NodeStateChange::Down",
    "NodeStateChange::PowerDown",
    "NodeStateChange::PowerUp",
];
const PREEMPT_MODES: [&str; 3] = ["PreemptMode::Requeue", "PreemptMode::Cancel", "PreemptMode::Suspend"];
const RESERVATION_CHANGES: [&str; 3] =
    ["ReservationChange::Create", "ReservationChange::Update", "ReservationChange::Delete"];
const DEPENDENCY_KINDS: [&str; 5] = [
    "DependencyKind::After",
    "DependencyKind::AfterOk",
    "DependencyKind::AfterNotOk",
    "DependencyKind::AfterAny",
    "DependencyKind::AfterCorr",
];
const REPEATS: [&str; 3] = ["Repeat::Once", "Repeat::Daily", "Repeat::Weekly"];
const JOB_STATES: [&str; 8] = [
    "JobState::Pending",
    "JobState::Running",
    "JobState::Completed",
    "JobState::Failed",
    "JobState::Cancelled",
    "JobState::TimedOut",
    "JobState::NodeFail",
    "JobState::Deadline",
];

fn job_state_named(state: JobState) -> &'static str {
    match state {
        JobState::Pending => JOB_STATES[0],
        JobState::Running => JOB_STATES[1],
        JobState::Completed => JOB_STATES[2],
        JobState::Failed => JOB_STATES[3],
        JobState::Cancelled => JOB_STATES[4],
        JobState::TimedOut => JOB_STATES[5],
        JobState::NodeFail => JOB_STATES[6],
        JobState::Deadline => JOB_STATES[7],
    }
}

/// Adds the name of `cmd`'s variant and of every enum variant inside it.
fn variants_named(cmd: &Command, out: &mut std::collections::BTreeSet<&'static str>) {
    use gangway_core::command::SignalTarget;
    use gangway_core::policy::PreemptMode;
    use gangway_core::reservation::{Repeat, ReservationChange};
    out.insert(match cmd {
        Command::SubmitJob { .. } => COMMANDS[0],
        Command::CancelJob { .. } => COMMANDS[1],
        Command::RegisterNode { .. } => COMMANDS[2],
        Command::SetNodeState { .. } => COMMANDS[3],
        Command::ApplyPlan { .. } => COMMANDS[4],
        Command::JobFinished { .. } => COMMANDS[5],
        Command::Batch(_) => COMMANDS[6],
        Command::TaskExited { .. } => COMMANDS[7],
        Command::SetGpuHealth { .. } => COMMANDS[8],
        Command::UpdatePolicy { .. } => COMMANDS[9],
        Command::UpdateJob { .. } => COMMANDS[10],
        Command::ApplySchedule { .. } => COMMANDS[11],
        Command::JobCheckpointed { .. } => COMMANDS[12],
        Command::SetDataFormat { .. } => COMMANDS[13],
        Command::ChangeReservation { .. } => COMMANDS[14],
        Command::StepStarted { .. } => COMMANDS[15],
        Command::StepEnded { .. } => COMMANDS[16],
        Command::RestoreUsage { .. } => COMMANDS[17],
        Command::AccountingStored { .. } => COMMANDS[18],
        Command::DrawHistory { .. } => COMMANDS[19],
        Command::SetNodeInventory { .. } => COMMANDS[20],
    });
    match cmd {
        Command::Batch(cmds) => cmds.iter().for_each(|c| variants_named(c, out)),
        Command::UpdateJob { change, .. } => {
            out.insert(match change {
                JobChange::Hold { .. } => JOB_CHANGES[0],
                JobChange::Release => JOB_CHANGES[1],
                JobChange::SetPriority(_) => JOB_CHANGES[2],
                JobChange::SetNice(_) => JOB_CHANGES[3],
                JobChange::Requeue { .. } => JOB_CHANGES[4],
                JobChange::SetTimeLimit(_) => JOB_CHANGES[5],
                JobChange::Suspend => JOB_CHANGES[6],
                JobChange::Resume => JOB_CHANGES[7],
                JobChange::Signal { .. } => JOB_CHANGES[8],
            });
            if let JobChange::Signal { target, .. } = change {
                out.insert(match target {
                    SignalTarget::Steps => SIGNAL_TARGETS[0],
                    SignalTarget::Batch => SIGNAL_TARGETS[1],
                    SignalTarget::Full => SIGNAL_TARGETS[2],
                });
            }
        }
        Command::SetNodeState { change, .. } => {
            out.insert(match change {
                NodeStateChange::Drain => NODE_STATE_CHANGES[0],
                NodeStateChange::Resume => NODE_STATE_CHANGES[1],
                NodeStateChange::Down => NODE_STATE_CHANGES[2],
                NodeStateChange::PowerDown => NODE_STATE_CHANGES[3],
                NodeStateChange::PowerUp => NODE_STATE_CHANGES[4],
            });
        }
        Command::ApplySchedule { preemptions, .. } => {
            for p in preemptions {
                out.insert(match p.mode {
                    PreemptMode::Requeue => PREEMPT_MODES[0],
                    PreemptMode::Cancel => PREEMPT_MODES[1],
                    PreemptMode::Suspend => PREEMPT_MODES[2],
                });
            }
        }
        Command::ChangeReservation { change, .. } => {
            out.insert(match change {
                ReservationChange::Create(_) => RESERVATION_CHANGES[0],
                ReservationChange::Update(_) => RESERVATION_CHANGES[1],
                ReservationChange::Delete { .. } => RESERVATION_CHANGES[2],
            });
            if let ReservationChange::Create(r) | ReservationChange::Update(r) = change {
                out.insert(match r.flags.repeat {
                    Repeat::Once => REPEATS[0],
                    Repeat::Daily => REPEATS[1],
                    Repeat::Weekly => REPEATS[2],
                });
            }
        }
        Command::SubmitJob { spec, .. } => {
            for d in &spec.dependencies {
                out.insert(match d.kind {
                    DependencyKind::After => DEPENDENCY_KINDS[0],
                    DependencyKind::AfterOk => DEPENDENCY_KINDS[1],
                    DependencyKind::AfterNotOk => DEPENDENCY_KINDS[2],
                    DependencyKind::AfterAny => DEPENDENCY_KINDS[3],
                    DependencyKind::AfterCorr => DEPENDENCY_KINDS[4],
                });
            }
        }
        Command::JobFinished { state, .. } => {
            out.insert(job_state_named(*state));
        }
        _ => {}
    }
}

/// The golden file pins every variant: each command and each variant of
/// the enums inside commands appears in `every_command`, and job states
/// an entry never carries (pending, running) in the golden snapshot.
#[test]
fn golden_encodings_cover_every_variant() {
    let mut named = std::collections::BTreeSet::new();
    for cmd in every_command() {
        variants_named(&cmd, &mut named);
    }
    for job in golden_state(gangway_core::format::FORMAT_NEWEST).jobs.values() {
        named.insert(job_state_named(job.state));
    }
    let lists: [&[&str]; 9] = [
        &COMMANDS,
        &JOB_CHANGES,
        &SIGNAL_TARGETS,
        &NODE_STATE_CHANGES,
        &PREEMPT_MODES,
        &RESERVATION_CHANGES,
        &REPEATS,
        &DEPENDENCY_KINDS,
        &JOB_STATES,
    ];
    let missing: Vec<&str> = lists.iter().flat_map(|l| l.iter().copied()).filter(|n| !named.contains(n)).collect();
    assert!(
        missing.is_empty(),
        "variants without a golden encoding (add them to every_command, then bless): {missing:?}"
    );
}

/// A policy with format 9's licenses too.
fn licenses_policy() -> gangway_core::policy::ClusterPolicy {
    let mut p = roles_policy();
    p.licenses = BTreeMap::from([("wandb".into(), 4), ("matlab".into(), 1)]);
    p
}

/// [`licenses_policy`] with format 11's license limits per account and QOS.
fn license_limits_policy() -> gangway_core::policy::ClusterPolicy {
    let mut p = licenses_policy();
    p.account_licenses = BTreeMap::from([("ml".into(), BTreeMap::from([("wandb".into(), 2)]))]);
    p.qos_licenses = BTreeMap::from([("normal".into(), BTreeMap::from([("matlab".into(), 1)]))]);
    p
}

/// A policy with every field of format 6 (roles, user map, job switches) set.
fn roles_policy() -> gangway_core::policy::ClusterPolicy {
    let mut p = preset_policy(3);
    p.admins = vec!["ops".into()];
    p.operators = vec!["oscar".into()];
    p.coordinators = BTreeMap::from([("ml".into(), vec!["carol".into()])]);
    p.user_map = BTreeMap::from([("alice@corp.example".into(), "alice".into())]);
    p.user_domains = vec!["lab.example".into()];
    p.allow_root_jobs = true;
    p.private_jobs = true;
    p
}

/// A small state that uses most of the model: nodes, a policy, running,
/// pending and finished jobs.
fn golden_state(format: u32) -> State {
    let mut s = base_state();
    s.apply(
        50,
        &Command::UpdatePolicy {
            policy: preset_policy(1),
            expected_version: None,
            force: true,
            identity: "server:1".into(),
            now_ms: 4_000,
        },
    );
    s.apply(
        51,
        &Command::CancelJob { job_id: *s.pending.iter().next().unwrap(), identity: "alice".into(), now_ms: 4_001 },
    );
    if format > 4 {
        let applied = s.apply(52, &Command::SetDataFormat { format, now_ms: 4_002 });
        assert!(matches!(applied.outcome, Outcome::DataFormatSet { .. }), "{:?}", applied.outcome);
    }
    if format >= gangway_core::policy::ROLES_FORMAT {
        let update = Command::UpdatePolicy {
            policy: roles_policy(),
            expected_version: None,
            force: true,
            identity: "server:1".into(),
            now_ms: 4_003,
        };
        let applied = s.apply(53, &update);
        assert!(matches!(applied.outcome, Outcome::PolicyUpdated { .. }), "{:?}", applied.outcome);
    }
    if format >= gangway_core::format::SLURM_FEATURES_FORMAT {
        let mut policy = licenses_policy();
        policy.admins.push("server:1".into());
        let update = Command::UpdatePolicy {
            policy,
            expected_version: None,
            force: true,
            identity: "server:1".into(),
            now_ms: 4_004,
        };
        let applied = s.apply(54, &update);
        assert!(matches!(applied.outcome, Outcome::PolicyUpdated { .. }), "{:?}", applied.outcome);
        let mut r = full_reservation();
        r.nodes = vec![s.nodes.keys().next().unwrap().clone()];
        r.partition = String::new();
        r.start_ms = 100_000;
        r.end_ms = 200_000;
        let create = Command::ChangeReservation {
            change: gangway_core::reservation::ReservationChange::Create(r),
            identity: "server:1".into(),
            now_ms: 4_005,
        };
        let applied = s.apply(55, &create);
        assert!(matches!(applied.outcome, Outcome::ReservationChanged { .. }), "{:?}", applied.outcome);
        let mut spec = job_spec(1, 1, 1);
        spec.licenses = BTreeMap::from([("wandb".into(), 1)]);
        spec.time_min_s = 1;
        spec.deadline_ms = 9_000_000;
        let submit =
            Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 4_006 };
        let applied = s.apply(56, &submit);
        assert!(matches!(applied.outcome, Outcome::Submitted { .. }), "{:?}", applied.outcome);
    }
    if format >= gangway_core::format::SUSPEND_FORMAT {
        let job_id = *s.running.iter().next().expect("the golden state runs a job");
        let attempt = s.jobs[&job_id].attempt;
        for (index, name) in [(57, "torchrun"), (58, "python")] {
            let step =
                Command::StepStarted { job_id, attempt, name: name.into(), nodes: vec![], tasks: 1, now_ms: 4_006 };
            let applied = s.apply(index, &step);
            assert!(matches!(applied.outcome, Outcome::StepStarted { .. }), "{:?}", applied.outcome);
        }
        let ended = Command::StepEnded { job_id, attempt, step_id: 0, exit_code: Some(0), signal: None, now_ms: 4_006 };
        assert!(matches!(s.apply(59, &ended).outcome, Outcome::StepEnded { .. }));
        let signal = JobChange::Signal { signal: 10, target: gangway_core::command::SignalTarget::Batch };
        let signal = Command::UpdateJob { job_id, change: signal, identity: "server:1".into(), now_ms: 4_006 };
        assert!(matches!(s.apply(59, &signal).outcome, Outcome::JobUpdated { .. }));
        let suspend =
            Command::UpdateJob { job_id, change: JobChange::Suspend, identity: "server:1".into(), now_ms: 4_007 };
        let applied = s.apply(60, &suspend);
        assert!(matches!(applied.outcome, Outcome::JobUpdated { .. }), "{:?}", applied.outcome);
    }
    if format >= gangway_core::format::HET_JOBS_FORMAT {
        let mut spec = job_spec(1, 1, 1);
        spec.batch = true;
        spec.components = vec![gangway_core::spec::HetComponent::of(&job_spec(1, 2, 1))];
        let submit =
            Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 4_008 };
        let applied = s.apply(61, &submit);
        assert!(matches!(applied.outcome, Outcome::Submitted { .. }), "{:?}", applied.outcome);
    }
    if format >= gangway_core::format::PREEMPT_SUSPEND_FORMAT {
        // A running job suspended for a preemptor that took its GPUs.
        use gangway_core::command::Preemption;
        use gangway_core::policy::{PreemptMode, Qos};
        let victim = s.running.iter().copied().find(|id| !s.jobs[id].is_suspended()).expect("an unsuspended job runs");
        let qos = s.jobs[&victim].spec.qos.clone();
        let mut policy = s.policy.clone();
        policy.qos.insert(qos.clone(), Qos { preempt_mode: PreemptMode::Suspend, ..Qos::default() });
        policy.qos.insert("urgent".into(), Qos { priority: 20, preempt: vec![qos], ..Qos::default() });
        // An elastic pool: its node is in the state, powered down.
        let pool = gangway_core::policy::NodePool { nodes: vec!["pool-0".into()], gpus: 2, ..Default::default() };
        policy.pools.insert("cloud".into(), pool);
        let update = Command::UpdatePolicy {
            policy,
            expected_version: None,
            force: true,
            identity: "server:1".into(),
            now_ms: 4_009,
        };
        let applied = s.apply(62, &update);
        assert!(matches!(applied.outcome, Outcome::PolicyUpdated { .. }), "{:?}", applied.outcome);
        let v = &s.jobs[&victim];
        let mut spec = job_spec(1, v.spec.gpus_per_node, v.spec.cpus_per_task);
        spec.qos = "urgent".into();
        spec.time_limit_s = 60; // ends before the golden reservation starts
        let applied = s.apply(63, &submit_cmd(spec));
        let Outcome::Submitted { job_id: preemptor, .. } = applied.outcome else { panic!("{:?}", applied.outcome) };
        let mut nodes = s.jobs[&victim].allocation.as_ref().unwrap().nodes.clone();
        nodes[0].mem_mb = s.jobs[&preemptor].spec.mem_per_node_mb;
        let schedule = Command::ApplySchedule {
            preemptions: vec![Preemption {
                job_id: victim,
                attempt: s.jobs[&victim].attempt,
                mode: PreemptMode::Suspend,
                for_job: preemptor,
            }],
            placements: vec![Placement { job_id: preemptor, attempt: 1, nodes }],
            now_ms: 4_010,
        };
        let applied = s.apply(64, &schedule);
        assert!(
            matches!(&applied.outcome, Outcome::ScheduleApplied { preempted, started, .. } if *preempted == [victim] && *started == [preemptor]),
            "{:?}",
            applied.outcome
        );
        assert_eq!(s.jobs[&victim].preempted_by, Some(preemptor));
        assert_eq!(s.nodes["pool-0"].state, gangway_core::NodeState::PoweredDown);
    }
    if format >= gangway_core::format::ACCOUNTING_FORMAT {
        // A policy keeping fewer finished jobs, a task's measured use, and
        // fair share's usage restored from the accounting store.
        let mut policy = s.policy.clone();
        policy.finished_jobs_kept = Some(50_000);
        let update = Command::UpdatePolicy {
            policy,
            expected_version: None,
            force: true,
            identity: "server:1".into(),
            now_ms: 4_011,
        };
        assert!(matches!(s.apply(65, &update).outcome, Outcome::PolicyUpdated { .. }));
        let (job_id, node) = s
            .running
            .iter()
            .find_map(|id| {
                let j = &s.jobs[id];
                (!j.is_suspended()).then(|| (*id, j.allocation.as_ref().unwrap().nodes[0].node.clone()))
            })
            .expect("a running job");
        let exited = task_exit_with_usage(job_id, s.jobs[&job_id].attempt, &node, 4_012);
        assert!(matches!(s.apply(66, &exited).outcome, Outcome::TaskRecorded { .. }));
        assert_eq!(s.jobs[&job_id].task_usage.len(), 1);
        let restore = restore_usage_cmd(4_013);
        assert!(matches!(s.apply(67, &restore).outcome, Outcome::UsageRestored { accounts: 1 }));
        let stored = Command::AccountingStored { index: 66, identity: "server:1".into(), now_ms: 4_014 };
        assert!(matches!(s.apply(68, &stored).outcome, Outcome::AccountingStored { index: 66 }));
    }
    if format >= gangway_core::format::HISTORY_FORMAT {
        // A restored cluster's (`backup::restored_history`).
        (s.history, s.history_since) = (0x9e37_79b9_7f4a_7c15, 40);
    }
    if format >= gangway_core::format::NODE_ADMISSION_FORMAT {
        let set = Command::SetNodeInventory {
            inventory: full_inventory(),
            expected_version: Some(0),
            identity: "server:1".into(),
            now_ms: 4_015,
        };
        let applied = s.apply(69, &set);
        assert!(matches!(applied.outcome, Outcome::NodeInventorySet { version: 1, .. }), "{:?}", applied.outcome);
    }
    s
}

/// An inventory with every field set, admitting the golden state's nodes.
fn full_inventory() -> gangway_core::inventory::NodeInventory {
    use gangway_core::inventory::{NodeClass, NodeInventory};
    let class = NodeClass {
        nodes: vec!["n[0-9]".into(), "pool-*".into()],
        cpus: 64,
        mem_mb: 1 << 20,
        gpus: 8,
        gpu_model: "h100-80gb".into(),
        labels: BTreeMap::from([("ib".into(), "*".into()), ("secure".into(), "yes".into())]),
        topology: vec!["zone-a".into()],
    };
    NodeInventory { version: 0, classes: BTreeMap::from([("h100".into(), class)]), retired: ["n99".to_string()].into() }
}

/// A task's exit with its measured use (format 13).
fn task_exit_with_usage(job_id: u64, attempt: u32, node: &str, now_ms: u64) -> Command {
    Command::TaskExited {
        job_id,
        attempt,
        node: node.into(),
        exit_code: Some(0),
        signal: None,
        reason: String::new(),
        lost: false,
        peak_mem_mb: Some(700),
        usage: Some(gangway_core::model::TaskUsage {
            cpu_ms: 123_456,
            mem_peak_mb: 700,
            gpu_samples: 4,
            gpu_util_pct_sum: 310,
            gpu_mem_peak_mb: 40_000,
        }),
        now_ms,
    }
}

/// Fair share's usage as `gangway accounting rebuild-fairshare` restores it.
fn restore_usage_cmd(now_ms: u64) -> Command {
    use gangway_core::state::UsageBucket;
    let buckets = vec![
        UsageBucket { start_ms: 1_000, gpu_ms: 3_600_000, cpu_ms: 7_200_000 },
        UsageBucket { start_ms: 2_000, gpu_ms: 0, cpu_ms: 60_000 },
    ];
    Command::RestoreUsage { usage: BTreeMap::from([("ml".into(), buckets)]), identity: "server:1".into(), now_ms }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every replicated encoding, by name: each command variant as a log entry in
/// every format that can carry it, the job spec, and the snapshot in each
/// format. The golden file pins these bytes: bincode is positional, so a field
/// added, moved or retyped anywhere below changes them. When that is meant,
/// bump `format::FORMAT_NEWEST`, freeze the old types in `compat/`, and bless
/// the new bytes with `GANGWAY_BLESS=1 cargo test -p gangway-core --test core golden`.
#[test]
fn golden_encodings_pin_every_replicated_format() {
    use gangway_core::format::{to_bytes, FORMAT_NEWEST, FORMAT_OLDEST};
    use gangway_core::payload::Payload;
    let mut got = Vec::new();
    got.push(format!("jobspec {}", hex(&to_bytes(&full_spec()))));
    for cmd in every_command() {
        for format in FORMAT_OLDEST..=FORMAT_NEWEST {
            if cmd.since_format() > format {
                continue;
            }
            let payload = Payload::new(cmd.clone(), format);
            let bytes = to_bytes(&payload);
            // Every entry decodes back to itself.
            assert_eq!(gangway_core::format::from_bytes::<Payload>(&bytes).unwrap(), payload, "{}", cmd.name());
            got.push(format!("entry-v{format} {} {}", cmd.name(), hex(&bytes)));
        }
    }
    for format in FORMAT_OLDEST..=FORMAT_NEWEST {
        let state = golden_state(format);
        let bytes = snapshot::encode(&state);
        assert_eq!(snapshot::decode(&bytes).unwrap(), state, "snapshot v{format}");
        got.push(format!("snapshot-v{format} {}", hex(&bytes)));
    }
    // Format 18's snapshot trailer: every stop cause.
    use gangway_core::StopCause;
    let causes = [
        ("preempted", StopCause::Preempted { by: 42 }),
        ("node-failed", StopCause::NodeFailed { node: "gpu01".into() }),
        ("gpu-failed", StopCause::GpuFailed { node: "gpu01".into(), gpu: 3 }),
        ("time-limit", StopCause::TimeLimit),
        ("cancelled-by", StopCause::CancelledBy { identity: "alice".into() }),
        ("requeued-by", StopCause::RequeuedBy { identity: "admin:ops".into() }),
    ];
    for (name, cause) in causes {
        // Matched so that a new cause is added here too.
        match cause {
            StopCause::Preempted { .. }
            | StopCause::NodeFailed { .. }
            | StopCause::GpuFailed { .. }
            | StopCause::TimeLimit
            | StopCause::CancelledBy { .. }
            | StopCause::RequeuedBy { .. } => {}
        }
        got.push(format!("stop-cause {name} {}", hex(&to_bytes(&cause))));
    }
    let path = manifest_dir().join("tests/golden/encodings.txt");
    let got = got.join("\n") + "\n";
    if std::env::var_os("GANGWAY_BLESS").is_some() {
        std::fs::write(&path, &got).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    for (g, w) in got.lines().zip(want.lines()) {
        let name = |l: &str| l.rsplit_once(' ').map_or(String::new(), |(n, _)| n.to_string());
        assert_eq!(name(g), name(w), "the golden file lists other encodings: re-bless it (see above)");
        assert!(
            g == w,
            "the encoding of `{}` changed. bincode is positional: bump format::FORMAT_NEWEST, freeze the \
             old types in compat/, then re-bless (GANGWAY_BLESS=1)",
            name(g)
        );
    }
    assert_eq!(got.lines().count(), want.lines().count(), "the golden file lists other encodings: re-bless it");
}

/// Numbers at and around every integer bound, plus small ones.
fn extreme_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(i64::MAX as u64),
        Just(u64::from(u32::MAX)),
        Just(u64::from(u32::MAX) + 1),
        0u64..8,
        any::<u64>(),
    ]
}

fn extreme_u32() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0u32), Just(1), Just(u32::MAX), Just(u32::MAX - 1), Just(i32::MAX as u32), 0u32..20, any::<u32>()]
}

fn extreme_i32() -> impl Strategy<Value = i32> {
    prop_oneof![Just(i32::MIN), Just(-1), Just(0), Just(127), Just(255), Just(256), Just(i32::MAX), any::<i32>()]
}

/// Empty, ordinary, hostile and huge strings, and names that exist in the base state.
fn extreme_string() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("n0".to_string()),
        Just("alice".to_string()),
        Just("root".to_string()),
        Just("../../etc/passwd".to_string()),
        Just("a\0b".to_string()),
        Just("ünï-çødé ✓".to_string()),
        Just("0-4294967295%4294967295".to_string()),
        Just("n[0-18446744073709551615]".to_string()),
        Just("x".repeat(70_000)),
        "[a-z0-9_:,%-]{0,12}",
    ]
}

fn extreme_spec() -> impl Strategy<Value = JobSpec> {
    (
        (extreme_u32(), extreme_u32(), extreme_u32(), extreme_u64(), extreme_u32(), extreme_u64()),
        (extreme_string(), extreme_string(), extreme_string(), extreme_string()),
        (extreme_i32(), extreme_u64(), extreme_u32(), any::<u8>(), extreme_u32(), extreme_u64()),
        (proptest::collection::vec(extreme_string(), 0..3), proptest::collection::vec((extreme_u64(), 0u8..4), 0..3)),
        (any::<bool>(), any::<bool>(), any::<bool>(), extreme_u64()),
    )
        .prop_map(
            |(
                (n, tpn, cpt, mem, gpn, tl),
                (user, array, account, name),
                (nice, begin, nmax, sig, warn, mpc),
                (list, deps),
                (b1, b2, b3, wait),
            )| {
                JobSpec {
                    name,
                    user,
                    command: vec!["true".into()],
                    nodes: n,
                    tasks_per_node: tpn,
                    cpus_per_task: cpt,
                    mem_per_node_mb: mem,
                    gpus_per_node: gpn,
                    time_limit_s: tl,
                    array,
                    account,
                    nice,
                    begin_ms: begin,
                    nodes_max: nmax,
                    warn_signal: sig,
                    warn_before_s: warn,
                    mem_per_cpu_mb: mpc,
                    nodelist: list.clone(),
                    exclude: list.clone(),
                    constraints: list,
                    dependencies: deps
                        .into_iter()
                        .map(|(job_id, k)| Dependency {
                            kind: [
                                DependencyKind::After,
                                DependencyKind::AfterOk,
                                DependencyKind::AfterAny,
                                DependencyKind::AfterNotOk,
                            ][usize::from(k)],
                            job_id,
                            array_index: None,
                        })
                        .collect(),
                    exclusive: b1,
                    hold: b2,
                    batch: b3,
                    topology: TopologyConstraint { level: "rack".into(), required: b1, wait_s: wait },
                    ..JobSpec::default()
                }
            },
        )
}

fn extreme_allocation() -> impl Strategy<Value = NodeAllocation> {
    (extreme_string(), extreme_u32(), extreme_u64(), proptest::collection::vec(extreme_u32(), 0..4))
        .prop_map(|(node, cpus, mem_mb, gpus)| NodeAllocation { node, cpus, mem_mb, gpus })
}

fn extreme_placement() -> impl Strategy<Value = Placement> {
    (extreme_u64(), extreme_u32(), proptest::collection::vec(extreme_allocation(), 0..3))
        .prop_map(|(job_id, attempt, nodes)| Placement { job_id, attempt, nodes })
}

fn extreme_command() -> impl Strategy<Value = Command> {
    use gangway_core::command::Preemption;
    use gangway_core::policy::PreemptMode;
    let state = prop_oneof![
        Just(JobState::Pending),
        Just(JobState::Running),
        Just(JobState::Completed),
        Just(JobState::Failed),
        Just(JobState::Cancelled),
        Just(JobState::TimedOut),
        Just(JobState::NodeFail)
    ];
    let change = prop_oneof![
        any::<bool>().prop_map(|admin| JobChange::Hold { admin }),
        Just(JobChange::Release),
        proptest::option::of(extreme_u32()).prop_map(JobChange::SetPriority),
        extreme_i32().prop_map(JobChange::SetNice),
        any::<bool>().prop_map(|hold| JobChange::Requeue { hold }),
        extreme_u64().prop_map(JobChange::SetTimeLimit),
        Just(JobChange::Suspend),
        Just(JobChange::Resume),
        extreme_i32()
            .prop_map(|signal| JobChange::Signal { signal, target: gangway_core::command::SignalTarget::Full }),
    ];
    let node_change =
        prop_oneof![Just(NodeStateChange::Drain), Just(NodeStateChange::Resume), Just(NodeStateChange::Down)];
    let single = prop_oneof![
        (extreme_spec(), extreme_string(), extreme_string(), extreme_u64()).prop_map(
            |(spec, identity, idempotency_key, now_ms)| Command::SubmitJob { spec, identity, idempotency_key, now_ms }
        ),
        (extreme_u64(), extreme_string(), extreme_u64()).prop_map(|(job_id, identity, now_ms)| Command::CancelJob {
            job_id,
            identity,
            now_ms
        }),
        (extreme_string(), extreme_u32(), extreme_u64(), 0usize..24, extreme_u32(), extreme_u64()).prop_map(
            |(name, cpus, mem_mb, gpus, island, now_ms)| {
                let gpus = (0..gpus)
                    .map(|g| GpuSpec { uuid: format!("G{g}"), model: "h100".into(), mem_mb, nvlink_island: island })
                    .collect();
                Command::RegisterNode {
                    spec: NodeSpec {
                        name,
                        addr: String::new(),
                        cpus,
                        mem_mb,
                        gpus,
                        topology: vec!["z".into()],
                        labels: BTreeMap::new(),
                    },
                    now_ms,
                }
            }
        ),
        (extreme_string(), node_change, extreme_string(), extreme_u64())
            .prop_map(|(name, change, reason, now_ms)| Command::SetNodeState { name, change, reason, now_ms }),
        (proptest::collection::vec(extreme_placement(), 0..3), extreme_u64())
            .prop_map(|(placements, now_ms)| Command::ApplyPlan { placements, now_ms }),
        (extreme_u64(), extreme_u32(), state, proptest::option::of(extreme_i32()), extreme_string(), extreme_u64())
            .prop_map(|(job_id, attempt, state, exit_code, reason, now_ms)| Command::JobFinished {
                job_id,
                attempt,
                state,
                exit_code,
                reason,
                now_ms
            }),
        (
            extreme_u64(),
            extreme_u32(),
            extreme_string(),
            proptest::option::of(extreme_i32()),
            proptest::option::of(extreme_i32()),
            any::<bool>(),
            proptest::option::of(extreme_u64()),
            proptest::option::of((extreme_u64(), extreme_u32(), extreme_u64())),
            extreme_u64()
        )
            .prop_map(|(job_id, attempt, node, exit_code, signal, lost, peak_mem_mb, usage, now_ms)| {
                Command::TaskExited {
                    job_id,
                    attempt,
                    node,
                    exit_code,
                    signal,
                    reason: String::new(),
                    lost,
                    peak_mem_mb,
                    usage: usage.map(|(n, samples, util)| gangway_core::model::TaskUsage {
                        cpu_ms: n,
                        mem_peak_mb: n,
                        gpu_samples: samples,
                        gpu_util_pct_sum: util,
                        gpu_mem_peak_mb: n,
                    }),
                    now_ms,
                }
            }),
        (extreme_string(), extreme_u32(), any::<bool>(), extreme_u64()).prop_map(|(node, gpu, healthy, now_ms)| {
            Command::SetGpuHealth { node, gpu, healthy, reason: "x".into(), now_ms }
        }),
        (any::<u8>(), proptest::option::of(extreme_u64()), any::<bool>(), extreme_u64()).prop_map(
            |(i, expected_version, force, now_ms)| Command::UpdatePolicy {
                policy: preset_policy(i),
                expected_version,
                force,
                identity: "server:1".into(),
                now_ms
            }
        ),
        (extreme_u64(), change, extreme_string(), extreme_u64())
            .prop_map(|(job_id, change, identity, now_ms)| Command::UpdateJob { job_id, change, identity, now_ms }),
        (
            extreme_u64(),
            extreme_u32(),
            extreme_string(),
            proptest::collection::vec(extreme_string(), 0..3),
            extreme_u32(),
            extreme_u64()
        )
            .prop_map(|(job_id, attempt, name, nodes, tasks, now_ms)| Command::StepStarted {
                job_id,
                attempt,
                name,
                nodes,
                tasks,
                now_ms
            }),
        (
            extreme_u64(),
            extreme_u32(),
            extreme_u32(),
            proptest::option::of(extreme_i32()),
            proptest::option::of(extreme_i32()),
            extreme_u64()
        )
            .prop_map(|(job_id, attempt, step_id, exit_code, signal, now_ms)| Command::StepEnded {
                job_id,
                attempt,
                step_id,
                exit_code,
                signal,
                now_ms
            }),
        (
            proptest::collection::vec((extreme_u64(), extreme_u32(), any::<bool>(), extreme_u64()), 0..3),
            proptest::collection::vec(extreme_placement(), 0..3),
            extreme_u64()
        )
            .prop_map(|(victims, placements, now_ms)| Command::ApplySchedule {
                preemptions: victims
                    .into_iter()
                    .map(|(job_id, attempt, cancel, for_job)| Preemption {
                        job_id,
                        attempt,
                        mode: if cancel { PreemptMode::Cancel } else { PreemptMode::Requeue },
                        for_job
                    })
                    .collect(),
                placements,
                now_ms,
            }),
        (extreme_u64(), extreme_u32(), extreme_u64()).prop_map(|(job_id, attempt, now_ms)| Command::JobCheckpointed {
            job_id,
            attempt,
            now_ms
        }),
        (
            proptest::collection::btree_map(
                extreme_string(),
                proptest::collection::vec((extreme_u64(), extreme_u64(), extreme_u64()), 0..4),
                0..3
            ),
            any::<bool>(),
            extreme_u64()
        )
            .prop_map(|(usage, admin, now_ms)| Command::RestoreUsage {
                usage: usage
                    .into_iter()
                    .map(|(a, b)| {
                        let b = b.into_iter().map(|(start_ms, gpu_ms, cpu_ms)| gangway_core::state::UsageBucket {
                            start_ms,
                            gpu_ms,
                            cpu_ms,
                        });
                        (a, b.collect())
                    })
                    .collect(),
                identity: if admin { "server:1".into() } else { "alice".into() },
                now_ms
            }),
        (extreme_u64(), any::<bool>(), extreme_u64()).prop_map(|(index, admin, now_ms)| Command::AccountingStored {
            index,
            identity: if admin { "server:1".into() } else { "alice".into() },
            now_ms
        }),
        (extreme_u64(), extreme_u64()).prop_map(|(history, now_ms)| Command::DrawHistory { history, now_ms }),
    ];
    single.prop_recursive(1, 8, 4, |inner| proptest::collection::vec(inner, 0..4).prop_map(Command::Batch))
}

/// A small live cluster: three nodes, running and pending jobs, an array.
fn base_state() -> State {
    let mut s = State::default();
    let mut i = 0;
    let mut apply = |s: &mut State, cmd: Command| {
        i += 1;
        s.apply(i, &cmd)
    };
    for n in 0..3 {
        apply(&mut s, Command::RegisterNode { spec: node_spec(n, 4), now_ms: 1_000 });
    }
    for k in 0..4 {
        let mut spec = job_spec(1, 2, 2);
        if k == 3 {
            spec.array = "0-3".into();
        }
        apply(
            &mut s,
            Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 2_000 },
        );
    }
    let opts = gangway_core::sched::Options {
        policy: gangway_core::sched::Policy::Easy,
        order: gangway_core::sched::Order::Priority,
        now_ms: 3_000,
        estimate_s: None,
        stopping: None,
    };
    let plan = gangway_core::sched::plan(&s, &opts);
    apply(&mut s, Command::ApplySchedule { preemptions: vec![], placements: plan.placements, now_ms: 3_000 });
    assert!(!s.running.is_empty() && !s.pending.is_empty(), "the base state has running and pending jobs");
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    /// Apply is total: commands with extreme values (integer bounds, empty,
    /// hostile and huge strings, every enum, nonsense placements) are applied or
    /// refused, never panic, keep every invariant, and a refusal changes nothing.
    /// Extremes of TaskExited's signal were a poison pill: `128 + signal`
    /// overflowed on every replica, at every replay.
    #[test]
    fn extreme_commands_are_refused_or_applied_never_panic(
        cmds in proptest::collection::vec(extreme_command(), 1..6),
        format in gangway_core::format::FORMAT_BASE..=gangway_core::format::FORMAT_NEWEST,
    ) {
        let mut s = base_state();
        // Every format's rules of apply: each must be total.
        if format > gangway_core::format::FORMAT_BASE {
            s.apply(99, &Command::SetDataFormat { format, now_ms: 1 });
        }
        for (k, cmd) in cmds.iter().enumerate() {
            let before = s.clone();
            let applied = s.apply(100 + k as u64, cmd);
            if let Outcome::Refused(_) = applied.outcome {
                let mut b = before;
                b.clock_ms = s.clock_ms;
                b.idempotency = s.idempotency.clone();
                b.idempotency_expiry = s.idempotency_expiry.clone();
                b.rebuild_derived();
                prop_assert_eq!(&b, &s, "a refused {} changed state", cmd.name());
            }
            if let Err(e) = s.check_invariants() {
                return Err(TestCaseError::fail(format!("after {}: {e}", cmd.name())));
            }
            // The scheduler plans over whatever the commands left.
            let opts = gangway_core::sched::Options {
                policy: gangway_core::sched::Policy::Easy,
                order: gangway_core::sched::Order::Priority,
                now_ms: s.clock_ms,
                estimate_s: None,
                stopping: None,
            };
            let _ = gangway_core::sched::plan(&s, &opts);
        }
        prop_assert_eq!(snapshot::decode(&snapshot::encode(&s)).unwrap(), s);
    }
}

/// The poison pill, exactly: a task reports the largest signal.
#[test]
fn a_task_reporting_the_largest_signal_fails_its_job_without_a_panic() {
    let mut s = base_state();
    let id = *s.running.iter().next().unwrap();
    let job = &s.jobs[&id];
    let node = job.allocation.as_ref().unwrap().nodes[0].node.clone();
    let cmd = Command::TaskExited {
        job_id: id,
        attempt: job.attempt,
        node,
        exit_code: None,
        signal: Some(i32::MAX),
        reason: String::new(),
        lost: false,
        peak_mem_mb: None,
        usage: None,
        now_ms: 5_000,
    };
    s.apply(1_000, &cmd);
    assert_eq!(s.jobs[&id].state, JobState::Failed);
    assert_eq!(s.jobs[&id].exit_code, Some(i32::MAX));
    s.check_invariants().unwrap();
}

/// Format 13: a task's measured use is kept with its job (and summed per
/// job), impossible figures are not, and a format-12 cluster keeps none.
#[test]
fn task_usage_is_kept_from_format_13_and_summed_per_job() {
    for format in [12, 13] {
        let mut s = base_state();
        s.apply(99, &Command::SetDataFormat { format, now_ms: 4_000 });
        let id = *s.running.iter().next().unwrap();
        let node = s.jobs[&id].allocation.as_ref().unwrap().nodes[0].node.clone();
        let exited = task_exit_with_usage(id, s.jobs[&id].attempt, &node, 5_000);
        assert!(matches!(s.apply(100, &exited).outcome, Outcome::TaskRecorded { .. }));
        let usage = s.jobs[&id].usage();
        if format < 13 {
            assert_eq!(usage, None, "format 12 carries no usage");
            continue;
        }
        let u = usage.expect("kept");
        assert_eq!((u.nodes, u.cpu_ms, u.mem_peak_mb, u.gpu_mem_peak_mb), (1, 123_456, 700, 40_000));
        assert_eq!(u.gpu_util_pct, Some(77.5), "310% over 4 readings");
        // Another job's report with more than 100% a reading is not kept.
        let other = *s.running.iter().next().unwrap();
        let node = s.jobs[&other].allocation.as_ref().unwrap().nodes[0].node.clone();
        let mut bad = task_exit_with_usage(other, s.jobs[&other].attempt, &node, 5_001);
        if let Command::TaskExited { usage: Some(u), .. } = &mut bad {
            u.gpu_util_pct_sum = 401;
        }
        s.apply(101, &bad);
        assert_eq!(s.jobs[&other].usage(), None);
        s.check_invariants().unwrap();
    }
}

/// Format 13: a task that reports after its job ended (cancelled, out of
/// time) still has its use kept, once per node, with a `usage` event.
#[test]
fn a_cancelled_jobs_task_usage_arrives_late_and_is_kept_once() {
    let mut s = base_state();
    s.apply(99, &Command::SetDataFormat { format: 13, now_ms: 4_000 });
    let id = *s.running.iter().next().unwrap();
    let (attempt, node) = (s.jobs[&id].attempt, s.jobs[&id].allocation.as_ref().unwrap().nodes[0].node.clone());
    s.apply(100, &Command::CancelJob { job_id: id, identity: "alice".into(), now_ms: 4_001 });
    assert_eq!(s.jobs[&id].state, JobState::Cancelled);
    let applied = s.apply(101, &task_exit_with_usage(id, attempt, &node, 4_002));
    assert!(matches!(applied.outcome, Outcome::TaskRecorded { .. }), "{:?}", applied.outcome);
    assert!(applied.events.len() == 1 && applied.events[0].usage && applied.events[0].state == JobState::Cancelled);
    assert_eq!(s.jobs[&id].usage().map(|u| u.cpu_ms), Some(123_456));
    assert_eq!(s.jobs[&id].state, JobState::Cancelled, "the state stays");
    // Once: a second report, or one from a node it did not run on, is stale.
    let again = s.apply(102, &task_exit_with_usage(id, attempt, &node, 4_003));
    assert!(matches!(again.outcome, Outcome::Refused(_)) && again.events.is_empty());
    let elsewhere = s.apply(103, &task_exit_with_usage(id, attempt, "nowhere", 4_004));
    assert!(matches!(elsewhere.outcome, Outcome::Refused(_)));
    s.check_invariants().unwrap();
}

/// Format 13's `finished_jobs_kept`: the state drops the oldest finished
/// jobs past it, and the policy refuses 0 or more than the hard limit.
#[test]
fn the_policy_bounds_the_finished_jobs_kept() {
    let mut s = base_state();
    s.apply(99, &Command::SetDataFormat { format: 13, now_ms: 4_000 });
    let mut policy = s.policy.clone();
    policy.admins.push("server:1".into());
    for bad in [0, gangway_core::limits::FINISHED_JOBS_RETAINED_MAX as u32 + 1] {
        policy.finished_jobs_kept = Some(bad);
        assert!(policy.validate().unwrap_err().to_string().contains("finished_jobs_kept"));
    }
    policy.finished_jobs_kept = Some(2);
    let update = Command::UpdatePolicy {
        policy,
        expected_version: None,
        force: true,
        identity: "server:1".into(),
        now_ms: 4_001,
    };
    assert!(matches!(s.apply(100, &update).outcome, Outcome::PolicyUpdated { .. }), "policy");
    let mut ids = Vec::new();
    for k in 0..5 {
        let Outcome::Submitted { job_id, .. } = s.apply(101 + k, &submit_cmd(job_spec(1, 0, 1))).outcome else {
            panic!("submit")
        };
        let cancel = Command::CancelJob { job_id, identity: "alice".into(), now_ms: 4_002 };
        s.apply(200 + k, &cancel);
        ids.push(job_id);
    }
    assert!(s.finished.len() <= 2, "{} kept", s.finished.len());
    assert!(!s.jobs.contains_key(&ids[0]) && s.jobs.contains_key(&ids[4]), "the oldest went first");
    s.check_invariants().unwrap();
}

/// Format 13: once the accounting store says where it is, finished jobs
/// it does not have yet stay past `finished_jobs_kept` (never past the
/// hard limit), and go when it catches up.
#[test]
fn finished_jobs_wait_for_the_accounting_store() {
    let mut s = accounting_state(13, Some(2));
    let stored = accounting_stored;
    // Not an operator, or an index not before the entry: refused.
    let mut by_alice = stored(100);
    if let Command::AccountingStored { identity, .. } = &mut by_alice {
        *identity = "alice".into();
    }
    assert!(matches!(s.apply(101, &by_alice).outcome, Outcome::Refused(_)));
    assert!(matches!(s.apply(101, &stored(101)).outcome, Outcome::Refused(_)));
    assert!(matches!(s.apply(101, &stored(100)).outcome, Outcome::AccountingStored { index: 100 }));
    let mut ids = Vec::new();
    for k in 0..6u64 {
        let Outcome::Submitted { job_id, .. } = s.apply(200 + 2 * k, &submit_cmd(job_spec(1, 0, 1))).outcome else {
            panic!("submit")
        };
        s.apply(201 + 2 * k, &Command::CancelJob { job_id, identity: "alice".into(), now_ms: 4_003 });
        ids.push(job_id);
    }
    // The store has none of them: every one is kept.
    assert!(ids.iter().all(|id| s.jobs.contains_key(id)), "kept until stored");
    // It has the first three (cancelled at 201, 203, 205): they may go.
    assert!(matches!(s.apply(300, &stored(205)).outcome, Outcome::AccountingStored { index: 205 }));
    assert!(ids[..3].iter().all(|id| !s.jobs.contains_key(id)) && ids[3..].iter().all(|id| s.jobs.contains_key(id)));
    // Never backwards.
    assert!(matches!(s.apply(301, &stored(10)).outcome, Outcome::AccountingStored { index: 205 }));
    assert!(matches!(s.apply(302, &stored(301)).outcome, Outcome::AccountingStored { index: 301 }));
    assert!(s.finished.len() <= 2, "down to the policy's {}", s.finished.len());
    s.check_invariants().unwrap();
}

/// The base state in `format`, with `server:1` an admin (the accounting
/// service's reports) and `finished_jobs_kept` set, through entry 100.
fn accounting_state(format: u32, finished_jobs_kept: Option<u32>) -> State {
    let mut s = base_state();
    s.apply(99, &Command::SetDataFormat { format, now_ms: 4_000 });
    let mut policy = s.policy.clone();
    policy.admins.push("server:1".into());
    policy.finished_jobs_kept = finished_jobs_kept;
    let update = Command::UpdatePolicy {
        policy,
        expected_version: None,
        force: true,
        identity: "server:1".into(),
        now_ms: 4_001,
    };
    assert!(matches!(s.apply(100, &update).outcome, Outcome::PolicyUpdated { .. }));
    s
}

/// The accounting service's report: every job through `index` is stored.
fn accounting_stored(index: u64) -> Command {
    Command::AccountingStored { index, identity: "server:1".into(), now_ms: 4_002 }
}

/// Past the hard limits, finished jobs the accounting store has not stored:
/// from format 15 they stay, and at the limit new jobs are refused (naming
/// the way out) until the store catches up; format 14 dropped the oldest.
/// Format 16: the history a restore derived from its backup is drawn anew
/// once, by a leader, and never again; nothing else changes with it.
#[test]
fn a_restored_clusters_history_is_drawn_once() {
    use gangway_core::format::FRESH_HISTORY_FORMAT;
    let draw = |history| Command::DrawHistory { history, now_ms: 5 };
    let refused = |s: &mut State, history, kind| match s.apply(9, &draw(history)).outcome {
        Outcome::Refused(r) => assert_eq!(r.kind, kind, "{}", r.message),
        other => panic!("drawing {history} was not refused: {other:?}"),
    };
    let mut s = State::default();
    (s.format, s.history, s.history_since) = (FRESH_HISTORY_FORMAT - 1, 77, 40);
    refused(&mut s, 99, RefusalKind::FailedPrecondition);
    s.format = FRESH_HISTORY_FORMAT;
    refused(&mut s, 99, RefusalKind::Stale);
    s.history_pending = true;
    s.check_invariants().unwrap();
    let before = snapshot::encode(&s);
    refused(&mut s, 0, RefusalKind::InvalidArgument);
    refused(&mut s, 77, RefusalKind::InvalidArgument);
    assert_eq!(snapshot::encode(&s), before, "a refused draw changes nothing");
    assert!(matches!(s.apply(10, &draw(99)).outcome, Outcome::HistoryDrawn { history: 99 }));
    assert_eq!((s.history, s.history_since, s.history_pending), (99, 40, false));
    s.check_invariants().unwrap();
    refused(&mut s, 100, RefusalKind::Stale);
    assert_eq!(s.history, 99);
}

#[test]
fn at_the_hard_limit_unstored_jobs_stay_and_new_jobs_wait_for_the_store() {
    use gangway_core::limits::FINISHED_JOBS_RETAINED_MAX;
    for format in [14, 15] {
        let mut s = accounting_state(format, None);
        let stored = accounting_stored;
        assert!(matches!(s.apply(101, &stored(100)).outcome, Outcome::AccountingStored { index: 100 }));
        let mut index = 200;
        let finish_one = |s: &mut State, index: &mut u64| -> Outcome {
            let outcome = s.apply(*index, &submit_cmd(job_spec(1, 0, 1))).outcome;
            if let Outcome::Submitted { job_id, .. } = outcome {
                s.apply(*index + 1, &Command::CancelJob { job_id, identity: "alice".into(), now_ms: 4_003 });
            }
            *index += 2;
            outcome
        };
        let Outcome::Submitted { job_id: first, .. } = finish_one(&mut s, &mut index) else { panic!("submit") };
        for _ in 1..FINISHED_JOBS_RETAINED_MAX {
            assert!(matches!(finish_one(&mut s, &mut index), Outcome::Submitted { .. }), "below the limit");
        }
        assert_eq!(s.finished.len(), FINISHED_JOBS_RETAINED_MAX, "format {format}: every unstored job kept");
        // One past the limit.
        let past = finish_one(&mut s, &mut index);
        if format == 14 {
            assert!(matches!(past, Outcome::Submitted { .. }), "{past:?}");
            assert!(!s.jobs.contains_key(&first), "format 14 drops the oldest though the store lacks it");
            continue;
        }
        let Outcome::Refused(r) = past else { panic!("format 15 refuses at the limit: {past:?}") };
        assert_eq!(r.kind, gangway_core::state::RefusalKind::ResourceExhausted);
        assert!(r.message.contains("release-unstored") && r.message.contains("log index 100"), "{}", r.message);
        assert!(s.jobs.contains_key(&first), "never dropped while unstored");
        assert_eq!(s.finished.len(), FINISHED_JOBS_RETAINED_MAX);
        // The store catches up: new jobs are taken, and the stored go as they finish.
        let caught_up = s.apply(index, &stored(index - 1)).outcome;
        assert!(matches!(caught_up, Outcome::AccountingStored { .. }), "{caught_up:?}");
        index += 1;
        assert!(matches!(finish_one(&mut s, &mut index), Outcome::Submitted { .. }));
        assert!(!s.jobs.contains_key(&first), "a stored job makes room");
        assert_eq!(s.finished.len(), FINISHED_JOBS_RETAINED_MAX);
        s.check_invariants().unwrap();
    }
}

/// `RestoreUsage`: admins only, ordered buckets, none after the clock; it
/// replaces fair share's usage whole, and `usage_from_runs` rebuilds the
/// buckets `charge_usage` made from the same runs.
#[test]
fn fair_share_usage_is_restored_by_admins_from_the_runs_it_was_charged_for() {
    use gangway_core::state::{usage_from_runs, ChargedRun, UsageBucket};
    let mut s = base_state();
    s.apply(99, &Command::SetDataFormat { format: 13, now_ms: 4_000 });
    let mut policy = s.policy.clone();
    policy.admins.push("server:1".into());
    s.apply(
        100,
        &Command::UpdatePolicy {
            policy,
            expected_version: None,
            force: true,
            identity: "server:1".into(),
            now_ms: 4_000,
        },
    );
    // Charge the running jobs by cancelling them at known times.
    let running: Vec<JobId> = s.running.iter().copied().collect();
    let mut runs = Vec::new();
    for (k, id) in running.iter().enumerate() {
        let now_ms = 10_000 + 1_000 * k as u64;
        let job = s.jobs[id].clone();
        let ran_ms = now_ms - job.start_time_ms.unwrap();
        let u = gangway_core::state::alloc_use(job.allocation.as_ref().unwrap());
        runs.push(ChargedRun {
            account: job.spec.account.clone(),
            end_ms: now_ms,
            gpu_ms: u.gpus * ran_ms,
            cpu_ms: u.cpus * ran_ms,
        });
        s.apply(300 + k as u64, &Command::CancelJob { job_id: *id, identity: "alice".into(), now_ms });
    }
    let charged: BTreeMap<String, Vec<UsageBucket>> =
        s.usage.iter().map(|(a, b)| (a.clone(), b.iter().copied().collect())).collect();
    assert!(!charged.is_empty());
    let rebuilt = usage_from_runs(runs, s.policy.fairshare_half_life_s);
    assert_eq!(rebuilt, charged, "rebuilt from the runs as apply charged them");
    // Refusals change nothing.
    let before = s.usage.clone();
    let restore = |usage: BTreeMap<String, Vec<UsageBucket>>, who: &str| Command::RestoreUsage {
        usage,
        identity: who.into(),
        now_ms: 20_000,
    };
    let b = |start_ms| UsageBucket { start_ms, gpu_ms: 1, cpu_ms: 1 };
    for (usage, who) in [
        (BTreeMap::from([("ml".to_string(), vec![b(1)])]), "alice"),
        (BTreeMap::from([("ml".to_string(), vec![b(2), b(1)])]), "server:1"),
        (BTreeMap::from([("ml".to_string(), vec![b(u64::MAX)])]), "server:1"),
        (BTreeMap::from([("bad name!".to_string(), vec![b(1)])]), "server:1"),
    ] {
        let applied = s.apply(400, &restore(usage, who));
        assert!(matches!(applied.outcome, Outcome::Refused(_)), "{:?}", applied.outcome);
        assert_eq!(s.usage, before);
    }
    let applied = s.apply(
        401,
        &restore(BTreeMap::from([("ml".to_string(), vec![b(1), b(2)]), ("gone".to_string(), vec![])]), "server:1"),
    );
    assert!(matches!(applied.outcome, Outcome::UsageRestored { accounts: 1 }), "{:?}", applied.outcome);
    assert_eq!(s.usage.len(), 1);
    assert_eq!(s.usage["ml"].len(), 2);
}

fn submit_cmd(spec: JobSpec) -> Command {
    Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 10 }
}

/// A spec padded (with environment values, each within its own limit) to
/// exactly `bytes` as `JobSpec::size_bytes` counts.
fn spec_of_size(bytes: usize) -> JobSpec {
    use gangway_core::limits::ENV_VALUE_BYTES_MAX;
    let mut spec = job_spec(1, 0, 1);
    let mut k = 0;
    while spec.size_bytes() + ENV_VALUE_BYTES_MAX + 200 < bytes {
        spec.env.insert(format!("PAD{k:03}"), "x".repeat(ENV_VALUE_BYTES_MAX));
        k += 1;
    }
    let short = bytes - spec.size_bytes();
    spec.env.insert("PADEND".into(), String::new());
    let overhead = spec.size_bytes() - (bytes - short);
    spec.env.insert("PADEND".into(), "y".repeat(short - overhead));
    assert_eq!(spec.size_bytes(), bytes);
    spec.validate().unwrap();
    spec
}

/// From format 5 a spec over JOB_SPEC_BYTES_MAX is refused in apply (format
/// 4's rules, which had no such limit, still decide format-4 entries), and a
/// user's unfinished jobs stop at USER_UNFINISHED_JOBS_MAX.
#[test]
fn budgets_hold_at_their_limits_from_format_5_on() {
    use gangway_core::limits::{JOB_SPEC_BYTES_MAX, USER_UNFINISHED_JOBS_MAX};
    let mut s4 = State::default();
    let mut s5 = State::default();
    s5.apply(1, &Command::SetDataFormat { format: 5, now_ms: 1 });
    assert_eq!(s5.format, 5);
    let at = spec_of_size(JOB_SPEC_BYTES_MAX);
    let past = spec_of_size(JOB_SPEC_BYTES_MAX + 1);
    assert!(matches!(s5.apply(2, &submit_cmd(at)).outcome, Outcome::Submitted { .. }));
    match s5.apply(3, &submit_cmd(past.clone())).outcome {
        Outcome::Refused(r) => assert!(r.message.contains("spec") && r.message.contains("at most"), "{r:?}"),
        other => panic!("an oversized spec was {other:?}"),
    }
    assert!(matches!(s4.apply(2, &submit_cmd(past)).outcome, Outcome::Submitted { .. }), "format 4 changed");
    // Jobs: arrays up to the budget, then one more is refused.
    let mut user_jobs = 1; // the spec at the limit above
    let mut index = 10;
    while user_jobs + 10_000 <= USER_UNFINISHED_JOBS_MAX {
        let mut spec = job_spec(1, 0, 1);
        spec.array = "0-9999".into();
        index += 1;
        let out = s5.apply(index, &submit_cmd(spec)).outcome;
        assert!(matches!(out, Outcome::Submitted { .. }), "{out:?}");
        user_jobs += 10_000;
    }
    let mut rest = job_spec(1, 0, 1);
    rest.array = format!("0-{}", USER_UNFINISHED_JOBS_MAX - user_jobs - 1);
    assert!(matches!(s5.apply(index + 1, &submit_cmd(rest)).outcome, Outcome::Submitted { .. }));
    match s5.apply(index + 2, &submit_cmd(job_spec(1, 0, 1))).outcome {
        Outcome::Refused(r) => {
            assert_eq!(r.kind, RefusalKind::ResourceExhausted);
            assert!(r.message.contains("budget"), "{r:?}");
        }
        other => panic!("the job past the budget was {other:?}"),
    }
    s5.check_invariants().unwrap();
}

/// Decoding bounds what a length prefix may claim (16× the input); a large,
/// realistic state still decodes well within it.
#[test]
fn a_large_realistic_snapshot_decodes_within_the_allocation_bound() {
    let mut s = State::default();
    s.apply(1, &Command::SetDataFormat { format: 5, now_ms: 1 });
    for n in 0..20 {
        s.apply(2, &Command::RegisterNode { spec: node_spec(n, 8), now_ms: 2 });
    }
    let mut spec = job_spec(1, 1, 1);
    spec.script = ("#!/bin/bash\n".to_string() + &"srun python train.py --lr 3e-4\n".repeat(60)).into();
    spec.env = (0..60).map(|i| (format!("VAR_{i}"), format!("value-{i}"))).collect();
    for i in 0..20 {
        let mut spec = spec.clone();
        spec.array = "0-999".into();
        spec.name = format!("sweep-{i}");
        assert!(matches!(s.apply(3 + i, &submit_cmd(spec)).outcome, Outcome::Submitted { .. }));
    }
    let bytes = snapshot::encode(&s);
    assert!(bytes.len() > 10_000_000, "{}", bytes.len());
    assert_eq!(snapshot::decode(&bytes).unwrap(), s);
}

/// A format-6 state with accounts `ml` > `ml-vision` > `ml-vision-3d` and
/// `infra`, operator oscar, coordinator carol of `ml`, and one pending job
/// each in `ml-vision` (alice's) and `infra` (bob's).
fn roles_state() -> (State, JobId, JobId) {
    use gangway_core::policy::*;
    let mut s = State::default();
    assert!(matches!(
        s.apply(1, &Command::SetDataFormat { format: 6, now_ms: 1 }).outcome,
        Outcome::DataFormatSet { .. }
    ));
    let mut p =
        ClusterPolicy { admins: vec!["ada".into()], operators: vec!["oscar".into()], ..ClusterPolicy::default() };
    p.accounts.insert("ml".into(), Account::default());
    p.accounts.insert("ml-vision".into(), Account { parent: "ml".into(), ..Account::default() });
    p.accounts.insert("ml-vision-3d".into(), Account { parent: "ml-vision".into(), ..Account::default() });
    p.accounts.insert("infra".into(), Account::default());
    p.users.insert("alice".into(), User { accounts: vec!["ml-vision".into()], ..User::default() });
    p.users.insert("bob".into(), User { accounts: vec!["infra".into()], ..User::default() });
    p.coordinators.insert("ml".into(), vec!["carol".into()]);
    p.user_map.insert("alice@corp.example".into(), "alice".into());
    p.user_domains.push("lab.example".into());
    let update = Command::UpdatePolicy {
        policy: p,
        expected_version: None,
        force: false,
        identity: "server:1".into(),
        now_ms: 2,
    };
    assert!(matches!(s.apply(2, &update).outcome, Outcome::PolicyUpdated { .. }));
    let mut ids = Vec::new();
    for (i, user) in ["alice", "bob"].into_iter().enumerate() {
        let spec = JobSpec { user: user.into(), command: vec!["true".into()], ..JobSpec::default() };
        let cmd =
            Command::SubmitJob { spec, identity: format!("client:{user}"), idempotency_key: String::new(), now_ms: 3 };
        match s.apply(3 + i as u64, &cmd).outcome {
            Outcome::Submitted { job_id, .. } => ids.push(job_id),
            other => panic!("{other:?}"),
        }
    }
    (s, ids[0], ids[1])
}

fn refused_kind(applied: &Applied) -> Option<gangway_core::state::RefusalKind> {
    match &applied.outcome {
        Outcome::Refused(r) => Some(r.kind),
        _ => None,
    }
}

/// Operators change any job but not the policy; coordinators change the jobs
/// of their accounts and below, not others'; the user map and domains make
/// an identity the owner of its Unix user's jobs.
#[test]
fn operators_coordinators_and_mapped_users_reach_what_the_policy_gives_them() {
    use gangway_core::state::RefusalKind;
    let (s, alice_job, bob_job) = roles_state();
    let hold = |s: &mut State, job: JobId, who: &str, admin: bool| {
        s.apply(
            100,
            &Command::UpdateJob { job_id: job, change: JobChange::Hold { admin }, identity: who.into(), now_ms: 10 },
        )
    };
    // Operator: admin holds and priorities on anyone's jobs.
    let mut t = s.clone();
    assert_eq!(refused_kind(&hold(&mut t, bob_job, "client:oscar", true)), None);
    let prio = Command::UpdateJob {
        job_id: alice_job,
        change: JobChange::SetPriority(Some(9)),
        identity: "client:oscar".into(),
        now_ms: 10,
    };
    assert_eq!(refused_kind(&t.apply(101, &prio)), None);
    let policy = Command::UpdatePolicy {
        policy: t.policy.clone(),
        expected_version: None,
        force: false,
        identity: "client:oscar".into(),
        now_ms: 10,
    };
    assert_eq!(refused_kind(&t.apply(102, &policy)), Some(RefusalKind::PermissionDenied));
    // Coordinator of ml: alice's job (ml-vision) yes, bob's (infra) no; no admin holds.
    let mut t = s.clone();
    assert_eq!(refused_kind(&hold(&mut t, alice_job, "client:carol", false)), None);
    assert_eq!(refused_kind(&hold(&mut t, bob_job, "client:carol", false)), Some(RefusalKind::PermissionDenied));
    let mut t = s.clone();
    assert_eq!(refused_kind(&hold(&mut t, alice_job, "client:carol", true)), Some(RefusalKind::PermissionDenied));
    // Not an agent named like a coordinator, nor a user of another name.
    let mut t = s.clone();
    assert_eq!(refused_kind(&hold(&mut t, alice_job, "agent:carol", false)), Some(RefusalKind::PermissionDenied));
    assert_eq!(refused_kind(&hold(&mut t, alice_job, "client:bob", false)), Some(RefusalKind::PermissionDenied));
    // The mapped identity and the domain-stripped one own alice's job.
    for who in ["client:alice@corp.example", "client:alice@lab.example"] {
        let mut t = s.clone();
        assert_eq!(refused_kind(&hold(&mut t, alice_job, who, false)), None, "{who}");
    }
    let mut t = s.clone();
    assert_eq!(
        refused_kind(&hold(&mut t, alice_job, "client:alice@evil.example", false)),
        Some(RefusalKind::PermissionDenied)
    );
    t.check_invariants().unwrap();
}

/// A coordinator's policy edits reach only below their accounts: sub-accounts
/// (added, changed, removed) and memberships; everything else is refused,
/// naming the field, and changes nothing.
#[test]
fn coordinators_edit_only_below_their_accounts() {
    use gangway_core::format::NODE_ADMISSION_FORMAT;
    use gangway_core::policy::*;
    use gangway_core::state::RefusalKind;
    let (before, _, _) = roles_state();
    let mut s = before.clone();
    let moved = s.apply(3, &Command::SetDataFormat { format: NODE_ADMISSION_FORMAT, now_ms: 3 });
    assert!(matches!(moved.outcome, Outcome::DataFormatSet { .. }), "{:?}", moved.outcome);
    let try_edit_in = |s: &State, edit: &dyn Fn(&mut ClusterPolicy)| {
        let mut t = s.clone();
        let mut p = t.policy.clone();
        edit(&mut p);
        let cmd = Command::UpdatePolicy {
            policy: p,
            expected_version: None,
            force: false,
            identity: "client:carol".into(),
            now_ms: 10,
        };
        let applied = t.apply(100, &cmd);
        if refused_kind(&applied).is_some() {
            t.clock_ms = s.clock_ms;
            assert_eq!(&t, s, "a refused edit changed the state");
        }
        (refused_kind(&applied), format!("{:?}", applied.outcome), t)
    };
    let try_edit = |edit: &dyn Fn(&mut ClusterPolicy)| try_edit_in(&s, edit);
    // Before format 17 a coordinator could add anyone (the rule a log of
    // format 16 replays with).
    let add_dave = |p: &mut ClusterPolicy| {
        p.users.insert("dave".into(), User { accounts: vec!["ml".into()], ..User::default() });
    };
    assert_eq!(try_edit_in(&before, &add_dave).0, None);
    assert_eq!(try_edit(&add_dave).0, Some(RefusalKind::PermissionDenied));
    type Edit = Box<dyn Fn(&mut ClusterPolicy)>;
    let allowed: Vec<(&str, Edit)> = vec![
        ("quota below", Box::new(|p| p.accounts.get_mut("ml-vision").unwrap().quota.max_running_gpus = Some(8))),
        (
            "new sub-account",
            Box::new(|p| {
                p.accounts.insert("ml-nlp".into(), Account { parent: "ml".into(), ..Account::default() });
            }),
        ),
        (
            "remove a leaf below",
            Box::new(|p| {
                p.accounts.remove("ml-vision-3d");
            }),
        ),
        ("alice also in ml", Box::new(|p| p.users.get_mut("alice").unwrap().accounts.push("ml".into()))),
        (
            "alice's default within reach",
            Box::new(|p| p.users.get_mut("alice").unwrap().accounts = vec!["ml".into(), "ml-vision".into()]),
        ),
        (
            "delegate a coordinator",
            Box::new(|p| {
                p.coordinators.insert("ml-vision".into(), vec!["vic".into()]);
            }),
        ),
    ];
    for (what, edit) in &allowed {
        let (kind, outcome, _) = try_edit(edit.as_ref());
        assert_eq!(kind, None, "{what}: {outcome}");
    }
    let refused: Vec<(&str, &str, Edit)> = vec![
        ("own account's quota", "accounts.ml", Box::new(|p| p.accounts.get_mut("ml").unwrap().shares = 5)),
        ("another tree", "accounts.infra", Box::new(|p| p.accounts.get_mut("infra").unwrap().shares = 5)),
        (
            "move in from outside",
            "accounts.infra",
            Box::new(|p| p.accounts.get_mut("infra").unwrap().parent = "ml".into()),
        ),
        (
            "move out",
            "accounts.ml-vision",
            Box::new(|p| p.accounts.get_mut("ml-vision").unwrap().parent = String::new()),
        ),
        ("bob's other account", "users.bob.accounts", Box::new(|p| p.users.get_mut("bob").unwrap().accounts.clear())),
        // Users from outside the tree are an admin's to add: once in, their
        // next jobs would be the coordinator's to see and cancel.
        (
            "bob's default into ml",
            "users.bob",
            Box::new(|p| p.users.get_mut("bob").unwrap().accounts = vec!["ml".into(), "infra".into()]),
        ),
        ("bob also in ml", "users.bob", Box::new(|p| p.users.get_mut("bob").unwrap().accounts.push("ml".into()))),
        (
            "a new user",
            "users.dave",
            Box::new(|p| {
                p.users.insert("dave".into(), User { accounts: vec!["ml".into()], ..User::default() });
            }),
        ),
        (
            "a user's quota",
            "users.alice.quota",
            Box::new(|p| p.users.get_mut("alice").unwrap().quota.max_running_jobs = Some(1)),
        ),
        ("become admin", "admins", Box::new(|p| p.admins.push("carol".into()))),
        ("become operator", "operators", Box::new(|p| p.operators.push("carol".into()))),
        (
            "map to root",
            "user_map",
            Box::new(|p| {
                p.user_map.insert("carol".into(), "root".into());
            }),
        ),
        ("root jobs", "allow_root_jobs", Box::new(|p| p.allow_root_jobs = true)),
        (
            "coordinate infra",
            "coordinators.infra",
            Box::new(|p| {
                p.coordinators.insert("infra".into(), vec!["carol".into()]);
            }),
        ),
        ("own coordinators", "coordinators.ml", Box::new(|p| p.coordinators.get_mut("ml").unwrap().push("eve".into()))),
        // Out of every account: alice would charge root, free of ml's limits.
        ("alice to root", "users.alice.accounts", Box::new(|p| p.users.get_mut("alice").unwrap().accounts.clear())),
        (
            "remove alice",
            "users.alice.accounts",
            Box::new(|p| {
                p.users.remove("alice");
            }),
        ),
        // A sub-account a job still names: its use would leave ml's quotas.
        (
            "remove a used account",
            "accounts.ml-vision",
            Box::new(|p| {
                p.accounts.remove("ml-vision-3d");
                p.accounts.remove("ml-vision");
                p.users.get_mut("alice").unwrap().accounts = vec!["ml".into()];
            }),
        ),
    ];
    for (what, field, edit) in &refused {
        let (kind, outcome, _) = try_edit(edit.as_ref());
        assert_eq!(kind, Some(RefusalKind::PermissionDenied), "{what}: {outcome}");
        assert!(outcome.contains(field), "{what}: {outcome} should name {field}");
    }
    // Coordinators cannot force, even for an edit in reach.
    let mut t = s.clone();
    let mut p = t.policy.clone();
    p.accounts.get_mut("ml-vision").unwrap().shares = 3;
    let forced = Command::UpdatePolicy {
        policy: p,
        expected_version: None,
        force: true,
        identity: "client:carol".into(),
        now_ms: 10,
    };
    assert_eq!(refused_kind(&t.apply(100, &forced)), Some(RefusalKind::PermissionDenied));
    // A retired account's name, still on bob's job, cannot be taken over.
    let mut t = s.clone();
    let mut p = t.policy.clone();
    p.accounts.remove("infra");
    p.users.get_mut("bob").unwrap().accounts = vec!["ml".into()];
    let retire = Command::UpdatePolicy {
        policy: p,
        expected_version: None,
        force: true,
        identity: "client:ada".into(),
        now_ms: 10,
    };
    assert_eq!(refused_kind(&t.apply(100, &retire)), None);
    let mut p = t.policy.clone();
    p.accounts.insert("infra".into(), Account { parent: "ml".into(), ..Account::default() });
    let take = Command::UpdatePolicy {
        policy: p,
        expected_version: None,
        force: false,
        identity: "client:carol".into(),
        now_ms: 11,
    };
    let applied = t.apply(101, &take);
    assert_eq!(refused_kind(&applied), Some(RefusalKind::PermissionDenied), "{:?}", applied.outcome);
    assert!(format!("{:?}", applied.outcome).contains("accounts.infra"), "{:?}", applied.outcome);
}

/// The roles, the user map and the job switches need data format 6: a
/// cluster still on 5 refuses them (a format-5 build could not read them),
/// and format 5's encoding cannot carry them.
#[test]
fn roles_wait_for_data_format_6() {
    use gangway_core::compat::v5;
    use gangway_core::state::RefusalKind;
    let mut s = State::default();
    s.apply(1, &Command::SetDataFormat { format: 5, now_ms: 1 });
    let update = Command::UpdatePolicy {
        policy: roles_policy(),
        expected_version: None,
        force: true,
        identity: "server:1".into(),
        now_ms: 2,
    };
    let before = s.clone();
    let applied = s.apply(2, &update);
    assert_eq!(refused_kind(&applied), Some(RefusalKind::FailedPrecondition), "{:?}", applied.outcome);
    assert_eq!(s.policy, before.policy);
    assert_eq!(update.since_format(), 6);
    assert!(v5::Wire::from_command(&update).unwrap_err().contains("format 6"));
    // Everything else still converts, both ways, batches included.
    let plain = Command::Batch(vec![Command::UpdatePolicy {
        policy: preset_policy(3),
        expected_version: None,
        force: true,
        identity: "server:1".into(),
        now_ms: 3,
    }]);
    assert_eq!(v5::Wire::from_command(&plain).unwrap().into_command().unwrap(), plain);
    s.apply(3, &Command::SetDataFormat { format: 6, now_ms: 3 });
    assert_eq!(refused_kind(&s.apply(4, &update)), None);
    assert!(s.policy.private_jobs && s.policy.allow_root_jobs);
}

/// A test submission explained without a copy of the state (the would-be job
/// planned as if pending) reads exactly as submitting it to a copy and
/// explaining that: for plain jobs, gangs, held jobs, arrays, dependencies
/// still waiting and already met, on an idle and a busy cluster.
#[test]
fn test_submissions_explain_without_a_copy_as_a_real_submission_would() {
    let mut states = vec![base_state(), golden_state(6)];
    // A busy cluster: everything placed that fits, and a queue behind it.
    let mut busy = base_state();
    for k in 0..6 {
        let spec = job_spec(1 + k % 2, 4, 2);
        busy.apply(
            200 + u64::from(k),
            &Command::SubmitJob { spec, identity: "bob".into(), idempotency_key: String::new(), now_ms: 5_000 },
        );
    }
    let plan =
        gangway_core::sched::plan(&busy, &gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, 5_000));
    busy.apply(300, &Command::ApplySchedule { preemptions: vec![], placements: plan.placements, now_ms: 5_000 });
    states.push(busy);
    for state in states {
        let running = *state.running.iter().next().expect("a running job");
        let finished = state.finished.back().copied();
        let mut specs = vec![job_spec(1, 1, 1), job_spec(2, 4, 2), job_spec(1, 0, 64), job_spec(9, 1, 1)];
        specs.push(JobSpec { hold: true, ..job_spec(1, 1, 1) });
        specs.push(JobSpec { array: "0-3".into(), ..job_spec(1, 2, 1) });
        specs.push(JobSpec { nice: 500, ..job_spec(1, 1, 1) });
        let dep = |kind, job_id| Dependency { kind, job_id, array_index: None };
        specs.push(JobSpec { dependencies: vec![dep(DependencyKind::AfterOk, running)], ..job_spec(1, 1, 1) });
        specs.push(JobSpec { dependencies: vec![dep(DependencyKind::After, running)], ..job_spec(1, 1, 1) });
        if let Some(f) = finished {
            specs.push(JobSpec { dependencies: vec![dep(DependencyKind::AfterAny, f)], ..job_spec(1, 1, 1) });
        }
        let now = state.clock_ms;
        for spec in specs {
            let mut copy = state.clone();
            let cmd = Command::SubmitJob {
                spec: spec.clone(),
                identity: "alice".into(),
                idempotency_key: String::new(),
                now_ms: now,
            };
            let Outcome::Submitted { job_id, .. } = copy.apply(u64::MAX / 2, &cmd).outcome else {
                panic!("{spec:?} refused")
            };
            let want = gangway_core::sched::explain(&copy, job_id, now).unwrap();
            let mut jobs = state.prepare_submission(u64::MAX / 2, &spec, "alice").unwrap();
            let job = &mut jobs[0];
            assert_eq!(job.id, job_id);
            state.settle_hypothetical(job);
            let got = gangway_core::sched::explain_submission(&state, job, now);
            assert_eq!(got, want, "{spec:?}");
        }
        // Refusals are the ones the log would give.
        let bad = JobSpec { partition: "nope".into(), ..job_spec(1, 1, 1) };
        let refused = state.prepare_submission(1, &bad, "alice").unwrap_err();
        assert!(matches!(refused.outcome, Outcome::Refused(_)), "{:?}", refused.outcome);
    }
}

/// The leader's fleet sends at most FLEET_HEARTBEATS_PER_S_MAX heartbeats a
/// second: the interval stretches with the fleet, but never past what keeps
/// an agent's self-fence from firing between heartbeats.
#[test]
fn the_heartbeat_interval_stretches_with_the_fleet_within_the_fence_window() {
    use gangway_core::agent::{heartbeat_interval_cap_ms, HEARTBEATS_PER_FENCE_WINDOW_MIN};
    use gangway_core::duties::{heartbeat_interval_ms, FLEET_HEARTBEATS_PER_S_MAX};
    assert_eq!(heartbeat_interval_ms(3, 1_000, 30_000), 1_000);
    assert_eq!(heartbeat_interval_ms(2_000, 1_000, 30_000), 1_000);
    assert_eq!(heartbeat_interval_ms(5_000, 1_000, 30_000), 2_500);
    assert_eq!(heartbeat_interval_ms(10_000, 1_000, 30_000), 5_000);
    // Past the fence window's cap the rate cap gives way: the node-down
    // timeout, and the fence, are what the operator set.
    assert_eq!(heartbeat_interval_ms(100_000, 1_000, 30_000), 5_000);
    for nodes in [0usize, 1, 999, 2_001, 7_777, 10_000, 65_536] {
        for (base, timeout) in [(1_000, 30_000), (500, 10_000), (2_000, 300_000)] {
            let ms = heartbeat_interval_ms(nodes, base, timeout);
            assert!(ms <= heartbeat_interval_cap_ms(timeout), "{nodes} {base} {timeout}: {ms}");
            assert!(ms * HEARTBEATS_PER_FENCE_WINDOW_MIN <= timeout / 2, "{nodes} {base} {timeout}: {ms}");
            let cap_reached = ms == heartbeat_interval_cap_ms(timeout);
            assert!(
                cap_reached || nodes as u64 * 1000 / ms <= FLEET_HEARTBEATS_PER_S_MAX,
                "{nodes} nodes every {ms} ms is over the fleet's rate"
            );
        }
    }
}

/// A job's start wakes its nodes' agents, and so does its end, although the
/// ended job no longer holds its allocation; a submission wakes nobody, and a
/// book resynced from the state knows the running jobs' nodes.
#[test]
fn pokes_wake_only_the_nodes_a_change_concerns() {
    use gangway_core::duties::PokeBook;
    let mut s = State::default();
    let mut book = PokeBook::default();
    let mut index = 0;
    let mut apply = |s: &mut State, book: &mut PokeBook, cmd: Command| {
        index += 1;
        let applied = s.apply(index, &cmd);
        let mut events = Vec::new();
        s.events_of(index, &applied, &mut events);
        let mut woken: Vec<String> = events.iter().flat_map(|e| book.nodes_to_poke(e, s)).collect();
        woken.sort();
        woken.dedup();
        (applied.outcome, woken)
    };
    for i in 0..4 {
        let (_, woken) = apply(&mut s, &mut book, Command::RegisterNode { spec: node_spec(i, 4), now_ms: 1 });
        assert_eq!(woken, vec![format!("n{i}")]);
    }
    let submit =
        Command::SubmitJob { spec: job_spec(2, 4, 1), identity: "a".into(), idempotency_key: String::new(), now_ms: 5 };
    let (Outcome::Submitted { job_id, .. }, woken) = apply(&mut s, &mut book, submit) else { panic!("refused") };
    assert!(woken.is_empty(), "a submission wakes nobody: {woken:?}");
    let plan = first_fit(&s, job_id, 0).unwrap();
    let nodes: Vec<String> = plan.nodes.iter().map(|n| n.node.clone()).collect();
    let (_, woken) =
        apply(&mut s, &mut book, Command::ApplySchedule { preemptions: vec![], placements: vec![plan], now_ms: 6 });
    assert_eq!(woken, nodes, "the gang's nodes launch");
    let mut fresh = PokeBook::default();
    assert_eq!(fresh.resync(&s), 1);
    let (_, woken) = apply(&mut s, &mut book, Command::CancelJob { job_id, identity: "alice".into(), now_ms: 7 });
    assert_eq!(s.jobs[&job_id].state, JobState::Cancelled);
    assert_eq!(woken, nodes, "the cancelled gang's nodes stop it");
    assert!(book.is_empty(), "an ended job is forgotten");
    // The resynced book knew the job too.
    let ev = gangway_core::Event::Job(gangway_core::state::JobEvent {
        index: 7,
        job_id,
        state: JobState::Cancelled,
        attempt: s.jobs[&job_id].attempt,
        reason: String::new(),
        suspended: None,
        step: None,
        usage: false,
    });
    assert_eq!(fresh.nodes_to_poke(&ev, &s), nodes);
}

/// A gang may span the fleet from data format 8 on: before it, a build that
/// refuses more than 1,024 nodes may still be applying the same log, so the
/// cluster refuses such a job (naming the field and the format) and changes
/// nothing. On format 8 a 4,096-node gang is placed whole.
#[test]
fn a_gang_as_big_as_the_fleet_waits_for_format_8_then_is_placed_whole() {
    use gangway_core::format::BIG_GANGS_FORMAT;
    use gangway_core::limits::{NODES_PER_JOB_MAX, NODES_PER_JOB_MAX_BEFORE_FORMAT_8};
    let mut s = State::default();
    s.apply(1, &Command::SetDataFormat { format: BIG_GANGS_FORMAT - 1, now_ms: 1 });
    let mut index = 1;
    for i in 0..4_200 {
        index += 1;
        s.apply(index, &Command::RegisterNode { spec: node_spec(i, 8), now_ms: index });
    }
    let gang = 4_096;
    let submit = |index: u64| Command::SubmitJob {
        spec: job_spec(gang, 8, 1),
        identity: "alice".into(),
        idempotency_key: String::new(),
        now_ms: index,
    };
    let before = s.clone();
    index += 1;
    let refused = s.apply(index, &submit(index));
    let Outcome::Refused(r) = &refused.outcome else { panic!("accepted before format 8: {:?}", refused.outcome) };
    assert!(r.message.contains("nodes") && r.message.contains("format 8"), "{}", r.message);
    assert!(r.message.contains(&NODES_PER_JOB_MAX_BEFORE_FORMAT_8.to_string()), "{}", r.message);
    assert_eq!(s.jobs, before.jobs, "a refusal changes nothing");
    index += 1;
    s.apply(index, &Command::SetDataFormat { format: BIG_GANGS_FORMAT, now_ms: index });
    index += 1;
    let Outcome::Submitted { job_id, .. } = s.apply(index, &submit(index)).outcome else {
        panic!("refused on format 8")
    };
    let opts = gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, index);
    let plan = gangway_core::sched::plan(&s, &opts);
    assert_eq!(plan.placements.len(), 1, "{:?}", plan.reasons);
    assert_eq!(plan.placements[0].nodes.len(), gang as usize);
    index += 1;
    s.apply(index, &Command::ApplySchedule { preemptions: vec![], placements: plan.placements, now_ms: index });
    assert_eq!(s.jobs[&job_id].state, JobState::Running);
    let alloc = s.jobs[&job_id].allocation.as_ref().unwrap();
    let nodes: std::collections::BTreeSet<&str> = alloc.nodes.iter().map(|n| n.node.as_str()).collect();
    assert_eq!(nodes.len(), gang as usize, "every node once");
    s.check_invariants().unwrap();
    // The fleet-wide limit itself is the cluster's node limit.
    assert_eq!(NODES_PER_JOB_MAX as usize, gangway_core::limits::NODES_MAX);
    let mut too_big = job_spec(NODES_PER_JOB_MAX + 1, 1, 1);
    too_big.user = "alice".into();
    assert_eq!(too_big.validate().unwrap_err().field, "nodes");
}

/// A heterogeneous job's placement lists component 0's nodes first, each
/// component with its own shape; apply refuses one whose components are out
/// of order or share a node, and starts the whole job at once.
#[test]
fn a_heterogeneous_job_is_placed_component_by_component() {
    let mut s = State::default();
    for n in 0..3 {
        s.apply(n as u64 + 1, &Command::RegisterNode { spec: node_spec(n, if n == 2 { 4 } else { 0 }), now_ms: 1_000 });
    }
    let mut spec = job_spec(1, 4, 1);
    spec.batch = true;
    spec.components = vec![gangway_core::spec::HetComponent::of(&job_spec(2, 0, 3))];
    let submit = Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 2_000 };
    s.apply(4, &Command::SetDataFormat { format: 10, now_ms: 1_500 });
    let Outcome::Refused(r) = s.apply(5, &submit).outcome else { panic!("format 10 took a heterogeneous job") };
    assert!(r.message.starts_with("components: a heterogeneous job needs data format 11"), "{}", r.message);
    s.apply(6, &Command::SetDataFormat { format: 11, now_ms: 1_500 });
    let Outcome::Submitted { job_id, .. } = s.apply(10, &submit).outcome else { panic!("submit refused") };
    let opts = gangway_core::sched::Options {
        policy: gangway_core::sched::Policy::Easy,
        order: gangway_core::sched::Order::Priority,
        now_ms: 3_000,
        estimate_s: None,
        stopping: None,
    };
    let plan = gangway_core::sched::plan(&s, &opts);
    let p = plan.placements.iter().find(|p| p.job_id == job_id).expect("placed").clone();
    let shape: Vec<(&str, u32, usize)> = p.nodes.iter().map(|n| (n.node.as_str(), n.cpus, n.gpus.len())).collect();
    assert_eq!(shape[0], ("n2", 1, 4), "component 0 first: the GPU node");
    assert_eq!(shape[1..].iter().map(|n| (n.1, n.2)).collect::<Vec<_>>(), vec![(3, 0), (3, 0)]);
    let mut swapped = p.clone();
    swapped.nodes.rotate_left(1);
    assert!(s.check_placement(&swapped).unwrap_err().starts_with("component 0:"));
    let mut shared = p.clone();
    shared.nodes[2] = shared.nodes[1].clone();
    assert!(s.check_placement(&shared).unwrap_err().contains("appears twice"));
    let apply = Command::ApplySchedule { preemptions: vec![], placements: vec![p], now_ms: 3_000 };
    s.apply(11, &apply);
    assert_eq!(s.jobs[&job_id].state, JobState::Running);
    assert_eq!(s.jobs[&job_id].gpus(), 4);
    s.check_invariants().unwrap();
}

/// A node a later component lists (`-w`) is kept for it: an earlier
/// component, which could go anywhere, goes elsewhere.
#[test]
fn a_component_does_not_take_a_node_another_lists() {
    let mut s = State::default();
    for n in 0..2 {
        s.apply(n as u64 + 1, &Command::RegisterNode { spec: node_spec(n, 0), now_ms: 1_000 });
    }
    s.apply(3, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 1_500 });
    let mut spec = job_spec(1, 0, 1);
    spec.batch = true;
    let mut listed = job_spec(1, 0, 1);
    listed.nodelist = vec!["n0".into()];
    spec.components = vec![gangway_core::spec::HetComponent::of(&listed)];
    let submit = Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 2_000 };
    let Outcome::Submitted { job_id, .. } = s.apply(10, &submit).outcome else { panic!("submit refused") };
    let opts = gangway_core::sched::Options {
        policy: gangway_core::sched::Policy::Easy,
        order: gangway_core::sched::Order::Priority,
        now_ms: 3_000,
        estimate_s: None,
        stopping: None,
    };
    let plan = gangway_core::sched::plan(&s, &opts);
    let p = plan.placements.iter().find(|p| p.job_id == job_id).expect("placed");
    let nodes: Vec<&str> = p.nodes.iter().map(|n| n.node.as_str()).collect();
    assert_eq!(nodes, vec!["n1", "n0"]);
}

/// From format 11 fair share is not charged for the time a job was
/// suspended (its processes were stopped); a format-10 log replays as it
/// was applied, charging it.
#[test]
fn suspended_time_is_not_charged_to_fair_share_from_format_11() {
    for (format, charged_s) in [(10u32, 100u64), (11, 60)] {
        let mut s = State::default();
        s.apply(1, &Command::RegisterNode { spec: node_spec(0, 1), now_ms: 0 });
        s.apply(2, &Command::SetDataFormat { format, now_ms: 0 });
        let policy = gangway_core::policy::ClusterPolicy { admins: vec!["ops".into()], ..Default::default() };
        let update = Command::UpdatePolicy {
            policy,
            expected_version: None,
            force: true,
            identity: "server:1".into(),
            now_ms: 0,
        };
        assert!(matches!(s.apply(3, &update).outcome, Outcome::PolicyUpdated { .. }));
        let submit = Command::SubmitJob {
            spec: job_spec(1, 1, 1),
            identity: "alice".into(),
            idempotency_key: String::new(),
            now_ms: 0,
        };
        let Outcome::Submitted { job_id, .. } = s.apply(4, &submit).outcome else { panic!("submit refused") };
        let placement = first_fit(&s, job_id, 0).expect("fits");
        s.apply(5, &Command::ApplySchedule { preemptions: vec![], placements: vec![placement], now_ms: 1_000 });
        assert_eq!(s.jobs[&job_id].state, JobState::Running);
        for (index, change, now_ms) in [(6, JobChange::Suspend, 11_000), (7, JobChange::Resume, 51_000)] {
            let cmd = Command::UpdateJob { job_id, change, identity: "ops".into(), now_ms };
            assert!(matches!(s.apply(index, &cmd).outcome, Outcome::JobUpdated { .. }), "format {format}");
        }
        s.apply(8, &Command::CancelJob { job_id, identity: "alice".into(), now_ms: 101_000 });
        let gpu_ms: u64 = s.usage.values().flatten().map(|b| b.gpu_ms).sum();
        assert_eq!(gpu_ms, charged_s * 1000, "format {format}");
    }
}

/// One case of `every_spec_limit_holds_at_its_value_and_refuses_one_past`:
/// the limit's name, its value, the field a refusal names, and how to set a
/// spec to a value.
type SpecLimitCase = (&'static str, u64, &'static str, fn(&mut JobSpec, u64));

fn len(v: u64) -> usize {
    usize::try_from(v).expect("limits fit in usize")
}

/// Every limit a job spec is checked against, as a table: a spec at the
/// limit is accepted, one past it is refused naming the field. A new limit
/// in `limits.rs` on a spec field belongs here.
#[test]
fn every_spec_limit_holds_at_its_value_and_refuses_one_past() {
    use gangway_core::limits::*;
    let cases: [SpecLimitCase; 26] = [
        ("NAME_BYTES_MAX", NAME_BYTES_MAX as u64, "name", |s, v| s.name = "a".repeat(len(v))),
        ("SCRIPT_BYTES_MAX", SCRIPT_BYTES_MAX as u64, "script", |s, v| s.script = "x".repeat(len(v)).into()),
        ("ARGS_MAX", ARGS_MAX as u64, "command", |s, v| s.command = vec!["true".to_string(); len(v)]),
        ("PATH_BYTES_MAX", PATH_BYTES_MAX as u64, "workdir", |s, v| s.workdir = format!("/{}", "a".repeat(len(v) - 1))),
        ("COMMENT_BYTES_MAX", COMMENT_BYTES_MAX as u64, "comment", |s, v| s.comment = "c".repeat(len(v))),
        ("NODES_PER_JOB_MAX", u64::from(NODES_PER_JOB_MAX), "nodes", |s, v| s.nodes = v as u32),
        ("TASKS_PER_NODE_MAX", u64::from(TASKS_PER_NODE_MAX), "tasks_per_node", |s, v| s.tasks_per_node = v as u32),
        ("CPUS_PER_TASK_MAX", u64::from(CPUS_PER_TASK_MAX), "cpus_per_task", |s, v| s.cpus_per_task = v as u32),
        ("MEM_PER_NODE_MB_MAX", MEM_PER_NODE_MB_MAX, "mem_per_node_mb", |s, v| s.mem_per_node_mb = v),
        ("MEM_PER_NODE_MB_MAX (per CPU)", MEM_PER_NODE_MB_MAX, "mem_per_cpu_mb", |s, v| s.mem_per_cpu_mb = v),
        ("GPUS_PER_NODE_MAX", u64::from(GPUS_PER_NODE_MAX), "gpus_per_node", |s, v| s.gpus_per_node = v as u32),
        ("TIME_LIMIT_S_MAX", TIME_LIMIT_S_MAX, "time_limit_s", |s, v| s.time_limit_s = v),
        ("TIME_LIMIT_S_MAX (topology wait)", TIME_LIMIT_S_MAX, "topology.wait_s", |s, v| {
            s.topology.level = "rack".into();
            s.topology.wait_s = v;
        }),
        ("WARN_BEFORE_S_MAX", u64::from(WARN_BEFORE_S_MAX), "warn_before_s", |s, v| {
            s.warn_signal = 10;
            s.warn_before_s = v as u32;
        }),
        ("CONSTRAINTS_MAX", CONSTRAINTS_MAX as u64, "constraints", |s, v| {
            s.constraints = (0..v).map(|i| format!("f{i}")).collect();
        }),
        ("EXCLUDED_NODES_MAX", EXCLUDED_NODES_MAX as u64, "exclude", |s, v| {
            s.exclude = (0..v).map(|i| format!("n{i}")).collect();
        }),
        ("DEPENDENCIES_MAX", DEPENDENCIES_MAX as u64, "dependencies", |s, v| {
            s.dependencies =
                (1..=v).map(|job_id| Dependency { kind: DependencyKind::AfterOk, job_id, array_index: None }).collect();
        }),
        ("NICE_MAX", NICE_MAX as u64, "nice", |s, v| s.nice = v as i32),
        ("LICENSES_PER_JOB_MAX", LICENSES_PER_JOB_MAX as u64, "licenses", |s, v| {
            s.licenses = (0..v).map(|i| (format!("lic{i}"), 1)).collect();
        }),
        ("LICENSE_COUNT_MAX", u64::from(LICENSE_COUNT_MAX), "licenses", |s, v| {
            s.licenses = BTreeMap::from([("wandb".to_string(), v as u32)]);
        }),
        ("ENV_VARS_MAX", ENV_VARS_MAX as u64, "env", |s, v| {
            s.env = (0..v).map(|i| (format!("V{i}"), String::new())).collect::<BTreeMap<_, _>>().into();
        }),
        ("ENV_VALUE_BYTES_MAX", ENV_VALUE_BYTES_MAX as u64, "env", |s, v| {
            s.env = BTreeMap::from([("V".to_string(), "v".repeat(len(v)))]).into();
        }),
        ("GPU_TYPE_BYTES_MAX", GPU_TYPE_BYTES_MAX as u64, "gpu_type", |s, v| {
            s.gpus_per_node = 1;
            s.gpu_type = "h".repeat(len(v));
        }),
        ("ARRAY_TASKS_MAX", ARRAY_TASKS_MAX as u64, "array", |s, v| s.array = format!("0-{}", v - 1)),
        ("ARRAY_INDEX_MAX", u64::from(ARRAY_INDEX_MAX), "array", |s, v| s.array = v.to_string()),
        ("HET_COMPONENTS_MAX", HET_COMPONENTS_MAX as u64, "components", |s, v| {
            s.batch = true;
            s.components = (0..v).map(|_| gangway_core::spec::HetComponent::of(&job_spec(1, 0, 1))).collect();
        }),
    ];
    let format = gangway_core::format::FORMAT_NEWEST;
    for (limit, value, field, set) in cases {
        let mut at = job_spec(1, 0, 1);
        set(&mut at, value);
        assert_eq!(at.validate_in(format), Ok(()), "{limit}: a spec at {value} is refused");
        let mut past = job_spec(1, 0, 1);
        set(&mut past, value + 1);
        let refused = past.validate_in(format).expect_err(&format!("{limit}: a spec at {} is accepted", value + 1));
        assert_eq!(refused.field, field, "{limit}: one past it is refused for another field: {refused}");
        // And by the named rule (a field may have several): the rule says
        // the limit (a heterogeneous job's counts its first component too).
        let shown = if limit == "HET_COMPONENTS_MAX" { value + 1 } else { value };
        assert!(refused.rule.contains(&shown.to_string()), "{limit}: refused by another rule: {refused}");
    }
    // The whole spec's size, besides its fields': exactly at
    // JOB_SPEC_BYTES_MAX (eight values of the largest size and the script
    // for the rest), then one byte more.
    let mut big = job_spec(1, 0, 1);
    big.env = (0..8).map(|i| (format!("V{i}"), "v".repeat(ENV_VALUE_BYTES_MAX))).collect::<BTreeMap<_, _>>().into();
    let script = JOB_SPEC_BYTES_MAX - big.size_bytes();
    assert!(script <= SCRIPT_BYTES_MAX, "the script fits its own limit: {script}");
    big.script = "x".repeat(script).into();
    assert_eq!(big.size_bytes(), JOB_SPEC_BYTES_MAX);
    assert_eq!(big.validate_in(format), Ok(()));
    assert_eq!(check_spec_size(&big), Ok(()));
    big.script = "x".repeat(script + 1).into();
    assert_eq!(check_spec_size(&big).map_err(|e| e.field), Err("spec".to_string()));
}

/// `count` names: `prefix0`, `prefix1`, ...
fn names(prefix: &str, count: u64) -> Vec<String> {
    (0..count).map(|i| format!("{prefix}{i}")).collect()
}

/// The policy's limits, as `every_spec_limit_holds_at_its_value_and_refuses_one_past`
/// checks a job spec's: a policy at each limit is accepted, one past it is
/// refused naming the field (or the entry, for `prefix.`) and the limit.
#[test]
fn every_policy_limit_holds_at_its_value_and_refuses_one_past() {
    use gangway_core::limits::{IDENTITY_NAME_BYTES_MAX, LICENSES_MAX, LICENSE_LIMIT_SCOPES_MAX, TOPOLOGY_LEVELS_MAX};
    use gangway_core::policy::*;
    type PolicyLimitCase = (&'static str, u64, &'static str, fn(&mut ClusterPolicy, u64));
    fn accounts(v: u64) -> BTreeMap<String, Account> {
        names("a", v).into_iter().map(|n| (n, Account::default())).collect()
    }
    let cases: [PolicyLimitCase; 21] = [
        ("PARTITIONS_MAX", PARTITIONS_MAX as u64, "partitions", |p, v| {
            p.partitions = names("p", v).into_iter().map(|n| (n, Partition::default())).collect();
        }),
        ("ACCOUNTS_MAX", ACCOUNTS_MAX as u64, "accounts", |p, v| p.accounts = accounts(v)),
        ("USERS_MAX", USERS_MAX as u64, "users", |p, v| {
            p.users = names("u", v).into_iter().map(|n| (n, User::default())).collect();
        }),
        ("QOS_MAX", QOS_MAX as u64, "qos", |p, v| {
            p.qos = names("q", v).into_iter().map(|n| (n, Qos::default())).collect()
        }),
        ("ACCOUNT_DEPTH_MAX", ACCOUNT_DEPTH_MAX as u64, "accounts.d", |p, v| {
            let name = |i: u64| format!("d{i:03}");
            let parent = |i: u64| if i == 1 { String::new() } else { name(i - 1) };
            p.accounts = (1..=v).map(|i| (name(i), Account { parent: parent(i), ..Account::default() })).collect();
        }),
        ("PARTITION_NODE_PATTERNS_MAX", PARTITION_NODE_PATTERNS_MAX as u64, "partitions.p.nodes", |p, v| {
            p.partitions = BTreeMap::from([("p".into(), Partition { nodes: names("n", v), ..Partition::default() })]);
        }),
        ("USER_ACCOUNTS_MAX", USER_ACCOUNTS_MAX as u64, "users.u.accounts", |p, v| {
            p.accounts = accounts(v);
            p.users = BTreeMap::from([("u".into(), User { accounts: names("a", v), ..User::default() })]);
        }),
        ("BACKFILL_RESERVATIONS_MAX", u64::from(BACKFILL_RESERVATIONS_MAX), "backfill_reservations", |p, v| {
            p.backfill_reservations = v as u32;
        }),
        ("HALF_LIFE_S_MAX", HALF_LIFE_S_MAX, "fairshare_half_life_s", |p, v| p.fairshare_half_life_s = v),
        ("ADMINS_MAX", ADMINS_MAX as u64, "admins", |p, v| p.admins = names("admin", v)),
        ("PRIORITY_WEIGHT_MAX", u64::from(PRIORITY_WEIGHT_MAX), "priority.age", |p, v| p.priority.age = v as u32),
        ("OPERATORS_MAX", OPERATORS_MAX as u64, "operators", |p, v| p.operators = names("op", v)),
        ("ACCOUNT_COORDINATORS_MAX", ACCOUNT_COORDINATORS_MAX as u64, "coordinators.a0", |p, v| {
            p.accounts = accounts(1);
            p.coordinators = BTreeMap::from([("a0".into(), names("c", v))]);
        }),
        ("USER_MAP_MAX", USER_MAP_MAX as u64, "user_map", |p, v| {
            p.user_map = (0..v).map(|i| (format!("cn{i}"), format!("u{i}"))).collect();
        }),
        ("IDENTITY_NAME_BYTES_MAX", IDENTITY_NAME_BYTES_MAX as u64, "user_map", |p, v| {
            p.user_map = BTreeMap::from([("c".repeat(len(v)), "u".to_string())]);
        }),
        ("USER_DOMAINS_MAX", USER_DOMAINS_MAX as u64, "user_domains", |p, v| p.user_domains = names("d", v)),
        ("POOLS_MAX", POOLS_MAX as u64, "pools", |p, v| {
            let pool = |n: String| NodePool { nodes: vec![format!("{n}-node")], ..NodePool::default() };
            p.pools = names("pool", v).into_iter().map(|n| (n.clone(), pool(n))).collect();
        }),
        ("POOL_SECONDS_MAX", POOL_SECONDS_MAX, "pools", |p, v| {
            let pool = NodePool { nodes: vec!["n".into()], suspend_after_s: v, ..NodePool::default() };
            p.pools = BTreeMap::from([("pool".into(), pool)]);
        }),
        ("LICENSES_MAX", LICENSES_MAX as u64, "licenses", |p, v| {
            p.licenses = names("lic", v).into_iter().map(|n| (n, 1)).collect();
        }),
        ("LICENSE_LIMIT_SCOPES_MAX", LICENSE_LIMIT_SCOPES_MAX as u64, "account_licenses", |p, v| {
            p.licenses = BTreeMap::from([("lic".into(), 10)]);
            p.accounts = accounts(v);
            p.account_licenses =
                names("a", v).into_iter().map(|a| (a, BTreeMap::from([("lic".to_string(), 1)]))).collect();
        }),
        ("TOPOLOGY_LEVELS_MAX", TOPOLOGY_LEVELS_MAX as u64, "topology_levels", |p, v| {
            p.topology_levels = names("l", v);
        }),
    ];
    for (limit, value, field, set) in cases {
        let mut at = ClusterPolicy::default();
        set(&mut at, value);
        assert_eq!(at.validate(), Ok(()), "{limit}: a policy at {value} is refused");
        let mut past = ClusterPolicy::default();
        set(&mut past, value + 1);
        let refused = past.validate().expect_err(&format!("{limit}: a policy at {} is accepted", value + 1));
        let named = if field.ends_with('.') || field == "accounts.d" {
            refused.field.starts_with(field)
        } else {
            refused.field == field
        };
        assert!(named, "{limit}: one past it is refused for another field: {refused}");
        assert!(refused.rule.contains(&value.to_string()), "{limit}: refused by another rule: {refused}");
    }
}

/// Limits `apply` checks on commands besides a spec's and a policy's, on a
/// cluster at the newest format: each at its value is taken, one past it is
/// refused, the refusal naming the field and the limit.
#[test]
fn every_command_limit_holds_at_its_value_and_refuses_one_past() {
    use gangway_core::command::{SignalTarget, BATCH_COMMANDS_MAX};
    use gangway_core::limits::{IDEMPOTENCY_KEY_BYTES_MAX, SIGNAL_SEND_MAX, USAGE_BUCKETS_MAX};
    use gangway_core::state::UsageBucket;
    type Run = Box<dyn Fn(u64) -> Outcome>;
    fn newest() -> State {
        let mut s = State::default();
        s.apply(1, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 1 });
        s.apply(2, &Command::RegisterNode { spec: node_spec(0, 2), now_ms: 2 });
        s
    }
    let cases: [(&str, u64, &str, Run); 4] = [
        (
            "IDEMPOTENCY_KEY_BYTES_MAX",
            IDEMPOTENCY_KEY_BYTES_MAX as u64,
            "idempotency_key:",
            Box::new(|v| {
                let key = "k".repeat(len(v));
                let cmd = Command::SubmitJob {
                    spec: job_spec(1, 0, 1),
                    identity: "alice".into(),
                    idempotency_key: key,
                    now_ms: 10,
                };
                newest().apply(3, &cmd).outcome
            }),
        ),
        (
            "SIGNAL_SEND_MAX",
            SIGNAL_SEND_MAX as u64,
            "signal:",
            Box::new(|v| {
                let mut s = newest();
                let Outcome::Submitted { job_id, .. } = s.apply(3, &submit_cmd(job_spec(1, 0, 1))).outcome else {
                    panic!("the job was not submitted")
                };
                let plan = first_fit(&s, job_id, 0).expect("it fits");
                s.apply(4, &Command::ApplySchedule { preemptions: vec![], placements: vec![plan], now_ms: 11 });
                let change = JobChange::Signal { signal: v as i32, target: SignalTarget::Batch };
                s.apply(5, &Command::UpdateJob { job_id, change, identity: "alice".into(), now_ms: 12 }).outcome
            }),
        ),
        (
            "USAGE_BUCKETS_MAX",
            USAGE_BUCKETS_MAX as u64,
            "usage.ml:",
            Box::new(|v| {
                let buckets = (1..=v).map(|start_ms| UsageBucket { start_ms, gpu_ms: 1, cpu_ms: 1 }).collect();
                let usage = BTreeMap::from([("ml".to_string(), buckets)]);
                newest().apply(3, &Command::RestoreUsage { usage, identity: "server:1".into(), now_ms: 1_000 }).outcome
            }),
        ),
        (
            "BATCH_COMMANDS_MAX",
            BATCH_COMMANDS_MAX as u64,
            "batch:",
            Box::new(|v| {
                let cancel = Command::CancelJob { job_id: 999, identity: "alice".into(), now_ms: 10 };
                newest().apply(3, &Command::Batch(vec![cancel; len(v)])).outcome
            }),
        ),
    ];
    for (limit, value, says, run) in cases {
        let at = run(value);
        assert!(!matches!(at, Outcome::Refused(_)), "{limit}: at {value}: {at:?}");
        match run(value + 1) {
            Outcome::Refused(r) => assert!(
                r.message.starts_with(says) && r.message.contains(&value.to_string()),
                "{limit}: one past it is refused by another rule: {}",
                r.message
            ),
            other => panic!("{limit}: one past {value} is taken: {other:?}"),
        }
    }
    // What a task may report it used (checked before apply keeps it).
    use gangway_core::model::{TaskUsage, TASK_CPU_MS_MAX, TASK_MEM_MB_MAX};
    assert_eq!(TaskUsage { cpu_ms: TASK_CPU_MS_MAX, ..TaskUsage::default() }.check(), Ok(()));
    assert!(TaskUsage { cpu_ms: TASK_CPU_MS_MAX + 1, ..TaskUsage::default() }
        .check()
        .is_err_and(|e| e.contains("cpu_ms")));
    assert_eq!(TaskUsage { mem_peak_mb: TASK_MEM_MB_MAX, ..TaskUsage::default() }.check(), Ok(()));
    let over = TaskUsage { gpu_mem_peak_mb: TASK_MEM_MB_MAX + 1, ..TaskUsage::default() };
    assert!(over.check().is_err_and(|e| e.contains("gpu_mem_peak_mb")));
    // The users and accounts a reservation names.
    use gangway_core::limits::RESERVATION_NAMES_MAX;
    use gangway_core::reservation::check_request;
    for (field, set) in [("users", 0), ("accounts", 1)] {
        let named = |n: usize| {
            let mut r = full_reservation();
            let list = (0..n).map(|i| format!("x{i}")).collect();
            if set == 0 {
                r.users = list
            } else {
                r.accounts = list
            }
            check_request(&r, 0, 0)
        };
        assert_eq!(named(RESERVATION_NAMES_MAX), Ok(()), "{field} at {RESERVATION_NAMES_MAX}");
        let refused = named(RESERVATION_NAMES_MAX + 1).expect_err("one past is taken");
        assert_eq!(refused.field, field, "{refused}");
    }
    // The nodes a reservation holds (a whole fleet's worth).
    use gangway_core::limits::RESERVATION_NODES_MAX;
    let holding = |n: usize| {
        let r = gangway_core::reservation::ReservationRequest {
            nodes: (0..n).map(|i| format!("n{i}")).collect(),
            ..full_reservation()
        };
        check_request(&r, 0, 0)
    };
    assert_eq!(holding(RESERVATION_NODES_MAX), Ok(()));
    let refused = holding(RESERVATION_NODES_MAX + 1).expect_err("one node past is taken");
    assert_eq!((refused.field.as_str(), refused.rule.contains(&RESERVATION_NODES_MAX.to_string())), ("nodes", true));
    // The spec bytes an array copies into its elements: 1024 copies of 64
    // KiB come to ARRAY_SPEC_BYTES_MAX exactly; one byte more each is past it.
    // (Counted on the spec as apply completes it: a job's stored spec shows
    // what that adds, the account and partition named.)
    use gangway_core::limits::ARRAY_SPEC_BYTES_MAX;
    let completed = {
        let mut s = newest();
        let Outcome::Submitted { job_id, .. } = s.apply(3, &submit_cmd(job_spec(1, 0, 1))).outcome else {
            panic!("the job was not submitted")
        };
        s.jobs[&job_id].spec.size_bytes() - job_spec(1, 0, 1).size_bytes()
    };
    let array = |bytes: usize| {
        let with = |spec: JobSpec| JobSpec { array: "0-1023".into(), ..spec };
        let sent = bytes - completed;
        let spec = with(spec_of_size(sent - (with(spec_of_size(sent)).size_bytes() - sent)));
        assert_eq!(spec.size_bytes(), sent);
        newest().apply(3, &submit_cmd(spec)).outcome
    };
    let each = ARRAY_SPEC_BYTES_MAX / 1024;
    let at = array(each);
    assert!(matches!(at, Outcome::Submitted { .. }), "an array at the limit is refused: {at:?}");
    match array(each + 1) {
        Outcome::Refused(r) => {
            assert!(r.message.starts_with("array:") && r.message.contains(&ARRAY_SPEC_BYTES_MAX.to_string()))
        }
        other => panic!("an array one byte past the limit per copy is taken: {other:?}"),
    }
    // The cluster's unfinished jobs. A million real jobs would take this test
    // gigabytes; the rule counts the pending and running sets, so they are
    // filled with ids of jobs that are not there.
    use gangway_core::limits::ACTIVE_JOBS_MAX;
    let mut s = newest();
    s.pending.extend((1_000_000_000..).take(ACTIVE_JOBS_MAX - 2));
    s.running.insert(999_999_999);
    assert!(matches!(s.apply(3, &submit_cmd(job_spec(1, 0, 1))).outcome, Outcome::Submitted { .. }), "at the limit");
    match s.apply(4, &submit_cmd(job_spec(1, 0, 1))).outcome {
        Outcome::Refused(r) => {
            assert!(r.message.contains(&format!("holds {ACTIVE_JOBS_MAX} unfinished jobs")), "{r:?}")
        }
        other => panic!("one job past ACTIVE_JOBS_MAX is taken: {other:?}"),
    }
}

/// A node spec's limits, as `every_spec_limit_holds_at_its_value_and_refuses_one_past`
/// checks a job spec's: what an agent registers is accepted at each limit and
/// refused one past it, naming the field and the limit.
#[test]
fn every_node_spec_limit_holds_at_its_value_and_refuses_one_past() {
    use gangway_core::limits::*;
    type NodeLimitCase = (&'static str, u64, &'static str, fn(&mut NodeSpec, u64));
    let cases: [NodeLimitCase; 6] = [
        ("NAME_BYTES_MAX", NAME_BYTES_MAX as u64, "name", |s, v| s.name = "n".repeat(len(v))),
        ("CPUS_PER_TASK_MAX × 4", u64::from(CPUS_PER_TASK_MAX) * 4, "cpus", |s, v| s.cpus = v as u32),
        ("MEM_PER_NODE_MB_MAX", MEM_PER_NODE_MB_MAX, "mem_mb", |s, v| s.mem_mb = v),
        ("GPUS_PER_NODE_MAX", u64::from(GPUS_PER_NODE_MAX), "gpus", |s, v| *s = node_spec(0, len(v))),
        ("TOPOLOGY_LEVELS_MAX", TOPOLOGY_LEVELS_MAX as u64, "topology", |s, v| {
            s.topology = (0..v).map(|i| format!("level-{i}")).collect();
        }),
        ("LABELS_PER_NODE_MAX", LABELS_PER_NODE_MAX as u64, "labels", |s, v| {
            s.labels = (0..v).map(|i| (format!("k{i}"), "v".to_string())).collect();
        }),
    ];
    for (limit, value, field, set) in cases {
        let mut at = node_spec(0, 2);
        set(&mut at, value);
        assert_eq!(at.validate(), Ok(()), "{limit}: a node at {value} is refused");
        let mut past = node_spec(0, 2);
        set(&mut past, value + 1);
        let refused = past.validate().expect_err(&format!("{limit}: a node at {} is accepted", value + 1));
        assert_eq!(refused.field, field, "{limit}: refused for another field: {refused}");
        assert!(refused.rule.contains(&value.to_string()), "{limit}: refused by another rule: {refused}");
    }
}

/// Each of the leader's per-tick duties stops at its limit: with as many
/// jobs past their time limit or deadline, or nodes silent, as the limit,
/// one tick ends them all; with one more, it ends the limit's worth (the
/// next tick takes the rest).
#[test]
fn each_leader_duty_stops_at_its_limit_per_tick() {
    use gangway_core::duties::{
        deadline_ends, silent_nodes, time_limit_ends, Heard, TaskReport, DOWN_PER_TICK_MAX, TIMEOUTS_PER_TICK_MAX,
    };
    let mut s = State::default();
    s.apply(1, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 1 });
    // One node past the silence limit; their CPUs hold one job past the
    // time-limit one.
    const { assert!(TIMEOUTS_PER_TICK_MAX < 16 * DOWN_PER_TICK_MAX, "the nodes cannot hold the jobs") };
    for i in 0..DOWN_PER_TICK_MAX + 1 {
        s.apply(2, &Command::RegisterNode { spec: node_spec(i, 0), now_ms: 2 });
    }
    // Nodes: every one silent, then all but one.
    let runs = |_: &str, _: JobId| -> Option<TaskReport> { None };
    let silent = |s: &State, heard_n0: bool| {
        let last = |name: &str| (heard_n0 && name == "n0").then_some(100_000);
        let heard =
            Heard { now: 100_000, leader_since: 0, down_timeout_ms: 10_000, last: &last, index: 2, runs: &runs };
        silent_nodes(s, &heard, 100)
    };
    assert_eq!(silent(&s, false).len(), DOWN_PER_TICK_MAX, "one node past the limit");
    let at = silent(&s, true);
    assert_eq!(at.len(), DOWN_PER_TICK_MAX, "at the limit every silent node is marked");
    assert!(at.iter().all(|c| !matches!(c, Command::SetNodeState { name, .. } if name == "n0")));
    // Jobs: running past their time limit, and pending past their deadline.
    let submit = |s: &mut State, deadline_ms: u64| {
        let spec = JobSpec { time_limit_s: 60, deadline_ms, ..job_spec(1, 0, 1) };
        let Outcome::Submitted { job_id, .. } = s.apply(3, &submit_cmd(spec)).outcome else { panic!("refused") };
        job_id
    };
    let mut running = Vec::new();
    for _ in 0..TIMEOUTS_PER_TICK_MAX + 1 {
        let job_id = submit(&mut s, 0);
        let plan = first_fit(&s, job_id, 0).expect("a node is free");
        s.apply(4, &Command::ApplySchedule { preemptions: vec![], placements: vec![plan], now_ms: 11 });
        running.push(job_id);
    }
    let waiting: Vec<JobId> = (0..TIMEOUTS_PER_TICK_MAX + 1).map(|_| submit(&mut s, 1_000_000)).collect();
    let later = 10_000_000;
    assert_eq!(time_limit_ends(&s, later).len(), TIMEOUTS_PER_TICK_MAX, "one job past the limit");
    assert_eq!(deadline_ends(&s, later).len(), TIMEOUTS_PER_TICK_MAX, "one job past the limit");
    for job_id in [running[0], waiting[0]] {
        s.apply(5, &Command::CancelJob { job_id, identity: "alice".into(), now_ms: 12 });
    }
    let ended = time_limit_ends(&s, later);
    assert_eq!(ended.len(), TIMEOUTS_PER_TICK_MAX, "at the limit every job past its time is ended");
    assert!(ended.iter().all(
        |c| matches!(c, Command::JobFinished { job_id, state: JobState::TimedOut, .. } if running[1..].contains(job_id))
    ));
    let ended = deadline_ends(&s, later);
    assert_eq!(ended.len(), TIMEOUTS_PER_TICK_MAX, "at the limit every job past its deadline is ended");
    assert!(ended.iter().all(
        |c| matches!(c, Command::JobFinished { job_id, state: JobState::Deadline, .. } if waiting[1..].contains(job_id))
    ));
}

/// A scheduling pass stops at its limits: at most PLACEMENTS_PER_PLAN_MAX
/// placements in one plan (at the limit every job that fits is placed), and
/// at most PLACE_ATTEMPTS_PER_PASS_MAX placement attempts (at the limit
/// every job of a shape of its own is tried; one more is examined but not
/// tried, and waits for the next pass).
#[test]
fn a_scheduling_pass_stops_at_its_limits() {
    use gangway_core::sched::{plan, Options, Pending, Policy, PLACEMENTS_PER_PLAN_MAX, PLACE_ATTEMPTS_PER_PASS_MAX};
    let cluster = |jobs: usize, spec: &dyn Fn(usize) -> JobSpec| {
        let mut s = State::default();
        s.apply(1, &Command::SetDataFormat { format: gangway_core::format::FORMAT_NEWEST, now_ms: 1 });
        for i in 0..PLACEMENTS_PER_PLAN_MAX / 16 + 2 {
            s.apply(2, &Command::RegisterNode { spec: node_spec(i, 0), now_ms: 2 });
        }
        for i in 0..jobs {
            assert!(matches!(s.apply(3, &submit_cmd(spec(i))).outcome, Outcome::Submitted { .. }));
        }
        plan(&s, &Options::new(Policy::Easy, 5))
    };
    let one_cpu = |_: usize| job_spec(1, 0, 1);
    assert_eq!(cluster(PLACEMENTS_PER_PLAN_MAX, &one_cpu).placements.len(), PLACEMENTS_PER_PLAN_MAX);
    let past = cluster(PLACEMENTS_PER_PLAN_MAX + 1, &one_cpu);
    assert_eq!(past.placements.len(), PLACEMENTS_PER_PLAN_MAX, "one job past the plan's limit");
    // Shapes no node holds (a feature none has), each its own (its memory).
    let nowhere =
        |i: usize| JobSpec { constraints: vec!["nowhere".into()], mem_per_node_mb: 1 + i as u64, ..job_spec(1, 0, 1) };
    let at = cluster(PLACE_ATTEMPTS_PER_PASS_MAX, &nowhere);
    assert_eq!(at.place_attempts, PLACE_ATTEMPTS_PER_PASS_MAX);
    assert!(at.reasons.iter().all(|(_, why)| *why == Pending::BadConstraints), "every job was tried");
    let past = cluster(PLACE_ATTEMPTS_PER_PASS_MAX + 1, &nowhere);
    assert_eq!(
        (past.place_attempts, past.examined),
        (PLACE_ATTEMPTS_PER_PASS_MAX, PLACE_ATTEMPTS_PER_PASS_MAX + 1),
        "the job one past the limit is examined, not tried"
    );
}

/// Node admission (format 17): with an inventory, a node registers only
/// under its class's bounds, the difference named when it claims more;
/// names no class lists and retired names are refused; an edit that leaves
/// a node out takes it down and requeues its jobs; only admins edit it, at
/// the version they read, and a refused registration changes nothing.
#[test]
fn nodes_are_admitted_not_self_declared() {
    use gangway_core::format::NODE_ADMISSION_FORMAT;
    use gangway_core::inventory::{NodeClass, NodeInventory};
    use gangway_core::state::RefusalKind;
    let mut s = State::default();
    assert!(matches!(
        s.apply(1, &Command::SetDataFormat { format: NODE_ADMISSION_FORMAT - 1, now_ms: 1 }).outcome,
        Outcome::DataFormatSet { .. }
    ));
    let class = NodeClass {
        nodes: vec!["gpu[01-04]".into()],
        cpus: 64,
        mem_mb: 512 * 1024,
        gpus: 8,
        gpu_model: "h100-80gb".into(),
        labels: BTreeMap::from([("ib".into(), "*".into())]),
        topology: vec!["zone-a".into()],
    };
    let inventory = NodeInventory { classes: BTreeMap::from([("h100".into(), class)]), ..NodeInventory::default() };
    let set = |inventory: &NodeInventory, identity: &str, expected: Option<u64>| Command::SetNodeInventory {
        inventory: inventory.clone(),
        expected_version: expected,
        identity: identity.into(),
        now_ms: 5,
    };
    // Not before format 17 (a replica of format 16 could not hold it).
    assert_eq!(refused_kind(&s.apply(2, &set(&inventory, "server:1", None))), Some(RefusalKind::FailedPrecondition));
    s.apply(3, &Command::SetDataFormat { format: NODE_ADMISSION_FORMAT, now_ms: 3 });
    // An empty inventory admits what registers (every cluster until an admin sets one).
    let mut open = node_spec(9, 16);
    open.name = "anything".into();
    assert_eq!(refused_kind(&s.apply(4, &Command::RegisterNode { spec: open, now_ms: 4 })), None);
    // Only admins, at the version read.
    assert_eq!(refused_kind(&s.apply(5, &set(&inventory, "client:alice", None))), Some(RefusalKind::PermissionDenied));
    assert_eq!(refused_kind(&s.apply(5, &set(&inventory, "server:1", Some(7)))), Some(RefusalKind::Stale));
    let applied = s.apply(6, &set(&inventory, "server:1", Some(0)));
    // The node registered before the inventory is in no class: down at once.
    let Outcome::NodeInventorySet { version: 1, revoked } = &applied.outcome else { panic!("{:?}", applied.outcome) };
    assert_eq!(revoked, &vec!["anything".to_string()]);
    assert_eq!(s.nodes["anything"].state, gangway_core::model::NodeState::Down);
    let gpu = |name: &str, gpus: usize| {
        let mut spec = node_spec(0, gpus);
        spec.name = name.into();
        spec
    };
    let register = |s: &mut State, spec: NodeSpec| {
        let before = s.clone();
        let applied = s.apply(10, &Command::RegisterNode { spec, now_ms: 10 });
        if refused_kind(&applied).is_some() {
            s.clock_ms = before.clock_ms;
            assert_eq!(*s, before, "a refused registration changed the state");
        }
        (refused_kind(&applied), format!("{:?}", applied.outcome))
    };
    assert_eq!(register(&mut s, gpu("gpu01", 8)).0, None);
    let mut labelled = gpu("gpu04", 4);
    labelled.labels.insert("ib".into(), "hdr".into());
    assert_eq!(register(&mut s, labelled).0, None);
    let refusals: Vec<(&str, NodeSpec, &str)> = vec![
        ("16 H100s", gpu("gpu02", 16), "gpus: node gpu02 claims 16 GPUs; its class h100 allows at most 8"),
        (
            "a secure label it was not given",
            {
                let mut n = gpu("gpu02", 8);
                n.labels.insert("secure".into(), "yes".into());
                n
            },
            "labels.secure: node gpu02 claims the label secure",
        ),
        (
            "another model",
            {
                let mut n = gpu("gpu02", 2);
                n.gpus[1].model = "b200".into();
                n
            },
            "gpus[1].model: node gpu02 claims a GPU of model b200; its class h100 allows only h100-80gb",
        ),
        (
            "more CPUs",
            {
                let mut n = gpu("gpu02", 0);
                n.cpus = 65;
                n
            },
            "cpus: node gpu02 claims 65",
        ),
        (
            "more memory",
            {
                let mut n = gpu("gpu02", 0);
                n.mem_mb = 512 * 1024 + 1;
                n
            },
            "mem_mb: node gpu02 claims 524289 MiB",
        ),
        (
            "another zone",
            {
                let mut n = gpu("gpu02", 0);
                n.topology = vec!["zone-b".into()];
                n
            },
            "topology: node gpu02 claims the topology zone-b",
        ),
        ("a name no class lists", gpu("gpu05", 0), "node gpu05 is in no node class"),
    ];
    for (what, spec, says) in refusals {
        let (kind, outcome) = register(&mut s, spec);
        assert_eq!(kind, Some(RefusalKind::PermissionDenied), "{what}: {outcome}");
        assert!(outcome.contains(says), "{what}: {outcome} should say {says}");
    }
    // gpu01 runs a job; retiring it takes the node down and requeues the job.
    let submitted = s.apply(20, &submit_cmd(job_spec(1, 1, 1)));
    let Outcome::Submitted { job_id, .. } = submitted.outcome else { panic!("{:?}", submitted.outcome) };
    let p = gangway_core::sched::plan(&s, &gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, 21));
    s.apply(21, &Command::ApplySchedule { preemptions: p.preemptions, placements: p.placements, now_ms: 21 });
    assert_eq!(s.jobs[&job_id].state, JobState::Running);
    let on = s.jobs[&job_id].allocation.as_ref().unwrap().nodes[0].node.clone();
    let mut retiring = inventory.clone();
    retiring.retired.insert(on.clone());
    let applied = s.apply(22, &set(&retiring, "server:1", Some(1)));
    let Outcome::NodeInventorySet { version: 2, revoked } = &applied.outcome else { panic!("{:?}", applied.outcome) };
    assert_eq!(revoked, &vec![on.clone()]);
    assert_eq!(s.nodes[&on].state, gangway_core::model::NodeState::Down);
    assert!(s.nodes[&on].state_reason.contains("retired"), "{}", s.nodes[&on].state_reason);
    assert_eq!(s.jobs[&job_id].state, JobState::Pending, "requeued off the retired node");
    // A decommissioned node's certificate still registers its name: refused.
    let (kind, outcome) = register(&mut s, gpu(&on, 8));
    assert_eq!(kind, Some(RefusalKind::PermissionDenied), "{outcome}");
    assert!(outcome.contains("retired"), "{outcome}");
    // A tightened class takes down the nodes that claim more than it allows.
    let mut labelled = gpu("gpu03", 2);
    labelled.labels.insert("ib".into(), "ndr".into());
    assert_eq!(register(&mut s, labelled).0, None);
    let mut tighter = retiring.clone();
    tighter.classes.get_mut("h100").unwrap().labels.clear();
    let up_with_labels: Vec<String> = s
        .nodes
        .values()
        .filter(|n| !n.labels.is_empty() && n.state != gangway_core::model::NodeState::Down)
        .map(|n| n.name.clone())
        .collect();
    assert!(up_with_labels.contains(&"gpu03".to_string()));
    let applied = s.apply(23, &set(&tighter, "server:1", None));
    let Outcome::NodeInventorySet { revoked, .. } = &applied.outcome else { panic!("{:?}", applied.outcome) };
    assert_eq!(revoked, &up_with_labels);
    s.check_invariants().unwrap();
    // The inventory survives a snapshot.
    let back = gangway_core::snapshot::decode(&gangway_core::snapshot::encode(&s)).unwrap();
    assert_eq!(back.node_inventory, s.node_inventory);
}

/// The inventory's own limits, each at the limit and one past.
#[test]
fn node_inventory_limits() {
    use gangway_core::inventory::*;
    let class =
        |nodes: usize| NodeClass { nodes: (0..nodes).map(|i| format!("n{i}")).collect(), ..NodeClass::default() };
    let classes = |count: usize, nodes: usize| NodeInventory {
        classes: (0..count).map(|i| (format!("c{i}"), class(nodes))).collect(),
        ..NodeInventory::default()
    };
    assert!(classes(NODE_CLASSES_MAX, 1).validate().is_ok());
    let e = classes(NODE_CLASSES_MAX + 1, 1).validate().unwrap_err();
    assert_eq!(e.field, "classes");
    assert!(classes(2, INVENTORY_PATTERNS_MAX / 2).validate().is_ok());
    let mut over = classes(2, INVENTORY_PATTERNS_MAX / 2);
    over.classes.get_mut("c0").unwrap().nodes.push("extra".into());
    let e = over.validate().unwrap_err();
    assert!(e.rule.contains(&format!("{}", INVENTORY_PATTERNS_MAX + 1)), "{e}");
    let retired =
        |n: usize| NodeInventory { retired: (0..n).map(|i| format!("r{i}")).collect(), ..NodeInventory::default() };
    assert!(retired(RETIRED_NODES_MAX).validate().is_ok());
    assert_eq!(retired(RETIRED_NODES_MAX + 1).validate().unwrap_err().field, "retired");
    // Bytes in all: at the limit, and one past.
    let long = |bytes: usize| {
        let names = bytes / 200;
        let mut retired: std::collections::BTreeSet<String> = (0..names).map(|i| format!("{i:0>200}")).collect();
        retired.insert("x".repeat(bytes - names * 200));
        NodeInventory { retired, ..NodeInventory::default() }
    };
    assert_eq!(long(INVENTORY_BYTES_MAX).bytes(), INVENTORY_BYTES_MAX);
    assert!(long(INVENTORY_BYTES_MAX).validate().is_ok());
    assert_eq!(long(INVENTORY_BYTES_MAX + 1).validate().unwrap_err().field, "inventory");
    // Each field's rule, named.
    let bad: Vec<(&str, NodeClass)> = vec![
        ("classes.c.nodes", NodeClass::default()),
        ("classes.c.cpus", NodeClass { cpus: 0, ..class(1) }),
        ("classes.c.gpus", NodeClass { gpus: gangway_core::limits::GPUS_PER_NODE_MAX + 1, ..class(1) }),
        ("classes.c.gpu_model", NodeClass { gpu_model: "H100 !".into(), ..class(1) }),
        ("classes.c.nodes", NodeClass { nodes: vec!["a\u{1b}[2J".into()], ..NodeClass::default() }),
    ];
    for (field, c) in bad {
        let inv = NodeInventory { classes: BTreeMap::from([("c".into(), c)]), ..NodeInventory::default() };
        assert_eq!(inv.validate().unwrap_err().field, field);
    }
}

/// The leader's side of a heartbeat, as the gRPC handler and the simulation
/// both run it: orders for a known, recently heard node; none for an
/// unknown, Down or too-silent one; a wait for an agent ahead of this state
/// (unless it counts in another history); GPU health as level-triggered
/// changes.
#[test]
fn a_heartbeat_is_answered_by_the_core() {
    use gangway_core::duties::{gpu_health_changes, on_heartbeat, Heartbeat, HeartbeatReply};
    let s = base_state();
    let node = s.nodes.keys().next().unwrap().clone();
    let running: std::collections::BTreeSet<_> = s.nodes[&node].jobs.iter().map(|j| (*j, s.jobs[j].attempt)).collect();
    assert!(!running.is_empty(), "the base state runs a job on {node}");
    let hb = Heartbeat { node: node.clone(), running: running.clone(), seen_index: 5, ..Heartbeat::default() };
    let HeartbeatReply::Orders { orders, seen_index, jobs } = on_heartbeat(&s, 10, 0, 1_000, &hb) else {
        panic!("a heard node got no orders")
    };
    assert_eq!(seen_index, 5);
    assert_eq!(jobs, running.iter().map(|t| t.0).collect());
    assert!(orders.known && running.iter().all(|t| orders.desired.contains(t)), "{orders:?}");
    // Silent past the timeout: it may already be on its way Down.
    assert_eq!(on_heartbeat(&s, 10, 1_001, 1_000, &hb), HeartbeatReply::RegisterAgain);
    let unknown = Heartbeat { node: "nowhere".into(), ..hb.clone() };
    assert_eq!(on_heartbeat(&s, 10, 0, 1_000, &unknown), HeartbeatReply::RegisterAgain);
    let mut down = s.clone();
    down.nodes.get_mut(&node).unwrap().state = gangway_core::model::NodeState::Down;
    assert_eq!(on_heartbeat(&down, 10, 0, 1_000, &hb), HeartbeatReply::RegisterAgain);
    // Ahead of this state: wait; counting in another history: from 0.
    let ahead = Heartbeat { seen_index: 11, ..hb.clone() };
    assert_eq!(on_heartbeat(&s, 10, 0, 1_000, &ahead), HeartbeatReply::Behind { index: 10, seen_index: 11 });
    let elsewhere = Heartbeat { history: 77, ..ahead };
    assert!(matches!(on_heartbeat(&s, 10, 0, 1_000, &elsewhere), HeartbeatReply::Orders { seen_index: 0, .. }));
    // GPU health: only what differs, within the node's GPUs, the reason cut
    // on a character boundary.
    let report = |gpu_health: Vec<(u32, bool, String)>| Heartbeat { gpu_health, ..hb.clone() };
    assert!(gpu_health_changes(&s, &report(vec![(0, true, String::new())]), 7, 64).is_empty());
    assert!(gpu_health_changes(&s, &report(vec![(99, false, "gone".into())]), 7, 64).is_empty());
    let changes = gpu_health_changes(&s, &report(vec![(1, false, "é".repeat(10))]), 7, 5);
    assert_eq!(
        changes,
        vec![Command::SetGpuHealth { node: node.clone(), gpu: 1, healthy: false, reason: "éé".into(), now_ms: 7 }]
    );
}

/// Issue 35: why an attempt stopped is a typed fact from format 18. A
/// preempted victim's tasks get their QOS's grace from the cause, not from
/// the words of its reason; node, GPU, time-limit, cancel and requeue stops
/// are typed too; a new start clears the cause; a snapshot keeps it; a
/// state of format 17 keeps its old rules (no cause, the words decide),
/// and its preempted jobs get their cause on the move to 18.
#[test]
fn stop_causes_are_typed_facts_from_format_18() {
    use gangway_core::duties::{node_orders, stopped_by_preemption};
    use gangway_core::format::STOP_CAUSE_FORMAT;
    use gangway_core::policy::{ClusterPolicy, PreemptMode, Qos};
    use gangway_core::StopCause;
    let setup = |format: u32| {
        let mut s = State::default();
        s.apply(1, &Command::SetDataFormat { format, now_ms: 1 });
        let mut policy = ClusterPolicy::default();
        let low = Qos { preempt_mode: PreemptMode::Requeue, preempt_grace_s: 45, ..Qos::default() };
        policy.qos.insert("low".into(), low);
        policy.qos.insert("high".into(), Qos { priority: 10, preempt: vec!["low".into()], ..Qos::default() });
        let update = Command::UpdatePolicy {
            policy,
            expected_version: None,
            force: true,
            identity: "server:1".into(),
            now_ms: 2,
        };
        assert!(matches!(s.apply(2, &update).outcome, Outcome::PolicyUpdated { .. }));
        for i in 0..2 {
            s.apply(3 + i as u64, &Command::RegisterNode { spec: node_spec(i, 8), now_ms: 3 });
        }
        let submit = |qos: &str| {
            let mut spec = job_spec(1, 8, 1);
            spec.qos = qos.into();
            spec.requeue = true;
            Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 4 }
        };
        s.apply(5, &submit("low"));
        s.apply(6, &submit("low"));
        let opts = gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, 5);
        let first = gangway_core::sched::plan(&s, &opts);
        s.apply(7, &Command::ApplySchedule { preemptions: vec![], placements: first.placements, now_ms: 5 });
        assert_eq!((s.jobs[&1].state, s.jobs[&2].state), (JobState::Running, JobState::Running));
        s.apply(8, &submit("high"));
        let plan = gangway_core::sched::plan(&s, &opts);
        assert_eq!(plan.preemptions.len(), 1, "{plan:?}");
        let victim = plan.preemptions[0].job_id;
        let node = s.jobs[&victim].ran_on[0].clone();
        let cmd = Command::ApplySchedule { preemptions: plan.preemptions, placements: plan.placements, now_ms: 6 };
        s.apply(9, &cmd);
        s.check_invariants().unwrap();
        (s, victim, node)
    };

    // Format 18: the cause is typed, and the leader's orders read it.
    let (mut s, victim, node) = setup(STOP_CAUSE_FORMAT);
    assert_eq!(s.jobs[&victim].state, JobState::Pending);
    assert_eq!(s.jobs[&victim].stop_cause, Some(StopCause::Preempted { by: 3 }));
    assert_eq!(s.jobs[&victim].reason, "requeued: preempted by job 3", "the words people read are the same");
    let running = std::collections::BTreeSet::from([(victim, 1)]);
    let stops = |s: &State| node_orders(s, &node, &running).stops;
    assert_eq!(stops(&s).len(), 1);
    assert_eq!(stops(&s)[0].grace_s, 45, "a preempted task gets its QOS's grace");
    // The words alone decide nothing any more.
    let mut words_only = s.clone();
    words_only.jobs.get_mut(&victim).unwrap().stop_cause = None;
    assert!(stops(&words_only).is_empty(), "format 18 reads the cause, not the reason's words");
    assert!(!stopped_by_preemption(STOP_CAUSE_FORMAT, &words_only.jobs[&victim]));
    // A snapshot keeps the cause.
    let back = gangway_core::snapshot::decode(&gangway_core::snapshot::encode(&s)).unwrap();
    assert_eq!(back, s);
    assert_eq!(back.jobs[&victim].stop_cause, Some(StopCause::Preempted { by: 3 }));

    // The other causes, each from the entry that stops the attempt.
    let other = if victim == 1 { 2 } else { 1 };
    let other_node = s.jobs[&other].ran_on[0].clone();
    s.apply(
        10,
        &Command::SetNodeState {
            name: other_node.clone(),
            change: NodeStateChange::Down,
            reason: "lost".into(),
            now_ms: 7,
        },
    );
    assert_eq!(s.jobs[&other].stop_cause, Some(StopCause::NodeFailed { node: other_node.clone() }));
    assert_eq!(s.jobs[&other].state, JobState::Pending, "requeued");
    s.apply(11, &Command::CancelJob { job_id: other, identity: "alice".into(), now_ms: 8 });
    assert_eq!(s.jobs[&other].stop_cause, Some(StopCause::CancelledBy { identity: "alice".into() }));
    // The preemptor runs: out of time, then its cause says so.
    let attempt = s.jobs[&3].attempt;
    let timeout = Command::JobFinished {
        job_id: 3,
        attempt,
        state: JobState::TimedOut,
        exit_code: None,
        reason: "time limit of 0:01:00 reached".into(),
        now_ms: 9,
    };
    s.apply(12, &timeout);
    assert_eq!(s.jobs[&3].stop_cause, Some(StopCause::TimeLimit));
    // The victim starts again: its cause is cleared.
    let opts = gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, 10);
    let again = gangway_core::sched::plan(&s, &opts);
    s.apply(13, &Command::ApplySchedule { preemptions: vec![], placements: again.placements, now_ms: 10 });
    assert_eq!(s.jobs[&victim].state, JobState::Running);
    assert_eq!(s.jobs[&victim].stop_cause, None, "a new attempt has not stopped");
    let requeue = Command::UpdateJob {
        job_id: victim,
        change: JobChange::Requeue { hold: false },
        identity: "server:1".into(),
        now_ms: 11,
    };
    s.apply(14, &requeue);
    assert_eq!(s.jobs[&victim].stop_cause, Some(StopCause::RequeuedBy { identity: "server:1".into() }));
    s.check_invariants().unwrap();

    // Format 17: no cause; the same words, which still decide the grace.
    let (s17, victim17, node17) = setup(STOP_CAUSE_FORMAT - 1);
    assert_eq!(s17.jobs[&victim17].stop_cause, None);
    assert_eq!(s17.jobs[&victim17].reason, "requeued: preempted by job 3");
    let running17 = std::collections::BTreeSet::from([(victim17, 1)]);
    assert_eq!(node_orders(&s17, &node17, &running17).stops.len(), 1);
    assert_eq!(gangway_core::snapshot::decode(&gangway_core::snapshot::encode(&s17)).unwrap(), s17);
    // The move to 18 types the words it finds.
    let mut moved = s17.clone();
    moved.apply(10, &Command::SetDataFormat { format: STOP_CAUSE_FORMAT, now_ms: 7 });
    assert_eq!(moved.jobs[&victim17].stop_cause, Some(StopCause::Preempted { by: 3 }));
    assert_eq!(node_orders(&moved, &node17, &running17).stops.len(), 1);
    assert_eq!(StopCause::legacy_preemptor("requeued: preempted by job 12_3 (grace)"), Some(12));
    assert_eq!(StopCause::legacy_preemptor("preempted by job x"), None);
}

/// The core's source files by module: each top-level module (a file of
/// `src/`, or a folder with everything in it) and its non-test text (a
/// file's `#[cfg(test)] mod tests` and the `tests.rs`/`*_tests.rs` files
/// left out, and comment lines).
fn core_modules() -> BTreeMap<String, String> {
    let src = manifest_dir().join("src");
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap().to_string_lossy().to_string();
            let file = rel.rsplit('/').next().unwrap_or_default();
            if !rel.ends_with(".rs") || rel == "lib.rs" || file == "tests.rs" || file.ends_with("_tests.rs") {
                continue;
            }
            let module = rel.split(['/', '.']).next().unwrap().to_string();
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("\n#[cfg(test)]\nmod tests").next().unwrap_or_default();
            let code: Vec<&str> = code.lines().filter(|l| !l.trim_start().starts_with("//")).collect();
            let entry = out.entry(module).or_default();
            entry.push_str(&code.join("\n"));
            entry.push('\n');
        }
    }
    out
}

/// Which of the core's modules each one names (`crate::NAME`, or
/// `crate::{NAME, ...}`): its dependencies inside the crate.
fn core_module_graph() -> BTreeMap<String, std::collections::BTreeSet<String>> {
    let modules = core_modules();
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut graph = BTreeMap::new();
    for (name, text) in &modules {
        let mut deps = std::collections::BTreeSet::new();
        for (i, _) in text.match_indices("crate::") {
            let rest = &text[i + "crate::".len()..];
            let names: Vec<String> = match rest.strip_prefix('{') {
                Some(list) => list.split('}').next().unwrap_or_default().split(',').map(|p| ident(p.trim())).collect(),
                None => vec![ident(rest)],
            };
            deps.extend(names.into_iter().filter(|d| d != name && modules.contains_key(d)));
        }
        graph.insert(name.clone(), deps);
    }
    graph
}

/// The groups of `graph`'s modules that depend on each other in a cycle
/// (strongly connected components of more than one module), each sorted.
fn module_cycles(graph: &BTreeMap<String, std::collections::BTreeSet<String>>) -> Vec<Vec<String>> {
    let mut reach: BTreeMap<&String, std::collections::BTreeSet<&String>> =
        graph.iter().map(|(m, d)| (m, d.iter().collect())).collect();
    loop {
        let mut grown = false;
        for m in graph.keys() {
            let more: Vec<&String> = reach[m].iter().flat_map(|d| reach[*d].iter().copied()).collect();
            let r = reach.get_mut(m).unwrap();
            for d in more {
                grown |= r.insert(d);
            }
        }
        if !grown {
            break;
        }
    }
    let mut cycles: Vec<Vec<String>> = Vec::new();
    for m in graph.keys() {
        let mut group: Vec<String> =
            reach[m].iter().filter(|d| reach[**d].contains(m)).map(|d| d.to_string()).collect();
        if group.is_empty() {
            continue;
        }
        if !group.contains(m) {
            group.push(m.clone());
        }
        group.sort();
        if !cycles.contains(&group) {
            cycles.push(group);
        }
    }
    cycles
}

/// Architecture Invariant: the core's modules depend on each other in no
/// cycle but the named ones, each with its reason (a ratchet: a new cycle
/// fails, and so does one that went without its entry going too). Read
/// from the sources' `crate::` paths (`cargo modules` is not installed
/// here); `gangway-core`'s own test prints the graph.
#[test]
fn the_core_has_no_module_cycles_but_the_named_ones() {
    // None today: the format constants (`format`) depend on nothing, the
    // log entry's codec is `payload`, and the types several modules share
    // (`TaskKey`, `SignalTarget`, `UsageBucket`, `StopCause`) live in `model`.
    let named: Vec<(Vec<&str>, &str)> = vec![];
    let graph = core_module_graph();
    let cycles = module_cycles(&graph);
    for (m, deps) in &graph {
        eprintln!("{m} -> {deps:?}");
    }
    let mut want: Vec<Vec<String>> = named.iter().map(|(g, _)| g.iter().map(|s| s.to_string()).collect()).collect();
    want.sort();
    let mut got = cycles.clone();
    got.sort();
    assert_eq!(got, want, "the core's module cycles changed: name a new one with its reason, or drop one that went");
    assert!(graph.len() >= 15, "the core's modules were not all read: {:?}", graph.keys());
    // The finder finds: a cycle through three modules, beside a module
    // outside it, and the core's graph with one edge back.
    let edges = |pairs: &[(&str, &str)]| {
        let mut g: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
        for (a, b) in pairs {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    let three = edges(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]);
    assert_eq!(module_cycles(&three), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
    let mut back = graph.clone();
    back.get_mut("model").unwrap().insert("state".into());
    assert!(module_cycles(&back).iter().any(|c| c.contains(&"model".to_string()) && c.contains(&"state".to_string())));
}

/// Every function of the core's non-test code with its length in lines
/// (from its `fn` line to the `}` at its indentation, as rustfmt writes
/// them): (file, name, lines).
fn core_function_lengths() -> Vec<(String, String, usize)> {
    let src = manifest_dir().join("src");
    let mut out = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap().to_string_lossy().to_string();
            let file = rel.rsplit('/').next().unwrap_or_default();
            if !rel.ends_with(".rs") || file == "tests.rs" || file.ends_with("_tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("\n#[cfg(test)]\nmod tests").next().unwrap_or_default();
            let lines: Vec<&str> = code.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                let body = line.trim_start();
                let indent = &line[..line.len() - body.len()];
                let after = ["pub fn ", "pub(crate) fn ", "pub(super) fn ", "fn ", "const fn ", "pub const fn "]
                    .iter()
                    .find_map(|p| body.strip_prefix(p));
                let Some(after) = after else { continue };
                let name: String = after.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                // A declaration without a body (a trait's) ends with `;` first.
                let opens = lines[i..].iter().find(|l| l.trim_end().ends_with('{') || l.trim_end().ends_with(';'));
                if opens.is_none_or(|l| l.trim_end().ends_with(';')) {
                    continue;
                }
                let close = format!("{indent}}}");
                let Some(end) = lines[i..].iter().position(|l| *l == close) else { continue };
                out.push((rel.clone(), name, end + 1));
            }
        }
    }
    out
}

/// Lines of non-test code one file of the core may hold: past it, a file
/// holds several rooms' things (issue 35's reviewer).
const CORE_FILE_LINES_MAX: usize = 1_000;

/// Architecture Invariant: no file of the core holds more than
/// CORE_FILE_LINES_MAX lines of non-test code but the named ones, each with
/// its reason (a ratchet, as for functions).
#[test]
fn core_files_stay_within_their_budget_but_the_named_ones() {
    let named: &[(&str, &str)] = &[
        (
            "state/mod.rs",
            "State itself, apply's dispatch and the job and node lifecycle every other room of state/ builds on",
        ),
        ("policy.rs", "the policy's types and their validation, which must see the whole policy at once"),
    ];
    let src = manifest_dir().join("src");
    let mut over = std::collections::BTreeSet::new();
    let mut files = 0;
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap().to_string_lossy().to_string();
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("\n#[cfg(test)]\nmod tests").next().unwrap_or_default();
            files += 1;
            if code.lines().count() > CORE_FILE_LINES_MAX {
                over.insert(rel);
            }
        }
    }
    assert!(files > 30, "the core's files were not all read: {files}");
    let excused: std::collections::BTreeSet<String> = named.iter().map(|(f, _)| f.to_string()).collect();
    let unexcused: Vec<_> = over.difference(&excused).collect();
    assert!(unexcused.is_empty(), "over {CORE_FILE_LINES_MAX} lines without a named reason: {unexcused:?}");
    let shrunk: Vec<_> = excused.difference(&over).collect();
    assert!(shrunk.is_empty(), "within {CORE_FILE_LINES_MAX} lines now: take them off the list: {shrunk:?}");
}

/// Lines one function of the core may take: past it, a function does
/// several things, and its stages want names (issue 35's reviewer).
const CORE_FN_LINES_MAX: usize = 80;

/// Architecture Invariant: no function of the core is longer than
/// CORE_FN_LINES_MAX lines but the named ones, each with its reason (a
/// ratchet: one that shrank under the budget must leave the list).
#[test]
fn core_functions_stay_within_their_budget_but_the_named_ones() {
    let named: &[(&str, &str, &str)] = &[
        ("state/invariants.rs", "check_invariants", "one recount of every derived index against the jobs and nodes, each a few lines; read in pieces, a missing recount would not show"),
        ("sim.rs", "simulate_with_progress", "the trace replayer's event loop, which issue 38 replaces with a driver of leader_tick"),
        ("policy.rs", "validate", "every field of a policy checked in turn, each refusal naming its field and rule"),
        ("spec.rs", "validate", "every field of a job spec checked in turn, each refusal naming its field and rule"),
        ("sched/explain.rs", "explain_job", "the pass's stages asked for one job in turn, each answer named"),
        ("state/reservations.rs", "resolve_reservation", "every field of a reservation request resolved and checked in turn"),
        ("sched/mod.rs", "reserve", "EASY's sweep over future job ends: one loop whose locals are the sweep's state"),
        ("state/submit.rs", "resolve_spec", "every default the policy decides filled in turn (partition, account, QOS, time, memory)"),
        ("policy.rs", "coordinator_change", "each part of a policy a coordinator may or may not change, compared in turn"),
        ("state/schedule.rs", "check_placement_freeing", "a placement against each rule apply enforces, in the order that names the first broken"),
        ("sched/view.rs", "place", "the search over topology domains for a gang, with the candidates' shared locals"),
        ("state/mod.rs", "apply_task_exited", "a task's end: late usage, stale reports, lost tasks, failure, completion, in the order their rules apply"),
        ("state/admin.rs", "apply_update_policy", "a policy update's checks (version, scope, format, limits) and effects, in order"),
        ("snapshot.rs", "decode", "one arm per snapshot format, each a few lines"),
        ("state/submit.rs", "prepare_submission", "a submission's checks in order (limits, quotas, dependencies, arrays), each naming its refusal"),
        ("state/schedule.rs", "place_gangs", "a plan's placements applied: each checked, started and charged, with its booting nodes"),
        ("sched/preempt.rs", "preempt", "the victim search: candidates ranked, trial placements, reclaim of borrowed quota, in one loop"),
        ("state/steps.rs", "apply_step_started", "a step's checks (attempt, nodes, limits) and its record"),
        ("state/schedule.rs", "check_component", "one heterogeneous component's placement rules, the first broken named"),
    ];
    let lengths = core_function_lengths();
    assert!(lengths.len() > 400, "the core's functions were not all read: {}", lengths.len());
    let over: std::collections::BTreeSet<(String, String)> = lengths
        .iter()
        .filter(|(_, _, n)| *n > CORE_FN_LINES_MAX)
        .map(|(f, name, _)| (f.clone(), name.clone()))
        .collect();
    let excused: std::collections::BTreeSet<(String, String)> =
        named.iter().map(|(f, n, _)| (f.to_string(), n.to_string())).collect();
    let unexcused: Vec<_> = over.difference(&excused).collect();
    assert!(unexcused.is_empty(), "over {CORE_FN_LINES_MAX} lines without a named reason: {unexcused:?}");
    let shrunk: Vec<_> = excused.difference(&over).collect();
    assert!(shrunk.is_empty(), "within {CORE_FN_LINES_MAX} lines now: take them off the list: {shrunk:?}");
}

/// The review of format 18: a victim cancelled for its preemptor at format
/// 17 keeps its grace across the move (its tasks may still be stopping); a
/// suspended victim whose own task ends is not "stopped" any more; a
/// snapshot's stop causes come in id order, once each.
#[test]
fn stop_causes_survive_the_move_and_end_with_the_job() {
    use gangway_core::duties::node_orders;
    use gangway_core::format::STOP_CAUSE_FORMAT;
    use gangway_core::policy::{ClusterPolicy, PreemptMode, Qos};
    let mut s = State::default();
    s.apply(1, &Command::SetDataFormat { format: STOP_CAUSE_FORMAT - 1, now_ms: 1 });
    let mut policy = ClusterPolicy::default();
    let low = Qos { preempt_mode: PreemptMode::Cancel, preempt_grace_s: 30, ..Qos::default() };
    policy.qos.insert("low".into(), low);
    policy.qos.insert("high".into(), Qos { priority: 10, preempt: vec!["low".into()], ..Qos::default() });
    let update =
        Command::UpdatePolicy { policy, expected_version: None, force: true, identity: "server:1".into(), now_ms: 2 };
    assert!(matches!(s.apply(2, &update).outcome, Outcome::PolicyUpdated { .. }));
    s.apply(3, &Command::RegisterNode { spec: node_spec(0, 8), now_ms: 3 });
    let submit = |qos: &str| {
        let mut spec = job_spec(1, 8, 1);
        spec.qos = qos.into();
        Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 4 }
    };
    s.apply(4, &submit("low"));
    let opts = gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, 5);
    let first = gangway_core::sched::plan(&s, &opts);
    s.apply(5, &Command::ApplySchedule { preemptions: vec![], placements: first.placements, now_ms: 5 });
    s.apply(6, &submit("high"));
    let plan = gangway_core::sched::plan(&s, &opts);
    s.apply(7, &Command::ApplySchedule { preemptions: plan.preemptions, placements: plan.placements, now_ms: 6 });
    assert_eq!(s.jobs[&1].state, JobState::Cancelled);
    let node = s.jobs[&1].ran_on[0].clone();
    let running = std::collections::BTreeSet::from([(1, 1)]);
    assert_eq!(node_orders(&s, &node, &running).stops[0].grace_s, 30, "format 17: the words give the grace");
    s.apply(8, &Command::SetDataFormat { format: STOP_CAUSE_FORMAT, now_ms: 7 });
    assert_eq!(s.jobs[&1].stop_cause, Some(StopCause::Preempted { by: 2 }), "a cancelled victim is typed too");
    assert_eq!(node_orders(&s, &node, &running).stops[0].grace_s, 30, "format 18: the cause gives the grace");
    s.check_invariants().unwrap();

    // A stop cause on a running job that is not suspended is caught.
    let attempt = s.jobs[&2].attempt;
    let mut broken = s.clone();
    broken.jobs.get_mut(&2).unwrap().stop_cause = Some(StopCause::TimeLimit);
    assert!(broken.check_invariants().unwrap_err().contains("running job 2 has a stop cause"));
    // A job that ends by its own task has no stop cause.
    let mut own = s.clone();
    own.jobs.get_mut(&2).unwrap().stop_cause = Some(StopCause::TimeLimit);
    let exit = Command::TaskExited {
        job_id: 2,
        attempt,
        node: node.clone(),
        exit_code: Some(0),
        signal: None,
        reason: String::new(),
        lost: false,
        peak_mem_mb: None,
        usage: None,
        now_ms: 9,
    };
    own.apply(9, &exit);
    assert_eq!(own.jobs[&2].state, JobState::Completed);
    assert_eq!(own.jobs[&2].stop_cause, None);

    // Stop causes out of order (or twice) in a snapshot are damage.
    let mut two = s.clone();
    two.jobs.get_mut(&2).unwrap().stop_cause = Some(StopCause::CancelledBy { identity: "x".into() });
    two.jobs.get_mut(&2).unwrap().state = JobState::Cancelled;
    let bytes = gangway_core::snapshot::encode(&two);
    let causes = gangway_core::format::to_bytes(&vec![
        (1u64, StopCause::Preempted { by: 2 }),
        (2u64, StopCause::CancelledBy { identity: "x".into() }),
    ]);
    let swapped = gangway_core::format::to_bytes(&vec![
        (2u64, StopCause::CancelledBy { identity: "x".into() }),
        (1u64, StopCause::Preempted { by: 2 }),
    ]);
    assert!(bytes.ends_with(&causes), "the trailer is the causes in id order");
    let mut body = bytes[12..bytes.len() - causes.len()].to_vec();
    body.extend_from_slice(&swapped);
    let mut damaged = bytes[..8].to_vec();
    damaged.extend_from_slice(&gangway_core::format::crc32c(&body).to_le_bytes());
    damaged.extend_from_slice(&body);
    let e = gangway_core::snapshot::decode(&damaged).unwrap_err().to_string();
    assert!(e.contains("stop causes out of order at job 1"), "{e}");
}
