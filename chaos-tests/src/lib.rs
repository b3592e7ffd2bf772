//! Fault-injection tests of real multi-replica Gangway clusters.
//!
//! Planned (see the chaos-tests issue): clusters of real `gangway` processes, one
//! network namespace per test host on a bridge the test creates, seeded fault
//! schedules (kills, pauses, iptables partitions, restarts, membership changes)
//! and independent checkers over the recorded history. The in-process failover,
//! restart and catch-up tests in `controller/tests/cluster.rs` cover the same
//! ground on loopback today.
