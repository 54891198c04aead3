"""AsyncLLMEngine on a tiny random-weight Llama: streaming equals LLM.generate, aborts free every block, the
event loop stays responsive while steps and tokenization run."""
import asyncio
import time

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncLLMEngine

PROMPTS = ["Once upon a time", "The quick brown fox jumps over", "def main():\n    print(", "Numbers: 0 1 2 3"]
NUM_KV_BLOCKS = 48
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture
def engine(model_dir):
    engine = AsyncLLMEngine.from_args(model_dir, num_kv_blocks=NUM_KV_BLOCKS)
    yield engine
    engine._engine_thread.shutdown(wait=True)
    engine._tokenizer_pool.shutdown(wait=True)


def run(coro):
    """asyncio.run with a deadline, so a hang fails the test instead of the suite."""
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def assert_idle(engine: AsyncLLMEngine) -> None:
    core = engine.engine
    assert not core.has_unfinished_requests()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


async def _drain(engine, prompt, params, request_id):
    outputs = []
    async for output in engine.generate(prompt, params, request_id):
        outputs.append(output)
    return outputs


def test_concurrent_streams_equal_llm_generate(engine, llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(PROMPTS, params, use_tqdm=False)

    async def main():
        results = await asyncio.gather(*(_drain(engine, p, params, f"r{i}") for i, p in enumerate(PROMPTS)))
        await engine.shutdown()
        return results

    for outputs, reference in zip(run(main()), expected):
        final = outputs[-1]
        assert final.finished and all(not o.finished for o in outputs[:-1])
        assert final.outputs[0].token_ids == reference.outputs[0].token_ids
        assert final.outputs[0].text == reference.outputs[0].text
        assert final.prompt_token_ids == reference.prompt_token_ids
        # Cumulative outputs: each one extends the previous one by the token(s) of one step.
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == list(range(1, 13))
    assert_idle(engine)


def test_abort_ends_the_stream_and_frees_blocks(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        outputs = []
        async for output in engine.generate(PROMPTS[0], params, "victim"):
            outputs.append(output)
            if len(outputs) == 3:
                await engine.abort("victim")
        await engine.abort("unknown-id")   # ignored
        await engine.shutdown()
        return outputs

    outputs = run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 200
    assert_idle(engine)


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_consumer_leaving_aborts_the_request(engine, how, monkeypatch):
    core = engine.engine
    aborted = []

    def recording_abort(request_id):
        output = type(core).abort_request(core, request_id)
        aborted.append(output)
        return output

    monkeypatch.setattr(core, "abort_request", recording_abort)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    streaming = asyncio.Event()

    async def consume(num_outputs):
        count = 0
        async for _ in engine.generate(PROMPTS[1], params, "leaver"):
            count += 1
            streaming.set()
            if count == num_outputs:
                break

    async def main():
        if how == "break":   # the async generator is closed when the loop leaves it
            await consume(3)
        else:
            task = asyncio.create_task(consume(10_000))
            # Cancelled once it streams: the request is running then. (A fixed sleep raced a slow machine: a task
            # cancelled before the engine thread took the request never adds it, and there is nothing to abort.)
            await asyncio.wait_for(streaming.wait(), timeout=120)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # A generator left by `break` is closed when garbage-collected (asyncio schedules its aclose), a
        # cancelled one at once; either way its abort is queued on the engine thread.
        for _ in range(100):
            stats = await engine.get_metrics()
            if stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert await engine.reset_prefix_cache()
        await engine.shutdown()
        return stats

    stats = run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert_idle(engine)
    # Aborted while running, not left to finish its 200 tokens.
    assert len(aborted) == 1 and aborted[0].outputs[0].finish_reason == "abort"
    assert len(aborted[0].outputs[0].token_ids) < 200


@pytest.mark.parametrize("yields", [0, 1, 2, 3, 5, 8])
def test_consumer_cancelled_before_its_request_runs_leaves_nothing_behind(engine, yields):
    """Cancelled while tokenizing or while its add waits for the engine thread: the request either never enters
    the engine or is aborted there; no blocks, no running or waiting request, and the engine serves the next one."""
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    follow_up = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main():
        task = asyncio.create_task(_drain(engine, PROMPTS[1], params, "early"))
        for _ in range(yields):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            stats = await engine.get_metrics()
            if stats.num_running == 0 and stats.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        after = await _drain(engine, PROMPTS[2], follow_up, "next")
        assert await engine.reset_prefix_cache()
        await engine.shutdown()
        return stats, after

    stats, after = run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 4
    assert_idle(engine)


def test_bad_request_raises_and_leaves_others_running(engine, llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]

    async def bad(prompt, params):
        with pytest.raises(ValueError):
            async for _ in engine.generate(prompt, params, "bad"):
                pass

    async def main():
        good = asyncio.create_task(_drain(engine, PROMPTS[2], params, "good"))
        await asyncio.sleep(0)
        await bad("", params)                                  # empty prompt
        await bad({"prompt_token_ids": [10**6]}, params)       # outside the vocabulary
        await bad(PROMPTS[0], SamplingParams(n=257, max_tokens=4))   # more sequences than max_num_seqs
        outputs = await good
        await engine.shutdown()
        return outputs

    assert run(main())[-1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert_idle(engine)


def test_event_loop_stays_responsive_during_slow_steps_and_tokenization(engine, monkeypatch):
    """Steps and tokenization run on worker threads: a ticker on the event loop keeps ticking while a
    (deliberately slowed) step or tokenization is in progress."""
    core = engine.engine
    real_step, real_encode = core.step, engine._encode

    def slow_step():
        time.sleep(0.05)
        return real_step()

    def slow_encode(text, add_special_tokens=True):
        time.sleep(0.5)
        return real_encode(text, add_special_tokens)

    monkeypatch.setattr(core, "step", slow_step)
    monkeypatch.setattr(engine, "_encode", slow_encode)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def main():
        gaps, done = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        # A pre-tokenized request runs while another one's (slow) tokenization is in progress.
        first = asyncio.create_task(_drain(engine, {"prompt_token_ids": [5, 6, 7, 8]}, params, "ids"))
        second = asyncio.create_task(_drain(engine, PROMPTS[0], params, "text"))
        first_outputs = await first
        first_done = time.perf_counter()
        await second
        second_done = time.perf_counter()
        done.set()
        await tick
        await engine.shutdown()
        return gaps, first_outputs, second_done - first_done

    gaps, first_outputs, lag = run(main())
    assert first_outputs[-1].outputs[0].finish_reason == "length"
    assert lag > 0.0   # the text request was still tokenizing when the token-id request had finished
    assert max(gaps) < 0.04, f"event loop blocked for {max(gaps):.3f} s"
    assert_idle(engine)


def test_a_step_that_raises_fails_its_requests_and_the_loop_goes_on(engine, llm, monkeypatch):
    """Should LLMEngine.step itself raise (its own isolation bypassed), the requests in the engine end with an
    error output, the engine is not dead, and the next request runs as LLM.generate does."""
    core = engine.engine
    real_step, raised = core.step, []

    def step_raising_once():
        if not raised and core.requests:
            raised.append(True)
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(core, "step", step_raising_once)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids

    async def main():
        failed = await _drain(engine, PROMPTS[0], params, "victim")
        await engine.check_health()
        after = await _drain(engine, PROMPTS[1], params, "after")
        await engine.shutdown()
        return failed, after

    failed, after = run(main())
    assert raised and failed[-1].finished and "injected step failure" in failed[-1].error
    assert after[-1].error is None and after[-1].outputs[0].token_ids == expected
    assert_idle(engine)
