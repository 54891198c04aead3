"""Seeded random checks of the engine as a whole: mixed requests under random engine settings against a plain
reference engine. Outside the default test run (a few seconds a trial); tests/engine/test_fuzz_engine.py runs one
trial of each mode so that this stays runnable:

    python -m tests.engine.fuzz_engine async --trials 80 --seed 100
    python -m tests.engine.fuzz_engine configs --trials 100 --seed 1000 --arch qwen3_moe
    python -m tests.engine.fuzz_engine abort --trials 60 --seed 20000 --tp 2
    python -m tests.engine.fuzz_engine lora --trials 25

Modes:
- ``async``: the same engine settings with async scheduling off and on: outputs equal (greedy and seeded sampling:
  tokens, text, finish and stop reasons, prompt logprobs' tokens; logprobs within 1e-3).
- ``configs``: a plain reference (no prefix caching, a large KV cache, eager, every request in one step) against
  random settings: small caches (both preemption modes), chunked prefill, prefix caching, CPU graphs,
  max_num_seqs and max_num_seqs_per_request, async scheduling or n-gram speculative decoding (its sampled requests
  draw other samples by design: greedy ones compared there), guided decoding, bad words, allowed tokens. Tokens,
  text and reasons equal; logprobs within 1e-3.
- ``abort``: requests added at random steps (beam searches among them), some aborted at random steps, every output
  kind: each request that was not aborted ends as in the reference.
- ``lora``: each request on one of the LoRA tests' four PEFT adapters or the base model, under random settings with
  fewer adapter slots (``max_loras``) and host slots (``max_cpu_loras``) than adapters: outputs as in a reference
  with a slot for each.

Every mode also checks that every KV block (and swap block) is free at the end. A failing trial prints its
settings and requests; the exit status is the number of failing trials (capped at 100)."""
from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import traceback

from engine import LLM, LoRARequest, SamplingParams
from engine.core.beam_search import BeamSearchParams
from engine.sampling_params import GuidedDecodingParams, RequestOutputKind
from tests.engine.models_util import build_tiny_model_dir, random_token_ids

GUIDES = [GuidedDecodingParams(choice=["yes", "no", "maybe"]), GuidedDecodingParams(regex=r"[a-c]{2,6}"),
          GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
          GuidedDecodingParams(json_object=True)]
TEXT_PROMPTS = ["The cat sat on the mat.", "Hello", "def main():", "a b c d e f g a b c d e f g"]


