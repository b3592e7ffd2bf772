//! Slurm's output format strings: squeue's `-o "%.18i %9P %j"` (a width makes a
//! column exactly that wide, truncating; `.` right-justifies), and the named
//! forms of `squeue -O JobID:10,Name` and `sacct -o JobID,JobName%30`.

/// One piece of a format: literal text, or a field by key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    Text(String),
    Field { key: &'static str, width: Option<usize>, right: bool },
}

/// Items one format may hold: far above any useful line.
const ITEMS_MAX: usize = 256;
/// Widest column a format may ask for.
const WIDTH_MAX: usize = 4096;

/// Parses a `%` format; `code` maps a letter to its field key.
pub fn parse_percent(
    fmt: &str,
    option: &str,
    code: impl Fn(char) -> Option<&'static str>,
) -> Result<Vec<Item>, String> {
    let mut items = Vec::new();
    let mut text = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            text.push(c);
            continue;
        }
        if chars.peek() == Some(&'%') {
            chars.next();
            text.push('%');
            continue;
        }
        let right = chars.next_if_eq(&'.').is_some();
        let _left = chars.next_if_eq(&'-').is_some();
        let mut digits = String::new();
        while let Some(d) = chars.next_if(|d| d.is_ascii_digit()) {
            digits.push(d);
        }
        let Some(letter) = chars.next() else {
            return Err(format!("{option}: '{fmt}' ends inside a % field"));
        };
        let key = code(letter).ok_or_else(|| format!("{option}: %{letter} is not a field Gangway knows"))?;
        if !text.is_empty() {
            items.push(Item::Text(std::mem::take(&mut text)));
        }
        let width = width_of(&digits, option)?;
        items.push(Item::Field { key, width, right });
        if items.len() > ITEMS_MAX {
            return Err(format!("{option}: more than {ITEMS_MAX} fields"));
        }
    }
    if !text.is_empty() {
        items.push(Item::Text(text));
    }
    Ok(items)
}

fn width_of(digits: &str, option: &str) -> Result<Option<usize>, String> {
    if digits.is_empty() {
        return Ok(None);
    }
    match digits.parse::<usize>() {
        Ok(w) if w <= WIDTH_MAX => Ok(Some(w)),
        _ => Err(format!("{option}: width {digits} is larger than {WIDTH_MAX}")),
    }
}

/// Parses a named format: `Name[:[.]WIDTH]` or `Name%WIDTH`, comma-separated,
/// names in any case; `known` lists the keys (canonical spelling).
pub fn parse_names(
    fmt: &str,
    option: &str,
    known: &[&'static str],
    default_width: Option<usize>,
) -> Result<Vec<Item>, String> {
    let mut items = Vec::new();
    for part in fmt.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, spec) = match part.find([':', '%']) {
            Some(i) => (&part[..i], Some(&part[i + 1..])),
            None => (part, None),
        };
        let key = known
            .iter()
            .find(|k| k.eq_ignore_ascii_case(name))
            .ok_or_else(|| format!("{option}: '{name}' is not a field Gangway knows (known: {})", known.join(", ")))?;
        let (right, width) = match spec {
            None => (false, default_width),
            Some(s) => {
                let (right, digits) = match s.strip_prefix('.') {
                    Some(d) => (true, d),
                    None => (false, s),
                };
                (right, width_of(digits, option)?.or(default_width))
            }
        };
        items.push(Item::Field { key, width, right });
        if items.len() > ITEMS_MAX {
            return Err(format!("{option}: more than {ITEMS_MAX} fields"));
        }
    }
    if items.is_empty() {
        return Err(format!("{option}: no fields given"));
    }
    Ok(items)
}

/// A field's value in its column, [`crate::output::printable`].
fn fit(value: &str, width: Option<usize>, right: bool) -> String {
    let value = crate::output::printable(value);
    match width {
        None => value.into_owned(),
        Some(w) => {
            let v: String = value.chars().take(w).collect();
            if right {
                format!("{v:>w$}")
            } else {
                format!("{v:<w$}")
            }
        }
    }
}

