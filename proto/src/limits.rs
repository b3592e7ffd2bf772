//! Message sizes, one per service, shared by its servers and its clients so
//! that neither side ever sends what the other refuses.

/// Requests to the client-facing services (jobs, nodes, admin): a submit
/// carries at most a 2 MiB spec (`gangway_core::limits::JOB_SPEC_BYTES_MAX`)
/// plus its metadata; 8 MiB leaves room without inviting abuse.
pub const API_REQUEST_BYTES_MAX: usize = 8 * 1024 * 1024;
/// Responses of the client-facing services: gRPC's default receive limit
/// (4 MiB), so any client — grpcurl, a Python SDK — can read every answer.
/// Lists are paged below it ([`LIST_RESPONSE_BYTES_MAX`]).
pub const API_RESPONSE_BYTES_MAX: usize = 4 * 1024 * 1024;
/// Bytes of jobs one list response carries before it stops and hands back a
/// cursor: three quarters of [`API_RESPONSE_BYTES_MAX`], for the envelope.
pub const LIST_RESPONSE_BYTES_MAX: usize = 3 * 1024 * 1024;
/// Agent ↔ controller messages, both ways: a heartbeat answer carries launch
/// orders, each with a whole job spec (at most 2 MiB).
pub const AGENT_MESSAGE_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Launch orders one heartbeat answer carries, in bytes: half the agent
/// message limit, so the answer always fits; the rest follow on the next beat.
pub const LAUNCH_ORDERS_BYTES_MAX: usize = 8 * 1024 * 1024;

/// An AgentService client with the agent message limit both ways (agents, and
/// replicas forwarding agents' calls to the leader).
pub fn agent_client(
    ch: tonic::transport::Channel,
) -> crate::v1::agent_service_client::AgentServiceClient<tonic::transport::Channel> {
    crate::v1::agent_service_client::AgentServiceClient::new(ch)
        .max_decoding_message_size(AGENT_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(AGENT_MESSAGE_BYTES_MAX)
}

/// A response's byte budget: items go in while they fit, and the first
/// always does (a single item too big for a page is still answered, within
/// the message limit it was bounded by when stored).
#[derive(Debug)]
pub struct PageBudget {
    max: usize,
    used: usize,
    taken: usize,
}

impl PageBudget {
    /// A list response's: [`LIST_RESPONSE_BYTES_MAX`].
    pub fn list() -> PageBudget {
        PageBudget { max: LIST_RESPONSE_BYTES_MAX, used: 0, taken: 0 }
    }

    /// A heartbeat answer's launch orders: [`LAUNCH_ORDERS_BYTES_MAX`].
    pub fn launch_orders() -> PageBudget {
        PageBudget { max: LAUNCH_ORDERS_BYTES_MAX, used: 0, taken: 0 }
    }

    /// Whether an item of `len` bytes fits; if so it is counted.
    pub fn take(&mut self, len: usize) -> bool {
        if self.taken > 0 && self.used.saturating_add(len) > self.max {
            return false;
        }
        self.used = self.used.saturating_add(len);
        self.taken = self.taken.saturating_add(1);
        true
    }

    /// Bytes taken so far.
    pub fn used(&self) -> usize {
        self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page holds items up to its limit exactly; one byte more waits for
    /// the next page; a first item bigger than the limit is still answered.
    #[test]
    fn pages_are_filled_to_their_limit_and_no_further() {
        for (mut budget, max) in
            [(PageBudget::list(), LIST_RESPONSE_BYTES_MAX), (PageBudget::launch_orders(), LAUNCH_ORDERS_BYTES_MAX)]
        {
            assert!(budget.take(max - 10));
            assert!(!budget.take(11), "one byte past {max}");
            assert!(budget.take(10));
            assert_eq!(budget.used(), max);
            assert!(!budget.take(1));
        }
        let mut budget = PageBudget::list();
        assert!(budget.take(LIST_RESPONSE_BYTES_MAX + 1), "a lone big item is answered");
        assert!(!budget.take(1), "nothing follows it");
    }
}
