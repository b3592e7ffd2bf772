//! The audit trail of one replica: every call it refused (unauthenticated or
//! denied) and every admin action it allowed, with who, what, the target and
//! the outcome. Each replica keeps its own (a denial happens where the call
//! arrives), in memory, bounded; `AdminService.Audit` streams it to admins and
//! `gangway events --audit` merges every replica's. Every entry also goes to
//! the log (target `gangway::audit`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tokio::sync::broadcast;

/// Entries a replica keeps: a few hours of a busy cluster's refusals. Older
/// ones are in the log.
pub const AUDIT_EVENTS_MAX: usize = 10_000;
/// Entries a slow audit stream may fall behind before it is ended.
pub const AUDIT_STREAM_BUFFER: usize = 1_024;
/// Longest caller, action, target or reason kept (they come from requests).
const FIELD_BYTES_MAX: usize = 512;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEvent {
    /// Numbered from 1 on this replica, in order.
    pub seq: u64,
    pub time_ms: u64,
    pub caller: String,
    pub action: String,
    pub target: String,
    /// "denied", "unauthenticated" or "allowed".
    pub outcome: &'static str,
    pub reason: String,
}

/// At most [`FIELD_BYTES_MAX`] bytes, with control characters (newlines,
/// terminal escapes: the text may come from a request) written as escapes.
fn bounded(s: &str) -> String {
    let mut end = s.len().min(FIELD_BYTES_MAX);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let mut out: String = s[..end]
        .chars()
        .flat_map(|c| {
            let e: Vec<char> = if c.is_control() { c.escape_default().collect() } else { vec![c] };
            e
        })
        .collect();
    if end < s.len() {
        out.push('…');
    }
    out
}

pub struct AuditLog {
    ring: Mutex<VecDeque<AuditEvent>>,
    seq: AtomicU64,
    tx: broadcast::Sender<AuditEvent>,
    /// Per address: the current minute's start and its anonymous entries.
    /// Refusals recorded per source (a network prefix for callers with no
    /// credentials, a principal for the gate's refusals of known callers)
    /// in the current minute, and when it began.
    anonymous: Mutex<std::collections::BTreeMap<String, (std::time::Instant, u32)>>,
}

/// Anonymous refusals recorded per address and minute; the rest are counted
/// and reported with the next one recorded, so a flood from one peer cannot
/// push everything else out of the trail.
pub const ANONYMOUS_PER_MINUTE_MAX: u32 = 20;
/// Addresses tracked for that; past it the counts start over.
const ANONYMOUS_PEERS_MAX: usize = 4_096;

impl Default for AuditLog {
    fn default() -> Self {
        AuditLog {
            ring: Mutex::new(VecDeque::new()),
            seq: AtomicU64::new(0),
            tx: broadcast::Sender::new(AUDIT_STREAM_BUFFER),
            anonymous: Mutex::new(Default::default()),
        }
    }
}

impl std::fmt::Debug for AuditLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditLog").field("seq", &self.seq.load(Ordering::Relaxed)).finish()
    }
}

impl AuditLog {
    /// Records one entry (and logs it).
    pub fn record(&self, caller: &str, action: &str, target: &str, outcome: &'static str, reason: &str) {
        if outcome == "allowed" {
            tracing::info!(target: "gangway::audit", caller, action, target, outcome, reason);
        } else {
            tracing::warn!(target: "gangway::audit", caller, action, target, outcome, reason);
        }
        let mut ring = self.ring.lock().expect("audit lock");
        let e = AuditEvent {
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
            time_ms: crate::now_ms(),
            caller: bounded(caller),
            action: bounded(action),
            target: bounded(target),
            outcome,
            reason: bounded(reason),
        };
        if ring.len() >= AUDIT_EVENTS_MAX {
            ring.pop_front();
        }
        ring.push_back(e.clone());
        // Sent under the lock, so a subscriber that read the ring first sees
        // every later entry exactly once.
        let _ = self.tx.send(e);
    }

