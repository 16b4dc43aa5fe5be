#!/usr/bin/env bash
# Regenerates the committed gRPC code of the lighthouse, ../src/proto/torchft.rs,
# from proto/torchft.proto (needs protoc: apt-get install protobuf-compiler).
# Run after changing the proto; commit the result.
set -euo pipefail
cd "$(dirname "$0")"
cargo run --quiet --release
