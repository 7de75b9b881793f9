"""The benchmark's chart: well-formed SVG, one bar per series and concurrency, roofline ratios."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from pdserve.bench_chart import chart_svg


def test_chart_has_bars_and_roofline_ratios() -> None:
    results = [{"concurrency": 4, "output_tok_s": 667.5}, {"concurrency": 16, "output_tok_s": 988.5}]
    root = ET.fromstring(chart_svg(results, "test"))
    ns = "{http://www.w3.org/2000/svg}"
    bars = [r for r in root.iter(f"{ns}rect") if float(r.get("height")) > 12]
    assert len(bars) == 6  # pdserve, vLLM, roofline at two concurrencies
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "c=4 (50% of roofline)" in texts and "c=16 (50% of roofline)" in texts
