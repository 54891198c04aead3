"""The decoder layers' few-row path (meta.skinny: pagedkernels.skinny_gemm with the norms and residual adds fused in,
engine/models/llama.py) against the ordinary layers, on CPU through the op's PyTorch twin: eager steps, the decode
graphs' ladder (the CUDA-graph double), and the compiled forward, as on CUDA. The Triton kernel itself is checked
against a float64 oracle in tests/pagedkernels/test_skinny_gemm.py; on a GPU the suite's batch-1 part runs both."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from engine.platform import DevicePolicy
from tests.engine.test_cuda_graph_runner import RecordingGraphRunner, _run, _sequences, make_runner

skinny_module = importlib.import_module("pagedkernels.skinny_gemm")


@pytest.fixture
def skinny_calls(monkeypatch):
    """Every skinny_gemm the twin computes, as (rows, norm fused, residual fused); and the CPU's weight prepacking
    off (a prepacked layer has no plain weight for the few-row path, so the runner would leave the path off)."""
    calls = []
    twin = skinny_module._skinny_torch

    def spy(x, weight, bias, norm_weight, eps, residual, out, gated=None):
        calls.append((x.shape[0], norm_weight is not None, residual is not None))
        return twin(x, weight, bias, norm_weight, eps, residual, out, gated)

    monkeypatch.setattr(skinny_module, "_skinny_torch", spy)
    for_device = DevicePolicy.for_device.__func__
    monkeypatch.setattr(DevicePolicy, "for_device", classmethod(
        lambda cls, device: dataclasses.replace(for_device(cls, device), prepack_linears=False)))
    return calls


# mistral: a sliding window; qwen2: q/k/v biases; qwen3: q/k norms; phi3: partial rotary, LongRoPE.
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_eager_steps_equal_the_ordinary_layers(tiny_model_dir, arch, skinny_calls, monkeypatch):
    """Steps of up to 8 tokens (the decode steps of 3, 1, 5 and 3 sequences) take the few-row path, the prefill and
    the decode step of 10 sequences the ordinary one; logits and KV cache as the ordinary layers'."""
    model_dir = tiny_model_dir(arch)
    ordinary = make_runner(model_dir, enforce_eager=True)
    assert ordinary.skinny_max_rows == 0
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "8")
    skinny = make_runner(model_dir, enforce_eager=True)
    assert skinny.skinny_max_rows == 8 and all(layer.skinny for layer in skinny.model.model.layers)
    expected = _run(ordinary, _sequences(ordinary.config.vocab_size))
    assert skinny_calls == []
    got = _run(skinny, _sequences(skinny.config.vocab_size))
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    torch.testing.assert_close(skinny.kv_cache, ordinary.kv_cache, atol=1e-4, rtol=1e-4, equal_nan=True)
    layers = skinny.config.num_hidden_layers
    # four products a layer (norm+qkv, o+add, norm+gate_up, SiLU-and-mul+down+add) in each of the four small steps
    assert skinny_calls == [call for rows in (3, 1, 5, 3)
                            for call in [(rows, True, False), (rows, False, True)] * 2 * layers]


def test_few_row_layers_and_ordinary_ones_in_one_model(tiny_model_dir, skinny_calls, monkeypatch):
    """Qwen3-MoE's dense layer (mlp_only_layers) takes the few-row path, its expert layer the ordinary one: the stream
    handed from one kind of layer to the other gives the ordinary model's logits."""
    model_dir = tiny_model_dir("qwen3_moe")
    ordinary = make_runner(model_dir, enforce_eager=True)
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "8")
    mixed = make_runner(model_dir, enforce_eager=True)
    assert [layer.skinny for layer in mixed.model.model.layers] == [False, True]
    expected = _run(ordinary, _sequences(ordinary.config.vocab_size))
    got = _run(mixed, _sequences(mixed.config.vocab_size))
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert {rows for rows, _, _ in skinny_calls} == {3, 1, 5}


def test_decode_graphs_take_the_few_row_path_up_to_the_limit(tiny_model_dir, skinny_calls, monkeypatch):
    """The decode graphs' ladder (the CUDA-graph double): graphs of up to ENGINE_SKINNY_GEMM_MAX_ROWS rows capture the
    few-row path, larger ones the ordinary layers; results as the eager runner's."""
    model_dir = tiny_model_dir("qwen3")
    eager = make_runner(model_dir, enforce_eager=True)
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "4")
    graphed = make_runner(model_dir, enforce_eager=False, graph_runner_class=RecordingGraphRunner)
    monkeypatch.setattr(RecordingGraphRunner, "replays", [])
    monkeypatch.setattr(RecordingGraphRunner, "model_runner", graphed, raising=False)
    expected = _run(eager, _sequences(eager.config.vocab_size))
    got = _run(graphed, _sequences(graphed.config.vocab_size))
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert [r["batch_size"] for r in RecordingGraphRunner.replays] == [4, 1, 8, 4]
    # the graphs of 4 and 1 rows run skinny products (capture and replays), the graph of 8 and the eager steps none
    assert {rows for rows, _, _ in skinny_calls} == {4, 1}


