"""Matrix functions on the CPU against the real allocator: the factorizations' in-kernel buffers
(capture/fidelity/linalg_factorizations.py), matrix_exp's Taylor buffers (matrix_exp.py), and
second-order optimizers built from them.

Truth: the same step run for real under torch.profiler (validate.real), compared op by op
(validate.per_op): each op's highest live bytes above the bytes live when it began, as the
allocator counted them, must equal the trace's; and the step's peak. A peak may sit up to 12 B
below the allocator's where a backward `mul` / `div` wraps a Python number (docs/validation.md,
"Python-scalar temporaries").
"""

import pytest
import torch

import tapescope
from tapescope.report.text import assumption_lines
from tapescope.validate.per_op import compare_ops
from tapescope.validate.real import run_real_steps


def _measure(build, inputs, optimizer="sgd", prebuilt=False):
    torch.manual_seed(0)
    p = tapescope.profile(build() if prebuilt else build, *inputs, optimizer=optimizer)
    torch.manual_seed(0)
    real = run_real_steps(build, inputs, optimizer=optimizer)
    return p, real, compare_ops(p, real, 1)


def _excess(ops, name, phase=None):
    return [(o.measured_excess, o.predicted_excess) for o in ops
            if o.name == name and (phase is None or o.phase == phase)]


class _Factorized(torch.nn.Module):
    """Parameters (single matrices or batches) through several factorizations each, every output
    into the loss (the ones torch cannot differentiate, detached)."""

    def __init__(self, which, params):
        super().__init__()
        self.ws = torch.nn.ParameterList(
            [torch.randn(*shape, dtype=dtype) / shape[-1] ** 0.5 for shape, dtype in params])
        self.which = which

    def forward(self, x):
        loss, la = x.sum(), torch.linalg
        for w in self.ws:
            outs = {"svd": lambda: la.svd(w, full_matrices=False),
                    "svd full": lambda: la.svd(w.detach(), full_matrices=True)[:1],
                    "svdvals": lambda: (la.svdvals(w), la.svdvals(w.detach())),
                    "qr": lambda: la.qr(w),
                    "qr r": lambda: la.qr(w.detach(), mode="r")[1:],
                    "lu_factor + lu_solve": lambda: (la.lu_solve(
                        *la.lu_factor(w), x[:1, :1].to(w.dtype).expand(*w.shape[:-1], 3)),),
                    "lu": lambda: la.lu(w),
                    "det": lambda: (la.det(w),),
                    "slogdet": lambda: la.slogdet(w),
                    "householder": lambda: (la.householder_product(
                        w, w.detach()[..., 0, :6]),) if w.shape[-2] >= w.shape[-1] else (),
                    "eigvalsh": lambda: (la.eigvalsh(w.detach() + w.detach().mT),
                                         la.eigvalsh(w + w.mT))}
            loss = loss + w.sum()
            for which in self.which:
                for o in outs[which]():
                    loss = loss + o.sum().float()
        return loss


_OPS = ["aten._linalg_svd", "aten.linalg_qr", "aten.linalg_lu_factor_ex",
        "aten._linalg_check_errors", "aten.linalg_lu_solve", "aten.lu_unpack", "aten.linalg_lu",
        "aten._linalg_det", "aten._linalg_slogdet", "aten._linalg_eigh",
        "aten.linalg_householder_product"]
_SQUARE = ("svd", "svdvals", "qr", "qr r", "lu_factor + lu_solve", "lu", "det", "slogdet",
           "eigvalsh")
_RECTANGULAR = ("svd", "svd full", "qr", "qr r", "lu", "householder")


@pytest.mark.parametrize("which,params", [
    (_SQUARE, [((48, 48), torch.float32), ((3, 20, 20), torch.float64)]),
    (_RECTANGULAR, [((40, 24), torch.float32), ((2, 24, 40), torch.float64)])],
    ids=["square", "tall-and-wide"])
def test_factorizations_match_the_allocator(which, params):
    """SVD's input copy and info check; QR's tau and geqrf/orgqr work arrays as long as LAPACK's
    own workspace query answers; linalg_lu's column-major copy, pivots and permutation;
    lu_unpack's permutation; det/slogdet's lu_det_P temporaries; eigvalsh's input copy and
    syevd's work arrays without and with eigenvectors; householder_product's orgqr work array
    and a strided tau's copy: each op's excess equal to
    the allocator's, forward and backward, fp32 and fp64, one matrix and a batch; the peak."""
    p, real, ops = _measure(lambda: _Factorized(which, params), (tapescope.spec((8, 4)),))
    checked = {name: _excess(ops, name) for name in _OPS}
    op_of = {"svd": "_linalg_svd", "svd full": "_linalg_svd", "svdvals": "_linalg_svd",
             "qr": "linalg_qr", "qr r": "linalg_qr", "lu_factor + lu_solve": "linalg_lu_solve",
             "lu": "linalg_lu", "det": "_linalg_det", "slogdet": "_linalg_slogdet",
             "eigvalsh": "_linalg_eigh", "householder": "linalg_householder_product"}
    assert all(checked[f"aten.{op_of[w]}"] for w in which), checked
    assert all(m == q for c in checked.values() for m, q in c), checked
    assert 0 <= real.peaks[1] - p.first_step_peak_bytes <= 12
    assert not p.facts["heuristics"].get("matrix function temporaries")


