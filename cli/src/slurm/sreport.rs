//! `sreport`: usage reports over the accounting database (`gangway
//! accounting`, read by replicas with `--accounting-database`), in Slurm's
//! table and `-P`/`-p` formats: `cluster Utilization` (allocated, down,
//! planned down, idle and reported, from the capacity the accounting service
//! samples every minute), `cluster AccountUtilizationByUser`,
//! `cluster UserUtilizationByAccount` and `user TopUsage`, in CPU or GPU
//! (`--tres=gres/gpu`) seconds, minutes or hours. Accounts are reported
//! flat: each account's own jobs, not its sub-accounts'.

use std::collections::BTreeMap;

use anyhow::bail;
use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use super::timestamp;

/// Users `user TopUsage` lists unless `TopCount=` says otherwise (Slurm's default).
const TOP_COUNT_DEFAULT: usize = 10;
/// Users it lists at most.
const TOP_COUNT_MAX: usize = 10_000;
/// What the rows name the cluster.
const CLUSTER: &str = "gangway";

#[derive(Args, Debug, Default)]
pub struct SreportArgs {
    /// `|` between fields, none after the last.
    #[arg(short = 'P', long = "parsable2")]
    parsable2: bool,
    /// `|` between fields and after the last.
    #[arg(short = 'p', long = "parsable")]
    parsable: bool,
    /// No title block and no column names.
    #[arg(short = 'n', long = "noheader")]
    noheader: bool,
    /// Units: seconds, minutes (the default), hours (or s, m, h).
    #[arg(short = 't', long = "time", default_value = "minutes")]
    time: String,
    /// What is counted: cpu (the default) or gres/gpu.
    #[arg(long = "tres", default_value = "cpu")]
    tres: String,
    /// The report and its options: `cluster AccountUtilizationByUser`,
    /// `cluster UserUtilizationByAccount` or `user TopUsage`, then
    /// start=TIME end=TIME (default: yesterday), Accounts=a,b Users=u,v TopCount=N.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    words: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Report {
    Utilization,
    AccountUtilizationByUser,
    UserUtilizationByAccount,
    TopUsage,
}

/// The report a command line asks for, and its options: pure.
fn parse(words: &[String], now_ms: u64) -> Result<(Report, pb::UsageRequest, usize), String> {
    let lower: Vec<String> = words.iter().map(|w| w.to_ascii_lowercase()).collect();
    let report = match (lower.first().map(String::as_str), lower.get(1).map(String::as_str)) {
        (Some("cluster"), Some("utilization")) => Report::Utilization,
        (Some("cluster"), Some("accountutilizationbyuser")) => Report::AccountUtilizationByUser,
        (Some("cluster"), Some("userutilizationbyaccount")) => Report::UserUtilizationByAccount,
        (Some("user"), Some("topusage")) => Report::TopUsage,
        _ => {
            return Err(format!(
                "report: {:?} is not one of: cluster Utilization, cluster AccountUtilizationByUser, \
                 cluster UserUtilizationByAccount, user TopUsage",
                words.iter().take(2).cloned().collect::<Vec<_>>().join(" ")
            ))
        }
    };
    // Yesterday, from midnight to midnight (local time), as Slurm.
    let today = local_midnight(now_ms);
    let mut req = pb::UsageRequest { start_ms: today.saturating_sub(86_400_000), end_ms: today, ..Default::default() };
    let mut top = TOP_COUNT_DEFAULT;
    for w in &words[2..] {
        let Some((k, v)) = w.split_once('=') else { return Err(format!("{w}: options are KEY=VALUE")) };
        let list = || v.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect::<Vec<_>>();
        match k.to_ascii_lowercase().as_str() {
            "start" => req.start_ms = crate::parse::parse_time("start", v, now_ms)?,
            "end" => req.end_ms = crate::parse::parse_time("end", v, now_ms)?,
            "accounts" | "account" => req.accounts = list(),
            "users" | "user" => req.users = list(),
            "topcount" => {
                top = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=TOP_COUNT_MAX).contains(n))
                    .ok_or_else(|| format!("TopCount: {v:?} must be 1 to {TOP_COUNT_MAX}"))?
            }
            _ => return Err(format!("{k}: not an option of this report (start, end, Accounts, Users, TopCount)")),
        }
    }
    if req.end_ms <= req.start_ms {
        return Err("end: must be after start".into());
    }
    req.utilization = report == Report::Utilization;
    Ok((report, req, top))
}

