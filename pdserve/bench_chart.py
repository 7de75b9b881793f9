"""An SVG bar chart of `pdserve bench` results beside vLLM's figures and the bandwidth roofline.

No plotting library: the SVG is written by hand, so the benchmark runs anywhere.
"""

from __future__ import annotations

from html import escape

# Same H200, same shape, 1,024-token prompts, 256 output tokens (shared/design.md, 2026-11-30).
VLLM_TOK_S = {4: 653.0, 16: 1406.0, 32: 1999.0}
# `vllm serve`, same settings, AIPerf 0.13 streaming (shared/design.md).
VLLM_SERVED_TOK_S = {4: 594.0, 16: 1365.0, 32: 2005.0}
# shared/tools/roofline.py, one GPU doing prefill too (bf16 weights, 4.3 TB/s).
ROOFLINE_TOK_S = {1: 691.0, 4: 1335.0, 16: 1977.0, 32: 2478.0, 64: 3400.0}
SERIES = (("pdserve", "#2b7bb9"), ("vLLM 0.26", "#e08a2c"), ("roofline", "#9aa5b1"))


def chart_svg(results: list[dict], title: str, reference: dict[int, float] = VLLM_TOK_S) -> str:
    """Grouped bars of output tok/s per concurrency; each pdserve bar labelled with its roofline ratio."""
    groups = [
        (
            r["concurrency"],
            [r["output_tok_s"], reference.get(r["concurrency"]), ROOFLINE_TOK_S.get(r["concurrency"])],
        )
        for r in results
    ]
    peak = max(v for _, vals in groups for v in vals if v) * 1.1
    width, height, left, bottom, top = max(640, 120 + 170 * len(groups)), 360, 70, 300, 50
    bar = 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
        ' font-family="sans-serif">',
        f'<text x="{width / 2}" y="24" text-anchor="middle" font-size="15">{escape(title)}</text>',
        f'<line x1="{left}" y1="{bottom}" x2="{width - 20}" y2="{bottom}" stroke="#333"/>',
    ]
    for k in range(5):
        value = peak * k / 4
        y = bottom - (bottom - top) * k / 4
        out.append(f'<text x="{left - 6}" y="{y + 4}" text-anchor="end" font-size="11">{value:,.0f}</text>')
        out.append(f'<line x1="{left}" y1="{y}" x2="{width - 20}" y2="{y}" stroke="#ddd"/>')
    for g, (conc, values) in enumerate(groups):
        x0 = left + 20 + 170 * g
        for s, ((_name, color), value) in enumerate(zip(SERIES, values, strict=True)):
            if value is None:
                continue
            h = (bottom - top) * value / peak
            x = x0 + s * (bar + 4)
            out.append(f'<rect x="{x}" y="{bottom - h:.1f}" width="{bar}" height="{h:.1f}" fill="{color}"/>')
            out.append(
                f'<text x="{x + bar / 2}" y="{bottom - h - 4:.1f}" text-anchor="middle" font-size="10">'
                f"{value:,.0f}</text>"
            )
        roof = values[2]
        ratio = f" ({values[0] / roof:.0%} of roofline)" if roof else ""
        out.append(
            f'<text x="{x0 + 64}" y="{bottom + 18}" text-anchor="middle" font-size="12">'
            f"c={conc}{ratio}</text>"
        )
    for s, (name, color) in enumerate(SERIES):
        x = left + 10 + 185 * s
        out.append(f'<rect x="{x}" y="{height - 30}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 16}" y="{height - 20}" font-size="12">{name} output tok/s</text>')
    out.append("</svg>")
    return "\n".join(out)
