//! Advance reservations (Slurm's `scontrol create reservation`): nodes set
//! aside for a window of time, for named users and accounts, or for
//! maintenance. Replicated in the state (data format 9); the scheduler and
//! `apply` share the rules here:
//!
//! - a job that names a reservation runs only on its nodes, only while it is
//!   active, and must end by its end (its time limit, shortened to fit down
//!   to `--time-min`);
//! - every other job stays off a reservation's nodes unless it ends (by its
//!   time limit) before the reservation starts: a maintenance window drains
//!   its nodes ahead of time;
//! - a `daily` or `weekly` reservation repeats; one that does not is removed
//!   once it has ended.

use serde::{Deserialize, Serialize};

use crate::limits::{RESERVATIONS_MAX, RESERVATION_HORIZON_S, RESERVATION_NAMES_MAX, RESERVATION_NODES_MAX};
use crate::spec::SpecError;

const DAY_MS: u64 = 24 * 3600 * 1000;
/// Occurrences compared when two repeating reservations are checked for a
/// conflict: a daily one's over two weeks covers every phase of a weekly one.
const REPEATS_CHECKED: usize = 14;

/// How a reservation repeats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Repeat {
    #[default]
    Once,
    Daily,
    Weekly,
}

impl Repeat {
    fn period_ms(self) -> Option<u64> {
        match self {
            Repeat::Once => None,
            Repeat::Daily => Some(DAY_MS),
            Repeat::Weekly => Some(DAY_MS.saturating_mul(7)),
        }
    }
}

/// Slurm's reservation flags that Gangway implements.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationFlags {
    /// A maintenance window: nodes show `maint`, and no users or accounts
    /// need be named (only admins' jobs may run in it).
    pub maint: bool,
    /// Create even if running jobs may still hold the nodes at the start.
    pub ignore_jobs: bool,
    pub repeat: Repeat,
}

impl ReservationFlags {
    /// Slurm's `Flags=` text: `MAINT,IGNORE_JOBS,DAILY`.
    pub fn as_text(&self) -> String {
        let mut out = Vec::new();
        if self.maint {
            out.push("MAINT");
        }
        if self.ignore_jobs {
            out.push("IGNORE_JOBS");
        }
        match self.repeat {
            Repeat::Once => {}
            Repeat::Daily => out.push("DAILY"),
            Repeat::Weekly => out.push("WEEKLY"),
        }
        out.join(",")
    }

    /// Parses Slurm's flag list (case-insensitive, comma-separated).
    pub fn parse(text: &str) -> Result<ReservationFlags, SpecError> {
        let mut f = ReservationFlags::default();
        for flag in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match flag.to_ascii_lowercase().as_str() {
                "maint" => f.maint = true,
                "ignore_jobs" => f.ignore_jobs = true,
                "daily" => f.repeat = Repeat::Daily,
                "weekly" => f.repeat = Repeat::Weekly,
                other => {
                    return Err(SpecError::new(
                        "flags",
                        format!(
                            "'{other}' is not a reservation flag Gangway knows (maint, ignore_jobs, daily, weekly)"
                        ),
                    ))
                }
            }
        }
        Ok(f)
    }
}

/// A reservation as asked for: `nodes` by name, or `gpus` (whole nodes with
/// at least that many GPUs in all, picked when it is created).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationRequest {
    pub name: String,
    pub start_ms: u64,
    pub end_ms: u64,
    pub nodes: Vec<String>,
    pub gpus: u32,
    /// Pick `gpus` from this partition's nodes (empty: any).
    pub partition: String,
    pub users: Vec<String>,
    pub accounts: Vec<String>,
    pub flags: ReservationFlags,
}

/// What a reservation command does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReservationChange {
    Create(ReservationRequest),
    /// Replaces the named reservation's window, nodes, users, accounts and flags.
    Update(ReservationRequest),
    Delete {
        name: String,
    },
}

/// A reservation in the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    pub name: String,
    /// The first occurrence's window (epoch ms, end exclusive).
    pub start_ms: u64,
    pub end_ms: u64,
    pub nodes: Vec<String>,
    pub users: Vec<String>,
    pub accounts: Vec<String>,
    pub flags: ReservationFlags,
    pub created_by: String,
}

impl Reservation {
    /// The occurrence in effect at `now_ms`, or the next one: `(start, end)`.
    /// None once a reservation that does not repeat has ended.
    pub fn window(&self, now_ms: u64) -> Option<(u64, u64)> {
        if now_ms < self.end_ms {
            return Some((self.start_ms, self.end_ms));
        }
        let period = self.flags.repeat.period_ms()?;
        let k = now_ms.saturating_sub(self.end_ms).checked_div(period).unwrap_or(0).saturating_add(1);
        let shift = period.saturating_mul(k);
        Some((self.start_ms.saturating_add(shift), self.end_ms.saturating_add(shift)))
    }

