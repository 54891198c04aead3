"""Seeded random checks of `python -m engine serve` as a whole, through the official openai client: per trial one
server (a tiny random-weight model, the engine core in its own process) under random settings, and random requests
sent to it at once from threads, against a plain offline reference engine. Outside the default test run (about ten
seconds a trial); tests/engine/test_fuzz_engine.py runs one trial so that this stays runnable:

    python -m tests.engine.fuzz_serve --trials 40 --seed 0
    python -m tests.engine.fuzz_serve --trials 10 --seed 900 --arch mixtral --tp 2

Requests: completions (text or token-id prompts, batches of them, echo) and chat completions, streamed (with or
without usage) or not, with the engine fuzzer's parameters (tests/engine/fuzz_engine.py's random_params: greedy or
seeded sampling with n up to 3, top-k/top-p/min-p, penalties, logit bias, stop strings and token ids, min/max tokens,
logprobs and prompt logprobs, guided decoding, bad words, allowed tokens) and the server's own fields (stop strings
kept in the text, special tokens shown); some streams are closed by the client after a few chunks. Settings: small
KV caches (both preemption modes), chunked prefill, prefix caching, CPU graphs or eager, max_num_seqs, async
scheduling or n-gram speculative decoding (its sampled requests draw other samples by design: greedy ones compared
there), one or two API server processes, tensor parallelism (--tp).

On Llama, Qwen3 and Gemma 2 a server may also serve the LoRA tests' four PEFT adapters as models of their own
(`--lora-modules`) through fewer slots than adapters, the requests picking one or the base model.

Every request the client did not close must equal the reference's: per choice its text, finish and stop reasons,
the sampled tokens' logprobs (within 1e-3), and the usage. Afterwards the server's /metrics shows no request
running, waiting or swapped and no KV block in use, it serves an ordinary request, its log holds no traceback, and
SIGTERM ends it with status 0, leaving no process behind. The exit status is the number of failing trials (capped
at 100)."""
from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import httpx

from engine import LLM, SamplingParams
from engine.sampling_params import GuidedDecodingParams
from tests.engine.fuzz_engine import TEXT_PROMPTS, lora_adapters, random_params, reference, run_trials
from tests.engine.models_util import build_tiny_model_dir, random_token_ids
from tests.engine.test_server_isolation import MODEL, ServeProcess, _wait_gone, metric_samples

