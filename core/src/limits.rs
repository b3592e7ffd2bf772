//! Every limit the core enforces, in one place, each with the reason for its size.

/// Nodes in one gang: the whole fleet (frontier training runs take 2,048
/// eight-GPU nodes, HPC sites 9,000+). A placement of this many nodes is
/// under 1 MiB in one Raft entry, and its launch order (every node's name)
/// well under the agent's order budget.
pub const NODES_PER_JOB_MAX: u32 = 20_000;
const _: () = assert!(NODES_PER_JOB_MAX as usize == NODES_MAX, "a gang may span the whole fleet");
/// Nodes in one gang while the cluster is on a data format before 8 (see
/// `format::BIG_GANGS_FORMAT`): what builds before it accept.
pub const NODES_PER_JOB_MAX_BEFORE_FORMAT_8: u32 = 1024;
/// GPUs on one node. The densest servers today carry 16 accelerators.
pub const GPUS_PER_NODE_MAX: u32 = 16;
/// Tasks on one node: one per hardware thread on the largest hosts.
pub const TASKS_PER_NODE_MAX: u32 = 1024;
/// CPUs per task: the largest single hosts have ~1,024 hardware threads.
pub const CPUS_PER_TASK_MAX: u32 = 1024;
/// Memory per node, in MiB: 64 TiB, beyond any single host sold today.
pub const MEM_PER_NODE_MB_MAX: u64 = 64 * 1024 * 1024;
/// Longest time limit: one year. Longer requests are almost always a unit mistake.
pub const TIME_LIMIT_S_MAX: u64 = 365 * 24 * 3600;
/// Default time limit when a job names none (Slurm sites commonly default to a day).
pub const TIME_LIMIT_S_DEFAULT: u64 = 24 * 3600;
/// A batch script or command line is stored in the replicated log; 1 MiB keeps one
/// submission well inside a Raft entry and a gRPC message.
pub const SCRIPT_BYTES_MAX: usize = 1024 * 1024;
/// Arguments in a command line.
pub const ARGS_MAX: usize = 4096;
/// Job, user, partition and node names: short identifiers, like Slurm's.
pub const NAME_BYTES_MAX: usize = 256;
/// A job's comment: a line of notes, kept in every replica's state.
pub const COMMENT_BYTES_MAX: usize = 1024;
/// Working directory paths (PATH_MAX on Linux).
pub const PATH_BYTES_MAX: usize = 4096;
/// Environment variables carried by one job.
pub const ENV_VARS_MAX: usize = 1024;
/// Bytes of one environment value (Linux caps one argument/env string at 128 KiB).
pub const ENV_VALUE_BYTES_MAX: usize = 128 * 1024;
/// Idempotency keys are client-chosen tokens (UUIDs are 36 bytes).
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 128;
/// How long a submit's idempotency key is remembered. Clients retry within seconds
/// or minutes; a day covers a client that retries after an outage.
pub const IDEMPOTENCY_TTL_MS: u64 = 24 * 3600 * 1000;
/// Idempotency keys remembered for one identity at once; past it its oldest
/// is forgotten first (from data format 14). At the write limit (500 a
/// second) that still covers 100 s of retries, and a pipeline's day of
/// 50,000 submits the whole day; without it, submit-and-cancel at the write
/// limit kept ~21 million keys a day on every replica and in every snapshot.
pub const IDEMPOTENCY_KEYS_PER_IDENTITY_MAX: usize = 50_000;
/// Idempotency keys remembered in all; past it the oldest anyone's is
/// forgotten first (from data format 14). At most ~100 MB of keys with
/// their indexes (128-byte keys), on every replica and in every snapshot.
pub const IDEMPOTENCY_KEYS_MAX: usize = 250_000;
/// Jobs that are not finished (pending or running). A million pending jobs is the
/// scale the scheduler is designed for; beyond it, submits are refused rather than
/// letting replicas run out of memory.
pub const ACTIVE_JOBS_MAX: usize = 1_000_000;
/// Finished jobs kept in the replicated state (the oldest are dropped first), like
/// Slurm's MinJobAge purge; long-term history is accounting's job.
pub const FINISHED_JOBS_RETAINED_MAX: usize = 100_000;
/// Nodes in one cluster (the scale named in the design: 10,000 eight-GPU nodes, with headroom).
pub const NODES_MAX: usize = 20_000;
/// Labels per node and topology levels per path.
pub const LABELS_PER_NODE_MAX: usize = 64;
pub const TOPOLOGY_LEVELS_MAX: usize = 8;
/// Length of a GPU type name such as `h100-80gb`.
pub const GPU_TYPE_BYTES_MAX: usize = 64;
/// Steps kept per job attempt (sacct's `ID.N` lines): the newest; an older
/// step that ended makes way (else the oldest). A training job runs a handful; a script that
/// loops over thousands of sruns keeps its last 64, so retained jobs stay
/// small (their steps count in `FINISHED_BYTES_RETAINED_MAX`).
pub const STEPS_PER_JOB_MAX: usize = 64;
/// Nodes a step's record lists when it runs on part of its job's nodes (a
/// step on all of them lists none). Steps on more, but not all, are not
/// recorded (srun says so and runs them).
pub const STEP_NODES_LISTED_MAX: usize = 64;
/// Tasks of one step on one node (the agent's own limit).
pub const STEP_TASKS_PER_NODE_MAX: u32 = 1024;
/// A step's recorded name (its program's name).
pub const STEP_NAME_BYTES_MAX: usize = 64;