class _KnownMatrixExp(torch.nn.Module):
    """matrix_exp of matrices whose values the capture knows (a small integer buffer, scaled):
    each scale picks another Taylor degree."""

    SCALES = (1e-9, 1e-3, 0.05, 1.0)  # degree 1, 4, 12, and 18 with squarings (float32)

    def __init__(self):
        super().__init__()
        self.register_buffer("pattern", (torch.arange(64) % 7).view(8, 8))
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        loss = x.sum()
        for scale in self.SCALES:
            loss = loss + (x @ (torch.linalg.matrix_exp(self.pattern.float() * scale)
                                * self.w)).sum()
        return loss


def test_matrix_exp_matches_the_allocator():
    """Where the capture knows the matrix, its norm picks the degree as the kernel does, and
    the kernel's buffers at that degree are exact; no assumption is made."""
    p, real, ops = _measure(_KnownMatrixExp, (tapescope.spec((4, 8)),))
    checked = _excess(ops, "aten.linalg_matrix_exp")
    assert len(checked) == 4 and all(m == q for m, q in checked), checked
    assert len({m for m, _ in checked}) == 4  # four degrees, four different buffer sets
    assert 0 <= real.peaks[1] - p.first_step_peak_bytes <= 16  # the scales' wrapped numbers
    assert not [x for x in assumption_lines(p) if "linalg_matrix_exp" in x]


def test_orthogonal_parametrization_matches_the_allocator():
    """torch.nn.utils.parametrizations.orthogonal (matrix_exp): the parameter's values are
    unknown, so the norm is a named assumption (the degree-18 approximation with squarings, the
    most memory any norm takes). The backward's 2n x 2n block matrix has such a norm (the
    gradient's), and is exact; the forward at initialization exponentiates a zero matrix
    (degree 1): the assumption bounds it from above. The step's peak (in the backward) is the
    allocator's."""
    from torch.nn.utils.parametrizations import orthogonal

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 8))
        orthogonal(model[0], orthogonal_map="matrix_exp")
        return model

    p, real, ops = _measure(build, (tapescope.spec((32, 64)),), optimizer="adamw", prebuilt=True)
    (fm, fp), = _excess(ops, "aten.linalg_matrix_exp", "forward")
    (bm, bp), = _excess(ops, "aten.linalg_matrix_exp", "backward")
    assert bm == bp and fp >= fm, (bm, bp, fm, fp)
    assert p.first_step_peak_bytes == real.peaks[1] == 995_936
    lines = [x for x in assumption_lines(p) if "linalg_matrix_exp exponentiates" in x]
    assert len(lines) == 2 and "64 x 64" in lines[0] and "128 x 128" in lines[1], lines


def test_spectral_norm_matches_the_allocator():
    """spectral_norm's power iteration (mv, normalize, dot) on two layers: the peak exact."""
    from torch.nn.utils.parametrizations import spectral_norm

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 8))
        spectral_norm(model[0])
        spectral_norm(model[2])
        return model

    p, real, _ = _measure(build, (tapescope.spec((16, 32)),), optimizer="adamw", prebuilt=True)
    assert 0 <= real.peaks[1] - p.first_step_peak_bytes <= 12


