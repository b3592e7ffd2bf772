//! Every parser of user-typed text: sbatch's directive lines (and #PBS/#BSUB ones), Slurm's hostlists, time, memory, GPU,
//! node-range, topology and signal options, sacct's times, job arrays and
//! dependencies, node-name patterns. None panics or allocates without bound.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The CLI's parsers, compiled here from their own files (the CLI is a binary).
#[allow(dead_code)]
#[path = "../../cli/src/sbatch/directives.rs"]
mod directives;
#[allow(dead_code)]
#[path = "../../cli/src/slurm/hostlist.rs"]
mod hostlist;
#[allow(dead_code)]
#[path = "../../cli/src/parse.rs"]
mod parse;
#[allow(dead_code)]
#[path = "../../cli/src/sbatch/xlate.rs"]
mod xlate;
use directives as sbatch;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    // A batch script's #SBATCH directives, split into words as sbatch does.
    if let Ok(lines) = sbatch::directives(s, &mut Vec::new()) {
        assert!(lines.iter().all(|(_, w)| !w.is_empty() && w.len() <= sbatch::WORDS_MAX));
    }
    let _ = sbatch::words(s);
    // #PBS and #BSUB lines, translated as sbatch does.
    if let Ok(lines) = xlate::translated(s, &mut Vec::new()) {
        assert!(lines.iter().all(|(_, w)| !w.is_empty()));
    }
    if let Ok(names) = hostlist::expand(s) {
        // Compressing what expanded never fails either (at the sizes it is
        // used for: one job's nodes, at most NODES_PER_JOB_MAX).
        if names.len() <= gangway_core::limits::NODES_PER_JOB_MAX as usize {
            let _ = hostlist::compress(&names);
        }
    }
    let _ = parse::time_limit_s(s);
    let _ = parse::job_time_s("--time", s);
    let _ = parse::gres_gpus(s);
    let _ = parse::begin_ms(s, 1_800_000_000_000);
    let _ = parse::licenses(s);
    let _ = parse::mem_mb(s);
    let _ = parse::gpus(s);
    let _ = parse::node_range(s);
    let _ = parse::topology(s);
    let _ = parse::switches(s);
    let _ = parse::warn_signal(s);
    let _ = parse::parse_time("-S", s, 1_800_000_000_000);
    let _ = gangway_core::spec::parse_array(s);
    let _ = gangway_core::spec::parse_dependencies(s);
    let _ = gangway_core::policy::pattern_matches(s, "gpu042");
    let _ = gangway_core::policy::pattern_matches("gpu[001-128]", s);
});
