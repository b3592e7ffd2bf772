//! The idempotency caps of format 14, each at its value and one past it.

use super::{Outcome, State, IDEMPOTENCY_PURGE_PER_APPLY_MAX};
use crate::command::Command;
use crate::format::{ACCOUNTING_FORMAT, IDEMPOTENCY_CAPS_FORMAT};
use crate::limits::{IDEMPOTENCY_KEYS_MAX, IDEMPOTENCY_KEYS_PER_IDENTITY_MAX};
use crate::spec::JobSpec;

fn state(format: u32) -> State {
    State { format, clock_ms: 1_000, ..State::default() }
}

/// Remembers `n` keys of `identity` (`{identity}-0`, …), each a millisecond
/// after the last, as submits would, without the jobs.
fn fill(s: &mut State, identity: &str, n: usize) {
    for i in 0..n {
        s.clock_ms += 1;
        s.remember_idempotency_key(identity, &format!("{identity}-{i}"), 1);
    }
}

/// A real submit through `apply`, with `key`.
fn submit(s: &mut State, index: u64, identity: &str, key: &str) -> (u64, bool) {
    let spec = JobSpec {
        command: vec!["true".into()],
        workdir: "/tmp".into(),
        user: identity.into(),
        hold: true,
        ..JobSpec::default()
    };
    let now_ms = s.clock_ms + 1;
    let cmd = Command::SubmitJob { spec, identity: identity.into(), idempotency_key: key.into(), now_ms };
    match s.apply(index, &cmd).outcome {
        Outcome::Submitted { job_id, duplicate } => (job_id, duplicate),
        other => panic!("the submit was not taken: {other:?}"),
    }
}

fn remembers(s: &State, identity: &str, key: &str) -> bool {
    s.idempotency.contains_key(&(identity.to_string(), key.to_string()))
}

#[test]
fn an_identity_at_its_key_cap_forgets_its_own_oldest_key_for_a_new_one() {
    let mut s = state(IDEMPOTENCY_CAPS_FORMAT);
    fill(&mut s, "bob", 1);
    fill(&mut s, "alice", IDEMPOTENCY_KEYS_PER_IDENTITY_MAX - 1);
    // At the cap less one, a new key is simply remembered.
    let (first, duplicate) = submit(&mut s, 10, "alice", "new-1");
    assert!(!duplicate);
    assert_eq!(s.idempotency_by_identity["alice"].len(), IDEMPOTENCY_KEYS_PER_IDENTITY_MAX);
    assert!(remembers(&s, "alice", "alice-0"));
    // One past: alice's oldest goes, bob's older one stays.
    let (second, duplicate) = submit(&mut s, 11, "alice", "new-2");
    assert!(!duplicate && second > first);
    assert_eq!(s.idempotency_by_identity["alice"].len(), IDEMPOTENCY_KEYS_PER_IDENTITY_MAX);
    assert!(!remembers(&s, "alice", "alice-0"), "alice's oldest key is forgotten");
    assert!(remembers(&s, "alice", "alice-1") && remembers(&s, "alice", "new-1") && remembers(&s, "alice", "new-2"));
    assert!(remembers(&s, "bob", "bob-0"), "another identity's keys are not alice's to spend");
    // A remembered key still deduplicates; the forgotten one submits anew.
    assert_eq!(submit(&mut s, 12, "alice", "new-1"), (first, true));
    assert!(!submit(&mut s, 13, "alice", "alice-0").1);
    s.check_invariants().expect("the indexes agree");
}

