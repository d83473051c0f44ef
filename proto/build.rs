//! Generates the tonic/prost code for `ferry/v1/*.proto` and the encoded file-descriptor set
//! that gRPC reflection serves. Needs `protoc` (Debian's `protobuf-compiler`); `scripts/setup`
//! installs it, and `PROTOC` may point at another one.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "ferry/v1/admin.proto",
    "ferry/v1/common.proto",
    "ferry/v1/generation.proto",
    "ferry/v1/executor.proto",
    "ferry/v1/kv_transfer.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    tonic_prost_build::configure()
        // KV block data as `bytes::Bytes`: decoded without a copy out of the receive buffer,
        // and sent from a block's buffer without one.
        .bytes(".ferry.v1.BlockChunk.data")
        .file_descriptor_set_path(out_dir.join("ferry_v1_descriptor.bin"))
        .compile_protos(PROTOS, &["."])
        .map_err(|e| {
            format!(
                "compiling ferry.v1 protos failed (is protoc installed? run scripts/setup): {e}"
            )
        })?;
    Ok(())
}
