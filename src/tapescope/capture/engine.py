"""A Python autograd engine that runs the backward graph the way torch's C++ engine does.

Why not `loss.backward()`: on a CUDA build without a GPU the C++ engine stops before running any node
(`stash_current_streams` asks the driver about device 0), and on fake tensors of any device it decides
some things differently from a real run: it never accumulates gradients in place into a Tensor
subclass (`can_accumulate_inplace`), and AccumulateGrad, called with the extra reference a Python
object holds, clones a gradient it would have stolen. Both change memory.

So we run the graph ourselves, following torch/csrc/autograd (engine.cpp, input_buffer.cpp,
accumulate_grad.h, python_function.cpp):
- dependencies counted from the root; ready nodes run highest sequence number first, ties broken as
  libstdc++'s std::priority_queue breaks them (AccumulateGrad nodes all have the largest number);
- each node: tensor pre-hooks, retain_grad, node pre-hooks, apply with grad mode off, post-hooks;
  its input gradients are freed when it returns, then its saved tensors (release_variables);
- outputs are checked against the next node's input metadata (`validate_outputs`: sum_to a broadcast
  shape, cast dtype), then accumulated into that node's input buffer: in place when the buffer holds
  the last reference to a dense tensor and its storage, else out of place;
- AccumulateGrad steals a gradient nobody else references and that has the parameter's strides, else
  copies it with the parameter's strides; an existing .grad is added to in place.
Reference counts are read as the C++ engine would see them: the tensor's own count less the one its
Python object holds, plus how many places in this engine hold it.

A backward called from inside a node (torch.utils.checkpoint's reentrant CheckpointFunction calls
torch.autograd.backward in its backward) runs here too, as the C++ engine runs it on a CPU thread:
a new graph task on the same ready queue, whose tasks go first (they are one reentrant level
deeper), run until that graph task completes. Each graph task gets its own id for
torch.utils.checkpoint (non-reentrant checkpoint recomputes once per graph task id), given
through torch's GraphExecGroup slot since the C++ id is not settable.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..torch_compat import (disable_torch_function, engine_grad_mode, graph_task_keep_graph_query,
                            is_zerotensor, patched, node_input_metadata, node_sequence_nr,
                            post_accumulate_grad_hooks,
                            set_graph_task_id, statically_known_true, storage_use_count,
                            tensor_backward_hooks, use_count, without_torch_function)
from .graph_task import GraphTask, standing_in
from .hooks import VARIABLE_INPUTS, HookRegistry, SavedTensors
from .view_replay import ViewRegeneration, as_strided_backward, emulable

__all__ = ["PythonEngine"]


class _Task:
    __slots__ = ("node", "inputs", "seq", "depth")

    def __init__(self, node, inputs, depth: int = 0):
        self.node, self.inputs, self.depth = node, inputs, depth
        self.seq = node_sequence_nr(node)


class _GraphTask:
    """One call of backward: its dependency counts, the input buffers of nodes not yet ready,
    and how many of its tasks are queued or running (it completes when none are)."""

    __slots__ = ("deps", "not_ready", "outstanding", "depth", "keep_graph")

    def __init__(self, deps: dict, depth: int, keep_graph: bool):
        self.deps, self.depth, self.keep_graph = deps, depth, keep_graph
        self.not_ready: dict = {}
        self.outstanding = 0


class _ReadyQueue:
    """std::priority_queue<NodeTask, vector, CompareNodeTaskTime> with libstdc++'s heap algorithms,
    so that tasks of equal priority come out in the same order as in the C++ engine."""

    def __init__(self):
        self.h: list[_Task] = []

    def __len__(self):
        return len(self.h)

    @staticmethod
    def _less(a: _Task, b: _Task) -> bool:
        # CompareNodeTaskTime: a deeper reentrant backward first, then the higher sequence number
        if a.depth == b.depth:
            return a.seq < b.seq
        return a.depth < b.depth

    def push(self, task: _Task) -> None:
        h = self.h
        h.append(task)
        self._push_heap(len(h) - 1, 0, task)

    def _push_heap(self, hole: int, top: int, value: _Task) -> None:
        h, less = self.h, self._less
        parent = (hole - 1) // 2
        while hole > top and less(h[parent], value):
            h[hole] = h[parent]
            hole = parent
            parent = (hole - 1) // 2
        h[hole] = value

    def pop(self) -> _Task:
        h, less = self.h, self._less
        top = h[0]
        value = h[-1]
        n = len(h) - 1  # std::pop_heap over [0, n]: the last element is re-inserted from the hole
        hole, second = 0, 0
        while second < (n - 1) // 2:
            second = 2 * (second + 1)
            if less(h[second], h[second - 1]):
                second -= 1
            h[hole] = h[second]
            hole = second
        if (n & 1) == 0 and second == (n - 2) // 2:
            second = 2 * (second + 1)
            h[hole] = h[second - 1]
            hole = second - 1
        h.pop()
        if n:
            self._push_heap(hole, 0, value)
        return top


def _gradient_edge(t):
    """Where a gradient enters or leaves the graph: a tensor's edge, or a GradientEdge given as
    is (torch.autograd.grad takes both; pipelining's split backward passes GradientEdges)."""
    if isinstance(t, torch.autograd.graph.GradientEdge):
        return t
    return torch.autograd.graph.get_gradient_edge(t)


class PythonEngine:
    """Runs `loss.backward()`'s graph from Python.

    saved: the saved tensors of the step (released node by node, as the C++ engine does);
    hooks: the backward hooks the step registered; views: the views autograd regenerated after
    in-place ops (their nodes run what AsStridedBackward0 runs); on_node(node) is told which node
    runs (None at the end).
    """

    def __init__(self, saved: SavedTensors, hooks: HookRegistry, views: ViewRegeneration,
                 on_node=None):
        self.saved, self.hooks, self.views, self.on_node = saved, hooks, views, on_node
        self._refs: dict[int, int] = defaultdict(int)  # id(tensor) -> places in this engine holding it
        self._graphs: list[_GraphTask] = []  # the graph tasks running, reentrant ones last
        self._queue: _ReadyQueue | None = None  # the thread's ready queue, shared by all of them
        self._node = None  # the node running now

    # ---- reference counts as the C++ engine sees them -----------------------------------------

    def _hold(self, t):
        if t is not None:
            self._refs[id(t)] += 1

    def _drop(self, t):
        if t is not None:
            k = id(t)
            self._refs[k] -= 1
            if self._refs[k] <= 0:
                del self._refs[k]

    def _use_count(self, t) -> int:
        """What `t.use_count()` would be inside the C++ engine."""
        return use_count(t) - 1 + self._refs.get(id(t), 0)

    @staticmethod
    def _storage_use_count(t) -> int:
        return storage_use_count(t)

    def _stealable(self, t, expected: int) -> bool:
        return self._use_count(t) <= expected

    def _can_accumulate_inplace(self, t) -> bool:
        return (not is_zerotensor(t) and not t.is_nested
                and _dense(t)
                and self._stealable(t, 1) and self._storage_use_count(t) == 1)

    # ---- the engine ---------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`."""
        self.run_backward((loss,))

    def run_backward(self, tensors, grad_tensors=None, retain_graph: bool = False) -> None:
        """`torch.autograd.backward(tensors, grad_tensors, retain_graph)` from outside any
        backward (the step's own call; a user's step may give several roots or gradients)."""
        # Code that asks the running graph task whether it keeps the graph (AOTAutograd's compiled
        # backward: only a graph used once may reuse its saved tensors' buffers, "donated
        # buffers") finds none when our engine runs, and the C++ answer is then True. The graph
        # task loss.backward() creates has keep_graph=False: answer that while we run.
        module, name = graph_task_keep_graph_query()
        with patched(module, **{name: (lambda: True) if retain_graph else _graph_not_kept}):
            self._backward(_roots(tensors, grad_tensors), bool(retain_graph))

    def _backward(self, roots: list, keep_graph: bool) -> None:
        # run_backward's variable_list of gradients (_make_grads' ones for a scalar root) holds
        # them until the engine returns
        for _, _, g in roots:
            self._hold(g)
        # a backward inside a node runs here too; hooks may ask the C++ engine about its graph
        # task (FSDP2 queues its final callback)
        with patched(torch.autograd, backward=self._reentrant_backward), \
                standing_in(GraphTask([n for n, _, _ in roots], self._dependencies)) as graph_task:
            self._run(roots, keep_graph=keep_graph)
            graph_task.run_final_callbacks()
        for _, _, g in roots:
            self._drop(g)

    def _reentrant_backward(self, tensors, grad_tensors=None, retain_graph=None,
                            create_graph=False, grad_variables=None, inputs=None):
        """torch.autograd.backward called while our engine runs a node (reentrant checkpoint)."""
        if create_graph or inputs is not None:
            from ..errors import TapescopeError

            raise TapescopeError("a backward inside the backward (reentrant checkpoint or a hook) "
                                 "with create_graph=True or inputs=... is not supported")
        roots = _roots(tensors, grad_tensors if grad_tensors is not None else grad_variables)
        for _, _, g in roots:  # run_backward's variable_list of gradients
            self._hold(g)
        try:
            self._run(roots, keep_graph=bool(retain_graph))
        finally:
            for _, _, g in roots:
                self._drop(g)

    def grad(self, outputs, inputs, grad_outputs=None, allow_unused=False,
             keep_graph: bool = False) -> tuple:
        """`torch.autograd.grad` on this engine: the gradients arriving at each input (a leaf's
        AccumulateGrad, a non-leaf's grad_fn) are captured there instead of accumulated into
        .grad, and only the nodes on a path to an input run (the C++ engine's exec_info).
        AOTAutograd's joint trace calls torch.autograd.grad, which on fake CUDA tensors without a
        GPU fails in the C++ engine; compiled.py routes it here for CUDA compiles."""
        edge_types = (torch.Tensor, torch.autograd.graph.GradientEdge)
        outputs = [outputs] if isinstance(outputs, edge_types) else list(outputs)
        inputs = [inputs] if isinstance(inputs, edge_types) else list(inputs)
        if grad_outputs is None:
            grad_outputs = [None] * len(outputs)
        elif isinstance(grad_outputs, torch.Tensor):
            grad_outputs = [grad_outputs]
        roots = []
        for out, g in zip(outputs, grad_outputs):
            if g is None:
                g = torch.ones_like(out, memory_format=torch.preserve_format)
            self._hold(g)
            if isinstance(out, torch.autograd.graph.GradientEdge):
                roots.append((out.node, out.output_nr, g))
            else:
                roots.append((out.grad_fn, out.output_nr, g))
        targets = {}
        for i, t in enumerate(inputs):
            edge = _gradient_edge(t)
            targets.setdefault((edge.node, edge.output_nr), []).append(i)
        results = [None] * len(inputs)
        # a hook may queue a final callback (AOTAutograd's stack-trace hooks on the joint
        # graph's C++ nodes do): the C++ engine's graph task of autograd.grad takes it
        with standing_in(GraphTask([n for n, _, _ in roots], self._dependencies)) as graph_task:
            self._run(roots, targets, results, keep_graph=keep_graph)
            graph_task.run_final_callbacks()
        for _, _, g in roots:
            self._drop(g)
        if not allow_unused and any(r is None for r in results):
            raise RuntimeError("One of the differentiated Tensors appears to not have been used "
                               "in the graph. Set allow_unused=True if this is the desired behavior.")
        return tuple(results)

    def _run(self, roots: list, targets: dict | None = None, results: list | None = None,
             keep_graph: bool = False) -> None:
        """Run the graph from `roots` [(node, input_nr, gradient)] as one graph task (Engine::
        execute). With `targets` {(node, input_nr): [result index]}, capture the gradients
        arriving there into `results` and run only the nodes that lead to a target."""
        deps = self._dependencies([n for n, _, _ in roots])
        runs = needed = None
        if targets is not None:
            target_nodes = {n for n, _ in targets}
            runs = self._leading_to([n for n, _, _ in roots], target_nodes)
            needed = runs | target_nodes  # nodes whose input gradients matter
        outer = self._graphs[-1] if self._graphs else None
        depth = 0 if outer is None else outer.depth + 1
        if outer is None:
            self._queue = _ReadyQueue()
        ready = self._queue
        graph = _GraphTask(deps, depth, keep_graph)
        not_ready = graph.not_ready
        self._graphs.append(graph)
        running = self._node
        previous_id = set_graph_task_id(object())
        on_node = self.on_node or (lambda node: None)
        try:
            pending: dict = {}
            for node, nr, g in roots:
                buf = pending.setdefault(node, [None] * len(node_input_metadata(node)))
                self._hold(g)
                self._add(buf, nr, g)
            for node, buf in pending.items():
                if deps.get(node, 0) == 0:
                    graph.outstanding += 1
                    ready.push(_Task(node, buf, depth))
                else:
                    not_ready[node] = buf
            # the graph task's grad mode (create_graph=False), hooks too
            with engine_grad_mode(False):
                while graph.outstanding:
                    task = ready.pop()
                    node, inputs = task.node, task.inputs
                    task.inputs = None
                    graph.outstanding -= 1
                    if targets is not None:
                        for nr in range(len(inputs)):
                            for i in targets.get((node, nr), ()):
                                results[i] = inputs[nr]
                        if node not in runs:  # a target only: its gradient is captured
                            for g in inputs:
                                self._drop(g)
                            continue
                    self._node = node
                    on_node(node)  # ops until the next node belong to this one, as in C++
                    self.saved.node_started()
                    outputs = self._call(node, inputs)  # consumes inputs
                    del inputs
                    self.saved.node_finished(task.seq, release=not keep_graph)
                    next_edges = node.next_functions
                    for i, out in enumerate(outputs):
                        outputs[i] = None
                        nxt, input_nr = next_edges[i] if i < len(next_edges) else (None, 0)
                        if nxt is None or (needed is not None and nxt not in needed):
                            self._drop(out)
                            if nxt is not None:
                                deps[nxt] -= 1
                            continue
                        deps[nxt] -= 1
                        is_ready = deps[nxt] == 0
                        buf = not_ready.get(nxt)
                        if buf is None:
                            buf = [None] * len(node_input_metadata(nxt))
                        self._add(buf, input_nr, out)
                        del out
                        if is_ready:
                            not_ready.pop(nxt, None)
                            graph.outstanding += 1
                            ready.push(_Task(nxt, buf, depth))
                        else:
                            not_ready[nxt] = buf
                    del outputs, node, task
        finally:
            self._graphs.pop()
            set_graph_task_id(previous_id)
            self._node = running
            on_node(running)

    @staticmethod
    def _leading_to(roots: list, target_nodes: set) -> set:
        """Nodes with a path to a target node through their next functions (the nodes the C++
        engine's exec_info marks needed)."""
        needed: set = set()
        state: dict = {}
        for root in roots:
            stack = [(root, iter(root.next_functions))]
            state[root] = False
            while stack:
                node, it = stack[-1]
                for nxt, _ in it:
                    if nxt is not None and nxt not in state:
                        state[nxt] = False
                        stack.append((nxt, iter(nxt.next_functions)))
                        break
                else:
                    stack.pop()
                    if any(n in needed or n in target_nodes for n, _ in node.next_functions
                           if n is not None):
                        needed.add(node)
        return needed

    @staticmethod
    def _dependencies(roots: list) -> dict:
        deps: dict = defaultdict(int)
        seen = set(roots)
        queue = list(roots)
        while queue:
            fn = queue.pop()
            for nxt, _ in fn.next_functions:
                if nxt is not None:
                    deps[nxt] += 1
                    if nxt not in seen:
                        seen.add(nxt)
                        queue.append(nxt)
        return deps

    @without_torch_function
    def _add(self, buf: list, pos: int, var) -> None:
        """InputBuffer::add for a dense tensor (the only kind fake tracing produces): C++ in a
        real step, unseen by torch function modes."""
        if var is None:
            return
        old = buf[pos]
        if old is None:
            buf[pos] = var  # moves our reference into the buffer
            return
        if self._can_accumulate_inplace(old):
            old.add_(var)
            self._drop(var)
        else:
            buf[pos] = old + var
            self._hold(buf[pos])
            self._drop(old)
            self._drop(var)

    def _call(self, node, inputs: list) -> list:
        """call_function: hooks, then the node with grad mode off; returns validated outputs."""
        hooks = self.hooks
        for i in range(len(inputs)):
            for d in hooks.tensor_hooks.get((node, i), ()):
                for hook in list(d.values()):
                    if inputs[i] is None:
                        break
                    new = hook(inputs[i])
                    if new is not None:
                        self._hold(new)
                        self._drop(inputs[i])
                        inputs[i] = new
            ref = hooks.retained.get((node, i))
            if ref is not None and ref() is not None and inputs[i] is not None:
                t = ref()
                t.grad = inputs[i].clone(memory_format=torch.contiguous_format) if t.grad is None \
                    else t.grad + inputs[i]
        for hook in (*hooks.pre_hooks.get(node, ()), *hooks.cpp_node_hooks(node, pre=True)):
            new = hook(tuple(inputs))
            if new is not None:
                for i, g in enumerate(new):
                    self._hold(g)
                    self._drop(inputs[i])
                    inputs[i] = g
        with engine_grad_mode(False):
            if type(node).__name__ == "AccumulateGrad":
                self._accumulate_grad(node, inputs)
                outputs = []
            elif isinstance(node, torch.autograd.function.BackwardCFunction):
                outputs = self._call_python_function(node, inputs)
            else:
                # a view regenerated after an in-place op runs AsStridedBackward0's ops, as for a
                # plain tensor (view_replay.py)
                regenerated = self.views.nodes.get(node)
                if regenerated is not None and inputs and inputs[0] is not None \
                        and emulable(regenerated):
                    outputs = [as_strided_backward(inputs[0], regenerated)]
                    self._hold(outputs[0])
                else:
                    outputs = self._call_cpp(node, inputs)
            outputs = self._validate(node, outputs)
        post = (*hooks.post_hooks.get(node, ()), *hooks.cpp_node_hooks(node, pre=False))
        if post:
            for hook in post:
                new = hook(tuple(outputs), tuple(inputs))
                if new is not None:
                    for g in outputs:
                        self._drop(g)
                    outputs = list(new)
                    for g in outputs:
                        self._hold(g)
        for g in inputs:  # the node's input gradients die when call_function returns
            self._drop(g)
        inputs.clear()
        return outputs

    def _call_cpp(self, node, inputs: list) -> list:
        out = node(*inputs)
        outputs = list(out) if isinstance(out, tuple) else [out]
        for g in outputs:
            self._hold(g)
        return outputs

    def _call_python_function(self, node, inputs: list) -> list:
        """PyNode::apply: materialise missing gradients, call the user's backward (boxed: the
        gradients handed over in a list the backward may empty, as AOTAutograd's compiled
        function does to free each at its last use), keep the gradients of tensor inputs."""
        if getattr(node, "materialize_grads", True):
            metas = node_input_metadata(node) if hasattr(node, "_input_metadata") else ()
            for i, g in enumerate(inputs):
                if g is None and i < len(metas):
                    m = metas[i]
                    inputs[i] = torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                    self._hold(inputs[i])
        if getattr(node._forward_cls, "boxed_grads_call", False):
            boxed = list(inputs)
            for g in inputs:
                self._drop(g)
            inputs.clear()
            out = node.apply_boxed(boxed)
            del boxed
        else:
            out = node.apply(*inputs)
        outputs = list(out) if isinstance(out, tuple) else [out]
        del out
        variable = getattr(node, VARIABLE_INPUTS, None)
        if variable is not None:
            outputs = [g for g, is_tensor in zip(outputs, variable) if is_tensor]
            n = len(node.next_functions)
            outputs = (outputs + [None] * n)[:n]
        else:  # a Function applied while nothing was recorded (a parallelize step, say)
            outputs = _per_edge(node, outputs)
        for g in outputs:
            self._hold(g)
        return outputs

    def _accumulate_grad(self, node, inputs: list) -> None:
        """AccumulateGrad::apply + accumulateGrad() for dense tensors without grad mode. Its own
        work is C++ in a real step, unseen by torch function modes (~6 tensor attribute reads
        and writes a parameter, each ~1.6 us through the capture's FunctionRulesMode); the
        user's hooks run as the user's code."""
        with disable_torch_function():
            variable = node.variable
            new_grad = inputs[0] if inputs else None
            if new_grad is None or not variable.requires_grad:
                return
            hooks = tensor_backward_hooks(variable)
        if hooks:
            for hook in list(hooks.values()):
                new = hook(new_grad)
                if new is not None:
                    self._hold(new)
                    self._drop(new_grad)
                    inputs[0] = new_grad = new
        with disable_torch_function():
            post = post_accumulate_grad_hooks(variable)
            if variable.grad is None:
                expected = 1 + bool(post)
                if self._stealable(new_grad, expected) and _obeys_layout_contract(new_grad,
                                                                                  variable):
                    variable.grad = new_grad.detach()
                else:
                    variable.grad = _clone_obey_contract(new_grad, variable)
            else:
                variable.grad += new_grad
        if post:
            for hook in list(post.values()):
                hook(variable)

    @without_torch_function
    def _validate(self, node, outputs: list) -> list:
        """validate_outputs: reduce broadcast gradients and cast dtypes to what the next node expects.

        Each step assigns over the gradient in place (`grad = metadata.maybe_reduce(i,
        std::move(grad))`, then `grad = grad.to(dtype)`), so the broadcast-sized gradient dies
        before the cast runs: a float64 product reduced to a float32 weight's gradient is not
        alive beside its cast."""
        for i, (nxt, nr) in enumerate(node.next_functions):
            if i >= len(outputs) or nxt is None or outputs[i] is None:
                continue
            meta = node_input_metadata(nxt)[nr]
            shape = tuple(meta.shape)
            if not _same_shape(outputs[i].shape, shape):
                self._replace(outputs, i, outputs[i].sum_to_size(shape) if shape
                              else outputs[i].sum())
            if outputs[i].dtype != meta.dtype:
                self._replace(outputs, i, outputs[i].to(meta.dtype))
            if outputs[i].device != meta.device:
                self._replace(outputs, i, outputs[i].to(meta.device))
        return outputs

    def _replace(self, outputs: list, i: int, new) -> None:
        """outputs[i] = new, the old gradient released now (no other reference of ours to it)."""
        if new is not outputs[i]:
            self._hold(new)
            self._drop(outputs[i])
            outputs[i] = new


def _graph_not_kept() -> bool:
    return False


def _roots(tensors, grads) -> list:
    """[(node, input_nr, gradient)] of torch.autograd.backward's arguments (_make_grads: an
    implicit gradient of ones only for a one-element root)."""
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grads is None or isinstance(grads, torch.Tensor):
        grads = (grads,) * len(tensors) if grads is None else (grads,)
    from ..errors import user_error

    roots = []
    for t, g in zip(tensors, grads):
        if t.grad_fn is None:
            raise user_error(RuntimeError(
                "element 0 of tensors does not require grad and does not have a grad_fn"
                if not t.requires_grad else "a backward from a leaf tensor is not supported"))
        if g is None:
            if t.numel() != 1:
                raise user_error(RuntimeError("grad can be implicitly created only for scalar "
                                              "outputs"))
            g = torch.ones_like(t, memory_format=torch.preserve_format)
        roots.append((t.grad_fn, t.output_nr, g))
    return roots


def _per_edge(node, grads: list) -> list:
    """The user's backward returns one gradient per forward input; the node has one edge per
    tensor input (PyNode::apply drops the positions of non-tensor inputs, `is_variable_input`).
    Python sees `needs_input_grad` per forward input and the edges: the inputs that need a
    gradient are the edges with a function, in order; the other edges get nothing.
    (FSDP2's RegisterPostBackwardFunction.apply(param_group, *inputs) returns (None, *grads).)"""
    edges = node.next_functions
    n = len(edges)
    needs = getattr(node, "needs_input_grad", None)
    if needs is None or len(needs) == n:
        return (grads + [None] * n)[:n]
    wanted = [i for i, need in enumerate(needs) if need]
    out = [None] * n
    for j, i in zip((j for j, (fn, _) in enumerate(edges) if fn is not None), wanted):
        if i < len(grads):
            out[j] = grads[i]
    return out


def _same_shape(a, b) -> bool:
    """Shapes equal as expressions (symbolic sizes are compared without adding guards: the
    engine's decision must not depend on the sizes a symbolic trace happens to run at)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif _expr(x) == _expr(y):  # the common case, without building a SymBool
            continue
        elif not statically_known_true(x == y):
            return False
    return True


def _expr(x):
    return x.node.expr if isinstance(x, torch.SymInt) else x


def _dense(t) -> bool:
    """is_non_overlapping_and_dense: some permutation of t's dims is laid out contiguously."""
    if t.dim() == 1:
        return t.shape[0] < 2 or t.stride(0) == 1
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


@without_torch_function
def _obeys_layout_contract(grad, variable) -> bool:
    if _dense(variable):
        for size, gs, vs in zip(grad.shape, grad.stride(), variable.stride()):
            if size != 1:
                if gs != vs:
                    return False
            elif gs == 0:
                return False
        return True
    return grad.is_contiguous()


def _clone_obey_contract(new_grad, variable):
    if _dense(variable):
        return new_grad.new_empty_strided(variable.shape, variable.stride()).copy_(new_grad)
    return new_grad.clone(memory_format=torch.contiguous_format)
