//! Data formats: how replicated and persisted values are encoded, and how a
//! cluster moves from one format to the next without stopping.
//!
//! bincode is positional, so any change to a replicated type changes its
//! bytes. Every encoding therefore names its format:
//!
//! - a log entry is a [`crate::payload::Payload`]: in format 4 the bare command (as the builds
//!   before formats were named wrote it), from format 5 on an envelope
//!   `(format, bytes)` in a variant index format 4 never used, so a format-4
//!   build refuses it instead of misreading it;
//! - a snapshot starts with a magic tag and its format (see [`crate::snapshot`]);
//! - the state records the cluster's format ([`crate::State::format`]).
//!
//! **Rolling upgrades.** A build reads every format from [`FORMAT_OLDEST`] to
//! [`FORMAT_NEWEST`] but writes the cluster's format, which only a committed
//! [`Command::SetDataFormat`](crate::command::Command::SetDataFormat) changes. The leader proposes it once every
//! member reports a build that reads the new format (etcd's cluster version).
//! Until then, old and new builds replicate and apply the same bytes with the
//! same meaning: `apply` keeps a format's semantics (`State::format` gates new
//! rules), so a mixed cluster never diverges.
//!
//! **Changing a format.** Bump [`FORMAT_NEWEST`], freeze the previous
//! format's types in `compat::vN` with conversions, keep decoding it, and
//! re-bless the golden encodings (`core/tests/golden/`), which fail
//! the tests whenever the bytes of a format change.

use serde::Serialize;

/// The format every log starts in: a new cluster's first entries are written
/// in it until its leader moves the cluster to the newest format.
pub const FORMAT_BASE: u32 = 4;
/// The oldest format this build reads (log entries, snapshots, stores).
pub const FORMAT_OLDEST: u32 = 4;
/// The newest format this build reads and, once every replica can, writes.
pub const FORMAT_NEWEST: u32 = 18;

/// Format 7 changed no encoding, only a rule of `apply`: a plan's preemption
/// victims are evicted only together with the placement they make room for,
/// once that placement is accepted (see `State::apply_schedule`). A cluster
/// with builds that apply the old rule stays on format 6.
pub const PLAN_APPLY_FORMAT: u32 = 7;

/// Format 8 changed no encoding, only a limit `apply` checks: a job may span
/// up to [`crate::limits::NODES_PER_JOB_MAX`] nodes (the cluster's node
/// limit) instead of [`crate::limits::NODES_PER_JOB_MAX_BEFORE_FORMAT_8`]. A
/// build that refuses such a job must not apply a log that accepts it.
pub const BIG_GANGS_FORMAT: u32 = 8;

/// Format 9 added the licenses, the reservation, `--time-min`, `--deadline`
/// and `--requeue=expedite` to the job spec, the shortened limit and the
/// expedited nodes to the job, the licenses to the policy, the advance
/// reservations to the state, [`Command::ChangeReservation`](crate::command::Command::ChangeReservation) and the DEADLINE
/// state, and a rule of apply: a node list shorter than the gang is completed
/// with other nodes. Formats 6 to 8 are frozen in `compat::v8`.
pub const SLURM_FEATURES_FORMAT: u32 = 9;

/// Format 10 added suspension to the job (when it was suspended, how long
/// it was before) and the job changes [`crate::command::JobChange::Suspend`]
/// and `Resume`, the srun steps to the job with [`Command::StepStarted`](crate::command::Command::StepStarted)
/// and [`Command::StepEnded`](crate::command::Command::StepEnded), and `scancel --signal` (the job change
/// `Signal`, the job's last request). Format 9's job and state are frozen in
/// `compat::v9`.
pub const SUSPEND_FORMAT: u32 = 10;