/// Attempts one job may make. A job requeued this often (its nodes keep failing
/// under it) ends NODE_FAIL instead of cycling through the cluster forever.
pub const ATTEMPTS_MAX: u32 = 16;
/// Longest lead time of a pre-time-limit warning signal (Slurm's maximum).
pub const WARN_BEFORE_S_MAX: u32 = 65_535;
/// Features in one job's constraint: real constraints name a few.
pub const CONSTRAINTS_MAX: usize = 32;
/// Nodes one job may exclude by name (Slurm's --exclude): a rack or two of
/// known-bad hosts, bounded so a spec stays small.
pub const EXCLUDED_NODES_MAX: usize = 1024;
/// Different licenses one job may hold: Slurm sites name a handful (a
/// tracker, a solver, a compiler); this bounds a spec's map.
pub const LICENSES_PER_JOB_MAX: usize = 16;
/// Seats of one license a job may ask for, and a cluster may have: far above
/// any real site's count, small enough that sums over 1,000,000 jobs stay in
/// a u64.
pub const LICENSE_COUNT_MAX: u32 = 1_000_000;
/// Licenses a cluster may define (the policy's `licenses` table).
pub const LICENSES_MAX: usize = 256;
/// Bytes of a certificate or token name a policy may map or grant to: as
/// long as any name a replica verifies (`gangway_proto::tls::PRINCIPAL_NAME_BYTES_MAX`;
/// the controller checks the two agree at compile time). A longer one could
/// never match a caller.
pub const IDENTITY_NAME_BYTES_MAX: usize = 128;
/// Advance reservations at once: one per maintenance window, team or event;
/// each pass of the scheduler walks them all.
pub const RESERVATIONS_MAX: usize = 256;
/// Users or accounts one reservation may name.
pub const RESERVATION_NAMES_MAX: usize = 256;
/// Nodes one reservation may hold: a whole fleet (`Nodes=ALL` for maintenance).
pub const RESERVATION_NODES_MAX: usize = NODES_MAX;
/// Node entries over all reservations: the scheduler and apply look nodes
/// up in an index of them; a few whole-fleet windows at most.
pub const RESERVED_NODE_ENTRIES_MAX: usize = 4 * NODES_MAX;
/// How far ahead a reservation may start, and how long it may last: a year.
pub const RESERVATION_HORIZON_S: u64 = 366 * 24 * 3600;
/// Jobs one job may depend on: pipelines name a handful; bounds the work of
/// resolving a finish.
pub const DEPENDENCIES_MAX: usize = 64;

/// Accounts, and QOS, with license limits of their own: one entry per
/// account or QOS of the policy at most.
pub const LICENSE_LIMIT_SCOPES_MAX: usize = ACCOUNTS_MAX;

