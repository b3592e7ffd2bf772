//! The scheduler's working copy of the cluster for one pass: nodes in topology
//! order (so every domain — rack, block, zone — is a contiguous run), what each
//! has free as the plan uses it up, and gang placement over it.
//!
//! Placement of one gang (all or nothing):
//! ```text
//! candidates = nodes that can take one member now (and do not break a reservation)
//! for depth = deepest level .. required level:      (rack, then block, then zone)
//!     best-fit domain = the one with the fewest candidates that still holds the gang
//! else (no level required): spread over the fewest top-level domains
//! within the chosen domain: best-fit nodes (least left over), GPUs from one NVLink island
//! ```
//!
//! Related code: `mod.rs` (the pass), `explain.rs` (why a job does not fit).

use std::collections::BTreeMap;

use crate::fit::{gpu_is_type, mismatch};
use crate::model::{GpuHealth, Job, Node, NodeState};
use crate::policy::ClusterPolicy;
use crate::reservation::Reservation;
use crate::state::State;

/// What a node has left, as the plan being built uses it up.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Free {
    pub cpus: u32,
    pub mem_mb: u64,
    /// Free, healthy GPUs (bit i = GPU index i).
    pub gpus: u32,
    /// Jobs on the node (an exclusive job needs 0).
    pub jobs: u32,
}

/// A reservation's hold on a node: jobs that end after `until_ms` may only use
/// what the reservation leaves spare there.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hold {
    pub until_ms: u64,
    pub spare_cpus: u32,
    pub spare_mem_mb: u64,
    pub spare_gpus: u32,
}

impl Hold {
    /// Whether a member ending at `end_ms` may use a node under this hold.
    pub fn allows(hold: Option<&Hold>, m: &Member, end_ms: u64) -> bool {
        match hold {
            None => true,
            Some(h) => {
                end_ms <= h.until_ms
                    || (m.cpus <= h.spare_cpus && m.mem_mb <= h.spare_mem_mb && m.gpus.count_ones() <= h.spare_gpus)
            }
        }
    }
}

/// One gang member: node index and what it gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    pub node: usize,
    pub cpus: u32,
    pub mem_mb: u64,
    pub gpus: u32,
}

/// Why a gang found no place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Miss {
    /// Not enough nodes with free resources.
    Resources,
    /// No set of nodes could ever hold it (partition, features, sizes, topology).
    Impossible,
    /// Enough nodes, but not within one domain of the required level.
    Topology,
}

pub(crate) struct View<'a> {
    pub nodes: Vec<&'a Node>,
    pub free: Vec<Free>,
    /// Per node: bit p set when the node is in partition p (policy order).
    part_mask: Vec<u64>,
    part_index: BTreeMap<&'a str, usize>,
    /// Per depth d (1-based: d = 1 is the top level): domain id of each node.
    domains: Vec<Vec<u32>>,
    /// GPU NVLink island masks per node.
    islands: Vec<Vec<u32>>,
    pub policy: &'a ClusterPolicy,
    /// The pass's time: advance reservations hold nodes by time.
    pub now_ms: u64,
    /// Per node: the advance reservations that hold it (usually none).
    pub node_resv: Vec<Vec<&'a Reservation>>,
}

/// What a node index outside the view is rejected with.
const NO_SUCH_NODE: &str = "no such node";

/// The bit mask of a list of GPU indexes.
pub(crate) fn gpu_mask(gpus: &[u32]) -> u32 {
    gpus.iter().fold(0, |m, g| m | (1 << g))
}

/// What a placed gang holds, for quota checks.
pub(crate) fn members_use(members: &[Member]) -> crate::policy::Use {
    crate::policy::Use {
        gpus: members.iter().map(|m| u64::from(m.gpus.count_ones())).sum(),
        cpus: members.iter().map(|m| u64::from(m.cpus)).sum(),
        jobs: 1,
    }
}

/// GPUs matching a type prefix on a node (bit mask).
pub(crate) fn type_mask(node: &Node, gpu_type: &str) -> u32 {
    let mut m = 0;
    for g in &node.gpus {
        if gpu_is_type(g, gpu_type) {
            m |= 1 << g.index;
        }
    }
    m
}

