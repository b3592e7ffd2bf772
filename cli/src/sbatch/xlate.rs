//! `#BSUB` (LSF) and `#PBS` (PBS Pro, Torque) directives, translated into
//! sbatch options as Slurm's sbatch translates them (`src/sbatch/xlate.c`), so
//! that scripts from a site moving over run unchanged: the whole script is
//! scanned (up to 100 lines that are not comments), `#BSUB` first and `#PBS`
//! only without it, and the translated options apply after the `#SBATCH`
//! ones (before the environment and the command line). `--ignore-pbs`
//! turns this off. Options sbatch ignores are ignored; what sbatch refuses is
//! refused, naming the directive.

use super::directives::{words, Origin, DIRECTIVE_LINES_MAX};

/// sbatch stops looking for these directives after this many lines that are
/// not comments.
const NON_COMMENT_LINES_MAX: usize = 100;

/// The translated options of `script`, each with the line it came from.
pub fn translated(script: &str, notices: &mut Vec<String>) -> Result<Vec<(Origin, Vec<String>)>, String> {
    for (magic, translate) in
        [("#BSUB", bsub as fn(&[String], usize, &mut Vec<String>) -> Result<Vec<String>, String>), ("#PBS", pbs)]
    {
        let lines = lines_of(script, magic)?;
        if lines.is_empty() {
            continue;
        }
        let mut out = Vec::new();
        for (n, argv) in lines {
            let words = translate(&argv, n, notices).map_err(|e| format!("line {n}: {magic}: {e}"))?;
            if !words.is_empty() {
                out.push((Origin::Line(n), words));
            }
        }
        return Ok(out);
    }
    Ok(Vec::new())
}

/// The words of every line that starts with `magic`, with its number.
fn lines_of(script: &str, magic: &str) -> Result<Vec<(usize, Vec<String>)>, String> {
    let mut out = Vec::new();
    let mut others = 0usize;
    for (i, line) in script.lines().enumerate().take(DIRECTIVE_LINES_MAX) {
        let n = i + 1;
        let Some(rest) = line.strip_prefix(magic) else {
            if !line.starts_with('#') {
                others += 1;
                if others > NON_COMMENT_LINES_MAX {
                    break;
                }
            }
            continue;
        };
        out.push((n, words(rest).map_err(|e| format!("line {n}: {e}"))?));
    }
    Ok(out)
}

/// One option of a getopt-style argument list: its letter and value.
type Opt = (char, Option<String>);

/// Splits `argv` as getopt does with `spec` (letters, `:` after those with a
/// value; `longs` maps long names to letters): clustered flags, values
/// attached or in the next word, `--name=value`; the first word that is not
/// an option is an error, as it is for sbatch.
fn getopt(argv: &[String], spec: &str, longs: &[(&str, char)]) -> Result<Vec<Opt>, String> {
    let takes = |c: char| spec.find(c).map(|i| spec[i + c.len_utf8()..].starts_with(':'));
    let mut out = Vec::new();
    let mut words = argv.iter();
    // Bounded by the words: each turn takes one or two.
    while let Some(w) = words.next() {
        if let Some(long) = w.strip_prefix("--") {
            let (name, attached) = long.split_once('=').map_or((long, None), |(n, v)| (n, Some(v.to_string())));
            let Some(&(_, c)) = longs.iter().find(|(l, _)| *l == name) else {
                return Err(format!("unrecognized option '--{name}'"));
            };
            let value = match (takes(c), attached) {
                (Some(true), Some(v)) => Some(v),
                (Some(true), None) => Some(words.next().ok_or(format!("option '--{name}' needs a value"))?.clone()),
                (_, Some(_)) => return Err(format!("option '--{name}' takes no value")),
                _ => None,
            };
            out.push((c, value));
            continue;
        }
        let Some(flags) = w.strip_prefix('-').filter(|f| !f.is_empty()) else {
            return Err(format!("Invalid argument: {w}"));
        };
        for (i, c) in flags.char_indices() {
            match takes(c) {
                None => return Err(format!("Unrecognized command line parameter {c}")),
                Some(false) => out.push((c, None)),
                Some(true) => {
                    let rest = &flags[i + c.len_utf8()..];
                    let value = if rest.is_empty() {
                        words.next().ok_or(format!("option -{c} needs a value"))?.clone()
                    } else {
                        rest.to_string()
                    };
                    out.push((c, Some(value)));
                    break;
                }
            }
        }
    }
    Ok(out)
}