    /// Records a refusal of a caller with no credentials from `ip`, at most
    /// [`ANONYMOUS_PER_MINUTE_MAX`] a minute per address.
    pub fn record_anonymous(&self, ip: Option<std::net::IpAddr>, action: &str, outcome: &'static str, reason: &str) {
        let caller = ip.map_or_else(|| "anonymous".to_string(), |ip| format!("anonymous@{ip}"));
        let Some(ip) = ip else {
            return self.record(&caller, action, "", outcome, reason);
        };
        let source = format!("net:{}", gangway_proto::tls::prefix_of(ip));
        self.record_throttled(source, &caller, action, "", outcome, reason);
    }

    /// Records a refusal of a known caller by the gate (a call its role
    /// never may make), at most [`ANONYMOUS_PER_MINUTE_MAX`] a minute per
    /// caller: a loop of them cannot push the admin actions out of the ring.
    pub fn record_refused(&self, caller: &str, action: &str, outcome: &'static str, reason: &str) {
        self.record_denied(caller, caller, action, "", outcome, reason);
    }

    /// Records a refusal of an authenticated caller (or an action allowed to
    /// one short of an admin: an operator's, a coordinator's) (`identity`,
    /// shown as `caller`: with the job whose credential it used), at most
    /// [`ANONYMOUS_PER_MINUTE_MAX`] a minute per identity and action,
    /// whichever of its jobs' credentials it uses: a loop of denied calls
    /// cannot push the admin actions and everyone else's refusals out of the
    /// ring, and each kind of refusal a caller met is still in it. (The log
    /// gets every one.)
    pub fn record_denied(
        &self,
        identity: &str,
        caller: &str,
        action: &str,
        target: &str,
        outcome: &'static str,
        reason: &str,
    ) {
        self.record_throttled(format!("who:{identity} {action}"), caller, action, target, outcome, reason);
    }

    fn record_throttled(
        &self,
        source: String,
        caller: &str,
        action: &str,
        target: &str,
        outcome: &'static str,
        reason: &str,
    ) {
        let ip = &source;
        let suppressed = {
            let mut m = self.anonymous.lock().expect("audit lock");
            if m.len() >= ANONYMOUS_PEERS_MAX && !m.contains_key(&source) {
                // The source whose minute began longest ago goes.
                if let Some(oldest) = m.iter().min_by_key(|(_, (start, _))| *start).map(|(k, _)| k.clone()) {
                    m.remove(&oldest);
                }
            }
            let now = std::time::Instant::now();
            let (start, n) = m.entry(source.clone()).or_insert((now, 0));
            if now.duration_since(*start) >= std::time::Duration::from_secs(60) {
                let dropped = n.saturating_sub(ANONYMOUS_PER_MINUTE_MAX);
                *start = now;
                *n = 1;
                Some(dropped)
            } else {
                *n = n.saturating_add(1);
                (*n <= ANONYMOUS_PER_MINUTE_MAX).then_some(0)
            }
        };
        match suppressed {
            None => {
                // Kept out of the ring, never out of the log.
                metrics::counter!("gangway_audit_suppressed_total").increment(1);
                tracing::warn!(target: "gangway::audit", caller, action, target, outcome, reason, suppressed = true);
            }
            Some(0) => self.record(caller, action, target, outcome, reason),
            Some(n) => {
                let r = format!("{reason} ({n} more refusals from {ip} in the previous minute were not recorded)");
                self.record(caller, action, target, outcome, &r)
            }
        }
    }

