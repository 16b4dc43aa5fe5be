#!/usr/bin/env bash
# Regenerates the committed etcd gRPC code (needs protoc: apt-get install
# protobuf-compiler). Run after changing ../proto; commit the result.
set -euo pipefail
cd "$(dirname "$0")"
cargo run --quiet --release
