//! Advance reservations and licenses from the command line:
//! `gangway admin reservation add|update|delete|list`, `gangway admin
//! license`, and scontrol's `show reservation`, `create|update|delete
//! reservation` and `show licenses`, in Slurm's words.

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use crate::output::Output;
use crate::slurm::{duration, hostlist, timestamp};

#[derive(Subcommand)]
pub enum ReservationCmd {
    /// Create a reservation (admins and operators).
    Add {
        name: String,
        #[command(flatten)]
        args: ReservationArgs,
    },
    /// Replace a reservation's window, nodes, users, accounts and flags.
    Update {
        name: String,
        #[command(flatten)]
        args: ReservationArgs,
    },
    /// Delete a reservation (refused while jobs run in it).
    Delete { name: String },
    /// List reservations (the window in effect now or next).
    List {
        #[arg(long)]
        stale: bool,
    },
}

#[derive(Args, Default, Clone)]
pub struct ReservationArgs {
    /// The nodes (a hostlist: gpu[01-08]), or ALL.
    #[arg(long)]
    nodes: Option<String>,
    /// Instead of --nodes: whole nodes with at least this many GPUs in all.
    #[arg(long)]
    gpus: Option<u32>,
    /// With --gpus: pick from this partition's nodes.
    #[arg(long)]
    partition: Option<String>,
    /// When it starts: now, now+1hour, 16:00, 2026-12-24T08:00 (local time).
    /// Default: now (update: unchanged).
    #[arg(long)]
    start: Option<String>,
    /// How long: minutes, H:M:S, D-H:M:S (or give --end).
    #[arg(long)]
    duration: Option<String>,
    /// When it ends (same forms as --start).
    #[arg(long)]
    end: Option<String>,
    /// Users whose jobs may run in it, comma-separated.
    #[arg(long, value_delimiter = ',')]
    users: Vec<String>,
    /// Accounts whose jobs may run in it, comma-separated.
    #[arg(long, value_delimiter = ',')]
    accounts: Vec<String>,
    /// maint, ignore_jobs, daily, weekly (comma-separated).
    #[arg(long, default_value = "")]
    flags: String,
}

/// The request for `name` from the options (times resolved against
/// `now_ms`); an update (`current`) keeps what the options leave out, its
/// start and end included, as absolute times.
async fn request(
    client: &Client,
    name: &str,
    a: &ReservationArgs,
    now_ms: u64,
    current: Option<&pb::Reservation>,
) -> anyhow::Result<pb::ReservationSpec> {
    let start_ms = match (&a.start, current) {
        (Some(t), _) => {
            crate::parse::begin_ms(t, now_ms).map_err(|e| anyhow::anyhow!(e.replace("--begin", "--start")))?
        }
        (None, Some(c)) => c.start_ms,
        (None, None) => now_ms,
    };
    let end_ms = match (&a.duration, &a.end, current) {
        (Some(_), Some(_), _) => bail!("--end: give --duration or --end, not both"),
        (Some(d), None, _) => {
            let secs = crate::parse::time_limit_s(d).map_err(|e| anyhow::anyhow!(e.replace("--time", "--duration")))?;
            start_ms.saturating_add(secs.saturating_mul(1000))
        }
        (None, Some(e), _) => {
            crate::parse::begin_ms(e, now_ms).map_err(|e| anyhow::anyhow!(e.replace("--begin", "--end")))?
        }
        // The same length from a moved start.
        (None, None, Some(c)) => start_ms.saturating_add(c.end_ms.saturating_sub(c.start_ms)),
        (None, None, None) => bail!("--duration: give how long it lasts (--duration 2:00:00) or when it ends (--end)"),
    };
    let nodes = match a.nodes.as_deref() {
        None => Vec::new(),
        Some(n) if n.eq_ignore_ascii_case("all") => {
            client.list_nodes(false).await?.into_iter().map(|n| n.name).collect()
        }
        Some(n) => hostlist::expand(n).map_err(|e| anyhow::anyhow!("--nodes: {e}"))?,
    };
    Ok(pb::ReservationSpec {
        name: name.to_string(),
        start_ms,
        end_ms,
        nodes,
        gpus: a.gpus.unwrap_or(0),
        partition: a.partition.clone().unwrap_or_default(),
        users: a.users.iter().filter(|u| !u.is_empty()).cloned().collect(),
        accounts: a.accounts.iter().filter(|u| !u.is_empty()).cloned().collect(),
        flags: a.flags.clone(),
    })
}

