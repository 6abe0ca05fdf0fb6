"""Where torch.distributed behaves differently on fake tensors than in the real eager step.

1. DTensor and the functional collectives ask `_are_we_tracing()`, which is True whenever a
   FakeTensorMode is active (they take fake mode to mean "torch.compile is tracing"). Then DTensor
   recomputes sharding decisions for every op instead of caching them, plans redistributions
   without its cache, and waits for each collective at once instead of returning an
   AsyncCollectiveTensor that waits at first use. tapescope traces the eager step, so while a
   distributed capture runs the modules that imported `_are_we_tracing` see the eager answer
   (False). The names are patched in those modules only, and restored on exit.
2. DTensor computes an op's output metadata by running the op on global-shaped fake tensors in
   the active fake mode (ShardingPropagator._propagate_tensor_meta_non_cached). In a real run
   that mode is a private FakeTensorMode and allocates nothing; here it is the Tape, which would
   record those ops as if the step ran them. They run unrecorded.
3. DeviceMesh keeps its ranks in a small CPU int tensor and finds sub-meshes, concatenations
   (FSDP2 + TP joins its data-parallel and tensor-parallel meshes) and coordinates with tensor ops
   (`as_strided`, `== rank`, `nonzero`). In a real job those run on that real tensor; under the
   Tape they would meet a fake mode that refuses a real input, or give fake, data-less results
   (`nonzero`). So the DeviceMesh methods that compute on the rank tensor run with the fake mode
   unset (`unset_fake_temporarily`), as in a real job: this is what made FSDP2 + TP fail under
   FakeTensorMode before. A mesh the user's code builds itself arrives with its rank tensor made
   in the fake mode: `init_device_mesh` (also called by `fully_shard(model)` without a mesh, and
   by torchtitan's ParallelDims) makes `torch.arange(world, dtype=int)` under it, and a
   `DeviceMesh("cuda", torch.arange(8).view(2, 4))` gets the user's fake tensor. Such a tensor
   was made from Python data alone; its ops are on the tape, so DeviceMesh.__init__ gets the
   same tensor re-made for real from them (`_made_for_real`), and the fake one is kept alive
   with it, so the trace holds the allocation the real job's rank map is.
4. DTensor caches sharding decisions, redistribution plans and mesh topologies process-wide,
   keyed by meshes that compare equal across worlds (same layout, names and device): a decision
   cached while simulating rank 0 would be reused for rank 1016 of the same job, or by a later
   profile, with rank 0's meshes (their coordinates, their process groups) in it. Every capture
   starts and ends with those caches empty, so that no rank or profile sees another's. The
   ranks of one profile share their decisions all the same, re-bound (`SharedDecisions`): a
   decision is a function of the op and its arguments' global metadata, placements and mesh
   layout, never of the rank (no sharding strategy reads a coordinate: every process of a real
   job must decide alike, or its collectives would not pair), so rank 1016's decision is rank
   0's with rank 0's meshes in it. When DTensor's C++ fast path misses its (emptied) cache it
   asks `propagate_op_sharding_non_cached` for a fresh decision; there a later rank gets the
   earlier rank's decision for an equal op schema, each mesh in it replaced by the mesh its own
   schema has at the same place (computed afresh where a mesh has no such place, or where the
   earlier rank's arguments shared one mesh object that this rank's do not). The current rank's
   own decisions are made as without it. A 405B rank makes 102, the optimizer's foreach ops over
   1,137-element lists the dearest: 1.1-1.4 s CPU that its second rank class no longer spends.
5. Speed only, same answers: for a foreach op (the optimizer's, over every parameter) DTensor
   calls `_propagate_use_strided_shard_flag(child, op_schema)` once per list element, and each
   call walks every argument of the whole op (`op_schema.args_spec`) to find one flag: quadratic
   in the number of parameters, 10 s of a 32-layer 70B step's first optimizer step. The flag
   depends only on which values the strided-shard arguments carry, so each op's arguments are
   summarised once (one spec per distinct value) and the function runs on that summary.
   Likewise `expand_to_full_mesh_op_strategy` enumerates every combination of placements over
   the mesh for each list element (~3 ms each; DTensor's own note calls it "prohibitively
   expensive"), though the elements of an optimizer's lists repeat a handful of layouts: within a
   capture its result is kept per (mesh, per-element schema, strategies, options) and reused for
   equal elements. Both are pure functions of those arguments; the memo ends with the capture.
   Torch 2.14's single-dimension strategies expand a foreach op element by element too
   (`expanded_foreach_strategy`: each element's schema translated, its strategy prepared and
   expanded, ~0.2 ms an element; a 70B rank's two AdamW steps have 10,122 elements of 7 kinds).
   An element's strategy is a function of its own children of the op's list arguments, its
   output's metadata and the op's other arguments alone (the translation picks `children[i]`),
   so the op is expanded over one representative of each distinct element, and equal elements
   get that element's strategy (the objects are shared, as the memo above already shares them).
6. A search's worker traces candidate after candidate, and a candidate's sharding decisions are
   mostly those of the candidates of its layout before it: the optimizer's foreach ops and
   FSDP2's setup work on the parameters, the same at every micro-batch size and checkpointing
   mode, and an HSDP x TP layout's 3-D mesh makes each decision dear (DTensor expands every
   combination of placements over the mesh). Point 4's decisions are a function of the op
   schema alone, so they may outlive the profile that made them: inside
   `decisions_remembered(memory)` each profile's decisions are kept in a `DecisionMemory` when
   it ends, and a later profile's miss is answered from it, re-bound to its own meshes as a
   later rank's is (point 4). What is kept holds no mesh: each is replaced by a `_MeshValue`,
   the plain values DeviceMesh's own equality and hash compare (rank map, layout, device type,
   dimension names), so no earlier profile's meshes, process groups or trace stay alive, and a
   schema matches a kept one exactly when DTensor's own cache would call them equal.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar

import torch

from ..capture.records import TensorRef
from ..errors import TapescopeError
from ..torch_compat import patched

__all__ = ["eager_distributed", "decisions_shared_by_ranks", "SharedDecisions", "DecisionMemory",
           "decisions_remembered", "remember_decisions_in_this_process"]

def _not_tracing() -> bool:
    return False


class _ArgsSpecs:
    """What `_propagate_use_strided_shard_flag` reads of an OpSchema: its argument specs."""

    __slots__ = ("args_spec",)

    def __init__(self, specs):
        self.args_spec = specs


@contextmanager
def _strided_flag_once_per_op():
    """`_propagate_use_strided_shard_flag` once per op, and the expansions memoised, for the
    block (see point 5)."""
    from ..torch_compat import StridedShard, strided_shard_flag_propagation

    site = strided_shard_flag_propagation()
    if site is None:
        yield
        return
    module, name = site
    original = getattr(module, name)
    last: list = [None, None]  # (op_schema, its summary): the children of one op come together

    def summary(op_schema):
        if last[0] is not op_schema:
            by_value = {}
            for spec in op_schema.args_spec:
                if any(isinstance(p, StridedShard) for p in spec.placements):
                    by_value.setdefault(spec.use_strided_shard_as_shard_order, spec)
            last[0], last[1] = op_schema, _ArgsSpecs(tuple(by_value.values()))
        return last[1]

    def propagate_flag(op_strategy, op_schema):
        try:
            return original(op_strategy, summary(op_schema))
        except AttributeError:  # a torch whose function reads more of the schema
            return original(op_strategy, op_schema)

    try:
        with patched(module, **{name: propagate_flag}), _expansions_memoised():
            yield
    finally:
        last[0] = last[1] = None


@contextmanager
def _expansions_memoised():
    """`expand_to_full_mesh_op_strategy` memoised for the block (see point 5)."""
    from ..torch_compat import mesh_strategy_expansion

    site = mesh_strategy_expansion()
    if site is None:
        yield
        return
    module, name = site
    original = getattr(module, name)
    memo: dict = {}

    def expand(mesh, op_schema, single_mesh_dim_strategies, **kwargs):
        if kwargs.get("full_mesh_strategy_filter") is not None:  # a closure: no key for it
            return original(mesh, op_schema, single_mesh_dim_strategies, **kwargs)
        try:
            key = (mesh, op_schema, tuple(tuple(s) for s in single_mesh_dim_strategies),
                   tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                for k, v in kwargs.items())))
            found = memo.get(key)
        except TypeError:  # unhashable (symbolic sizes): compute
            return original(mesh, op_schema, single_mesh_dim_strategies, **kwargs)
        if found is None:
            found = memo[key] = original(mesh, op_schema, single_mesh_dim_strategies, **kwargs)
        return found

    try:
        with patched(module, **{name: expand}):
            yield
    finally:
        memo.clear()


@contextmanager
def _foreach_elements_once():
    """A foreach op's distinct elements expanded only, for the block (see point 5)."""
    from ..torch_compat import foreach_strategy_expansion

    site = foreach_strategy_expansion()
    if site is None:
        yield
        return
    module, name, tuple_strategy, op_schema_type = site
    original = getattr(module, name)

    def expand(mesh, op_schema, strategy_info, output_tensor_meta):
        reduced = _distinct_elements(op_schema, output_tensor_meta, tuple_strategy,
                                     op_schema_type)
        if reduced is None:
            return original(mesh, op_schema, strategy_info, output_tensor_meta)
        schema, meta, position = reduced
        inner = original(mesh, schema, strategy_info, meta)

        def expanded(op, args_schema, kwargs_schema):
            children = inner(op, schema.args_meta, schema.kwargs_meta).children
            return tuple_strategy(children=[children[i] for i in position])

        return expanded

    with patched(module, **{name: expand}):
        yield


