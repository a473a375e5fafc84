"""Run the lessons: regenerate figures from the scripts, or executed notebooks from them.

Usage (from anywhere; paths are resolved from the package location)::

    python -m nbinfer.lessons_tool figures   [LESSON ...]   # run lessons/NN_*.py -> figures/*.png
    python -m nbinfer.lessons_tool notebooks [LESSON ...]   # lessons/NN_*.py -> executed .ipynb

A lesson is a jupytext "percent" script ``lessons/NN_name.py``. ``LESSON`` selects lessons by
number (``01``), stem (``01_attention_states``), name (``attention_states``) or file name.
``figures`` runs each script in a fresh interpreter with ``MPLBACKEND=Agg`` and the repository
root as working directory. ``notebooks`` converts each script with jupytext, executes it with
nbclient on the ``python3`` kernel of the current interpreter, and writes ``lessons/NN_name.ipynb``
with outputs and figures embedded.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

LESSON_PATTERN = re.compile(r"^\d\d_[A-Za-z0-9_]+\.py$")
KERNEL_NAME = "python3"
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


def repo_root() -> Path:
    """The repository root: the directory that contains the ``nbinfer`` package."""
    return Path(__file__).resolve().parent.parent


def start_lesson() -> Path:
    """The first line of a lesson that runs kernels: choose Numba's CUDA simulator (lessons run
    their kernels at tiny shapes so every step can be inspected, on any machine, GPU or not)
    before Numba loads, so a lesson runs as ``python lessons/NN_name.py`` from any directory
    and as a notebook, with no environment variable set by hand. Returns the repository root
    (read files through it, never relative to the working directory).

    Raises
    ------
    RuntimeError
        Numba's CUDA target was already loaded without the simulator in this process (restart
        the notebook's kernel and run the lesson from its first cell).
    """
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if "numba" in sys.modules:
        from numba.core import config

        if "numba.cuda" in sys.modules and not config.ENABLE_CUDASIM:
            raise RuntimeError("numba.cuda was loaded without the CUDA simulator before this "
                               "lesson started: restart the Python kernel and run the lesson "
                               "from its first cell")
        config.reload_config()  # numba core is loaded but not its CUDA target: re-read the env
    return repo_root()


def gpu_present() -> bool:
    """Whether torch sees a CUDA GPU, asked in a fresh process (a lesson's own process runs
    Numba's simulator)."""
    import shutil

    if shutil.which("nvidia-smi") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                           capture_output=True)
    return probe.returncode == 0


def run_bench(script: str, *args: str) -> dict:
    """Run ``bench/<script> *args --out FILE`` in a separate process without the simulator (the
    lessons' live measurements) and return the JSON it wrote."""
    import json
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        proc = subprocess.run([sys.executable, str(repo_root() / "bench" / script), *args,
                               "--out", out], env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"bench/{script} failed ({proc.returncode}):\n"
                               f"{proc.stderr[-2000:]}")
        return json.loads(Path(out).read_text())


def lessons_dir() -> Path:
    """``<repo>/lessons``."""
    return repo_root() / "lessons"


def lesson_scripts(names=None) -> list[Path]:
    """Lesson scripts ``lessons/NN_*.py`` in order, restricted to ``names`` when given.

    Raises
    ------
    ValueError
        If a name matches no lesson.
    """
    scripts = sorted(p for p in lessons_dir().glob("*.py") if LESSON_PATTERN.match(p.name))
    if not names:
        return scripts
    chosen = []
    for name in names:
        key = Path(name).name.removesuffix(".py").removesuffix(".ipynb")
        hits = [p for p in scripts
                if key in (p.stem, p.stem[:2], p.stem[3:])]
        if not hits:
            known = ", ".join(p.stem for p in scripts) or "none"
            raise ValueError(f"lesson {name!r} not found; lessons are: {known}")
        chosen.extend(h for h in hits if h not in chosen)
    return sorted(chosen)


def script_env(extra=None) -> dict:
    """Environment for running a lesson: Agg backend, the repo importable, and Numba's CUDA
    simulator (lessons run their kernels at tiny shapes so every step can be inspected, on any
    machine, GPU or not)."""
    env = dict(os.environ)
    env["MPLBACKEND"] = "Agg"
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    root = str(repo_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if extra:
        env.update(extra)
    return env


def run_script(path: Path, *, env=None, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run one lesson script in a fresh interpreter (cwd = repo root); raise on failure."""
    proc = subprocess.run([sys.executable, str(path)], cwd=repo_root(), env=script_env(env),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{path.name} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def script_to_notebook(path: Path):
    """Convert a percent script to an (unexecuted) ``nbformat`` notebook with a python3 kernel."""
    import jupytext

    nb = jupytext.read(path, fmt="py:percent")
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nb.metadata.pop("jupytext", None)
    nb.metadata["language_info"] = {"name": "python"}
    # Stable cell ids keep regenerated notebooks byte-identical when nothing changed.
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{path.stem[:2]}-{i:03d}"
    return nb


def execute_notebook(nb, *, timeout: float = 600.0):
    """Execute ``nb`` in place with nbclient (cwd = repo root) and return it."""
    from nbclient import NotebookClient

    saved = os.environ.get("MPLBACKEND")
    # The kernel inherits this process's environment; let it use the inline backend so that
    # any pyplot figure is embedded (nbinfer.viz.show embeds Figure objects either way).
    os.environ["MPLBACKEND"] = INLINE_BACKEND
    try:
        client = NotebookClient(nb, kernel_name=KERNEL_NAME, timeout=int(timeout),
                                record_timing=False,
                                resources={"metadata": {"path": str(repo_root())}})
        client.execute()
    finally:
        if saved is None:
            os.environ.pop("MPLBACKEND", None)
        else:
            os.environ["MPLBACKEND"] = saved
    for cell in nb.cells:
        if cell.get("cell_type") == "code":
            cell["outputs"] = coalesce_streams(cell.get("outputs", []))
    return nb


def coalesce_streams(outputs: list) -> list:
    """Outputs with consecutive stream chunks of one stream joined into one: where the kernel
    happens to flush between two prints is timing, not content (an executed notebook must not
    change from run to run)."""
    merged = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if (out.get("output_type") == "stream" and prev is not None
                and prev.get("output_type") == "stream" and prev.get("name") == out.get("name")):
            prev["text"] = "".join(prev["text"]) + "".join(out["text"])
        else:
            merged.append(out)
    return merged


def build_notebook(path: Path, *, out: Path | None = None, timeout: float = 600.0) -> Path:
    """Convert, execute and write ``lessons/NN_name.ipynb`` (or ``out``); return the path."""
    import nbformat

    nb = execute_notebook(script_to_notebook(path), timeout=timeout)
    out = out or path.with_suffix(".ipynb")
    nbformat.write(nb, str(out))
    return out


def cmd_figures(names) -> int:
    for path in lesson_scripts(names):
        t0 = time.perf_counter()
        run_script(path)
        print(f"{path.name}: ok ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


def cmd_notebooks(names) -> int:
    for path in lesson_scripts(names):
        t0 = time.perf_counter()
        out = build_notebook(path)
        print(f"{path.name} -> {out.relative_to(repo_root())} ({time.perf_counter() - t0:.1f} s)",
              flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbinfer.lessons_tool",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=("figures", "notebooks"),
                        help="figures: run the scripts; notebooks: write executed .ipynb files")
    parser.add_argument("lessons", nargs="*", help="restrict to these lessons (e.g. 01 02)")
    args = parser.parse_args(argv)
    try:
        if args.task == "figures":
            return cmd_figures(args.lessons)
        return cmd_notebooks(args.lessons)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
