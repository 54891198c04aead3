"""Multi-LoRA: a batch whose tokens use different low-rank adapters, as two grouped GEMMs (Punica / S-LoRA's
SGMV; vLLM's ``lora_shrink_op.py`` / ``lora_expand_op.py``), not a loop over the adapters.

The adapters of a layer sit stacked in slots. ``lora_a[l]`` holds slot l's down-projection and ``lora_b[l]`` its
up-projection, each of rank ``R`` (an adapter of a smaller rank is zero-padded to R). A fused projection (q/k/v, or
gate/up) is ``S`` slices: their A matrices stacked along the rank dimension (rows ``s*R .. s*R + R`` of
``lora_a[l]`` are slice s's), their B matrices along the output dimension as the base weight stacks them (rows
``o_s .. o_s + N_s`` of ``lora_b[l]``, ``o_s`` the sum of the slice sizes before s). With token t's slot
``l = token_lora_indices[t]`` (-1: no adapter):

    shrink:  buffer[t, j]          = scale * sum_k x[t, k] * lora_a[l, j, k]            (j < S*R; 0 when l = -1)
    expand:  out[t, o_s + n]      += sum_r buffer[t, s*R + r] * lora_b[l, o_s + n, r]   (n < N_s; nothing when l = -1)

so ``out += scale * x @ A_s^T @ B_s^T`` per slice, the adapter's delta added to the base layer's output.

Adapters of mixed ranks: ``lora_ranks`` (optional, int32 ``[num_slots, S]``, the same for both ops of a layer) gives
slot l's own rank in slice s, ``r_ls <= R``. The padding past it is then taken as zero and not read: rows ``s*R +
r_ls ..`` of ``lora_a[l]`` (the shrink writes zeros in those buffer columns) and columns ``r_ls ..`` of slice s's
rows of ``lora_b[l]`` (the expand reads neither them nor those buffer columns). A stack serving ranks 8 and 16
padded to 16 computes a quarter less; a slot of rank 0 costs nothing. Without it every slot is of rank R. The
buffer is float32 ``[num_tokens, S*R]`` on every backend (its shape depends on the arguments' shapes alone, so a
traced graph holds no device- or batch-dependent shape). For decode-sized batches the Triton shrink cuts K into
``num_splits`` parts (:func:`shrink_num_splits`, shapes only), each writing its partial sums to one plane of a
scratch ``[num_splits, num_tokens, S*R]``, then sums the planes in order (``torch.sum``): no atomics, so a result
never depends on the order the programs ran in.

Grouping: the Triton kernels take the tokens grouped by slot (``lora_mapping``: the token ids sorted by slot,
stable, and each slot's start in that list). A program owns one slot and one block of its tokens, so it reads
that slot's weights only and a batch of many adapters costs about what one does; programs of slots with no (or
fewer) tokens return at once. Segments (Punica's form, each adapter's tokens contiguous) are the special case
whose sorted order is the identity. The grid depends on shapes only (the number of tokens and slots), and the
mapping is computed on the device from the indices (a stable sort, a scatter-add, a cumulative sum: no host
sync), so the launches capture into CUDA graphs with the indices in device buffers. An index outside
``[-1, num_slots)`` is a ValueError wherever values are checked (CPU always, CUDA with ``PAGEDKERNELS_DEBUG=1``);
unchecked, the Triton path treats it as -1.

Backends:

- Triton (CUDA; the interpreter on CPU): ``_lora_shrink_kernel`` (grid: token blocks x output blocks, K splits,
  slots + 1: the last group writes the zero rows of tokens without an adapter; then the planes' sum when split)
  and ``_lora_expand_kernel`` (grid: token blocks x output blocks, slices, slots). Dots in the weights' dtype,
  float32 accumulation (``ieee`` for float32 inputs); the expand feeds the float32 buffer to a 16-bit dot
  rounded to the weights' dtype, as vLLM's does. Launch configs come from shapes, dtype and device kind only
  (``shrink_launch_config``, ``expand_launch_config``), no autotuning; every one compiles for sm_90 / sm_80
  without spills (``pagedkernels._aot``).
- Native (CPU): ``csrc/lora_cpu.c``, the same grouping by a counting sort of the indices in each call, float32
  arithmetic; it checks the indices in that pass. Recordable by CPU graphs (``pagedkernels.cpu_graph``), whose
  replays read the indices the buffers then hold.
- PyTorch twin: float32 products per slot that has tokens (the reference on CPU; reads the counts on the host).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import _native
from ._backend import has_no_data, launch_device_kind, num_multiprocessors, use_native, use_triton, value_checks_enabled
from ._validate import FLOAT_DTYPES, check_tensor

__all__ = ["lora_shrink", "lora_expand", "add_lora", "lora_mapping", "check_lora_shrink_args",
           "check_lora_expand_args", "check_add_lora_args", "shrink_num_splits", "expand_sums_planes",
           "MAX_LORA_SLICES", "MAX_SHRINK_SPLITS"]

# Fused projections have at most three slices (q/k/v).
MAX_LORA_SLICES = 3
# A K split of the shrink streams at least this many input features: its fixed costs (the token ids, one
# output tile's store) stay small next to its share of the dot.
MIN_K_PER_SPLIT = 256
MAX_SHRINK_SPLITS = 32


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_mapping(token_lora_indices, num_tokens: int, num_loras: int, sorted_token_ids, lora_token_starts,
                   like: tuple[str, torch.Tensor]) -> None:
    check_tensor("token_lora_indices", token_lora_indices, ndim=1, dtypes=(torch.int32,), like=like,
                 shape=(num_tokens,))
    if (sorted_token_ids is None) != (lora_token_starts is None):
        raise ValueError("sorted_token_ids and lora_token_starts come together (lora_mapping's two results): "
                         "give both or neither")
    if sorted_token_ids is not None:
        check_tensor("sorted_token_ids", sorted_token_ids, ndim=1, dtypes=(torch.int32,), like=like,
                     shape=(num_tokens,))
        check_tensor("lora_token_starts", lora_token_starts, ndim=1, dtypes=(torch.int32,), like=like,
                     shape=(num_loras + 1,))
        if not (sorted_token_ids.is_contiguous() and lora_token_starts.is_contiguous()):
            raise ValueError("sorted_token_ids and lora_token_starts must be contiguous")


def _check_ranks(lora_ranks, num_loras: int, num_slices: int | None, like: tuple[str, torch.Tensor]) -> None:
    """``lora_ranks``: None, or int32 ``[num_loras, num_slices]`` (None: any number of slices), contiguous."""
    if lora_ranks is not None:
        check_tensor("lora_ranks", lora_ranks, ndim=2, dtypes=(torch.int32,), like=like,
                     shape=(num_loras, num_slices))
        if not lora_ranks.is_contiguous():
            raise ValueError("lora_ranks must be contiguous")


def _check_rank_values(lora_ranks: torch.Tensor, rank: int) -> None:
    """Reads the ranks (a host sync on CUDA)."""
    bad = (lora_ranks < 0) | (lora_ranks > rank)
    if bool(bad.any()):
        slot, s = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"lora_ranks must lie in [0, {rank}] (the stack's rank), got {int(lora_ranks[slot, s])} "
                         f"for slot {slot}, slice {s}")


def check_lora_shrink_args(x, lora_a, token_lora_indices, scale=1.0, num_splits=None, sorted_token_ids=None,
                           lora_token_starts=None, out=None, lora_ranks=None) -> tuple[int, int, int, int]:
    """Every check of :func:`lora_shrink`'s arguments that reads no tensor value (shared with its fake
    implementation). Returns (num_tokens, in_features, num_loras, S*R)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last (in_features) dimension")
    on_x = ("x", x)
    num_tokens, in_features = x.shape
    check_tensor("lora_a", lora_a, ndim=3, dtypes=(x.dtype,), like=on_x, shape=(None, None, in_features))
    num_loras, width = lora_a.shape[:2]
    if num_loras < 1 or width < 1:
        raise ValueError(f"lora_a must hold at least one slot and one rank row, got shape {list(lora_a.shape)}")
    if lora_a.stride(-1) != 1:
        raise ValueError("lora_a must be contiguous in its last (in_features) dimension")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale or abs(scale) == float("inf"):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if num_splits is not None:
        _check_int("num_splits", num_splits, minimum=1)
    _check_mapping(token_lora_indices, num_tokens, num_loras, sorted_token_ids, lora_token_starts, on_x)
    _check_ranks(lora_ranks, num_loras, None, on_x)   # the shrink's slices: lora_ranks' second dimension
    if lora_ranks is not None:
        if width % lora_ranks.shape[1]:
            raise ValueError(f"lora_ranks has {lora_ranks.shape[1]} slices, which do not divide lora_a's "
                             f"{width} rank rows")
    if out is not None:
        check_tensor("out", out, dtypes=(torch.float32,), like=on_x, shape=(num_tokens, width))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last (S*R) dimension")
    return num_tokens, in_features, num_loras, width