/// The start of `now_ms`'s day in local time.
fn local_midnight(now_ms: u64) -> u64 {
    const DAY_MS: i64 = 86_400_000;
    let now = i64::try_from(now_ms).unwrap_or(i64::MAX);
    let offset_ms = crate::parse::local_offset_s(now).saturating_mul(1000);
    let local = now.saturating_add(offset_ms);
    u64::try_from(local - local.rem_euclid(DAY_MS) - offset_ms).unwrap_or(0)
}

/// Seconds in one unit of `-t`, and the unit's name in the title.
fn unit(t: &str) -> Result<(f64, &'static str), String> {
    match t.to_ascii_lowercase().as_str() {
        "s" | "sec" | "secs" | "seconds" => Ok((1.0, "Seconds")),
        "m" | "min" | "mins" | "minutes" => Ok((60.0, "Minutes")),
        "h" | "hour" | "hours" => Ok((3600.0, "Hours")),
        _ => Err(format!("--time: {t:?} must be seconds, minutes or hours")),
    }
}

/// The rows of a report, in order: (account, login, used). Pure.
fn rows(report: Report, usage: &[pb::UsageRow], gpus: bool, top: usize) -> Vec<(String, String, f64)> {
    let used = |r: &pb::UsageRow| if gpus { r.gpu_seconds } else { r.cpu_seconds };
    match report {
        Report::Utilization => Vec::new(),
        Report::AccountUtilizationByUser => {
            let mut by_account: BTreeMap<&str, Vec<&pb::UsageRow>> = BTreeMap::new();
            for r in usage {
                by_account.entry(r.account.as_str()).or_default().push(r);
            }
            let mut out = Vec::new();
            for (account, users) in by_account {
                out.push((account.to_string(), String::new(), users.iter().map(|r| used(r)).sum()));
                let mut users = users;
                users.sort_by(|a, b| used(b).total_cmp(&used(a)).then_with(|| a.user.cmp(&b.user)));
                out.extend(users.into_iter().map(|r| (account.to_string(), r.user.clone(), used(r))));
            }
            out
        }
        Report::UserUtilizationByAccount => {
            let mut out: Vec<(String, String, f64)> =
                usage.iter().map(|r| (r.account.clone(), r.user.clone(), used(r))).collect();
            out.sort_by(|a, b| b.2.total_cmp(&a.2).then_with(|| a.1.cmp(&b.1)));
            out
        }
        Report::TopUsage => {
            let mut by_user: BTreeMap<&str, (Vec<&str>, f64)> = BTreeMap::new();
            for r in usage {
                let e = by_user.entry(r.user.as_str()).or_default();
                e.0.push(r.account.as_str());
                e.1 += used(r);
            }
            let mut out: Vec<(String, String, f64)> =
                by_user.into_iter().map(|(u, (accounts, n))| (accounts.join(","), u.to_string(), n)).collect();
            out.sort_by(|a, b| b.2.total_cmp(&a.2).then_with(|| a.1.cmp(&b.1)));
            out.truncate(top);
            out
        }
    }
}

/// `cluster Utilization`'s figures in seconds: allocated, down, planned
/// down, idle (what is left of what was reported) and reported. Pure.
fn utilization(u: &pb::Utilization, gpus: bool) -> [f64; 5] {
    let (reported, down, planned, allocated) = match gpus {
        true => (u.gpu_reported, u.gpu_down, u.gpu_planned_down, u.gpu_allocated),
        false => (u.cpu_reported, u.cpu_down, u.cpu_planned_down, u.cpu_allocated),
    };
    let idle = (reported - down - planned - allocated).max(0.0);
    [allocated, down, planned, idle, reported]
}

