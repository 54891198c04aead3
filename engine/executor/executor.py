"""Executors: the engine's one door to the model. `execute_model`, `copy_blocks`, `swap_out`, `swap_in`, `add_lora`,
`remove_lora` — the engine decides, the executor runs it on every device that holds part of the model.

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
import gc
import logging
import multiprocessing
import os
import time
import weakref

import torch

from engine.worker.cache_engine import CacheEngine, num_swap_blocks_for
from engine.config import EngineConfig, ModelConfig
from engine.distributed import broadcast_object, destroy_distributed_environment, init_distributed_environment
from engine.distributed.parallel_state import (env_rank_and_world_size, free_port, is_distributed_initialized,
                                               planned_layout)
from engine.platform import DevicePolicy
from engine.step_records import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot run the model any more."""


class UniprocExecutor:
    """The model in this process."""

    def __init__(self, config: EngineConfig):
        from engine.worker.model_runner import ModelRunner   # pulls in the model code and pagedkernels

        self.model_runner = runner = ModelRunner(config)
        swap_space = config.cache_config.swap_space if config.scheduler_config.preemption_mode == "swap" else 0
        # The draft model's cache (speculative decoding) swaps with the model's: its block ids are the same.
        caches = [runner.kv_cache] + ([runner.drafter.kv_cache[:, :, :runner.num_kv_blocks]]
                                      if runner.drafter is not None else [])
        self.cache_engine = CacheEngine(caches, num_swap_blocks_for(swap_space, caches))
        self._closed = False

    @property
    def num_kv_blocks(self) -> int:
        return self.model_runner.num_kv_blocks

    def _open_runner(self):
        if self._closed:
            raise RuntimeError("the engine is shut down: it runs no more steps")
        return self.model_runner

    @property
    def num_swap_blocks(self) -> int:
        return self.cache_engine.num_swap_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step (its block moves are issued before, by the engine)."""
        return self._open_runner().execute_model(scheduler_output)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._open_runner().copy_blocks(pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._open_runner()
        self.cache_engine.swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._open_runner()
        self.cache_engine.swap_in(pairs)

    def add_lora(self, lora_request) -> bool:
        return self._open_runner().add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._open_runner().remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._open_runner().list_loras()

    def shutdown(self) -> None:
        """Release the model, its KV cache and swap space, step graphs and compiled tails (idempotent): the device
        memory goes back to the allocator even while something outside still holds the engine."""
        if self._closed:
            return
        self._closed = True
        self.cache_engine.release()
        self.model_runner.release()


def _launcher_local_rank(rank: int) -> int:
    """This process's index on its node under torchrun (LOCAL_RANK), else its rank."""
    return int(os.environ.get("LOCAL_RANK", rank))


def _backend(device: torch.device) -> str:
    """The collectives' backend for the model's device: NCCL for GPUs, gloo for CPU (also on a machine that
    has GPUs, for an engine that runs on its CPU)."""
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """`config` for the rank whose index on its node is `local_rank`: one GPU per rank; CPU as is."""
    if config.device.type != "cuda":
        return config
    return config.with_device(torch.device("cuda", local_rank % torch.cuda.device_count()))


def _worker_main(rank: int, world_size: int, init_method: str, config: EngineConfig, num_threads: int | None,
                 local_rank: int | None = None, started=None) -> None:
    """A worker process: join the group, build this rank's shard, then run what rank 0 broadcasts until it says
    "shutdown". An exception ends the process (rank 0 sees a dead peer). `local_rank`: its GPU index on the
    node (default: the rank, one node). `started`: an event set once the process runs this function, before it
    joins the group (rank 0 waits for it, watching the process, so a worker that dies on start-up fails rank 0
    at once instead of leaving it in the rendezvous)."""
    if started is not None:
        started.set()
    if num_threads:
        torch.set_num_threads(num_threads)
    config = _rank_config(config, rank if local_rank is None else local_rank)
    device = config.device
    init_distributed_environment(world_size, rank, init_method=init_method, backend=_backend(device),
                                 local_rank=device.index if device.type == "cuda" else None)
    try:
        executor = UniprocExecutor(config)
        with torch.inference_mode():
            while True:
                method, args = broadcast_object(None)
                if method == "shutdown":
                    break
                try:
                    getattr(executor, method)(*args)
                except ValueError:
                    # A request's own error (a bad LoRA adapter): rank 0 hits it too and refuses the request.
                    if method not in _REQUEST_LEVEL_METHODS:
                        raise
    finally:
        destroy_distributed_environment()


