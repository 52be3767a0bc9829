"""Peak resident memory against trained tokens per micro-batch, main against this
branch, from scripts/bench-long-memory.sh's lines ("label N rss_kb wall"), as a PNG
drawn with PIL (no matplotlib here).
  python bench/long/plot_memory.py results.txt docs/img/long-memory.png"""

import sys
from PIL import Image, ImageDraw

rows = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) >= 3 and p[2].isdigit():
        rows.setdefault(p[0], []).append((int(p[1]) * 8 + 8 * 46, int(p[2]) / 1e6))
W, H, M = 900, 560, 80
img = Image.new("RGB", (W, H), "white")
d = ImageDraw.Draw(img)
xs = [x for v in rows.values() for x, _ in v]
ys = [y for v in rows.values() for _, y in v]
xmax, ymax = max(xs) * 1.05, max(max(ys) * 1.1, 1)
px = lambda x: M + (W - 2 * M) * x / xmax
py = lambda y: H - M - (H - 2 * M) * y / ymax
d.line([(M, H - M), (W - M, H - M)], fill="black")
d.line([(M, M), (M, H - M)], fill="black")
for i in range(6):
    y = ymax * i / 5
    d.text((10, py(y) - 6), f"{y:.1f} GB", fill="black")
    x = xmax * i / 5
    d.text((px(x) - 15, H - M + 8), f"{x:,.0f}", fill="black")
d.text((W / 2 - 120, H - 30), "trained positions per micro-batch (8 samples)", fill="black")
d.text((M, 20), "SmolLM2-135M, one GRPO step, f32, 2 cores: peak resident memory", fill="black")
colours = {"main": "red", "branch": "blue"}
for k, (label, v) in enumerate(sorted(rows.items())):
    v.sort()
    c = colours.get(label, "green")
    d.line([(px(x), py(y)) for x, y in v], fill=c, width=3)
    for x, y in v:
        d.ellipse([px(x) - 4, py(y) - 4, px(x) + 4, py(y) + 4], fill=c)
    d.text((W - M - 150, M + 20 * k), label, fill=c)
img.save(sys.argv[2])
