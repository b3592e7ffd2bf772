//! Reading `#SBATCH` directives out of a batch script and splitting them into
//! words: pure text handling, kept apart from the option parsing so the fuzz
//! target `text_parsers` can run it on its own.

/// Lines scanned for directives: sbatch stops at the first command, and a
/// file with this many leading comment lines is not a batch script.
pub const DIRECTIVE_LINES_MAX: usize = 10_000;
/// Words on one directive line, and in all: far above any real script.
pub const WORDS_MAX: usize = 4096;

/// Where some words came from, for messages: a directive line, an
/// `SBATCH_*` environment variable or the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Line(usize),
    Env(&'static str),
    CommandLine,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Line(n) => write!(f, "line {n}"),
            Origin::Env(var) => write!(f, "environment variable {var}"),
            Origin::CommandLine => write!(f, "command line"),
        }
    }
}

/// Splits a directive into words as sbatch does (`get_argument`):
/// whitespace separates, '...' and "..." quote, a backslash outside single
/// quotes keeps the next character as it is, and an unquoted `#` begins a
/// comment, also inside a word (`--job-name=run#3` is `run`).
pub fn words(text: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            '#' => break,
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        // sbatch drops a backslash inside single quotes too.
                        Some('\\') => match chars.next() {
                            Some(c) => cur.push(c),
                            None => return Err("unterminated ' quote".into()),
                        },
                        Some(c) => cur.push(c),
                        None => return Err("unterminated ' quote".into()),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$' | '`')) => cur.push(c),
                            Some(c) => {
                                cur.push('\\');
                                cur.push(c);
                            }
                            None => return Err("unterminated \" quote".into()),
                        },
                        Some(c) => cur.push(c),
                        None => return Err("unterminated \" quote".into()),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(c) = chars.next() {
                    cur.push(c);
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
        if out.len() > WORDS_MAX {
            return Err(format!("more than {WORDS_MAX} words"));
        }
    }
    if in_word {
        out.push(cur);
    }
    // The last word is pushed here, after the loop's checks.
    if out.len() > WORDS_MAX {
        return Err(format!("more than {WORDS_MAX} words"));
    }
    Ok(out)
}

/// Separates the components of a heterogeneous job: a `#SBATCH hetjob`
/// line, and `:` between option sets on the command line.
pub const HET_SEPARATOR: &str = ":";

/// The `#SBATCH` directives of a script, with their line numbers: from the
/// lines after `#!` up to the first command. Later `#SBATCH` lines (in a
/// heredoc, say) are not directives. As in sbatch, a line is a directive
/// when it starts with `#SBATCH` (`#SBATCH--time=5` too; `#SBATCHED` makes
/// `ED` an argument, which is refused) or with the old `#SLURM` (applied,
/// with a notice).
pub fn directives(script: &str, notices: &mut Vec<String>) -> Result<Vec<(Origin, Vec<String>)>, String> {
    let mut out = Vec::new();
    for (i, line) in script.lines().enumerate().take(DIRECTIVE_LINES_MAX) {
        let n = i + 1;
        if i == 0 && line.starts_with("#!") {
            continue;
        }
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        let rest = line.strip_prefix("#SBATCH").or_else(|| {
            let rest = line.strip_prefix("#SLURM")?;
            notices.push(format!(
                "line {n}: Change from #SLURM to #SBATCH in your script and verify the options are valid in sbatch"
            ));
            Some(rest)
        });
        if let Some(rest) = rest {
            let w = words(rest).map_err(|e| format!("line {n}: {e}"))?;
            let first = w.first().map(|f| f.to_ascii_lowercase());
            if matches!(first.as_deref(), Some("hetjob" | "packjob")) {
                if w.len() > 1 {
                    return Err(format!(
                        "line {n}: #SBATCH {} takes no options: put the next component's options on the lines after it",
                        w[0]
                    ));
                }
                // The next component of a heterogeneous job starts here.
                out.push((Origin::Line(n), vec![HET_SEPARATOR.to_string()]));
                continue;
            }
            if !w.is_empty() {
                out.push((Origin::Line(n), w));
            }
            continue;
        }
        if t.starts_with('#') {
            continue;
        }
        break;
    }
    Ok(out)
}
