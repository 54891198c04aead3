"""lm-eval against the loopback server, compared with lm-eval's `hf` model (transformers) on the same SmolLM2
weights, on two small local tasks:

- multiple choice through `local-completions` (loglikelihood: /v1/completions with echo + logprobs): the same
  accuracy, per-choice loglikelihoods within float32 rounding;
- greedy generation with stop sequences (`generate_until`) through `local-completions` and, with the chat template
  applied, `local-chat-completions`: the same text as transformers generates."""
import json

import pytest

from tests.extras import require_serve_extra  # noqa: E402

(lm_eval,) = require_serve_extra("lm_eval")

from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402

ITEMS = [
    ("The capital of France is", [" Paris", " London", " Berlin"], 0),
    ("Water freezes at zero degrees", [" Fahrenheit", " Celsius", " Kelvin"], 1),
    ("The largest planet of the solar system is", [" Mars", " Venus", " Jupiter"], 2),
    ("One, two, three, four,", [" five", " seven", " ten"], 0),
    ("The opposite of hot is", [" warm", " cold", " red"], 1),
    ("A week has seven", [" months", " hours", " days"], 2),
    ("Cats like to chase", [" mice", " cars", " planets"], 0),
    ("The sun rises in the", [" west", " east", " north"], 1),
    ("Monday, Tuesday,", [" Sunday", " Friday", " Wednesday"], 2),
    ("Snow is usually", [" white", " green", " purple"], 0),
]
TASK = "engine_tiny_mc"
GEN_ITEMS = [
    ("Q: What is 2 plus 3?\nA:", "5"),
    ("Q: Name the capital of France.\nA:", "Paris"),
    ("Q: What color is the sky on a clear day?\nA:", "blue"),
    ("Q: How many days are in a week?\nA:", "7"),
]
GEN_TASK = "engine_tiny_gen"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm_eval_task")
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
    (directory / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    gen_data = directory / "gen.jsonl"
    gen_data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN_ITEMS))
    # Greedy, cut at the first newline or "Q:" (lm-eval sends them as the request's stop strings).
    (directory / f"{GEN_TASK}.yaml").write_text(f"""task: {GEN_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen_data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "Q:"]
  do_sample: false
  max_gen_toks: 16
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return str(directory)


def _evaluate(model: str, model_args: str, task_dir: str, tasks: list[str], *, chat: bool = False) -> dict:
    """lm-eval's samples, by task: each a list of the docs' responses in doc order."""
    from lm_eval.tasks import TaskManager

    # Only these tasks (indexing lm-eval's own thousands of tasks takes ~10-30 s), no bootstrapped stderr.
    task_manager = TaskManager(include_path=task_dir, include_defaults=False)
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                      task_manager=task_manager, batch_size=1, bootstrap_iters=0,
                                      apply_chat_template=chat)
    return {task: [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]
            for task in tasks} | {"acc": results["results"].get(TASK, {}).get("acc,none")}


def _logliks(responses: list) -> list[list[float]]:
    return [[float(resp[0][0]) for resp in sample] for sample in responses]


def _texts(responses: list) -> list[str]:
    return [sample[0][0] for sample in responses]


def test_local_completions_equals_hf(smollm2_dir, task_dir):
    engine = AsyncLLMEngine.from_args(smollm2_dir, dtype="float32", num_kv_blocks=64, max_model_len=256)
    client_args = f"model=smollm2,tokenizer={smollm2_dir},tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
    with ServerThread(build_app(engine, served_model_names=["smollm2"])) as server:
        ours = _evaluate("local-completions", f"{client_args},base_url={server.url}/v1/completions", task_dir,
                         [TASK, GEN_TASK])
        ours_chat = _evaluate("local-chat-completions", f"{client_args},base_url={server.url}/v1/chat/completions",
                              task_dir, [GEN_TASK], chat=True)
    hf_args = f"pretrained={smollm2_dir},dtype=float32,device=cpu"
    theirs = _evaluate("hf", hf_args, task_dir, [TASK, GEN_TASK])
    theirs_chat = _evaluate("hf", hf_args, task_dir, [GEN_TASK], chat=True)

    assert ours["acc"] == theirs["acc"]
    assert len(ours[TASK]) == len(ITEMS)
    for server_logliks, hf_logliks in zip(_logliks(ours[TASK]), _logliks(theirs[TASK])):
        assert server_logliks == pytest.approx(hf_logliks, abs=2e-3)
    assert ours["acc"] > 1 / 3   # better than chance: the task and the scoring are not degenerate

    # Greedy generation cut at the stop strings: the same text, on both routes.
    assert _texts(ours[GEN_TASK]) == _texts(theirs[GEN_TASK])
    assert _texts(ours_chat[GEN_TASK]) == _texts(theirs_chat[GEN_TASK])
    texts = _texts(ours[GEN_TASK]) + _texts(ours_chat[GEN_TASK])
    assert all(text and "\n" not in text and "Q:" not in text for text in texts), texts   # the stops applied
    assert len(set(texts)) > 1   # not degenerate
