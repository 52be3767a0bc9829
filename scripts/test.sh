#!/usr/bin/env bash
# The test command: bootstraps what it needs, then runs every test in the workspace.
# Each crate's integration tests are one binary (tests/main.rs), and the binaries and the
# tests share one build: the release profile, with the same features (see Cargo.toml).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$YATT_ROOT"
# libtorch's OpenMP threads spin while they wait for work. With tests and their child
# processes sharing a few cores, the spinning threads take the cores the working ones
# need: one SmolLM2 test took 131 s spinning and 27 s passive on 2 loaded cores.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
cargo build --workspace --bins --release
# yatt-collective alone, without NCCL: the workspace turns `nccl` on (the binaries'
# default), so the stub backend is tested only here. The NCCL backend's CPU tests (they
# load the venv's libnccl and report the missing driver) run in the workspace run below;
# its GPU tests skip without a GPU.
cargo nextest run -p yatt-collective --release
cargo nextest run --workspace --release --no-fail-fast "$@"
cargo test --workspace --release --doc
# The API docs build without a warning (broken intra-doc links, private items linked from
# public docs); missing docs in the SDK crates are already errors in the builds above.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --release