#[test]
fn all_keys_at_the_total_cap_forget_the_oldest_of_anyone_for_a_new_one() {
    let mut s = state(IDEMPOTENCY_CAPS_FORMAT);
    let identities = IDEMPOTENCY_KEYS_MAX / IDEMPOTENCY_KEYS_PER_IDENTITY_MAX;
    for i in 0..identities {
        // One short in all: the total starts one under its cap.
        let n = if i == 0 { IDEMPOTENCY_KEYS_PER_IDENTITY_MAX - 1 } else { IDEMPOTENCY_KEYS_PER_IDENTITY_MAX };
        fill(&mut s, &format!("user{i}"), n);
    }
    assert_eq!(s.idempotency.len(), IDEMPOTENCY_KEYS_MAX - 1);
    submit(&mut s, 10, "carol", "c-1");
    assert_eq!(s.idempotency.len(), IDEMPOTENCY_KEYS_MAX, "under the cap nothing is forgotten");
    assert!(remembers(&s, "user0", "user0-0"));
    // One past: the oldest of all (user0's first) goes.
    submit(&mut s, 11, "carol", "c-2");
    assert_eq!(s.idempotency.len(), IDEMPOTENCY_KEYS_MAX);
    assert_eq!(s.idempotency_expiry.len(), IDEMPOTENCY_KEYS_MAX);
    assert!(!remembers(&s, "user0", "user0-0"), "the oldest key of all is forgotten");
    assert!(remembers(&s, "user0", "user0-1") && remembers(&s, "carol", "c-1") && remembers(&s, "carol", "c-2"));
    s.check_invariants().expect("the indexes agree");
}

#[test]
fn before_format_14_keys_are_not_capped_and_past_it_an_excess_drains() {
    let mut s = state(ACCOUNTING_FORMAT);
    fill(&mut s, "alice", IDEMPOTENCY_KEYS_PER_IDENTITY_MAX);
    submit(&mut s, 10, "alice", "new-1");
    assert_eq!(s.idempotency.len(), IDEMPOTENCY_KEYS_PER_IDENTITY_MAX + 1, "format 13 keeps every key for a day");
    assert!(remembers(&s, "alice", "alice-0"));
    s.check_invariants().expect("the indexes agree");

    // Past the total cap under format 13, then the cluster moves to 14: the
    // excess goes oldest first, a bounded number per apply.
    let excess = IDEMPOTENCY_PURGE_PER_APPLY_MAX + 10;
    let more = IDEMPOTENCY_KEYS_MAX + excess - s.idempotency.len();
    for i in 0..more.div_ceil(IDEMPOTENCY_KEYS_PER_IDENTITY_MAX) {
        let n = (more - i * IDEMPOTENCY_KEYS_PER_IDENTITY_MAX).min(IDEMPOTENCY_KEYS_PER_IDENTITY_MAX);
        fill(&mut s, &format!("user{i}"), n);
    }
    assert_eq!(s.idempotency.len(), IDEMPOTENCY_KEYS_MAX + excess);
    let now_ms = s.clock_ms;
    s.apply(20, &Command::SetDataFormat { format: IDEMPOTENCY_CAPS_FORMAT, now_ms });
    assert_eq!(s.format, IDEMPOTENCY_CAPS_FORMAT);
    s.apply(21, &Command::SetDataFormat { format: IDEMPOTENCY_CAPS_FORMAT, now_ms });
    assert_eq!(
        s.idempotency.len(),
        IDEMPOTENCY_KEYS_MAX + excess - IDEMPOTENCY_PURGE_PER_APPLY_MAX,
        "bounded per apply"
    );
    s.apply(22, &Command::SetDataFormat { format: IDEMPOTENCY_CAPS_FORMAT, now_ms });
    assert_eq!(s.idempotency.len(), IDEMPOTENCY_KEYS_MAX, "down to the cap, and no further");
    assert!(!remembers(&s, "alice", "alice-0"), "the oldest went first");
    s.check_invariants().expect("the indexes agree");
}

#[test]
fn a_decoded_snapshot_rebuilds_the_keys_per_identity() {
    let mut s = state(IDEMPOTENCY_CAPS_FORMAT);
    fill(&mut s, "alice", 3);
    fill(&mut s, "bob", 2);
    let decoded = crate::snapshot::decode(&crate::snapshot::encode(&s)).expect("decodes");
    assert_eq!(decoded.idempotency_by_identity, s.idempotency_by_identity);
    assert_eq!(decoded, s);
}
