"""One seeded trial of each mode of the engine's random checks (tests/engine/fuzz_engine.py and, for the server,
tests/engine/fuzz_serve.py, run longer by hand), so that they stay runnable. The engine seeds are trials that failed
before an n > 1 request held its rows from admission (the scheduler let three sequences into a step of two rows);
the LoRA trial runs four adapters through two slots with a cache that preempts. The server trial sends eleven
requests at once (chat and completions, streamed and not, two closed by the client, a batched prompt, echo, guided
decoding, bad words, allowed tokens, n > 1, logprobs, LoRA adapters through fewer slots) to a server with chunked
prefill and prefix caching, on two tensor-parallel ranks: before the engine core process shut down in order at
SIGTERM, its worker then failed in gloo ("Connection closed by peer") and the trial found the traceback."""
import re

import pytest

from tests.engine import fuzz_engine
from tests.extras import require_serve_extra


@pytest.mark.parametrize("mode, seed", [("async", 1), ("configs", 3), ("abort", 7), ("lora", 7)])
def test_a_fuzz_trial_passes(mode, seed):
    lines = []
    assert fuzz_engine.run(mode, 1, seed, log=lines.append) == 0, "\n".join(lines)


def test_a_serve_fuzz_trial_passes():
    require_serve_extra("openai", "httpx")
    from tests.engine import fuzz_serve

    lines = []
    assert fuzz_serve.run(1, 95, tp=2, log=lines.append) == 0, "\n".join(lines)
    compared, closed = map(int, re.search(r"(\d+) requests compared, (\d+) streams closed", lines[-1]).groups())
    assert (compared, closed) == (9, 2), lines[-1]   # the trial reaches what it should
