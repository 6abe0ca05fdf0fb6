"""The `--graph` file: the step's FX graph as Python code, with a header of each node's meta.

Module names, op names and file names come from user code; each goes into a comment line with
every control character escaped, so no name can end the comment and become code.
"""

from __future__ import annotations

import unicodedata

__all__ = ["graph_file_text", "one_line"]


def one_line(text) -> str:
    """`text` on one line: line breaks and other control characters as escapes (\\n, \\x1b)."""
    out = []
    for c in str(text):
        if c == "\\":
            out.append("\\\\")
        elif unicodedata.category(c)[0] == "C" or unicodedata.category(c) in ("Zl", "Zp"):
            out.append(c.encode("unicode_escape").decode("ascii"))
        else:
            out.append(c)
    return "".join(out)


def graph_file_text(p) -> str:
    gm = p.graph
    lines = [f"# tapescope: training step of {one_line(p.model)} on {one_line(p.device)}; "
             "one node per aten op",
             "# node meta: phase | seq_nr | module | FLOPs | saved-for-backward"]
    for n in gm.graph.nodes:
        if n.op == "call_function" and "phase" in n.meta:
            m = n.meta
            lines.append("#   " + one_line(f"{n.name}: {m['phase']} | {m['seq_nr']} | "
                                             f"{m['nn_module']} | {m['flops']} | "
                                             f"{'saved' if m['saved'] else ''}"))
    return "\n".join(lines) + "\n" + gm.code