class Shampoo(torch.optim.Optimizer):
    """A small Shampoo: per matrix parameter, left and right statistics G G^T and G^T G, their
    inverse fourth roots from eigh, the preconditioned gradient; vectors take plain SGD."""

    def __init__(self, params, lr=1e-2, eps=1e-6):
        super().__init__(params, dict(lr=lr, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if p.dim() != 2:
                    p.add_(g, alpha=-group["lr"])
                    continue
                state = self.state[p]
                if not state:
                    state["L"] = torch.zeros(p.shape[0], p.shape[0])
                    state["R"] = torch.zeros(p.shape[1], p.shape[1])
                state["L"].add_(g @ g.T)
                state["R"].add_(g.T @ g)
                roots = []
                for s in (state["L"], state["R"]):
                    w, v = torch.linalg.eigh(s + group["eps"] * torch.eye(s.shape[0]))
                    roots.append((v * w.clamp_min(group["eps"]).pow(-0.25)) @ v.T)
                p.add_(roots[0] @ g @ roots[1], alpha=-group["lr"])


class SOAP(torch.optim.Optimizer):
    """A small SOAP: Adam in the eigenbasis of Shampoo's statistics; the basis from eigh at the
    first step, then refreshed by one power iteration and a QR each step."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if p.dim() != 2:
                    p.add_(g, alpha=-group["lr"])
                    continue
                state = self.state[p]
                if not state:
                    state["L"], state["R"] = g @ g.T, g.T @ g
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                    state["QL"] = torch.linalg.eigh(state["L"])[1]
                    state["QR"] = torch.linalg.eigh(state["R"])[1]
                else:
                    state["L"].mul_(b2).add_(g @ g.T, alpha=1 - b2)
                    state["R"].mul_(b2).add_(g.T @ g, alpha=1 - b2)
                    state["QL"] = torch.linalg.qr(state["L"] @ state["QL"])[0]
                    state["QR"] = torch.linalg.qr(state["R"] @ state["QR"])[0]
                rotated = state["QL"].T @ g @ state["QR"]
                state["m"].mul_(b1).add_(rotated, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(rotated, rotated, value=1 - b2)
                step = state["m"] / (state["v"].sqrt() + group["eps"])
                p.add_(state["QL"] @ step @ state["QR"].T, alpha=-group["lr"])


@pytest.mark.parametrize("optimizer", [Shampoo, SOAP])
def test_second_order_optimizers_match_the_allocator(optimizer):
    """eigh per statistic (Shampoo), QR eigenbasis refreshes from the second step (SOAP): both
    steps' peaks exact."""
    build = lambda: torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.GELU(),  # noqa: E731
                                        torch.nn.Linear(64, 8))
    p, real, ops = _measure(build, (tapescope.spec((16, 48)),), optimizer=optimizer)
    linalg = [e for name in ("aten._linalg_eigh", "aten.linalg_qr") for e in _excess(ops, name)]
    assert linalg and all(m == q for m, q in linalg), linalg
    assert (p.first_step_peak_bytes, p.peak_bytes) == (real.peaks[1], real.peaks[2])


class _MaxAggregation(torch.nn.Module):
    """Messages along edges, max-aggregated per node (scatter_reduce "amax")."""

    def __init__(self, nodes, d):
        super().__init__()
        self.lin, self.nodes = torch.nn.Linear(d, d), nodes

    def forward(self, x, src, dst):
        msg = self.lin(x)[src]
        out = torch.zeros(self.nodes, msg.shape[1]).scatter_reduce(
            0, dst[:, None].expand_as(msg), msg, "amax", include_self=False)
        return out.sum()


def test_scatter_reduce_amax_backward_matches_the_allocator():
    """scatter_reduce("amax")'s backward multiplies the gradient by `src == value` (a bool
    mask): the CPU copies the mask as float (fidelity/promotion.py); every backward op exact."""
    torch.manual_seed(0)
    src, dst = torch.randint(0, 32, (96,)), torch.randint(0, 32, (96,))
    p, real, ops = _measure(lambda: _MaxAggregation(32, 64), (tapescope.spec((32, 64)), src, dst))
    backward = [(o.name, o.measured_excess, o.predicted_excess) for o in ops
                if o.phase == "backward"]
    assert any(name == "aten.mul" for name, _, _ in backward)
    assert all(m == q for _, m, q in backward), backward
    assert p.first_step_peak_bytes == real.peaks[1]


def test_eig_says_it_is_an_estimate():
    """The general eigendecomposition's buffers are not modelled, and the profile says so."""

    class Eig(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            return torch.linalg.eigvals(self.w.detach() + 0 * x.sum()).real.sum() + self.w.sum()

    p = tapescope.profile(Eig, tapescope.spec((4, 16)), optimizer="sgd")
    notes = p.facts["heuristics"].get("matrix function temporaries", [])
    assert any(n.startswith("linalg_eig:") for n in notes), p.facts["heuristics"]


def test_batched_factorization_backward_matches_the_allocator():
    """The backward of a batched wide QR and a batched tall LU: `bmm` of the expanded gradient
    (the split path's per-matrix copies), `tril`/`triu` of a stride-0 or narrowed batch (a
    contiguous copy), `linalg_solve_triangular` of a narrowed A (cloned column-major): every
    backward op exact."""

    class Batched(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wide = torch.nn.Parameter(torch.randn(2, 24, 40))
            self.tall = torch.nn.Parameter(torch.randn(2, 40, 24))

        def forward(self, x):
            q, r = torch.linalg.qr(self.wide)
            _, lower, upper = torch.linalg.lu(self.tall)
            return q.sum() + r.sum() + lower.sum() + upper.sum() + x.sum()

    p, real, ops = _measure(Batched, (tapescope.spec((4, 8)),))
    backward = [(o.name, o.measured_excess, o.predicted_excess) for o in ops
                if o.phase == "backward"]
    names = {name for name, _, _ in backward}
    assert {"aten.bmm", "aten.tril", "aten.triu", "aten.linalg_solve_triangular"} <= names
    assert all(m == q for _, m, q in backward), backward
    assert p.first_step_peak_bytes == real.peaks[1]