impl<'a> View<'a> {
    /// The cluster of `state` at `now_ms`.
    pub fn of(state: &'a State, now_ms: u64) -> View<'a> {
        let mut view = View::new(state.nodes.values(), &state.policy);
        view.now_ms = now_ms;
        // A job suspended for a preemptor does not hold its CPUs and GPUs,
        // but they are kept for its resume: nothing else is planned there.
        if !state.yielded.is_empty() {
            let index: BTreeMap<&str, usize> =
                view.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
            let yielded = state.yielded.iter().filter_map(|id| state.jobs.get(id));
            for na in yielded.flat_map(|j| j.allocation.iter().flat_map(|a| &a.nodes)) {
                if let Some(f) = index.get(na.node.as_str()).and_then(|&i| view.free.get_mut(i)) {
                    f.cpus = f.cpus.saturating_sub(na.cpus);
                    f.gpus &= !gpu_mask(&na.gpus);
                }
            }
        }
        if !state.reservations.is_empty() {
            let index: BTreeMap<&str, usize> =
                view.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
            for r in state.reservations.values().filter(|r| r.window(now_ms).is_some()) {
                for i in r.nodes.iter().filter_map(|n| index.get(n.as_str())) {
                    if let Some(held) = view.node_resv.get_mut(*i) {
                        held.push(r);
                    }
                }
            }
        }
        view
    }

    pub fn new(nodes: impl Iterator<Item = &'a Node>, policy: &'a ClusterPolicy) -> View<'a> {
        let mut nodes: Vec<&Node> = nodes.collect();
        nodes.sort_by(|a, b| a.topology.cmp(&b.topology).then_with(|| a.name.cmp(&b.name)));
        let free = nodes.iter().map(|n| free_of(n)).collect();
        let part_index: BTreeMap<&str, usize> =
            policy.partitions.keys().enumerate().map(|(i, k)| (k.as_str(), i)).collect();
        let part_mask = nodes
            .iter()
            .map(|n| {
                let mut m = 0u64;
                for (i, p) in policy.partitions.values().enumerate() {
                    if p.contains(&n.name) {
                        m |= 1 << i;
                    }
                }
                m
            })
            .collect();
        let depth = nodes.iter().map(|n| n.topology.len()).max().unwrap_or(0);
        let mut domains = Vec::with_capacity(depth);
        for d in 1..=depth {
            let mut ids = Vec::with_capacity(nodes.len());
            let mut id = 0u32;
            let mut prev: Option<&Node> = None;
            for &n in &nodes {
                if prev.is_some_and(|p| prefix(p, d) != prefix(n, d)) {
                    crate::incr(&mut id);
                }
                ids.push(id);
                prev = Some(n);
            }
            domains.push(ids);
        }
        let islands = nodes
            .iter()
            .map(|n| {
                let mut by: BTreeMap<u32, u32> = BTreeMap::new();
                for g in &n.gpus {
                    *by.entry(g.nvlink_island).or_default() |= 1 << g.index;
                }
                by.into_values().collect()
            })
            .collect();
        let n = nodes.len();
        View { nodes, free, part_mask, part_index, domains, islands, policy, now_ms: 0, node_resv: vec![Vec::new(); n] }
    }

    pub fn depth(&self) -> usize {
        self.domains.len()
    }

