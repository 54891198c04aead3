"""Executors: the engine's one door to the model (see executor.py): in this process, or over tensor-parallel
worker processes."""
from engine.executor.executor import MultiprocExecutor, UniprocExecutor, WorkerDiedError, make_executor

__all__ = ["MultiprocExecutor", "UniprocExecutor", "WorkerDiedError", "make_executor"]
