"""The registry of fidelity rules: what a real kernel or branch does that a fake one would not.

tapescope traces a step on FakeTensors, and a FakeTensor is a tensor subclass. In a few places
PyTorch's C++ takes another branch for subclasses ("composite compliance"), a meta kernel gives
its output other strides than the real kernel, or a device's real kernel picks an implementation
that a machine without that device cannot ask for. Each such difference, where it changes the op
sequence or the memory, is one `Rule` here: what it applies to, on which devices, what it does,
the PyTorch source it follows and the test that checks it against real execution.

A rule acts at one stage:
- FUNCTION: a torch function (seen by `FunctionRulesMode`, a TorchFunctionMode, above the
  dispatcher, whatever name the model imported it under) runs as `handler(ctx, func, args, kwargs)`
  instead: `aten::linear`'s plain-tensor bias add, the SDPA backend a named GPU would choose.
- FORWARD_OP / BACKWARD_OP: an aten op about to run is rewritten,
  `handler(ctx, func, args, kwargs) -> (func, args, kwargs) | None` (None: not this time);
  a backward rule also gets the autograd node that runs (`ctx.node`).
- OUTPUT: an aten op's fresh output is replaced by one with the real kernel's layout,
  `handler(ctx, func, args, out) -> out`.
- CHECK: what the real kernel refuses and the fake (meta) kernel lets through, such as a float64
  input into a float32 matmul: `handler(ctx, func, args, kwargs) -> None`, raising the real
  kernel's error with its message. Runs before the op, forward and backward; a step PyTorch
  would refuse is refused, never profiled.
- KERNEL: the fake kernel of an op whose own fake kernel refuses inputs the real kernel of the
  device runs (`_grouped_mm` in fp32): `handler(ctx, *args, **kwargs) -> outputs`, which the
  capture's Tape runs in place of FakeTensorMode's kernel (fake_kernels.py says why not through
  torch.library).
- WORKSPACE: scratch memory the real kernel allocates and frees inside the op (a reorder into a
  blocked layout, a GEMM fallback's per-thread buffers, a contiguous copy of an operand), which a
  fake kernel never allocates: `handler(ctx, func, args, kwargs, out) -> bytes | [bytes, ...] |
  [Alloc | Free | Output, ...] | None`. The tape records each buffer as a storage of the category
  "kernel workspace", freed before the next op, so the timeline's level inside the op includes it.
  Plain byte counts are allocated after the op's outputs and live until the op ends. Where the
  kernel's order matters for the peak (a oneDNN convolution reorders its operands into blocked
  copies, frees them, and only then allocates its output), the handler returns the kernel's
  sequence: `Alloc(name, nbytes)`, `Free(name)` and `Output(i)` (the op's i-th output is allocated
  here; outputs a sequence does not place come first). Buffers not freed explicitly are freed,
  last allocated first, when the op ends.
Rules registered for `ANY_OP` see every op of their stage; keep their test for relevance cheap.

The registry is filled when the rule modules are imported and never changes afterwards; each
capture builds its own `FidelityContext` (the per-trace state rules read and write), so two
profiles in one process cannot influence each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from ...errors import passes_user_calls

__all__ = ["Rule", "RULES", "Rules", "RuleSet", "FidelityContext", "FunctionRulesMode", "FUNCTION",
           "FORWARD_OP", "BACKWARD_OP", "OUTPUT", "WORKSPACE", "CHECK", "KERNEL", "STAGES", "ANY_OP",
           "Alloc", "Free", "Output", "LibraryOp"]

FUNCTION, FORWARD_OP, BACKWARD_OP, OUTPUT = "function", "forward op", "backward op", "output"
WORKSPACE, CHECK = "workspace", "check"
KERNEL = "fake kernel"
STAGES = (FUNCTION, FORWARD_OP, BACKWARD_OP, OUTPUT, WORKSPACE, CHECK, KERNEL)
ANY_OP = "any op"


@dataclass(frozen=True)
class Rule:
    name: str
    stage: str
    targets: tuple                  # OpOverloads or functions, or (ANY_OP,)
    handler: Callable
    devices: frozenset | None       # device types the rule applies on; None: every device
    source: str                     # the PyTorch source it follows
    test: str                       # the test that checks it against real execution
    doc: str = ""

    def applies_on(self, device_type: str) -> bool:
        return self.devices is None or device_type in self.devices


@dataclass(frozen=True)
class LibraryOp:
    """A target named by its qualified name ("bitsandbytes::optimizer_update_8bit_blockwise"): an
    op a library registers when it is imported. Resolved when a capture's RuleSet is built, so
    tapescope never imports the library itself; a library not imported has no such op, and the
    rule no target."""

    qualname: str

    def resolve(self) -> list:
        namespace, name = self.qualname.split("::")
        if not hasattr(getattr(torch.ops, namespace), name):
            return []
        packet = getattr(getattr(torch.ops, namespace), name)
        return [packet] + [getattr(packet, o) for o in packet.overloads()]


@dataclass(frozen=True, slots=True)
class Alloc:
    """A WORKSPACE step: the kernel allocates a scratch buffer (`name` is how a Free names it)."""

    name: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Free:
    """A WORKSPACE step: the kernel frees the scratch buffer `name`."""

    name: str


@dataclass(frozen=True, slots=True)
class Output:
    """A WORKSPACE step: the op's output number `index` (its position in what the op returns) is
    allocated here."""

    index: int = 0


_STEPS = (Alloc, Free, Output)


@dataclass
class FidelityContext:
    """Per-capture state the rules share: the traced device and GPU, the torch functions running
    now (innermost last), and what the rules counted."""

    device: torch.device
    gpu: Any = None
    cpu: Any = None                     # devices.cpu.CpuTarget: the ISA and threads kernels see
    views: Any = None                   # capture.view_replay.ViewRegeneration of this capture
    values: Any = None                  # capture.data_values.DataValues, when sizes depend on data
    node: Any = None                    # the autograd node running (backward), else None
    where: Any = None                   # () -> the user's Frame of the op a WORKSPACE rule sees
    running: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)   # e.g. "sdpa:flash" -> calls
    functions: dict = field(default_factory=dict)  # function -> its FUNCTION rule's handler
    cache: dict = field(default_factory=dict)      # what a rule builds once per capture
    notes: dict = field(default_factory=dict)      # topic -> what a rule could only estimate
    # memory a rule records outside any op: Tape.bytes_outside_ops(nbytes, device) -> a token
    # whose release frees it, and SavedTensors.keep_with_node(node, token), which keeps it
    # while that autograd node lives and releases it when the node runs
    bytes_outside_ops: Any = None
    keep_with_node: Any = None

    def inside(self, func) -> bool:
        return func in self.running

    def innermost(self, candidates):
        """The innermost running function among `candidates`, or None."""
        for f in reversed(self.running):
            if f in candidates:
                return f
        return None

    @passes_user_calls
    def call(self, func, args, kwargs):
        """Run `func` as its FUNCTION rule says (plainly if it has none)."""
        try:
            handler = self.functions.get(func)
        except TypeError:  # an unhashable callable: no rule can name it
            handler = None
        if handler is None:
            return func(*args, **kwargs)
        self.running.append(func)
        try:
            return handler(self, func, args, kwargs)
        finally:
            self.running.pop()

    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def note(self, topic: str, text: str) -> None:
        """Record that a rule is a heuristic here (the report lists each note once per topic
        and text)."""
        texts = self.notes.setdefault(topic, [])
        if text not in texts:
            texts.append(text)


class Rules:
    """All rules, by stage; `register` is the decorator the rule modules use."""

    def __init__(self):
        self.all: list[Rule] = []

    def register(self, stage: str, *targets, devices=None, source: str, test: str,
                 name: str | None = None):
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}")
        if not targets:
            raise ValueError("a rule needs at least one target (or ANY_OP)")
        if ANY_OP in targets and stage not in (FORWARD_OP, BACKWARD_OP):
            raise ValueError(f"ANY_OP is for op rewrites; a {stage} rule names its ops")

        def decorate(handler):
            if stage == FUNCTION:  # it runs the user's call of a torch function, the real way
                passes_user_calls(handler)
            self.all.append(Rule(name or handler.__name__, stage, tuple(targets), handler,
                                 None if devices is None else frozenset(devices), source, test,
                                 (handler.__doc__ or "").strip()))
            return handler

        return decorate

    def for_device(self, device_type: str) -> "RuleSet":
        return RuleSet([r for r in self.all if r.applies_on(device_type)])


RULES = Rules()


class RuleSet:
    """The rules of one device, indexed for the dispatch path (a dict lookup per op)."""

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self.by_stage: dict[str, dict] = {s: {} for s in STAGES}
        self.any_op: dict[str, list] = {s: [] for s in STAGES}
        for r in rules:
            targets = [x for t in r.targets
                       for x in (t.resolve() if isinstance(t, LibraryOp) else (t,))]
            for t in targets:
                if t is ANY_OP:
                    self.any_op[r.stage].append(r.handler)
                else:
                    self.by_stage[r.stage].setdefault(t, []).append(r.handler)
        self.functions = {f: hs[0] for f, hs in self.by_stage[FUNCTION].items()}
        # what the tape checks inline for each op before calling into the rules
        self.forward_targets = frozenset(self.by_stage[FORWARD_OP])
        self.backward_targets = frozenset(self.by_stage[BACKWARD_OP])
        self.output_targets = frozenset(self.by_stage[OUTPUT])
        self.workspace_targets = frozenset(self.by_stage[WORKSPACE])
        self.check_targets = frozenset(self.by_stage[CHECK])
        self.rewrites_any_forward = bool(self.any_op[FORWARD_OP])
        self.rewrites_any_backward = bool(self.any_op[BACKWARD_OP])
        self.kernels = {op: hs[0] for op, hs in self.by_stage[KERNEL].items()}
        for stage in (FUNCTION, KERNEL):  # a function or kernel runs one way: two rules contradict
            duplicated = [f for f, hs in self.by_stage[stage].items() if len(hs) > 1]
            if duplicated:
                raise ValueError(f"two {stage} rules for {duplicated}")

    def rewrite(self, stage: str, ctx: FidelityContext, func, args, kwargs):
        """(func, args, kwargs) after the rules of `stage` (FORWARD_OP or BACKWARD_OP)."""
        handlers = self.by_stage[stage].get(func)
        extra = self.any_op[stage]
        if handlers is None and not extra:
            return func, args, kwargs
        for h in (*(handlers or ()), *extra):
            new = h(ctx, func, args, kwargs)
            if new is not None:
                func, args, kwargs = new
        return func, args, kwargs

    def output(self, ctx: FidelityContext, func, args, out):
        handlers = self.by_stage[OUTPUT].get(func)
        if handlers is not None:
            for h in handlers:
                out = h(ctx, func, args, out)
        return out

    def check(self, ctx: FidelityContext, func, args, kwargs) -> None:
        """Raise what the real kernel of `func` would raise for these arguments (CHECK rules)."""
        handlers = self.by_stage[CHECK].get(func)
        if handlers is not None:
            for h in handlers:
                h(ctx, func, args, kwargs)

    def workspace(self, ctx: FidelityContext, func, args, kwargs, out) -> list:
        """The scratch the real kernel of this op allocates inside it, as a sequence of Alloc,
        Free and Output steps (empty if none)."""
        handlers = self.by_stage[WORKSPACE].get(func)
        if handlers is None:
            return []
        steps, ordered, answered = [], 0, 0
        for h in handlers:
            got = h(ctx, func, args, kwargs, out)
            if got is None:
                continue
            answered += 1
            for n in (got if isinstance(got, (list, tuple)) else (got,)):
                if isinstance(n, _STEPS):
                    ordered += isinstance(n, Output)
                    steps.append(n)
                elif n:  # a plain byte count: after the outputs, alive until the op ends
                    steps.append(Alloc(f"#{len(steps)}", n))
        if not steps:  # the common answer (a rule that looked and found nothing to count)
            return steps
        if ordered and answered > 1:
            raise ValueError(f"{func}: a rule that places the outputs must be the op's only "
                             "WORKSPACE rule")
        empty = {s.name for s in steps if type(s) is Alloc and not s.nbytes}
        return [s for s in steps if type(s) is Output or s.name not in empty]


class FunctionRulesMode(TorchFunctionMode):
    """Applies the FUNCTION rules of a capture. A TorchFunctionMode sees `F.linear`, `torch.tensor`
    or `scaled_dot_product_attention` however the model spelt them (a pre-bound import included);
    torch pops the mode while a call runs, so a rule's own calls are not seen again."""

    def __init__(self, ctx: FidelityContext, rules: RuleSet):
        super().__init__()
        self.ctx = ctx
        self.functions = ctx.functions = rules.functions

    @passes_user_calls
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # every torch call of the step passes here: the common case (no rule) in one lookup
        try:
            handler = self.functions.get(func)
        except TypeError:  # an unhashable callable: no rule can name it
            handler = None
        if handler is None:  # (no empty dict made for the common call without keywords)
            return func(*args, **kwargs) if kwargs else func(*args)
        return self.ctx.call(func, args, kwargs or {})