/// Further components of a heterogeneous job (so at most 16 in all): sites
/// use two to four (a reward model and an actor, a CPU and a GPU part);
/// each one is a placement the scheduler tries in every pass.
pub const HET_COMPONENTS_MAX: usize = 15;
/// Elements in one job array (Slurm's MaxArraySize defaults to 1001): each is a
/// full job in the replicated state.
pub const ARRAY_TASKS_MAX: usize = 10_000;
/// Largest array index (Slurm caps indexes at MaxArraySize - 1 = 4,000,000 max).
pub const ARRAY_INDEX_MAX: u32 = 4_000_000;
/// Bytes of spec copied into one array's elements in all: an array of large
/// scripts would otherwise blow up the replicated state.
pub const ARRAY_SPEC_BYTES_MAX: usize = 64 * 1024 * 1024;
/// Nice values (Slurm allows ±2147483645; a priority's weighted factors sum to
/// far less, so this is plenty).
pub const NICE_MAX: i32 = 1_000_000;
/// Buckets of historical usage kept per account for fair share: with buckets a
/// quarter half-life wide this covers 16 half-lives (usage then weighs 1/65536).
pub const USAGE_BUCKETS_MAX: usize = 64;
/// Largest exit code a task can report: a wait status keeps 8 bits of it.
pub const EXIT_CODE_MAX: i32 = 255;
/// Largest signal a task can report: a wait status keeps 7 bits of it (Linux's
/// SIGRTMAX is 64).
pub const SIGNAL_MAX: i32 = 127;
/// The highest signal a job may be sent (`scancel --signal`): Linux's SIGRTMAX.
pub const SIGNAL_SEND_MAX: i32 = 64;
/// Bytes of a reason an agent or the leader attaches to an ending or a health
/// change: a line or two of error text.
pub const REASON_BYTES_MAX: usize = 4096;

/// Checks a task's reported ending against what a wait status can hold.
pub fn check_task_exit(exit_code: Option<i32>, signal: Option<i32>, reason: &str) -> Result<(), crate::SpecError> {
    if let Some(c) = exit_code.filter(|c| !(0..=EXIT_CODE_MAX).contains(c)) {
        return Err(crate::SpecError::new("exit_code", format!("must be 0..={EXIT_CODE_MAX}, got {c}")));
    }
    if let Some(s) = signal.filter(|s| !(1..=SIGNAL_MAX).contains(s)) {
        return Err(crate::SpecError::new("signal", format!("must be 1..={SIGNAL_MAX}, got {s}")));
    }
    if reason.len() > REASON_BYTES_MAX {
        return Err(crate::SpecError::new("reason", format!("must be at most {REASON_BYTES_MAX} bytes")));
    }
    Ok(())
}

/// Bytes of one job's spec as [`crate::spec::JobSpec::size_bytes`] counts them:
/// a 1 MiB script with a generous environment. A spec travels whole in a
/// launch order, so it stays far below what an agent accepts in one message
/// (`gangway_proto::limits::AGENT_MESSAGE_BYTES_MAX`, 16 MiB). Since format 5.
pub const JOB_SPEC_BYTES_MAX: usize = 2 * 1024 * 1024;
/// Unfinished jobs one user may have, whatever the policy's quotas say: a
/// runaway submit loop must not fill the cluster's queue (ACTIVE_JOBS_MAX) by
/// itself. Since format 5.
pub const USER_UNFINISHED_JOBS_MAX: u64 = 200_000;
/// Bytes of spec one user's unfinished jobs may hold on every replica: ~500
/// jobs with 1 MiB scripts, or 100,000 with ordinary ones. Since format 5.
pub const USER_UNFINISHED_BYTES_MAX: u64 = 512 * 1024 * 1024;
/// Bytes of spec all unfinished jobs may hold: the replicated state must fit in
/// each replica's memory (and a snapshot in one transfer) with room to spare.
/// Since format 5.
pub const CLUSTER_UNFINISHED_BYTES_MAX: u64 = 4 * 1024 * 1024 * 1024;