def random_params(rng: random.Random, max_n: int, guided: bool = False) -> SamplingParams:
    """One request's parameters: greedy or seeded sampling with any of the filters, penalties, stops, logprobs."""
    kw: dict = {"max_tokens": rng.randint(1, 30)}
    if rng.random() < 0.4:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randint(0, 1000),
                  n=min(rng.choice([1, 1, 2, 3]), max_n))
        if rng.random() < 0.5:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.5:
            kw["top_k"] = rng.choice([1, 5, 40])
        if rng.random() < 0.3:
            kw["min_p"] = rng.choice([0.05, 0.2])
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.5:
        kw["ignore_eos"] = True
    if rng.random() < 0.3:
        kw["stop"] = rng.choice([["the"], [" a", "e"], ["."]])
    if rng.random() < 0.3:
        kw.update(repetition_penalty=rng.choice([1.1, 1.5]), presence_penalty=rng.choice([0.0, 0.5]),
                  frequency_penalty=rng.choice([0.0, 0.3]))
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randint(0, 200): rng.choice([-100.0, 5.0])}
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.15:
        kw["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.15:
        kw["stop_token_ids"] = [rng.randint(0, 200)]
    if guided:
        r = rng.random()
        if r < 0.2:
            kw.update(guided_decoding=rng.choice(GUIDES), stop=[])
        elif r < 0.3:
            kw["bad_words"] = [rng.choice(["the", " a", "cat"])]
        elif r < 0.4:
            kw["allowed_token_ids"] = sorted(rng.sample(range(5, 400), 20))
    return SamplingParams(**kw)


def random_prompts(rng: random.Random, trial: int, most: int) -> list:
    """Token-id prompts, some sharing a prefix (prefix caching), and text prompts."""
    shared = random_token_ids(rng.randint(16, 48), seed=trial)
    prompts = []
    for i in range(rng.randint(1, most)):
        r = rng.random()
        if r < 0.4:
            prompts.append({"prompt_token_ids": shared + random_token_ids(rng.randint(1, 20), seed=trial * 100 + i)})
        elif r < 0.7:
            prompts.append({"prompt_token_ids": random_token_ids(rng.randint(1, 70), seed=trial * 100 + i)})
        else:
            prompts.append(rng.choice(TEXT_PROMPTS))
    return prompts


def random_settings(rng: random.Random, max_num_seqs: int, tensor_parallel_size: int = 1) -> dict:
    settings = dict(tensor_parallel_size=tensor_parallel_size, max_model_len=160,
                    num_kv_blocks=rng.choice([24, 40, 200]),
                    max_num_batched_tokens=rng.choice([32, 64, 512]), max_num_seqs=max_num_seqs,
                    enable_prefix_caching=rng.random() < 0.7, preemption_mode=rng.choice(["recompute", "swap"]),
                    swap_space=0.05, enforce_eager=rng.random() < 0.5)
    if rng.random() < 0.3:
        settings["max_num_seqs_per_request"] = rng.choice([1, 2])
    if settings["max_num_batched_tokens"] < settings["max_model_len"]:
        settings["enable_chunked_prefill"] = True
    return settings


def reference(model_dir: str, enable_lora: bool = False) -> LLM:
    lora = dict(enable_lora=True, max_loras=4) if enable_lora else {}
    return LLM(model_dir, max_model_len=160, num_kv_blocks=400, max_num_seqs=64, enable_prefix_caching=False,
               enforce_eager=True, **lora)


def summary(outputs) -> list:
    """Per request: per completion its index, token ids, text, finish and stop reasons; then the token sets of its
    prompt logprobs (the values: logprobs_close)."""
    return [[(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            + [None if o.prompt_logprobs is None else [None if e is None else sorted(e) for e in o.prompt_logprobs]]
            for o in outputs]


def logprobs_close(expected, got, tol: float = 1e-3) -> bool:
    """The sampled tokens' logprobs and cumulative logprobs within `tol` (a step's batch changes the rounding)."""
    for a, b in zip(expected, got):
        for ca, cb in zip(a.outputs, b.outputs):
            if (ca.logprobs is None) != (cb.logprobs is None):
                return False
            if ca.logprobs is not None and abs(ca.cumulative_logprob - cb.cumulative_logprob) > tol * len(ca.logprobs):
                return False
            for ea, eb in zip(ca.logprobs or (), cb.logprobs or ()):
                if set(ea) != set(eb) or any(abs(ea[t].logprob - eb[t].logprob) > tol for t in ea):
                    return False
    return True


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"KV blocks leaked: {bm.num_blocks - bm.num_free_blocks}"
    assert bm.num_free_swap_blocks == bm.num_swap_blocks, "swap blocks leaked"


def generate(model_dir: str, settings: dict, prompts: list, params: list, lora_request=None):
    """The requests through a fresh engine of `settings`, which must give every block back."""
    llm = LLM(model_dir, **settings)
    try:
        outputs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
        assert_all_blocks_free(llm)
        return outputs
    finally:
        llm.llm_engine.shutdown()


def differences(expected: list, got: list, labels: list, compare) -> list[str]:
    """The requests `compare` whose summaries differ, each named by its label (its parameters)."""
    return [f"request {i} {labels[i]}\n  expected {expected[i]}\n  got      {got[i]}"
            for i in compare if expected[i] != got[i]]


def verdict(settings: dict, expected: list, got: list, labels: list, problems=()) -> list[str]:
    """A trial's problems (none: it passed): the outputs that differ, logprobs beyond 1e-3, and `problems` found
    before; headed by the settings."""
    problems = [*problems, *differences(summary(expected), summary(got), labels, range(len(expected)))]
    if not logprobs_close(expected, got):
        problems.append("logprobs differ by more than 1e-3")
    return [f"settings {settings}"] + problems if problems else []


def trial_async(model_dir: str, ref: LLM, rng: random.Random, trial: int, tp: int) -> list[str]:
    max_num_seqs = rng.choice([2, 4, 16])
    prompts = random_prompts(rng, trial, 10)
    params = [random_params(rng, max_num_seqs) for _ in prompts]
    settings = random_settings(rng, max_num_seqs, tp)
    off, on = (generate(model_dir, {**settings, "async_scheduling": a}, prompts, params) for a in (False, True))
    return verdict(settings, off, on, params)


def trial_configs(model_dir: str, ref: LLM, rng: random.Random, trial: int, tp: int) -> list[str]:
    max_num_seqs = rng.choice([2, 4, 16])
    prompts = random_prompts(rng, trial, 10)
    spec = rng.random() < 0.35
    params = [random_params(rng, max_num_seqs, guided=not spec) for _ in prompts]
    settings = random_settings(rng, max_num_seqs, tp)
    if spec:
        settings["speculative_config"] = {"method": "ngram", "num_speculative_tokens": rng.choice([1, 3, 5]),
                                          "prompt_lookup_max": rng.choice([2, 4]), "prompt_lookup_min": 1}
    else:
        settings["async_scheduling"] = rng.random() < 0.5
    expected = ref.generate(prompts, params, use_tqdm=False)
    got = generate(model_dir, settings, prompts, params)
    # Rejection sampling draws other samples than plain decoding: under speculation only greedy requests compare.
    compare = [i for i, p in enumerate(params) if not spec or p.temperature == 0]
    return verdict(settings, [expected[i] for i in compare], [got[i] for i in compare], [params[i] for i in compare])


def trial_abort(model_dir: str, ref: LLM, rng: random.Random, trial: int, tp: int) -> list[str]:
    max_num_seqs = rng.choice([2, 4, 16])
    prompts = random_prompts(rng, trial, 10)
    requests = []   # (id, prompt, params or BeamSearchParams, step added, step aborted or None)
    for i, prompt in enumerate(prompts):
        if rng.random() < 0.15:
            params = BeamSearchParams(beam_width=rng.randint(1, min(3, max_num_seqs)), max_tokens=rng.randint(1, 12),
                                      ignore_eos=rng.random() < 0.5)
        else:
            params = dataclasses.replace(random_params(rng, max_num_seqs),
                                         output_kind=rng.choice(list(RequestOutputKind)))
        added = rng.randint(0, 12)
        aborted = rng.randint(0, 25) if rng.random() < 0.3 else None
        requests.append((f"r{i}", prompt, params, added, aborted))
    settings = {**random_settings(rng, max_num_seqs, tp), "async_scheduling": rng.random() < 0.6}
    llm = LLM(model_dir, **settings)
    engine, final, aborted_ids, step = llm.llm_engine, {}, set(), 0
    try:
        while step <= 12 or engine.has_unfinished_requests():
            for request_id, prompt, params, added, aborted in requests:
                if added == step:
                    if isinstance(params, BeamSearchParams):
                        text, token_ids = engine.process_prompt(prompt)
                        engine.add_beam_request(request_id, {"prompt": text, "prompt_token_ids": token_ids}, params)
                    else:
                        engine.add_request(request_id, prompt, params)
                if aborted == step and added <= step and request_id not in final:
                    engine.abort_request(request_id)
                    aborted_ids.add(request_id)
            for output in engine.step():
                if output.finished:
                    final[output.request_id] = output
            step += 1
            assert step < 2000, "no progress in 2000 steps"
        assert_all_blocks_free(llm)
    finally:
        engine.shutdown()
    survivors = [r for r in requests if r[0] not in aborted_ids]
    missing = [r[0] for r in survivors if r[0] not in final]
    if missing:
        return [f"settings {settings}", f"no final output for {missing}"]
    plain = [r for r in survivors if not isinstance(r[2], BeamSearchParams)]
    expected = ref.generate([r[1] for r in plain],
                            [dataclasses.replace(r[2], output_kind=RequestOutputKind.FINAL_ONLY) for r in plain],
                            use_tqdm=False)
    problems = []
    for request_id, prompt, params, _, _ in survivors:
        if isinstance(params, BeamSearchParams):
            (beams,) = ref.beam_search([prompt], params)
            num_prompt_tokens = len(ref.llm_engine.process_prompt(prompt)[1])
            want = [(s.tokens[num_prompt_tokens:], s.finish_reason) for s in beams.sequences]
            got = [(list(c.token_ids), c.finish_reason) for c in final[request_id].outputs]
            if want != got:
                problems.append(f"beam request {request_id} {params}\n  expected {want}\n  got      {got}")
    return verdict(settings, expected, [final[r[0]] for r in plain], [r[2] for r in plain], problems)


def trial_lora(model_dir: str, ref: LLM, rng: random.Random, trial: int, tp: int, loras: list) -> list[str]:
    max_num_seqs = rng.choice([2, 4, 16])
    prompts = random_prompts(rng, trial, 10)
    params = [random_params(rng, max_num_seqs) for _ in prompts]
    adapters = [rng.choice([None, *loras]) for _ in prompts]
    max_loras = rng.randint(1, len(loras))
    settings = {**random_settings(rng, max_num_seqs, tp), "enable_lora": True, "max_loras": max_loras,
                "max_cpu_loras": rng.randint(max_loras, len(loras)), "async_scheduling": rng.random() < 0.5}
    expected = ref.generate(prompts, params, lora_request=adapters, use_tqdm=False)
    got = generate(model_dir, settings, prompts, params, lora_request=adapters)
    return verdict(settings, expected, got, [(p, a and a.lora_name) for p, a in zip(params, adapters)])


MODES = {"async": trial_async, "configs": trial_configs, "abort": trial_abort, "lora": trial_lora}


def lora_adapters(model_dir: str, out_dir: str) -> list:
    """The LoRA tests' four PEFT adapters of the model (ranks 4 to 16, rslora, rank and alpha patterns)."""
    from tests.engine.lora_util import ADAPTERS, make_peft_adapter

    return [LoRARequest(name, i + 1, make_peft_adapter(model_dir, f"{out_dir}/{name}", seed=i, **options))
            for i, (name, options) in enumerate(ADAPTERS.items())]


def run_trials(label: str, seed: int, trials: int, where: str, log, one_trial) -> int:
    """Trials `seed` to `seed + trials - 1` of `one_trial(rng, trial)` (which returns its problems); each failing one
    (problems, or an exception) logged with its number; returns how many failed."""
    failed = 0
    for trial in range(seed, seed + trials):
        try:
            problems = one_trial(random.Random(trial), trial)
        except Exception:
            problems = [traceback.format_exc()]
        if problems:
            failed += 1
            log(f"{label} {trial} {where} failed:\n" + "\n".join(problems))
    return failed


def run(mode: str, trials: int, seed: int, arch: str = "llama", tp: int = 1, log=print) -> int:
    """`trials` seeded trials of `mode` (the engines under test on `tp` ranks); returns how many failed (each
    printed)."""
    work_dir = tempfile.mkdtemp(prefix=f"fuzz-{arch}-")
    model_dir = build_tiny_model_dir(arch, f"{work_dir}/model")
    extra = {}
    if mode == "lora":
        extra["loras"] = lora_adapters(model_dir, work_dir)
    ref = reference(model_dir, enable_lora=mode == "lora")
    try:
        failed = run_trials(f"{mode} trial", seed, trials, f"({arch}, tp {tp})", log,
                            lambda rng, trial: MODES[mode](model_dir, ref, rng, trial, tp, **extra))
    finally:
        ref.llm_engine.shutdown()
    log(f"{mode}: {trials} trials from seed {seed} ({arch}, tp {tp}), {failed} failed")
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=list(MODES))
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", default="llama", help="a tiny architecture of tests/engine/models_util.py")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks of the engines under test (gloo on CPU)")
    args = parser.parse_args(argv)
    return min(run(args.mode, args.trials, args.seed, args.arch, args.tp), 100)


if __name__ == "__main__":
    sys.exit(main())