    /// The powered-down pool nodes and what each would have free once up
    /// (their `free` here is none: see `Pass::dormant`).
    pub fn dormant(&self) -> BTreeMap<usize, Free> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.state == NodeState::PoweredDown)
            .map(|(i, n)| (i, unused(n)))
            .collect()
    }

    /// Whether node `i` could ever hold one member of `job` (ignoring what is in
    /// use): up, in the partition, with the features and enough hardware.
    pub fn static_ok(&self, i: usize, job: &Job) -> bool {
        self.static_reject(i, job).is_none()
    }

    /// Why node `i` cannot hold a member of `job` whatever runs on it, if it
    /// cannot (down and drained nodes cannot now).
    pub fn static_reject(&self, i: usize, job: &Job) -> Option<&'static str> {
        let Some(n) = self.nodes.get(i) else { return Some(NO_SUCH_NODE) };
        if !n.state.takes_work() {
            return Some(if n.state == NodeState::Down { "node down" } else { "node drained" });
        }
        if let Some(why) = self.hardware_reject(i, job) {
            return Some(why);
        }
        self.reservation_reject(i, job, self.now_ms)
    }

    /// Why advance reservations keep node `i` from `job` if it started at
    /// `at_ms` with its shortest limit: outside its reservations a job must
    /// end before they start; in its own, it must end by its end.
    pub fn reservation_reject(&self, i: usize, job: &Job, at_ms: u64) -> Option<&'static str> {
        if self.reservations_of(i).is_empty() {
            return None;
        }
        let end = at_ms.saturating_add(job.min_limit_s().saturating_mul(1000));
        (!self.reservations_allow(i, job, at_ms, end))
            .then_some("reserved (an advance reservation holds it before the job would end)")
    }

    /// Whether node `i` may hold a member of `job` that runs over
    /// `[from_ms, to_ms)` as far as advance reservations go (for start
    /// estimates in the future).
    pub fn reservations_allow(&self, i: usize, job: &Job, from_ms: u64, to_ms: u64) -> bool {
        let own = job.spec.reservation.as_str();
        self.reservations_of(i).iter().all(|r| {
            if r.name == own {
                r.window(from_ms).is_some_and(|(s, e)| s <= from_ms && to_ms <= e)
            } else {
                !r.overlaps(from_ms, to_ms)
            }
        })
    }

    /// The advance reservations that hold node `i` (none for an unknown node).
    fn reservations_of(&self, i: usize) -> &[&'a Reservation] {
        self.node_resv.get(i).map_or(&[], Vec::as_slice)
    }

    /// Why node `i` could never hold a member of `job`, even when up and idle:
    /// partition, features, hardware.
    pub fn hardware_reject(&self, i: usize, job: &Job) -> Option<&'static str> {
        let Some(n) = self.nodes.get(i) else { return Some(NO_SUCH_NODE) };
        let in_partition = self.policy.partitions.is_empty()
            || self
                .part_index
                .get(job.spec.partition.as_str())
                .is_some_and(|&p| self.part_mask.get(i).is_some_and(|m| m & (1 << p) != 0));
        if let Some(m) = mismatch(&job.spec, n, in_partition) {
            return Some(m.as_str());
        }
        let own = &job.spec.reservation;
        if !own.is_empty() && !self.reservations_of(i).iter().any(|r| &r.name == own) {
            return Some("not in the job's reservation");
        }
        None
    }

    /// What one member of `job` takes on node `i` if it fits in `f` now.
    pub fn fit(&self, i: usize, job: &Job, f: &Free, tmask: u32) -> Option<Member> {
        let s = &job.spec;
        let n = self.nodes.get(i)?;
        let cpus = if s.exclusive { n.cpus } else { s.cpus_per_node() };
        if f.cpus < cpus || f.mem_mb < s.mem_per_node_mb || (s.exclusive && f.jobs > 0) {
            return None;
        }
        let gpus = pick_gpus(f.gpus & tmask, s.gpus_per_node, self.islands.get(i)?)?;
        Some(Member { node: i, cpus, mem_mb: s.mem_per_node_mb, gpus })
    }

    /// Whether node `i` can take one member of `job` with what it has free now.
    pub fn fits_now(&self, i: usize, job: &Job) -> bool {
        let (Some(f), Some(n)) = (self.free.get(i), self.nodes.get(i)) else { return false };
        self.fit(i, job, f, type_mask(n, &job.spec.gpu_type)).is_some()
    }

    /// Why node `i` (statically fine) cannot take a member now.
    pub fn busy_reason(&self, job: &Job, f: &Free) -> &'static str {
        let s = &job.spec;
        if s.exclusive && f.jobs > 0 {
            "in use (exclusive job needs a whole node)"
        } else if f.cpus < s.cpus_per_node() {
            "CPUs in use"
        } else if f.mem_mb < s.mem_per_node_mb {
            "memory in use"
        } else {
            "GPUs in use"
        }
    }

    /// Places `job` whole on `free`, or says why not. `holds`/`end_ms` keep
    /// long jobs out of what reservations need; `topology_depth` is the level
    /// that must hold the whole gang (None: preferred tightest, any allowed).
    pub fn place(
        &self,
        job: &Job,
        free: &[Free],
        holds: Option<(&[Option<Hold>], u64)>,
        required_depth: Option<usize>,
        at_ms: u64,
    ) -> Result<Vec<Member>, Miss> {
        if !job.spec.components.is_empty() {
            return self.place_het(job, free, holds, required_depth, at_ms);
        }
        let s = &job.spec;
        let need = s.nodes as usize;
        let want = s.nodes_max() as usize;
        let mut cand: Vec<Member> = Vec::new();
        for (i, (n, f)) in self.nodes.iter().zip(free).enumerate() {
            // Cheap filters first: most nodes are rejected here on a busy cluster.
            if f.cpus < s.cpus_per_node() || f.mem_mb < s.mem_per_node_mb || f.gpus.count_ones() < s.gpus_per_node {
                continue;
            }
            if !n.state.takes_work()
                || self.hardware_reject(i, job).is_some()
                || self.reservation_reject(i, job, at_ms).is_some()
            {
                continue;
            }
            let Some(m) = self.fit(i, job, f, type_mask(n, &s.gpu_type)) else { continue };
            if let Some((holds, end_ms)) = holds {
                if !Hold::allows(holds.get(i).and_then(Option::as_ref), &m, end_ms) {
                    continue;
                }
            }
            cand.push(m);
        }
        if cand.len() < need {
            return Err(Miss::Resources);
        }
        let leftover = |m: &Member| {
            free.get(m.node).map_or((0, 0), |f| ((f.gpus & !m.gpus).count_ones(), f.cpus.saturating_sub(m.cpus)))
        };
        if !s.nodelist.is_empty() && s.nodelist.len() < need {
            let listed = s.nodelist.iter().map(String::as_str).collect();
            return self.place_with_listed(job, cand, required_depth, &leftover, &listed, true);
        }
        if let Some(previous) = job.expedite_nodes.as_ref().filter(|p| !p.is_empty()) {
            // Its previous nodes and spares; else wherever it fits.
            let previous = previous.iter().map(String::as_str).collect();
            if let Ok(m) = self.place_with_listed(job, cand.clone(), required_depth, &leftover, &previous, false) {
                return Ok(m);
            }
        }
        if need == 1 && want == 1 {
            // Best fit, then the fullest deepest domain (keeps empty racks whole).
            let counts = self.domain_counts(&cand, self.depth());
            let domain_cands = |m: &Member| {
                let c = counts.as_ref().zip(self.dom(self.depth(), m.node));
                c.and_then(|(c, dom)| c.get(dom)).copied().unwrap_or(0)
            };
            let Some(best) = cand.iter().min_by_key(|m| (leftover(m), domain_cands(m), m.node)) else {
                return Err(Miss::Resources);
            };
            return Ok(vec![best.clone()]);
        }
        let floor = required_depth.unwrap_or(1).max(1);
        for d in (floor..=self.depth()).rev() {
            let Some(counts) = self.domain_counts(&cand, d) else { continue };
            let best = counts.iter().enumerate().filter(|(_, &c)| c >= need).min_by_key(|(id, &c)| (c, *id));
            if let Some((dom, _)) = best {
                let mut members: Vec<Member> = cand.into_iter().filter(|m| self.dom(d, m.node) == Some(dom)).collect();
                members.sort_by_key(|m| (leftover(m), m.node));
                members.truncate(want);
                members.sort_by_key(|m| m.node);
                return Ok(members);
            }
        }
        if required_depth.is_some() && self.depth() > 0 {
            return Err(Miss::Topology);
        }
        // No single domain holds it: fill from the top-level domains with the
        // most candidates first (spans as few as possible).
        if let Some(counts) = self.domain_counts(&cand, 1) {
            cand.sort_by_key(|m| {
                let dom = self.dom(1, m.node);
                let c = dom.and_then(|dom| counts.get(dom)).copied().unwrap_or(0);
                (std::cmp::Reverse(c), dom, leftover(m), m.node)
            });
        } else {
            cand.sort_by_key(|m| (leftover(m), m.node));
        }
        cand.truncate(want);
        cand.sort_by_key(|m| m.node);
        Ok(cand)
    }

    /// A heterogeneous job, all or nothing: each component in turn, as a gang
    /// of its own shape, on nodes no earlier component took and with what
    /// they left free; nodes another component lists (`-w`) are kept for it.
    /// Members are in component order (what `apply` expects: component 0's
    /// nodes first).
    fn place_het(
        &self,
        job: &Job,
        free: &[Free],
        holds: Option<(&[Option<Hold>], u64)>,
        required_depth: Option<usize>,
        at_ms: u64,
    ) -> Result<Vec<Member>, Miss> {
        // A node with no CPUs left is no candidate for any member.
        let unusable = Free { cpus: 0, mem_mb: 0, gpus: 0, jobs: u32::MAX };
        let lists = || std::iter::once(&job.spec.nodelist).chain(job.spec.components.iter().map(|c| &c.nodelist));
        // Node indexes by name, only when some component lists nodes.
        let index: BTreeMap<&str, usize> = if lists().any(|l| !l.is_empty()) {
            self.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect()
        } else {
            BTreeMap::new()
        };
        let mut free = free.to_vec();
        let mut all: Vec<Member> = Vec::new();
        for k in 0..job.spec.het_size() {
            let part = job.component_job(k);
            let mut mine = free.clone();
            for (_, listed) in lists().enumerate().filter(|(j, _)| *j != k) {
                for i in listed.iter().filter_map(|n| index.get(n.as_str())) {
                    if let Some(f) = mine.get_mut(*i) {
                        *f = unusable;
                    }
                }
            }
            let members = self.place(&part, &mine, holds, required_depth, at_ms)?;
            for m in &members {
                if let Some(f) = free.get_mut(m.node) {
                    *f = unusable;
                }
            }
            all.extend(members);
        }
        Ok(all)
    }

    /// A gang of the `listed` nodes first, then the best-fitting others
    /// (within the listed nodes' domain when a level is required). With
    /// `all`, every listed node must be in it, as Slurm completes a `-w`
    /// list shorter than `-N`; without, they are preferred (an expedited
    /// requeue's previous nodes: those still free, plus spares).
    fn place_with_listed(
        &self,
        job: &Job,
        cand: Vec<Member>,
        required_depth: Option<usize>,
        leftover: &dyn Fn(&Member) -> (u32, u32),
        listed: &std::collections::BTreeSet<&str>,
        all: bool,
    ) -> Result<Vec<Member>, Miss> {
        let s = &job.spec;
        let (mut members, mut rest): (Vec<Member>, Vec<Member>) =
            cand.into_iter().partition(|m| self.nodes.get(m.node).is_some_and(|n| listed.contains(n.name.as_str())));
        if (all && members.len() < listed.len()) || members.is_empty() {
            return Err(Miss::Resources);
        }
        let want = s.nodes_max() as usize;
        members.truncate(want);
        if let Some(d) = required_depth.filter(|d| (1..=self.depth()).contains(d)) {
            let dom = members.first().and_then(|m| self.dom(d, m.node));
            if dom.is_none() || members.iter().any(|m| self.dom(d, m.node) != dom) {
                return Err(Miss::Topology);
            }
            rest.retain(|m| self.dom(d, m.node) == dom);
        }
        // At least enough for the gang's minimum, at most its maximum.
        let need = (s.nodes as usize).saturating_sub(members.len());
        if rest.len() < need {
            return Err(Miss::Resources);
        }
        rest.sort_by_key(|m| (leftover(m), m.node));
        members.extend(rest.into_iter().take(want.saturating_sub(members.len())));
        members.sort_by_key(|m| m.node);
        Ok(members)
    }

    /// The domain id of node `i` at `depth` (1 = top level); None for a
    /// level or node the cluster does not have.
    pub fn domain_of(&self, depth: usize, i: usize) -> Option<usize> {
        self.dom(depth, i)
    }

    fn dom(&self, depth: usize, node: usize) -> Option<usize> {
        self.domains.get(depth.saturating_sub(1))?.get(node).map(|&id| id as usize)
    }

    /// Candidates per domain at `depth` (None when the cluster has no levels).
    fn domain_counts(&self, cand: &[Member], depth: usize) -> Option<Vec<usize>> {
        if depth == 0 || depth > self.depth() {
            return None;
        }
        let ids = self.domains.get(depth.saturating_sub(1))?;
        // Ids are numbered in node order, so the last is the largest.
        let mut counts = vec![0usize; ids.last().map_or(0, |&l| (l as usize).saturating_add(1))];
        for &id in cand.iter().filter_map(|m| ids.get(m.node)) {
            if let Some(c) = counts.get_mut(id as usize) {
                crate::incr(c);
            }
        }
        Some(counts)
    }

    /// Takes a gang's resources out of `free`.
    pub fn take(free: &mut [Free], members: &[Member]) {
        for m in members {
            let Some(f) = free.get_mut(m.node) else { continue };
            f.cpus = f.cpus.saturating_sub(m.cpus);
            f.mem_mb = f.mem_mb.saturating_sub(m.mem_mb);
            f.gpus &= !m.gpus;
            crate::incr(&mut f.jobs);
        }
    }

    /// Gives resources back to `free` (a job expected to end).
    pub fn give(&self, free: &mut [Free], node: usize, cpus: u32, mem_mb: u64, gpus: u32) {
        let (Some(f), Some(n)) = (free.get_mut(node), self.nodes.get(node)) else { return };
        // Never more than the node has: a job suspended for a preemptor
        // counts as holding the CPUs the preemptor holds too.
        f.cpus = f.cpus.saturating_add(cpus).min(n.cpus);
        f.mem_mb = f.mem_mb.saturating_add(mem_mb).min(n.mem_mb);
        // A GPU quarantined meanwhile does not come back.
        let healthy: u32 = n.gpus.iter().filter(|g| g.health == GpuHealth::Healthy).fold(0, |m, g| m | (1 << g.index));
        f.gpus |= gpus & healthy;
        f.jobs = f.jobs.saturating_sub(1);
    }
}

