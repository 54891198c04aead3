"""Fairness under heavy valid requests (issue 21, item 4): with max_num_seqs_per_request=k, a request's
sequences take at most k rows of a step while other requests run or wait (the rest take turns, least recently run
first), an n > max_num_seqs - k request does not keep others from being admitted, and a request alone runs all of
its sequences. Greedy tokens are the same as without the limit."""
from engine import SamplingParams
from tests.engine.models_util import make_engine, random_token_ids

HEAVY = SamplingParams(n=16, temperature=0.0, max_tokens=8, ignore_eos=True)
LIGHT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT_HEAVY, PROMPT_LIGHT = random_token_ids(20, seed=1), random_token_ids(20, seed=2)


def run(llama_dir, limit, *, light: bool = True):
    engine = make_engine(llama_dir, max_model_len=128, num_kv_blocks=256, max_num_seqs=16,
                         max_num_seqs_per_request=limit)
    engine.add_request("heavy", {"prompt_token_ids": PROMPT_HEAVY}, HEAVY)
    rows_per_step, finished = [], {}
    original = engine.executor.execute_model

    def spy(scheduler_output):
        heavy_ids = {s.seq_id for s in engine.requests["heavy"].seqs} if "heavy" in engine.requests else set()
        rows = set(scheduler_output.num_scheduled_tokens)
        rows_per_step.append((len(rows & heavy_ids), len(rows - heavy_ids), len(scheduler_output.sample_from)))
        return original(scheduler_output)
    engine.executor.execute_model = spy
    engine.step()   # the heavy prompt
    if light:
        engine.add_request("light", {"prompt_token_ids": PROMPT_LIGHT}, LIGHT)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished, rows_per_step


def _finished_outputs(engine) -> dict:
    """Step `engine` until every request ends: request id -> its completions' token ids in order (no errors)."""
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                finished[out.request_id] = [c.token_ids for c in out.outputs]
    return finished


def _add(engine, name: str, prompt: list[int], params) -> None:
    """A request (a beam search for BeamSearchParams) of token ids."""
    from engine.core.beam_search import BeamSearchParams

    add = engine.add_beam_request if isinstance(params, BeamSearchParams) else engine.add_request
    add(name, {"prompt_token_ids": prompt}, params)


def _each_alone(engine_for, requests) -> dict:
    """_finished_outputs of each (name, prompt, params) of `requests` on an engine of its own without the limit."""
    alone = {}
    for name, prompt, params in requests:
        engine = engine_for(None)
        _add(engine, name, prompt, params)
        alone.update(_finished_outputs(engine))
    return alone


def _count_rows(engine) -> list[int]:
    """The rows of each step `engine` runs from now on (scheduled sequences and forks sampling), appended as they
    run."""
    rows = []
    original = engine.executor.execute_model

    def spy(scheduler_output):
        rows.append(len(set(scheduler_output.num_scheduled_tokens) | set(scheduler_output.sample_from)))
        return original(scheduler_output)
    engine.executor.execute_model = spy
    return rows


def test_a_heavy_request_takes_its_share_while_another_runs(llama_dir):
    free, _ = run(llama_dir, None)
    fair, rows = run(llama_dir, 4)
    # Same greedy tokens; the light request finished while the heavy one still had sequences to run.
    assert {k: [c.token_ids for c in v.outputs] for k, v in fair.items()} == \
           {k: [c.token_ids for c in v.outputs] for k, v in free.items()}
    with_light = [heavy for heavy, light, _ in rows if light]
    assert with_light and max(with_light) <= 4
    # The light request was admitted at once (max_num_seqs=16 and the heavy request has 16 sequences) and
    # ran in every step until it finished: 8 tokens in 8 steps after its admission.
    assert len(with_light) == 8
    # The heavy request alone again runs everything it has.
    assert max(heavy for heavy, light, _ in rows[-3:] if not light) > 4


def test_a_request_alone_runs_all_its_sequences(llama_dir):
    _, rows = run(llama_dir, 4, light=False)
    assert max(heavy for heavy, _, _ in rows[1:]) == 16


def test_an_n_max_num_seqs_request_admitted_beside_another_forks_within_the_rows(llama_dir):
    """Admission counts a request's share, not its n: an n = max_num_seqs request and a light one admitted in one
    step had 16 forks + 1 rows for 16 (the step failed, and both requests with it). The forks past the step's
    rows compute their prompt's last token themselves later; greedy tokens are those of the requests run alone."""
    def engine_for(limit):
        return make_engine(llama_dir, max_model_len=128, num_kv_blocks=256, max_num_seqs=16,
                           max_num_seqs_per_request=limit)

    alone = _each_alone(engine_for, [("light", PROMPT_LIGHT, LIGHT), ("heavy", PROMPT_HEAVY, HEAVY)])
    engine = engine_for(4)
    rows = _count_rows(engine)
    engine.add_request("light", {"prompt_token_ids": PROMPT_LIGHT}, LIGHT)
    engine.add_request("heavy", {"prompt_token_ids": PROMPT_HEAVY}, HEAVY)
    together = _finished_outputs(engine)
    assert together == alone
    assert rows[0] == 16 and max(rows) <= 16


def test_a_beam_search_takes_a_row_a_beam_under_the_limit(llama_dir):
    """A beam search is exempt from the per-request limit (its beams step together), so admission counts every
    beam's row: counted as its share, a width-2 beam search under a limit of 1 left room for one more request than
    the rows held, and the step of max_num_seqs + 1 rows failed every request in it (found by tests/engine/
    fuzz_engine.py abort --seed 9210). Every step within the rows; the outputs those of each request alone."""
    from engine.core.beam_search import BeamSearchParams

    beam = ("beam", PROMPT_HEAVY, BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    lights = [(f"light{i}", random_token_ids(12 + i, seed=10 + i), LIGHT) for i in range(3)]

    def engine_for(limit):
        return make_engine(llama_dir, max_model_len=128, num_kv_blocks=256, max_num_seqs=3,
                           max_num_seqs_per_request=limit)

    alone = _each_alone(engine_for, [beam, *lights])
    engine = engine_for(1)
    rows = _count_rows(engine)
    _add(engine, *beam)
    engine.step()   # the beam search's prompt, then its two beams from the next step
    for light in lights:
        _add(engine, *light)
    assert _finished_outputs(engine) == alone
    assert max(rows) <= 3