/// Format 11 added heterogeneous jobs: the components after the first to
/// the job spec (`JobSpec::components`), placed together all or nothing;
/// and license limits per account and QOS to the policy
/// (`ClusterPolicy::account_licenses`, `qos_licenses`). Formats 9 and 10's
/// job spec, job, policy, entry and state are frozen in `compat::v10`.
pub const HET_JOBS_FORMAT: u32 = 11;

/// Format 11's rule of apply: fair share is not charged for the time a job
/// was suspended (before, an attempt was charged from its start to its end).
pub const UNCHARGED_SUSPENSION_FORMAT: u32 = HET_JOBS_FORMAT;

/// Format 12 added the QOS preempt mode SUSPEND
/// ([`crate::policy::PreemptMode::Suspend`], a variant appended to the
/// policy's and the plan's preemption mode) and the job's
/// `Job::preempted_by`: a victim suspended for a preemptor, holding its
/// memory but not its CPUs or GPUs until `apply` resumes it. Format 11's
/// job and state are frozen in `compat::v11`.
pub const PREEMPT_SUSPEND_FORMAT: u32 = 12;

/// Format 12 also added elastic node pools: `ClusterPolicy::pools`, the
/// node states `PoweredDown` and `PoweringUp`, and the node changes
/// `PowerDown` and `PowerUp`. Format 11's policy and entry are frozen in
/// `compat::v11` too.
pub const ELASTIC_POOLS_FORMAT: u32 = 12;

/// Format 13 added accounting: what each node's task used
/// (`Command::TaskExited::usage`, kept in `Job::task_usage`), the number of
/// finished jobs the state keeps (`ClusterPolicy::finished_jobs_kept`),
/// [`Command::RestoreUsage`](crate::command::Command::RestoreUsage), which rebuilds fair share's usage from the
/// accounting store, and [`Command::AccountingStored`](crate::command::Command::AccountingStored) with
/// `State::accounted_index` and `Job::finished_index`: finished jobs the
/// store does not have yet stay in the state. Format 12's job, policy, entry and state are frozen in
/// `compat::v12`.
pub const ACCOUNTING_FORMAT: u32 = 13;

/// Format 14 changed no encoding, only a rule of `apply`: idempotency keys
/// are capped per identity ([`crate::limits::IDEMPOTENCY_KEYS_PER_IDENTITY_MAX`])
/// and in all ([`crate::limits::IDEMPOTENCY_KEYS_MAX`]), the oldest forgotten
/// first. A build that keeps every key for a day must not apply a log whose
/// submits found a forgotten key new. Format 14 decodes as format 13.
pub const IDEMPOTENCY_CAPS_FORMAT: u32 = 14;

/// Format 15 names the cluster's history (`State::history`): 0 for the
/// history a cluster started with, a new number at every restore from a
/// backup (and the index it began after, `State::history_since`), so that
/// a log index (an event's, the accounting store's cursor, an agent's
/// fences) names a place only together with its history. It is written
/// after the state in a snapshot, not as a field of the state's encoding,
/// so no command and no older format changed: format 15's entries decode
/// as 13's, and a format-14 snapshot holds history 0.
pub const HISTORY_FORMAT: u32 = 15;

/// Format 15 also changed a rule of `apply`: once an accounting service has
/// said where it is, a finished job it has not stored is never dropped,
/// even past the hard limits (`limits::FINISHED_JOBS_RETAINED_MAX`,
/// `limits::FINISHED_BYTES_RETAINED_MAX`); while such jobs fill them, new
/// jobs are refused instead (`State::accounting_backlog_full`). Before, past
/// the hard limits they were dropped whether stored or not.
pub const ACCOUNTING_BACKLOG_FORMAT: u32 = HISTORY_FORMAT;

/// Format 16: a restored cluster's first leader draws its history at random
/// ([`Command::DrawHistory`](crate::command::Command::DrawHistory); `State::history_pending` until then, written
/// after `history_since` in a snapshot). Before, the history was only derived
/// from the backup, so two restores from one file shared it, and a service
/// or agent that had followed the first past the second's index skipped or
/// stalled on the second's entries.
pub const FRESH_HISTORY_FORMAT: u32 = 16;

