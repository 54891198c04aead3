"""bench.spec_decode_cpu's engines and report, with stand-in engines (no model runs here): which speculative engines
measure() builds, and what it reports of each."""

from __future__ import annotations

from types import SimpleNamespace

import engine
from bench import spec_decode_cpu


class _Runner:
    def __init__(self, graphs: bool, few_rows: int):
        self.graphs, self.few_rows, self.skinny_max_rows = graphs, few_rows, 0

    def set_spec_decode_graphs(self, on: bool) -> bool:
        return bool(on) and self.graphs

    def set_skinny_max_rows(self, rows: int) -> int:
        self.skinny_max_rows = rows if rows <= self.few_rows else 0
        return self.skinny_max_rows


def _fake_llm(built: list, graphs: bool, few_rows: int):
    class FakeLLM:
        def __init__(self, model, speculative_config=None, **options):
            self.spec = speculative_config
            self.llm_engine = SimpleNamespace(model_runner=_Runner(graphs, few_rows), shutdown=self.shutdown,
                                              spec_decode_stats=SimpleNamespace(num_drafts=0, num_draft_tokens=0,
                                                                                num_accepted_tokens=0))
            self.closed = False
            built.append(self)

        def shutdown(self):
            self.closed = True
    return FakeLLM


def _measure(monkeypatch, *, graphs: bool, few_rows: int) -> tuple[dict, list]:
    built = []
    monkeypatch.setattr(engine, "LLM", _fake_llm(built, graphs, few_rows))

    def run(llm, prompts, max_tokens):   # the few-row engine twice as fast as plain, the rest as fast
        runner = llm.llm_engine.model_runner
        stats = llm.llm_engine.spec_decode_stats
        if llm.spec:
            stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens = (
                stats.num_drafts + 2, stats.num_draft_tokens + 10, stats.num_accepted_tokens + 9)
        return [[1, 2, 3]] * len(prompts), 0.5 if runner.skinny_max_rows else 1.0, dict.fromkeys(
            spec_decode_cpu.REQUEST_PARTS, 0.1)
    monkeypatch.setattr(spec_decode_cpu, "run", run)
    report = spec_decode_cpu.measure("model", repeats=1, verify_graphs=True, few_row_verify=True, log=lambda *a: None)
    return report, built


def test_the_few_row_verification_engine_is_built_and_reported_where_it_can_run(monkeypatch):
    report, built = _measure(monkeypatch, graphs=True, few_rows=8)
    assert report["engines"] == ["plain", "ngram", "ngram_graphs", "ngram_graphs_few_rows"]
    few = built[3].llm_engine.model_runner
    assert few.skinny_max_rows == 6   # k + 1 = 6 rows a verification
    grounded = report["workloads"]["grounded"]
    assert grounded["graphs_speedup"] == 1.0 and grounded["few_rows_graphs_speedup"] == 2.0
    assert grounded["ngram_graphs_few_rows_tokens_per_s"] == 2 * grounded["ngram_graphs_tokens_per_s"]
    assert grounded["few_rows_graphs_same_leading_tokens"] == [3] * len(spec_decode_cpu.GROUNDED)
    assert all(llm.closed for llm in built)


def test_no_few_row_engine_where_the_layers_cannot_take_it_or_without_graphs(monkeypatch):
    report, built = _measure(monkeypatch, graphs=True, few_rows=0)   # e.g. a quantized model: no few-row path
    assert report["engines"] == ["plain", "ngram", "ngram_graphs"] and len(built) == 4
    assert "few_rows_graphs_speedup" not in report["workloads"]["grounded"]
    assert all(llm.closed for llm in built)
    report, built = _measure(monkeypatch, graphs=False, few_rows=8)   # a CPU: no graphs to verify in
    assert report["engines"] == ["plain", "ngram"] and len(built) == 3


def test_step_parts_time_the_runner_s_parts_and_put_the_methods_back(tmp_path):
    """On a tiny random model with n-gram proposals: every step counted, the runner's parts timed (each within the
    runner's share, itself within the step), and afterwards the runner's and the engine's own methods again."""
    from engine import LLM, SamplingParams
    from tests.engine.models_util import build_tiny_model_dir

    model_dir = build_tiny_model_dir("llama", str(tmp_path / "model"))
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=256, enforce_eager=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    try:
        runner, core = llm.llm_engine.model_runner, llm.llm_engine
        prompt = {"prompt_token_ids": [5, 6, 7, 8] * 6}
        with spec_decode_cpu.step_parts(llm) as spent:
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert spent["steps"] >= 2
        assert {"step", "execute_model", "forward", "logits", "propose"} <= set(spent)
        assert 0 < spent["forward"] <= spent["execute_model"] <= spent["step"]
        assert spent["propose"] <= spent["execute_model"]
        assert all(name not in vars(runner) for name in spec_decode_cpu.STEP_PARTS) and "step" not in vars(core)
    finally:
        llm.llm_engine.shutdown()
