#!/usr/bin/env bash
# The test command: bootstraps what it needs, then runs every test in the workspace.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$YATT_ROOT"
cargo build --workspace --bins --release
cargo nextest run --workspace --release --no-fail-fast "$@"
cargo test --workspace --release --doc
