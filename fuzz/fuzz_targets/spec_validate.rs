//! A job spec with arbitrary fields (decoded from the input as the log
//! carries it): validation, the size estimate and the budgets never panic,
//! and a valid spec's array and dependency syntax parse.
#![no_main]

use gangway_core::limits::check_spec_size;
use gangway_core::spec::parse_array;
use gangway_core::JobSpec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(spec) = gangway_core::format::from_bytes::<JobSpec>(data) else { return };
    let _ = spec.size_bytes();
    let _ = spec.approx_bytes();
    let _ = check_spec_size(&spec);
    if spec.validate().is_ok() && !spec.array.is_empty() {
        parse_array(&spec.array).expect("a valid spec's array parses");
    }
});
