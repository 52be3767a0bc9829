#!/usr/bin/env bash
# Runs one `yatt train` job under `nice -n 10 /usr/bin/time -v` and samples the job
# process's VmHWM and VmRSS every SAMPLE_S seconds (issue 49's whole-job runs):
#   SAMPLE_S=2 bench/long/sample_rss.sh BINARY OUT CONFIG [--set k=v ...]
# Writes OUT/log.txt (stdout), OUT/time.txt (stderr and time -v), OUT/rss.txt (one line
# per sample: UTC time, VmHWM, VmRSS), OUT/run/ (the job's output_dir, metrics.jsonl).
# Run it from the repository root, so that relative config paths resolve.
set -u
bin=$1 out=$2 cfg=$3; shift 3
mkdir -p "$out"
nice -n 10 /usr/bin/time -v "$bin" train "$cfg" --set job.output_dir=\"$out/run\" "$@" \
  >"$out/log.txt" 2>"$out/time.txt" &
tpid=$!
sleep 1
ypid=$(pgrep -P $tpid | head -1)
echo "time pid $tpid yatt pid $ypid" >"$out/rss.txt"
while kill -0 "$ypid" 2>/dev/null; do
  echo "$(date -u +%H:%M:%S) $(grep -E 'VmRSS|VmHWM' /proc/$ypid/status 2>/dev/null | tr -s ' \n' ' ')" >>"$out/rss.txt"
  sleep "${SAMPLE_S:-5}"
done
wait $tpid
echo "exit $?" >>"$out/rss.txt"
