//! Encoding of everything this crate writes: bincode (standard config) over serde.

use serde::de::DeserializeOwned;
use serde::Serialize;

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    bincode::serde::encode_to_vec(value, bincode::config::standard()).expect("encoding into memory cannot fail")
}

pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, bincode::error::DecodeError> {
    let (value, _) = bincode::serde::decode_from_slice(bytes, bincode::config::standard())?;
    Ok(value)
}

/// Log keys are big-endian indexes so that RocksDB's byte order is log order.
pub(crate) fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

pub(crate) fn key_index(key: &[u8]) -> u64 {
    u64::from_be_bytes(key[..8].try_into().expect("log keys are 8 bytes"))
}
