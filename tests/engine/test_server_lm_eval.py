"""lm-eval's `local-completions` model (loglikelihood through /v1/completions with echo + logprobs) against the
loopback server gives the same accuracy, and per-choice loglikelihoods within float32 rounding, as lm-eval's
`hf` model (transformers) on the same SmolLM2 weights, on a small local multiple-choice task."""
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
    return str(directory)


def _evaluate(model: str, model_args: str, task_dir: str) -> tuple[float, list[list[float]]]:
    from lm_eval.tasks import TaskManager

    # Only this task (indexing lm-eval's own thousands of tasks takes ~10-30 s), no bootstrapped stderr.
    task_manager = TaskManager(include_path=task_dir, include_defaults=False)
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                                      task_manager=task_manager, batch_size=1, bootstrap_iters=0)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    logliks = [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]
    return results["results"][TASK]["acc,none"], logliks


def test_local_completions_equals_hf(smollm2_dir, task_dir):
    engine = AsyncLLMEngine.from_args(smollm2_dir, dtype="float32", num_kv_blocks=64, max_model_len=256)
    with ServerThread(build_app(engine, served_model_names=["smollm2"])) as server:
        server_acc, server_logliks = _evaluate(
            "local-completions", f"model=smollm2,base_url={server.url}/v1/completions,tokenizer={smollm2_dir},"
                                 f"tokenizer_backend=huggingface,num_concurrent=1,max_retries=1", task_dir)
    hf_acc, hf_logliks = _evaluate("hf", f"pretrained={smollm2_dir},dtype=float32,device=cpu", task_dir)
    assert server_acc == hf_acc
    assert len(server_logliks) == len(ITEMS)
    for ours, theirs in zip(server_logliks, hf_logliks):
        assert ours == pytest.approx(theirs, abs=2e-3)
    assert server_acc > 1 / 3   # better than chance: the task and the scoring are not degenerate
