//! Snapshot encoding of [`State`]: a magic tag, the data format, then the state.
//! The encoding is deterministic (BTreeMaps, fixed field order), so two
//! replicas with the same state produce byte-identical snapshots.
//!
//! A snapshot is written in the cluster's data format (`State::format`), so
//! a replica still on an older build can install one during a rolling upgrade:
//!
//! - format 4: `GWSN` | 4 (u32 LE) | bincode of format 4's state;
//! - format 5: `GWSN` | 5 (u32 LE) | CRC-32C of the body (u32 LE) | bincode of format 5's state;
//! - format 6: the same with 6 and today's state;
//! - formats 7 and 8: the same with 7 or 8 (rules of apply changed, not the state);
//! - format 9: the same with 9 and format 9's state (`compat::v9`);
//! - format 10: the same with 10 and format 10's state (`compat::v10`);
//! - format 11: the same with 11 and format 11's state (`compat::v11`);
//! - format 12: the same with 12 and format 12's state (`compat::v12`);
//! - format 13: the same with 13 and today's state;
//! - format 14: the same with 14 (a rule of apply changed, not the state);
//! - format 15: the same with 15, the state followed by its history
//!   (`State::history`, u64) and the index it began after
//!   (`State::history_since`, u64);
//! - format 16: the same with 16, and then whether the history is still to
//!   be drawn (`State::history_pending`, bool);
//! - format 17: the same with 17, and then the node inventory
//!   (`State::node_inventory`);
//! - format 18: the same with 18, and then the jobs' stop causes
//!   (`Job::stop_cause`, the jobs that have one, by id).

use crate::compat::{v10, v11, v12, v4, v5, v8, v9};
use crate::format::{crc32c, from_bytes, to_bytes, FORMAT_NEWEST, FORMAT_OLDEST};
use crate::model::{JobId, StopCause};
use crate::state::State;

/// The jobs' stop causes as format 18 writes them: `(id, cause)` for each
/// job that has one, in id order, serialized straight from the state.
struct StopCausesRef<'a>(&'a State);

impl serde::Serialize for StopCausesRef<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Collected first: bincode writes a sequence's length before it.
        let causes: Vec<_> = self.0.jobs.iter().filter_map(|(id, j)| j.stop_cause.as_ref().map(|c| (id, c))).collect();
        serde::Serialize::serialize(&causes, s)
    }
}

/// Marks a Gangway snapshot, so a foreign or truncated blob is refused clearly.
pub const SNAPSHOT_MAGIC: &[u8; 4] = b"GWSN";

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("not a Gangway snapshot (bad magic)")]
    BadMagic,
    #[error(
        "snapshot format version {found} is not supported (this build reads versions {FORMAT_OLDEST}..={FORMAT_NEWEST})"
    )]
    UnsupportedVersion { found: u32 },
    #[error("snapshot is damaged: its checksum is {found:08x}, its body sums to {computed:08x}")]
    Checksum { found: u32, computed: u32 },
    #[error("snapshot body does not decode: {0}")]
    Decode(String),
}

