"""A GPU engine compiles every Triton kernel variant its steps launch at start-up, not in a user's first requests.

Triton compiles a kernel once per *variant*: its constexprs, its tensors' dtypes and 16-byte alignment, and each
integer argument's specialization (equal to 1, divisible by 16, or neither) unless the kernel lists it in
``do_not_specialize``. A count that changes from step to step (the step's sequences, tokens, routed slots) or a
stride that follows one (a block table's width) would make a step of a new shape compile a kernel in the middle of
serving: a Triton compile takes most of a second (0.75 s a variant in the AOT compile here), so the first requests
of each new shape stall (and a benchmark's first engine pays what a second one then finds compiled).

Here the engine runs on CPU with every pagedkernels op on its Triton kernel (the interpreter) and every launch
config chosen as on an H100 (``simulate_cuda_launches``); each launch's variant is worked out by Triton's own binder
for sm_90 (``pagedkernels._aot``). Start-up is what a CUDA runner does before serving: the memory profile's step,
the kernel warm-up (``ModelRunner.warm_up_kernels``) and the decode graphs' captures. Then a schedule of steps of
other shapes (prefills of one sequence and of several, chunks with earlier context, mixed batches, decodes of other
sizes, with and without LoRA adapters, block tables of other widths) must launch no variant start-up did not."""
from __future__ import annotations

import contextlib
import sys

import pytest
import torch

import pagedkernels as pk
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams
from engine.step_records import CachedSequenceData, NewSequenceData, SchedulerOutput
from pagedkernels import _aot, _backend
from tests.engine.models_util import engine_config, random_token_ids
from tests.engine.test_cuda_graph_runner import ArenaStaging

pytest.importorskip("triton.backends.nvidia.compiler", reason="needs Triton's NVIDIA backend for its binder")

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0)


class _VariantRecorder:
    """Stands in for a kernel in its module: ``kernel[grid](...)`` notes the launch's variant on sm_90 (Triton's
    binder, through a JITFunction twin of the interpreted kernel), then launches the kernel itself."""

    def __init__(self, kernel, variants: list[str]):
        from triton.runtime.jit import JITFunction

        self.kernel, self.variants = kernel, variants
        options = {name: kernel.kwargs.get(name) for name in ("do_not_specialize", "do_not_specialize_on_alignment")}
        self.twin = JITFunction(kernel.fn, **options)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.backends.compiler import GPUTarget

            recorded = _aot.Launch(self.twin, (1,), tuple(map(_aot._stand_in, args)),
                                   {k: _aot._stand_in(v) for k, v in kwargs.items()}, "")
            self.variants.append(_aot.distinct_variants([recorded], GPUTarget("cuda", 90, 32))[0].key)
            return self.kernel[grid](*args, **kwargs)
        return launch


@contextlib.contextmanager
def recording_variants():
    """Every pagedkernels op on its Triton kernel, launch configs as on an H100; yields the list of the launches'
    variants (keys), appended to as they launch."""
    variants: list[str] = []
    originals = []
    for attr, (kernel, module_name) in _aot.launched_kernels().items():
        module = sys.modules[module_name]
        originals.append((module, attr, kernel))
        setattr(module, attr, _VariantRecorder(kernel, variants))
    try:
        with pk.use_backend("triton"), _backend.simulate_cuda_launches(132, (9, 0)):
            yield variants
    finally:
        for module, attr, kernel in originals:
            setattr(module, attr, kernel)


def _kernel_names(keys) -> list[str]:
    return sorted(key.split("'")[1] for key in keys)