/// Format 17: the node inventory (`State::node_inventory`, set by the
/// appended [`Command::SetNodeInventory`](crate::command::Command::SetNodeInventory), written after `history_pending`
/// in a snapshot) decides which nodes register and what they may claim, and
/// two rules of `apply` changed: a registration the inventory does not admit
/// is refused, and a coordinator's policy edit touches only users already in
/// their accounts (`policy::coordinator_change`). Format 17's entries
/// decode as 13's.
pub const NODE_ADMISSION_FORMAT: u32 = 17;

/// Format 18: why an attempt was stopped is a typed fact
/// ([`crate::model::StopCause`], `Job::stop_cause`), set by `apply` and
/// written after the node inventory in a snapshot; a preempted job's reason
/// no longer holds the preemptor's id as text (the edge writes it from the
/// cause). Format 18's entries decode as 13's.
pub const STOP_CAUSE_FORMAT: u32 = 18;

/// Whether this build reads `format`.
pub fn readable(format: u32) -> bool {
    (FORMAT_OLDEST..=FORMAT_NEWEST).contains(&format)
}

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("data format {0} is not one this build reads ({FORMAT_OLDEST}..={FORMAT_NEWEST}): run a newer build")]
    Unreadable(u32),
    #[error("{0}")]
    Decode(String),
}

/// A byte field that bincode writes exactly as serde writes a `Vec<u8>` (its
/// length, then the bytes) but in one copy: serde's default for `Vec<u8>` is a
/// sequence, one call per byte each way, which made a 1 MiB log entry cost
/// milliseconds of CPU every time it was encoded or decoded (appended,
/// replicated, applied) and a snapshot seconds. Same bytes on disk and on the
/// wire, so no format changes (`raw_bytes_are_written_as_a_vec_of_bytes`).
/// Use with `#[serde(with = "gangway_core::format::raw_bytes")]`.
pub mod raw_bytes {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(bytes)
    }

    /// Asks for borrowed bytes: bincode's slice decoder then checks the
    /// length against what the input holds before anything is allocated (its
    /// owned `Vec<u8>` path allocates the claimed length first, up to the
    /// decode limit), and the visitor copies exactly what is there.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        deserializer.deserialize_bytes(Visitor)
    }

    struct Visitor;

    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("bytes")
        }

        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        /// Formats that have no bytes type (JSON) hand over a sequence.
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            // The hint is the sender's claim: never allocate more than a page on it.
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
            while let Some(b) = seq.next_element::<u8>()? {
                out.push(b);
            }
            Ok(out)
        }
    }
}

/// Encodes a value with the standard bincode configuration.
#[expect(
    clippy::expect_used,
    reason = "writing into a Vec cannot fail, and bincode refuses only values serde cannot give lengths for: none of \
              the replicated types (golden_encodings_pin encodes every variant of each); the core never encodes a \
              Payload (whose Serialize refuses a format it cannot hold) with it"
)]
pub fn to_bytes<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    bincode::serde::encode_to_vec(value, bincode::config::standard()).expect("encoding into memory cannot fail")
}

/// How much more memory a decoded value may claim than its encoding is long:
/// in-memory strings, vectors and maps are larger than their bytes, but not by
/// more than this. A length prefix claiming more (damage, or a hostile peer)
/// is an error instead of an allocation of whatever it says.
pub const DECODE_EXPANSION_MAX: usize = 16;

