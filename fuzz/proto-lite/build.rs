//! Generates the message types of proto/gangway/v1 (no services), as
//! gangway-proto's build does with tonic: the same files, read from its
//! build script, and the same prost with the same (default) options. A
//! prost option that build sets would change the types the fuzz targets
//! see: the build stops until it is set here too.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let root = "../../proto";
    let real = std::fs::read_to_string(format!("{root}/build.rs"))?;
    // The options gangway-proto's build sets on tonic's builder: only where
    // the descriptor set goes, which changes no type.
    let chain = real.split("tonic_build::configure()").nth(1).and_then(|c| c.split(".compile_protos(").next());
    let options: Vec<&str> = chain
        .ok_or("proto/build.rs no longer calls tonic_build::configure()...compile_protos(")?
        .split("\n        .")
        .map(str::trim)
        .filter(|o| !o.is_empty() && !o.starts_with("file_descriptor_set_path("))
        .collect();
    if !options.is_empty() {
        return Err(
            format!("proto/build.rs sets {options:?}: set the same on prost here (fuzz/proto-lite/build.rs)").into()
        );
    }
    let files: Vec<String> = real
        .split('"')
        .filter(|s| s.starts_with("gangway/v1/") && s.ends_with(".proto"))
        .map(|f| format!("{root}/{f}"))
        .collect();
    if files.len() < 5 {
        return Err(format!("proto/build.rs's .proto files were not found: {files:?}").into());
    }
    prost_build::Config::new().compile_protos(&files, &[root])?;
    println!("cargo:rerun-if-changed={root}/build.rs");
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    Ok(())
}
