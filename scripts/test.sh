#!/usr/bin/env bash
# The test command: bootstraps what it needs, then runs every test in the workspace.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$YATT_ROOT"
cargo build --workspace --bins --release
# yatt-collective's NCCL backend builds without CUDA: its CPU tests load the venv's
# libnccl and report the missing driver; the GPU tests skip without a GPU.
# yatt-collective alone, both ways: the workspace build turns `nccl` on (the binaries'
# default), so the stub backend is tested only here.
cargo nextest run -p yatt-collective --release
cargo nextest run -p yatt-collective --release --features nccl
cargo nextest run --workspace --release --no-fail-fast "$@"
cargo test --workspace --release --doc