/// A user's full name from the passwd database (Slurm's "Proper Name").
fn proper_name(login: &str) -> String {
    if login.is_empty() {
        return String::new();
    }
    match nix::unistd::User::from_name(login) {
        Ok(Some(u)) => {
            let gecos = u.gecos.to_string_lossy().into_owned();
            let name = gecos.split(',').next().unwrap_or("").trim().to_string();
            if name.is_empty() {
                login.to_string()
            } else {
                name
            }
        }
        _ => login.to_string(),
    }
}

pub async fn run(client: &Client, a: SreportArgs) -> anyhow::Result<()> {
    let (report, req, top) = parse(&a.words, super::now_ms()).map_err(anyhow::Error::msg)?;
    let (per_unit, unit_name) = unit(&a.time).map_err(anyhow::Error::msg)?;
    let gpus = match a.tres.to_ascii_lowercase().as_str() {
        "cpu" => false,
        "gres/gpu" | "gpu" => true,
        t => bail!("--tres: {t:?} must be cpu or gres/gpu"),
    };
    if a.parsable && a.parsable2 {
        bail!("--parsable: give -p or -P, not both");
    }
    let answer =
        client.job_usage(req.clone()).await.map_err(|s| anyhow::anyhow!("sreport: {}", s.message()))?.into_inner();
    let usage = answer.rows;
    let (title, columns): (&str, &[(&str, usize)]) = match report {
        Report::Utilization => (
            "Cluster Utilization",
            &[("Cluster", 9), ("Allocated", 10), ("Down", 9), ("PLND Down", 9), ("Idle", 10), ("Reported", 10)],
        ),
        Report::AccountUtilizationByUser => (
            "Cluster/Account/User Utilization",
            &[("Cluster", 9), ("Account", 15), ("Login", 9), ("Proper Name", 15), ("Used", 9), ("Energy", 8)],
        ),
        Report::UserUtilizationByAccount => (
            "Cluster/User/Account Utilization",
            &[("Cluster", 9), ("Login", 9), ("Proper Name", 15), ("Account", 15), ("Used", 9), ("Energy", 8)],
        ),
        Report::TopUsage => (
            "Top Users",
            &[("Cluster", 9), ("Login", 9), ("Proper Name", 15), ("Account", 15), ("Used", 9), ("Energy", 8)],
        ),
    };
    let parsable = a.parsable || a.parsable2;
    let line = |cells: &[String]| -> String {
        if parsable {
            let mut s = cells.join("|");
            if a.parsable {
                s.push('|');
            }
            return s;
        }
        cells
            .iter()
            .zip(columns)
            .map(|(c, (_, w))| format!("{:>w$}", c.chars().take(*w).collect::<String>(), w = *w))
            .collect::<Vec<_>>()
            .join(" ")
    };
    if !a.noheader {
        let secs = (req.end_ms - req.start_ms) / 1000;
        let what = if gpus { "gres/gpu" } else { "CPU" };
        let rule = "-".repeat(80);
        println!("{rule}");
        println!("{title} {} - {} ({secs} secs)", timestamp(req.start_ms), timestamp(req.end_ms.saturating_sub(1000)));
        println!("Usage reported in {what} {unit_name}");
        println!("{rule}");
        println!("{}", line(&columns.iter().map(|(n, _)| n.to_string()).collect::<Vec<_>>()));
        if !parsable {
            println!("{}", columns.iter().map(|(_, w)| "-".repeat(*w)).collect::<Vec<_>>().join(" "));
        }
    }
    if report == Report::Utilization {
        let u = answer.utilization.unwrap_or_default();
        if u.samples == 0 {
            eprintln!(
                "sreport: no capacity samples in this range (does `gangway accounting` run?): only what jobs were \
                 allocated is known"
            );
        }
        let mut cells = vec![CLUSTER.to_string()];
        cells.extend(utilization(&u, gpus).iter().map(|v| format!("{}", (v / per_unit).round() as u64)));
        println!("{}", line(&cells));
        return Ok(());
    }
    for (account, login, used) in rows(report, &usage, gpus, top) {
        let used = format!("{}", (used / per_unit).round() as u64);
        let name = proper_name(&login);
        let cells: Vec<String> = match report {
            Report::AccountUtilizationByUser => {
                vec![CLUSTER.into(), account, login, name, used, "0".into()]
            }
            Report::UserUtilizationByAccount | Report::TopUsage | Report::Utilization => {
                vec![CLUSTER.into(), login, name, account, used, "0".into()]
            }
        };
        println!("{}", line(&cells));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TopCount takes 1 to TOP_COUNT_MAX; one more is refused, naming it.
    #[test]
    fn top_count_stops_at_its_limit() {
        let top = |n: usize| {
            let words = ["user", "topusage", &format!("TopCount={n}")].map(String::from);
            parse(&words, 1_796_084_311_000).map(|(_, _, top)| top)
        };
        assert_eq!(top(TOP_COUNT_MAX), Ok(TOP_COUNT_MAX));
        let e = top(TOP_COUNT_MAX + 1).unwrap_err();
        assert!(e.starts_with("TopCount:") && e.contains(&TOP_COUNT_MAX.to_string()), "{e}");
    }

    fn row(account: &str, user: &str, cpu: f64, gpu: f64) -> pb::UsageRow {
        pb::UsageRow { account: account.into(), user: user.into(), cpu_seconds: cpu, gpu_seconds: gpu, jobs: 1 }
    }

    #[test]
    fn reports_sum_by_account_then_user_and_rank_top_users() {
        let usage = [row("ml", "bob", 60.0, 0.0), row("ml", "alice", 120.0, 3600.0), row("nlp", "alice", 30.0, 0.0)];
        let by_account = rows(Report::AccountUtilizationByUser, &usage, false, 10);
        assert_eq!(
            by_account,
            [
                ("ml".into(), "".into(), 180.0),
                ("ml".into(), "alice".into(), 120.0),
                ("ml".into(), "bob".into(), 60.0),
                ("nlp".into(), "".into(), 30.0),
                ("nlp".into(), "alice".into(), 30.0)
            ]
        );
        let top = rows(Report::TopUsage, &usage, true, 1);
        assert_eq!(top, [("ml,nlp".into(), "alice".into(), 3600.0)]);
    }

    #[test]
    fn utilization_is_what_was_reported_less_down_planned_and_allocated() {
        let u = pb::Utilization {
            samples: 3,
            gpu_reported: 1000.0,
            gpu_down: 100.0,
            gpu_planned_down: 50.0,
            gpu_allocated: 600.0,
            cpu_reported: 10.0,
            cpu_allocated: 40.0,
            ..Default::default()
        };
        assert_eq!(utilization(&u, true), [600.0, 100.0, 50.0, 250.0, 1000.0]);
        assert_eq!(utilization(&u, false)[3], 0.0, "never negative");
        let (r, req, _) = parse(&["cluster".into(), "Utilization".into()], 1_800_000_000_000).unwrap();
        assert!(r == Report::Utilization && req.utilization);
    }

    #[test]
    fn report_words_parse_like_slurms() {
        let w = |s: &str| s.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        let (r, req, top) =
            parse(&w("cluster AccountUtilizationByUser start=2026-11-01 end=2026-11-02 Accounts=ml,nlp"), 0).unwrap();
        assert_eq!(r, Report::AccountUtilizationByUser);
        assert_eq!(req.accounts, ["ml", "nlp"]);
        assert!(req.end_ms > req.start_ms && top == TOP_COUNT_DEFAULT);
        assert_eq!(parse(&w("user topusage TopCount=3"), 1_800_000_000_000).unwrap().2, 3);
        assert!(parse(&w("job SizesByAccount"), 0).unwrap_err().contains("not one of"));
        assert!(parse(&w("user TopUsage TopCount=0"), 0).unwrap_err().contains("TopCount"));
        assert!(parse(&w("user TopUsage start=2026-11-02 end=2026-11-01"), 0).unwrap_err().contains("after"));
        assert_eq!(unit("h").unwrap().0, 3600.0);
    }
}