def test_compiled_forward_takes_the_few_row_path(tiny_model_dir, skinny_calls, monkeypatch):
    """torch.compile (inductor, fullgraph, dynamic: as on CUDA) traces the few-row layers with the skinny custom ops,
    the residual stream updated in place inside the graph, and a separate graph for the ordinary steps."""
    model_dir = tiny_model_dir("qwen3")
    eager = make_runner(model_dir, enforce_eager=True, compile_model=False)
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "8")
    compiled = make_runner(model_dir, enforce_eager=True, compile_model=True)
    expected = _run(eager, _sequences(eager.config.vocab_size))
    got = _run(compiled, _sequences(compiled.config.vocab_size))
    assert compiled.compiled, "compilation fell back to eager"
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert {rows for rows, _, _ in skinny_calls} == {3, 1, 5}


def test_the_path_stays_off_where_it_cannot_run(tiny_model_dir, monkeypatch):
    """Prepacked CPU weights (the CPU's default), another architecture's layers (OPT), or the variable unset: the
    runner leaves it off. A bad value is an error naming the variable."""
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "8")
    assert make_runner(tiny_model_dir("llama"), enforce_eager=True).skinny_max_rows == 0   # prepacked
    for_device = DevicePolicy.for_device.__func__
    monkeypatch.setattr(DevicePolicy, "for_device", classmethod(
        lambda cls, device: dataclasses.replace(for_device(cls, device), prepack_linears=False)))
    assert make_runner(tiny_model_dir("opt"), enforce_eager=True).skinny_max_rows == 0
    assert make_runner(tiny_model_dir("gemma2"), enforce_eager=True).skinny_max_rows == 0   # LlamaModel, its own layers
    assert make_runner(tiny_model_dir("llama"), enforce_eager=True).skinny_max_rows == 8
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "")
    assert make_runner(tiny_model_dir("llama"), enforce_eager=True).skinny_max_rows == 0
    for bad in ("9", "-1", "yes"):
        monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", bad)
        with pytest.raises(ValueError, match="ENGINE_SKINNY_GEMM_MAX_ROWS"):
            DevicePolicy.for_device("cpu")


def test_the_default_is_one_row_on_cuda_and_off_on_cpu(monkeypatch):
    """Measured on an H200 (batch-1 decode 1.51x cuBLAS at the Qwen3-0.6B shape), the few-row path is on by default
    for steps of one token on CUDA; on CPU off (prepacked weights); the variable overrides either, 0 included."""
    monkeypatch.delenv("ENGINE_SKINNY_GEMM_MAX_ROWS", raising=False)
    assert DevicePolicy.for_device("cuda").skinny_gemm_max_rows == 1
    assert DevicePolicy.for_device("cpu").skinny_gemm_max_rows == 0
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "0")
    assert DevicePolicy.for_device("cuda").skinny_gemm_max_rows == 0
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "4")
    assert DevicePolicy.for_device("cpu").skinny_gemm_max_rows == 4


def test_turned_on_and_off_on_a_built_runner(tiny_model_dir, skinny_calls, monkeypatch):
    """set_skinny_max_rows (bench.engine_gpu's A/B on one engine): the decode graphs whose side changes are captured
    again by the next step that needs them; results as the ordinary layers' either way."""
    model_dir = tiny_model_dir("llama")
    eager = make_runner(model_dir, enforce_eager=True)
    graphed = make_runner(model_dir, enforce_eager=False, graph_runner_class=RecordingGraphRunner,
                          capture_graphs_at_startup=True)
    monkeypatch.setattr(RecordingGraphRunner, "replays", [])
    monkeypatch.setattr(RecordingGraphRunner, "model_runner", graphed, raising=False)
    assert graphed.skinny_max_rows == 0 and sorted(graphed.graphs) == [1, 2, 4, 8]
    assert graphed.set_skinny_max_rows(2) == 2 and sorted(graphed.graphs) == [4, 8]
    expected = _run(eager, _sequences(eager.config.vocab_size))
    got = _run(graphed, _sequences(graphed.config.vocab_size))
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert {rows for rows, _, _ in skinny_calls} == {1}   # the one-sequence step's graph
    assert graphed.set_skinny_max_rows(0) == 0 and sorted(graphed.graphs) == [4, 8]
    with pytest.raises(ValueError, match="rows must be an int from 0 to 8"):
        graphed.set_skinny_max_rows(9)


