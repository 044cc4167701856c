"""Triton's interpreter (TRITON_INTERPRET=1) without its re-patching on every device-function call.

A launch (`GridExecutor.__call__`) patches the language modules its kernel sees (`triton.language`,
`triton.language.core`) to interpreted builtins and restores them when it ends. Every call of a
`@triton.jit` function inside the kernel (`InterpretedFunction.__call__`), `tl.max` and `tl.sum`
included, patches the modules that function sees again, walking each with `inspect.getmembers`:
most of an interpreted flash kernel's time. Once a module has been patched during the launch under
way, by the launch or by an earlier call, patching it again changes nothing (its builtins are
already replaced, the rest is set to the same behaviour), so `install` skips it; the first call
that needs a module the launch has not patched runs Triton's own code, as does any call outside a
launch. What the kernel computes and what a launch leaves patched or restored are Triton's own.

The interpreter also checks every 32-bit integer add, subtract and multiply for overflow (in 64
bits, then compared with the limits), for a device assertion that its builder, never in debug
mode, then skips: a fifth of an interpreted flash kernel's time for a result nothing reads.
`install` turns that check off where the assertion would be skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

_launches: list[set] = []  # per launch under way, innermost last: the language modules patched in it


def _language_modules(fn) -> frozenset:
    """The modules Triton's `_patch_lang` patches for `fn`: `triton.language` and its `core`, as `fn` sees them."""
    import triton.language as tl

    return frozenset(value for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core))


def install() -> None:
    """Wrap the interpreter's launch and device-function call; once per process."""
    from triton.runtime import interpreter

    if getattr(interpreter.InterpretedFunction.__call__, "patches_once", False):
        return
    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    launch, device_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__

    @functools.wraps(launch)
    def tracked_launch(executor, *args, **kwargs):
        _launches.append(set(_language_modules(executor.fn)))
        try:
            return launch(executor, *args, **kwargs)
        finally:
            _launches.pop()

    @functools.wraps(device_call)
    def call_in_patched_language(function, *args, **kwargs):
        modules = _language_modules(function.fn)
        if not _launches or not modules <= _launches[-1]:
            if _launches:
                _launches[-1].update(modules)
            return device_call(function, *args, **kwargs)
        rewritten = function.rewrite()
        try:
            return rewritten(*args, **kwargs)
        except Exception as exc:  # reported as Triton's own call reports it
            raise interpreter.InterpreterError(repr(exc)) from exc

    call_in_patched_language.patches_once = True
    interpreter.GridExecutor.__call__ = tracked_launch
    interpreter.InterpretedFunction.__call__ = call_in_patched_language
