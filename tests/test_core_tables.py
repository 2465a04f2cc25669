"""The core is the one source of truth for dtypes, ops, wire types, tags and settings: the Python
layers and the docs read its tables, and the type stub lists exactly what the extension has."""

import ast
import re
from pathlib import Path

import numpy as np
import pytest

import plait
from plait import _core, _dtypes

ROOT = Path(__file__).resolve().parent.parent


def _stub_names():
    tree = ast.parse((ROOT / "python/plait/_core.pyi").read_text())
    helpers = {n.name for n in tree.body if isinstance(n, ast.ClassDef) and "TypedDict" in ast.unparse(n)}
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} - helpers
    top |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    classes = {n.name: {f.name for f in n.body if isinstance(f, (ast.FunctionDef, ast.AnnAssign)) and hasattr(f, "name")}
               | {f.target.id for f in n.body if isinstance(f, ast.AnnAssign)}
               for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("Comm", "Work")}
    return top, classes


def test_the_type_stub_lists_exactly_what_the_extension_has():
    top, classes = _stub_names()
    public = {n for n in dir(_core) if not n.startswith("_") or n == "__version__"}
    assert public - top == set(), "in the extension, missing from _core.pyi"
    assert top - public == set(), "in _core.pyi, missing from the extension"
    for cls, members in classes.items():
        real = {n for n in dir(getattr(_core, cls)) if not n.startswith("_")} | {"__init__"} & members
        assert members - real == set(), f"_core.pyi lists {cls} members the extension lacks"
        assert real - members == set(), f"{cls} has members _core.pyi does not list"


def test_python_dtypes_and_ops_are_the_cores():
    assert {_dtypes.core_dtype(d) for d in plait.supported_dtypes()} <= {d["name"] for d in _core.DTYPES}
    assert _dtypes.OPS == tuple(o["name"] for o in _core.OPS)
    assert _dtypes.FLOATS == {d["name"] for d in _core.DTYPES if d["float"]}
    for d in _core.DTYPES:
        if d["name"] != "bf16" or _dtypes.BFLOAT16 is not None:
            assert np.dtype(_dtypes._NUMPY_OF[d["name"]]).itemsize == d["size"], d


@pytest.mark.parametrize("dtype", [d["name"] for d in _core.DTYPES])
def test_an_op_is_accepted_exactly_where_the_core_reduces_it(dtype):
    floating = dtype in _dtypes.FLOATS
    for op in _dtypes.OPS:
        factor = 0.5 if op == "premul_sum" else None
        allowed = not (op in ("band", "bor", "bxor") and floating) and not (op in ("avg", "premul_sum") and not floating)
        if allowed:
            assert _dtypes.check_op(op, dtype, factor) == (op, factor)
        else:
            with pytest.raises(plait.InvalidArgumentError):
                _dtypes.check_op(op, dtype, factor)


def test_names_and_codes_are_interchangeable_at_the_binding():
    sum_code = next(o["code"] for o in _core.OPS if o["name"] == "sum")
    f32_code = next(d["code"] for d in _core.DTYPES if d["name"] == "f32")
    assert _core.check_op(sum_code, f32_code) == _core.check_op("sum", "f32") == ("sum", None)
    ag = next(c["code"] for c in _core.COLLECTIVES if c["name"] == "allgather")
    assert _core.algorithms(ag) == _core.algorithms("allgather")
    with pytest.raises(plait.InvalidArgumentError, match="unknown dtype code 250"):
        _core.check_op("sum", 250)


def test_every_core_setting_is_documented_in_the_readme():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Environment variables"):]
    section = section[:section.index("\n## ", 3)]
    documented = set(re.findall(r"^\| `(PLAIT_[A-Z_]+)` \|", section, re.M))
    core = {s["name"] for s in _core.SETTINGS}
    assert core - documented == set(), "core settings missing from the README's table"
    for s in _core.SETTINGS:
        assert s["doc"] and s["kind"] in ("seconds", "bytes", "microseconds", "count", "text", "choice"), s
