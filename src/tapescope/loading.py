"""Loading the user's code by name: `path/to/file.py:fn` and `package.module:fn`.

A file is imported the way Python would import it from its own folder, so that a multi-file
project works as it does when run directly:
- the folder is put on `sys.path` (as `python file.py` does), so sibling imports resolve;
- a file inside a package (folders with `__init__.py`) is imported as `package.module`, from the
  package's parent folder, so its relative imports resolve;
- the module is registered in `sys.modules` under that name before it runs, as `import` does:
  `@dataclass` looks the module up there (it must, under `from __future__ import annotations`),
  and pickle finds classes by module name.
A name already imported from another file is not replaced: that file is then loaded under a
private name (sibling imports and dataclasses still work; pickling its classes by name does not).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from .errors import SpecError

__all__ = ["load_function", "import_file"]


def load_function(text: str, what: str = "function"):
    """The callable named by `file.py:name` or `package.module:name` (dots reach attributes:
    `module:Class.method`)."""
    target, sep, attr = text.rpartition(":")
    if not sep or not target or not attr:
        raise SpecError(f"cannot read {what} {text!r}: write path/to/file.py:name or "
                        "package.module:name")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = import_file(target)
    else:
        try:
            module = importlib.import_module(target)
        except SystemExit as e:
            raise SpecError(_exited(target, e)) from None
        except Exception as e:  # noqa: BLE001 - the user's module failed to import
            raise SpecError(f"importing {target} for {what} {text!r} failed: "
                            f"{type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise SpecError(f"{target} has no {attr!r} (for {what} {text!r})")
    if not callable(obj):
        raise SpecError(f"{target}:{attr} is a {type(obj).__name__}, not a function")
    return obj


def import_file(path: str):
    """Import a Python file as its folder's code would import it (see the module docstring)."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise SpecError(f"no such file: {path}")
    if not path.endswith(".py"):
        raise SpecError(f"{path} is not a Python file (.py)")
    root, name = _module_name(path)
    if root not in sys.path:
        sys.path.insert(0, root)
    known = sys.modules.get(name)
    if known is not None and os.path.abspath(getattr(known, "__file__", "") or "") == path:
        return known
    if known is not None or _shadows_installed(name, root):
        # another module owns the name: load this file privately, under its own folder's path
        name = "tapescope_user." + name.replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(name, None)
        if isinstance(e, KeyboardInterrupt):
            raise
        if isinstance(e, SystemExit):
            raise SpecError(_exited(path, e)) from None
        raise SpecError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    return module


def _exited(what: str, e: SystemExit) -> str:
    """A module that ends the process when imported (a script's sys.exit() at module level)."""
    return (f"importing {what} called sys.exit({'' if e.code is None else repr(e.code)}); a file "
            "tapescope imports must not exit on import: put the script's own code under "
            "`if __name__ == \"__main__\":`")


def _module_name(path: str) -> tuple[str, str]:
    """(folder to put on sys.path, dotted module name) for a file, climbing out of packages."""
    folder, file = os.path.split(path)
    parts = [file[:-3]]
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder, pkg = os.path.split(folder)
        parts.insert(0, pkg)
    if parts[-1] == "__init__":
        parts.pop()
    return folder, ".".join(parts)


def _shadows_installed(name: str, root: str) -> bool:
    """True if the top-level name belongs to another module than the user's folder's (a file called
    torch.py or typing.py must not take torch's or typing's place)."""
    top = name.split(".", 1)[0]
    if top in sys.builtin_module_names or top in getattr(sys, "stdlib_module_names", ()):
        return True
    known = sys.modules.get(top)
    if known is None:
        return False
    ours = (os.path.join(root, top), os.path.join(root, top + ".py"))
    where = [os.path.abspath(p) for p in getattr(known, "__path__", ()) or ()]
    where.append(os.path.abspath(getattr(known, "__file__", "") or ""))
    return not any(w in ours or w == os.path.join(ours[0], "__init__.py") for w in where)
