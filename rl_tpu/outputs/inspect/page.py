"""The page: its template's three package files made into one HTML file, with the data embedded as JSON."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from rl_tpu.outputs.inspect.data import run_data

PAGE_FILE = "inspect.html"
TEMPLATE, STYLE, SCRIPT = "page.html", "page.css", "page.js"
MARKERS = ("/*STYLE*/", "/*DATA*/", "/*SCRIPT*/")  # where the template takes each part, in its order


def embedded_json(data: dict) -> str:
    """`data` as JSON that an HTML script element holds as it is: `<`, `>` and `&` escaped as JSON escapes (they can
    only be in strings), so that no text of a sample can end the element or start markup."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(data: dict) -> str:
    """The page's HTML with `data` in it."""
    files = resources.files(__package__)
    style, script = (files.joinpath(name).read_text(encoding="utf-8") for name in (STYLE, SCRIPT))
    parts = (style, embedded_json(data), script)
    out, rest = [], files.joinpath(TEMPLATE).read_text(encoding="utf-8")
    for marker, part in zip(MARKERS, parts, strict=True):
        before, found, rest = rest.partition(marker)  # in the template's text only, never in a part's
        if not found:
            raise ValueError(f"{TEMPLATE} has no {marker} marker after the one before")
        out += [before, part]
    return "".join(out + [rest])


def write_page(run_dir: str | Path) -> Path:
    """Write `RUN_DIR/inspect.html` (whole: renamed into place) from the run's metrics and rollout record."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run folder")
    path = run_dir / PAGE_FILE
    partial = path.with_name(path.name + ".partial")
    partial.write_text(render(run_data(run_dir)), encoding="utf-8")
    os.replace(partial, path)
    return path