def _distinct_elements(op_schema, output_tensor_meta, tuple_strategy, op_schema_type):
    """(schema over one element of each distinct kind, its output metadata, element ->
    position in it), or None where the op is no foreach op or has no repeated element."""
    args = op_schema.args_schema
    lists = [i for i, a in enumerate(args) if isinstance(a, tuple_strategy)]
    if not lists or not op_schema.op.name().startswith(
            ("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")):
        return None
    if any(isinstance(v, tuple_strategy) for v in op_schema.kwargs_schema.values()):
        return None  # DTensor translates only the positional lists' children
    n = len(args[lists[0]].children)
    if any(len(args[i].children) != n for i in lists):
        return None  # DTensor's own check raises on it
    if output_tensor_meta is not None and (type(output_tensor_meta) not in (list, tuple)
                                           or len(output_tensor_meta) != n):
        return None  # not one metadata per element: leave it to DTensor
    seen: dict = {}
    firsts, position = [], []
    try:
        for e in range(n):
            key = (tuple(args[i].children[e] for i in lists),
                   None if output_tensor_meta is None else output_tensor_meta[e])
            k = seen.setdefault(key, len(seen))
            if k == len(firsts):
                firsts.append(e)
            position.append(k)
    except TypeError:  # unhashable (symbolic sizes): every element its own
        return None
    if len(firsts) == n:
        return None
    new_args = tuple(tuple_strategy(children=[a.children[e] for e in firsts])
                     if isinstance(a, tuple_strategy) else a for a in args)
    schema = op_schema_type(op_schema.op, args_schema=new_args,
                            kwargs_schema=op_schema.kwargs_schema)
    meta = None if output_tensor_meta is None else \
        type(output_tensor_meta)(output_tensor_meta[e] for e in firsts)
    return schema, meta, position


