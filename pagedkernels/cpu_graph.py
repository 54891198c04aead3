"""CPU graphs: a callable's kernel calls recorded once, then replayed from C without the Python between them.

On a CPU a small model's decode step is mostly Python: SmolLM2-135M's 30 layers make ~330 native kernel calls a
token, and each costs ~20 us of module calls, argument checks and ctypes conversion around a kernel that often
runs for less (2-core AMD EPYC: 7.6 ms of a 15-18 ms token). CUDA graphs remove the same overhead on GPUs;
:class:`CPUGraph` does it for pagedkernels' native CPU kernels:

- ``capture(fn)`` runs ``fn`` once to warm up, then once more while recording: every native kernel call (their
  arguments are plain integers, pointers and floats) and every torch operation that computes something (seen
  through a ``TorchDispatchMode``; views and allocations compute nothing). The second run's output tensor is the
  graph's output.
- ``replay()`` runs the recorded calls again, in order: runs of consecutive kernel calls in one C call
  (``pk_graph_replay``), the few torch operations between them (an embedding lookup, a bias) through torch, their
  results copied into the tensors the recording run produced. It returns the output tensor, rewritten.

- ``replay(n)`` of a graph captured with ``rows=m`` (a decode step of m sequences) runs the recorded kernels over
  the first n rows only, as a CUDA graph of m rows serves n padded up to m, without computing the padding: each
  kernel's row counts (``_native.ROW_ARGS``) are rewritten for n. So one recording serves every smaller batch;
  recording a batch size costs ~20 ms over a replay, which a step of each new size paid before (SmolLM2, 48
  requests on a 2-core AMD EPYC: 11.0 -> 10.4 s). The capture checks that the callable keeps its rows outermost.

As with CUDA graphs, a replay reads whatever the callable's input tensors hold at the time, so inputs must stay
the same tensors (static buffers, filled before each replay), shapes are fixed, and anything the callable decides
in Python from tensor values is frozen at capture: such decisions (``.item()``, ``.tolist()``, ops whose output
shape depends on values) make the capture fail with :class:`GraphCaptureError`, and so does a CUDA tensor. The
intermediate tensors of the recording run that only kernels read and write are moved into a :class:`CPUGraphPool`
arena and laid out by their lifetimes, so a graph holds about its peak of live activations, and the graphs of one
pool (replayed one at a time) share one arena. Work that neither pagedkernels' native kernels nor torch's
dispatcher does (a collective of ``torch.distributed``, numpy on a tensor's memory) is not recorded: capture
replays once and raises :class:`GraphCaptureError` when that replay's output differs from the recording run's.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import threading
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import _native

# Allocations: their outputs are the graph's intermediate buffers; nothing to replay.
_ALLOCATIONS = frozenset({
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty_strided.default,
})
_ALIGN = 64


class GraphCaptureError(RuntimeError):
    """The callable cannot be replayed as a CPU graph (see the module docstring for what makes it so)."""


class CPUGraphPool:
    """The arena the intermediate tensors of a family of graphs live in. The graphs of one pool must not replay
    concurrently (they overwrite each other's intermediates); the arena grows to the largest graph's need."""

    def __init__(self) -> None:
        self.arena = torch.empty(0, dtype=torch.uint8)
        self.version = 0

    def reserve(self, nbytes: int) -> None:
        if nbytes > self.arena.numel():
            self.arena = torch.empty(nbytes, dtype=torch.uint8)
            self.version += 1


@dataclass
class _NativeCall:
    kind: int
    name: str
    ints: list[int]
    floats: list[float]
    pointer_slots: list[int]   # indices into ints that hold pointers
    row_slots: list[int]       # indices into ints that count rows (_native.ROW_ARGS)


@dataclass
class _TorchCall:
    func: object
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]


@dataclass
class _ArenaView:
    """Where a tensor of an intermediate buffer lives in the pool's arena: its buffer's offset (bytes) and its
    dtype, shape, strides and storage offset (elements) within that buffer."""
    offset: int
    dtype: torch.dtype
    size: tuple
    stride: tuple
    storage_offset: int

    @classmethod
    def of(cls, t: torch.Tensor, offset: int) -> "_ArenaView":
        return cls(offset, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())

    def tensor(self, arena: torch.Tensor) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return torch.empty(0, dtype=self.dtype).set_(arena.untyped_storage(), self.offset // itemsize
                                                     + self.storage_offset, self.size, self.stride)


@dataclass
class _TorchStep:
    """A recorded torch operation as it replays: its tensors of intermediate buffers as arena views."""
    func: object
    arg_templates: tuple
    output_templates: list
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)


@dataclass
class _Segment:
    """Consecutive kernel calls replayed by one pk_graph_replay."""
    names: list[str]
    calls: ctypes.Array
    # (call index, int slot, offset in the arena): pointers into the pool's arena, rewritten when it moves
    patches: list[tuple[int, int, int]] = field(default_factory=list)


class _KernelRecorder:
    """Stands in for the native library while a graph captures: each recordable kernel call is appended to the
    event list with its arguments, then run."""

    def __init__(self, lib, events: list) -> None:
        self._lib, self._events = lib, events
        self.thread = threading.get_ident()   # other threads' calls run as usual, unrecorded
        self._kinds = {name: kind for kind, name in enumerate(_native.GRAPH_KERNELS)}

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)
        kind = self._kinds.get(name)
        if kind is None:
            return fn
        argtypes = _native.SIGNATURES[name]
        row_args = _native.ROW_ARGS.get(name, ())

        def record(*args):
            ints, floats, pointer_slots, row_slots = [], [], [], []
            for position, (argtype, value) in enumerate(zip(argtypes, args, strict=True)):
                if argtype is ctypes.c_float:
                    floats.append(float(value))
                    continue
                if argtype is ctypes.c_void_p:
                    pointer_slots.append(len(ints))
                    value = 0 if value is None else value
                elif position in row_args:
                    row_slots.append(len(ints))
                ints.append(int(value))
            self._events.append(_NativeCall(kind, name, ints, floats, pointer_slots, row_slots))
            return fn(*args)

        return record


def _storage_key(t: torch.Tensor) -> int | tuple:
    """The address of ``t``'s storage; for a tensor without one (oneDNN's opaque prepacked weights), its identity."""
    if t.layout != torch.strided or t.is_mkldnn:
        return ("opaque", id(t))
    return t.untyped_storage().data_ptr()


def _tensor_leaves(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


_VIEW, _ALLOCATION, _OTHER, _REFUSED = range(4)


@functools.lru_cache(maxsize=None)
def _op_kind(func) -> int:
    """How the recorder treats an operator: a view (its schema's outputs alias its first input, written by
    nothing), an allocation, one a replay could not follow, or any other (checked call by call)."""
    if func in _ALLOCATIONS:
        return _ALLOCATION
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags:
        return _REFUSED
    schema = func._schema
    if (not schema.is_mutable and schema.returns and schema.arguments
            and isinstance(schema.arguments[0].type, torch.TensorType)
            and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)):
        return _VIEW
    return _OTHER


class _OpRecorder(TorchDispatchMode):
    """Records the torch operations that compute (not views, not allocations) and the storages created.

    Views and allocations, nearly all of a decode step's torch operations (SmolLM2: 513 of 514), take a short
    path: a step that captures its batch size's graph pays the recording on top of its forward."""

    def __init__(self, events: list, buffers: dict) -> None:
        super().__init__()
        self.events, self.buffers = events, buffers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _op_kind(func)
        if kind == _VIEW:
            base = args[0]
            if base.device.type != "cpu":
                raise GraphCaptureError(f"{func} has a {base.device} tensor: CPU graphs record CPU work only")
            out = func(*args, **kwargs)
            key = _storage_key(base)
            if all(_storage_key(t) == key for t in ((out,) if isinstance(out, torch.Tensor) else out)):
                return out
            # A view-or-copy operator (reshape) that copied: record the call as any other computation's.
            outputs = _tensor_leaves(out)
            self.events.append(_TorchCall(func, args, kwargs, outputs))
            self._register([t for t in outputs if _storage_key(t) != key])
            return out
        if kind == _ALLOCATION:
            out = func(*args, **kwargs)
            if out.device.type != "cpu":
                raise GraphCaptureError(f"{func} has a {out.device} tensor: CPU graphs record CPU work only")
            self._register([out])
            return out
        if kind == _REFUSED:
            raise GraphCaptureError(f"{func} reads tensor values on the host or has a value-dependent shape: "
                                    f"a replay could not follow it")
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in inputs + outputs:
            if t.device.type != "cpu":
                raise GraphCaptureError(f"{func} has a {t.device} tensor: CPU graphs record CPU work only")
        input_storages = {_storage_key(t) for t in inputs}
        if not func._schema.is_mutable and all(_storage_key(t) in input_storages for t in outputs):
            return out   # a view: its memory is its input's
        self.events.append(_TorchCall(func, args, kwargs, outputs))
        self._register([t for t in outputs if _storage_key(t) not in input_storages])
        return out

    def _register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if isinstance(_storage_key(t), tuple):
                raise GraphCaptureError(f"an intermediate without a plain storage ({t.layout}, mkldnn "
                                        f"{t.is_mkldnn}) cannot be laid out in the arena")
            storage = t.untyped_storage()
            if storage.nbytes() > 0:
                self.buffers[storage.data_ptr()] = storage


