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


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=2, rank=2), "rank must be in"),
    (dict(world_size=0, rank=0), "rank must be in"),
    (dict(world_size=2, rank=True), "rank must be an int"),
    (dict(world_size=1, rank=0, backend="mpi"), "backend must be"),
])
def test_bad_arguments_are_rejected_before_joining(kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine_dist.init_distributed_environment(**kwargs)