pub fn encode(state: &State) -> Vec<u8> {
    let mut out = Vec::with_capacity(state.jobs.len().saturating_mul(256).saturating_add(64));
    out.extend_from_slice(SNAPSHOT_MAGIC);
    let body = match state.format {
        4 => {
            out.extend_from_slice(&4u32.to_le_bytes());
            out.extend_from_slice(&to_bytes(&v4::StateRef::from(state)));
            return out;
        }
        5 => to_bytes(&v5::StateRef::from(state)),
        6..=8 => to_bytes(&v8::StateRef::from(state)),
        9 => to_bytes(&v9::StateRef::from(state)),
        10 => to_bytes(&v10::StateRef::from(state)),
        11 => to_bytes(&v11::StateRef::from(state)),
        12 => to_bytes(&v12::StateRef::from(state)),
        13 | 14 => to_bytes(state),
        15 => to_bytes(&(state, state.history, state.history_since)),
        16 => to_bytes(&(state, state.history, state.history_since, state.history_pending)),
        17 => to_bytes(&(state, state.history, state.history_since, state.history_pending, &state.node_inventory)),
        _ => to_bytes(&(
            state,
            state.history,
            state.history_since,
            state.history_pending,
            &state.node_inventory,
            StopCausesRef(state),
        )),
    };
    out.extend_from_slice(&state.format.min(FORMAT_NEWEST).to_le_bytes());
    out.extend_from_slice(&crc32c(&body).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Format 18's trailer into the decoded state's jobs: in id order, once
/// each, and only for jobs the state holds (anything else is damage).
fn set_stop_causes(state: &mut State, causes: Vec<(JobId, StopCause)>) -> Result<(), SnapshotError> {
    let mut last = None;
    for (id, cause) in causes {
        if last.is_some_and(|l| id <= l) {
            return Err(SnapshotError::Decode(format!("stop causes out of order at job {id}")));
        }
        last = Some(id);
        let Some(job) = state.jobs.get_mut(&id) else {
            return Err(SnapshotError::Decode(format!("a stop cause for job {id}, which the state lacks")));
        };
        job.stop_cause = Some(cause);
    }
    Ok(())
}

pub fn decode(bytes: &[u8]) -> Result<State, SnapshotError> {
    let Some((magic, rest)) = bytes.split_first_chunk::<4>() else { return Err(SnapshotError::BadMagic) };
    let Some((version, rest)) = rest.split_first_chunk::<4>().filter(|_| magic == SNAPSHOT_MAGIC) else {
        return Err(SnapshotError::BadMagic);
    };
    let version = u32::from_le_bytes(*version);
    let decode_err = |e: crate::format::FormatError| SnapshotError::Decode(e.to_string());
    if version == 4 {
        let mut state: State = from_bytes::<v4::State>(rest).map_err(decode_err)?.into();
        state.rebuild_derived();
        return Ok(state);
    }
    if !(5..=FORMAT_NEWEST).contains(&version) {
        return Err(SnapshotError::UnsupportedVersion { found: version });
    }
    let Some((sum, body)) = rest.split_first_chunk::<4>() else {
        return Err(SnapshotError::Decode("no checksum".into()));
    };
    let found = u32::from_le_bytes(*sum);
    let computed = crc32c(body);
    if found != computed {
        return Err(SnapshotError::Checksum { found, computed });
    }
    let (stored, mut state): (u32, State) = match version {
        5 => {
            let v5: v5::State = from_bytes(body).map_err(decode_err)?;
            (v5.stored_format(), v5.into())
        }
        6..=8 => {
            let v8: v8::State = from_bytes(body).map_err(decode_err)?;
            (v8.stored_format(), v8.into())
        }
        9 => {
            let v9: v9::State = from_bytes(body).map_err(decode_err)?;
            (v9.stored_format(), v9.into())
        }
        10 => {
            let v10: v10::State = from_bytes(body).map_err(decode_err)?;
            (v10.stored_format(), v10.into())
        }
        11 => {
            let v11: v11::State = from_bytes(body).map_err(decode_err)?;
            (v11.stored_format(), v11.into())
        }
        12 => {
            let v12: v12::State = from_bytes(body).map_err(decode_err)?;
            (v12.stored_format(), v12.into())
        }
        13 | 14 => {
            let state: State = from_bytes(body).map_err(decode_err)?;
            (state.format, state)
        }
        15 => {
            let (mut state, history, since): (State, u64, u64) = from_bytes(body).map_err(decode_err)?;
            (state.history, state.history_since) = (history, since);
            (state.format, state)
        }
        16 => {
            let (mut state, history, since, pending): (State, u64, u64, bool) = from_bytes(body).map_err(decode_err)?;
            (state.history, state.history_since, state.history_pending) = (history, since, pending);
            (state.format, state)
        }
        17 => {
            type Body = (State, u64, u64, bool, crate::inventory::NodeInventory);
            let (mut state, history, since, pending, inventory): Body = from_bytes(body).map_err(decode_err)?;
            (state.history, state.history_since, state.history_pending) = (history, since, pending);
            state.node_inventory = inventory;
            (state.format, state)
        }
        _ => {
            type Body = (State, u64, u64, bool, crate::inventory::NodeInventory, Vec<(JobId, StopCause)>);
            let (mut state, history, since, pending, inventory, causes): Body = from_bytes(body).map_err(decode_err)?;
            (state.history, state.history_since, state.history_pending) = (history, since, pending);
            state.node_inventory = inventory;
            set_stop_causes(&mut state, causes)?;
            (state.format, state)
        }
    };
    if stored != version {
        return Err(SnapshotError::Decode(format!("a format-{version} snapshot holds a state of format {stored}")));
    }
    state.rebuild_derived();
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_in_every_format_and_refusals() {
        for format in FORMAT_OLDEST..=FORMAT_NEWEST {
            let state = State { format, ..State::default() };
            let bytes = encode(&state);
            assert_eq!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()), format);
            assert_eq!(decode(&bytes).unwrap(), state, "format {format}");
        }
        let bytes = encode(&State { format: FORMAT_NEWEST, ..State::default() });
        assert!(matches!(decode(b"nope"), Err(SnapshotError::BadMagic)));
        let mut future = bytes.clone();
        future[4] = 99;
        assert!(matches!(decode(&future), Err(SnapshotError::UnsupportedVersion { found: 99 })));
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(decode(&trailing), Err(SnapshotError::Checksum { .. })));
        let mut flipped = bytes.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(matches!(decode(&flipped), Err(SnapshotError::Checksum { .. })));
        let mut v4 = encode(&State::default());
        v4.push(0);
        assert!(matches!(decode(&v4), Err(SnapshotError::Decode(_))));
    }

    #[test]
    fn the_history_is_kept_from_format_15_on_and_older_snapshots_hold_the_first() {
        let history = 0x9e37_79b9_7f4a_7c15;
        let state = State { format: crate::format::HISTORY_FORMAT, history, history_since: 900, ..State::default() };
        let decoded = decode(&encode(&state)).unwrap();
        assert_eq!((decoded.history, decoded.history_since), (history, 900));
        // Format 14's bytes are exactly the state's, as before: no history.
        let older = State { format: crate::format::HISTORY_FORMAT - 1, ..State::default() };
        let bytes = encode(&older);
        assert_eq!(&bytes[12..], to_bytes(&older).as_slice());
        assert_eq!(decode(&bytes).unwrap().history, 0);
        // A format-15 snapshot without its history is damaged, not history 0.
        let mut cut = encode(&State { format: crate::format::HISTORY_FORMAT, ..State::default() });
        cut.truncate(cut.len() - 1);
        let body = cut[12..].to_vec();
        cut[8..12].copy_from_slice(&crc32c(&body).to_le_bytes());
        assert!(matches!(decode(&cut), Err(SnapshotError::Decode(_))), "{:?}", decode(&cut));
    }

    #[test]
    fn a_history_to_draw_is_kept_from_format_16_on() {
        use crate::format::FRESH_HISTORY_FORMAT;
        let pending = State { format: FRESH_HISTORY_FORMAT, history: 7, history_pending: true, ..State::default() };
        let decoded = decode(&encode(&pending)).unwrap();
        assert_eq!((decoded.history, decoded.history_pending), (7, true));
        // Format 15 has no place for it: its bytes are unchanged.
        let older = State { format: FRESH_HISTORY_FORMAT - 1, history: 7, ..State::default() };
        assert_eq!(&encode(&older)[12..], to_bytes(&(&older, 7u64, 0u64)).as_slice());
        assert!(!decode(&encode(&older)).unwrap().history_pending);
    }
}
