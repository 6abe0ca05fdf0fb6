"""Fidelity rules: what a real kernel or branch does where a fake one would do otherwise.

See registry.py for what a rule is. Each module below holds the rules of one part of PyTorch;
importing this package registers them all. A new rule goes next to its siblings, with the PyTorch
source it follows and a test against real execution (tests/test_engine.py has the pattern: the op
sequence of the real step under torch.profiler, and the allocator's peak).
"""

from . import (attention, backward, batched_matmul, checks, collectives, contiguous,  # noqa: F401
               convolution, cpu_attention, cuda_kernels, data, detection, fake_kernels, float8,
               layouts, library_kernels, linalg, linalg_factorizations, linear, literals, losses,
               matmul, matrix_exp, norms, pooling, promotion, reductions, rnn, slow_convolution,
               sorting, triangular, upsampling, views, wrapped_numbers)  # registers
from .registry import (ANY_OP, BACKWARD_OP, CHECK, FORWARD_OP, FUNCTION, KERNEL, OUTPUT, RULES,
                       WORKSPACE, Alloc, FidelityContext, Free, FunctionRulesMode, Output, Rule,
                       RuleSet)

__all__ = ["RULES", "Rule", "RuleSet", "FidelityContext", "FunctionRulesMode", "FUNCTION",
           "FORWARD_OP", "BACKWARD_OP", "OUTPUT", "WORKSPACE", "CHECK", "KERNEL", "ANY_OP", "Alloc",
           "Free", "Output"]
