"""One seeded trial of each mode of the engine's random checks (tests/engine/fuzz_engine.py, run longer by hand), so
that the fuzzer stays runnable. The seeds are trials that failed before an n > 1 request held its rows from
admission (the scheduler let three sequences into a step of two rows); the LoRA trial runs four adapters through
two slots with a cache that preempts."""
import pytest

from tests.engine import fuzz_engine


@pytest.mark.parametrize("mode, seed", [("async", 1), ("configs", 3), ("abort", 7), ("lora", 7)])
def test_a_fuzz_trial_passes(mode, seed):
    lines = []
    assert fuzz_engine.run(mode, 1, seed, log=lines.append) == 0, "\n".join(lines)
