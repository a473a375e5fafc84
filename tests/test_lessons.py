"""The lessons run, write their figures, and their committed notebooks match their scripts."""

from __future__ import annotations

import re

import nbformat
import pytest

from nbinfer import lessons_tool

SCRIPTS = lessons_tool.lesson_scripts()
SAVED = re.compile(r"""save_figure\(\s*\w+\s*,\s*["']([^"']+)["']""")


def _ids(paths):
    return [p.stem for p in paths]


def _figure_names(script):
    return SAVED.findall(script.read_text())


def _code_sources(nb):
    return [c.source.rstrip() for c in nb.cells if c.cell_type == "code"]


def test_lessons_exist():
    assert len(SCRIPTS) >= 2, [p.name for p in SCRIPTS]
    numbers = [p.name[:2] for p in SCRIPTS]
    assert len(set(numbers)) == len(numbers), f"duplicate lesson numbers: {numbers}"


@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_lesson_runs_and_saves_figures(script, tmp_path):
    names = _figure_names(script)
    assert names, f"{script.name} saves no figure"
    lessons_tool.run_script(script, env={"NBINFER_FIGURES_DIR": str(tmp_path)}, timeout=120)
    for name in names:
        out = tmp_path / name
        assert out.is_file() and out.stat().st_size > 1000, f"{script.name} did not write {name}"
        committed = lessons_tool.repo_root() / "figures" / name
        assert committed.is_file(), f"figures/{name} is not generated (bash dev.sh figures)"


@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_notebook_matches_script(script):
    ipynb = script.with_suffix(".ipynb")
    assert ipynb.is_file(), f"{ipynb.name} missing: run bash dev.sh notebooks"
    committed = nbformat.read(str(ipynb), as_version=4)
    expected = lessons_tool.script_to_notebook(script)
    assert _code_sources(committed) == _code_sources(expected), (
        f"{ipynb.name} is out of date with {script.name}: run bash dev.sh notebooks")
    prose = [c.source.rstrip() for c in committed.cells if c.cell_type == "markdown"]
    assert prose == [c.source.rstrip() for c in expected.cells if c.cell_type == "markdown"], (
        f"{ipynb.name} prose differs from {script.name}: run bash dev.sh notebooks")


@pytest.mark.parametrize("script", SCRIPTS, ids=_ids(SCRIPTS))
def test_notebook_was_executed(script):
    ipynb = script.with_suffix(".ipynb")
    if not ipynb.is_file():
        pytest.fail(f"{ipynb.name} missing: run bash dev.sh notebooks")
    nb = nbformat.read(str(ipynb), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "not executed"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], "executed with errors"
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= len(_figure_names(script)), (
        f"{ipynb.name} embeds {len(images)} images, expected one per saved figure")


def test_stream_chunks_of_an_executed_cell_are_joined():
    # where the kernel flushed between prints is timing: the committed notebook must not show it
    outs = [{"output_type": "stream", "name": "stdout", "text": "a\n"},
            {"output_type": "stream", "name": "stdout", "text": ["b\n", "c\n"]},
            {"output_type": "stream", "name": "stderr", "text": "w\n"},
            {"output_type": "display_data", "data": {}},
            {"output_type": "stream", "name": "stdout", "text": "d\n"}]
    got = lessons_tool.coalesce_streams(outs)
    assert [o.get("text") for o in got] == ["a\nb\nc\n", "w\n", None, "d\n"]