    /// The kept entries after `from_seq`, and a receiver for the ones to come.
    pub fn follow(&self, from_seq: u64) -> (Vec<AuditEvent>, broadcast::Receiver<AuditEvent>) {
        let ring = self.ring.lock().expect("audit lock");
        let rx = self.tx.subscribe();
        (ring.iter().filter(|e| e.seq > from_seq).cloned().collect(), rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trail_is_bounded_ordered_and_followable() {
        let log = AuditLog::default();
        for i in 0..AUDIT_EVENTS_MAX + 5 {
            log.record("client:bob", "drain nodes", &format!("node-{i}"), "denied", "not an admin");
        }
        let (kept, mut rx) = log.follow(0);
        assert_eq!(kept.len(), AUDIT_EVENTS_MAX);
        assert_eq!(kept.first().unwrap().seq, 6);
        assert!(kept.windows(2).all(|w| w[1].seq == w[0].seq + 1));
        log.record(&"x".repeat(10_000), "a", "t", "unauthenticated", "r");
        let next = rx.try_recv().unwrap();
        assert_eq!(next.seq, AUDIT_EVENTS_MAX as u64 + 6);
        assert!(next.caller.len() <= FIELD_BYTES_MAX + "…".len());
        assert_eq!(log.follow(next.seq - 1).0.len(), 1);
    }
}

#[cfg(test)]
mod flood_tests {
    use super::*;

    /// The throttle remembers at most ANONYMOUS_PEERS_MAX sources: at the
    /// limit every one is kept; one more makes the one whose minute began
    /// first make way.
    #[test]
    fn the_throttle_remembers_at_most_its_limit_of_sources() {
        let log = AuditLog::default();
        log.record_refused("client:c0", "raft", "denied", "x");
        std::thread::sleep(std::time::Duration::from_millis(2));
        for i in 1..ANONYMOUS_PEERS_MAX {
            log.record_refused(&format!("client:c{i}"), "raft", "denied", "x");
        }
        let sources = || log.anonymous.lock().unwrap().keys().cloned().collect::<std::collections::BTreeSet<_>>();
        let at = sources();
        assert_eq!(at.len(), ANONYMOUS_PEERS_MAX);
        assert!(at.contains("who:client:c0 raft"));
        log.record_refused("client:one-more", "raft", "denied", "x");
        let past = sources();
        assert_eq!(past.len(), ANONYMOUS_PEERS_MAX);
        assert!(
            !past.contains("who:client:c0 raft") && past.contains("who:client:one-more raft"),
            "the oldest made way"
        );
    }

    #[test]
    fn one_peer_cannot_flood_the_trail_and_text_cannot_forge_lines() {
        let log = AuditLog::default();
        let ip: std::net::IpAddr = "10.0.0.9".parse().unwrap();
        for _ in 0..1_000 {
            log.record_anonymous(Some(ip), "Submit", "unauthenticated", "no certificate");
        }
        // Another address of the same /24 shares the throttle; another
        // network does not.
        log.record_anonymous(Some("10.0.0.10".parse().unwrap()), "Submit", "unauthenticated", "x");
        log.record_anonymous(Some("10.0.1.10".parse().unwrap()), "Submit", "unauthenticated", "x");
        // A known caller's refusals by the gate are throttled per caller.
        for _ in 0..100 {
            log.record_refused("client:mallory", "raft", "denied", "not a server");
        }
        let (kept, _) = log.follow(0);
        assert_eq!(kept.len(), 2 * ANONYMOUS_PER_MINUTE_MAX as usize + 1);
        // So are an authenticated caller's denials, per action, across the
        // credentials of its jobs; another action's are kept apart, and an
        // admin's action is still recorded after them.
        for i in 0..100 {
            let via = format!("client:eve (job {i} attempt 1)");
            log.record_denied("client:eve", &via, "drain nodes", "n1", "denied", "not an admin");
        }
        log.record_denied("client:eve", "client:eve", "cancel a job", "7", "denied", "not hers");
        // A coordinator's allowed edits (checked by the state machine after
        // this entry) are bounded the same way.
        for _ in 0..100 {
            log.record_denied("client:carol", "client:carol", "change the policy", "", "allowed", "coordinator");
        }
        log.record("client:admin", "drain nodes", "n1", "allowed", "");
        let (kept, _) = log.follow(0);
        assert_eq!(kept.len(), 4 * ANONYMOUS_PER_MINUTE_MAX as usize + 3);
        let eves = kept.iter().filter(|e| e.caller.starts_with("client:eve"));
        assert_eq!(eves.clone().filter(|e| e.action == "drain nodes").count(), ANONYMOUS_PER_MINUTE_MAX as usize);
        assert_eq!(eves.filter(|e| e.action == "cancel a job").count(), 1);
        assert!(kept.iter().any(|e| e.caller.starts_with("client:eve") && e.target == "n1"), "the target is kept");
        assert_eq!(kept.last().map(|e| e.caller.as_str()), Some("client:admin"));
        log.record("client:x\n2026 replica 1 allowed", "a\u{1b}]0;pwned\u{7}", "", "denied", "r\r\n");
        let (kept, _) = log.follow(0);
        let last = kept.last().unwrap();
        assert!(!last.caller.contains('\n') && !last.action.contains('\u{1b}') && !last.reason.contains('\r'));
        assert!(last.caller.contains("\\n"));
    }
}