/// The budget that `count` more jobs of `spec_bytes` each would exceed for a
/// user who has `user_jobs` unfinished jobs holding `user_bytes`, in a cluster
/// whose unfinished jobs hold `all_bytes`: the message (naming the budget and
/// what to do), or None.
pub fn budget_exceeded(
    user: &str,
    user_jobs: u64,
    user_bytes: u64,
    all_bytes: u64,
    spec_bytes: usize,
    count: usize,
) -> Option<String> {
    if user_jobs.saturating_add(count as u64) > USER_UNFINISHED_JOBS_MAX {
        return Some(format!(
            "budget: user {user} has {user_jobs} unfinished jobs and may have {USER_UNFINISHED_JOBS_MAX}; \
             retry when some have finished"
        ));
    }
    let adding = (spec_bytes as u64).saturating_mul(count as u64);
    if user_bytes.saturating_add(adding) > USER_UNFINISHED_BYTES_MAX {
        return Some(format!(
            "budget: user {user}'s unfinished jobs hold {user_bytes} bytes of scripts and environment; these add \
             {adding}, over the {USER_UNFINISHED_BYTES_MAX} a user may hold; retry when some have finished"
        ));
    }
    if all_bytes.saturating_add(adding) > CLUSTER_UNFINISHED_BYTES_MAX {
        return Some(format!(
            "budget: the cluster's unfinished jobs hold {all_bytes} bytes of scripts and environment; these add \
             {adding}, over its {CLUSTER_UNFINISHED_BYTES_MAX}; retry later"
        ));
    }
    None
}

/// Bytes of spec the retained finished jobs may hold (besides their count,
/// FINISHED_JOBS_RETAINED_MAX): without it, jobs submitted and cancelled at the
/// write rate would each leave up to 2 MiB behind, 200 GiB at the count limit.
/// The oldest finished jobs go first. Since format 5.
pub const FINISHED_BYTES_RETAINED_MAX: u64 = 2 * 1024 * 1024 * 1024;

/// Checks one spec's size against [`JOB_SPEC_BYTES_MAX`].
pub fn check_spec_size(spec: &crate::JobSpec) -> Result<(), crate::SpecError> {
    let bytes = spec.size_bytes();
    if bytes > JOB_SPEC_BYTES_MAX {
        return Err(crate::SpecError::new(
            "spec",
            format!(
                "the job's script, command, environment and lists come to {bytes} bytes; at most {JOB_SPEC_BYTES_MAX}"
            ),
        ));
    }
    Ok(())
}

/// Accounts in the tree: large organisations have thousands of projects.
pub const ACCOUNTS_MAX: usize = 10_000;

#[cfg(test)]
mod tests {
    use super::*;

    /// Each budget holds at its limit and refuses one past it.
    #[test]
    fn budgets_refuse_one_past_each_limit() {
        let ok = |jobs, mine, all, bytes, count| budget_exceeded("u", jobs, mine, all, bytes, count);
        assert_eq!(ok(USER_UNFINISHED_JOBS_MAX - 1, 0, 0, 1, 1), None);
        assert!(ok(USER_UNFINISHED_JOBS_MAX, 0, 0, 1, 1).unwrap().contains("unfinished jobs and may have"));
        assert_eq!(ok(0, USER_UNFINISHED_BYTES_MAX - 10, 0, 10, 1), None);
        assert!(ok(0, USER_UNFINISHED_BYTES_MAX - 10, 0, 11, 1).unwrap().contains("a user may hold"));
        assert!(ok(0, USER_UNFINISHED_BYTES_MAX - 10, 0, 6, 2).unwrap().contains("a user may hold"));
        assert_eq!(ok(0, 0, CLUSTER_UNFINISHED_BYTES_MAX - 10, 10, 1), None);
        assert!(ok(0, 0, CLUSTER_UNFINISHED_BYTES_MAX - 10, 11, 1).unwrap().contains("over its"));
        // Saturating: absurd sizes are refused, not wrapped into a pass.
        assert!(ok(0, 0, 0, usize::MAX, usize::MAX).is_some());
    }

    #[test]
    fn exit_codes_and_signals_stop_at_what_a_wait_status_holds() {
        assert!(check_task_exit(Some(EXIT_CODE_MAX), None, "").is_ok());
        assert!(check_task_exit(Some(EXIT_CODE_MAX + 1), None, "").is_err());
        assert!(check_task_exit(Some(-1), None, "").is_err());
        assert!(check_task_exit(None, Some(SIGNAL_MAX), "").is_ok());
        assert!(check_task_exit(None, Some(SIGNAL_MAX + 1), "").is_err());
        assert!(check_task_exit(None, Some(0), "").is_err());
        assert!(check_task_exit(None, None, &"r".repeat(REASON_BYTES_MAX)).is_ok());
        assert!(check_task_exit(None, None, &"r".repeat(REASON_BYTES_MAX + 1)).is_err());
    }
}
