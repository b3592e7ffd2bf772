//! Generates the Rust types and tonic stubs for proto/gangway/v1, plus the file
//! descriptor set that server reflection serves. protoc comes from a vendored
//! crate, so building needs no system package.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let files = [
        "gangway/v1/types.proto",
        "gangway/v1/jobs.proto",
        "gangway/v1/nodes.proto",
        "gangway/v1/admin.proto",
        "gangway/v1/raft.proto",
    ];
    tonic_build::configure()
        .file_descriptor_set_path(out.join("gangway_descriptor.bin"))
        .compile_protos(&files, &["."])?;
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    Ok(())
}