/// One line: each field's value fitted to its column.
pub fn render(items: &[Item], value: impl Fn(&str) -> String) -> String {
    items
        .iter()
        .map(|i| match i {
            Item::Text(t) => t.clone(),
            Item::Field { key, width, right } => fit(&value(key), *width, *right),
        })
        .collect::<String>()
        .trim_end()
        .to_string()
}

/// Named fields separated by a space (squeue -O, sacct), or by `|` when
/// `parsable` (sacct -P; with `trailing`, also after the last, as -p).
pub fn render_columns(items: &[Item], value: impl Fn(&str) -> String, parsable: bool, trailing: bool) -> String {
    let cells: Vec<String> = items
        .iter()
        .map(|i| match i {
            Item::Text(t) => t.clone(),
            Item::Field { key, width, right } if !parsable => fit(&value(key), *width, *right),
            Item::Field { key, .. } => crate::output::printable(&value(key)).into_owned(),
        })
        .collect();
    if parsable {
        let mut line = cells.join("|");
        if trailing {
            line.push('|');
        }
        line
    } else {
        cells.join(" ").trim_end().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(c: char) -> Option<&'static str> {
        match c {
            'i' => Some("id"),
            'j' => Some("name"),
            _ => None,
        }
    }

    #[test]
    fn formats_parse_and_fit() {
        let items = parse_percent("%.5i|%-4j%%", "-o", code).unwrap();
        let v = |k: &str| if k == "id" || k == "JobID" { "12".to_string() } else { "training".to_string() };
        assert_eq!(render(&items, v), "   12|trai%");
        assert!(parse_percent("%q", "-o", code).unwrap_err().contains("%q"));
        assert!(parse_percent("%.5", "-o", code).is_err());
        let named = parse_names("JobID:.6,name%3", "-O", &["JobID", "Name"], Some(10)).unwrap();
        assert_eq!(render_columns(&named, v, false, false), "    12 tra");
        assert_eq!(render_columns(&named, v, true, true), "12|training|");
        assert!(parse_names("Bogus", "-O", &["JobID"], None).unwrap_err().contains("Bogus"));
    }

    /// A format holds at most ITEMS_MAX fields, each at most WIDTH_MAX wide:
    /// at each limit it parses, one past it is refused naming the option and
    /// the limit, in both the `%` and the named forms.
    #[test]
    fn formats_stop_at_their_limits() {
        let refused = |r: Result<Vec<Item>, String>, limit: usize| {
            let e = r.expect_err("one past the limit is taken");
            assert!(e.starts_with("-o:") && e.contains(&limit.to_string()), "{e}");
        };
        assert_eq!(parse_percent(&"%i".repeat(ITEMS_MAX), "-o", code).unwrap().len(), ITEMS_MAX);
        refused(parse_percent(&"%i".repeat(ITEMS_MAX + 1), "-o", code), ITEMS_MAX);
        let names = |n: usize| vec!["JobID"; n].join(",");
        assert_eq!(parse_names(&names(ITEMS_MAX), "-o", &["JobID"], None).unwrap().len(), ITEMS_MAX);
        refused(parse_names(&names(ITEMS_MAX + 1), "-o", &["JobID"], None), ITEMS_MAX);
        let field = Item::Field { key: "id", width: Some(WIDTH_MAX), right: false };
        assert_eq!(parse_percent(&format!("%{WIDTH_MAX}i"), "-o", code).unwrap(), [field]);
        refused(parse_percent(&format!("%{}i", WIDTH_MAX + 1), "-o", code), WIDTH_MAX);
        let field = Item::Field { key: "JobID", width: Some(WIDTH_MAX), right: false };
        assert_eq!(parse_names(&format!("JobID:{WIDTH_MAX}"), "-o", &["JobID"], None).unwrap(), [field]);
        refused(parse_names(&format!("JobID%{}", WIDTH_MAX + 1), "-o", &["JobID"], None), WIDTH_MAX);
    }
}
