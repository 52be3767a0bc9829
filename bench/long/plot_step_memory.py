"""Peak resident memory of one SmolLM2-135M training step against tokens per
micro-batch (issue 49), from the `step-memory tokens=... peak_kb=...` lines that
`long_bench::peak_memory_per_trained_token` prints, one file per curve; with the
issue's target drawn as a line of 100 KB per token from the first point of the curve
marked with a leading "*" (else the first curve).
  python bench/long/plot_step_memory.py docs/img/long-memory-step.png \
      "before=bench/long/step-memory-before.txt" "*after=bench/long/step-memory-after.txt"
"""

import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def points(path):
    out = []
    for line in open(path):
        m = re.search(r"step-memory tokens=(\d+) .*peak_kb=(\d+)", line)
        if m:
            out.append((int(m.group(1)), int(m.group(2)) * 1024 / 1e9))
    return sorted(out)


def main(png, curves):
    fig, ax = plt.subplots(figsize=(8, 5))
    first = None
    for spec in curves:
        label, path = spec.split("=", 1)
        pts = points(path)
        if not pts:
            continue
        if label.startswith("*"):
            label, first = label[1:], pts[0]
        first = first or pts[0]
        xs, ys = zip(*pts)
        (t0, p0), (t1, p1) = pts[0], pts[-1]
        slope = (p1 - p0) * 1e6 / (t1 - t0) if t1 > t0 else 0.0
        ax.plot(xs, ys, "o-", label=f"{label}: {slope:.0f} KB/token")
    if first:
        t0, p0 = first
        xs = [t0, 16384]
        ax.plot(
            xs,
            [p0 + (x - t0) * 100e3 / 1e9 for x in xs],
            "k--",
            label="target: 100 KB/token",
        )
    ax.set_xticks([1024, 2048, 4096, 8192, 16384])
    ax.set_xticklabels(["1k", "2k", "4k", "8k", "16k"])
    ax.set_xlabel("trained tokens per micro-batch (8 packed sequences)")
    ax.set_ylabel("peak resident memory (GB)")
    ax.set_title("SmolLM2-135M training step, f32, layer recompute, chunked head")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
