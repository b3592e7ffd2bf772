//! Encoding of everything this crate writes: bincode (standard config) over serde.

use serde::de::DeserializeOwned;
use serde::Serialize;

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    bincode::serde::encode_to_vec(value, bincode::config::standard()).expect("encoding into memory cannot fail")
}

/// Decodes what `encode` wrote. A length prefix claiming far more than the
/// input holds (a damaged entry, or a hostile Raft message) is an error, not an
/// allocation of whatever it says (see `gangway_core::format::from_bytes_prefix`).
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, gangway_core::format::FormatError> {
    let (value, _) = gangway_core::format::from_bytes_prefix(bytes)?;
    Ok(value)
}

/// openraft's `InstallSnapshotRequest` as the Raft service sends it: the same
/// fields in the same order, so the same bytes (bincode is positional; a
/// peer of an earlier build reads it), with the chunk written by
/// `raw_bytes` in one copy instead of one serde call per byte.
#[derive(Serialize, serde::Deserialize)]
pub struct SnapshotChunk {
    vote: openraft::Vote<crate::NodeId>,
    meta: openraft::SnapshotMeta<crate::NodeId, openraft::BasicNode>,
    offset: u64,
    #[serde(with = "gangway_core::format::raw_bytes")]
    data: Vec<u8>,
    done: bool,
}

type InstallSnapshot = openraft::raft::InstallSnapshotRequest<crate::TypeConfig>;

impl From<InstallSnapshot> for SnapshotChunk {
    fn from(r: InstallSnapshot) -> SnapshotChunk {
        SnapshotChunk { vote: r.vote, meta: r.meta, offset: r.offset, data: r.data, done: r.done }
    }
}

impl From<SnapshotChunk> for InstallSnapshot {
    fn from(c: SnapshotChunk) -> InstallSnapshot {
        InstallSnapshot { vote: c.vote, meta: c.meta, offset: c.offset, data: c.data, done: c.done }
    }
}

/// Log keys are big-endian indexes so that RocksDB's byte order is log order.
pub(crate) fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

pub(crate) fn key_index(key: &[u8]) -> u64 {
    u64::from_be_bytes(key[..8].try_into().expect("log keys are 8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A length prefix claiming more than the limit is refused without an
    /// attempt to allocate it.
    #[test]
    fn a_huge_length_prefix_is_refused() {
        // bincode's varint: 0xfd then a u64 — a Vec<u8> of 2^40 bytes.
        let mut bytes = vec![0xfd];
        bytes.extend_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(decode::<Vec<u8>>(&bytes).is_err());
        let ok = encode(&vec![7u8; 16]);
        assert_eq!(decode::<Vec<u8>>(&ok).unwrap(), vec![7u8; 16]);
    }

    /// A snapshot chunk is the bytes openraft's own request encodes to, both ways.
    #[test]
    fn a_snapshot_chunk_is_written_as_openraft_writes_it() {
        let meta = openraft::SnapshotMeta {
            last_log_id: Some(openraft::LogId::new(openraft::CommittedLeaderId::new(3, 2), 41)),
            last_membership: Default::default(),
            snapshot_id: "3-41".into(),
        };
        let request = InstallSnapshot {
            vote: openraft::Vote::new_committed(3, 2),
            meta,
            offset: 1 << 20,
            data: (0..70_000u32).map(|i| (i % 251) as u8).collect(),
            done: true,
        };
        let bytes = encode(&SnapshotChunk::from(request.clone()));
        assert_eq!(bytes, encode(&request));
        assert_eq!(InstallSnapshot::from(decode::<SnapshotChunk>(&bytes).unwrap()), request);
    }
}