def _clear_dtensor_caches() -> None:
    from ..torch_compat import clear_dtensor_caches

    clear_dtensor_caches()


class DecisionMemory:
    """Sharding decisions kept beyond the profile that made them (point 6), with no mesh in
    them: op schema (meshes as `_MeshValue`s) -> (that schema, its decision, likewise)."""

    def __init__(self):
        self._kept: dict = {}

    def __len__(self) -> int:
        return len(self._kept)

    def find(self, schema):
        """(the kept schema equal to the mesh-free `schema`, its decision), or None."""
        return self._kept.get(schema)

    def keep(self, schema, decision) -> None:
        self._kept.setdefault(schema, (schema, decision))


# the DecisionMemory profiles keep their decisions in (decisions_remembered), None: none
_REMEMBERED: ContextVar = ContextVar("tapescope_sharding_decisions", default=None)


@contextmanager
def decisions_remembered(memory: DecisionMemory):
    """Distributed profiles in the block keep their sharding decisions in `memory` and answer
    from it (point 6)."""
    token = _REMEMBERED.set(memory)
    try:
        yield memory
    finally:
        _REMEMBERED.reset(token)


def remember_decisions_in_this_process() -> None:
    """`decisions_remembered` for the rest of this process: the initializer of a worker process
    that profiles candidate after candidate (layout_search's local pool)."""
    _REMEMBERED.set(DecisionMemory())


