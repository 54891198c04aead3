"""Triton's interpreter without its repeated patching of ``triton.language`` on every device-function call.

To run a kernel on CPU tensors the interpreter swaps ``triton.language``'s builtins (``tl.load``, ``tl.sum``,
``tensor.__add__``, ``tl.range``, ...) for NumPy versions: ``_patch_lang(kernel)`` before the grid runs, restored
after. It also calls ``_patch_lang`` on *every call of a nested ``@triton.jit`` function* inside the kernel (once per
program and loop iteration), which walks the language modules with ``inspect.getmembers`` and replaces every builtin
again by an equal wrapper. For kernels built from small helpers (the skinny GEMMs, the sampler's draw, fused MoE) that
walk was about 30% of an interpreted test's time (62 of 212 s in a profile of the skinny decode layers).

``install()`` wraps ``_patch_lang`` so that a nested call whose language modules the running kernel already patched
patches nothing (an empty scope, as the interpreter discards a nested call's scope anyway): the same builtins are in
place, so the kernels compute the same values. Any other call (a kernel's launch, a helper that reaches a language
module the kernel did not) goes to Triton's own ``_patch_lang`` as before. It also has ``_get_np_dtype`` remember
its answers (the original builds a table of every dtype on each call). Installed by tests/conftest.py when the
interpreter is on; ``TESTS_TRITON_REPATCH=1`` leaves Triton as it is (to compare).
"""
from __future__ import annotations

import inspect
import threading

_state = threading.local()   # the language modules the running kernel's launch patched (ids), or None
_installed: list = []        # (interpreter module, name, Triton's own function) for each function replaced


_languages_of: dict = {}   # function -> its languages (a module's imports do not change while kernels run)


def _languages(fn) -> frozenset[int]:
    """The ``triton.language`` modules ``fn``'s globals reach: what ``_patch_lang(fn)`` patches."""
    languages = _languages_of.get(fn)
    if languages is None:
        import triton.language as tl

        languages = _languages_of[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                                  if inspect.ismodule(value) and value in (tl, tl.core))
    return languages


def install() -> bool:
    """Wrap the interpreter's ``_patch_lang`` and ``_get_np_dtype`` (once). False where this Triton has no
    ``_patch_lang`` (then nothing changes)."""
    if _installed:
        return True
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_class is None:
        return False

    def patch_lang(fn):
        covered = getattr(_state, "languages", None)
        languages = _languages(fn)
        if covered is not None and languages <= covered:
            return scope_class()   # a nested call: its builtins are in place already
        scope = original(fn)
        if covered is not None:
            # A nested call that reached another language module (triton.language.standard's helpers, tl.sum and
            # tl.zeros, see tl.core too): the interpreter never restores a nested call's scope, so from now on that
            # module stays patched as well.
            _state.languages = covered | languages
        else:   # a kernel's launch: the grid runs under this scope until its restore
            _state.languages = languages
            restore = scope.restore

            def restore_and_forget():
                _state.languages = None
                restore()

            scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = patch_lang
    _installed.append((interpreter, "_patch_lang", original))
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None:
        interpreter._get_np_dtype = _remembering_np_dtype(np_dtype)
        _installed.append((interpreter, "_get_np_dtype", np_dtype))
    return True


def _remembering_np_dtype(original):
    """The interpreter's ``_get_np_dtype`` (a Triton dtype -> its NumPy storage dtype), which builds its table of
    every dtype on each of its calls (several per interpreted operation: 7% of an interpreted test's time), with each
    answer remembered per element dtype. A block's dtype is its element's, as in the original."""
    import triton.language as tl

    answers: dict = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):   # unhashable; the original answers it before building its table
            return original(tt_dtype)
        answer = answers.get(tt_dtype)
        if answer is None:
            answer = answers[tt_dtype] = original(tt_dtype)
        return answer

    return np_dtype


def uninstall() -> None:
    """Triton's own functions back (tests of this module)."""
    while _installed:
        module, name, original = _installed.pop()
        setattr(module, name, original)
    _state.languages = None
