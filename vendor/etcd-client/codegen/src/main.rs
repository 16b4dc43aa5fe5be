//! Writes the etcd gRPC client code into `src/rpc/generated/` (run by regen.sh).

fn main() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = root.join("src/rpc/generated");
    let protos = [
        "proto/etcd/api/authpb/auth.proto",
        "proto/etcd/api/etcdserverpb/rpc.proto",
        "proto/etcd/api/mvccpb/kv.proto",
        "proto/etcd/server/etcdserver/api/v3election/v3electionpb/v3election.proto",
        "proto/etcd/server/etcdserver/api/v3lock/v3lockpb/v3lock.proto",
    ]
    .map(|p| root.join(p));
    tonic_prost_build::configure()
        .build_server(false)
        .out_dir(&out)
        .compile_protos(&protos, &[root.join("proto")])
        .expect("cannot compile the etcd protos (is protoc installed?)");
    // Annotation-only packages the client does not use.
    for unused in ["google.api.rs", "grpc.gateway.protoc_gen_openapiv2.options.rs"] {
        let _ = std::fs::remove_file(out.join(unused));
    }
    println!("wrote {}", out.display());
}