/// Decodes a value from the start of `bytes`, returning it and the bytes
/// used; allocations are bounded by [`DECODE_EXPANSION_MAX`] × the input.
pub fn from_bytes_prefix<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<(T, usize), FormatError> {
    macro_rules! within {
        ($($limit:expr),*) => {{
            let wanted = bytes.len().saturating_mul(DECODE_EXPANSION_MAX);
            $(if wanted <= $limit {
                let config = bincode::config::standard().with_limit::<{ $limit }>();
                return bincode::serde::decode_from_slice(bytes, config).map_err(|e| FormatError::Decode(e.to_string()));
            })*
            let config = bincode::config::standard().with_limit::<{ 1 << 40 }>();
            bincode::serde::decode_from_slice(bytes, config).map_err(|e| FormatError::Decode(e.to_string()))
        }};
    }
    within!(1 << 16, 1 << 20, 1 << 24, 1 << 28, 1 << 32, 1 << 36)
}

/// Decodes a whole buffer (trailing bytes are an error), allocations bounded
/// as [`from_bytes_prefix`] bounds them.
pub fn from_bytes<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, FormatError> {
    let (value, used) = from_bytes_prefix(bytes)?;
    if used != bytes.len() {
        return Err(FormatError::Decode(format!("{} trailing bytes", bytes.len().saturating_sub(used))));
    }
    Ok(value)
}

