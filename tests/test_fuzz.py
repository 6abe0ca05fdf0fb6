"""Random module stacks: each step's peak equals the CPU allocator's, or both PyTorch and tapescope
refuse it (tests/fuzz_models.py). A few examples here; benchmarks/fuzz_models.py runs thousands,
known gaps included (docs/fuzz.md)."""

from hypothesis import HealthCheck, given, settings

from .fuzz_models import GAP_LAYERS, check, fuzz_cases


@settings(max_examples=12, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(fuzz_cases(losses=("mean", "cross-entropy"), exclude=GAP_LAYERS))
def test_random_models_match_the_allocator_or_are_refused(case):
    outcome = check(case)
    assert outcome.kind in ("match", "refused"), (case.describe(), outcome)
