"""Prints the headline figures of a `gpu-check.sh run` output folder (one line each)."""
import glob
import json
import os
import sys

out = sys.argv[1]
for f in sorted(glob.glob(f"{out}/bench-*.json")):
    b = json.load(open(f))
    name = os.path.basename(f)[:-5]
    print(name, "copy GB/s %.0f matmul TFLOP/s %.0f" % (b.get("copy_gbps") or 0, b.get("matmul_tflops") or 0))
    for k in ["decode", "decode_eager", "decode_b1"]:
        d = b.get(k) or {}
        if "failed" in d:
            print("  ", k, "FAILED", d["failed"])
        elif d:
            print("  ", k, "step %.2f ms, %.0f tok/s, hbm %.3f, prefill %.4f s" % (
                d["step_ms"], d["decode_tokens_per_s"], d.get("hbm_fraction", float("nan")), d["prefill_s"]))
    t = b.get("train") or {}
    if "tokens_per_s" in t:
        print("   train %.0f tok/s, MFU %.3f (datasheet) %.3f (measured), step %.3f s" % (
            t["tokens_per_s"], t.get("mfu_datasheet") or float("nan"), t["mfu_measured"], t["step_s"]))
for name in ["grpo-bf16", "grpo-bf16-eager"]:
    try:
        rows = [json.loads(l) for l in open(f"{out}/{name}-metrics.jsonl")][1:]
    except OSError:
        print(name, "no metrics")
        continue
    def col(k):
        return ", ".join("%.3g" % r.get(k, float("nan")) for r in rows)
    print(name, "step s:", col("timing_s/step"))
    print(name, "gen s:", col("timing_s/gen"))
    print(name, "logprob diff:", col("rollout/logprob_diff_mean"))
    print(name, "reward:", col("critic/rewards/mean"))
try:
    rows = [l.rstrip("\n").split("\t") for l in open(f"{out}/weight-sync/summary.tsv")]
    for r in rows[1:]:
        print("weight-sync", ", ".join(f"{k} {v}" for k, v in zip(rows[0], r)))
except OSError:
    print("weight-sync no summary")
