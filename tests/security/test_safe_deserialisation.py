"""No code-executing deserialisation anywhere in the sources: what kvserve reads from Redis (bus
messages: shared/bus.py, shared/protocol.py; store frames: shared/store/) and from disk is
msgpack, JSON, GGUF or safetensors, never a format whose loader runs code.

The sources of shared/, services/ and kernels/ are parsed with `ast` (not searched as text, so
a word in a comment or a string does not count and an aliased import does), and a test fails on:

- an import of a pickle-family module (`pickle`, `_pickle`, `cPickle`, `cloudpickle`, `dill`,
  `jsonpickle`, `joblib`, `marshal`, `shelve`), including `importlib.import_module("pickle")`
  and `__import__("pickle")` with a literal name;
- a call of `torch.load` (or `torch.serialization.load`), however imported or aliased, without
  the literal keyword `weights_only=True` (torch's restricted unpickler);
- `numpy.load(..., allow_pickle=...)` unless the literal `False`; `yaml.load` / `yaml.load_all`
  without `Loader=SafeLoader` (or CSafeLoader / BaseLoader), and `yaml.unsafe_load*`;
  `pandas.read_pickle`.

A use that must stay goes into EXCEPTIONS with its file, the finding's text and the reason;
there is none today. The detector itself is tested on snippets that must and must not count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("shared", "services", "kernels")
# The bus and the store: the paths that read bytes other processes wrote into Redis.
# Files, or folders with the modules of theirs that read bytes from outside.
BUS_AND_STORE = {
    "shared/protocol.py": (),
    "shared/bus": ("base.py", "memory.py", "redis.py", "redis_port.py"),
    "shared/store": ("codec.py", "redis.py", "disk.py"),
    "shared/engine/kv": ("connector.py", "load.py"),
}

PICKLE_FAMILY = frozenset(
    {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "jsonpickle", "joblib", "marshal",
     "shelve"}
)  # fmt: skip
TORCH_LOADS = frozenset({"torch.load", "torch.serialization.load"})
YAML_LOADS = frozenset({"yaml.load", "yaml.load_all"})
YAML_UNSAFE = frozenset({"yaml.unsafe_load", "yaml.unsafe_load_all"})
YAML_SAFE_LOADERS = frozenset({"SafeLoader", "CSafeLoader", "BaseLoader"})

# (path relative to the repository root, finding) -> why it is acceptable. Empty: no exceptions.
EXCEPTIONS: dict[tuple[str, str], str] = {}


class _Scanner(ast.NodeVisitor):
    """Findings in one module: each a short text naming the line and what was found."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # local name -> the dotted name it stands for
        self.findings: list[str] = []

    def _add(self, node: ast.AST, what: str) -> None:
        self.findings.append(f"line {getattr(node, 'lineno', '?')}: {what}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in PICKLE_FAMILY:
                self._add(node, f"import {alias.name}")
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.aliases[top] = top
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        names = [alias.name for alias in node.names]
        from_family = node.level == 0 and module.split(".")[0] in PICKLE_FAMILY
        # Also a family module imported from a package: `from six.moves import cPickle`.
        if from_family or any(name in PICKLE_FAMILY for name in names):
            self._add(node, f"from {module} import {', '.join(names)}")
        for alias in node.names:
            full = f"{module}.{alias.name}" if module else alias.name
            self.aliases[alias.asname or alias.name] = full
        self.generic_visit(node)

    def _dotted(self, expr: ast.expr) -> str | None:
        """`a.b.c` with its first name resolved through the module's imports."""
        parts: list[str] = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        head = self.aliases.get(expr.id, expr.id)
        return ".".join([head, *reversed(parts)])

    def visit_Call(self, node: ast.Call) -> None:
        name = self._dotted(node.func)
        if name is not None:
            self._check_call(node, name)
        self.generic_visit(node)

    def _check_call(self, node: ast.Call, name: str) -> None:
        if name in ("importlib.import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] in PICKLE_FAMILY:
                self._add(node, f"{name}({arg.value!r})")
        elif name in TORCH_LOADS and not _keyword_is(node, "weights_only", True):
            self._add(node, f"{name} without weights_only=True")
        elif name == "numpy.load" and _has_keyword(node, "allow_pickle"):
            if not _keyword_is(node, "allow_pickle", False):
                self._add(node, "numpy.load with allow_pickle")
        elif name in YAML_UNSAFE or name == "pandas.read_pickle":
            self._add(node, name)
        elif name in YAML_LOADS and not self._safe_yaml_loader(node):
            self._add(node, f"{name} without a safe Loader")

    def _safe_yaml_loader(self, node: ast.Call) -> bool:
        loader = next((k.value for k in node.keywords if k.arg == "Loader"), None)
        if loader is None and len(node.args) >= 2:
            loader = node.args[1]
        name = self._dotted(loader) if loader is not None else None
        return name is not None and name.split(".")[-1] in YAML_SAFE_LOADERS


def _has_keyword(node: ast.Call, arg: str) -> bool:
    return any(k.arg == arg for k in node.keywords)


def _keyword_is(node: ast.Call, arg: str, value: bool) -> bool:
    """The call passes `arg=value` as a literal (a variable or **kwargs proves nothing)."""
    return any(
        k.arg == arg and isinstance(k.value, ast.Constant) and k.value.value is value
        for k in node.keywords
    )


def findings(source: str) -> list[str]:
    scanner = _Scanner()
    scanner.visit(ast.parse(source))
    return scanner.findings


def source_files() -> Iterator[Path]:
    for top in SCANNED:
        yield from sorted((ROOT / top).rglob("*.py"))


# ---- the sources -----------------------------------------------------------------------------


def test_the_scan_covers_the_bus_and_the_store() -> None:
    """The scan is not vacuous: the bus, the messages and every store module are in it."""
    scanned = {p.relative_to(ROOT).as_posix() for p in source_files()}
    for path, modules in BUS_AND_STORE.items():
        if path.endswith(".py"):
            assert path in scanned, path
        else:
            assert {f"{path}/{m}" for m in modules} <= scanned, path
    assert len(scanned) > 50


def test_no_code_executing_deserialisation_in_the_sources() -> None:
    found = {
        (path.relative_to(ROOT).as_posix(), finding)
        for path in source_files()
        for finding in findings(path.read_text())
    }
    unexplained = sorted(found - set(EXCEPTIONS))
    assert unexplained == [], "code-executing deserialisation:\n" + "\n".join(
        f"  {path} {finding}" for path, finding in unexplained
    )
    stale = sorted(set(EXCEPTIONS) - found)
    assert stale == [], f"EXCEPTIONS that no longer match anything: {stale}"


def test_bus_and_store_decode_with_bounded_msgpack() -> None:
    """What the bus and the store decode is msgpack: each of those modules that unpacks
    imports msgpack, and the store's frame decoder bounds every field (codec.py `_unpack` reads
    the frame through msgpack_view with `_LIMITS`, whose every value goes to msgpack.unpackb or
    msgpack.Unpacker with those limits)."""
    for rel in ("shared/protocol.py", "shared/bus/redis.py", "shared/store/msgpack_view.py"):
        tree = ast.parse((ROOT / rel).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "msgpack" in imported, rel
    codec = ast.parse((ROOT / "shared/store/codec.py").read_text())
    unpack = next(
        n for n in ast.walk(codec) if isinstance(n, ast.FunctionDef) and n.name == "_unpack"
    )
    assert any(
        isinstance(n, ast.Call) and ast.unparse(n) == "unpack(data, _LIMITS)"
        for n in ast.walk(unpack)
    )
    limits = next(
        n.value
        for n in ast.walk(codec)
        if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "_LIMITS"
    )
    assert isinstance(limits, ast.Call) and ast.unparse(limits.func) == "Limits"
    bounded = {"max_bin_len", "max_str_len", "max_array_len", "max_map_len"}
    assert {k.arg for k in limits.keywords} == bounded
    view = ast.parse((ROOT / "shared/store/msgpack_view.py").read_text())
    calls = [
        n
        for n in ast.walk(view)
        if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("msgpack.")
    ]
    assert {ast.unparse(c.func) for c in calls} == {"msgpack.unpackb", "msgpack.Unpacker"}
    for call in calls:
        assert bounded | {"max_ext_len"} <= {k.arg for k in call.keywords}


# ---- the detector ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import pickle as p",
        "import _pickle",
        "from pickle import loads",
        "from pickle import loads as l",
        "import dill",
        "import cloudpickle as cp",
        "from marshal import loads",
        "from six.moves import cPickle",
        "import shelve",
        "import joblib",
        "import importlib\nimportlib.import_module('pickle')",
        "from importlib import import_module\nimport_module('dill')",
        "__import__('marshal')",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=False)",
        "import torch\ntorch.load(f, weights_only=flag)",
        "import torch\ntorch.load(f, **kw)",
        "import torch as t\nt.load(f)",
        "from torch import load\nload(f)",
        "from torch import load as tload\ntload(f)",
        "import torch.serialization\ntorch.serialization.load(f)",
        "from torch import serialization\nserialization.load(f)",
        "def f():\n    import torch\n    return torch.load(p)",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import yaml\nyaml.load(s)",
        "import yaml\nyaml.load(s, Loader=yaml.Loader)",
        "import yaml\nyaml.unsafe_load(s)",
        "import pandas as pd\npd.read_pickle(f)",
    ],
)
def test_detector_finds(source: str) -> None:
    assert len(findings(source)) == 1, source


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load(f, weights_only=True)",
        "import torch as t\nt.load(f, map_location='cpu', weights_only=True)",
        "import triton.language as tl\ntl.load(ptr + offs, mask=m)",
        "model.load(x)",
        "self.connector.load(hashes)",
        "import json\njson.loads(s)",
        "import msgpack\nmsgpack.unpackb(b, raw=False)",
        "import numpy as np\nnp.load(f)",
        "import numpy as np\nnp.load(f, allow_pickle=False)",
        "import yaml\nyaml.safe_load(s)",
        "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)",
        "s = 'import pickle; torch.load(f)'  # pickle",
        "from safetensors import safe_open",
        "import importlib\nimportlib.import_module(f'kvserve.services.{name}')",
    ],
)
def test_detector_ignores(source: str) -> None:
    assert findings(source) == [], source