def _assign_offsets(lifetimes: dict[int, tuple[int, int, int]]) -> tuple[dict[int, int], int]:
    """Offsets in one arena for buffers ``key -> (nbytes, first use, last use)`` such that buffers whose uses
    overlap never share bytes (largest first, each at the lowest offset that fits). Returns offsets, total."""
    placed: list[tuple[int, int, int, int]] = []   # offset, end, first, last
    offsets, total = {}, 0
    for key, (nbytes, first, last) in sorted(lifetimes.items(), key=lambda item: -item[1][0]):
        size = -(-nbytes // _ALIGN) * _ALIGN
        busy = sorted((start, end) for start, end, f, l in placed if f <= last and first <= l)
        offset = 0
        for start, end in busy:
            if offset + size <= start:
                break
            offset = max(offset, end)
        placed.append((offset, offset + size, first, last))
        offsets[key] = offset
        total = max(total, offset + size)
    return offsets, total


class CPUGraph:
    """One callable's work recorded for replay (see the module docstring). Same contract as the engine's CUDA
    graph runner: ``capture(fn)`` once, then ``replay()`` any number of times, returning the same tensor."""

    def __init__(self, pool: CPUGraphPool | None = None) -> None:
        self.pool = pool if pool is not None else CPUGraphPool()
        self.output: torch.Tensor | None = None
        self.num_kernel_calls = 0
        self.num_torch_calls = 0
        self.arena_bytes = 0
        self.rows: int | None = None   # the rows the callable was recorded for, when given
        self.resizable = False         # whether a replay of fewer rows computes just those (see capture)
        self._lib = None   # the native library, once captured
        self._steps: list[_Segment | _TorchStep] = []
        self._output_template = None
        self._patched_version = -1

    @staticmethod
    def new_pool(device: torch.device | None = None) -> CPUGraphPool:
        return CPUGraphPool()

    def capture(self, fn, *, warm_up: bool = True, check: bool = True, rows: int | None = None) -> torch.Tensor:
        """Record ``fn`` (a callable returning one tensor) and return the recording run's output (a tensor of
        its own, not the graph's output buffer). ``warm_up``: run ``fn`` once before recording, so that what it
        creates lazily on a first call is not taken for an intermediate. ``check``: replay once and compare
        with the recording run's output. A caller recording one callable at several sizes may skip both after
        its first capture.

        ``rows``: the number of rows ``fn`` processes, the outermost dimension of its inputs and its output (a
        decode step's sequences). A replay may then be asked for fewer (``replay(n)``), as a CUDA graph is padded
        up to its size: the inputs' rows past n must hold valid padding, and the output's first n rows are the
        result. Kernels that count their rows (``_native.ROW_ARGS``) then process just n rows, when each of their
        counts is a multiple of ``rows``; torch operations process them all. Whether that layout holds (rows
        outermost all through the callable) is checked here: a replay of one row on an arena of NaNs must give
        the recording run's first row. If it does not, :attr:`resizable` is False and every replay
        processes all the rows."""
        lib = _native.library()
        if lib is None:
            raise GraphCaptureError(f"CPU graphs replay pagedkernels' native kernels, which are unavailable: "
                                    f"{_native.build_error()}")
        if warm_up:
            fn()
        events: list = []
        buffers: dict = {}
        _native._recorder = _KernelRecorder(lib, events)
        try:
            with _OpRecorder(events, buffers):
                output = fn()
        finally:
            _native._recorder = None
        if not isinstance(output, torch.Tensor):
            raise GraphCaptureError(f"the captured callable must return one tensor, got {type(output).__name__}")
        self.rows = rows
        self._build(lib, events, buffers, output)
        if check:
            got = self.replay()
            if not bool(((got == output) | (got.isnan() & output.isnan())).all()):
                raise GraphCaptureError("the replay's output differs from the recording run's: the callable does "
                                        "work that neither pagedkernels' native kernels nor torch's dispatcher does")
        self.resizable = rows is not None and (rows == 1 or self._replays_fewer_rows(output))
        return output

    def _replays_fewer_rows(self, output: torch.Tensor) -> bool:
        """Whether a replay of one row, on an arena of NaNs (every intermediate it does not compute stays NaN),
        gives the recording run's first row (see :meth:`capture`): a kernel whose rows are not outermost would
        compute the wrong sliver. Kernels may pick other paths for one row than for all (attention splits a
        sequence's keys between threads): a near match passes, near at the output dtype's resolution (a 16-bit
        model's hidden states then differ by an ulp or two through every layer: bf16 ones by 0.25 at 32 on
        SmolLM2's 30 layers, which a float32 bound of 1e-3 took for a wrong sliver, so that its decode recorded a
        graph per batch size). A mismatch replays all the rows once more, so that whatever the replay wrote outside
        the arena (a KV cache) is the recording run's again."""
        self.pool.arena.fill_(0xFF)   # NaN in every float format
        try:
            got, want = self._run(1)[:1], output[:1]
            tol = max(1e-3, 4 * torch.finfo(want.dtype).eps) if want.dtype.is_floating_point else 1e-3
            close = got.shape == want.shape and bool(torch.allclose(
                got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().nan_to_num().max()),
                equal_nan=True))
        except RuntimeError:
            close = False
        if not close:
            self._run(self.rows)
        return close

    def _build(self, lib, events: list, buffers: dict, output: torch.Tensor) -> None:
        self._lib = lib
        bases = sorted(buffers)

        def buffer_of(pointer: int) -> int | None:
            i = bisect.bisect_right(bases, pointer) - 1
            if i >= 0 and pointer < bases[i] + buffers[bases[i]].nbytes():
                return bases[i]
            return None

        lifetimes: dict[int, tuple[int, int, int]] = {}

        def use(base: int, index: int) -> None:
            nbytes, first, _ = lifetimes.get(base, (buffers[base].nbytes(), index, index))
            lifetimes[base] = (nbytes, first, index)

        references = []   # (event index, slot, buffer, delta): kernel pointers into intermediate buffers
        for index, event in enumerate(events):
            if isinstance(event, _NativeCall):
                for slot in event.pointer_slots:
                    base = buffer_of(event.ints[slot])
                    if base is not None:
                        use(base, index)
                        references.append((index, slot, base, event.ints[slot] - base))
            else:
                for t in _tensor_leaves((event.args, event.kwargs, event.outputs)):
                    if _storage_key(t) in buffers:
                        use(_storage_key(t), index)
        if _storage_key(output) in buffers:   # the output lives past the last call, until the next replay
            use(_storage_key(output), len(events))
        offsets, self.arena_bytes = _assign_offsets(lifetimes)
        self.pool.reserve(self.arena_bytes)

        def relocated(tree):
            """Tensors of intermediate buffers as their places in the arena (materialized by _patch)."""
            return pytree.tree_map(lambda x: _ArenaView.of(x, offsets[_storage_key(x)])
                                   if isinstance(x, torch.Tensor) and _storage_key(x) in buffers else x, tree)

        patches_by_event: dict[int, list[tuple[int, int]]] = {}
        for index, slot, base, delta in references:
            patches_by_event.setdefault(index, []).append((slot, offsets[base] + delta))
        steps: list = []
        run: list[tuple[int, _NativeCall]] = []

        def close_run() -> None:
            if not run:
                return
            calls = (_native.GraphCall * len(run))()
            segment = _Segment(names=[call.name for _, call in run], calls=calls)
            for position, (index, call) in enumerate(run):
                record = calls[position]
                record.kind = call.kind
                for slot, value in enumerate(call.ints):
                    record.i[slot] = value
                for slot, value in enumerate(call.floats):
                    record.f[slot] = value
                # Row counts a replay of fewer rows rewrites: all of a call's, or none when one is not a multiple.
                counts = [call.ints[slot] for slot in call.row_slots]
                scaled = bool(self.rows) and bool(counts) and all(c > 0 and c % self.rows == 0 for c in counts)
                for j in range(_native.GRAPH_MAX_ROW_ARGS):
                    rewritten = scaled and j < len(counts)
                    record.row_slot[j] = call.row_slots[j] if rewritten else -1
                    record.row_per[j] = counts[j] // self.rows if rewritten else 0
                segment.patches.extend((position, slot, offset) for slot, offset in patches_by_event.get(index, ()))
            steps.append(segment)
            run.clear()

        for index, event in enumerate(events):
            if isinstance(event, _NativeCall):
                run.append((index, event))
            else:
                close_run()
                steps.append(_TorchStep(event.func, relocated((event.args, event.kwargs)), relocated(event.outputs)))
        close_run()
        self._steps = steps
        self._output_template = relocated(output)
        self.num_kernel_calls = sum(isinstance(e, _NativeCall) for e in events)
        self.num_torch_calls = len(events) - self.num_kernel_calls
        self._patched_version = -1

    def _patch(self) -> None:
        """Point the recorded calls at the pool's arena where it is now."""
        arena = self.pool.arena
        base = arena.data_ptr()
        materialize = functools.partial(pytree.tree_map, lambda x: x.tensor(arena) if isinstance(x, _ArenaView) else x)
        for step in self._steps:
            if isinstance(step, _Segment):
                for position, slot, offset in step.patches:
                    step.calls[position].i[slot] = base + offset
            else:
                step.args, step.kwargs = materialize(step.arg_templates)
                step.outputs = materialize(step.output_templates)
        self.output = materialize(self._output_template)
        self._patched_version = self.pool.version

    def replay(self, rows: int | None = None) -> torch.Tensor:
        """Rerun the recorded work and return the output tensor. ``rows``: that many rows of those the capture
        recorded, a :attr:`resizable` graph's kernels processing just those (see :meth:`capture`)."""
        if self._lib is None:
            raise RuntimeError("replay() before capture()")
        if rows is not None and (self.rows is None or not 1 <= rows <= self.rows):
            raise ValueError(f"replay of {rows} rows: the graph was recorded for "
                             f"{'an unstated number of' if self.rows is None else self.rows} rows")
        return self._run(rows if rows is not None and self.resizable else self.rows or 0)

    def _run(self, rows: int) -> torch.Tensor:
        """The replay, the kernels' row counts set for ``rows`` rows (0: as recorded)."""
        if self._patched_version != self.pool.version:
            self._patch()
        rc = ctypes.c_int(0)
        for step in self._steps:
            if isinstance(step, _Segment):
                failed = self._lib.pk_graph_replay(step.calls, len(step.names), rows, ctypes.byref(rc))
                if failed >= 0:
                    raise RuntimeError(f"CPU graph replay: {step.names[failed]} failed (code {rc.value}); a replay "
                                       f"skips the argument checks, so its inputs must hold what eager calls accept")
            else:
                result = step.func(*step.args, **step.kwargs)
                for dst, src in zip(step.outputs, _tensor_leaves(result)):
                    if dst.data_ptr() != src.data_ptr():
                        dst.copy_(src)
        return self.output