@pytest.mark.triton
def test_the_triton_kernels_in_the_few_row_layers(tiny_model_dir, monkeypatch):
    """Every op on its Triton kernel (interpreted on CPU, compiled on a GPU): skinny_gemm's norm, SiLU-and-mul and
    residual variants and rotary_embedding_and_cache inside the few-row layers give the ordinary layers' logits."""
    import pagedkernels as pk

    for_device = DevicePolicy.for_device.__func__
    monkeypatch.setattr(DevicePolicy, "for_device", classmethod(
        lambda cls, device: dataclasses.replace(for_device(cls, device), prepack_linears=False)))
    model_dir = tiny_model_dir("qwen3")
    ordinary = make_runner(model_dir, enforce_eager=True)
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "8")
    skinny = make_runner(model_dir, enforce_eager=True)
    with pk.use_backend("triton"):
        expected = _run(ordinary, _sequences(ordinary.config.vocab_size))
        got = _run(skinny, _sequences(skinny.config.vocab_size))
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    torch.testing.assert_close(skinny.kv_cache, ordinary.kv_cache, atol=1e-4, rtol=1e-4, equal_nan=True)


def test_the_rotary_and_cache_write_in_the_decode_kernel(tiny_model_dir, monkeypatch):
    """DevicePolicy.decode_fused_rope (ENGINE_DECODE_FUSED_ROPE on CUDA): the few-row layers' decode steps rotate q/k,
    write the new K/V and attend in the decode split kernel (pagedkernels.rotary_cache_decode_attention, Triton,
    interpreted on CPU), as the engine's Attention layer calls it, on Qwen3 (q/k norms; the kernel's other
    variants, partial and GPT-J rotary among them, are tests/pagedkernels/test_rotary_cache_decode.py's); logits and
    KV cache as the same layers' two kernels (rotary_embedding_and_cache, then the decode op), and every decode step
    of the few-row layers took it (the ordinary layers' steps rotate before the attention layer, as ever)."""
    import pagedkernels as pk
    from pagedkernels import decode_attention

    for_device = DevicePolicy.for_device.__func__
    monkeypatch.setattr(DevicePolicy, "for_device", classmethod(
        lambda cls, device: dataclasses.replace(for_device(cls, device), prepack_linears=False)))
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "8")
    model_dir = tiny_model_dir("qwen3")
    runners = []
    for fused in (False, True):
        runner = make_runner(model_dir, enforce_eager=True)
        for layer in runner.attention_layers:   # the decode op in eager steps, as on CUDA
            layer.use_decode_kernel = True
        assert runner.set_decode_fused_rope(fused) is fused
        runners.append(runner)
    calls = []
    real = decode_attention._decode_triton
    monkeypatch.setattr(decode_attention, "_decode_triton",
                        lambda *args, **kwargs: (calls.append(args[-1] is not None), real(*args, **kwargs))[1])
    # The products on their PyTorch twin (their kernel is test_the_triton_kernels_in_the_few_row_layers'): the
    # interpreter's time goes to the attention
    monkeypatch.setattr(skinny_module, "_skinny_triton", skinny_module._skinny_torch)
    with pk.use_backend("triton"):
        expected = _run(runners[0], _sequences(runners[0].config.vocab_size))
        assert calls and not any(calls)
        calls.clear()
        got = _run(runners[1], _sequences(runners[1].config.vocab_size))
    # a call a layer in each decode step: those of 3, 1 and 5 sequences fused, 10 (past the few-row limit of 8) not, 3
    layers = runners[1].config.num_hidden_layers
    assert calls == [True] * 3 * layers + [False] * layers + [True] * layers
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step}: {m}")
    # the keys as one float32 rounding apart at most (Qwen3's norm sums its squares in another order)
    torch.testing.assert_close(runners[1].kv_cache, runners[0].kv_cache, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("arch, compiled", [("qwen3", False), ("llama", True)])
def test_the_step_graphs_fold_the_final_norm_into_the_lm_head(tiny_model_dir, skinny_calls, monkeypatch, arch,
                                                              compiled):
    """set_skinny_lm_head (DevicePolicy.skinny_lm_head, ENGINE_SKINNY_LM_HEAD on CUDA): the step graphs of the few-row
    layers (the CUDA-graph double; the compiled forward and tail too) end in one few-row product for the LM head with
    the final RMSNorm in its prologue (LlamaForCausalLM.skinny_logits), tied (qwen3) or untied (llama); the graph
    above the limit and the eager steps keep the norm and the LM head apart. Logits as the eager runner's."""
    model_dir = tiny_model_dir(arch)
    eager = make_runner(model_dir, enforce_eager=True, compile_model=False)
    assert eager.set_skinny_lm_head(True) is False   # no step graphs
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "4")
    graphed = make_runner(model_dir, enforce_eager=False, graph_runner_class=RecordingGraphRunner,
                          compile_model=compiled)
    monkeypatch.setattr(RecordingGraphRunner, "replays", [])
    monkeypatch.setattr(RecordingGraphRunner, "model_runner", graphed, raising=False)
    compiled_calls = []   # meta.skinny of each call of the compiled forward
    compiled_forward = graphed.forward
    graphed.forward = lambda input_ids, positions, meta, **kwargs: (
        compiled_calls.append(meta.skinny), compiled_forward(input_ids, positions, meta, **kwargs))[1]
    assert graphed.skinny_head is False   # DevicePolicy.skinny_lm_head: off on CPU
    assert graphed.set_skinny_lm_head(True) and graphed.model.can_fold_final_norm()
    heads = []   # the rows of every product on the LM head's weight (with the final norm's weight in its prologue)
    head_weight, norm_weight = graphed.model.lm_head.weight, graphed.model.model.norm.weight
    spy = skinny_module._skinny_torch
    monkeypatch.setattr(skinny_module, "_skinny_torch", lambda x, weight, bias, norm, *args, **kwargs: (
        heads.append((x.shape[0], norm is not None and norm.data_ptr() == norm_weight.data_ptr()))
        if weight.data_ptr() == head_weight.data_ptr() else None, spy(x, weight, bias, norm, *args, **kwargs))[1])
    expected = _run(eager, _sequences(eager.config.vocab_size))
    got = _run(graphed, _sequences(graphed.config.vocab_size))
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert [r["batch_size"] for r in RecordingGraphRunner.replays] == [4, 1, 8, 4]
    # the graphs of 4 and 1 rows (captures and replays), not 8's nor the eager steps'
    assert heads and set(heads) == {(4, True), (1, True)}
    if compiled:   # the compiled forward ran, but never for the few-row layers' steps (ModelRunner._forward)
        assert graphed.compiled and compiled_calls and not any(compiled_calls)
    assert graphed.set_skinny_lm_head(False) is False and sorted(graphed.graphs) == [8]


