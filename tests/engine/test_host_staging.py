"""HostStaging.to_device_many: a step's input arrays staged back to back in the pinned arena and sent to the device in
one copy, each result a view of the device buffer (engine/worker/input_batch.py)."""

from __future__ import annotations

import numpy as np
import torch

from engine.worker.input_batch import HostStaging
from tests.engine.fake_cuda import fake_cuda, no_host_sync


def _arrays():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 1000, 5, dtype=np.int64), np.arange(3, dtype=np.int32),
            rng.integers(-1, 99, (4, 7)).astype(np.int32), np.zeros(0, dtype=np.int64),
            np.array([0.5, 0.25], dtype=np.float32), np.array([True, False, True])]


def test_on_the_cpu_each_array_is_a_view():
    arrays = _arrays()
    tensors = HostStaging(torch.device("cpu")).to_device_many(*arrays)
    for array, tensor in zip(arrays, tensors):
        assert tensor.shape == array.shape and np.array_equal(tensor.numpy(), array)
    arrays[0][0] = -7   # views: no copy on the CPU
    assert tensors[0][0] == -7


def test_the_arena_path_keeps_every_value_dtype_and_shape(monkeypatch):
    """The pinned path's staging and slicing, run with the CPU as the "device" (its arena a plain tensor): the values
    come back as they went in, after the arena's earlier contents (an unaligned offset rounds up)."""
    staging = HostStaging(torch.device("cpu"))
    staging.pinned = True
    arena = torch.full((1 << 12,), 0xAB, dtype=torch.uint8)
    monkeypatch.setattr(staging, "_arena", lambda needed: arena if needed <= arena.numel() else None)
    first = staging.to_device(np.arange(3, dtype=np.int16))   # 6 bytes: the next array starts at 64
    arrays = _arrays()
    tensors = staging.to_device_many(*arrays)
    assert first.tolist() == [0, 1, 2]
    for array, tensor in zip(arrays, tensors):
        assert tensor.dtype == torch.from_numpy(array).dtype and tuple(tensor.shape) == array.shape
        assert np.array_equal(tensor.numpy(), array)
    assert staging._offset % HostStaging.ALIGN == 0 and staging._offset > 64


def test_one_copy_from_pinned_memory_on_cuda(monkeypatch):
    """On the fake CUDA device: one host-to-device copy for all of them, from pinned memory (no host sync), each
    result on the device with its dtype and shape."""
    arrays = _arrays()
    with fake_cuda():
        staging = HostStaging(torch.device("cuda"))
        copies, depth = [], [0]
        real_to = torch.Tensor.to

        def counting_to(self, *args, **kwargs):
            depth[0] += 1   # the fake layers re-dispatch a call: count the outermost one
            try:
                result = real_to(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0 and self.device.type == "cpu" and result.device.type == "cuda":
                copies.append(tuple(self.shape))
            return result

        monkeypatch.setattr(torch.Tensor, "to", counting_to)
        with no_host_sync():
            tensors = staging.to_device_many(*arrays)
    assert len(copies) == 1
    for array, tensor in zip(arrays, tensors):
        assert tensor.device.type == "cuda" and tensor.dtype == torch.from_numpy(array).dtype
        assert tuple(tensor.shape) == array.shape
