"""No function in analysis/ or distributed/ is over 80 lines: orchestration is split into named
phases (issue 37). Counted from its `def` line to its last line, docstring and comments
included, nested functions inside their parent (and on their own).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tapescope"
FOLDERS = ("analysis", "distributed")
LIMIT = 80


def long_functions(folder: Path, limit: int = LIMIT) -> list[str]:
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - first + 1
                if lines > limit:
                    out.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name}: "
                               f"{lines} lines")
    return out


def test_no_function_over_80_lines_in_analysis_and_distributed():
    found = [f for folder in FOLDERS for f in long_functions(SRC / folder)]
    assert not found, f"split into named phases (at most {LIMIT} lines each):\n" + \
        "\n".join(found)