class _Schedule:
    """Sequences on blocks of their own, stepped through SchedulerOutputs the way the core sends them."""

    def __init__(self, runner, lora_requests: dict):
        self.runner, self.lora_requests = runner, lora_requests
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.next_block = 0

    def _blocks(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // BLOCK_SIZE)
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return blocks

    def step(self, new: dict[int, tuple[int, int, LoRARequest | None]] = (), decode: list[int] = (),
             chunks: dict[int, int] = (), params: dict[int, SamplingParams] = (),
             drafts: dict[int, list[int]] = ()):
        """new: seq_id -> (prompt length, tokens this step, adapter[, tokens the prefix cache holds]); decode:
        seq_ids taking one token; chunks: seq_id -> the next chunk of a prompt started earlier; params: a new
        sequence's sampling (default greedy); drafts: seq_id (of decode) -> speculative tokens it verifies this step
        (once a sequence: what it accepted is not followed). Returns the step's ModelRunnerOutput."""
        drafts = dict(drafts)
        new, chunks = dict(new), dict(chunks)
        new_seqs, cached, scheduled = [], [], {}
        for seq_id, (length, first, lora, *hit) in new.items():
            self.tokens[seq_id] = random_token_ids(length, seed=seq_id)
            self.computed[seq_id] = hit[0] if hit else 0   # tokens the prefix cache already holds
            new_seqs.append(NewSequenceData(
                seq_id=seq_id, token_ids=self.tokens[seq_id], num_prompt_tokens=length,
                num_computed_tokens=self.computed[seq_id],
                block_ids=self._blocks(length + 8), params=dict(params).get(seq_id, GREEDY), seed=None,
                stop_token_ids=[], lora_request=lora))
            scheduled[seq_id] = first
        for seq_id, n in chunks.items():
            cached.append(CachedSequenceData(seq_id, [], len(self.runner.input_batch.states[seq_id].block_ids), [],
                                             self.computed[seq_id]))
            scheduled[seq_id] = n
        for seq_id in decode:
            self.tokens[seq_id].append(5)
            # (with drafts: token 5 in place of the one the worker sampled, so the drafts end the sequence and the
            # step verifies them)
            cached.append(CachedSequenceData(seq_id, [5], len(self.runner.input_batch.states[seq_id].block_ids), [],
                                             self.computed[seq_id],
                                             token_start=self.computed[seq_id] if seq_id in drafts else None))
            scheduled[seq_id] = 1 + len(drafts.get(seq_id, ()))
        output = self.runner.execute_model(SchedulerOutput(new_seqs=new_seqs, cached_seqs=cached,
                                                           num_scheduled_tokens=scheduled,
                                                           lora_requests=self.lora_requests, spec_token_ids=drafts))
        for seq_id, n in scheduled.items():
            self.computed[seq_id] += n
        return output


@pytest.fixture(autouse=True)
def _cuda_input_layout(monkeypatch):
    """The CUDA runner's input layout: each decode graph size's inputs in a region of their own, a step's inputs
    compact copies out of the staging arena (so a block table's row stride is the step's width, as on CUDA)."""
    from engine.worker.decode_graphs import DecodeGraphs

    allocate = DecodeGraphs._allocate_static_buffers
    monkeypatch.setattr(DecodeGraphs, "_allocate_static_buffers",
                        lambda self, per_size_regions=None: allocate(self, per_size_regions=True))


def _start_up(model_dir: str, variants: list[str], **options):
    """A runner of ``model_dir`` (float16) started as on CUDA: the memory profile's step, the kernel warm-up, the
    decode graphs (the CPU stand-in for CUDA graphs runs the forward it captures). Returns (runner, the variants
    start-up launched)."""
    from engine.worker.model_runner import EagerGraphRunner, ModelRunner

    config = engine_config(model_dir, device="cpu", dtype="float16", max_model_len=256, block_size=BLOCK_SIZE,
                           num_kv_blocks=96, enforce_eager=False, **options)
    runner = ModelRunner(config, graph_runner_class=EagerGraphRunner, compile_model=False,
                         capture_graphs_at_startup=False)
    runner.staging = ArenaStaging(runner.device)   # each step's inputs compact copies, as on CUDA
    runner.sampler.sync_free = runner.sampler.fused_draw = True   # the CUDA defaults
    runner._profile_run()   # on CUDA: run while the runner sizes its KV cache (the CPU sizes it from RAM)
    runner._bind_kv_cache(runner.kv_cache)
    runner.warm_up_kernels()
    runner.capture_all_graphs()
    runner.kv_cache.zero_()   # finite keys for the "prefix-cache hits" below, whose context no step wrote
    return runner, set(variants)


def test_a_dense_model_with_lora_compiles_nothing_after_start_up(tiny_model_dir, tmp_path):
    """Llama with two LoRA adapters: the prefill kernel's sequence count and table width, the LoRA kernels' tiles
    (16- and 64-token blocks) and K splits, the fused draw's kernels and their scratch at other row counts."""
    from bench.lora_engine_gpu import write_random_adapter

    model_dir = tiny_model_dir("llama")   # (Qwen3's q/k norms would add a norm program a head and token)
    loras = [LoRARequest(f"adapter-{i}", i + 1, write_random_adapter(model_dir, str(tmp_path / f"a{i}"), rank,
                                                                     seed=i, dtype=torch.float16))
             for i, rank in enumerate((4, 8))]
    with recording_variants() as variants:
        runner, started = _start_up(model_dir, variants, max_num_seqs=16, max_num_batched_tokens=128,
                                    enable_lora=True, max_loras=2, max_lora_rank=8)
        assert {"_prefill_attention_kernel", "_lora_shrink_kernel", "_lora_expand_kernel"} <= set(
            _kernel_names(started))
        for lora in loras:
            runner.add_lora(lora)
        steps = _Schedule(runner, {lora.lora_int_id: lora for lora in loras})
        a, b = loras
        steps.step(new={0: (9, 9, a), 1: (30, 30, b), 2: (17, 17, None)})   # three prompts, 56 tokens
        steps.step(decode=[0, 1, 2])
        steps.step(new={3: (45, 45, None)})                                # one prompt alone, no adapter
        steps.step(new={4: (100, 40, a)}, decode=[0, 1])                   # a chunk beside decodes
        steps.step(chunks={4: 60}, decode=[2, 3])                          # its rest, after its context
        steps.step(new={5: (12, 12, a), 6: (20, 20, None)}, decode=[0],   # sampled rows: the fused draw
                   params={5: SamplingParams(temperature=0.8, seed=1), 6: SamplingParams(temperature=1.0, min_p=0.1)})
        steps.step(new={7: (248, 8, b, 240)}, decode=[5, 6])               # a prefix-cache hit: a 16-block table
        late = set(variants) - started
    assert not late, f"variants first compiled after start-up: {_kernel_names(late)}\n" + "\n".join(sorted(late))


def test_speculative_verification_compiles_nothing_after_start_up(tiny_model_dir):
    """n-gram speculation, k = 3, greedy: verification steps of one sequence and of three (1 + k tokens each: the
    prefill kernel over them, the k + 1 rows of each drawn by the fused draw for rejection_sample_greedy)."""
    model_dir = tiny_model_dir("llama")
    with recording_variants() as variants:
        runner, started = _start_up(model_dir, variants, max_num_seqs=16, max_num_batched_tokens=128,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        steps = _Schedule(runner, {})
        steps.step(new={0: (20, 20, None), 1: (9, 9, None), 2: (33, 33, None), 3: (12, 12, None)})
        verified = [steps.step(decode=[0], drafts={0: [3, 4, 5]}),
                    steps.step(decode=[1, 2, 3], drafts={1: [7, 8, 9], 2: [4, 4, 4], 3: [1, 2, 3]})]
        late = set(variants) - started
    assert [sorted(output.num_accepted_tokens) for output in verified] == [[0], [1, 2, 3]]
    assert {"_prefill_attention_kernel", "_sample_kernel"} <= set(_kernel_names(started))
    assert not late, f"variants first compiled after start-up: {_kernel_names(late)}\n" + "\n".join(sorted(late))


@pytest.fixture(params=[False, True], ids=["tiled", "matrix-vector"])
def moe_gemv(request):
    """fused_moe's matrix-vector launches off, or on up to 4 tokens (pagedkernels.set_moe_gemv_max_tokens)."""
    previous = pk.set_moe_gemv_max_tokens(4 if request.param else 0)
    yield request.param
    pk.set_moe_gemv_max_tokens(previous)


def test_a_moe_model_compiles_nothing_after_start_up(tiny_model_dir, monkeypatch, moe_gemv):
    """Mixtral (8 experts, top-2): fused_moe's tiles follow the slots per expert (16-, 32- and 128-row blocks,
    the direct layout of a one-token step), its alignment and top-k the step's token count; with the matrix-vector
    launches up to 4 tokens, the decodes of 1-3 sequences take those."""
    from engine.layers.fused_moe import FusedMoE

    # The experts' weights as on CUDA, in the Triton kernel's layout (the CPU packs them for its native kernel).
    monkeypatch.setattr(FusedMoE, "process_weights_after_loading", lambda self: None)
    with recording_variants() as variants:
        runner, started = _start_up(tiny_model_dir("mixtral"), variants, max_num_seqs=16,
                                    max_num_batched_tokens=272)   # the profile's step: 128-row blocks
        assert {"_fused_moe_kernel", "_moe_align_kernel", "_moe_topk_kernel"} <= set(_kernel_names(started))
        gemv_kernels = {"_moe_gemv_up_kernel", "_moe_gemv_down_kernel"}
        assert (gemv_kernels <= set(_kernel_names(started))) == moe_gemv
        steps = _Schedule(runner, {})
        steps.step(new={0: (9, 9, None), 1: (30, 30, None)})
        steps.step(decode=[0, 1])
        steps.step(new={2: (150, 150, None)}, decode=[0])                  # 151 tokens: 32-row blocks
        steps.step(new={3: (120, 20, None, 96)}, decode=[0, 1, 2])         # a chunk after cached context
        steps.step(decode=[2])                                             # one token: the direct layout
        late = set(variants) - started
    assert not late, f"variants first compiled after start-up: {_kernel_names(late)}\n" + "\n".join(sorted(late))
