//! Following the cluster's event stream across failures: reconnect to any
//! replica and resume after the last event delivered, so each event reaches
//! the caller once, in order, even when the replica it streamed from dies.

use std::time::Duration;

use tonic::{Code, Status};

use crate::client::Client;
use crate::v1::job_service_client::JobServiceClient;
use crate::v1::{ClusterEvent, EventsRequest};

/// Consecutive reconnects that fail before giving up: with the client's own
/// failover inside each one, about a minute without any replica answering.
pub const RECONNECTS_MAX: u32 = 60;
/// Pause between reconnects.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// Where a follower is: the index to ask for, and how many events at that
/// index were already delivered (all events of one index come together, in
/// the same order on every replica).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cursor {
    pub index: u64,
    pub delivered: usize,
    /// The cluster history `index` counts in (`stream_start`'s), once known:
    /// after a restore from a backup the same index names other events, and
    /// a replica of another history refuses the cursor (OUT_OF_RANGE).
    pub history: Option<u64>,
}

/// Follows events from `from` (0: from now), calling `on_event` once per
/// event until it returns false. Errors: events that old are gone
/// (OUT_OF_RANGE), or no replica answered RECONNECTS_MAX times in a row.
pub async fn follow(client: &Client, from: u64, mut on_event: impl FnMut(&ClusterEvent) -> bool) -> Result<(), Status> {
    let start = (from > 0).then_some(Cursor { index: from, delivered: 0, history: None });
    follow_from(client, start, move |ev, _| std::future::ready(on_event(&ev))).await
}

/// [`follow`] from a cursor a follower saved (`None`: from now), with an
/// asynchronous `on_event` that also gets the cursor just past its event:
/// saved with what the event did, it resumes exactly after it.
pub async fn follow_from<F, Fut>(client: &Client, start: Option<Cursor>, mut on_event: F) -> Result<(), Status>
where
    F: FnMut(ClusterEvent, Cursor) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut cursor = start;
    let mut failures = 0u32;
    loop {
        let req = EventsRequest {
            from_index: cursor.map_or(0, |c| c.index),
            job_id: 0,
            history: cursor.and_then(|c| c.history),
        };
        let opened = client
            .call(|ch| {
                let r = client.stream_request(req);
                async move { JobServiceClient::new(ch).events(r).await }
            })
            .await;
        // This replica forgot those events (a snapshot replaced its state):
        // another may still have them.
        let opened = match opened {
            Err(s) if s.code() == Code::OutOfRange => elsewhere(client, req).await.ok_or(s),
            other => other,
        };
        let last_error = match opened {
            // Refusals every replica would repeat.
            Err(s)
                if matches!(
                    s.code(),
                    Code::OutOfRange | Code::InvalidArgument | Code::Unauthenticated | Code::PermissionDenied
                ) =>
            {
                return Err(s)
            }
            Err(s) => s,
            Ok(resp) => {
                let mut stream = resp.into_inner();
                let mut at_index = 0usize;
                loop {
                    match stream.message().await {
                        Ok(Some(ev)) if ev.kind == "stream_start" => {
                            failures = 0;
                            let c = cursor.get_or_insert(Cursor {
                                index: ev.index.saturating_add(1),
                                delivered: 0,
                                history: Some(ev.history),
                            });
                            // (A replica that predates histories does not check.)
                            match c.history {
                                Some(h) if h != ev.history => return Err(other_history(h, ev.history)),
                                _ => c.history = Some(ev.history),
                            }
                        }
                        Ok(Some(ev)) => {
                            failures = 0;
                            let c = cursor.get_or_insert(Cursor { index: ev.index, delivered: 0, history: None });
                            if ev.index < c.index {
                                continue;
                            }
                            if ev.index > c.index {
                                *c = Cursor { index: ev.index, delivered: 0, history: c.history };
                                at_index = 0;
                            }
                            at_index = at_index.saturating_add(1);
                            if at_index <= c.delivered {
                                continue; // delivered before the reconnect
                            }
                            c.delivered = at_index;
                            let after = *c;
                            if !on_event(ev, after).await {
                                return Ok(());
                            }
                        }
                        Ok(None) => break Status::unavailable("the event stream ended"),
                        Err(s) => break s,
                    }
                }
            }
        };
        failures = failures.saturating_add(1);
        if gives_up(failures) {
            return Err(Status::unavailable(format!(
                "events: no replica answered {RECONNECTS_MAX} times in a row; last error: {}",
                last_error.message()
            )));
        }
        tokio::time::sleep(RECONNECT_PAUSE).await;
    }
}

/// Whether following stops after `failures` reconnects in a row that no
/// replica answered: [`RECONNECTS_MAX`], a second apart (a minute).
fn gives_up(failures: u32) -> bool {
    failures >= RECONNECTS_MAX
}

/// A cursor of one cluster history met a replica of another (the cluster
/// was restored from a backup since): what a replica that checks answers.
fn other_history(ours: u64, theirs: u64) -> Status {
    Status::out_of_range(format!(
        "history: the cursor counts in cluster history {ours}, and the cluster's history is {theirs} (it was \
         restored from a backup since): read the current state and follow from now"
    ))
}

/// The stream opened on whichever replica still keeps events from `req`'s index.
async fn elsewhere(
    client: &Client,
    req: EventsRequest,
) -> Option<tonic::Response<tonic::codec::Streaming<ClusterEvent>>> {
    for ch in client.channels() {
        if let Ok(resp) = JobServiceClient::new(ch.clone()).events(client.stream_request(req)).await {
            return Some(resp);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Following gives up after RECONNECTS_MAX failed reconnects in a row
    /// (a minute of no replica answering), not one sooner.
    #[test]
    fn following_gives_up_after_reconnects_max_failures_in_a_row() {
        assert!(!gives_up(RECONNECTS_MAX - 1));
        assert!(gives_up(RECONNECTS_MAX));
        assert_eq!(RECONNECT_PAUSE * RECONNECTS_MAX, Duration::from_secs(60));
    }
}
