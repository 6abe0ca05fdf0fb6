"""Plain records of a traced training step.

Capture writes these and nothing else; every analysis (FLOPs, bytes, memory, graph) is a pure
function of them. They hold shapes, dtypes and storage ids, never tensors: a trace of a 70B-parameter
model stays small, and keeping no tensor alive means the recorder cannot change when memory is freed.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch

__all__ = [
    "op_name",
    "slot_init",
    "FORWARD",
    "BACKWARD",
    "OPTIMIZER",
    "PHASES",
    "OTHER",
    "BUILDS_GRAPH",
    "ZERO_GRAD",
    "TensorRef",
    "Frame",
    "OpRecord",
    "StorageRecord",
    "Segment",
    "GuardRecord",
    "KernelLaunch",
    "Trace",
    "RunFacts",
    "LOSS_MODULE",
    "INTERNAL_GUARD",
    "SETUP",
    "CATEGORIES",
    "ALL_CATEGORIES",
    "DISTRIBUTED_CATEGORIES",
    "FIRST_STEP_ONLY",
]

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
PHASES = (FORWARD, BACKWARD, OPTIMIZER)
# a user's own step (capture/program.py): its ops outside the model's forward, the backward and
# an optimizer's step (computing the loss, clipping gradients, an EMA of the weights)
OTHER = "other"
# phases whose ops may record autograd nodes: each op gets the sequence number, module and line
# (a user's step computes its loss in its own code, phase OTHER)
BUILDS_GRAPH = (FORWARD, OTHER)
# the label of the optimizer-phase segment that ends a step: the gradient reset, and the loss's end
ZERO_GRAD = "zero_grad"
# the label of an OTHER segment of step 1 that later steps do not run (a pipeline schedule's
# initialisation of its stages: their receive buffers): a step 2 built from step 1 leaves it out
FIRST_STEP_ONLY = "first_step_only"
SETUP = "setup"  # step 0: work done on the model before the first step (parallelising it)
LOSS_MODULE = "(loss)"  # the module name of ops computing the loss outside the model
INTERNAL_GUARD = "<tapescope>"  # where a guard tapescope's own code placed comes from

# Roles a storage can play, in the order that decides a storage's memory category when it plays
# several (a parameter saved for backward is a parameter).
PARAMETER, BUFFER, INPUT, GRADIENT, OPTIMIZER_STATE = (
    "parameters", "buffers", "inputs", "gradients", "optimizer state")
SAVED, TEMPORARY = "saved activations", "temporaries"
# scratch a real kernel allocates and frees inside one op (capture/fidelity: WORKSPACE rules)
WORKSPACE = "kernel workspace"
CATEGORIES = (PARAMETER, BUFFER, GRADIENT, OPTIMIZER_STATE, INPUT, SAVED, TEMPORARY, WORKSPACE)
# Roles only a distributed step has (capture/distributed_roles.py): the shard of a parameter a rank
# keeps, the full parameter it gathers for compute, and the flat buffers collectives use.
SHARDED_PARAMETER, UNSHARDED_PARAMETER = "sharded parameters", "unsharded parameters"
ALL_GATHER_BUFFER, REDUCE_SCATTER_BUFFER = "all-gather buffers", "reduce-scatter buffers"
COMM_STAGING = "communication staging"
DISTRIBUTED_CATEGORIES = (SHARDED_PARAMETER, UNSHARDED_PARAMETER, ALL_GATHER_BUFFER,
                          REDUCE_SCATTER_BUFFER, COMM_STAGING)
# Which role decides a storage's category when it plays several; the first wins
ROLE_ORDER = (PARAMETER, SHARDED_PARAMETER, BUFFER, GRADIENT, OPTIMIZER_STATE, INPUT, WORKSPACE,
              UNSHARDED_PARAMETER, ALL_GATHER_BUFFER, REDUCE_SCATTER_BUFFER, COMM_STAGING)
# Every category in report order; a report lists the core CATEGORIES and the others it has
ALL_CATEGORIES = (PARAMETER, SHARDED_PARAMETER, UNSHARDED_PARAMETER, BUFFER, GRADIENT,
                  OPTIMIZER_STATE, INPUT, ALL_GATHER_BUFFER, REDUCE_SCATTER_BUFFER, COMM_STAGING,
                  SAVED, TEMPORARY, WORKSPACE)


def slot_init(cls):
    """A frozen slots dataclass with an `__init__` that sets each field through its slot's
    descriptor. The one dataclass writes calls `object.__setattr__` per field (a frozen class
    refuses plain assignment), ~0.15 us a field: a 17-field `Op` took 2.6 us, this 1.3 us, and a
    profile makes one per op of its step and a TensorRef per output. Same signature, defaults and
    order; the instance is as frozen, equal and hashable as before."""
    params, body, names = [], [], {}
    for f in fields(cls):
        if not f.init or f.default_factory is not MISSING:
            raise TypeError(f"slot_init: {cls.__name__}.{f.name} is not a plain init field")
        names[f"_set_{f.name}"] = cls.__dict__[f.name].__set__  # the slot's member descriptor
        if f.default is MISSING:
            params.append(f.name)
        else:
            names[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        body.append(f"        _set_{f.name}(self, {f.name})")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"slot_init: {cls.__name__} has a __post_init__")
    source = (f"def make({', '.join(names)}):\n    def __init__(self, {', '.join(params)}):\n"
              + "\n".join(body) + "\n    return __init__\n")
    scope: dict = {}
    exec(source, scope)  # as dataclasses builds its own __init__
    init = scope["make"](**names)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init
    return cls


@slot_init
@dataclass(frozen=True, slots=True)
class TensorRef:
    """One tensor as an op saw it.

    `value` names the tensor's version in the dataflow graph: every op output gets a new value, an
    in-place op gives its mutated argument a new one. `storage` is the id of the memory it lives in
    (views and in-place results share their base's storage).
    """

    shape: tuple
    dtype: torch.dtype
    storage: int
    value: int

    @property
    def numel(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self):
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Frame:
    """The user source line that issued an op."""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}"


@dataclass(slots=True)
class OpRecord:
    """One aten op as it ran.

    `seq_nr` follows AOTAutograd's convention: a forward op carries the sequence number of the last
    autograd node created when it ran, a backward op the sequence number of the node running it, so
    a backward op and the forward op that recorded its node share a number. `grad_fn` is the name of
    that node; `owns_node` marks the forward op during which the node was created. `recompute`
    marks a forward op run again during backward (activation checkpointing); its phase is
    BACKWARD (when it runs) and its seq_nr, module and frame are a forward op's. `stream` is the
    stream it was issued on (analysis.timing runs each stream's ops in their own queue), `waits`
    the ops of other streams it was ordered after.
    """

    index: int
    func: Any  # an OpOverload (torch_compat.OpOverload)
    phase: str
    step: int
    args: tuple
    kwargs: dict
    outputs: tuple  # TensorRef, or None where the op returned no tensor in that position
    inputs: tuple = ()  # the TensorRefs among args and kwargs, in order (lists flattened)
    module: str | None = None
    seq_nr: int | None = None
    owns_node: bool = False
    grad_fn: str | None = None
    frame: Frame | None = None
    recompute: bool = False
    # the CUDA stream the op was issued on, by creation order (0: the default stream); only a
    # distributed CUDA profile's stand-in streams tell them apart (FSDP2's copy-in, all-gather
    # and reduce-scatter streams)
    stream: int = 0
    # indices of the ops this op's stream was made to wait for since its previous op (events
    # recorded after them: FSDP2's copy-out events, `wait_stream`); analysis.timing starts the
    # op no earlier than they end
    waits: tuple = ()

    @property
    def name(self) -> str:
        return op_name(self.func)

    def tensor_inputs(self) -> tuple:
        return self.inputs

    def tensor_outputs(self) -> tuple:
        outputs = self.outputs
        for o in outputs:  # most ops return only tensors: their outputs as they are
            if o is None:
                return tuple(o for o in outputs if o is not None)
        return outputs


_NAMES: dict = {}


def op_name(func) -> str:
    """'aten.mm.default' (cached: str() of an OpOverload is not free)."""
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name


@dataclass(slots=True)
class StorageRecord:
    """A block of memory: created by op `created_by` (None: existed before the trace), or, where
    `resized_by` is set, re-allocated by `UntypedStorage.resize_` after op `created_by`."""

    id: int
    nbytes: int
    device: torch.device
    created_by: int | None
    roles: set = field(default_factory=set)
    # the CUDA stream it was allocated on, where that is not `created_by`'s: a storage re-allocated
    # by `UntypedStorage.resize_` between ops (FSDP2's copy-out re-allocates its all-gather outputs
    # on the compute stream, after the all-gather recorded last on its own stream); None: the
    # creating op's stream
    stream: int | None = None
    # the line that called `UntypedStorage.resize_` on it, which dispatches no op (FSDP2's
    # `alloc_storage` re-allocating an unsharded parameter): `created_by` is then only the last
    # op recorded before (another stream's all-gather or another block's reduce-scatter), not
    # what made it (analysis.reallocations names it for a user); None: made by an op
    resized_by: Frame | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous run of the trace: one phase of one step.

    `label` tells apart the optimizer's step ("optimizer") from the gradient reset that ends a step
    ("zero_grad"). `ops` and `events` are half-open ranges into Trace.ops and Trace.events.
    """

    step: int
    phase: str
    label: str
    ops: range
    events: range


@dataclass(frozen=True, slots=True)
class GuardRecord:
    """A guard the symbolic trace placed on the named dimensions: `expr` a sympy boolean in the
    trace's symbols, `where` the source line that asked, `internal` when tapescope's own
    bookkeeping asked (structural, not a limit of the model)."""

    expr: Any
    where: str
    internal: bool = False


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """One kernel a compiled graph's generated wrapper launched (never run: capture/compiled.py),
    with inductor's own estimate of its work (the kernel's `inductor_meta`)."""

    op: int                  # launched after the ops before this trace index (len(ops) then)
    call: int                # the run of compiled code it is part of (Trace.compiled_calls index)
    name: str                # the generated kernel ("triton_poi_fused_add_0")
    stream: int              # the raw stream the wrapper launched it on (0: the current stream)
    num_bytes: int | None    # inductor's `kernel_num_gb` x 1e9: what its arguments load and store
    flops: int | None        # inductor's `kernel_flop`
    dtype: torch.dtype       # its first tensor argument's
    args: tuple = ()         # storage ids of its tensor arguments
    writes: tuple = ()       # storage ids of those it stores to (out_ptr*, in_out_ptr*, mutated)


@dataclass
class Trace:
    """Everything capture recorded.

    events: the order in which storages came to life and died: `(op_index, storage_id, +1 | -1)`.
    A free is tagged with the last op recorded before it.
    """

    ops: list = field(default_factory=list)
    storages: list = field(default_factory=list)
    events: list = field(default_factory=list)
    segments: list = field(default_factory=list)
    # value id -> name of a tensor the step did not produce (parameter, buffer, input ...)
    external_values: dict = field(default_factory=dict)
    # value ids that autograd saved for backward
    saved_values: set = field(default_factory=set)
    # storage id -> fully qualified name of the parameter it holds (or its gradient/state)
    storage_owner: dict = field(default_factory=dict)
    # forward autograd node seq_nr -> node name (e.g. "MmBackward0")
    node_names: dict = field(default_factory=dict)
    # autograd's sequence counter when the capture began: records keep the counter's values (the
    # engine and the nodes speak them); the op table shows seq_nr - seq_base, so that the same
    # step gives the same numbers whatever the process ran before
    seq_base: int = 0
    device: torch.device = torch.device("cpu")
    # how steady-state step 2 was obtained: "traced" or "reused forward+backward of step 1"
    step2: str = "none"
    # symbolic profiles: dimension name -> sympy symbol, and the sizes the trace ran at; the
    # guards the trace placed, the symbols it replaced (name -> sympy expr: a pinned dimension is
    # an Integer), and name -> (low, high) ranges where the trace holds (None: unbounded)
    symbols: dict = field(default_factory=dict)
    hints: dict = field(default_factory=dict)
    guards: list = field(default_factory=list)
    replacements: dict = field(default_factory=dict)
    ranges: dict = field(default_factory=dict)
    # compiled steps: (graph label, first op, end op) for each run of a compiled graph's code
    compiled_calls: list = field(default_factory=list)
    # compiled steps: every kernel the generated wrappers launched, in order (KernelLaunch)
    kernel_launches: list = field(default_factory=list)
    # gradient accumulation: (first op, end op, runs) where the ops of one traced micro-batch stand
    # for `runs` micro-batches, the later ones proven to repeat it (capture/session.py)
    repeated: list = field(default_factory=list)
    # storage id -> the storage it stands for: one per untraced micro-batch of what a repeated
    # block leaves alive past its region (capture/repeats.py); its category is that storage's
    stand_ins: dict = field(default_factory=dict)
    # data-dependent sizes (capture/data_values.py): each unbacked symbol -> the name it is
    # reported under (one name per source line, op and value; also in `symbols` and `hints`),
    # the sizes with their assumed values (DataSize), the assumptions that decided them
    unbacked: dict = field(default_factory=dict)
    data_sizes: list = field(default_factory=list)
    assumptions: list = field(default_factory=list)


@dataclass(frozen=True)
class RunFacts:
    """What a capture learned about the run besides the Trace's records: the model's size, the
    optimizer and loss it stepped, the kernel choices and estimates the report names, and the
    notes it owes the user. Built once, at the end of `CaptureSession.run`; `Profile.facts` is a
    read-only dict view of it (its keys are this record's fields, each present where the run had
    it, as `RunFacts.as_dict` says)."""

    parameters: int                       # elements of the model's parameters (as the step holds them)
    param_dtype: str | None               # the floating-point dtype most parameter elements have
    optimizer: dict | None                # {"name", "implementation": fused | foreach | for-loop}
    amp: str | None                       # the autocast dtype of forward and loss ("bfloat16")
    # what fidelity rules could only estimate (kernel workspaces of heuristic kernel choices):
    # topic -> the texts of its estimates
    heuristics: dict = field(default_factory=dict)
    loss: str | None = None               # the loss the step used, as the report names it
    step: dict | None = None              # a user's step: {"fn", "setup", "optimizers": n}
    isolation_notes: tuple | None = None  # what the model's private copy could not isolate
    sizes_unused: tuple | None = None     # Sizes entries no data-dependent size used
    gpu: str | None = None                # the GPU whose kernels were followed (its catalogue key)
    sdpa_backends: dict | None = None     # CUDA: attention backend -> calls that chose it
    cpu: dict | None = None               # CPU: {"isa", "threads", "detected"} kernels were sized for
    checkpointing: tuple | None = None    # the checkpointing plan applied (UnitPolicy.to_dict each)
    accumulate: int | None = None         # micro-batches per optimizer step (when more than 1)
    accumulate_traced: int | None = None  # of those, how many were traced before they repeated
    # what compiling the step produced (capture.compiled.CompileRecord; analysis/compiled.py
    # reads it), None for an eager step
    compiled: object = field(default=None, repr=False)
    # a program whose step 2 may be built from step 1 (a pipelined step) and was traced: why the
    # proof did not hold (capture/first_step.py)
    step2_not_reused: str | None = None

    # keys `as_dict` always writes; the others only when the run had them (None: not this run's)
    _ALWAYS = ("optimizer", "amp", "heuristics", "parameters", "param_dtype")

    def as_dict(self) -> dict:
        """The plain-data facts by name, as `Profile.facts` and --json show them (the compile
        record is not data: `Profile.compiled` is its report)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "compiled" or (value is None and f.name not in self._ALWAYS):
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out