TOL = 1e-3
LORA_ARCHITECTURES = ("llama", "qwen3", "gemma2")   # those the LoRA tests check against PEFT
MAX_MODEL_LEN = 160   # the context of fuzz_engine.reference()
CHATS = [[{"role": "user", "content": "Hello"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The cat sat on the mat."}],
         [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "d e f"},
          {"role": "user", "content": "g"}]]


EXTRA_FIELDS = ("top_k", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "stop_token_ids",
                "include_stop_str_in_output", "skip_special_tokens", "bad_words", "allowed_token_ids",
                "prompt_logprobs", "guided_choice", "guided_regex", "response_format")


def guide_fields(guide: GuidedDecodingParams) -> dict:
    """A structured output as the OpenAI body says it (response_format) or vLLM's extras (guided_*)."""
    if guide.choice is not None:
        return {"guided_choice": guide.choice}
    if guide.regex is not None:
        return {"guided_regex": guide.regex}
    if guide.json is not None:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": guide.json}}}
    assert guide.json_object, guide
    return {"response_format": {"type": "json_object"}}


def openai_body(params: SamplingParams, chat: bool) -> dict:
    """`params` as an OpenAI request's sampling fields (vLLM's extras among them). The sampling knobs are always
    sent, so that the model's generation_config defaults (which the server applies to fields left out) never do."""
    body = {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "min_p": params.min_p, "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty, "repetition_penalty": params.repetition_penalty}
    optional = {"n": params.n > 1, "seed": params.seed is not None, "min_tokens": params.min_tokens > 0,
                "stop": bool(params.stop), "stop_token_ids": bool(params.stop_token_ids),
                "ignore_eos": params.ignore_eos, "include_stop_str_in_output": params.include_stop_str_in_output,
                "skip_special_tokens": not params.skip_special_tokens, "bad_words": bool(params.bad_words),
                "allowed_token_ids": params.allowed_token_ids is not None,
                "prompt_logprobs": params.prompt_logprobs is not None}
    body.update({name: getattr(params, name) for name, wanted in optional.items() if wanted})
    if params.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if params.logprobs is not None:
        body.update({"logprobs": True, "top_logprobs": params.logprobs} if chat else {"logprobs": params.logprobs})
    if params.guided_decoding is not None:
        body.update(guide_fields(params.guided_decoding))
    return body


def random_request(rng: random.Random, trial: int, index: int, max_n: int, guided: bool, loras: list) -> dict:
    """One request: its endpoint, its model (the base or one of `loras`), prompt (a list of them for a batched
    completion) or messages, its parameters (fuzz_engine's draw, with the server's own fields: echo, stop strings
    kept in the text, special tokens in it) and its OpenAI body, whether it streams, and after how many chunks the
    client closes it (None: never)."""
    chat = rng.random() < 0.35
    params = random_params(rng, max_n, guided)
    extra = {}
    if params.stop and rng.random() < 0.3:
        extra["include_stop_str_in_output"] = True
    if rng.random() < 0.1:
        extra["skip_special_tokens"] = False
    if chat:
        prompt = rng.choice(CHATS)
    else:   # one prompt, or a batch of one kind (the API takes strings or token-id lists, not a mix)
        as_ids = rng.random() < 0.5
        batch = [random_token_ids(rng.randint(1, 60), seed=trial * 100 + index * 10 + i) if as_ids
                 else rng.choice(TEXT_PROMPTS) for i in range(rng.randint(1, 3) if rng.random() < 0.2 else 1)]
        prompt = batch if len(batch) > 1 else batch[0]
    echo = not chat and rng.random() < 0.15
    stream = rng.random() < 0.6
    if stream or echo:
        # Refused with stream, as vLLM does; echo's logprobs begin with the prompt's, as many as the completion's.
        extra["prompt_logprobs"] = params.logprobs if echo else None
    params = dataclasses.replace(params, **extra)
    body = openai_body(params, chat)
    if echo:
        body["echo"] = True
        if params.prompt_logprobs is not None:
            del body["prompt_logprobs"]   # implied by echo with logprobs
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    close_after = rng.randint(0, 3) if stream and rng.random() < 0.25 else None
    return {"chat": chat, "prompt": prompt, "params": params, "body": body, "stream": stream,
            "close_after": close_after, "delay_s": rng.uniform(0, 0.4), "lora": rng.choice([None, *loras])}


def prompts_of(request: dict) -> list:
    """The request's prompts for the offline engine (a completion's batch, or one)."""
    prompt = request["prompt"]
    batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    return [{"prompt_token_ids": p} if isinstance(p, list) else p for p in batch]


def expected_choices(request: dict, outputs: list, tokenizer) -> tuple[list, int, int]:
    """The reference's RequestOutputs of one request as (per choice: index, text, finish and stop reasons, the
    tokens' logprobs or None), prompt tokens, completion tokens."""
    choices, echo, n = [], request["body"].get("echo", False), len(outputs[0].outputs)
    for i, output in enumerate(outputs):
        prompt_text = ""
        if echo:
            prompt_text = output.prompt if output.prompt is not None else tokenizer.decode(output.prompt_token_ids)
        for c in output.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]
                if echo:
                    logprobs = [None if e is None else e[t].logprob
                                for e, t in zip(output.prompt_logprobs, output.prompt_token_ids)] + logprobs
            choices.append((i * n + c.index, prompt_text + c.text, c.finish_reason, c.stop_reason, logprobs))
    return (choices, sum(len(o.prompt_token_ids) for o in outputs),
            sum(len(c.token_ids) for o in outputs for c in o.outputs))


def _logprob_values(logprobs, chat: bool) -> list | None:
    if logprobs is None:
        return None
    if chat:
        return [entry.logprob for entry in logprobs.content or ()]
    return list(logprobs.token_logprobs)


def send(client, request: dict) -> tuple[list, int, int] | None:
    """The request through the server, as expected_choices gives the reference's; None when the client closed
    it."""
    time.sleep(request["delay_s"])
    chat, body = request["chat"], dict(request["body"])
    # vLLM's fields, and OpenAI's that the client's create() does not take for this endpoint.
    extra = {k: body.pop(k) for k in EXTRA_FIELDS if k in body and (k != "response_format" or not chat)}
    if chat:
        create = lambda **kw: client.chat.completions.create(messages=request["prompt"], **kw)  # noqa: E731
    else:
        create = lambda **kw: client.completions.create(prompt=request["prompt"], **kw)  # noqa: E731
    model = MODEL if request["lora"] is None else request["lora"].lora_name
    response = create(model=model, stream=request["stream"], extra_body=extra, **body)
    if not request["stream"]:
        choices = [(c.index, c.message.content if chat else c.text, c.finish_reason,
                    (c.model_extra or {}).get("stop_reason"), _logprob_values(c.logprobs, chat))
                   for c in response.choices]
        return sorted(choices), response.usage.prompt_tokens, response.usage.completion_tokens
    texts, finish, stop, logprobs, usage = {}, {}, {}, {}, None
    for number, chunk in enumerate(response):
        if request["close_after"] is not None and number >= request["close_after"]:
            response.close()
            return None
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = (c.delta.content if chat else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index], stop[c.index] = c.finish_reason, (c.model_extra or {}).get("stop_reason")
            values = _logprob_values(c.logprobs, chat)
            if values is not None:
                logprobs[c.index] = logprobs.get(c.index, []) + values
    want_logprobs = request["params"].logprobs is not None
    choices = [(i, texts[i], finish.get(i), stop.get(i), logprobs.get(i, []) if want_logprobs else None)
               for i in sorted(texts)]
    if usage is None:
        return choices, None, None
    return choices, usage.prompt_tokens, usage.completion_tokens


def _close(a: list | None, b: list | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(x is y if x is None or y is None else abs(x - y) <= TOL for x, y in zip(a, b))


def compare(label: str, want: tuple, got: tuple) -> list[str]:
    (want_choices, want_prompt, want_completion), (got_choices, got_prompt, got_completion) = want, got
    problems = []
    strip = lambda choices: [c[:4] for c in choices]  # noqa: E731
    if strip(want_choices) != strip(got_choices):
        problems.append(f"{label}\n  expected {strip(want_choices)}\n  got      {strip(got_choices)}")
    else:
        for (index, *_, a), (*_, b) in zip(want_choices, got_choices):
            if not _close(a, b):
                problems.append(f"{label}: choice {index}'s logprobs differ\n  expected {a}\n  got      {b}")
    if got_prompt is not None and (got_prompt, got_completion) != (want_prompt, want_completion):
        problems.append(f"{label}: usage {got_prompt}+{got_completion}, expected {want_prompt}+{want_completion}")
    return problems


def random_settings(rng: random.Random, max_num_seqs: int, loras: list) -> list[str]:
    """The server's command-line flags (LoRA among them: fewer adapter slots than adapters)."""
    flags = ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(rng.choice([24, 40, 200])),
             "--max-num-seqs", str(max_num_seqs), "--preemption-mode", rng.choice(["recompute", "swap"]),
             "--swap-space", "0.05"]
    budget = rng.choice([32, 64, 512])
    flags += ["--max-num-batched-tokens", str(budget)]
    if budget < MAX_MODEL_LEN:
        flags.append("--enable-chunked-prefill")
    flags.append("--enable-prefix-caching" if rng.random() < 0.7 else "--no-enable-prefix-caching")
    if rng.random() < 0.5:
        flags.append("--enforce-eager")
    if rng.random() < 0.3:
        flags += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": %d, '
                  '"prompt_lookup_max": 3, "prompt_lookup_min": 1}' % rng.choice([1, 3])]
    else:
        flags.append("--async-scheduling" if rng.random() < 0.5 else "--no-async-scheduling")
    if rng.random() < 0.3:
        flags += ["--api-server-count", "2"]
    if loras and rng.random() < 0.3:
        max_loras = rng.randint(1, len(loras))
        flags += ["--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras",
                  str(rng.randint(max_loras, len(loras))), "--lora-modules",
                  *(f"{lora.lora_name}={lora.lora_path}" for lora in loras)]
    return flags