def check_lora_expand_args(buffer, lora_b, token_lora_indices, out, slice_sizes=None, sorted_token_ids=None,
                           lora_token_starts=None, lora_ranks=None) -> tuple[int, tuple[int, ...], int, int]:
    """Every check of :func:`lora_expand`'s arguments that reads no tensor value (shared with its fake
    implementation). Returns (num_tokens, slice sizes, num_loras, rank)."""
    check_tensor("out", out, ndim=2, dtypes=FLOAT_DTYPES)
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous in its last (out_features) dimension")
    on_out = ("out", out)
    num_tokens, out_features = out.shape
    check_tensor("lora_b", lora_b, ndim=3, dtypes=(out.dtype,), like=on_out, shape=(None, out_features, None))
    num_loras, _, rank = lora_b.shape
    if num_loras < 1 or rank < 1:
        raise ValueError(f"lora_b must hold at least one slot of rank >= 1, got shape {list(lora_b.shape)}")
    if lora_b.stride(-1) != 1:
        raise ValueError("lora_b must be contiguous in its last (rank) dimension")
    sizes = (out_features,) if slice_sizes is None else tuple(slice_sizes)
    if not 1 <= len(sizes) <= MAX_LORA_SLICES or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                                     for s in sizes):
        raise ValueError(f"slice_sizes must be 1 to {MAX_LORA_SLICES} positive ints, got {slice_sizes!r}")
    if sum(sizes) != out_features:
        raise ValueError(f"slice_sizes {list(sizes)} sum to {sum(sizes)}, not out's {out_features} features")
    if buffer is not None:   # None: add_lora's own intermediate
        check_tensor("buffer", buffer, dtypes=(torch.float32,), like=on_out, shape=(num_tokens, len(sizes) * rank))
        if buffer.stride(-1) != 1:
            raise ValueError("buffer must be contiguous in its last (S*R) dimension")
    _check_mapping(token_lora_indices, num_tokens, num_loras, sorted_token_ids, lora_token_starts, on_out)
    _check_ranks(lora_ranks, num_loras, len(sizes), on_out)
    return num_tokens, sizes, num_loras, rank