/// LSF's `bsub` options, as sbatch's.
fn bsub(argv: &[String], _line: usize, _notices: &mut Vec<String>) -> Result<Vec<String>, String> {
    // sbatch reads LSF's `-cwd` (one dash, a long name) as -c.
    let argv: Vec<String> = argv.iter().map(|w| if w == "-cwd" { "-c".to_string() } else { w.clone() }).collect();
    let longs = [
        ("cwd", 'c'),
        ("error_file", 'e'),
        ("job_name", 'J'),
        ("hostname", 'm'),
        ("memory_limit", 'M'),
        ("output_file", 'o'),
        ("queue_name", 'q'),
        ("time", 'W'),
        ("exclusive", 'x'),
    ];
    let mut out = Vec::new();
    for (c, v) in getopt(&argv, "c:e:J:m:M:n:o:q:W:x", &longs)? {
        let v = v.unwrap_or_default();
        match c {
            'c' => out.push(format!("--chdir={v}")),
            'e' => out.push(format!("--error={v}")),
            'J' => out.push(format!("--job-name={v}")),
            'o' => out.push(format!("--output={v}")),
            // A space-separated host list.
            'm' => out.push(format!("--nodelist={}", v.split_whitespace().collect::<Vec<_>>().join(","))),
            'M' => out.push(format!("--mem-per-cpu={v}")),
            // MIN,MAX tasks: sbatch takes the maximum.
            'n' => {
                let max = match v.split_once(',') {
                    Some((_, "")) => return Err(format!("#BSUB -n format not correct given: '{v}'")),
                    Some((_, max)) => max,
                    None => v.as_str(),
                };
                out.push(format!("--ntasks={max}"));
            }
            'q' => out.push(format!("--partition={v}")),
            'W' => out.push(format!("--time={v}")),
            'x' => out.push("--exclusive".into()),
            _ => unreachable!("getopt returns only the spec's letters"),
        }
    }
    Ok(out)
}

/// PBS's `qsub` options, as sbatch's.
fn pbs(argv: &[String], _line: usize, notices: &mut Vec<String>) -> Result<Vec<String>, String> {
    let longs = [
        ("start_time", 'a'),
        ("account", 'A'),
        ("checkpoint", 'c'),
        ("working_dir", 'C'),
        ("error", 'e'),
        ("hold", 'h'),
        ("interactive", 'I'),
        ("join", 'j'),
        ("job_array", 'J'),
        ("keep", 'k'),
        ("resource_list", 'l'),
        ("mail_options", 'm'),
        ("mail_user_list", 'M'),
        ("job_name", 'N'),
        ("out", 'o'),
        ("priority", 'p'),
        ("destination", 'q'),
        ("rerunable", 'r'),
        ("script_path", 'S'),
        ("array", 't'),
        ("running_user", 'u'),
        ("variable_list", 'v'),
        ("all_env", 'V'),
        ("attributes", 'W'),
        ("no_std", 'z'),
    ];
    let mut out = Vec::new();
    for (c, v) in getopt(argv, "a:A:c:C:e:hIj:J:k:l:m:M:N:o:p:q:r:S:t:u:v:VW:z", &longs)? {
        let v = v.unwrap_or_default();
        match c {
            'a' => out.push(format!("--begin={v}")),
            'A' => out.push(format!("--account={v}")),
            'e' => out.push(format!("--error={v}")),
            'o' => out.push(format!("--output={v}")),
            'h' => out.push("--hold".into()),
            // PBS Pro's -J, Torque's -t.
            'J' | 't' => out.push(format!("--array={v}")),
            'l' => out.extend(resource_list(&v, notices)),
            'm' => {
                if let Some(types) = mail_types(&v) {
                    out.push(format!("--mail-type={types}"));
                }
            }
            'M' => out.push(format!("--mail-user={v}")),
            'N' => out.push(format!("--job-name={v}")),
            'p' => out.push(format!("--nice={v}")),
            'q' => out.push(format!("--partition={v}")),
            'v' => out.push(format!("--export={v}")),
            'W' => match v.split_once('=') {
                Some((k, d)) if k.eq_ignore_ascii_case("depend") => out.push(format!("--dependency={d}")),
                _ => notices.push(format!("#PBS -W {v} is ignored (sbatch reads only depend= here)")),
            },
            // What sbatch ignores: checkpoint, working dir, interactive, join,
            // keep, rerunable, shell, user, all_env, no_std.
            _ => {}
        }
    }
    Ok(out)
}

