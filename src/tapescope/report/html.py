"""`write_html`: one self-contained, offline HTML page that shows a Profile interactively.

The page is a template (assets/report.html) with the stylesheet, uPlot (vendored, MIT) and the
page's script inlined, and the profile's digest (page_data.py) as JSON in a
`<script type="application/json">` element. Model, module, op and file names come from user code,
so the JSON is escaped for that element (`<`, `>` and `&` as \\u003c etc.: no `</script>` can
close it early) and the page's script only ever puts data into the DOM as text.
"""

from __future__ import annotations

import html
import json
import re
from importlib.resources import files

from .page_data import page_data

__all__ = ["write_html", "render_html"]

_ASSETS = files(__package__) / "assets"
_SLOT = re.compile(r"<!--tapescope:(\w+)-->")
_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
                 "\u2028": "\\u2028", "\u2029": "\\u2029"}


def write_html(profile, path, *, max_points: int = 4000) -> None:
    """Write the report of `profile` to `path` (one file; it opens offline in any browser).

    max_points: most points of the memory chart; longer steps are downsampled keeping each
    bucket's lowest and highest sample and the peak exactly.
    """
    from .files import write_text

    write_text(path, render_html(profile, max_points=max_points))


def render_html(profile, *, max_points: int = 4000) -> str:
    data = page_data(profile, max_points=max_points)
    slots = {
        "title": html.escape(f"tapescope · {profile.model}"),
        "css": _asset("uPlot.min.css") + "\n" + _asset("report.css"),
        "data": _script_json(data),
        "js": _inline_script(_asset("uPlot.iife.min.js")) + "\n" + _inline_script(_asset("report.js")),
    }
    # one pass: text put into a slot is never searched for slots again
    return _SLOT.sub(lambda m: slots[m.group(1)], _asset("report.html"))


def _asset(name: str) -> str:
    return (_ASSETS / name).read_text(encoding="utf-8")


def _script_json(data) -> str:
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return re.sub("[<>&\u2028\u2029]", lambda m: _JSON_ESCAPES[m.group(0)], text)


def _inline_script(js: str) -> str:
    # "</script" would end the element mid-code; inside JS strings and regexes "<\/" means "</"
    return re.sub(r"</(script)", r"<\\/\1", js, flags=re.IGNORECASE)
