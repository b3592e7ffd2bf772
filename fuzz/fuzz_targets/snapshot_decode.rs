//! Snapshot bytes (as installed from a leader or read from disk): decoding
//! never panics, and a snapshot that decodes encodes back to the same state.
#![no_main]

use gangway_core::snapshot;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(state) = snapshot::decode(data) else { return };
    let _ = state.check_invariants();
    let again = snapshot::decode(&snapshot::encode(&state)).expect("an encoded snapshot decodes");
    assert_eq!(again, state, "a snapshot did not survive encode/decode");
});
