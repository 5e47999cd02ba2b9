"""The package's shape, checked from the source: every import points down the layers, no module
imports itself back through others (lazy imports inside functions count too), no block of six
lines is written twice, pickles made by 0.1.0 still load, and the tests mirror the packages.
"""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest
import torch

import actcomp

ROOT = Path(actcomp.__file__).parent
# Bottom to top: a module may import its own layer and the layers below it, never one above.
LAYERS = ["errors", "torch_compat", "host_allocator", "kernels", "core", "compressors", "graph", "layers", "whole_model",
          "losses", "convert", "tools", "legacy_paths", "__init__", "__main__"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The actcomp modules ``path`` imports, at the top or inside functions; ``if TYPE_CHECKING``
    blocks included (a type-only cycle is still a cycle for a reader)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("actcomp"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("actcomp"):
            for alias in node.names:
                # "from actcomp.tools import max_batch" imports the module actcomp.tools.max_batch.
                child = f"{node.module}.{alias.name}"
                found.add(child if (ROOT.parent / child.replace(".", "/")).with_suffix(".py").exists()
                          or (ROOT.parent / child.replace(".", "/")).is_dir() else node.module)
    return found


GRAPH = {_module_name(path): _imports(path) for path in sorted(ROOT.rglob("*.py"))}


def _layer(module: str) -> int:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    return LAYERS.index(name)


def test_every_module_sits_in_a_known_layer():
    for module in GRAPH:
        assert _layer(module) >= 0, module


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module):
    upward = [target for target in GRAPH[module] if target in GRAPH and _layer(target) > _layer(module)]
    assert not upward, f"{module} imports {upward} from a layer above it; layers bottom-up: {LAYERS}"


def test_no_import_cycles():
    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for target in GRAPH.get(module, ()):
                if target == start:
                    return path + [start]
                # A package's __init__ runs on importing any of its modules; it is not an edge back.
                if target in GRAPH and target not in seen and not start.startswith(target + "."):
                    seen.add(target)
                    stack.append((target, path + [target]))
        return None

    cycles = [cycle for module in GRAPH if (cycle := cycle_from(module)) is not None and module != "actcomp"]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of the lines that carry code: no docstrings, blanks, comments
    or lone brackets."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    lines = []
    for number, line in enumerate(source.splitlines(), 1):
        text = line.strip()
        if number not in docstrings and text and not text.startswith("#") and text not in {")", "]", "}", "):"}:
            lines.append((number, text))
    return lines


def test_no_block_of_six_lines_written_twice():
    first: dict[tuple[str, ...], tuple[str, int]] = {}
    repeats = []
    for path in sorted(ROOT.rglob("*.py")):
        name = str(path.relative_to(ROOT.parent))
        lines = _code_lines(path)
        for index in range(len(lines) - 5):
            block = tuple(text for _, text in lines[index:index + 6])
            # Import lists repeat by nature; the code is what must not.
            if all(text.startswith(("from ", "import ")) for text in block):
                continue
            number = lines[index][0]
            seen = first.setdefault(block, (name, number))
            # A block overlapping its own first place (a run of equal lines) is not a copy.
            if seen != (name, number) and (seen[0] != name or number - seen[1] >= 6):
                repeats.append(f"{name}:{number} repeats {seen[0]}:{seen[1]}")
    assert not repeats, "\n".join(repeats)


# Delicate operations, each written in one place: the class swap both modes share, a private
# torch API whose every read would have to change with it, and weak references (to tensors, in
# the saved-tensor cache; to checkpoint's private frame, where torch_compat patches checkpoint;
# to a routed language model from its own loss function, which a strong one made a cycle).
WRITTEN_ONCE = {
    ".__class__ = ": ("actcomp/graph/module_surgery.py",),
    "_top_saved_tensors_default_hooks": ("actcomp/torch_compat.py",),
    "double backward (create_graph=True)": ("actcomp/graph/saved_tensors.py",),
    "weakref.ref(": ("actcomp/graph/saved_tensors.py", "actcomp/torch_compat.py", "actcomp/losses/causal_lm.py"),
}


@pytest.mark.parametrize("text", sorted(WRITTEN_ONCE))
def test_delicate_operations_are_written_in_one_place(text):
    places = [f"{path.relative_to(ROOT.parent)}:{number}" for path in sorted(ROOT.rglob("*.py"))
              for number, line in _code_lines(path) if text in line]
    assert places and all(place.split(":")[0] in WRITTEN_ONCE[text] for place in places), places


# Names actcomp defines anywhere (functions, classes, attributes it sets, arguments, imports): an
# underscore name outside them is someone else's private, which in this package means torch's.
def _names_defined_in_actcomp() -> set[str]:
    names = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                names.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
    return names


def _private_torch_uses(source: str, name: str, ours: set[str]) -> list[str]:
    """Where ``source`` (the file ``name``) reads a private torch name: a ``_``-name in a torch module path, an
    attribute of underscore name that actcomp never defines (``tensor._base``), an autograd node's
    class name, or a ``"_key"`` read from a dict torch hands over."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{where} imports {module}" for module in modules
                      if module.startswith("torch") and any(part.startswith("_") for part in module.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in ours:
                found.append(f"{where} reads .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"[A-Z]\w*Backward\d*|AccumulateGrad", node.value):
                found.append(f"{where} names the autograd node {node.value!r}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            attribute = node.args[1].value
            if attribute.startswith("_") and not attribute.startswith("__") and attribute not in ours:
                found.append(f"{where} reads .{attribute}")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
            if isinstance(key, str) and key.startswith("_") and not key.startswith("__"):
                found.append(f"{where} reads the key {key!r}")
    return found


def test_private_torch_internals_are_used_only_in_torch_compat():
    ours = _names_defined_in_actcomp()
    uses = [use for path in sorted(ROOT.rglob("*.py")) if path.name != "torch_compat.py"
            for use in _private_torch_uses(path.read_text(), str(path.relative_to(ROOT.parent)), ours)]
    assert not uses, "private torch internals outside actcomp/torch_compat.py:\n" + "\n".join(uses)


def test_the_private_torch_check_finds_each_kind():
    source = "import torch._dynamo\nx._base\nname == 'MulBackward0'\ncontext['_node']\nx._ours\ngetattr(torch, '_hidden')\n"
    found = sorted(_private_torch_uses(source, "sample.py", {"_ours"}))
    assert found == ["sample.py:1 imports torch._dynamo", "sample.py:2 reads ._base",
                     "sample.py:3 names the autograd node 'MulBackward0'", "sample.py:4 reads the key '_node'",
                     "sample.py:6 reads ._hidden"]


def test_pickles_made_by_0_1_0_load():
    with open(Path(__file__).resolve().parents[1] / "data" / "converted_models_0.1.0.pkl", "rb") as file:
        models = pickle.load(file)
    x = torch.randn(2, 3, 8, 8)
    for name, model in models.items():
        model.train()
        model(x).sum().backward()
        assert all(parameter.grad is not None for parameter in model.parameters()), name
    assert actcomp.compressed_layers(models["layers"]) == {"0": actcomp.parse("mink0.9+int8"),
                                                           "3": actcomp.parse("mink0.9+int8")}
    # A 0.1.0 pickle stored its choices kind by kind: it keeps the codes it was made with, int8 for
    # every norm (stop 57's "8bit" keeps a bf16 BatchNorm input in int4).
    assert str(models["whole_model"].actcomp_rest) == \
        "activation=int8, normalization=int8, attention=int8, pooling=exact, dropout=exact, other=None"
    plain = actcomp.from_compressed(models["whole_model"])
    assert type(plain) is torch.nn.Sequential


# The tests mirror the layers: tests/<subpackage>/ tests actcomp/<subpackage>/, tests/package/ the
# top-level modules (convert, host_allocator, __init__) and the package as shipped (packaging,
# version, README, docs, this file), tests/integration/ whole models across the layers (the zoo,
# training, DDP/FSDP2/tensor parallel, the examples). The shared helpers stay at tests/ root.
TESTS = Path(__file__).resolve().parents[1]
SUBPACKAGES = sorted(path.parent.name for path in ROOT.glob("*/__init__.py"))
ROOMS = [*SUBPACKAGES, "package", "integration"]
HELPERS = {"conftest.py", "models.py", "zoo.py", "data", "__pycache__"}


def test_every_subpackage_has_its_test_folder():
    missing = [name for name in SUBPACKAGES if not any((TESTS / name).glob("test_*.py"))]
    assert not missing, f"actcomp subpackages without tests/<name>/test_*.py: {missing}"


def test_every_test_file_sits_in_the_folder_of_what_it_tests():
    loose = sorted(path.name for path in TESTS.iterdir() if path.name not in HELPERS and path.name not in ROOMS
                   and not path.name.startswith("."))
    assert not loose, (f"tests/ root holds {loose}: put a test file in tests/<room>/, one of {ROOMS} "
                       f"(docs/development.md says which); helpers at the root are {sorted(HELPERS)}")
    misplaced = sorted(str(path.relative_to(TESTS)) for path in TESTS.rglob("test_*.py")
                       if path.parent.parent != TESTS or path.parent.name not in ROOMS)
    assert not misplaced, f"test files outside tests/<room>/ (rooms: {ROOMS}): {misplaced}"


def test_test_file_names_are_unique():
    # pytest imports each test file by its name alone (no __init__.py, the default import mode),
    # and tests/conftest.py's tier tables name files without their folder.
    names = [path.name for path in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted({name for name in names if names.count(name) > 1})