def test_the_lm_head_fold_stays_off_where_it_cannot_run(tiny_model_dir, skinny_calls, monkeypatch):
    """Without few-row graphs (the limit 0, eager) or where the model cannot fold (Gemma 2's softcapped LM head, OPT's
    LayerNorm) set_skinny_lm_head leaves it off; a limit raised later turns a wanted fold on. The setting's parsing."""
    monkeypatch.setenv("ENGINE_SKINNY_GEMM_MAX_ROWS", "0")
    runner = make_runner(tiny_model_dir("llama"), enforce_eager=False, graph_runner_class=RecordingGraphRunner)
    assert runner.set_skinny_lm_head(True) is False and runner._skinny_head_wanted
    assert runner.set_skinny_max_rows(2) == 2 and runner.skinny_head   # wanted, and now possible
    assert runner.set_skinny_max_rows(0) == 0 and not runner.skinny_head
    assert make_runner(tiny_model_dir("gemma2"), enforce_eager=True).model.can_fold_final_norm() is False
    assert not hasattr(make_runner(tiny_model_dir("opt"), enforce_eager=True).model, "can_fold_final_norm")
    monkeypatch.delenv("ENGINE_SKINNY_LM_HEAD", raising=False)
    assert DevicePolicy.for_device("cuda").skinny_lm_head is True   # on by default on CUDA
    assert DevicePolicy.for_device("cpu").skinny_lm_head is False
    monkeypatch.setenv("ENGINE_SKINNY_LM_HEAD", "0")
    assert DevicePolicy.for_device("cuda").skinny_lm_head is False
    monkeypatch.setenv("ENGINE_SKINNY_LM_HEAD", "1")
    assert DevicePolicy.for_device("cuda").skinny_lm_head is True
    assert DevicePolicy.for_device("cpu").skinny_lm_head is False
    monkeypatch.setenv("ENGINE_SKINNY_LM_HEAD", "maybe")
    with pytest.raises(ValueError, match="ENGINE_SKINNY_LM_HEAD"):
        DevicePolicy.for_device("cuda")