@contextmanager
def decisions_shared_by_ranks():
    """DTensor's sharding decisions kept from one rank's capture to the next, each re-bound to
    the meshes of the rank that asks (point 4); forgotten when it ends, or kept in the
    DecisionMemory of an enclosing `decisions_remembered` (point 6). Yields the SharedDecisions
    to give each capture's `eager_distributed`."""
    from ..torch_compat import sharding_decisions

    propagator, name, spec_type, schema_type, output_type = sharding_decisions()
    compute = propagator.__dict__[name]
    shared = SharedDecisions(compute, spec_type, schema_type, output_type, _REMEMBERED.get())

    def propagate(self, op_schema):
        return shared.decide(self, op_schema)

    try:
        with patched(propagator, **{name: propagate}):
            yield shared
    finally:
        shared.forget()


class SharedDecisions:
    """The sharding decisions the ranks of one profile made, by op schema (global metadata,
    placements, meshes by value): a rank whose op misses DTensor's own caches (emptied for each
    capture) gets an earlier rank's decision re-bound to its own meshes, once per rank; the
    current rank's own decisions are made as without it (point 4). With a DecisionMemory, an
    earlier profile's decisions are asked too, and this profile's are kept there when it ends
    (point 6)."""

    def __init__(self, compute, spec_type, schema_type, output_type,
                 memory: DecisionMemory | None = None):
        self._compute = compute
        self._spec, self._schema, self._output = spec_type, schema_type, output_type
        self._memory = memory
        self._earlier: dict = {}  # op schema -> (that schema, the decision an earlier rank made)
        self._made: dict = {}     # ... the current rank made
        self._rank: dict = {}     # op schema -> an earlier rank's decision, re-bound

    def begin_rank(self) -> None:
        """A rank's capture starts: the decisions made so far are an earlier rank's."""
        for schema, decision in self._made.items():
            self._earlier.setdefault(schema, decision)
        self._made, self._rank = {}, {}

    def forget(self) -> None:
        if self._memory is not None:
            for schema, decision in (*self._earlier.values(), *self._made.values()):
                self._remember(schema, decision)
        self._earlier, self._made, self._rank = {}, {}, {}

    def decide(self, propagator, op_schema):
        try:
            found = self._rank.get(op_schema)
            earlier = self._earlier.get(op_schema) if found is None else None
            if found is None and earlier is None and self._memory is not None:
                earlier = self._recalled(op_schema)
        except TypeError:  # unhashable (symbolic sizes): DTensor caches none of it either
            return self._compute(propagator, op_schema)
        if earlier is not None:
            found = self._rank[op_schema] = self._rebound(propagator, *earlier, op_schema)
        if found is not None:
            return found
        decision = self._compute(propagator, op_schema)
        self._made.setdefault(op_schema, (op_schema, decision))
        return decision

    def _rebound(self, propagator, schema, decision, op_schema):
        """`decision`, made by an earlier rank for `schema` (equal to `op_schema` by value), with
        each mesh of that rank replaced by the mesh `op_schema` has at the same place; computed
        afresh where a mesh has no such place or two (its arguments differ in which are one
        mesh object)."""
        theirs, ours = (list(self._specs((s.args_schema, s.kwargs_schema)))
                        for s in (schema, op_schema))
        meshes: dict = {}  # id(earlier rank's mesh) -> this rank's
        if len(theirs) != len(ours):
            return self._compute(propagator, op_schema)
        for a, b in zip(theirs, ours):
            if meshes.setdefault(id(a.mesh), b.mesh) is not b.mesh:
                return self._compute(propagator, op_schema)
        if not self._names_only(decision, meshes):
            return self._compute(propagator, op_schema)
        return self._bound_decision(decision, meshes)

    def _names_only(self, decision, meshes: dict) -> bool:
        """Does `decision` name only meshes in `meshes` (by id)?"""
        redistribute = decision.redistribute_schema
        its = (decision.output_spec, None if redistribute is None else
               (redistribute.args_schema, redistribute.kwargs_schema))
        return all(id(s.mesh) in meshes for s in self._specs(its))

    def _bound_schema(self, schema, meshes: dict):
        return self._schema(schema.op, self._bind(schema.args_schema, meshes),
                            self._bind(schema.kwargs_schema, meshes),
                            schema_info=schema.schema_info)

    def _bound_decision(self, decision, meshes: dict):
        redistribute = decision.redistribute_schema
        return self._output(
            self._bind(decision.output_spec, meshes),
            None if redistribute is None else self._bound_schema(redistribute, meshes),
            decision.needs_redistribute, decision.use_val_from_redistribute_schema)

    def _mesh_free(self, schema) -> tuple | None:
        """(`schema` with each mesh object replaced by its _MeshValue, id(mesh) -> _MeshValue),
        or None where a mesh has no value key (a torch without DeviceMesh._hash_key)."""
        from ..torch_compat import mesh_value

        values: dict = {}
        for spec in self._specs((schema.args_schema, schema.kwargs_schema)):
            if id(spec.mesh) not in values:
                key = mesh_value(spec.mesh)
                if key is None:
                    return None
                values[id(spec.mesh)] = _MeshValue(key)
        return self._bound_schema(schema, values), values

    def _remember(self, schema, decision) -> None:
        """Keep `decision`, made for `schema`, in the memory, mesh-free (point 6); not where it
        names a mesh its schema does not (it could not be re-bound)."""
        try:
            free = self._mesh_free(schema)
            if free is None or self._memory.find(free[0]) is not None:
                return
        except TypeError:  # unhashable: never made here (decide computes it uncached)
            return
        template, values = free
        if self._names_only(decision, values):
            self._memory.keep(template, self._bound_decision(decision, values))

    def _recalled(self, op_schema):
        """(a kept schema equal to `op_schema`, its decision), both mesh-free, or None."""
        free = self._mesh_free(op_schema)
        return None if free is None else self._memory.find(free[0])

    def _specs(self, x):
        """The DTensorSpecs in `x` (nested tuples, lists and dicts)."""
        if isinstance(x, self._spec):
            yield x
        elif isinstance(x, (tuple, list)):
            for v in x:
                yield from self._specs(v)
        elif isinstance(x, dict):
            for v in x.values():
                yield from self._specs(v)

    def _bind(self, x, meshes):
        """`x` with each DTensorSpec's mesh replaced by `meshes[id(mesh)]` (a copy)."""
        if isinstance(x, self._spec):
            mesh = meshes[id(x.mesh)]
            if mesh is x.mesh:
                return x
            spec = copy.copy(x)
            spec.mesh = mesh  # DTensorSpec.__setattr__ forgets the hash it kept
            return spec
        if isinstance(x, (tuple, list)):
            return type(x)(self._bind(v, meshes) for v in x)
        if isinstance(x, dict):
            return {k: self._bind(v, meshes) for k, v in x.items()}
        return x


