"""The course's CUDA paths, checked on a machine with a CUDA GPU; the tests run without one.

    python tools/gpu_check.py

1. Every solution notebook runs top to bottom as a learner's kernel runs it on a GPU (Colab's,
   say): the try-it cells put their tensors on the GPU, `check()` and nbgrader's test cells run
   every visible and hidden test, and the Triton kernel is compiled instead of interpreted.
2. The not-allowed tripwire stops PyTorch's CUDA attention kernels (flash, memory-efficient,
   cuDNN and math backends) and the softmax family on CUDA tensors.
3. The Triton rule on compiled kernels: the solution keeps full marks, while attention computed
   in PyTorch, returned as it is or copied by a kernel, loses every test.
4. Triton in a sandboxed `flash_triton` worker finds the driver's library (`libcuda.so.1`),
   against which it links its launcher; it prints where, the first folder on the loader's paths
   that the worker cannot reach, and the modes of the folders the library lies in.
5. The grader (`python -m autograde grade`, sandboxed workers) on a class: a `flash_triton`
   worker computes on the GPU; a notebook that takes all of the GPU's memory costs the
   notebooks graded beside it nothing; a worker of another exercise finds no GPU.

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
    from autograde.sandbox.tripwire import ForbiddenCall, Tripwire

    q = torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.float16)
    stopped = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        with sdpa_kernel(backend):
            try:  # outside the tripwire first: a backend this GPU or build lacks is no test of it
                F.scaled_dot_product_attention(q, q, q)
            except RuntimeError:
                continue
            # F.sdpa is written in C: only the replaced kernels in the dispatcher can stop it, modes or not.
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


# Prepended to the solution cell of a flash_triton notebook: all of the GPU's memory but 256 MiB,
# held while the notebook runs, as a hostile submission would to cost its neighbours their grades.
HOARD = """import time
free, _ = torch.cuda.mem_get_info()
hoard = torch.empty(free - 2**28, dtype=torch.uint8, device="cuda")
time.sleep(20)
"""
# Appended to the solution cell of an sdpa notebook: what a learner meets who uses the GPU there.
ON_THE_GPU = """
on_the_gpu = torch.zeros(1, device="cuda")
"""


# Run in a flash_triton worker: whether the driver's library, where the loader's cache puts it,
# can be reached from there (Triton links its launcher against it), and if not, why.
DRIVER_IN_THE_WORKER = r"""
import json, os, subprocess
seen = {"uid": os.getuid(), "TRITON_LIBCUDA_PATH": os.environ.get("TRITON_LIBCUDA_PATH")}
cache = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
for path in [line.rsplit("=>", 1)[-1].strip() for line in cache.splitlines() if "libcuda.so.1 " in line]:
    parts = path.split("/")
    for end in range(2, len(parts) + 1):
        step = "/".join(parts[:end])
        try:
            os.stat(step)
        except OSError as error:
            seen[path] = f"{step}: {error.strerror}"
            break
    else:
        seen[path] = "reachable"
try:
    from triton.backends.nvidia import driver
    seen["triton"] = driver.libcuda_dirs()
except Exception as error:
    seen["triton"] = f"{type(error).__name__}: {error}"
seen["mounts"] = [line.split(" - ")[0].split()[4] + " " + line.split(" - ")[1].split()[0]
                  for line in open("/proc/self/mountinfo") if ("nvidia" in line or "cuda" in line) and " - " in line]