# Executor calls whose ValueError is one request's (rank 0 reports it; every rank reads the same files), which a
# worker survives; any other exception ends the worker.
_REQUEST_LEVEL_METHODS = frozenset({"add_lora"})


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


def run_launched_worker(rank: int, world_size: int, config: EngineConfig) -> None:
    """Rank `rank` (> 0) of a torchrun job: this rank's worker loop, in this process, until rank 0 shuts down."""
    logger.info("rank %d of %d (env:// launcher): serving as a tensor-parallel worker until rank 0 shuts down",
                rank, world_size)
    _worker_main(rank, world_size, "env://", config, None, local_rank=_launcher_local_rank(rank))


def check_tensor_parallel_shapes(model_config: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise the ValueError a rank would raise building its shard (heads, KV heads, MLP width not dividing by
    `tensor_parallel_size`), before any process is started or group joined: the model is built on the meta
    device as rank 0 of the planned group, with the layers' own checks."""
    from engine.models import get_model_class

    with planned_layout(tensor_parallel_size, 0), torch.device("meta"):
        get_model_class(model_config.architecture)(model_config)


def check_no_engine_holds_the_group() -> None:
    """An engine in this process that holds the tensor-parallel group (the layers of every engine here would
    see its world size) must be shut down before another engine starts. One dropped without shutdown() (`del`,
    or garbage in a reference cycle) releases the group when it is collected: collect it now."""
    if is_distributed_initialized():
        gc.collect()
    if is_distributed_initialized():
        from engine.distributed import get_tp_world_size
        raise ValueError(f"another engine in this process holds a tensor-parallel group of "
                         f"{get_tp_world_size()} ranks: shut it down (llm.llm_engine.shutdown()) before "
                         f"starting a new engine")


def make_executor(config: EngineConfig):
    """The executor of `config`: the model in this process, or tensor parallelism."""
    check_no_engine_holds_the_group()
    if config.parallel_config.tensor_parallel_size == 1:
        return UniprocExecutor(config)
    return MultiprocExecutor(config)


class _ProcessResources:
    """What a MultiprocExecutor changes in its process (worker processes, the process group, torch's thread
    count), released by `release` however the executor ends: shutdown(), a failed start, garbage collection or
    interpreter exit. Holds no reference to the executor, so the executor's finalizer can call it."""

    def __init__(self) -> None:
        self.threads_before = torch.get_num_threads()
        self.workers: list = []
        self.joined = False          # this process is in the group
        self.ready = False           # every rank built its shard: workers wait for broadcasts
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.ready and all(w.is_alive() for w in self.workers):
            try:   # a clean stop: each worker leaves its loop, destroys its group and exits
                broadcast_object(("shutdown", ()))
            except RuntimeError:
                pass
        elif self.joined:
            # The start failed part-way: workers may be inside any collective, so no message is safe. Leaving
            # the group closes the connections, which ends their pending collective with an error.
            destroy_distributed_environment()
        for worker in self.workers:
            if self.ready:   # stopping on their own after the shutdown message (or the group's end)
                worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=5)
        if self.joined:
            destroy_distributed_environment()
        torch.set_num_threads(self.threads_before)


