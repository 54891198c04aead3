"""Gemma 2 beyond the shared parity tests: the split-K decode op (the CUDA path) with the softcap and the
sliding window, forced on CPU."""

from __future__ import annotations

from engine.layers.attention import Attention
from tests.engine.models_util import GEMMA2_ATTN_SOFTCAP, GEMMA2_SLIDING_WINDOW
from tests.engine.test_model_runner import (MIXED_SCHEDULE, assert_matches_hf, make_runner, mixed_sequences,
                                            run_schedule, scatter_blocks)


def test_decode_kernel_path_with_softcap_and_window_matches_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("gemma2")
    runner = make_runner(model_dir)
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    assert [layer.sliding_window for layer in layers] == [GEMMA2_SLIDING_WINDOW, None]
    assert all(layer.softcap == GEMMA2_ATTN_SOFTCAP and layer.scale != layer.head_dim ** -0.5 for layer in layers)
    for layer in layers:
        layer.use_decode_kernel = True
    seqs = mixed_sequences(runner.config.vocab_size, seed=90)
    scatter_blocks(seqs, runner.num_kv_blocks, seed=7)
    assert_matches_hf(model_dir, seqs, run_schedule(runner, seqs, MIXED_SCHEDULE))
