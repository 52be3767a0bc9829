#!/usr/bin/env bash
# Runs yatt's cargo-fuzz targets one after another and prints what each run did.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# SECONDS_PER_TARGET defaults to 3600. TARGET is a target name (`gguf`) or
# `crate/target` (`engine/gguf`); none means every target:
#
#   runtime/frame_decoder   QUIC frame decoder and bulk headers (runtime/fuzz)
#   engine/gguf             GGUF header, metadata, tensor infos, dequantization, import
#   engine/model_config     a model directory's config.json
#   engine/safetensors      model.safetensors as the model loader reads and uses it
#   trainer/job_toml        the job TOML with --set overrides and validation
#
# Installs cargo-fuzz if it is missing (`cargo install cargo-fuzz --locked`; it needs a
# nightly toolchain: `rustup toolchain install nightly`), sources scripts/bootstrap.sh
# for libtorch (the engine and trainer targets link it), then runs each target under
# `nice` for SECONDS_PER_TARGET, starting from its corpus (`CRATE/fuzz/corpus/TARGET`,
# git-ignored, kept between runs) and its committed seeds (`CRATE/fuzz/seeds/TARGET`,
# and `config/` for job_toml; read only). Crashes land in `CRATE/fuzz/artifacts/TARGET/`
# (git-ignored); logs in `target/fuzz-logs/`. Exits 1 if any target found something.
#
# Environment:
#   YATT_FUZZ_SANITIZER  address | none (default: address; it works with the targets
#                        that link libtorch too; `none` runs several times faster and
#                        cannot catch memory errors or single huge mallocs)
#   YATT_FUZZ_RSS_MB     libFuzzer -rss_limit_mb (default 2048)
#   YATT_FUZZ_MALLOC_MB  libFuzzer -malloc_limit_mb (default 2048; enforced under ASan
#                        only: without a sanitizer libFuzzer cannot see single mallocs)
#   YATT_FUZZ_TIMEOUT    libFuzzer -timeout per input, seconds (default 30)
#   YATT_FUZZ_NICE       nice level (default 19)
#   YATT_FUZZ_ARGS       more libFuzzer arguments (e.g. "-jobs=2 -workers=2")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

ALL=(runtime/frame_decoder engine/gguf engine/model_config engine/safetensors trainer/job_toml)

secs="${1:-3600}"
[ $# -gt 0 ] && shift
if ! [[ "$secs" =~ ^[0-9]+$ ]] || [ "$secs" -eq 0 ]; then
  echo "fuzz.sh: SECONDS_PER_TARGET must be a positive integer, got '$secs'" >&2
  echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]  (targets: ${ALL[*]})" >&2
  exit 2
fi

targets=()
for want in "$@"; do
  hit=""
  for t in "${ALL[@]}"; do
    if [ "$want" = "$t" ] || [ "$want" = "${t#*/}" ]; then hit="$t"; fi
  done
  if [ -z "$hit" ]; then
    echo "fuzz.sh: unknown target '$want'; targets are: ${ALL[*]}" >&2
    exit 2
  fi
  targets+=("$hit")