class _MeshValue:
    """A mesh in a remembered decision (point 6): equal to another exactly when DeviceMesh's own
    equality would call their meshes equal, and hashed alike; it keeps nothing else."""

    __slots__ = ("key", "_hash")

    def __init__(self, key):
        self.key, self._hash = key, hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _MeshValue) and other.key == self.key

    def __repr__(self) -> str:
        return f"_MeshValue({self.key!r})"


def _real(fn):
    from functools import wraps

    from ..torch_compat import unset_fake_mode

    @wraps(fn)
    def run(*args, **kwargs):
        with unset_fake_mode():
            return fn(*args, **kwargs)

    return run


_REMAKE_LIMIT = 1 << 20  # elements: a rank map is one int per rank


def _remake(trace, value: int, depth: int = 0):
    """The real tensor of dataflow value `value` if the trace made it from Python data alone
    (factories such as arange, and functional ops on such tensors), else None. Refused where an
    in-place op wrote it or its storage afterwards: the values would be stale."""
    if value is None or depth > 16:
        return None
    ops = trace.ops
    for rec in reversed(ops):
        hit = next((i for i, o in enumerate(rec.outputs) if o is not None and o.value == value),
                   None)
        if hit is not None:
            break
    else:
        return None
    out_ref = rec.outputs[hit]
    if rec.func._schema.is_mutable or _numel(out_ref.shape) > _REMAKE_LIMIT:
        return None
    for later in ops[rec.index + 1:]:
        if later.func._schema.is_mutable and any(
                o is not None and o.storage == out_ref.storage for o in later.outputs):
            return None
    missing = []

    def real(a):
        if isinstance(a, TensorRef):
            r = _remake(trace, a.value, depth + 1)
            if r is None:
                missing.append(a)
            return r
        if type(a) is tuple and any(isinstance(x, TensorRef) for x in a):
            return [real(x) for x in a]
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    args = tuple(real(a) for a in rec.args)
    kwargs = {k: real(v) for k, v in rec.kwargs.items()}
    if missing:
        return None
    kwargs.pop("pin_memory", None)
    try:
        out = rec.func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that cannot run on these values: not re-makable
        return None
    if isinstance(out, (tuple, list)):
        out = out[hit]
    return out if isinstance(out, torch.Tensor) else None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        if not isinstance(s, int):
            return _REMAKE_LIMIT + 1  # a symbolic size: not a rank map
        n *= s
    return n


