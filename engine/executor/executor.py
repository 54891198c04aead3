"""Executors: the engine's one door to the model. `execute_model`, `copy_blocks`, `swap_out`, `swap_in` — the
engine decides, the executor runs it on every device that holds part of the model.

- `UniprocExecutor`: one ModelRunner (and its swap space) in this process.
- `MultiprocExecutor`: tensor parallelism over `tensor_parallel_size` processes on torch.distributed. This process
  is rank 0 (it holds a shard like the others, and is the one that gets logits and samples); ranks 1..N-1 are
  worker processes it starts (spawn). Each call is sent to the workers first as plain, picklable records (the
  new token ids, computed-token count and block table of each scheduled entry; block-id pairs), broadcast over
  the gloo group, then run on every rank, the collectives inside the forward lining the ranks up. Tensors only
  ever move through torch.distributed's collectives (NCCL on GPUs, gloo on CPU).

Under torchrun (or any env:// launcher: RANK, WORLD_SIZE, MASTER_ADDR/PORT set), one node or several, nothing is
spawned: every rank runs the same script, joins the job's group through env://, and `LLM(...)` on a rank other
than 0 becomes that rank's worker (`run_launched_worker`), which serves rank 0's broadcasts and then ends its
process with status 0 when rank 0's engine shuts down; only rank 0's script goes on past `LLM(...)`.

A worker that dies (or raises) stops the engine: the executor checks its workers before every call and turns a
collective that fails because a peer is gone into `WorkerDiedError`, which the engine does not treat as one
failed step but as the end (never a hang: gloo notices a closed peer at once; NCCL jobs are bounded by the group's
timeout).
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import time
import weakref
from dataclasses import dataclass

import torch

from engine.worker.cache_engine import CacheEngine, num_swap_blocks_for
from engine.config import ModelConfig
from engine.distributed import broadcast_object, destroy_distributed_environment, init_distributed_environment
from engine.distributed.parallel_state import env_rank_and_world_size, free_port
from engine.platform import DevicePolicy

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot run the model any more."""


@dataclass(slots=True)
class ScheduledEntry:
    """What a worker needs of one scheduled sequence: its new tokens and where their KV goes. It stands in for a
    Sequence in ModelRunner.execute_model: `token_ids[num_computed_tokens:]` are exactly the new tokens."""
    new_token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]

    @property
    def token_ids(self) -> "_TokenWindow":
        return _TokenWindow(self.num_computed_tokens, self.new_token_ids)


class _TokenWindow:
    """The tail of a token list that starts at `start` (the runner slices only the new tokens and takes len)."""
    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __len__(self) -> int:
        return self.start + len(self.ids)

    def __getitem__(self, index: slice) -> list[int]:
        if not isinstance(index, slice) or index.step is not None or (index.start or 0) < self.start:
            raise IndexError(f"only the new tokens [{self.start}:] of a scheduled entry are sent to the workers")
        stop = len(self) if index.stop is None else index.stop
        return self.ids[index.start - self.start:stop - self.start]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What a step's forward gives the engine (rank 0; the other ranks return None)."""
    logits: torch.Tensor                   # float32 [num_scheduled, vocab_size], each entry's last new token
    prompt_logits: dict[int, torch.Tensor]  # entry row -> float32 [num_new_tokens, vocab_size] (prompt logprobs)


def to_entries(scheduled) -> list[tuple[ScheduledEntry, int]]:
    """(Sequence, num_new_tokens) pairs -> the picklable records the workers run."""
    return [(ScheduledEntry(seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n],
                            seq.num_computed_tokens, list(seq.block_table)), n) for seq, n in scheduled]


