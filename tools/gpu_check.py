"""The course's CUDA paths, checked on a machine with a CUDA GPU; the tests run without one.

    python tools/gpu_check.py

1. Every solution notebook runs top to bottom as a learner's kernel runs it on a GPU (Colab's,
   say): the try-it cells put their tensors on the GPU, `check()` and nbgrader's test cells run
   every visible and hidden test, and the Triton kernel is compiled instead of interpreted.
2. The not-allowed tripwire stops PyTorch's CUDA attention kernels (flash, memory-efficient,
   cuDNN and math backends) and the softmax family on CUDA tensors.
3. The Triton rule on compiled kernels: the solution keeps full marks, while attention computed
   in PyTorch, returned as it is or copied by a kernel, loses every test.

It prints each check and exits with status 1 if one fails.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

FAILED: list[str] = []


def outcome(name: str, check) -> None:
    """Run one check; a check fails by raising."""
    start = time.perf_counter()
    try:
        detail = check()
    except Exception:
        FAILED.append(name)
        print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        return
    print(f"ok   {name} ({time.perf_counter() - start:.1f} s){': ' + detail if detail else ''}", flush=True)


def solution_notebook(path: Path):
    """Every code cell of a solution notebook in order, in the notebook's folder, as its kernel would."""
    def run() -> str:
        import nbformat

        notebook = nbformat.read(path, as_version=4)
        namespace = {"__name__": "__main__"}
        printed = io.StringIO()
        here = os.getcwd()
        os.chdir(path.parent)
        try:
            with contextlib.redirect_stdout(printed):
                for number, cell in enumerate(notebook.cells):
                    if cell.cell_type == "code":
                        # Registered as IPython does, since Triton reads a kernel's source to compile it.
                        filename = f"<{path.name} cell {number}>"
                        linecache.cache[filename] = (len(cell.source), None, cell.source.splitlines(True), filename)
                        exec(compile(cell.source, filename, "exec"), namespace)
        finally:
            os.chdir(here)
        passed = printed.getvalue().count(" passed")
        return f"{passed} test cells and checks passed"
    return run


def tripwire_stops_cuda_attention() -> str:
    from autograde.cases import NOT_ALLOWED_ATTENTION, NOT_ALLOWED_SOFTMAX
    from autograde.submission.forbidden import ForbiddenCall, Tripwire

    q = torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.float16)
    stopped = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        with sdpa_kernel(backend):
            try:  # outside the tripwire first: a backend this GPU or build lacks is no test of it
                F.scaled_dot_product_attention(q, q, q)
            except RuntimeError:
                continue
            # Without the torch-function half: only the replaced kernels in the dispatcher can stop it.
            with Tripwire(NOT_ALLOWED_ATTENTION), torch._C.DisableTorchFunction():
                try:
                    F.scaled_dot_product_attention(q, q, q)
                except ForbiddenCall:
                    stopped.append(backend.name)
                    continue
            raise AssertionError(f"the {backend.name} backend ran under the tripwire")
    with Tripwire(NOT_ALLOWED_SOFTMAX):
        for call in (lambda x: x.softmax(-1), lambda x: torch.ops.aten._log_softmax(x, -1, False),
                     lambda x: torch.logsumexp(x, -1)):
            try:
                call(q.float())
            except ForbiddenCall:
                continue
            raise AssertionError("a softmax-family operator ran on CUDA under the tripwire")
    if not stopped:
        raise AssertionError("no SDPA backend ran on this GPU")
    return "stopped: " + ", ".join(stopped) + "; softmax, _log_softmax, logsumexp"


def triton_rule_on_compiled_kernels() -> str:
    from autograde import registry
    from autograde.frontends import check as self_check
    from tests.fixtures.notebooks import learner_notebook, run_cells
    from tests.test_exercise_flash import COPIED_BY_A_KERNEL, TORCH_INSTEAD_OF_TRITON

    exercise = registry.get("flash_triton")
    lost = {}
    for name, answers in (("solution", None), ("attention in PyTorch", TORCH_INSTEAD_OF_TRITON),
                          ("copied by a kernel", COPIED_BY_A_KERNEL)):
        namespace = run_cells(learner_notebook("flash_triton", answers and {"flash_attention_triton": answers}))
        results, _, _ = self_check.run_in_kernel(exercise, namespace, 1)
        lost[name] = [result.name for result in results if not result.passed]
        if (name == "solution") != (not lost[name]) or (name != "solution" and len(lost[name]) != len(results)):
            raise AssertionError(f"{name}: lost {lost[name]}")
    return ", ".join(f"{name} lost {len(tests)} tests" for name, tests in lost.items())


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing was checked",
              file=sys.stderr)
        return 1
    import triton

    print(f"machine: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, torch {torch.__version__}, "
          f"triton {triton.__version__}, Python {platform.python_version()}", flush=True)
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        outcome(f"solution notebook {path.relative_to(ROOT)} on the GPU", solution_notebook(path))
    outcome("the tripwire stops PyTorch's CUDA attention kernels and softmaxes", tripwire_stops_cuda_attention)
    outcome("the Triton rule on compiled kernels", triton_rule_on_compiled_kernels)
    print(f"\n{len(FAILED)} checks failed" + (": " + "; ".join(FAILED) if FAILED else ""))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