def _capture_fake(t) -> bool:
    from ..capture.tape import Tape
    from ..torch_compat import FakeTensor

    return isinstance(t, FakeTensor) and isinstance(t.fake_mode, Tape)


def _made_for_real(t, what: str):
    """The capture's fake tensor `t` made for real (see point 3)."""
    from ..torch_compat import unset_fake_mode

    tape = t.fake_mode
    with unset_fake_mode():
        values = tape.fidelity.values
        known = values.value(t) if values is not None else None  # torch.tensor([...]) literals
        real = known[0].clone() if known is not None else _remake(tape.trace, tape.value_of(t))
    if real is None:
        raise TapescopeError(
            f"DeviceMesh was given a {what} tensor computed from tensors tapescope cannot re-make "
            "(they are fake: no values); build the mesh with init_device_mesh(device, shape, "
            "mesh_dim_names=...) or give the ranks as a list, e.g. DeviceMesh(\"cuda\", "
            "[[0, 1], [2, 3]])")
    return real


def _mesh_init(init):
    """DeviceMesh.__init__ on real rank tensors, outside the fake mode (point 3)."""
    from functools import wraps

    from ..torch_compat import MESH_RANK_MAP, unset_fake_mode

    @wraps(init)
    def run(self, device_type, mesh=None, *args, **kwargs):
        kept = None  # the fake rank map, alive as long as the mesh's real one: the job's memory
        if _capture_fake(mesh):
            # what __init__ makes of it, made here so that the tape records it
            kept = (mesh if mesh.device.type == "cpu" else mesh.to("cpu")).detach() \
                .to(dtype=torch.int).contiguous()
            mesh = _made_for_real(kept, "mesh")
        if _capture_fake(kwargs.get(MESH_RANK_MAP)):  # init_device_mesh's arange
            kept = kwargs[MESH_RANK_MAP]
            kwargs[MESH_RANK_MAP] = _made_for_real(kept, "rank map")
        with unset_fake_mode():
            init(self, device_type, mesh, *args, **kwargs)
        if kept is not None:
            # shared by every mesh derived from this one
            getattr(self, MESH_RANK_MAP)._tapescope_fake = _KeptAlive(kept)

    return run


class _KeptAlive:
    """The capture's fake rank map, held by the mesh's real one so that the job's memory keeps
    it. A copy of the mesh shares it: dynamo's DTensor spec guard deep-copies every DTensorSpec
    a compiled region sees (guards.py, extract_dtensor_spec), mesh and rank map included, and a
    copied fake tensor would drag the capture's fake mode (and the fake process group it holds,
    which cannot be copied: "Tried to deepcopy object ...c10d.ProcessGroup") into the copy."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


@contextmanager
def _mesh_bookkeeping_on_real_tensors():
    """DeviceMesh's rank-tensor methods run outside the fake mode, for the block."""
    from ..torch_compat import mesh_rank_tensor_methods

    with ExitStack() as stack:
        for cls, name in mesh_rank_tensor_methods():
            attr = cls.__dict__[name]
            if name == "__init__":
                new = _mesh_init(attr)
            elif isinstance(attr, staticmethod):
                new = staticmethod(_real(attr.__func__))
            elif isinstance(attr, property):
                new = property(_real(attr.fget), attr.fset, attr.fdel, attr.__doc__)
            elif callable(attr):
                new = _real(attr)
            else:
                continue
            stack.enter_context(patched(cls, **{name: new}))
        yield