    /// Whether the reservation holds its nodes at `now_ms`.
    pub fn active(&self, now_ms: u64) -> bool {
        self.window(now_ms).is_some_and(|(s, _)| s <= now_ms)
    }

    /// Whether `[from, to)` overlaps an occurrence (the one in effect at
    /// `from` or the next; a job is never longer than a period's gap here
    /// because limits are capped far below a year, and a daily
    /// reservation's next occurrence is checked too).
    pub fn overlaps(&self, from_ms: u64, to_ms: u64) -> bool {
        let Some((s, e)) = self.window(from_ms) else { return false };
        if from_ms < e && s < to_ms {
            return true;
        }
        match self.flags.repeat.period_ms() {
            // Occurrences at s + k·period: the first that starts before `to` decides.
            Some(p) if p > 0 => {
                let next = s.saturating_add(p);
                next < to_ms
            }
            _ => false,
        }
    }

    /// Whether some occurrence of this reservation overlaps some occurrence
    /// of `other` (both may repeat).
    pub fn conflicts(&self, other: &Reservation) -> bool {
        match (self.flags.repeat.period_ms(), other.flags.repeat.period_ms()) {
            (None, _) => other.overlaps(self.start_ms, self.end_ms),
            (_, None) => self.overlaps(other.start_ms, other.end_ms),
            (Some(p), Some(_)) => {
                // The periods (a day, a week) divide a week: two weeks of this
                // one's occurrences from the later first start decide.
                let Some((mut s, mut e)) = self.window(self.start_ms.max(other.start_ms)) else { return false };
                for _ in 0..REPEATS_CHECKED {
                    if other.overlaps(s, e) {
                        return true;
                    }
                    s = s.saturating_add(p);
                    e = e.saturating_add(p);
                }
                false
            }
        }
    }

    /// Whether a job of `user` and `account`, submitted by `identity`, may
    /// run in this reservation (admins may run in any: the API edge asks
    /// them to force it where the reservation does not list them).
    pub fn admits(&self, user: &str, account: &str, admin: bool) -> bool {
        admin || self.lists(user, account)
    }

    /// Whether the reservation names `user` or `account`.
    pub fn lists(&self, user: &str, account: &str) -> bool {
        self.users.iter().any(|u| u == user) || (!account.is_empty() && self.accounts.iter().any(|a| a == account))
    }

    pub fn contains(&self, node: &str) -> bool {
        self.nodes.iter().any(|n| n == node)
    }
}

/// Checks a reservation's name.
pub fn check_name(name: &str) -> Result<(), SpecError> {
    crate::policy::check_ident("name", name)
}

