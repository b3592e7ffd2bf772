//! Fault-injection tests of real multi-host Gangway clusters, in the spirit of
//! Jepsen and etcd's robustness tests: real `gangway` processes, each on its
//! own test host (a network namespace on a bridge the test creates), a client
//! workload recorded as a history, faults from a seeded schedule, and
//! independent checkers over the history, every replica's final state and the
//! agents' execution records.
//!
//! ```text
//! net.rs       test hosts: namespaces, bridge, iptables partitions, cleanup
//! cluster.rs   controllers and agents as real processes on those hosts
//! workload.rs  concurrent submitters (idempotency keys), short real jobs
//! history.rs   what clients invoked and saw (ok / fail / unknown)
//! check.rs     the invariants, each its own function
//! scenario.rs  cluster shapes and their faults; one run, healed and judged
//! bin/gangway-chaos.rs  runs scenarios by name, seeds, results table
//! ```
//!
//! Related code: tests/chaos.rs (every scenario once, the CI smoke set); controller/tests/cluster.rs
//! covers failover and recovery in process on loopback.

pub mod check;
pub mod cluster;
pub mod history;
pub mod net;
pub mod scenario;
pub mod workload;

/// A small, seeded generator for fault schedules (xorshift64*): the same seed
/// gives the same schedule.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}