def _check_index_values(token_lora_indices: torch.Tensor, num_loras: int) -> None:
    """Reads the indices (a host sync on CUDA)."""
    bad = (token_lora_indices < -1) | (token_lora_indices >= num_loras)
    if bool(bad.any()):
        token = int(bad.nonzero()[0, 0])
        raise ValueError(f"token_lora_indices must lie in [-1, {num_loras}) (-1: no adapter; else a slot of the "
                         f"{num_loras} stacked), got {int(token_lora_indices[token])} for token {token}")


# ----------------------------------------------------------------------------------------------
# the grouping
# ----------------------------------------------------------------------------------------------


def lora_mapping(token_lora_indices: torch.Tensor, num_loras: int, *, sorted_token_ids: torch.Tensor | None = None,
                 lora_token_starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens grouped by adapter slot, as the Triton kernels read them.

    Args:
        token_lora_indices: int32 ``[num_tokens]``, each token's slot in ``[0, num_loras)`` or -1 (none).
        num_loras: the number of stacked slots.
        sorted_token_ids, lora_token_starts: optional int32 ``[num_tokens]`` / ``[num_loras + 1]`` buffers to
            write into (preallocated for CUDA graphs; contiguous).

    Returns ``(sorted_token_ids, lora_token_starts)``: the token ids ordered by slot (stable; tokens without an
    adapter last), and where each slot's run starts in that list (``lora_token_starts[num_loras]``: the
    number of tokens with an adapter). Slot l's tokens are
    ``sorted_token_ids[lora_token_starts[l]:lora_token_starts[l + 1]]``. Device ops only, no host sync.
    """
    _check_int("num_loras", num_loras, minimum=1)
    check_tensor("token_lora_indices", token_lora_indices, ndim=1, dtypes=(torch.int32,))
    num_tokens = token_lora_indices.shape[0]
    device = token_lora_indices.device
    if sorted_token_ids is None:
        sorted_token_ids = torch.empty(num_tokens, dtype=torch.int32, device=device)
    if lora_token_starts is None:
        lora_token_starts = torch.empty(num_loras + 1, dtype=torch.int32, device=device)
    _check_mapping(token_lora_indices, num_tokens, num_loras, sorted_token_ids, lora_token_starts,
                   ("token_lora_indices", token_lora_indices))
    if has_no_data(token_lora_indices, sorted_token_ids, lora_token_starts):
        return sorted_token_ids, lora_token_starts
    if value_checks_enabled(token_lora_indices):
        _check_index_values(token_lora_indices, num_loras)
    key = token_lora_indices.long()
    key = torch.where((key < 0) | (key >= num_loras), num_loras, key)  # unchecked bad values: no adapter
    sorted_token_ids.copy_(torch.sort(key, stable=True).indices)
    counts = torch.zeros(num_loras + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    lora_token_starts[:1].zero_()
    lora_token_starts[1:].copy_(torch.cumsum(counts[:num_loras], 0))
    return sorted_token_ids, lora_token_starts


# ----------------------------------------------------------------------------------------------
# the ops
# ----------------------------------------------------------------------------------------------


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_lora_indices: torch.Tensor, *, scale: float = 1.0,
                num_splits: int | None = None, sorted_token_ids: torch.Tensor | None = None,
                lora_token_starts: torch.Tensor | None = None, out: torch.Tensor | None = None,
                lora_ranks: torch.Tensor | None = None) -> torch.Tensor:
    """``buffer[t] = scale * x[t] @ lora_a[token_lora_indices[t]]^T`` for every token, over mixed adapters.

    Args:
        x: ``[num_tokens, in_features]`` fp16/bf16/fp32, last dimension contiguous.
        lora_a: ``[num_loras, S*R, in_features]`` in x's dtype, last dimension contiguous: each slot's A
            matrices, its S slices' stacked along the rank dimension (rank R, zero-padded).
        token_lora_indices: int32 ``[num_tokens]``: each token's slot, or -1 for none.
        scale: multiplies the product (1.0 when the adapters' scaling is folded into their B).
        num_splits: the Triton path's K splits (default :func:`shrink_num_splits`: shapes only); ignored by
            the other backends.
        sorted_token_ids, lora_token_starts: :func:`lora_mapping` of ``token_lora_indices`` (computed here when
            not given; pass them to share one grouping between a step's layers). Only the Triton path reads them.
        out: optional float32 ``[num_tokens, S*R]``, last dimension contiguous.
        lora_ranks: optional int32 ``[num_loras, S]``, each slot's rank per slice in ``[0, R]`` (the module
            docstring): its S gives the slices (R = S*R / S); rows of A past a slot's rank are not read and
            give zeros.

    Returns float32 ``[num_tokens, S*R]`` (``out`` when given), float32 accumulation; all zero for a token
    without an adapter.
    """
    num_tokens, in_features, num_loras, width = check_lora_shrink_args(
        x, lora_a, token_lora_indices, scale, num_splits, sorted_token_ids, lora_token_starts, out, lora_ranks)
    if out is None:
        out = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)
    if has_no_data(x, lora_a, token_lora_indices, sorted_token_ids, lora_token_starts, out, lora_ranks):
        return out  # meta or fake tensors: checked, nothing to compute (the fake implementation)
    if num_tokens == 0:
        return out
    slice_rank = width // (1 if lora_ranks is None else lora_ranks.shape[1])
    if use_triton(x):
        sorted_token_ids, lora_token_starts = _triton_mapping(x, token_lora_indices, num_loras, sorted_token_ids,
                                                              lora_token_starts, lora_ranks, slice_rank)
        if num_splits is None:
            num_splits = _shrink_splits(x, width)
        _shrink_triton(x, lora_a, sorted_token_ids, lora_token_starts, float(scale), num_splits, out, lora_ranks)
    else:
        _shrink_cpu(x, lora_a, token_lora_indices, float(scale), out, lora_ranks, num_loras, slice_rank)
    return out


def lora_expand(buffer: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor, out: torch.Tensor, *,
                slice_sizes: Sequence[int] | None = None, sorted_token_ids: torch.Tensor | None = None,
                lora_token_starts: torch.Tensor | None = None, lora_ranks: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t, slice s] += buffer[t, s*R:(s+1)*R] @ lora_b[token_lora_indices[t], slice s]^T`` in place.

    Args:
        buffer: float32 ``[num_tokens, S*R]`` (:func:`lora_shrink`'s result), last dimension contiguous.
        lora_b: ``[num_loras, out_features, R]`` in out's dtype, last dimension contiguous: each slot's B
            matrices, its slices' stacked along the output dimension.
        token_lora_indices: int32 ``[num_tokens]``: each token's slot, or -1 for none (its row of ``out`` is
            left as it is, and its buffer row is never read).
        out: ``[num_tokens, out_features]`` fp16/bf16/fp32, last dimension contiguous (a strided view of a
            wider tensor is fine): the base layer's output, which the adapters' deltas are added to.
        slice_sizes: the output features of each slice, at most 3, summing to out_features (default one slice).
        sorted_token_ids, lora_token_starts: as for :func:`lora_shrink`.
        lora_ranks: optional int32 ``[num_loras, S]``, each slot's rank per slice in ``[0, R]``: B's columns and
            the buffer's past it are not read.

    Returns ``out``: each adapted row ``out + delta`` with the delta in float32 (from 16-bit products on the
    Triton path), rounded once to out's dtype.
    """
    num_tokens, sizes, num_loras, rank = check_lora_expand_args(buffer, lora_b, token_lora_indices, out, slice_sizes,
                                                                sorted_token_ids, lora_token_starts, lora_ranks)
    if (has_no_data(buffer, lora_b, token_lora_indices, out, sorted_token_ids, lora_token_starts, lora_ranks)
            or num_tokens == 0):
        return out
    if use_triton(out):
        sorted_token_ids, lora_token_starts = _triton_mapping(out, token_lora_indices, num_loras, sorted_token_ids,
                                                              lora_token_starts, lora_ranks, rank)
        _expand_triton(buffer, lora_b, sorted_token_ids, lora_token_starts, out, sizes, lora_ranks)
    else:
        _expand_cpu(buffer, lora_b, token_lora_indices, out, sizes, lora_ranks, num_loras, rank)
    return out


def check_add_lora_args(x, lora_a, lora_b, token_lora_indices, out, scale=1.0, slice_sizes=None, num_splits=None,
                        sorted_token_ids=None, lora_token_starts=None,
                        lora_ranks=None) -> tuple[int, int, tuple[int, ...], int, int]:
    """Every check of :func:`add_lora`'s arguments that reads no tensor value (shared with its fake
    implementation): the shrink's and the expand's, and that their weights stack alike. Returns (num_tokens,
    in_features, slice sizes, num_loras, rank)."""
    num_tokens, in_features, num_loras, width = check_lora_shrink_args(
        x, lora_a, token_lora_indices, scale, num_splits, sorted_token_ids, lora_token_starts, None, lora_ranks)
    _, sizes, b_loras, rank = check_lora_expand_args(None, lora_b, token_lora_indices, out, slice_sizes,
                                                     sorted_token_ids, lora_token_starts, lora_ranks)
    if b_loras != num_loras:
        raise ValueError(f"lora_a and lora_b must stack the same slots, got {num_loras} and {b_loras}")
    if width != len(sizes) * rank:
        raise ValueError(f"lora_a has {width} rank rows, not the {len(sizes)} slices x lora_b's rank {rank} = "
                         f"{len(sizes) * rank}")
    return num_tokens, in_features, sizes, num_loras, rank


def add_lora(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_lora_indices: torch.Tensor,
             out: torch.Tensor, *, scale: float = 1.0, slice_sizes: Sequence[int] | None = None,
             num_splits: int | None = None, sorted_token_ids: torch.Tensor | None = None,
             lora_token_starts: torch.Tensor | None = None, lora_ranks: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] += scale * (x[t] @ A^T) @ B^T`` with each token's slot's adapter, in place: a LoRA layer's delta
    (vLLM's ``add_lora_linear``), :func:`lora_shrink` then :func:`lora_expand` in one call.

    Arguments as for those two: ``x`` and ``lora_a`` as the shrink's, ``lora_b``, ``out`` and ``slice_sizes`` as
    the expand's, the indices, grouping and ``lora_ranks`` shared (so ``lora_a`` holds ``len(slice_sizes) * R``
    rank rows, R being ``lora_b``'s rank). The float32 intermediate is the op's own.

    On the Triton path, for decode batches of 16-bit activations at the usual ranks (:func:`expand_sums_planes`),
    the expand reads the shrink's K-split planes and sums them as it loads them, in plane order: two launches where
    the two ops take three (the planes' ``torch.sum``), with the same arithmetic. Elsewhere it is the two ops.
    Returns ``out``.
    """
    num_tokens, in_features, sizes, num_loras, rank = check_add_lora_args(
        x, lora_a, lora_b, token_lora_indices, out, scale, slice_sizes, num_splits, sorted_token_ids,
        lora_token_starts, lora_ranks)
    if (has_no_data(x, lora_a, lora_b, token_lora_indices, out, sorted_token_ids, lora_token_starts, lora_ranks)
            or num_tokens == 0):
        return out
    width = len(sizes) * rank
    if use_triton(out):
        sorted_token_ids, lora_token_starts = _triton_mapping(out, token_lora_indices, num_loras, sorted_token_ids,
                                                              lora_token_starts, lora_ranks, rank)
        if num_splits is None:
            num_splits = _shrink_splits(x, width)
        planes = torch.empty(num_splits, num_tokens, width, dtype=torch.float32, device=x.device)
        _launch_shrink(x, lora_a, sorted_token_ids, lora_token_starts, float(scale), planes, lora_ranks)
        if num_splits > 1 and not expand_sums_planes(num_tokens, rank, out.dtype, launch_device_kind(out.device)):
            planes = torch.sum(planes, dim=0)
        _expand_triton(planes, lora_b, sorted_token_ids, lora_token_starts, out, sizes, lora_ranks)
    else:
        buffer = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)
        _shrink_cpu(x, lora_a, token_lora_indices, float(scale), buffer, lora_ranks, num_loras, rank)
        _expand_cpu(buffer, lora_b, token_lora_indices, out, sizes, lora_ranks, num_loras, rank)
    return out


def _triton_mapping(like, token_lora_indices, num_loras, sorted_token_ids, lora_token_starts, lora_ranks, rank):
    """The Triton path's grouping (computed when not given) after the value checks, when enabled."""
    if sorted_token_ids is None:
        sorted_token_ids, lora_token_starts = lora_mapping(token_lora_indices, num_loras)
    elif value_checks_enabled(like):
        _check_index_values(token_lora_indices, num_loras)
    if lora_ranks is not None and value_checks_enabled(like):
        _check_rank_values(lora_ranks, rank)
    return sorted_token_ids, lora_token_starts


def _shrink_splits(x: torch.Tensor, width: int) -> int:
    num_tokens, in_features = x.shape
    return shrink_num_splits(num_tokens, width, in_features, num_multiprocessors(x.device), x.dtype,
                             launch_device_kind(x.device))


def _shrink_cpu(x, lora_a, token_lora_indices, scale, out, lora_ranks, num_loras, slice_rank):
    _run_cpu("lora_shrink", lambda: _native.lora_shrink(x, lora_a, token_lora_indices, scale, out, lora_ranks),
             lambda: _shrink_torch(x, lora_a, token_lora_indices, scale, out, lora_ranks),
             x, token_lora_indices, num_loras, lora_ranks, slice_rank)


def _expand_cpu(buffer, lora_b, token_lora_indices, out, sizes, lora_ranks, num_loras, rank):
    _run_cpu("lora_expand", lambda: _native.lora_expand(buffer, lora_b, token_lora_indices, sizes, out, lora_ranks),
             lambda: _expand_torch(buffer, lora_b, token_lora_indices, out, sizes, lora_ranks),
             out, token_lora_indices, num_loras, lora_ranks, rank)


def _run_cpu(what: str, native, twin, like: torch.Tensor, token_lora_indices, num_loras: int, lora_ranks,
             rank: int) -> None:
    """The native kernel, which checks the values as it groups (a refusal: the checks say what was wrong), else the
    twin after the checks (where enabled)."""
    if use_native(like):
        if not native():
            _check_values(token_lora_indices, num_loras, lora_ranks, rank)
            raise RuntimeError(f"pagedkernels native {what} rejected values the checks accept")
        return
    if value_checks_enabled(like):
        _check_values(token_lora_indices, num_loras, lora_ranks, rank)
    twin()


def _check_values(token_lora_indices: torch.Tensor, num_loras: int, lora_ranks: torch.Tensor | None,
                  rank: int) -> None:
    """The indices' and the ranks' values (a host sync on CUDA)."""
    _check_index_values(token_lora_indices, num_loras)
    if lora_ranks is not None:
        _check_rank_values(lora_ranks, rank)


# ----------------------------------------------------------------------------------------------
# PyTorch twin
# ----------------------------------------------------------------------------------------------


def _slot_runs(token_lora_indices: torch.Tensor, num_loras: int) -> list[tuple[int, torch.Tensor]]:
    """(slot, its token ids) for every slot with tokens (reads the counts on the host)."""
    sorted_ids, starts = lora_mapping(token_lora_indices, num_loras)
    bounds = starts.tolist()
    return [(slot, sorted_ids[bounds[slot]:bounds[slot + 1]].long()) for slot in range(num_loras)
            if bounds[slot + 1] > bounds[slot]]


def _shrink_torch(x, lora_a, token_lora_indices, scale, out, lora_ranks=None):
    out.zero_()
    ranks = None if lora_ranks is None else lora_ranks.tolist()
    slice_rank = lora_a.shape[1] // (1 if ranks is None else len(ranks[0]))
    for slot, rows in _slot_runs(token_lora_indices, lora_a.shape[0]):
        inputs = x.index_select(0, rows).float()
        if ranks is None:
            out.index_copy_(0, rows, (inputs @ lora_a[slot].float().t()) * scale)
            continue
        product = torch.zeros(len(rows), lora_a.shape[1], dtype=torch.float32, device=x.device)
        for s, r in enumerate(ranks[slot]):   # each slice's rows up to the slot's rank; zeros past it
            start = s * slice_rank
            product[:, start:start + r] = (inputs @ lora_a[slot, start:start + r].float().t()) * scale
        out.index_copy_(0, rows, product)


def _expand_torch(buffer, lora_b, token_lora_indices, out, sizes, lora_ranks=None):
    rank = lora_b.shape[2]
    ranks = None if lora_ranks is None else lora_ranks.tolist()
    for slot, rows in _slot_runs(token_lora_indices, lora_b.shape[0]):
        inputs = buffer.index_select(0, rows)
        deltas = []
        for s, part in enumerate(lora_b[slot].split(sizes, dim=0)):
            r = rank if ranks is None else ranks[slot][s]
            deltas.append(inputs[:, s * rank:s * rank + r] @ part[:, :r].float().t())
        out.index_copy_(0, rows, (out.index_select(0, rows).float() + torch.cat(deltas, dim=1)).to(out.dtype))


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


def shrink_num_splits(num_tokens: int, width: int, in_features: int, num_multiprocessors: int, dtype: torch.dtype,
                      device_kind: str) -> int:
    """K splits of a shrink launch, from shapes only (no host sync; CUDA-graph capturable).

    Without splitting, a decode batch (a few tokens, width S*R of 16-192) is a handful of programs, each
    streaming all of K: most SMs idle while they do. We aim for two waves (``2 * num_multiprocessors``
    programs, counting one slot's token blocks: the others' programs come on top), no split under
    ``MIN_K_PER_SPLIT`` input features, at most ``MAX_SHRINK_SPLITS``. On an H100 (132 SMs), K = 4096,
    width 48: 1, 64 or 1024 tokens -> 16 splits of 256 features (1, 1 and 16 token blocks), 8192 tokens -> 3;
    K = 576 -> 2 at most. The split planes cost a scratch of num_splits x num_tokens x width floats and a sum."""
    block_m, block_n, _, _ = shrink_launch_config(num_tokens, width, dtype, device_kind)
    programs = max(1, triton.cdiv(num_tokens, block_m) * triton.cdiv(width, block_n))
    wanted = triton.cdiv(2 * num_multiprocessors, programs)
    return max(1, min(wanted, in_features // MIN_K_PER_SPLIT, MAX_SHRINK_SPLITS))


def shrink_launch_config(num_tokens: int, width: int, dtype: torch.dtype, device_kind: str) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the shrink, from shapes, dtype and device kind only (so the
    CUDA choice compiles ahead of time anywhere: ``pagedkernels._aot``).

    The output is narrow (S*R: 8-192 for ranks 8-64 and up to three slices): one output tile covers it up to 64
    (tl.dot needs >= 16 in every dimension, so narrower ones are padded and masked). Decode batches take 16-token
    blocks (the smallest dot); longer ones 64, so each weight tile loaded serves more tokens. A program holds an
    x tile (BLOCK_M x BLOCK_K), an A tile (BLOCK_K x BLOCK_N) and the float32 accumulator (BLOCK_M x BLOCK_N):
    at 64 x 64 x 64 and 4 warps, 32 accumulator registers a thread; ptxas gave 16-bit inputs 46-146 registers
    (sm_90 / sm_80, Triton 3.9) and no spills. float32 inputs run ieee FMA dots (exact, a correctness dtype, not a
    serving one) whose operand layouts keep long K rows per thread: half the K tile, and 8 warps (at 4, a 64-token
    tile took 220 registers on sm_80). The interpreter takes 16 x 16 x 16 tiles, so small test shapes still cross
    every mask and split."""
    if device_kind != "cuda":
        return 16, 16, 16, 4
    block_m = 16 if num_tokens <= 32 else 64
    block_n = min(64, max(16, triton.next_power_of_2(width)))
    if dtype == torch.float32:
        return block_m, block_n, 32, 8
    return block_m, block_n, 64, 4


def expand_launch_config(num_tokens: int, rank: int, dtype: torch.dtype, device_kind: str) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_R, num_warps) of the expand, from shapes, dtype and device kind only.

    The reduction is over the rank (8-64 typically, looped in chunks of BLOCK_R <= 64, so any rank fits the same
    registers), the output is wide (a projection's features): 64-feature tiles read each slot's B once per
    token block. A program holds the buffer tile (BLOCK_M x BLOCK_R), a B tile (BLOCK_R x BLOCK_N), the
    accumulator and the out tile (BLOCK_M x BLOCK_N each): 16-bit weights took 46-144 registers (sm_90 / sm_80,
    Triton 3.9), no spills. float32 (ieee dots) at a 64-token tile, 64-rank chunks and 4 warps spilled on sm_80
    (255 registers + 0.8 KB), and still took 254 at 32-rank chunks and 8 warps: it takes 32-token tiles, 32-rank
    chunks and 8 warps."""
    if device_kind != "cuda":
        return 16, 16, min(64, max(16, triton.next_power_of_2(rank))), 4
    block_m = 16 if num_tokens <= 32 else 64
    if dtype == torch.float32:
        return min(block_m, 32), 64, min(32, max(16, triton.next_power_of_2(rank))), 8
    return block_m, 64, min(64, max(16, triton.next_power_of_2(rank))), 4


# Not specialized on the step's tokens: a step of a new shape compiles no variant of its own
# (tests/engine/test_kernel_variants.py). Hence no stride of the split planes either (num_tokens * stride_o_m).
@triton.jit(do_not_specialize=["num_tokens"])
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, in_features]
    a_ptr,  # [num_loras, width, in_features]  (width = num_slices * rank)
    out_ptr,  # fp32 [num_splits, num_tokens, width] contiguous (one split: [num_tokens, width], rows stride_o_m)
    sorted_ids_ptr,  # int32 [num_tokens]: token ids grouped by slot, tokens without an adapter last
    starts_ptr,  # int32 [num_loras + 1]: where each slot's run starts in sorted_ids
    ranks_ptr,  # int32 [num_loras, num_slices]: each slot's rank per slice (read only when has_ranks)
    num_tokens,
    width,
    in_features,
    scale,  # float
    has_ranks,  # 0: every slot of rank slice_rank (ranks_ptr any int32 pointer, never read)
    num_slices,
    slice_rank,  # R: width = num_slices * R
    stride_x_m: tl.int64,
    stride_a_l: tl.int64,
    stride_a_n: tl.int64,
    stride_o_m: tl.int64,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (exact, not tf32); None (default) for 16-bit
):
    # grid: (cdiv(num_tokens, BLOCK_M) * cdiv(width, BLOCK_N), num_splits, num_loras + 1). Program (i, split,
    # slot) computes token block i // n_blocks of the slot's run against output block i % n_blocks, over its
    # split's share of the K tiles; the extra slot, num_loras, is the tokens without an adapter: zeros.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.program_id(2)
    num_loras = tl.num_programs(2) - 1
    n_blocks = tl.cdiv(width, BLOCK_N)
    pid_m = pid // n_blocks
    pid_n = pid % n_blocks

    run_start = tl.load(starts_ptr + slot)
    run_end = tl.load(starts_ptr + tl.minimum(slot + 1, num_loras))
    run_end = tl.where(slot < num_loras, run_end, num_tokens)
    if pid_m * BLOCK_M >= run_end - run_start:
        return  # the slot has fewer tokens than this block (most programs of a many-adapter grid)

    m_offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] positions in the slot's run
    m_mask = m_offs < run_end - run_start
    tokens = tl.load(sorted_ids_ptr + run_start + m_offs, mask=m_mask, other=0).to(tl.int64)  # [BLOCK_M]
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = n_offs < width
    plane = split.to(tl.int64) * num_tokens * stride_o_m   # split 0 alone when the output is not split
    out_ptrs = out_ptr + plane + tokens[:, None] * stride_o_m + n_offs[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if slot < num_loras:
        # rows of A past the slot's rank in their slice: not read, zeros out
        slot_ranks = tl.full([BLOCK_N], slice_rank, tl.int32)
        if has_ranks != 0:
            slot_ranks = tl.load(ranks_ptr + slot * num_slices + n_offs // slice_rank, mask=n_mask, other=0)
        live = n_mask & (n_offs % slice_rank < slot_ranks)  # [BLOCK_N]
        k_tiles = tl.cdiv(in_features, BLOCK_K)
        tiles_per_split = tl.cdiv(k_tiles, tl.num_programs(1))
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, k_tiles)
        k_base = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        x_rows = x_ptr + tokens[:, None] * stride_x_m  # [BLOCK_M, 1]
        a_cols = a_ptr + slot.to(tl.int64) * stride_a_l + n_offs[None, :].to(tl.int64) * stride_a_n  # [1, BLOCK_N]
        for tile in range(tile_lo, tile_hi):
            k_offs = tile * BLOCK_K + k_base
            k_mask = k_offs < in_features
            # X : (BLOCK_M, BLOCK_K)
            X = tl.load(x_rows + k_offs[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            # A : (BLOCK_K, BLOCK_N), the slot's rows n read along k
            A = tl.load(a_cols + k_offs[:, None], mask=k_mask[:, None] & live[None, :], other=0.0)
            acc += tl.dot(X, A, input_precision=DOT_PRECISION)
        acc = tl.where(live[None, :], acc * scale, 0.0)
    tl.store(out_ptrs, acc, mask=out_mask)


def expand_sums_planes(num_tokens: int, rank: int, dtype: torch.dtype, device_kind: str) -> bool:
    """Whether :func:`add_lora`'s expand sums the shrink's K-split planes itself (shapes, dtype and device kind
    only). On CUDA for 16-bit weights whose expand tile holds at most 64 x 32 buffer values (token block x rank
    chunk): decode batches (16-token tiles, 47-103 registers) and 64-token tiles at ranks up to 32 (125-160), a
    128-row decode step's at rank 16 among them; no spills on sm_90 / sm_80 with Triton 3.6 and 3.9. With the
    planes' loop the 64-token tile of 64-rank chunks and the float32 tiles spilled on sm_80 (4-8 B): those sum
    apart, as :func:`lora_shrink` does. The interpreter's tiles are all 16 x 16 x 16: always."""
    if device_kind != "cuda":
        return True
    if dtype == torch.float32:
        return False
    block_m, _, block_r, _ = expand_launch_config(num_tokens, rank, dtype, device_kind)
    return block_m * block_r <= 64 * 32


# The planes' count and their stride (num_tokens rows apart) are not specialized on either: a step's token count
# compiles no variant of its own (tests/engine/test_kernel_variants.py).
@triton.jit(do_not_specialize=["num_tokens", "num_planes"])
def _lora_expand_kernel(
    buffer_ptr,  # fp32 [num_planes, num_tokens, num_slices * rank] (one plane: rows stride_buf_m apart)
    b_ptr,  # [num_loras, out_features, rank]
    out_ptr,  # [num_tokens, out_features], updated in place
    sorted_ids_ptr,  # int32 [num_tokens]
    starts_ptr,  # int32 [num_loras + 1]
    ranks_ptr,  # int32 [num_loras, num_slices]: each slot's rank per slice (read only when has_ranks)
    num_tokens,
    num_planes,  # the shrink's K splits, unsummed: the buffer is their sum, taken here in plane order
    rank,
    has_ranks,  # 0: every slot of rank `rank`
    num_slices,
    slice_size_0,  # output features of each slice; 0 for slices past the last (the grid has one row per slice)
    slice_size_1,
    slice_size_2,
    stride_buf_m: tl.int64,
    stride_b_l: tl.int64,
    stride_b_n: tl.int64,
    stride_o_m: tl.int64,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SUM_PLANES: tl.constexpr,  # read num_planes planes (else one, num_planes ignored)
):
    # grid: (cdiv(num_tokens, BLOCK_M) * cdiv(largest slice, BLOCK_N), num_slices, num_loras). Program (i, s,
    # slot): token block i // n_blocks of the slot's run, output block i % n_blocks of slice s.
    pid = tl.program_id(0)
    s = tl.program_id(1)
    slot = tl.program_id(2)
    n_blocks = tl.cdiv(tl.maximum(slice_size_0, tl.maximum(slice_size_1, slice_size_2)), BLOCK_N)
    pid_m = pid // n_blocks
    pid_n = pid % n_blocks
    slice_start = tl.where(s > 0, slice_size_0, 0) + tl.where(s > 1, slice_size_1, 0)
    slice_size = tl.where(s == 0, slice_size_0, tl.where(s == 1, slice_size_1, slice_size_2))

    run_start = tl.load(starts_ptr + slot)
    run_len = tl.load(starts_ptr + slot + 1) - run_start
    if (pid_m * BLOCK_M >= run_len) | (pid_n * BLOCK_N >= slice_size):
        return

    m_offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_mask = m_offs < run_len
    tokens = tl.load(sorted_ids_ptr + run_start + m_offs, mask=m_mask, other=0).to(tl.int64)  # [BLOCK_M]
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] within the slice
    n_mask = n_offs < slice_size
    columns = (slice_start + n_offs).to(tl.int64)  # [BLOCK_N] of out and lora_b
    r_base = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    buf_rows = buffer_ptr + tokens[:, None] * stride_buf_m + s * rank  # [BLOCK_M, 1]
    plane_stride = num_tokens.to(tl.int64) * stride_buf_m
    b_cols = b_ptr + slot.to(tl.int64) * stride_b_l + columns[None, :] * stride_b_n  # [1, BLOCK_N]

    # the slot's rank in this slice: the buffer's and B's columns past it are not read
    slot_rank = rank
    if has_ranks != 0:
        slot_rank = tl.load(ranks_ptr + slot * num_slices + s)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, slot_rank, BLOCK_R):
        r_offs = r0 + r_base
        r_mask = r_offs < slot_rank
        # U : (BLOCK_M, BLOCK_R)
        u_mask = m_mask[:, None] & r_mask[None, :]
        U = tl.load(buf_rows + r_offs[None, :], mask=u_mask, other=0.0)
        if SUM_PLANES:
            for p in range(1, num_planes):  # the K splits' partial sums, in order (as torch.sum over the planes)
                U += tl.load(buf_rows + p * plane_stride + r_offs[None, :], mask=u_mask, other=0.0)
        # B : (BLOCK_R, BLOCK_N)
        B = tl.load(b_cols + r_offs[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(U.to(B.dtype), B, input_precision=DOT_PRECISION)

    out_ptrs = out_ptr + tokens[:, None] * stride_o_m + columns[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    previous = tl.load(out_ptrs, mask=out_mask, other=0.0)
    tl.store(out_ptrs, (previous.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def _shrink_triton(x, lora_a, sorted_token_ids, lora_token_starts, scale, num_splits, out, lora_ranks=None):
    # One split writes `out` itself; more write planes of a scratch, summed in order after.
    planes = out if num_splits == 1 else torch.empty(num_splits, *out.shape, dtype=torch.float32, device=x.device)
    _launch_shrink(x, lora_a, sorted_token_ids, lora_token_starts, scale, planes, lora_ranks)
    if num_splits > 1:
        torch.sum(planes, dim=0, out=out)


def _launch_shrink(x, lora_a, sorted_token_ids, lora_token_starts, scale, planes, lora_ranks):
    """The shrink into ``planes``: ``[num_tokens, width]`` (rows any stride) for one K split, else contiguous
    ``[num_splits, num_tokens, width]``, a plane a split."""
    num_tokens, in_features = x.shape
    num_loras, width, _ = lora_a.shape
    num_splits = 1 if planes.dim() == 2 else planes.shape[0]
    block_m, block_n, block_k, num_warps = shrink_launch_config(num_tokens, width, x.dtype,
                                                                launch_device_kind(x.device))
    grid = (triton.cdiv(num_tokens, block_m) * triton.cdiv(width, block_n), num_splits, num_loras + 1)
    num_slices = 1 if lora_ranks is None else lora_ranks.shape[1]
    _lora_shrink_kernel[grid](
        x, lora_a, planes, sorted_token_ids, lora_token_starts,
        lora_token_starts if lora_ranks is None else lora_ranks, num_tokens, width, in_features, scale,
        int(lora_ranks is not None), num_slices, width // num_slices,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), planes.stride(-2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=num_warps,
    )


def _expand_triton(buffer, lora_b, sorted_token_ids, lora_token_starts, out, sizes, lora_ranks=None):
    """``buffer``: ``[num_tokens, S*R]`` (rows any stride), or the shrink's unsummed planes, contiguous
    ``[num_splits, num_tokens, S*R]``."""
    num_tokens = out.shape[0]
    num_planes = 1 if buffer.dim() == 2 else buffer.shape[0]
    num_loras, _, rank = lora_b.shape
    block_m, block_n, block_r, num_warps = expand_launch_config(num_tokens, rank, out.dtype,
                                                                launch_device_kind(out.device))
    padded = tuple(sizes) + (0,) * (MAX_LORA_SLICES - len(sizes))
    grid = (triton.cdiv(num_tokens, block_m) * triton.cdiv(max(sizes), block_n), len(sizes), num_loras)
    _lora_expand_kernel[grid](
        buffer, lora_b, out, sorted_token_ids, lora_token_starts,
        lora_token_starts if lora_ranks is None else lora_ranks, num_tokens, num_planes, rank,
        int(lora_ranks is not None), len(sizes), *padded,
        buffer.stride(-2), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        DOT_PRECISION="ieee" if out.dtype == torch.float32 else None, SUM_PLANES=num_planes > 1,
        num_warps=num_warps,
    )