/// qsub's mail events (a, b, e, n) as sbatch's mail types.
fn mail_types(v: &str) -> Option<String> {
    let has = |c: char| v.chars().any(|x| x.eq_ignore_ascii_case(&c));
    if has('n') {
        return Some("NONE".into());
    }
    let types: Vec<&str> =
        [('b', "BEGIN"), ('e', "END"), ('a', "FAIL")].into_iter().filter(|(c, _)| has(*c)).map(|(_, t)| t).collect();
    (!types.is_empty()).then(|| types.join(","))
}

/// A resource list (`-l nodes=2:ppn=8,walltime=1:00:00,mem=16gb`, or PBS
/// Pro's `select=2:ncpus=8:mpiprocs=8`) as sbatch options.
fn resource_list(rl: &str, notices: &mut Vec<String>) -> Vec<String> {
    let mut out = Vec::new();
    let (mut ncpus, mut mpiprocs, mut gpu_flag) = (None::<String>, None::<String>, false);
    let mut rest = rl;
    // Bounded by the list: each turn consumes at least one character.
    while !rest.is_empty() {
        // The value after `key=`, up to `sep`; `rest` moves past it.
        let mut take = |key: &str, sep: char| -> Option<String> {
            let after = strip_prefix_ci(rest, key)?;
            let (value, tail) = after.split_once(sep).unwrap_or((after, ""));
            rest = tail;
            Some(value.to_string())
        };
        if let Some(v) = take("accelerator=", ',') {
            gpu_flag |= v.eq_ignore_ascii_case("true");
        } else if let Some(v) = take("walltime=", ',').or_else(|| take("cput=", ',')).or_else(|| take("pcput=", ',')) {
            out.push(format!("--time={v}"));
        } else if let Some(v) = take("mem=", ',') {
            // Torque's 16gb is Slurm's 16g.
            let v = v.strip_suffix(['b', 'B']).unwrap_or(&v);
            out.push(format!("--mem={v}"));
        } else if let Some(v) = take("file=", ',') {
            out.push(format!("--tmp={}", v.strip_suffix(['b', 'B']).unwrap_or(&v)));
        } else if let Some(v) = take("mpiprocs=", ':') {
            out.push(format!("--ntasks-per-node={v}"));
            mpiprocs = Some(v);
        } else if let Some(v) = take("naccelerators=", ',') {
            out.push(format!("--gpus={v}"));
        } else if let Some(v) = take("ncpus=", ':') {
            ncpus = Some(v);
        } else if let Some(v) = take("nice=", ',') {
            out.push(format!("--nice={v}"));
        } else if let Some(v) = take("nodes=", ',') {
            out.extend(pbs_nodes(&v));
        } else if let Some(v) = take("proc=", ',') {
            out.push(format!("--constraint={v}"));
        } else if let Some(v) = take("select=", ':') {
            out.push(format!("--nodes={v}"));
        } else if ["arch=", "host=", "opsys=", "other=", "pmem=", "pvmem=", "software=", "vmem="]
            .iter()
            .any(|k| take(k, ',').is_some())
        {
            // What sbatch skips.
        } else {
            let mut chars = rest.chars();
            chars.next();
            rest = chars.as_str();
        }
    }
    // ncpus is a per-node CPU count (sbatch's --mincpus, which Gangway
    // does not have): with mpiprocs, the CPUs of each task; alone, the one
    // task's.
    if let Some(n) = ncpus {
        let per_task = match mpiprocs.as_deref().map(str::parse::<u32>) {
            Some(Ok(m)) if m > 0 => n.parse::<u32>().ok().map(|n| n / m).filter(|c| *c > 1),
            Some(_) => None,
            None => n.parse::<u32>().ok(),
        };
        if let Some(c) = per_task {
            out.push(format!("--cpus-per-task={c}"));
        }
        notices.push(format!("#PBS ncpus={n} is read as CPUs per task (Gangway has no --mincpus)"));
    }
    if gpu_flag && !out.iter().any(|o| o.starts_with("--gpus=")) {
        out.push("--gres=gpu:1".into());
    }
    out
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix).then(|| &s[prefix.len()..])
}

