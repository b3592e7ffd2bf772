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
}