class UniprocExecutor:
    """The model in this process."""

    def __init__(self, model_config: ModelConfig, runner_kwargs: dict, *, swap_space_gib: float):
        from engine.worker.model_runner import ModelRunner   # pulls in the model code and pagedkernels

        self.model_runner = ModelRunner(model_config, **runner_kwargs)
        self.cache_engine = CacheEngine(self.model_runner.kv_cache,
                                        num_swap_blocks_for(swap_space_gib, self.model_runner.kv_cache))

    @property
    def num_kv_blocks(self) -> int:
        return self.model_runner.num_kv_blocks

    @property
    def num_swap_blocks(self) -> int:
        return self.cache_engine.swap_cache.shape[2]

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        """Run a SchedulerOutput's batch (its block moves are issued before, by the engine): the runner sees only
        the entries' plain records."""
        return self.execute_entries(to_entries(scheduler_output.scheduled), scheduler_output.prompt_logits_rows)

    def execute_entries(self, entries: list[tuple[ScheduledEntry, int]],
                        prompt_logits_rows: list[int]) -> ModelRunnerOutput | None:
        if not prompt_logits_rows:
            logits = self.model_runner.execute_model(entries)
            return None if logits is None else ModelRunnerOutput(logits, {})
        logits, extra = self.model_runner.execute_model(entries, all_logits_for=prompt_logits_rows)
        return None if logits is None else ModelRunnerOutput(logits, dict(zip(prompt_logits_rows, extra)))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.model_runner.copy_blocks(pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.cache_engine.swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.cache_engine.swap_in(pairs)

    def shutdown(self) -> None:
        pass


def _launcher_local_rank(rank: int) -> int:
    """This process's index on its node under torchrun (LOCAL_RANK), else its rank."""
    return int(os.environ.get("LOCAL_RANK", rank))


def _rank_device(runner_kwargs: dict, local_rank: int) -> dict:
    """runner_kwargs with the device of the rank whose index on its node is `local_rank`: one GPU per rank;
    CPU as is."""
    device = torch.device(runner_kwargs["device"])
    if device.type != "cuda":
        return runner_kwargs
    return {**runner_kwargs, "device": torch.device("cuda", local_rank % torch.cuda.device_count())}


def _worker_main(rank: int, world_size: int, init_method: str, model_config: ModelConfig, runner_kwargs: dict,
                 swap_space_gib: float, num_threads: int | None, local_rank: int | None = None) -> None:
    """A worker process: join the group, build this rank's shard, then run what rank 0 broadcasts until it says
    "shutdown". An exception ends the process (rank 0 sees a dead peer). `local_rank`: its GPU index on the
    node (default: the rank, one node)."""
    if num_threads:
        torch.set_num_threads(num_threads)
    runner_kwargs = _rank_device(runner_kwargs, rank if local_rank is None else local_rank)
    device = torch.device(runner_kwargs["device"])
    init_distributed_environment(world_size, rank, init_method=init_method,
                                 local_rank=device.index if device.type == "cuda" else None)
    try:
        executor = UniprocExecutor(model_config, runner_kwargs, swap_space_gib=swap_space_gib)
        with torch.inference_mode():
            while True:
                method, args = broadcast_object(None)
                if method == "shutdown":
                    break
                getattr(executor, method)(*args)
    finally:
        destroy_distributed_environment()


def launched_rank(tensor_parallel_size: int) -> int | None:
    """This process's rank when an env:// launcher (torchrun) started the job, else None (the executor spawns
    its workers). The launcher's world must be exactly the tensor-parallel group."""
    launched = env_rank_and_world_size()
    if launched is None:
        return None
    rank, world_size = launched
    if world_size != tensor_parallel_size:
        raise ValueError(f"this process was started by an env:// launcher (torchrun) with WORLD_SIZE={world_size}, "
                         f"but tensor_parallel_size={tensor_parallel_size}: they must be equal (one rank per shard)")
    return rank


def run_launched_worker(rank: int, world_size: int, model_config: ModelConfig, runner_kwargs: dict,
                        swap_space_gib: float) -> None:
    """Rank `rank` (> 0) of a torchrun job: this rank's worker loop, in this process, until rank 0 shuts down."""
    logger.info("rank %d of %d (env:// launcher): serving as a tensor-parallel worker until rank 0 shuts down",
                rank, world_size)
    _worker_main(rank, world_size, "env://", model_config, runner_kwargs, swap_space_gib, None,
                 local_rank=_launcher_local_rank(rank))


class MultiprocExecutor:
    """Tensor parallelism over `tensor_parallel_size` processes: this one (rank 0) and the workers it spawns, or
    under torchrun the job's other ranks (which run `run_launched_worker`)."""

    def __init__(self, model_config: ModelConfig, runner_kwargs: dict, *, swap_space_gib: float,
                 tensor_parallel_size: int, init_method: str | None = None):
        launched = launched_rank(tensor_parallel_size) is not None
        device = torch.device(runner_kwargs["device"])
        gpus_needed = int(os.environ.get("LOCAL_WORLD_SIZE", tensor_parallel_size)) if launched else tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < gpus_needed:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs {gpus_needed} GPUs on this node, "
                             f"{torch.cuda.device_count()} visible")
        self._threads_before = torch.get_num_threads()
        # Under a launcher the threads are the launcher's business (torchrun sets OMP_NUM_THREADS).
        worker_threads = None if launched else DevicePolicy.for_device(device).threads_per_rank(tensor_parallel_size)
        if worker_threads is not None:   # this process is a rank too
            torch.set_num_threads(worker_threads)
            logger.info("tensor parallelism on CPU: %d ranks, %d threads each", tensor_parallel_size, worker_threads)
        self.tensor_parallel_size = tensor_parallel_size
        self.launched = launched
        if launched:
            init_method, self.workers = "env://", []
        else:
            init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
            context = multiprocessing.get_context("spawn")
            self.workers = [context.Process(target=_worker_main, name=f"engine-tp-worker-{rank}", daemon=True,
                                            args=(rank, tensor_parallel_size, init_method, model_config,
                                                  runner_kwargs, swap_space_gib, worker_threads))
                            for rank in range(1, tensor_parallel_size)]
            for worker in self.workers:
                worker.start()
        self._closed = False
        # Workers must not outlive the engine, however it ends; launched ones are told to stop at exit.
        self._finalizer = weakref.finalize(self, MultiprocExecutor._stop_workers, self.workers)
        atexit.register(self._finalizer)
        if launched:
            atexit.register(self.shutdown)
        runner_kwargs = _rank_device(runner_kwargs, _launcher_local_rank(0) if launched else 0)
        rank_device = torch.device(runner_kwargs["device"])
        init_distributed_environment(tensor_parallel_size, 0, init_method=init_method,
                                     local_rank=rank_device.index if rank_device.type == "cuda" else None)
        self.local = UniprocExecutor(model_config, runner_kwargs, swap_space_gib=swap_space_gib)
        self.model_runner, self.cache_engine = self.local.model_runner, self.local.cache_engine
        self.num_kv_blocks, self.num_swap_blocks = self.local.num_kv_blocks, self.local.num_swap_blocks
        # Time rank 0 spends sending each step's records (the driver's overhead per step).
        self.broadcast_seconds = 0.0
        self.num_broadcasts = 0

    def _call(self, method: str, args: tuple):
        if self._closed:
            raise WorkerDiedError("the tensor-parallel executor is shut down")
        dead = [w for w in self.workers if not w.is_alive()]
        if dead:
            self._closed = True
            raise WorkerDiedError(f"tensor-parallel worker {dead[0].name} died (exit code {dead[0].exitcode}); "
                                  f"the engine has stopped")
        try:
            start = time.perf_counter()
            try:
                broadcast_object((method, args))
            except RuntimeError as e:
                if self.launched:   # no process handles to look at: a failed send means a rank is gone
                    self._closed = True
                    raise WorkerDiedError(f"a tensor-parallel rank is unreachable ({e}); the engine has stopped") from e
                raise
            self.broadcast_seconds += time.perf_counter() - start
            self.num_broadcasts += 1
            return getattr(self.local, method)(*args)
        except RuntimeError as e:   # a collective whose peer went away
            if isinstance(e, WorkerDiedError) or all(w.is_alive() for w in self.workers):
                raise
            self._closed = True
            dead = next(w for w in self.workers if not w.is_alive())
            raise WorkerDiedError(f"tensor-parallel worker {dead.name} died (exit code {dead.exitcode}) during "
                                  f"{method}; the engine has stopped") from e

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        return self._call("execute_entries", (to_entries(scheduler_output.scheduled),
                                              scheduler_output.prompt_logits_rows))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._call("copy_blocks", (pairs,))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._call("swap_out", (pairs,))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._call("swap_in", (pairs,))

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if not self._closed and all(w.is_alive() for w in self.workers):
            try:
                broadcast_object(("shutdown", ()))
            except RuntimeError:
                pass
        self._closed = True
        self._finalizer()
        destroy_distributed_environment()
        torch.set_num_threads(self._threads_before)

    @staticmethod
    def _stop_workers(workers) -> None:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=5)
