//! A submit's and a registration's protobuf bytes, as a client or an agent
//! sends them, turned into the core's types at the API edge: decoding and
//! conversion never panic; what the edge accepts is a valid spec within the
//! size limit, and it survives the trip back to protobuf and in again.
#![no_main]

use gangway_proto::v1 as pb;
use libfuzzer_sys::fuzz_target;
use prost::Message;

// The controller's edge conversions, compiled here from their file (the
// controller crate brings RocksDB with it).
#[allow(dead_code)]
#[path = "../../controller/src/api/convert.rs"]
mod convert;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = pb::JobSpec::decode(data) {
        if let Ok(spec) = convert::spec_from_proto(p, "alice") {
            spec.validate().expect("the edge accepted an invalid spec");
            gangway_core::limits::check_spec_size(&spec).expect("the edge accepted an oversized spec");
            let again = convert::spec_from_proto(convert::spec_to_proto(&spec), "alice")
                .expect("a spec the edge accepted is accepted again");
            assert_eq!(again, spec, "a spec changed on its way through protobuf");
        }
    }
    if let Ok(r) = pb::RegisterRequest::decode(data) {
        if let Ok(node) = convert::node_spec_from_proto(r) {
            node.validate().expect("the edge accepted an invalid node");
        }
    }
});
