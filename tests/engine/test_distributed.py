"""engine.distributed on gloo with 2 CPU processes: the collectives give the same numbers as the single-process
reference, also inside a fullgraph torch.compile, and a single process needs no process group at all."""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from engine import distributed as engine_dist
from engine.distributed.parallel_state import free_port


def _worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    torch.manual_seed(1234)   # every rank draws the same full tensors, then keeps its own part
    full = torch.randn(world_size, 5, 6)
    engine_dist.init_distributed_environment(world_size, rank, init_method=init_method, backend="gloo")
    try:
        mine = full[rank]
        results = {
            "all_reduce": engine_dist.tensor_model_parallel_all_reduce(mine).tolist(),
            "all_gather": engine_dist.tensor_model_parallel_all_gather(mine, dim=-1).tolist(),
            "all_gather_dim0": engine_dist.tensor_model_parallel_all_gather(mine, dim=0).tolist(),
            "broadcast": engine_dist.broadcast_object({"step": 7, "rank": rank} if rank == 0 else None),
            "rank": engine_dist.get_tp_rank(), "world_size": engine_dist.get_tp_world_size(),
        }
        gathered = engine_dist.tensor_model_parallel_gather(mine, dst=0, dim=-1)
        results["gather"] = None if gathered is None else gathered.tolist()

        # A row-parallel matmul as the model runs it: partial products, then the all-reduce, in one fullgraph.
        def row_parallel(x, weight):
            return engine_dist.tensor_model_parallel_all_reduce(x @ weight.t()) * 2.0

        weight = torch.randn(world_size, 4, 6)   # same on every rank (seeded): rank r multiplies its slice
        compiled = torch.compile(row_parallel, backend="aot_eager", fullgraph=True, dynamic=True)
        results["compiled"] = compiled(mine, weight[rank]).tolist()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        engine_dist.destroy_distributed_environment()


def test_collectives_on_two_gloo_ranks(tmp_path):
    world_size = 2
    mp.spawn(_worker, args=(world_size, f"tcp://127.0.0.1:{free_port()}", str(tmp_path)), nprocs=world_size,
             join=True)
    torch.manual_seed(1234)
    full = torch.randn(world_size, 5, 6)
    weight = torch.randn(world_size, 4, 6)
    for rank in range(world_size):
        with open(tmp_path / f"rank{rank}.json") as f:
            results = json.load(f)
        assert results["rank"] == rank and results["world_size"] == world_size
        torch.testing.assert_close(torch.tensor(results["all_reduce"]), full.sum(0))
        torch.testing.assert_close(torch.tensor(results["all_gather"]), torch.cat(list(full), dim=-1))
        torch.testing.assert_close(torch.tensor(results["all_gather_dim0"]), torch.cat(list(full), dim=0))
        assert results["broadcast"] == {"step": 7, "rank": 0}
        if rank == 0:
            torch.testing.assert_close(torch.tensor(results["gather"]), torch.cat(list(full), dim=-1))
        else:
            assert results["gather"] is None
        expected = sum(full[r] @ weight[r].t() for r in range(world_size)) * 2.0
        torch.testing.assert_close(torch.tensor(results["compiled"]), expected)


def test_single_process_needs_no_group():
    assert not engine_dist.is_distributed_initialized()
    x = torch.randn(3, 4)
    assert engine_dist.get_tp_world_size() == 1 and engine_dist.get_tp_rank() == 0
    assert engine_dist.tensor_model_parallel_all_reduce(x) is x
    assert engine_dist.tensor_model_parallel_all_gather(x) is x
    assert engine_dist.tensor_model_parallel_gather(x) is x
    assert engine_dist.broadcast_object({"a": 1}) == {"a": 1}


def _idle_worker(rank: int, init_method: str, out_dir: str) -> None:
    """Rank 1 waits in the object broadcast (where a TP worker waits for the next step) longer than the group's
    timeout, as the workers of an idle server do."""
    import time

    engine_dist.init_distributed_environment(2, rank, init_method=init_method, backend="gloo", timeout_s=1.0)
    try:
        if rank == 0:
            time.sleep(3.0)
        received = engine_dist.broadcast_object("step" if rank == 0 else None)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(received, f)
    finally:
        engine_dist.destroy_distributed_environment()


