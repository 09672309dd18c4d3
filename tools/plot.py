"""A dependency-free SVG line chart of benchmark rows: TFLOP/s against seqlen, one panel per head dim.

    svg = attention_chart(rows, title)   # rows: bench rows with head_dim, seqlen, ours_tflops, peers
"""

from __future__ import annotations

import math

COLORS = {"ours": "#d62728", "ours_k_ne_v": "#ff9896", "fa4": "#1f77b4", "cudnn": "#2ca02c",
          "sdpa_mem_efficient": "#9467bd"}
LABELS = {"ours": "ours", "ours_k_ne_v": "ours, K != V", "fa4": "FlashAttention-4", "cudnn": "cuDNN",
          "sdpa_mem_efficient": "torch mem-efficient SDPA"}
PEERS = ("fa4", "cudnn", "sdpa_mem_efficient")
PANEL_W, PANEL_H, PAD = 300, 230, 45


def _panel(rows, x0, head_dim, ymax) -> list:
    seqs = sorted({r["seqlen"] for r in rows})
    if not seqs:
        return []
    lx = [math.log2(s) for s in seqs]
    lo, hi = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1

    def px(s):
        return x0 + PAD + (math.log2(s) - lo) / (hi - lo) * (PANEL_W - PAD - 10)

    def py(v):
        return 30 + (1 - v / ymax) * (PANEL_H - 30 - PAD)

    out = [f'<text x="{x0 + PANEL_W / 2}" y="18" text-anchor="middle" font-size="13">head dim {head_dim}</text>',
           f'<line x1="{x0 + PAD}" y1="{py(0)}" x2="{x0 + PANEL_W - 10}" y2="{py(0)}" stroke="#444"/>',
           f'<line x1="{x0 + PAD}" y1="{py(0)}" x2="{x0 + PAD}" y2="{py(ymax)}" stroke="#444"/>']
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        v = ymax * frac
        out.append(f'<text x="{x0 + PAD - 4}" y="{py(v) + 4}" text-anchor="end" font-size="10">{v:.0f}</text>')
    for s in seqs:
        label = f"{s // 1024}k" if s >= 1024 else str(s)
        out.append(f'<text x="{px(s)}" y="{py(0) + 14}" text-anchor="middle" font-size="10">{label}</text>')
    # stage D1 rows carry kv = k_eq_v / k_ne_v: "ours" is the K = V kernel there
    series = {"ours": [(r["seqlen"], r["ours_tflops"]) for r in rows if r.get("kv", "k_eq_v") == "k_eq_v"]}
    ne = [(r["seqlen"], r["ours_tflops"]) for r in rows if r.get("kv") == "k_ne_v"]
    if ne:
        series["ours_k_ne_v"] = ne
    for peer in PEERS:
        pts = [(r["seqlen"], r["peers"][peer]) for r in rows if peer in r.get("peers", {})]
        if pts:
            series[peer] = pts
    for name, pts in series.items():
        pts = sorted(pts)
        path = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{COLORS[name]}" stroke-width="2"/>')
        out += [f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="2.5" fill="{COLORS[name]}"/>' for s, v in pts]
    return out


def attention_chart(rows, title: str) -> str:
    dims = sorted({r["head_dim"] for r in rows})
    vals = [r["ours_tflops"] for r in rows] + [v for r in rows for v in r.get("peers", {}).values()]
    ymax = max(100.0, math.ceil(max(vals, default=100) / 100) * 100)
    width, height = max(PANEL_W * len(dims), 740), PANEL_H + 58
    body = []
    for i, d in enumerate(dims):
        body += _panel([r for r in rows if r["head_dim"] == d], i * PANEL_W, d, ymax)
    legend_y = PANEL_H + 22
    present = {"ours"} | {p for r in rows for p in r.get("peers", {})} | (
        {"ours_k_ne_v"} if any(r.get("kv") == "k_ne_v" for r in rows) else set())
    names = [n for n in COLORS if n in present]
    step = 130
    for i, name in enumerate(names):
        x = 10 + i * step
        body.append(f'<rect x="{x}" y="{legend_y - 9}" width="14" height="4" fill="{COLORS[name]}"/>')
        body.append(f'<text x="{x + 20}" y="{legend_y - 4}" font-size="11">{LABELS[name]}</text>')
    body.append(f'<text x="{width - 10}" y="{legend_y + 14}" text-anchor="end" font-size="11">'
                f'{title} (TFLOP/s vs seqlen)</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>\n")


def ratio_chart(rows, peer: str, title: str, bar: float | None = None) -> str:
    """Horizontal bars of our time / ``peer``'s time, one per row that has that ratio (its case
    as the label): 1.0 (level) drawn, and ``bar`` (a target ratio, e.g. 1 / 1.1) dashed. For
    groups whose cases do not sweep one axis (the serving group: FlashMLA's decode configs and
    batches, prefill chunks)."""
    rows = [r for r in rows if peer in r.get("time_ratio_vs", {})]
    label_w, plot_w, row_h, top = 430, 330, 16, 28
    vmax = max([1.0, bar or 0.0] + [r["time_ratio_vs"][peer] for r in rows]) * 1.1
    height = top + row_h * len(rows) + 40

    def px(v):
        return label_w + v / vmax * plot_w

    body = [f'<text x="10" y="18" font-size="13">{title}: our time / {peer}\'s (lower is faster; '
            f'1.0 = level)</text>']
    for i, r in enumerate(rows):
        y = top + i * row_h
        v = r["time_ratio_vs"][peer]
        color = COLORS["ours"] if v > 1.0 else COLORS["cudnn"]
        case = r["case"].replace(f" {peer}", "")
        case = case if len(case) <= 72 else case[:69] + "..."
        body.append(f'<text x="{label_w - 6}" y="{y + 11}" text-anchor="end" font-size="10">{case}</text>')
        body.append(f'<rect x="{label_w}" y="{y + 2}" width="{px(v) - label_w:.1f}" height="{row_h - 5}" '
                    f'fill="{color}"/>')
        body.append(f'<text x="{px(v) + 4:.1f}" y="{y + 11}" font-size="10">{v:.2f}x</text>')
    y_end = top + row_h * len(rows)
    body.append(f'<line x1="{px(1.0):.1f}" y1="{top - 4}" x2="{px(1.0):.1f}" y2="{y_end}" stroke="#444"/>')
    if bar is not None:
        body.append(f'<line x1="{px(bar):.1f}" y1="{top - 4}" x2="{px(bar):.1f}" y2="{y_end}" stroke="#444" '
                    f'stroke-dasharray="4,3"/>')
        body.append(f'<text x="{px(bar):.1f}" y="{y_end + 14}" text-anchor="middle" font-size="10">'
                    f'bar {bar:.2f}x</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + plot_w + 60}" height="{height}" '
            f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>\n")
