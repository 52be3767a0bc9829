#!/usr/bin/env bash
# The main job: bootstraps what it needs, builds, and runs the embedded single-machine
# default. Extra arguments go to `yatt`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$YATT_ROOT"
cargo build --release --bins
exec target/release/yatt demo "$@"