/// The first `d` levels of `n`'s topology (all of them when it has fewer).
fn prefix(n: &Node, d: usize) -> &[String] {
    n.topology.get(..d).unwrap_or(&n.topology)
}

/// What node `n` has free for new work: nothing unless it is up (or a pool
/// node booting, which takes work while it boots).
fn free_of(n: &Node) -> Free {
    if matches!(n.state, NodeState::Up | NodeState::PoweringUp) {
        unused(n)
    } else {
        Free { cpus: 0, mem_mb: 0, gpus: 0, jobs: u32::try_from(n.jobs.len()).unwrap_or(u32::MAX) }
    }
}

/// What node `n`'s allocations leave unused, whatever its state.
fn unused(n: &Node) -> Free {
    let gpus = n
        .gpus
        .iter()
        .filter(|g| g.allocated_to.is_none() && g.health == GpuHealth::Healthy)
        .fold(0, |m, g| m | (1 << g.index));
    let jobs = u32::try_from(n.jobs.len()).unwrap_or(u32::MAX);
    Free { cpus: n.cpus.saturating_sub(n.cpus_alloc), mem_mb: n.mem_mb.saturating_sub(n.mem_alloc_mb), gpus, jobs }
}

/// Picks `n` GPUs from `avail`: the tightest single island that holds them all,
/// else the fullest islands first.
pub(crate) fn pick_gpus(avail: u32, n: u32, islands: &[u32]) -> Option<u32> {
    if n == 0 {
        return Some(0);
    }
    if avail.count_ones() < n {
        return None;
    }
    let take = |mask: u32, k: u32| {
        let mut out = 0u32;
        let mut m = mask;
        for _ in 0..k {
            let bit = m & m.wrapping_neg();
            out |= bit;
            m &= !bit;
        }
        out
    };
    let best = islands.iter().map(|&isl| isl & avail).filter(|m| m.count_ones() >= n).min_by_key(|m| m.count_ones());
    if let Some(m) = best {
        return Some(take(m, n));
    }
    let mut by_size: Vec<u32> = islands.iter().map(|&isl| isl & avail).collect();
    by_size.sort_by_key(|m| std::cmp::Reverse(m.count_ones()));
    let mut out = 0u32;
    let mut left = n;
    for m in by_size {
        let k = m.count_ones().min(left);
        out |= take(m, k);
        left = left.saturating_sub(k);
        if left == 0 {
            break;
        }
    }
    (left == 0).then_some(out)
}
