//! Writes the lighthouse's gRPC code into `../src/proto/` (run by regen.sh):
//! messages, the server of `torchft.LighthouseService` that `rally lighthouse`
//! serves, and its client, which the tests use as torchft's managers do.

fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = root.join("../src/proto");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .out_dir(&out)
        .compile_protos(&[root.join("proto/torchft.proto")], &[root.join("proto")])
        .expect("cannot compile proto/torchft.proto (is protoc installed?)");
    println!("wrote {}", out.join("torchft.rs").display());
}
