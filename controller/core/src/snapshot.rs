//! Snapshot encoding of [`State`]: a magic tag, a format version, then the state in
//! bincode. The encoding is deterministic (BTreeMaps, fixed field order), so two
//! replicas with the same state produce byte-identical snapshots.
//!
//! Bump [`SNAPSHOT_FORMAT_VERSION`] when the encoding of `State` changes, and keep
//! a decoder for every version still found on disk.

use crate::state::State;

/// Marks a Gangway snapshot, so a foreign or truncated blob is refused clearly.
pub const SNAPSHOT_MAGIC: &[u8; 4] = b"GWSN";
pub const SNAPSHOT_FORMAT_VERSION: u32 = 4;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("not a Gangway snapshot (bad magic)")]
    BadMagic,
    #[error("snapshot format version {found} is not supported (this build reads version {SNAPSHOT_FORMAT_VERSION})")]
    UnsupportedVersion { found: u32 },
    #[error("snapshot body does not decode: {0}")]
    Decode(String),
    #[error("snapshot has {0} trailing bytes")]
    Trailing(usize),
}

pub fn encode(state: &State) -> Vec<u8> {
    let mut out = Vec::with_capacity(state.jobs.len().saturating_mul(256).saturating_add(64));
    out.extend_from_slice(SNAPSHOT_MAGIC);
    out.extend_from_slice(&SNAPSHOT_FORMAT_VERSION.to_le_bytes());
    let body = bincode::serde::encode_to_vec(state, bincode::config::standard())
        .expect("encoding a State into memory cannot fail");
    out.extend_from_slice(&body);
    out
}

pub fn decode(bytes: &[u8]) -> Result<State, SnapshotError> {
    if bytes.len() < 8 || &bytes[..4] != SNAPSHOT_MAGIC {
        return Err(SnapshotError::BadMagic);
    }
    let version = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
    if version != SNAPSHOT_FORMAT_VERSION {
        return Err(SnapshotError::UnsupportedVersion { found: version });
    }
    let (state, used): (State, usize) = bincode::serde::decode_from_slice(&bytes[8..], bincode::config::standard())
        .map_err(|e| SnapshotError::Decode(e.to_string()))?;
    let body = bytes.len().saturating_sub(8);
    if used != body {
        return Err(SnapshotError::Trailing(body.saturating_sub(used)));
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_refusals() {
        let state = State::default();
        let bytes = encode(&state);
        assert_eq!(decode(&bytes).unwrap(), state);
        assert!(matches!(decode(b"nope"), Err(SnapshotError::BadMagic)));
        let mut future = bytes.clone();
        future[4] = 99;
        assert!(matches!(decode(&future), Err(SnapshotError::UnsupportedVersion { found: 99 })));
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(decode(&trailing), Err(SnapshotError::Trailing(1))));
    }
}
