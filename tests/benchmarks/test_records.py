"""Every benchmark keeps its output: each ``benchmarks/bench_*.py`` runs its main through
``_record.run`` under its own name (so its table lands, with the machine and the commit, in a new
file under ``benchmarks/results/``) and builds no path of its own into the results folder, where a
rerun would overwrite a file."""

import ast
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("bench_*.py"))


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def test_there_are_benchmarks_to_check():
    assert len(BENCHMARKS) >= 10


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_each_benchmark_records_its_output_under_its_own_name(path):
    tree = ast.parse(path.read_text())
    runs = [c for c in _calls(tree) if isinstance(c.func, ast.Name) and c.func.id == "run"
            and c.args and isinstance(c.args[0], ast.Constant)]
    assert [c.args[0].value for c in runs] == [path.stem], f"{path.name} does not call run({path.stem!r}, main)"
    joins = [node for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
             and any(isinstance(side, ast.Constant) and side.value == "results" for side in (node.left, node.right))]
    assert not joins, f"{path.name} builds a path into results/ of its own (line {joins[0].lineno if joins else ''})"