pub async fn list(client: &Client, name: &str, stale: bool) -> anyhow::Result<Vec<pb::Reservation>> {
    let r = client.admin_list_reservations(pb::ListReservationsRequest { name: name.to_string(), stale }).await?;
    Ok(r.into_inner().reservations)
}

async fn change(client: &Client, action: &str, spec: pb::ReservationSpec) -> anyhow::Result<Vec<pb::Reservation>> {
    let r = client
        .admin_change_reservation(pb::ChangeReservationRequest { action: action.to_string(), spec: Some(spec.clone()) })
        .await?;
    Ok(r.into_inner().reservations)
}

pub async fn run(client: &Client, out: &Output, cmd: ReservationCmd) -> anyhow::Result<()> {
    let now = crate::slurm::now_ms();
    match cmd {
        ReservationCmd::Add { name, args } => {
            let spec = request(client, &name, &args, now, None).await?;
            let made = change(client, "create", spec).await?;
            print_reservations(out, &made, now)?;
        }
        ReservationCmd::Update { name, mut args } => {
            let current = list(client, &name, false).await?.into_iter().next().context("reservation: not found")?;
            if args.nodes.is_none() && args.gpus.is_none() {
                args.nodes = Some(hostlist::compress(&current.nodes));
            }
            if args.users.is_empty() && args.accounts.is_empty() {
                (args.users, args.accounts) = (current.users.clone(), current.accounts.clone());
            }
            if args.flags.is_empty() {
                args.flags = current.flags.clone();
            }
            let spec = request(client, &name, &args, now, Some(&current)).await?;
            let made = change(client, "update", spec).await?;
            print_reservations(out, &made, now)?;
        }
        ReservationCmd::Delete { name } => {
            change(client, "delete", pb::ReservationSpec { name: name.clone(), ..Default::default() }).await?;
            println!("reservation {name} deleted");
        }
        ReservationCmd::List { stale } => print_reservations(out, &list(client, "", stale).await?, now)?,
    }
    Ok(())
}

/// `scontrol show reservation`'s fields for one reservation.
pub fn reservation_fields(r: &pb::Reservation) -> Vec<(String, String)> {
    let none = |v: String| if v.is_empty() { "(null)".to_string() } else { v };
    let mut tres = format!("cpu={}", r.cpus);
    if r.gpus > 0 {
        tres.push_str(&format!(",gres/gpu={}", r.gpus));
    }
    vec![
        ("ReservationName".into(), r.name.clone()),
        ("StartTime".into(), timestamp(r.start_ms)),
        ("EndTime".into(), timestamp(r.end_ms)),
        ("Duration".into(), duration(r.end_ms.saturating_sub(r.start_ms) / 1000)),
        ("Nodes".into(), none(hostlist::compress(&r.nodes))),
        ("NodeCnt".into(), r.nodes.len().to_string()),
        ("CoreCnt".into(), r.cpus.to_string()),
        ("Features".into(), "(null)".into()),
        ("PartitionName".into(), "(null)".into()),
        ("Flags".into(), none(r.flags.clone())),
        ("TRES".into(), tres),
        ("Users".into(), none(r.users.join(","))),
        ("Groups".into(), "(null)".into()),
        ("Accounts".into(), none(r.accounts.join(","))),
        ("Licenses".into(), "(null)".into()),
        ("State".into(), if r.active { "ACTIVE" } else { "INACTIVE" }.into()),
        ("BurstBuffer".into(), "(null)".into()),
    ]
}

pub fn print_reservations(out: &Output, rs: &[pb::Reservation], _now: u64) -> anyhow::Result<()> {
    if out.json {
        let v: Vec<serde_json::Value> = rs
            .iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.name, "start_ms": r.start_ms, "end_ms": r.end_ms, "nodes": r.nodes,
                    "users": r.users, "accounts": r.accounts, "flags": r.flags, "active": r.active,
                    "gpus": r.gpus, "cpus": r.cpus, "created_by": r.created_by,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "reservations": v }))?);
        return Ok(());
    }
    if rs.is_empty() {
        println!("No reservations in the system");
    }
    for r in rs {
        crate::slurm::scontrol::print_fields(&reservation_fields(r), false, 5);
    }
    Ok(())
}