/// Torque's `nodes=` value: `2:ppn=8`, `node1+node2`, `2:gpus=1` (counts
/// add up, ppn per node, names a node list; the rest is skipped).
fn pbs_nodes(v: &str) -> Vec<String> {
    let (mut count, mut ppn) = (0u32, 0u32);
    let mut hosts = Vec::new();
    for part in v.split(['+', ':']).filter(|p| !p.is_empty()) {
        if let Some(n) = part.strip_prefix("ppn=") {
            ppn = ppn.saturating_add(leading_number(n));
        } else if part.starts_with(|c: char| c.is_ascii_digit()) {
            count = count.saturating_add(leading_number(part));
        } else if part.starts_with(|c: char| c.is_ascii_alphabetic()) && !part.contains('=') {
            hosts.push(part.to_string());
        }
    }
    let mut out = Vec::new();
    if count > 0 {
        out.push(format!("--nodes={count}"));
    }
    if ppn > 0 {
        out.push(format!("--ntasks={}", ppn.saturating_mul(count.max(1))));
    }
    if !hosts.is_empty() {
        out.push(format!("--nodelist={}", hosts.join(",")));
    }
    out
}

fn leading_number(s: &str) -> u32 {
    let digits: String = s.chars().take_while(char::is_ascii_digit).take(9).collect();
    digits.parse().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// #PBS lines are read within the first DIRECTIVE_LINES_MAX lines and
    /// until NON_COMMENT_LINES_MAX commands have passed: a line at either
    /// limit is read, one past it is not (as sbatch stops looking).
    #[test]
    fn directives_are_read_up_to_their_line_limits() {
        let read = |before: &str, n: usize| t(&format!("{}#PBS -q gpu\n", before.repeat(n))).unwrap();
        let queue = vec![vec!["--partition=gpu".to_string()]];
        assert_eq!(read("#\n", DIRECTIVE_LINES_MAX - 1), queue, "on the last line scanned");
        assert!(read("#\n", DIRECTIVE_LINES_MAX).is_empty(), "one line past the scan");
        assert_eq!(read("echo\n", NON_COMMENT_LINES_MAX), queue, "after as many commands as allowed");
        assert!(read("echo\n", NON_COMMENT_LINES_MAX + 1).is_empty(), "after one command more");
    }

    fn t(script: &str) -> Result<Vec<Vec<String>>, String> {
        let mut notices = Vec::new();
        translated(script, &mut notices).map(|v| v.into_iter().map(|(_, w)| w).collect())
    }

    #[test]
    fn torque_and_pbs_pro_resource_lists() {
        assert_eq!(
            t("#!/bin/bash\n#PBS -N train -l nodes=2:ppn=8,walltime=01:30:00,mem=16gb\n#PBS -q gpu\n").unwrap(),
            [
                vec!["--job-name=train", "--nodes=2", "--ntasks=16", "--time=01:30:00", "--mem=16g"],
                vec!["--partition=gpu"]
            ]
        );
        assert_eq!(
            t("#PBS -l select=4:ncpus=16:mpiprocs=4\n").unwrap(),
            [vec!["--nodes=4", "--ntasks-per-node=4", "--cpus-per-task=4"]]
        );
        assert_eq!(t("#PBS -l nodes=n01+n02\n").unwrap(), [vec!["--nodelist=n01,n02"]]);
        assert_eq!(
            t("#PBS -l naccelerators=2 -m abe -W depend=afterok:12\n").unwrap(),
            [vec!["--gpus=2", "--mail-type=BEGIN,END,FAIL", "--dependency=afterok:12"]]
        );
        // Clustered flags, attached values, long names; ignored ones vanish.
        assert_eq!(
            t("#PBS -hV -Nname --account=ml -j oe -r y\n").unwrap(),
            [vec!["--hold", "--job-name=name", "--account=ml"]]
        );
    }

    #[test]
    fn lsf_options_and_precedence() {
        assert_eq!(
            t("#BSUB -J job -n 2,8 -W 30 -m \"h1 h2\" -cwd /tmp -x\n#PBS -N ignored\n").unwrap(),
            [vec!["--job-name=job", "--ntasks=8", "--time=30", "--nodelist=h1,h2", "--chdir=/tmp", "--exclusive"]]
        );
        assert!(t("#BSUB -n 2,\n").unwrap_err().contains("#BSUB -n format not correct"));
        assert!(t("#BSUB -Z 1\n").unwrap_err().contains("line 1: #BSUB: Unrecognized command line parameter Z"));
        assert!(t("#PBS stray\n").unwrap_err().contains("Invalid argument: stray"));
        assert!(t("#PBS -N\n").unwrap_err().contains("option -N needs a value"));
        // Only the first 100 lines that are not comments are looked at.
        let late = format!("#!/bin/sh\n{}#PBS -N late\n", "true\n".repeat(101));
        assert_eq!(t(&late).unwrap(), Vec::<Vec<String>>::new());
    }
}
