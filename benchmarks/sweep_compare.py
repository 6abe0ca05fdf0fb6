"""Two runs of benchmarks/sweep.py side by side (this ISA and the ISA capped at AVX2): the
allocator's peaks in bytes, tapescope's difference from them, and sweep.py's verdicts, row by row.

    python benchmarks/sweep_compare.py avx512.jsonl avx2.jsonl

Bytes, not percentages: with every row within 0.1% the percentages all print as 0.000%, and what
is left to read is how many bytes, and where (the counts go to stderr).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep import verdict  # noqa: E402


def load(path: str) -> dict:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {(r["name"], json.dumps(r.get("options"), sort_keys=True)): r for r in rows}


def _cells(r: dict | None) -> list[str]:
    if r is None:
        return ["not run", ""]
    if "predicted" not in r:
        return ["-", "-"]
    real = " / ".join(f"{m:,}" for m in r["measured"])
    gap = " / ".join(f"{p - m:+,}" for p, m in zip(r["predicted"], r["measured"]))
    return [real, gap]


def _verdicts(a: dict | None, b: dict | None) -> str:
    texts = [verdict(r).replace("|", "/") if r else "not run" for r in (a, b)]
    return texts[0] if texts[0] == texts[1] else f"AVX-512: {texts[0]}; AVX2: {texts[1]}"


def counts(rows: dict) -> dict:
    c = collections.Counter(rows=len(rows))
    for r in rows.values():
        v = verdict(r)
        c["within 0.1%"] += v.startswith("exact to") or v == "within 0.1%"
        c["exact to 16 B"] += v.startswith("exact to")
        if v.startswith("exact to"):
            c[v] += 1
        c["ops identical"] += bool(r.get("ops_identical"))
        c["crashed or refused"] += "crash" in r or "error" in r
    return dict(c)


def table(a: dict, b: dict) -> str:
    lines = ["| family | model | batch x size | AVX-512: real peak, first / steady (B) | predicted - real "
             "| AVX2 (capped): real peak | predicted - real | ops | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in list(a) + [k for k in b if k not in a]:
        r = a.get(key) or b[key]
        ops = {x.get("ops_identical") for x in (a.get(key), b.get(key)) if x and "predicted" in x}
        ops_text = ("identical" if ops == {True} else
                    "differs: " + " ".join((r.get("ops_diff") or [])[:2]) if ops else "-")
        lines.append(f"| {r['family']} | {r['name']} | {r['shape']} | "
                     + " | ".join(_cells(a.get(key)) + _cells(b.get(key))) + f" | {ops_text} | "
                     + _verdicts(a.get(key), b.get(key)) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("first", help="sweep.py results on this host's ISA")
    ap.add_argument("second", help="the same rows with the ISA capped at AVX2")
    a = ap.parse_args()
    first, second = load(a.first), load(a.second)
    print(table(first, second))
    for label, rows in (("first", first), ("second", second)):
        print(label, counts(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