def test_workers_wait_for_the_next_step_past_the_group_timeout(tmp_path):
    mp.spawn(_idle_worker, args=(f"tcp://127.0.0.1:{free_port()}", str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == "step"


def test_a_group_the_caller_made_is_used_and_left_in_place():
    """torch.distributed initialized by the caller (world size 1 here): the engine's layers still see one rank
    until the engine joins, which uses that group and leaves it initialized when it leaves."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    try:
        assert not engine_dist.is_distributed_initialized() and engine_dist.get_tp_world_size() == 1
        engine_dist.init_distributed_environment(1, 0, backend="gloo")
        assert engine_dist.is_distributed_initialized()
        with pytest.raises(ValueError, match="already rank 0 of a tensor-parallel group of 1"):
            engine_dist.init_distributed_environment(1, 0, backend="gloo")
        engine_dist.destroy_distributed_environment()
        assert dist.is_initialized() and not engine_dist.is_distributed_initialized()
    finally:
        engine_dist.destroy_distributed_environment()
        dist.destroy_process_group()


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=2, rank=2), "rank must be in"),
    (dict(world_size=0, rank=0), "rank must be in"),
    (dict(world_size=2, rank=True), "rank must be an int"),
    (dict(world_size=1, rank=0, backend="mpi"), "backend must be"),
])
def test_bad_arguments_are_rejected_before_joining(kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine_dist.init_distributed_environment(**kwargs)


def _nccl_world_of_one(rank: int, init_method: str, out_dir: str) -> None:
    """The NCCL path at world size 1 (one GPU): the collective ops themselves, which the layers skip at world
    size 1, eager, inside a fullgraph inductor compile and captured in a CUDA graph."""
    from engine.distributed.parallel_state import get_cpu_group

    engine_dist.init_distributed_environment(1, 0, init_method=init_method, backend="nccl")
    try:
        torch.manual_seed(0)
        x, weight = torch.randn(5, 6, device="cuda"), torch.randn(4, 6, device="cuda")

        def row_parallel(x, weight):
            return torch.ops.engine.tp_all_reduce(x @ weight.t()) * 2.0

        expected = (x @ weight.t()) * 2.0
        compiled = torch.compile(row_parallel, fullgraph=True)(x, weight)
        static_x = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                row_parallel(static_x, weight)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = row_parallel(static_x, weight)
        static_x.copy_(3 * x)
        graph.replay()
        torch.cuda.synchronize()
        gathered = torch.ops.engine.tp_all_gather(x, 1)
        results = {
            "backend": torch.distributed.get_backend(), "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "cpu_group_backend": torch.distributed.get_backend(get_cpu_group()),
            "eager": (torch.ops.engine.tp_all_reduce(x) - x).abs().max().item(),
            "compiled": (compiled - expected).abs().max().item(),
            "graph_replay": (static_out - 3 * expected).abs().max().item(),
            "all_gather": (gathered[0] - x).abs().max().item(), "all_gather_shape": list(gathered.shape),
        }
        with open(os.path.join(out_dir, "nccl.json"), "w") as f:
            json.dump(results, f)
    finally:
        engine_dist.destroy_distributed_environment()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs CUDA (run by the GPU suite)")
def test_nccl_collectives_at_world_size_one(tmp_path):
    mp.spawn(_nccl_world_of_one, args=(f"tcp://127.0.0.1:{free_port()}", str(tmp_path)), nprocs=1, join=True)
    with open(tmp_path / "nccl.json") as f:
        results = json.load(f)
    print("NCCL world size 1:", results)
    assert results["backend"] == "nccl" and results["cpu_group_backend"] == "gloo"
    assert results["eager"] == 0 and results["all_gather"] == 0 and results["all_gather_shape"] == [1, 5, 6]
    assert results["compiled"] < 1e-4 and results["graph_replay"] < 1e-4
