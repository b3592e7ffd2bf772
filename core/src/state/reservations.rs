//! Advance reservations and licenses in the state: the reservation commands,
//! and the rules a placement must keep (shared with the scheduler through
//! [`State::start_limit_s`] and [`crate::reservation`]).

use super::*;
use crate::format::SLURM_FEATURES_FORMAT;
use crate::limits::RESERVED_NODE_ENTRIES_MAX;
use crate::reservation::{check_request, Reservation, ReservationChange, ReservationRequest};

impl State {
    pub(super) fn apply_change_reservation(&mut self, change: &ReservationChange, identity: &str) -> Applied {
        if self.format < SLURM_FEATURES_FORMAT {
            return Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("reservations need data format {SLURM_FEATURES_FORMAT}; the cluster is on {}", self.format),
            );
        }
        if !self.is_operator(identity) {
            return Applied::refused(
                RefusalKind::PermissionDenied,
                format!("{identity} may not manage reservations (admins and operators may)"),
            );
        }
        let name = match change {
            ReservationChange::Create(r) => {
                if self.reservations.get(&r.name).is_some_and(|old| old.window(self.clock_ms).is_some()) {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("name: reservation {} exists already", r.name),
                    );
                }
                match self.resolve_reservation(r, identity, None) {
                    Ok(res) => {
                        self.reservations.insert(res.name.clone(), res);
                    }
                    Err(refused) => return refused,
                }
                r.name.clone()
            }
            ReservationChange::Update(r) => {
                let Some(old) = self.reservations.get(&r.name).filter(|old| old.window(self.clock_ms).is_some()) else {
                    return Applied::refused(RefusalKind::NotFound, format!("reservation {} does not exist", r.name));
                };
                let created_by = old.created_by.clone();
                match self.resolve_reservation(r, &created_by, Some(&r.name)) {
                    Ok(res) => {
                        self.reservations.insert(res.name.clone(), res);
                    }
                    Err(refused) => return refused,
                }
                r.name.clone()
            }
            ReservationChange::Delete { name } => {
                if !self.reservations.contains_key(name) {
                    return Applied::refused(RefusalKind::NotFound, format!("reservation {name} does not exist"));
                }
                let running: Vec<String> = self
                    .running
                    .iter()
                    .filter_map(|id| self.jobs.get(id))
                    .filter(|j| &j.spec.reservation == name)
                    .take(8)
                    .map(|j| j.display_id())
                    .collect();
                if !running.is_empty() {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("reservation {name} is busy: jobs {} run in it", running.join(", ")),
                    );
                }
                self.reservations.remove(name);
                name.clone()
            }
        };
        self.purge_reservations();
        self.reserved_nodes = self.reserved_nodes_of_reservations();
        Applied { outcome: Outcome::ReservationChanged { name }, events: Vec::new() }
    }

    /// The reservation `r` asks for, with its nodes picked and checked
    /// against other reservations and (unless `ignore_jobs`) running jobs.
    fn resolve_reservation(
        &self,
        r: &ReservationRequest,
        identity: &str,
        replacing: Option<&str>,
    ) -> Result<Reservation, Applied> {
        let others = self
            .reservations
            .values()
            .filter(|o| Some(o.name.as_str()) != replacing && o.window(self.clock_ms).is_some())
            .count();
        check_request(r, self.clock_ms, others)
            .map_err(|e| Applied::refused(RefusalKind::InvalidArgument, e.to_string()))?;
        let mut res = Reservation {
            name: r.name.clone(),
            start_ms: r.start_ms,
            end_ms: r.end_ms,
            nodes: Vec::new(),
            users: r.users.clone(),
            accounts: r.accounts.clone(),
            flags: r.flags,
            created_by: identity.to_string(),
        };
        // Why `node` cannot be in the reservation, if it cannot.
        let conflict = |res: &Reservation, node: &Node| -> Option<String> {
            for other in self.reservations_on(&node.name) {
                if Some(other.name.as_str()) == replacing {
                    continue;
                }
                if other.conflicts(res) {
                    return Some(format!("node {} is in reservation {} then", node.name, other.name));
                }
            }
            if res.flags.ignore_jobs {
                return None;
            }
            node.jobs.iter().filter_map(|id| self.jobs.get(id)).find_map(|j| {
                let end = j.expected_end_ms(self.clock_ms);
                let inside = replacing.is_some_and(|n| j.spec.reservation == n);
                (!inside && res.overlaps(self.clock_ms, end)).then(|| {
                    format!(
                        "node {} runs job {} until after the start (flags=ignore_jobs creates it anyway)",
                        node.name,
                        j.display_id()
                    )
                })
            })
        };
        if r.gpus == 0 {
            for name in &r.nodes {
                let node = self.nodes.get(name).ok_or_else(|| {
                    Applied::refused(RefusalKind::NotFound, format!("nodes: node {name} does not exist"))
                })?;
                if let Some(why) = conflict(&res, node) {
                    return Err(Applied::refused(RefusalKind::FailedPrecondition, format!("nodes: {why}")));
                }
            }
            res.nodes = r.nodes.clone();
        } else {
            let partition = if r.partition.is_empty() {
                None
            } else {
                Some(self.policy.partitions.get(&r.partition).ok_or_else(|| {
                    Applied::refused(RefusalKind::NotFound, format!("partition: {} does not exist", r.partition))
                })?)
            };
            // Whole nodes in topology order, so a reservation's nodes sit together.
            let mut candidates: Vec<&Node> = self
                .nodes
                .values()
                .filter(|n| n.state == NodeState::Up && partition.is_none_or(|p| p.contains(&n.name)))
                .filter(|n| n.gpus.iter().any(|g| g.health == GpuHealth::Healthy))
                .collect();
            candidates.sort_by(|a, b| a.topology.cmp(&b.topology).then_with(|| a.name.cmp(&b.name)));
            let mut got = 0u64;
            for node in candidates {
                if got >= u64::from(r.gpus) {
                    break;
                }
                if conflict(&res, node).is_some() {
                    continue;
                }
                got = got.saturating_add(node.gpus.iter().filter(|g| g.health == GpuHealth::Healthy).count() as u64);
                res.nodes.push(node.name.clone());
            }
            if got < u64::from(r.gpus) {
                return Err(Applied::refused(
                    RefusalKind::ResourceExhausted,
                    format!(
                        "gpus: only {got} healthy GPUs are on nodes free of other reservations{} then",
                        if r.flags.ignore_jobs { "" } else { " and running jobs" }
                    ),
                ));
            }
        }
        let entries = self
            .reservations
            .values()
            .filter(|r| Some(r.name.as_str()) != replacing)
            .map(|r| r.nodes.len())
            .fold(res.nodes.len(), usize::saturating_add);
        if entries > RESERVED_NODE_ENTRIES_MAX {
            return Err(Applied::refused(
                RefusalKind::ResourceExhausted,
                format!("nodes: reservations would hold {entries} node entries, over {RESERVED_NODE_ENTRIES_MAX}"),
            ));
        }
        // A replaced reservation's running jobs must stay within it.
        if let Some(name) = replacing {
            for j in self.running.iter().filter_map(|id| self.jobs.get(id)).filter(|j| j.spec.reservation == name) {
                let end = j.expected_end_ms(self.clock_ms);
                let window = res.window(self.clock_ms).filter(|(s, _)| *s <= self.clock_ms);
                let inside = j.allocation.iter().flat_map(|a| &a.nodes).all(|n| res.contains(&n.node));
                if !inside || window.is_none_or(|(_, e)| end > e) {
                    return Err(Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!(
                            "reservation {name} is busy: job {} runs in it on nodes or until a time the change leaves out",
                            j.display_id()
                        ),
                    ));
                }
            }
        }
        Ok(res)
    }

    /// The reservations that hold `node` (ended ones are purged).
    pub fn reservations_on(&self, node: &str) -> impl Iterator<Item = &Reservation> {
        self.reserved_nodes.get(node).into_iter().flatten().filter_map(|name| self.reservations.get(name))
    }

    /// Node → the reservations that hold it, from the reservations.
    pub(super) fn reserved_nodes_of_reservations(&self) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for r in self.reservations.values() {
            for n in &r.nodes {
                out.entry(n.clone()).or_default().push(r.name.clone());
            }
        }
        out
    }

    /// Node name → the reservation holding it at `now_ms` (active ones).
    pub fn active_reservations(&self, now_ms: u64) -> BTreeMap<&str, &Reservation> {
        let mut out = BTreeMap::new();
        for r in self.reservations.values().filter(|r| r.active(now_ms)) {
            for n in &r.nodes {
                out.insert(n.as_str(), r);
            }
        }
        out
    }

    /// Seats of license `name` the running jobs hold.
    pub fn licenses_in_use(&self, name: &str) -> u64 {
        self.licenses_used.get(name).copied().unwrap_or(0)
    }

    /// Drops reservations that have ended and do not repeat. Only a
    /// reservation command that takes effect does this (a refused command
    /// changes nothing); until then an ended one holds nothing and admits
    /// no job.
    fn purge_reservations(&mut self) {
        let now = self.clock_ms;
        self.reservations.retain(|_, r| r.window(now).is_some());
    }

    /// Why `job` may not use its reservation at all now (it does not exist,
    /// does not admit the job, or is not active yet), or None.
    pub fn reservation_gate(&self, job: &Job, now_ms: u64) -> Option<ReservationWait> {
        if job.spec.reservation.is_empty() {
            return None;
        }
        let Some(r) = self.reservations.get(&job.spec.reservation).filter(|r| r.window(now_ms).is_some()) else {
            return Some(ReservationWait::Deleted);
        };
        if !r.admits(&job.spec.user, &job.spec.account, self.is_admin(&job.submitted_by)) {
            return Some(ReservationWait::Deleted);
        }
        if !r.active(now_ms) {
            return Some(ReservationWait::NotYet);
        }
        None
    }

    /// The time limit (seconds) `job` would start with on `nodes` at
    /// `now_ms`, or why it cannot start there now. Its full limit, or a
    /// shorter one down to `--time-min` that ends before the first
    /// reservation it must stay out of, the end of its own reservation, and
    /// its deadline. The scheduler plans with this and apply starts the job
    /// with it.
    pub fn start_limit_s<'n>(
        &self,
        job: &Job,
        nodes: impl Iterator<Item = &'n str>,
        now_ms: u64,
    ) -> Result<u64, String> {
        let spec = &job.spec;
        // The latest end the rules allow.
        let mut end_by = u64::MAX;
        let mut why = String::new();
        if spec.deadline_ms > 0 {
            end_by = spec.deadline_ms;
            why = "its deadline".into();
        }
        let own = (!spec.reservation.is_empty()).then(|| self.reservations.get(&spec.reservation)).flatten();
        if !spec.reservation.is_empty() {
            let Some(r) = own else { return Err(format!("reservation {} does not exist", spec.reservation)) };
            let Some((_, end)) = r.window(now_ms).filter(|(s, _)| *s <= now_ms) else {
                return Err(format!("reservation {} is not active", r.name));
            };
            if end < end_by {
                end_by = end;
                why = format!("the end of reservation {}", r.name);
            }
        }
        let full_ms = spec.time_limit_s.saturating_mul(1000);
        let min_ms = job.min_limit_s().saturating_mul(1000);
        if !self.reservations.is_empty() {
            // Through the node index: a gang may span thousands of nodes.
            for node in nodes {
                if let Some(r) = own {
                    if !self.reservations_on(node).any(|x| x.name == r.name) {
                        return Err(format!("node {node} is not in reservation {}", r.name));
                    }
                }
                for r in self.reservations_on(node).filter(|r| Some(*r) != own) {
                    let Some((start, _)) = r.window(now_ms) else { continue };
                    if r.overlaps(now_ms, now_ms.saturating_add(min_ms)) {
                        return Err(format!("node {node} is reserved ({})", r.name));
                    }
                    // Not active now (that overlaps): the job must end
                    // before its next occurrence starts.
                    if start < end_by {
                        end_by = start;
                        why = format!("reservation {} on {node}", r.name);
                    }
                }
            }
        }
        let room_ms = end_by.saturating_sub(now_ms);
        if room_ms >= full_ms {
            return Ok(spec.time_limit_s);
        }
        if room_ms >= min_ms && min_ms > 0 {
            return Ok(room_ms / 1000);
        }
        Err(format!("its time limit would run past {why}"))
    }
}

/// Why a job that names a reservation cannot use it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationWait {
    /// It does not exist (deleted) or does not admit the job.
    Deleted,
    /// It has not started.
    NotYet,
}

impl ReservationWait {
    pub fn as_str(self) -> &'static str {
        match self {
            ReservationWait::Deleted => "gone, or it does not admit the job",
            ReservationWait::NotYet => "not active",
        }
    }
}
