"""Chat templates rendered in sandbox processes, with a time and a memory limit.

A chat template is Jinja code, and a request may bring its own (--trust-request-chat-template): a template with
nested `range(100000)` loops holds a Python thread (and the GIL) for minutes, `{{ 'x' * 10**8 }}` takes
gigabytes. So no template renders in the server's process: `ChatTemplateSandbox` keeps a few worker processes
(spawned, so they hold no copy of the model or the engine), each rendering with transformers' own renderer
(`render_jinja_template`, Jinja's sandboxed environment, as `tokenizer.apply_chat_template`) under an address-space
limit (RLIMIT_AS) of `memory_bytes` above what the worker needs to start. A render that runs past `timeout_s` is
killed with its process (a fresh one replaces it); one that runs out of memory, raises or renders more than
`max_output_chars` is a ValueError. Either way the server and the other requests go on.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 512 << 20
DEFAULT_NUM_WORKERS = 2
STARTUP_TIMEOUT_S = 120.0


class TemplateTimeoutError(ValueError):
    """The template did not render within the time limit (its worker was killed)."""


def _worker_main(conn, memory_bytes: int, max_output_chars: int) -> None:
    """A sandbox worker: render what comes over `conn` until it closes."""
    import resource

    from transformers.utils.chat_template_utils import render_jinja_template

    # The limit counts from what the worker holds now (the interpreter, transformers' modules).
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = current + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            rendered, _ = render_jinja_template(**request)
            text = rendered[0]
            if not isinstance(text, str):
                raise ValueError("the chat template did not render to a string")
            if len(text) > max_output_chars:
                raise ValueError(f"the chat template rendered {len(text)} characters; at most {max_output_chars} "
                                 f"are taken")
            reply = ("ok", text)
        except MemoryError:
            reply = ("error", f"the chat template needed more than the {memory_bytes >> 20} MiB a render may use")
        except Exception as e:   # jinja errors (raise_exception in templates, bad roles) are bad input
            reply = ("error", f"cannot apply the chat template: {type(e).__name__}: {str(e)[:500]}")
        try:
            conn.send(reply)
        except MemoryError:
            conn.send(("error", "the chat template's output does not fit the memory a render may use"))


class _Worker:
    def __init__(self, memory_bytes: int, max_output_chars: int):
        # A plain subprocess (not multiprocessing's spawn, which re-imports the parent's __main__ and so needs
        # a guard in every script that serves), over a socket pair with multiprocessing's Connection framing.
        parent, child = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.chat_template_sandbox", str(child.fileno()),
             str(memory_bytes), str(max_output_chars)],
            pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        child.close()
        self.conn = Connection(parent.detach())
        self.ready = False

    def wait_ready(self) -> None:
        """Wait for the worker's start (imports), which the render time limit does not count."""
        if self.ready:
            return
        try:
            started = self.conn.poll(STARTUP_TIMEOUT_S) and self.conn.recv()[0] == "ready"
        except (EOFError, OSError):
            started = False
        if not started:
            self.kill()
            raise ValueError("a chat template sandbox process did not start")
        self.ready = True

    def render(self, request: dict, timeout_s: float) -> str:
        """Blocking: send, wait up to timeout_s. Raises TemplateTimeoutError (the process is then killed) or
        ValueError."""
        self.wait_ready()
        self.conn.send(request)
        if not self.conn.poll(timeout_s):
            self.kill()
            raise TemplateTimeoutError(f"the chat template did not render within {timeout_s:g} s")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):   # the worker died (killed by the kernel, a crash in native code)
            self.kill()
            raise ValueError("the chat template's render process died") from None
        if status != "ok":
            raise ValueError(value)
        return value

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("a chat template sandbox process (pid %d) did not exit", self.process.pid)
        self.conn.close()


class ChatTemplateSandbox:
    """A pool of sandbox worker processes; `await render(...)` returns the rendered text or raises ValueError."""

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 num_workers: int = DEFAULT_NUM_WORKERS, max_output_chars: int = 1 << 24):
        self.timeout_s, self.memory_bytes, self.max_output_chars = timeout_s, memory_bytes, max_output_chars
        self.num_workers = num_workers
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._available = threading.Semaphore(num_workers)
        self._closed = False
        self.num_killed = 0   # renders killed for their time (tests, logs)

    def start(self) -> None:
        """Start the workers now (they take a second to import transformers' renderer), not on first use."""
        with self._lock:
            while len(self._idle) < self.num_workers:
                self._idle.append(_Worker(self.memory_bytes, self.max_output_chars))

    def wait_started(self) -> None:
        """Block until the started workers have imported the renderer. A server waits for this before it takes
        requests: two workers importing take about two CPU-seconds, and on a small machine the first requests
        shared the cores with them (a 16-token completion took 0.1-2.8 s for the first few seconds of a fresh
        server, 0.068 s after). A worker that fails to start is dropped with a warning (the next render starts
        another)."""
        with self._lock:
            workers = list(self._idle)
        for worker in workers:
            try:
                worker.wait_ready()
            except ValueError:
                logger.warning("a chat template sandbox process did not start; another starts on first use")
                with self._lock:
                    if worker in self._idle:
                        self._idle.remove(worker)

    def render_blocking(self, request: dict) -> str:
        if self._closed:
            raise RuntimeError("the chat template sandbox is shut down")
        self._available.acquire()
        try:
            with self._lock:   # a started worker first (one just replacing a killed one may still import)
                ready = [w for w in self._idle if w.ready]
                worker = (ready or self._idle or [None])[0]
                if worker is not None:
                    self._idle.remove(worker)
            if worker is None or not worker.alive:
                worker = _Worker(self.memory_bytes, self.max_output_chars)
            try:
                text = worker.render(request, self.timeout_s)
            except TemplateTimeoutError:
                self.num_killed += 1
                logger.warning("a chat template ran past %.1f s: its sandbox process was killed", self.timeout_s)
                self._give_back(_Worker(self.memory_bytes, self.max_output_chars))   # starts warming up now
                raise
            except ValueError:
                self._give_back(worker if worker.alive else _Worker(self.memory_bytes, self.max_output_chars))
                raise
            self._give_back(worker)
            return text
        finally:
            self._available.release()

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)

    async def render(self, *, chat_template: str, messages: list[dict], tools: list[dict] | None = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     template_vars: dict | None = None) -> str:
        """The text of `messages` rendered with `chat_template` (as tokenizer.apply_chat_template(tokenize=False)
        with template_vars as its extra keyword arguments: special tokens, chat_template_kwargs)."""
        request = dict(conversations=[messages], tools=tools, chat_template=chat_template,
                       add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       **(template_vars or {}))
        return await asyncio.get_running_loop().run_in_executor(None, self.render_blocking, request)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.kill()


if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
