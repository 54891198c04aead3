"""Executors: the engine's one door to the model (see executor.py): in this process, or over tensor-parallel
worker processes."""
from engine.executor.executor import (ModelRunnerOutput, MultiprocExecutor, ScheduledEntry, UniprocExecutor,
                                      WorkerDiedError, to_entries)

__all__ = ["ModelRunnerOutput", "MultiprocExecutor", "ScheduledEntry", "UniprocExecutor", "WorkerDiedError", "to_entries"]
