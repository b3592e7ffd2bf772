//! Generates the message types of proto/gangway/v1 (no services), as
//! gangway-proto's build does with tonic: the same files, the same prost.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let root = "../../proto";
    let files = ["types", "jobs", "nodes", "admin", "raft"].map(|f| format!("{root}/gangway/v1/{f}.proto"));
    prost_build::Config::new().compile_protos(&files, &[root])?;
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    Ok(())
}
