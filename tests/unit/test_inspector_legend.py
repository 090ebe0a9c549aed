"""The inspector's legend names every segment its bars draw."""

from __future__ import annotations

import re

from tests.conftest import REPO

STATIC = REPO / "gateway" / "ui" / "static"


def test_every_layer_the_bar_draws_has_its_key_in_the_legend() -> None:
    """The bar drew `tools` and `overhead` segments the legend did not name."""
    layers = re.search(r"const layers = \[([^\]]*)\]", (STATIC / "app.js").read_text())
    assert layers is not None
    drawn = re.findall(r'"([a-z]+)"', layers.group(1))
    legend = re.search(r'<div id="legend"[^>]*>(.*?)</div>', (STATIC / "index.html").read_text(), re.S)
    assert legend is not None
    keyed = set(re.findall(r'<i class="seg-([a-z]+)"></i>', legend.group(1)))
    assert len(drawn) >= 6 and set(drawn) <= keyed, set(drawn) - keyed
    styled = (STATIC / "style.css").read_text()
    assert all(f".seg-{layer} " in styled for layer in keyed)
