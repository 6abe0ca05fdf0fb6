"""Each option is declared once (tapescope/option_table.py): `tapescope.profile`'s keywords,
`Options.create`'s, the `Options` fields and the `tapescope profile` flags agree with it.

Truth: the declaration table, and what Python and click say the functions and the command take
(inspect.signature, the click command typer builds) - never a second list written here.
"""

from __future__ import annotations

import inspect
import typing

import typer

import tapescope
from tapescope.cli import app
from tapescope.option_table import OPTION, OPTIONS, WORKLOAD_KEYWORDS
from tapescope.options import Options, Workload

# `tapescope profile`'s flags that are no option of the step: the model and its inputs (the
# Workload), and what to write where
_NOT_OPTIONS = {"spec", "--batch", "--seq", "--input", "--json", "--graph", "--html", "--png",
                "--top", "--quiet"}


def _keywords(fn) -> dict:
    return {n: p for n, p in inspect.signature(fn).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _check_signature(fn, extra=()):
    params = _keywords(fn)
    assert set(params) - set(extra) == set(OPTION), \
        f"{fn.__qualname__} takes {sorted(set(params) - set(extra) ^ set(OPTION))} " \
        "differently from option_table.OPTIONS"
    for o in OPTIONS:
        p = params[o.name]
        assert p.default == o.default, (fn.__qualname__, o.name, p.default, o.default)
        assert p.annotation == o.annotation, (fn.__qualname__, o.name, p.annotation)


def test_profile_signature_is_the_declaration():
    _check_signature(tapescope.profile, extra=WORKLOAD_KEYWORDS)
    assert list(inspect.signature(tapescope.profile).parameters)[:2] == ["model", "inputs"]


def test_options_create_signature_is_the_declaration():
    _check_signature(Options.create)


def test_profile_docstring_describes_every_option():
    doc = inspect.getdoc(tapescope.profile)
    for o in OPTIONS:
        assert f"\n{o.name}: " in doc, o.name
    for k in WORKLOAD_KEYWORDS:
        assert k in doc, k


def test_options_fields_are_the_declared_fields_and_typed():
    fields = Options.__dataclass_fields__
    assert set(fields) == {o.field_name for o in OPTIONS if o.field_name}
    # every annotation names its type (resolvable: no Any left where a type exists)
    hints = typing.get_type_hints(Options, localns=_option_value_types())
    for name, hint in hints.items():
        assert hint is not typing.Any and "Any" not in str(hint), (name, hint)
    workload = typing.get_type_hints(Workload)
    assert all(h is not typing.Any and "Any" not in str(h) for h in workload.values()), workload


def _option_value_types() -> dict:
    from tapescope.devices.calibration import Calibration
    from tapescope.devices.cpu import CpuTarget
    from tapescope.devices.gpus import GPU
    from tapescope.values.allocator import AllocatorConfig
    from tapescope.values.checkpointing import UnitPolicy
    from tapescope.values.mesh import MeshSpec
    from tapescope.values.pipeline import PipelineSpec
    from tapescope.values.sizes import Sizes

    return {t.__name__: t for t in (Calibration, CpuTarget, GPU, AllocatorConfig, UnitPolicy,
                                    MeshSpec, PipelineSpec, Sizes)}


def _profile_command():
    return typer.main.get_command(app).commands["profile"]


def test_cli_flags_are_the_declared_flags():
    params = _profile_command().params
    flags = {f for p in params for f in p.opts}
    declared = {f for o in OPTIONS for f in o.flags}
    assert declared <= flags, f"declared flags profile lacks: {sorted(declared - flags)}"
    # every flag of `tapescope profile` sets an option or is one of the workload/output flags
    for p in params:
        assert set(p.opts) & (declared | _NOT_OPTIONS), \
            f"--{p.name} of tapescope profile is declared nowhere: add it to option_table.py"


def test_cli_one_flag_options_take_the_declared_default_and_help():
    by_flags = {tuple(p.opts): p for p in _profile_command().params}
    for o in OPTIONS:
        if o.help is None:
            continue
        p = by_flags[o.flags]  # the flag and its aliases, as declared
        assert p.help == o.help, o.name
        assert p.default == o.default, (o.name, p.default, o.default)