/// CRC-32C (Castagnoli) of `bytes`: snapshots carry it, so a damaged one is
/// refused rather than applied.
pub fn crc32c(bytes: &[u8]) -> u32 {
    #[allow(
        clippy::arithmetic_side_effects,
        clippy::cast_possible_truncation,
        clippy::indexing_slicing,
        reason = "evaluated at compile time: an overflow or an index out of range fails the build, never a replica"
    )]
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 == 1 { (c >> 1) ^ 0x82F6_3B78 } else { c >> 1 };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    #[expect(clippy::indexing_slicing, reason = "an index masked with 0xff is below the table's 256 entries")]
    let crc = bytes.iter().fold(!0u32, |crc, &b| TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8));
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::Command;
    use crate::compat::v4;
    use crate::payload::Payload;
    use serde::Deserialize;

    /// `raw_bytes` changes how fast bytes are written, never which bytes:
    /// stores, snapshots and peers written before it read the same.
    #[test]
    fn raw_bytes_are_written_as_a_vec_of_bytes() {
        #[derive(Serialize, Deserialize, Debug)]
        struct Raw(#[serde(with = "super::raw_bytes")] Vec<u8>);
        #[derive(Serialize, Deserialize, Debug)]
        struct Seq(Vec<u8>);
        for len in [0usize, 1, 250, 251, 252, 65_535, 65_536, 1 << 20] {
            let bytes: Vec<u8> = (0..len).map(|i| (i.wrapping_mul(31) ^ len) as u8).collect();
            let raw = to_bytes(&Raw(bytes.clone()));
            assert_eq!(raw, to_bytes(&Seq(bytes.clone())), "{len} bytes");
            assert_eq!(from_bytes::<Raw>(&raw).unwrap().0, bytes);
            assert_eq!(from_bytes::<Seq>(&raw).unwrap().0, bytes);
        }
        // A length past the input is an error (checked against the input
        // before any allocation: `deserialize` asks for borrowed bytes).
        assert!(from_bytes::<Raw>(&[253, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 1]).is_err());
        assert!(from_bytes::<Raw>(&[251, 0xff, 0xff]).is_err());
    }

    /// What a length prefix may claim is DECODE_EXPANSION_MAX times the
    /// input, rounded up to the next of the decoder's limits: 4 KiB of
    /// input may claim 64 KiB, less the eight bytes the length itself
    /// counts as (a string's claim is checked before its bytes are read);
    /// one byte more is refused before any allocation. A byte more of input
    /// moves to the next limit, 1 MiB.
    #[test]
    fn a_length_may_claim_the_decode_expansion_and_no_more() {
        let input = 4096;
        let limit = input * DECODE_EXPANSION_MAX;
        assert_eq!(limit, 1 << 16);
        let claim = |len: usize, input: usize| {
            let mut bytes = to_bytes(&(len as u64));
            bytes.resize(input, 0);
            from_bytes::<String>(&bytes).unwrap_err().to_string()
        };
        let at = claim(limit - 8, input);
        assert!(at.contains("UnexpectedEnd"), "a claim at the limit is refused for another reason: {at}");
        let past = claim(limit - 7, input);
        assert!(past.contains("LimitExceeded"), "a claim one byte past the limit is taken: {past}");
        let more = claim(limit - 7, input + 1);
        assert!(more.contains("UnexpectedEnd"), "a byte more input is not given the next limit: {more}");
        assert!(claim((1 << 20) - 7, input + 1).contains("LimitExceeded"));
    }

    /// A crafted entry of deeply nested batches is a decode error, not a
    /// stack overflow (found by the fuzz target `entry_apply`).
    #[test]
    fn deeply_nested_batches_do_not_decode() {
        let mut cmd = Command::CancelJob { job_id: 1, identity: "a".into(), now_ms: 1 };
        for _ in 0..crate::command::BATCH_DECODE_DEPTH_MAX {
            cmd = Command::Batch(vec![cmd]);
        }
        let ok = to_bytes(&cmd);
        assert_eq!(from_bytes::<Command>(&ok).unwrap(), cmd);
        let deeper = to_bytes(&Command::Batch(vec![cmd]));
        assert!(from_bytes::<Command>(&deeper).unwrap_err().to_string().contains("nest"));
        // Bytes for a million levels: refused quickly, no stack overflow.
        let mut bomb = [6u8, 1].repeat(1_000_000);
        bomb.extend_from_slice(&to_bytes(&Command::CancelJob { job_id: 1, identity: "a".into(), now_ms: 1 }));
        assert!(from_bytes::<Command>(&bomb).is_err());
        assert!(from_bytes::<Payload>(&bomb).is_err());
    }

    #[test]
    fn commands_of_a_newer_format_are_writable_only_after_the_move() {
        let roles = crate::policy::ClusterPolicy { private_jobs: true, ..Default::default() };
        let update = Command::UpdatePolicy {
            policy: roles,
            expected_version: None,
            force: false,
            identity: "a".into(),
            now_ms: 1,
        };
        assert!(update.writable_in(5).unwrap_err().contains("needs data format 6"));
        assert_eq!(update.writable_in(6), Ok(6));
        let moved = Command::Batch(vec![Command::SetDataFormat { format: 6, now_ms: 1 }, update.clone()]);
        assert_eq!(moved.writable_in(5), Ok(6));
        let early = Command::Batch(vec![update, Command::SetDataFormat { format: 6, now_ms: 1 }]);
        assert!(early.writable_in(5).is_err());
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn payloads_round_trip_in_every_format_and_newer_ones_are_recognised() {
        let cmd = Command::CancelJob { job_id: 7, identity: "alice".into(), now_ms: 9 };
        for format in FORMAT_OLDEST..=FORMAT_NEWEST {
            let p = Payload::new(cmd.clone(), format);
            let bytes = to_bytes(&p);
            assert_eq!(from_bytes::<Payload>(&bytes).unwrap(), p, "format {format}");
        }
        // Format 4 is the bare command, byte for byte.
        assert_eq!(to_bytes(&Payload::new(cmd.clone(), 4)), to_bytes(&cmd));
        // A command newer than the cluster's format is written in its own.
        let set = Command::SetDataFormat { format: 5, now_ms: 1 };
        assert_eq!(Payload::new(set, 4).format, 5);
        // An envelope from a future format decodes as unreadable, not garbage.
        let future = to_bytes(&v4::Wire::Envelope { format: 99, body: vec![1, 2, 3] });
        let unreadable = from_bytes::<Payload>(&future).unwrap();
        assert_eq!(unreadable, Payload { format: 99, command: None, unread: vec![1, 2, 3] });
        // Stored and sent on byte for byte.
        assert_eq!(to_bytes(&unreadable), future);
    }
}