def settle(server: ServeProcess, timeout_s: float = 30.0) -> list[str]:
    """Wait until /metrics shows the engine idle (no request running, waiting or swapped, no KV block in use);
    the problems if it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        left = {name: metric_samples(text, name) for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                      "vllm:num_requests_swapped", "vllm:kv_cache_usage_perc")}
        if all(values and not any(values) for values in left.values()):
            return []
        if time.monotonic() > deadline:
            return [f"the engine is not idle {timeout_s:.0f} s after the last answer: {left}"]
        time.sleep(0.2)


def trial(model_dir: str, ref: LLM, rng: random.Random, trial_number: int, counts: dict, loras: list,
          tp: int = 1) -> list[str]:
    max_num_seqs = rng.choice([2, 4, 16])
    flags = random_settings(rng, max_num_seqs, loras) + (["--tensor-parallel-size", str(tp)] if tp > 1 else [])
    speculative = "--speculative-config" in flags
    served_loras = loras if "--enable-lora" in flags else []
    requests = [random_request(rng, trial_number, i, max_num_seqs, not speculative, served_loras)
                for i in range(rng.randint(1, 12))]
    expected = []
    for request in requests:
        params = request["params"]
        outputs = (ref.chat(request["prompt"], params, use_tqdm=False, lora_request=request["lora"])
                   if request["chat"] else
                   ref.generate(prompts_of(request), params, use_tqdm=False, lora_request=request["lora"]))
        expected.append(expected_choices(request, outputs, ref.get_tokenizer()))
    server = ServeProcess(model_dir, *flags)
    problems = []
    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(send, server.client, r) for r in requests]
            for i, (request, future) in enumerate(zip(requests, futures)):
                try:
                    got = future.result()
                except Exception as e:   # an error answer or a broken connection: the trial fails
                    problems.append(f"request {i} {request}: {type(e).__name__}: {e}")
                    continue
                if got is None:
                    counts["closed"] += 1
                # Rejection sampling draws other samples than plain decoding: under speculation only greedy
                # requests compare.
                elif not speculative or request["params"].temperature == 0:
                    counts["compared"] += 1
                    problems += compare(f"request {i} {request}", expected[i], got)
        problems += settle(server)
        answer = server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                                  extra_body={"ignore_eos": True})
        if answer.usage.completion_tokens != 4:
            problems.append(f"an ordinary request after the trial got {answer.usage.completion_tokens} tokens of 4")
    except Exception:
        problems.append(traceback.format_exc())
    finally:
        pids = server.tree()
        status = server.stop()
        if status != 0:
            problems.append(f"the server ended with status {status} on SIGTERM")
        left = _wait_gone(pids)
        if left:
            problems.append(f"processes left after SIGTERM: {sorted(left)}")
        log = "".join(server.lines)
        if "Traceback" in log:
            problems.append("the server's log holds a traceback:\n" + log[-4000:])
    return [f"flags {' '.join(flags)}"] + problems if problems else []


def run(trials: int, seed: int, arch: str = "llama", tp: int = 1, log=print) -> int:
    """`trials` seeded trials (the servers on `tp` tensor-parallel ranks); returns how many failed (each
    printed)."""
    work_dir = tempfile.mkdtemp(prefix=f"fuzz-serve-{arch}-")
    model_dir = build_tiny_model_dir(arch, f"{work_dir}/model")
    loras = lora_adapters(model_dir, work_dir) if arch in LORA_ARCHITECTURES else []
    ref = reference(model_dir, enable_lora=bool(loras))
    counts = {"compared": 0, "closed": 0}
    try:
        failed = run_trials("serve trial", seed, trials, f"({arch}, tp {tp})", log,
                            lambda rng, number: trial(model_dir, ref, rng, number, counts, loras, tp))
    finally:
        ref.llm_engine.shutdown()
    log(f"serve: {trials} trials from seed {seed} ({arch}, tp {tp}), {failed} failed; {counts['compared']} requests "
        f"compared, {counts['closed']} streams closed by the client")
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", default="llama", help="a tiny architecture of tests/engine/models_util.py")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the servers (gloo on CPU)")
    args = parser.parse_args(argv)
    return min(run(args.trials, args.seed, args.arch, args.tp), 100)


if __name__ == "__main__":
    sys.exit(main())