@contextmanager
def eager_distributed(decisions: SharedDecisions | None = None):
    """Run DTensor and the functional collectives as in an eager step while a capture runs.
    `decisions`: the ranks' shared sharding decisions (`decisions_shared_by_ranks`), kept."""
    from ..capture.tape import Tape
    from ..torch_compat import active_fake_mode, dtensor_meta_propagation, dtensor_tracing_checks

    propagator, propagate_name = dtensor_meta_propagation()
    propagate = propagator.__dict__[propagate_name]

    def propagate_unrecorded(self, op_schema):
        tape = active_fake_mode()
        if not isinstance(tape, Tape):
            return propagate(self, op_schema)
        if not op_schema.op._schema.returns:
            # an op that returns nothing (the foreach optimizer ops: `_foreach_addcdiv_`) has no
            # output metadata: DTensor's own code runs it on global-shaped fake copies of every
            # argument and returns None (`_propagate_tensor_meta_non_cached`): over a 70B model's
            # 723 shards, 6% of an FSDP 256 candidate's trace. The op itself still runs on the
            # rank's shards, where the tape records it and its kernel checks its arguments
            return None
        with tape.unrecorded():
            return propagate(self, op_schema)

    with ExitStack() as stack:
        for mod, name in dtensor_tracing_checks():
            stack.enter_context(patched(mod, **{name: _not_tracing}))
        stack.enter_context(patched(propagator, **{propagate_name: propagate_unrecorded}))
        stack.enter_context(_mesh_bookkeeping_on_real_tensors())
        stack.enter_context(_strided_flag_once_per_op())
        stack.enter_context(_foreach_elements_once())
        stack.enter_context(_p2p_works_hold_their_tensors())
        _clear_dtensor_caches()
        stack.callback(_clear_dtensor_caches)  # first on the way out
        if decisions is not None:
            decisions.begin_rank()
        yield


class _HeldWork:
    """A point-to-point Work that holds its tensor, as a real backend's does.

    Gloo's send and receive works keep their tensors until the Work object dies
    (ProcessGroupGloo's AsyncWork members); NCCL's keep them in the work's stash for the
    allocator's safety (TORCH_NCCL_AVOID_RECORD_STREAMS) at least until it is waited. The fake
    process group's FakeWork holds nothing, so a sent activation would die as soon as the
    program dropped it. Pipeline schedules keep their send works in a list until the next
    send (Schedule1F1B's `send_work`): in a real gloo run stage 0 holds micro-batch 0's output
    that long, 16 KiB of a 2-stage Llama's peak in tests/test_pipeline.py."""

    __slots__ = ("work", "tensor")

    def __init__(self, work, tensor):
        self.work, self.tensor = work, tensor

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def __bool__(self):
        return True

    def __getattr__(self, name):
        return getattr(self.work, name)


@contextmanager
def _p2p_works_hold_their_tensors():
    """Make torch.distributed.isend / irecv return works that hold their tensors (_HeldWork)
    while the block runs. The same wrapper is set
    on torch.distributed and distributed_c10d: P2POp and batch_isend_irecv compare an op with
    `isend` / `irecv` by identity."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    originals = {name: getattr(c10d, name) for name in ("isend", "irecv")}

    def holding(fn):
        def p2p(tensor, *args, **kwargs):
            work = fn(tensor, *args, **kwargs)
            return None if work is None else _HeldWork(work, tensor)
        p2p.__name__ = p2p.__qualname__ = fn.__name__
        p2p.__wrapped__ = fn
        return p2p

    wrapped = {name: holding(fn) for name, fn in originals.items()}
    with patched(c10d, **wrapped), patched(dist, **wrapped):
        yield