json.dump(seen, open("driver.json", "w"))
"""


def driver_in_the_worker() -> str:
    """The GPU driver's library as a sandboxed flash_triton worker sees it, and where Triton there
    finds it; with the modes of the folders it lies in, as the grader sees them."""
    import json
    import tempfile

    from autograde import registry
    from autograde.grading.sandboxed import SandboxedSubmission
    from autograde.sandbox import client as sandbox

    library = sandbox.driver_library()
    folders = {}
    if library is not None:
        for parent in reversed(Path(library).parents):
            folders[str(parent)] = oct(parent.stat().st_mode & 0o7777)
    with tempfile.TemporaryDirectory() as folder:
        outcome = SandboxedSubmission(registry.get("flash_triton"), [(1, DRIVER_IN_THE_WORKER)], sandbox.Limits(),
                                      folder=Path(folder)).close()
        report = Path(folder) / "work" / "driver.json"
        if not report.exists():
            raise AssertionError(f"the worker wrote nothing: {outcome}")
        seen = json.loads(report.read_text())
    seen["found by the grader"] = library
    seen["folder modes"] = folders
    if not isinstance(seen["triton"], list):
        raise AssertionError(f"Triton in the worker finds no libcuda.so.1: {seen}")
    return json.dumps(seen)


def grader_on_a_class() -> str:
    """`python -m autograde grade --jobs 4` on five students, as an instructor runs it."""
    import csv
    import subprocess
    import tempfile

    from autograde import registry
    from tests.fixtures.notebooks import answer, learner_notebook, write
    from tests.test_exercise_flash import TORCH_INSTEAD_OF_TRITON

    triton = answer("flash_triton", "flash_attention_triton")
    students = {
        "solution": ("flash_triton", None), "solution-again": ("flash_triton", None),
        "hoarder": ("flash_triton", {"flash_attention_triton": HOARD + triton}),
        "attention-in-pytorch": ("flash_triton", {"flash_attention_triton": TORCH_INSTEAD_OF_TRITON}),
        "sdpa-on-the-gpu": ("sdpa", {"scaled_dot_product_attention": answer("sdpa", "scaled_dot_product_attention")
                                     + ON_THE_GPU}),
    }
    with tempfile.TemporaryDirectory() as folder:
        submitted, out = Path(folder) / "submitted", Path(folder) / "graded"
        for student, (exercise_id, answers) in students.items():
            write(learner_notebook(exercise_id, answers), submitted / student / registry.get(exercise_id).notebook)
        start = time.perf_counter()
        ran = subprocess.run([sys.executable, "-m", "autograde", "grade", str(submitted), "--out", str(out),
                              "--jobs", "4", "--seed", "1", "--assignment", "flash", "--assignment", "attention"],
                             cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        print(ran.stdout[-3000:], ran.stderr[-3000:], sep="\n")
        rows = {(row["student"], row["exercise"]): row for row in csv.DictReader((out / "grades.csv").open())}
        feedback = {student: (out / "feedback" / f"{student}.md").read_text() for student in students}
        free, total = torch.cuda.mem_get_info()
    for (student, exercise_id), row in sorted(rows.items()):
        if students[student][0] == exercise_id:
            print(f"     {student:22} {exercise_id:13} {row['score']:>5}/{row['max_score']:<5} {row['status']:10} "
                  f"{row['reason'][:150]}")
    full = [s for s in ("solution", "solution-again") if rows[s, "flash_triton"]["score"]
            != rows[s, "flash_triton"]["max_score"]]
    if full:
        raise AssertionError(f"lost points on the GPU: {', '.join(full)}\n{feedback[full[0]][-2500:]}")
    if float(rows["attention-in-pytorch", "flash_triton"]["score"]) > 0:
        raise AssertionError("attention in PyTorch kept points")
    if rows["sdpa-on-the-gpu", "sdpa"]["score"] != rows["sdpa-on-the-gpu", "sdpa"]["max_score"]:
        raise AssertionError("the sdpa notebook that used the GPU lost points")
    found = [line for line in feedback["sdpa-on-the-gpu"].splitlines() if "cuda" in line.lower() or "GPU" in line]
    if not found:
        raise AssertionError("the sdpa worker's use of the GPU was not reported")
    if free < total - 2**30:
        raise AssertionError(f"after grading, only {free / 2**30:.1f} of {total / 2**30:.1f} GiB of GPU memory free")
    return (f"{seconds:.0f} s for the class with --jobs 4; the sdpa worker was told: {found[0].strip()[:200]}; "
            f"afterwards {free / 2**30:.1f} of {total / 2**30:.1f} GiB of GPU memory free")


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
    outcome("the GPU driver's library, from a sandboxed worker", driver_in_the_worker)
    outcome("the grader on a class, in sandboxed workers", grader_on_a_class)
    print(f"\n{len(FAILED)} checks failed" + (": " + "; ".join(FAILED) if FAILED else ""))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