/// `scontrol create|update reservation KEY=VALUE...` (Slurm's keys:
/// ReservationName, StartTime, EndTime, Duration, Nodes, Users, Accounts,
/// Flags, PartitionName, TRES=gres/gpu=N).
pub async fn scontrol_change(client: &Client, out: &Output, update: bool, words: &[&str]) -> anyhow::Result<()> {
    let mut kv: Vec<(String, String)> = Vec::new();
    for w in words {
        let (k, v) = w.split_once('=').with_context(|| format!("reservation: '{w}' must be KEY=VALUE"))?;
        kv.push((k.to_ascii_lowercase(), v.to_string()));
    }
    let get = |k: &str| kv.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    let name = get("reservationname")
        .or_else(|| get("reservation"))
        .context("reservation: give ReservationName=NAME (Gangway does not make up reservation names)")?;
    let now = crate::slurm::now_ms();
    let current = if update {
        Some(
            list(client, &name, false)
                .await?
                .into_iter()
                .next()
                .with_context(|| format!("reservation {name} does not exist"))?,
        )
    } else {
        None
    };
    let mut a = ReservationArgs::default();
    if let Some(c) = &current {
        a.nodes = (!c.nodes.is_empty()).then(|| hostlist::compress(&c.nodes));
        a.users = c.users.clone();
        a.accounts = c.accounts.clone();
        a.flags = c.flags.clone();
    }
    for (k, v) in &kv {
        match k.as_str() {
            "reservationname" | "reservation" => {}
            "starttime" => a.start = Some(v.clone()),
            "endtime" => a.end = Some(v.clone()),
            "duration" => a.duration = Some(v.clone()),
            "nodes" | "nodelist" => a.nodes = Some(v.clone()),
            "users" | "user" => a.users = v.split(',').map(String::from).collect(),
            "accounts" | "account" => a.accounts = v.split(',').map(String::from).collect(),
            "flags" | "flag" => a.flags = v.clone(),
            "partitionname" | "partition" => a.partition = Some(v.clone()),
            "tres" => {
                let gpus = v
                    .strip_prefix("gres/gpu=")
                    .and_then(|g| g.parse::<u32>().ok())
                    .with_context(|| format!("TRES: '{v}': Gangway reserves GPUs as TRES=gres/gpu=COUNT"))?;
                a.gpus = Some(gpus);
                a.nodes = None;
            }
            other => bail!(
                "reservation: {other} is not a key Gangway reads (ReservationName, StartTime, EndTime, Duration, \
                 Nodes, Users, Accounts, Flags, PartitionName, TRES=gres/gpu=N)"
            ),
        }
    }
    // Slurm's key names in the errors.
    let spec = request(client, &name, &a, now, current.as_ref()).await.map_err(|e| {
        let mut m = e.to_string();
        for (opt, key) in
            [("--start", "StartTime"), ("--duration", "Duration"), ("--end", "EndTime"), ("--nodes", "Nodes")]
        {
            m = m.replace(opt, key);
        }
        anyhow::anyhow!(m)
    })?;
    let made = change(client, if update { "update" } else { "create" }, spec).await?;
    if !update {
        println!("Reservation created: {name}");
    }
    if out.json {
        print_reservations(out, &made, now)?;
    }
    Ok(())
}

/// `scontrol delete reservation NAME`, `delete ReservationName=NAME`.
pub async fn scontrol_delete(client: &Client, words: &[&str]) -> anyhow::Result<()> {
    let name = words
        .first()
        .map(|w| w.split_once('=').map_or(*w, |(_, v)| v))
        .context("delete reservation: give the reservation's name")?;
    change(client, "delete", pb::ReservationSpec { name: name.to_string(), ..Default::default() }).await?;
    Ok(())
}

pub async fn licenses(client: &Client, stale: bool) -> anyhow::Result<Vec<pb::License>> {
    let r = client.admin_licenses(pb::LicensesRequest { stale }).await?;
    Ok(r.into_inner().licenses)
}

/// `scontrol show licenses [NAME]`.
pub async fn show_licenses(client: &Client, out: &Output, name: Option<&str>) -> anyhow::Result<()> {
    let mut ls = licenses(client, false).await?;
    if let Some(n) = name {
        ls.retain(|l| l.name == n);
        if ls.is_empty() {
            bail!("license {n}: Invalid license name specified");
        }
    }
    if out.json {
        let v: Vec<serde_json::Value> =
            ls.iter().map(|l| serde_json::json!({"name": l.name, "total": l.total, "used": l.used})).collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "licenses": v }))?);
        return Ok(());
    }
    if ls.is_empty() {
        println!("No licenses configured");
    }
    for l in ls {
        let free = u64::from(l.total).saturating_sub(l.used);
        println!("LicenseName={}", l.name);
        println!("    Total={} Used={} Free={free} Reserved=0 Remote=no", l.total, l.used);
    }
    Ok(())
}