/// Checks a request's own fields (not the nodes it needs: see the state).
pub fn check_request(r: &ReservationRequest, now_ms: u64, existing: usize) -> Result<(), SpecError> {
    crate::policy::check_ident("name", &r.name)?;
    if existing >= RESERVATIONS_MAX {
        return Err(SpecError::new("name", format!("the cluster holds {RESERVATIONS_MAX} reservations already")));
    }
    let horizon = RESERVATION_HORIZON_S.saturating_mul(1000);
    if r.end_ms <= r.start_ms {
        return Err(SpecError::new("end", "must be after the start (give --duration or --end)"));
    }
    if r.start_ms > now_ms.saturating_add(horizon) {
        return Err(SpecError::new("start", format!("must be within {} days", RESERVATION_HORIZON_S / 86_400)));
    }
    if r.end_ms.saturating_sub(r.start_ms) > horizon {
        return Err(SpecError::new("duration", format!("must be at most {} days", RESERVATION_HORIZON_S / 86_400)));
    }
    if r.end_ms <= now_ms {
        return Err(SpecError::new("end", "is in the past"));
    }
    if let Some(p) = r.flags.repeat.period_ms() {
        if r.end_ms.saturating_sub(r.start_ms) > p {
            return Err(SpecError::new("duration", "a repeating reservation must be no longer than its period"));
        }
    }
    if r.nodes.is_empty() == (r.gpus == 0) {
        return Err(SpecError::new("nodes", "give either the nodes or a GPU count"));
    }
    if r.nodes.len() > RESERVATION_NODES_MAX {
        return Err(SpecError::new("nodes", format!("at most {RESERVATION_NODES_MAX}")));
    }
    for (field, list) in [("nodes", &r.nodes), ("users", &r.users), ("accounts", &r.accounts)] {
        if field != "nodes" && list.len() > RESERVATION_NAMES_MAX {
            return Err(SpecError::new(field, format!("at most {RESERVATION_NAMES_MAX}")));
        }
        // A set, not a scan of the names before: 20,000 nodes would take
        // 200 million comparisons on every replica.
        let mut seen = std::collections::BTreeSet::new();
        for n in list {
            crate::policy::check_ident(field, n)?;
            if !seen.insert(n.as_str()) {
                return Err(SpecError::new(field, format!("{n} is named twice")));
            }
        }
    }
    if !r.partition.is_empty() {
        crate::policy::check_ident("partition", &r.partition)?;
    }
    if r.users.is_empty() && r.accounts.is_empty() && !r.flags.maint {
        return Err(SpecError::new(
            "users",
            "name the users or accounts it is for (only a maint reservation need not)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resv(start: u64, end: u64, repeat: Repeat) -> Reservation {
        Reservation {
            name: "r".into(),
            start_ms: start,
            end_ms: end,
            nodes: vec!["n0".into()],
            users: vec!["alice".into()],
            accounts: Vec::new(),
            flags: ReservationFlags { repeat, ..Default::default() },
            created_by: "ops".into(),
        }
    }

    #[test]
    fn windows_repeat_and_end() {
        let once = resv(1_000, 2_000, Repeat::Once);
        assert_eq!(once.window(0), Some((1_000, 2_000)));
        assert!(!once.active(999) && once.active(1_000) && once.active(1_999));
        assert_eq!(once.window(2_000), None);
        assert!(once.overlaps(500, 1_001) && !once.overlaps(500, 1_000) && !once.overlaps(2_000, 3_000));
        let daily = resv(1_000, 2_000, Repeat::Daily);
        assert_eq!(daily.window(2_000), Some((1_000 + DAY_MS, 2_000 + DAY_MS)));
        assert_eq!(daily.window(3 * DAY_MS), Some((1_000 + 3 * DAY_MS, 2_000 + 3 * DAY_MS)));
        assert!(daily.active(1_500 + 2 * DAY_MS));
        // A job from after today's occurrence into tomorrow's overlaps it.
        assert!(daily.overlaps(2_000, 1_001 + DAY_MS));
        assert!(!daily.overlaps(2_000, 1_000 + DAY_MS));
    }

    #[test]
    fn repeating_reservations_conflict_when_any_occurrences_meet() {
        let weekly = resv(0, 3_600_000, Repeat::Weekly);
        let daily = resv(10 * DAY_MS, 10 * DAY_MS + 3_600_000, Repeat::Daily);
        // Day 14: both hold the node from 0:00 to 1:00.
        assert!(weekly.conflicts(&daily) && daily.conflicts(&weekly));
        let later = resv(10 * DAY_MS + 7_200_000, 10 * DAY_MS + 10_800_000, Repeat::Daily);
        assert!(!weekly.conflicts(&later) && !later.conflicts(&weekly));
        let once = resv(14 * DAY_MS + 1_000, 14 * DAY_MS + 2_000, Repeat::Once);
        assert!(once.conflicts(&weekly) && weekly.conflicts(&once));
        assert!(!once.conflicts(&later));
    }

    #[test]
    fn flags_parse_and_print_as_slurm_does() {
        let f = ReservationFlags::parse("MAINT,ignore_jobs,Weekly").unwrap();
        assert_eq!(f.as_text(), "MAINT,IGNORE_JOBS,WEEKLY");
        assert!(ReservationFlags::parse("overlap").unwrap_err().to_string().contains("'overlap'"));
    }

    #[test]
    fn requests_are_checked_field_by_field() {
        let ok = ReservationRequest {
            name: "train".into(),
            start_ms: 10_000,
            end_ms: 20_000,
            gpus: 8,
            users: vec!["alice".into()],
            ..Default::default()
        };
        assert_eq!(check_request(&ok, 0, 0), Ok(()));
        let field = |r: ReservationRequest| check_request(&r, 0, 0).unwrap_err().field;
        assert_eq!(field(ReservationRequest { end_ms: 10_000, ..ok.clone() }), "end");
        assert_eq!(field(ReservationRequest { nodes: vec!["n0".into()], ..ok.clone() }), "nodes");
        assert_eq!(field(ReservationRequest { users: Vec::new(), ..ok.clone() }), "users");
        assert_eq!(field(ReservationRequest { name: "a b".into(), ..ok.clone() }), "name");
        let daily = ReservationFlags { repeat: Repeat::Daily, ..Default::default() };
        assert_eq!(field(ReservationRequest { end_ms: 10_000 + 2 * DAY_MS, flags: daily, ..ok.clone() }), "duration");
        assert_eq!(check_request(&ok, 0, RESERVATIONS_MAX).unwrap_err().field, "name");
        let maint = ReservationFlags { maint: true, ..Default::default() };
        assert_eq!(check_request(&ReservationRequest { users: Vec::new(), flags: maint, ..ok }, 0, 0), Ok(()));
    }
}