class MultiprocExecutor:
    """Tensor parallelism over `tensor_parallel_size` processes: this one (rank 0) and the workers it spawns, or
    under torchrun the job's other ranks (which run `run_launched_worker`).

    A refused or failed start leaves the process as it found it (no worker, no group, torch's thread count);
    so do shutdown() and the garbage collection of an engine dropped without it."""

    # Longest a spawned worker may take to start running (import torch and the engine); it ends sooner when
    # the process dies.
    worker_start_timeout_s = 300.0

    def __init__(self, config: EngineConfig, init_method: str | None = None):
        tensor_parallel_size = config.parallel_config.tensor_parallel_size
        launched = launched_rank(tensor_parallel_size) is not None
        device = config.device
        gpus_needed = int(os.environ.get("LOCAL_WORLD_SIZE", tensor_parallel_size)) if launched else tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < gpus_needed:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs {gpus_needed} GPUs on this node, "
                             f"{torch.cuda.device_count()} visible")
        check_tensor_parallel_shapes(config.model_config, tensor_parallel_size)
        self.tensor_parallel_size = tensor_parallel_size
        self.launched = launched
        self._closed = False
        self._resources = resources = _ProcessResources()
        self.workers = resources.workers
        # Runs on shutdown(), on garbage collection and at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _ProcessResources.release, resources)
        try:
            self._start(config, init_method)
        except BaseException as e:
            dead = [w for w in self.workers if w.exitcode is not None]
            self._closed = True
            self._finalizer()
            if dead and isinstance(e, RuntimeError) and not isinstance(e, WorkerDiedError):
                raise WorkerDiedError(f"tensor-parallel worker {dead[0].name} died (exit code {dead[0].exitcode}) "
                                      f"while the engine started") from e
            raise
        resources.ready = True
        if launched:   # the other ranks are told to stop when this process ends
            atexit.register(self.shutdown)
        # Time rank 0 spends sending each step's records (the driver's overhead per step).
        self.broadcast_seconds = 0.0
        self.num_broadcasts = 0

    def _start(self, config: EngineConfig, init_method: str | None) -> None:
        tensor_parallel_size, resources = self.tensor_parallel_size, self._resources
        # Under a launcher the threads are the launcher's business (torchrun sets OMP_NUM_THREADS).
        worker_threads = None if self.launched else \
            DevicePolicy.for_device(config.device).threads_per_rank(tensor_parallel_size)
        if worker_threads is not None:   # this process is a rank too
            torch.set_num_threads(worker_threads)
            logger.info("tensor parallelism on CPU: %d ranks, %d threads each", tensor_parallel_size, worker_threads)
        if self.launched:
            init_method = "env://"
        else:
            init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
            context = multiprocessing.get_context("spawn")
            started = [context.Event() for _ in range(1, tensor_parallel_size)]
            for rank in range(1, tensor_parallel_size):
                resources.workers.append(context.Process(
                    target=_worker_main, name=f"engine-tp-worker-{rank}", daemon=True,
                    args=(rank, tensor_parallel_size, init_method, config, worker_threads),
                    kwargs={"started": started[rank - 1]}))
            for worker in resources.workers:
                worker.start()
            self._wait_for_workers_to_start(started)
        config = _rank_config(config, _launcher_local_rank(0) if self.launched else 0)
        resources.joined = True   # from here on the group may exist: release() leaves it
        init_distributed_environment(tensor_parallel_size, 0, init_method=init_method, backend=_backend(config.device),
                                     local_rank=config.device.index if config.device.type == "cuda" else None)
        self.local = UniprocExecutor(config)
        self.model_runner, self.cache_engine = self.local.model_runner, self.local.cache_engine
        self.num_kv_blocks, self.num_swap_blocks = self.local.num_kv_blocks, self.local.num_swap_blocks

    def _wait_for_workers_to_start(self, started: list) -> None:
        """Until every spawned worker runs `_worker_main`; a worker that exits first (an exception while its
        process starts, e.g. a script without the `__main__` guard) is a WorkerDiedError within a fraction of a
        second, not a rendezvous that waits out its timeout."""
        deadline = time.monotonic() + self.worker_start_timeout_s
        while not all(event.is_set() for event in started):
            for worker, event in zip(self.workers, started):
                if not event.is_set() and not worker.is_alive():
                    raise WorkerDiedError(
                        f"tensor-parallel worker {worker.name} exited with code {worker.exitcode} while starting "
                        f"(its error is printed above). Workers are started with multiprocessing's spawn, which "
                        f"imports the main script again: a script that creates a tensor-parallel LLM needs the "
                        f"`if __name__ == \"__main__\":` guard around it")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"tensor-parallel workers did not start within {self.worker_start_timeout_s:.0f} s")
            time.sleep(0.02)

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

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", (scheduler_output,))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._call("copy_blocks", (pairs,))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._call("swap_out", (pairs,))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._call("swap_in", (pairs,))

    def add_lora(self, lora_request) -> bool:
        """Load an adapter on every rank (each keeps its shard of it); ValueError (rank 0's) for a bad one."""
        return self._call("add_lora", (lora_request,))

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._call("remove_lora", (lora_int_id,))

    def list_loras(self) -> list[int]:
        return self.local.list_loras()   # every rank holds the same adapters: rank 0's answer is theirs

    def shutdown(self) -> None:
        """Stop the workers and leave the process group, then release this rank's model and caches (idempotent)."""
        self._closed = True
        self._finalizer()
        if getattr(self, "local", None) is not None:
            self.local.shutdown()