done
[ ${#targets[@]} -gt 0 ] || targets=("${ALL[@]}")

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
  echo "fuzz.sh: cargo-fuzz needs a nightly toolchain: rustup toolchain install nightly" >&2
  exit 2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked
fi

# libtorch for the engine and trainer targets (LD_LIBRARY_PATH: fuzz binaries carry no
# rpath). Keep a target dir the caller chose.
saved_target_dir="${CARGO_TARGET_DIR:-}"
# shellcheck source=scripts/bootstrap.sh
source "$ROOT/scripts/bootstrap.sh"
target_base="${saved_target_dir:-$ROOT/target}"

rss="${YATT_FUZZ_RSS_MB:-2048}"
malloc="${YATT_FUZZ_MALLOC_MB:-2048}"
timeout="${YATT_FUZZ_TIMEOUT:-30}"
nice_level="${YATT_FUZZ_NICE:-19}"
logs="$ROOT/target/fuzz-logs"
mkdir -p "$logs"
stamp="$(date +%Y%m%d-%H%M%S)"
toolchain="$(rustc +nightly --version | cut -d' ' -f2-3), $(cargo fuzz --version 2>/dev/null)"

# Reading libFuzzer's log; each prints nothing when the log has no such line.
# The last value of `key: value` on the stat lines (`#N DONE cov: ...`).
last_stat() { { grep -E '^#[0-9]+' "$2" | grep -oE "$1: [0-9]+" | tail -1 | awk '{print $2}'; } || true; }
# A `stat::KEY: VALUE` line of -print_final_stats.
final_stat() { { grep -E "^stat::$1:" "$2" | tail -1 | awk '{print $2}'; } || true; }
# The last match of an extended regex.
last_match() { { grep -oE "$1" "$2" | tail -1; } || true; }

rows=()
found_any=0
for t in "${targets[@]}"; do
  crate="${t%%/*}"
  name="${t#*/}"
  dir="$ROOT/$crate/fuzz"
  san="${YATT_FUZZ_SANITIZER:-address}"
  # cargo-fuzz builds for the explicit target triple, apart from host builds. Builds
  # without a sanitizer get a dir of their own, so that the instrumented builds of the
  # crates the targets share stay built across a switch.
  export CARGO_TARGET_DIR="$target_base"
  [ "$san" = address ] || CARGO_TARGET_DIR="$target_base/fuzz-sanitizer-$san"
  corpus="$dir/corpus/$name"
  mkdir -p "$corpus"
  dirs=("$corpus")
  [ -d "$dir/seeds/$name" ] && dirs+=("$dir/seeds/$name")
  # The shipped job configs seed the job TOML target too.
  [ "$name" = job_toml ] && dirs+=("$ROOT/config")
  log="$logs/$name-$stamp.log"
  args=(-max_total_time="$secs" -rss_limit_mb="$rss" -timeout="$timeout" -print_final_stats=1)
  [ "$san" = none ] || args+=(-malloc_limit_mb="$malloc")
  # shellcheck disable=SC2206
  args+=(${YATT_FUZZ_ARGS:-})
  cmd=(cargo +nightly fuzz run -s "$san" "$name" "${dirs[@]}" -- "${args[@]}")
  echo "== $t ($san, ${secs}s): (cd ${dir#"$ROOT"/} && ${cmd[*]})" >&2
  start=$(date +%s)
  set +e
  (cd "$dir" && nice -n "$nice_level" "${cmd[@]}") >"$log" 2>&1
  rc=$?
  set -e
  wall=$(($(date +%s) - start))
  # The targets' scratch directories (engine/fuzz/fuzz_targets/scratch.rs), of
  # processes that have ended.
  for d in /dev/shm/yatt-fuzz-"$name"-* "${TMPDIR:-/tmp}"/yatt-fuzz-"$name"-*; do
    if [ -d "$d" ] && ! kill -0 "${d##*-}" 2>/dev/null; then rm -rf "$d"; fi
  done
  runs="$(final_stat number_of_executed_units "$log")"
  [ -n "$runs" ] || runs="$(last_match '^#[0-9]+' "$log" | tr -d '#')"
  eps="$(final_stat average_exec_per_sec "$log")"
  cov="$(last_stat cov "$log")"
  ft="$(last_stat ft "$log")"
  corp="$(last_match 'corp: [0-9]+/[0-9]+[a-zA-Z]*' "$log" | cut -d' ' -f2)"
  rss_peak="$(final_stat peak_rss_mb "$log")"
  artifact="$(last_match 'Test unit written to [^ ]+' "$log" | cut -d' ' -f5)"
  if [ "$rc" -eq 0 ] && [ -z "$artifact" ]; then
    result="nothing found"
  else
    found_any=1
    # A panic's place (a registry crate's without its registry path), else the
    # sanitizer's or libFuzzer's summary (allocation-size-too-big, timeout, ...).
    panic_at="$(last_match 'panicked at [^ ]+' "$log")"
    kind="$(echo "$panic_at" | sed -e 's|/.*/registry/src/[^/]*/||' -e "s|$ROOT/||" -e 's|:$||')"
    # A panic in the standard library or a registry crate (an overflow in a `product()`):
    # the first frame of yatt's own code under it too.
    if [ -n "$panic_at" ] && [[ "$panic_at" != "panicked at $ROOT/"* ]]; then
      ours="$({ grep -oE ' at /[^ ]+' "$log" | grep -F " at $ROOT/" | head -1 | sed "s|^ at $ROOT/||"; } || true)"
      [ -z "$ours" ] || kind="$kind, from $ours"
    fi
    [ -n "$kind" ] || kind="$(last_match 'SUMMARY: [A-Za-z]+: [a-z-]+' "$log" | sed 's/^SUMMARY: //')"
    result="FOUND (rc $rc${kind:+, $kind}${artifact:+, ${artifact#"$ROOT"/}})"
    if [ -z "$runs" ] && [ -z "$artifact" ]; then
      result="FAILED before fuzzing (rc $rc; see ${log#"$ROOT"/})"
    fi
  fi
  echo "   $t: ${runs:-?} executions, ${eps:-?} exec/s, cov ${cov:-?}, ft ${ft:-?}, corpus ${corp:-?}, peak RSS ${rss_peak:-?} MB, ${wall}s wall incl. build: $result" >&2
  rows+=("| $t | $san | ${secs} | ${runs:-?} | ${eps:-?} | ${cov:-?} | ${ft:-?} | ${corp:-?} | ${rss_peak:-?} | $result |")
done

echo
echo "toolchain: $toolchain; logs: ${logs#"$ROOT"/}/*-$stamp.log"
echo
echo "| target | sanitizer | seconds | executions | exec/s | cov | ft | corpus | peak RSS MB | result |"
echo "|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit "$found_any"
