"""The package's shape: no import cycle, no module over 600 lines, a core that never loads the tooling, and a
README whose "Public API" and "Code map" sections are the package as it is.

Each check is a function of what it reads (a source tree, a README text) so that it is also run on a small
broken input here, to show it can fail.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxpar"
MAX_LINES = 600
# What ``import jaxpar`` must not load: the experiment tooling and the optional libraries it needs.
TOOLING = ("jaxpar.cli", "tyro", "tqdm", "matplotlib", "tensorboardX")
CLI = ("jaxpar.cli", "jaxpar.cli.experiment", "jaxpar.cli.launch")


# ------------------------------------------------------------------------------------------------ imports

def module_files(package: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under ``package`` (a package is its ``__init__``)."""
    out = {}
    for f in sorted(package.rglob("*.py")):
        parts = list(f.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from every ``import`` / ``from ... import`` statement at any
    level (module, function, class, ``if TYPE_CHECKING``: a lazy import is a dependence too).

    ``from P import N`` is an edge to ``P.N`` when that is a module, else to ``P`` (a name defined in ``P``'s
    ``__init__``, which needs all of ``P``); ``import P.Q`` is an edge to ``P.Q``. The parent packages Python
    initialises on the way are not edges: a package's ``__init__`` importing its submodules would otherwise
    close a loop with every submodule importing a sibling, a loop Python resolves (the submodule is found by
    name) and that no code runs through.
    """
    files = module_files(package)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, f in files.items():
        here = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                graph[mod] |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:   # relative: drop level - 1 trailing parts of this module's package
                    parts = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                    if target in files:
                        graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected component of more than one module (or a module importing
    itself), as a closed path through it, e.g. ``['a', 'b', 'a']``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:      # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(_closed_path(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _closed_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A cycle through the component's first module, by breadth-first search back to it."""
    start = min(component)
    paths = {w: [start, w] for w in sorted(graph[start]) if w in component}
    while start not in paths:
        paths = {w: path + [w] for path in paths.values() for w in sorted(graph[path[-1]])
                 if w in component and w not in path[1:]} or {start: [start, start]}
    return paths[start]


def test_no_import_cycle_in_jaxpar():
    assert cycles(import_graph(PACKAGE)) == []


def test_the_core_never_imports_the_cli():
    """Dependencies point from ``jaxpar.cli`` to the core, never back (at any level, lazy imports included)."""
    graph = import_graph(PACKAGE)
    inward = {(m, t) for m, targets in graph.items() if not m.startswith("jaxpar.cli") for t in targets
              if t.startswith("jaxpar.cli")}
    assert inward == set()


def test_the_cycle_check_finds_cycles_at_any_level(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c   # lazy, relative\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a, c\n")          # imports into a cycle: not part of it
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    (pkg / "c.py").write_text("X = 1\n")
    assert cycles(import_graph(pkg)) == []
    (pkg / "c.py").write_text("from pkg import X\n")   # a name of the package's __init__: needs all of it
    assert cycles(import_graph(pkg)) == [["pkg", "pkg.a", "pkg.sub.b", "pkg.c", "pkg"]]


# ------------------------------------------------------------------------------------------------ layering

def room_order(readme: str) -> list[str]:
    """The rooms, lowest first, from the Code map's line ``Rooms, lowest first: `a` < `b` < ...``."""
    match = re.search(r"^Rooms, lowest first: (.*)$", readme_section(readme, "Code map"), re.M)
    assert match, "the Code map has no 'Rooms, lowest first:' line"
    return re.findall(r"`(\w+)`", match.group(1))


def room_of(module: str) -> str | None:
    """``jaxpar.train.grads`` -> ``train``; None for the package itself and its private ``_*`` modules (below
    every room: anything may import them, and they import no room)."""
    parts = module.split(".")
    return None if len(parts) == 1 or parts[1].startswith("_") else parts[1]


def layering_violations(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """Imports that break the room order: a room importing a later room, a private module importing a room, or a
    module outside the listed rooms."""
    rank = {room: i for i, room in enumerate(order)}
    problems = []
    for mod, targets in sorted(graph.items()):
        if mod == "jaxpar":
            continue
        here = room_of(mod)
        if here is not None and here not in rank:
            problems.append(f"{mod} is in no listed room")
            continue
        for t in sorted(targets):
            there = room_of(t)
            if there is None or there == here:
                continue
            if here is None or there not in rank or rank[there] > rank[here]:
                problems.append(f"{mod} imports {t}")
    return problems


def test_rooms_import_only_lower_rooms():
    """The order the README's Code map writes: the training core never imports the pipeline, the model zoo or the
    tools, the layers never import the zoo, the private modules import no room."""
    order = room_order((ROOT / "README.md").read_text())
    assert order.index("train") < order.index("pipeline") and order.index("layers") < order.index("models")
    assert order.index("train") < order.index("tools") and order[-1] == "cli"
    assert layering_violations(import_graph(PACKAGE), order) == []


def test_the_layering_check_finds_upward_imports():
    graph = {"jaxpar": {"jaxpar.train"}, "jaxpar._compat": set(), "jaxpar.train.step": {"jaxpar._compat",
             "jaxpar.sharding.rules", "jaxpar.train.grads"}, "jaxpar.sharding.rules": set(), "jaxpar.train.grads": set()}
    assert layering_violations(graph, ["sharding", "train"]) == []
    graph["jaxpar.sharding.rules"] = {"jaxpar.train.step"}
    graph["jaxpar._compat"] = {"jaxpar.sharding.rules"}
    graph["jaxpar.extra.x"] = set()
    assert layering_violations(graph, ["sharding", "train"]) == [
        "jaxpar._compat imports jaxpar.sharding.rules", "jaxpar.extra.x is in no listed room",
        "jaxpar.sharding.rules imports jaxpar.train.step"]


def test_public_entries_are_the_rooms():
    """``ls jaxpar/``: the rooms of the order (at most a dozen) and private ``_*.py`` modules, nothing else."""
    order = room_order((ROOT / "README.md").read_text())
    entries = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
               if not p.name.startswith(("_", ".")) and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert sorted(entries) == sorted(order) and len(entries) <= 12


def test_moved_module_paths_are_the_same_module_objects():
    """An old module path is the module that holds the code now (patching through it reaches the running code)."""
    import jaxpar
    for old, new in jaxpar.MOVED_MODULES.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    import jaxpar.tokens
    assert jaxpar.tokens is jaxpar.data.prepare and jaxpar.fp8 is jaxpar.precision.fp8


# ------------------------------------------------------------------------------------------------ size

def long_modules(package: Path, limit: int = MAX_LINES) -> dict[str, int]:
    return {str(f.relative_to(package.parent)): n for f in sorted(package.rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > limit}


def test_no_module_over_600_lines(tmp_path):
    assert long_modules(PACKAGE) == {}
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules(tmp_path / "pkg") == {"pkg/big.py": MAX_LINES + 1}


def thread_local_flags(package: Path, rooms: tuple[str, ...]) -> list[str]:
    """The modules under ``package``'s ``rooms`` that keep state in a ``threading.local``."""
    return sorted(str(f.relative_to(package.parent)) for room in rooms for f in (package / room).rglob("*.py")
                  if re.search(r"threading\.local\b|from threading import [^\n]*\blocal\b", f.read_text()))


def test_no_thread_local_flag_between_the_pipeline_and_the_layers(tmp_path):
    """The layers (attention) read what the pipeline's stages mean from the mesh in context, never from a flag
    the pipeline sets beside the trace."""
    assert thread_local_flags(PACKAGE, ("layers", "pipeline")) == []
    (tmp_path / "pkg" / "layers").mkdir(parents=True)
    (tmp_path / "pkg" / "layers" / "a.py").write_text("import threading\n_flag = threading.local()\n")
    assert thread_local_flags(tmp_path / "pkg", ("layers",)) == ["pkg/layers/a.py"]


# ------------------------------------------------------------------------------------------------ core

def loaded_by(code: str) -> list[str]:
    """The modules of :data:`TOOLING` (and their submodules) in ``sys.modules`` after ``code`` ran in a fresh
    interpreter on this checkout."""
    check = (f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if any(m == t or "
             f"m.startswith(t + '.') for t in {TOOLING!r}))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


SPEC_ENTRY_IDIOM = re.compile(r"\(([\w\[\]]+),\) if isinstance\(\1, str\) else")
"""The str-or-tuple normalisation of a PartitionSpec entry or rule target: ``(t,) if isinstance(t, str) else t``."""


def test_spec_entries_are_normalised_in_one_place():
    """A ``PartitionSpec`` entry (None, an axis name, a tuple of them) becomes a tuple of axes in one function,
    ``jaxpar.sharding.names.entry_axes``; ``protocol.require`` normalises method names (and sits below
    sharding), no spec entries."""
    assert SPEC_ENTRY_IDIOM.search("axes = {a for s in spec for a in ((s,) if isinstance(s, str) else s)}")
    assert SPEC_ENTRY_IDIOM.search("set((r[1],) if isinstance(r[1], str) else r[1])")
    hits = sorted(str(f.relative_to(ROOT)) for f in PACKAGE.rglob("*.py")
                  for line in f.read_text().splitlines() if SPEC_ENTRY_IDIOM.search(line))
    assert hits == ["jaxpar/protocol.py", "jaxpar/sharding/names.py"]


def test_import_jaxpar_loads_no_tooling():
    assert loaded_by("import jaxpar") == []
    assert "jaxpar.cli.experiment" in loaded_by("from jaxpar.cli import experiment")   # the check sees them


# ------------------------------------------------------------------------------------------------ README

def readme_section(text: str, title: str) -> str:
    """The text of the README's ``## <title>`` section (up to the next ``## `` heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def listed_api(text: str) -> dict[str, list[str]]:
    """``{module: names}`` from the "Public API" section's lines ``* `jp.train`: TrainState, init_state, ...``
    (``jp`` is ``jaxpar``)."""
    out = {}
    for label, names in re.findall(r"^\* `([\w.]+)`: (.*)$", readme_section(text, "Public API"), re.M):
        module = "jaxpar" + label[2:] if label == "jp" or label.startswith("jp.") else label
        out[module] = [n.strip() for n in names.split(",")]
    return out


def public_namespaces() -> list[str]:
    """``jaxpar``, the modules its ``__all__`` lists and, recursively, the modules theirs list; the cli's modules."""
    found, todo = [], ["jaxpar"]
    while todo:
        name = todo.pop(0)
        found.append(name)
        module = importlib.import_module(name)
        todo += [f"{name}.{n}" for n in module.__all__ if isinstance(getattr(module, n), types.ModuleType)
                 and f"{name}.{n}" not in found + todo]
    return [*found, *CLI]


def exported() -> dict[str, list[str]]:
    return {m: list(importlib.import_module(m).__all__) for m in public_namespaces()}


def api_mismatches(listed: dict[str, list[str]], actual: dict[str, list[str]]) -> list[str]:
    problems = [f"README lists {m}, which is not a public namespace" for m in sorted(set(listed) - set(actual))]
    problems += [f"README does not list {m}" for m in sorted(set(actual) - set(listed))]
    for m in sorted(set(listed) & set(actual)):
        if sorted(listed[m]) != sorted(actual[m]):
            problems.append(f"{m}: README {sorted(listed[m])} != __all__ {sorted(actual[m])}")
    return problems


def test_readme_public_api_is_the_packages_all():
    readme = (ROOT / "README.md").read_text()
    assert api_mismatches(listed_api(readme), exported()) == []
    broken = readme.replace("* `jp.train.optim`: adamw, decay_mask", "* `jp.train.optim`: adamw")
    assert api_mismatches(listed_api(broken), exported()) == [
        "jaxpar.train.optim: README ['adamw'] != __all__ ['adamw', 'decay_mask']"]


def test_each_public_name_is_exported_once():
    """No object is in the ``__all__`` of two public namespaces (``jp.train.adamw`` beside ``jp.optim.adamw``),
    and every name an ``__all__`` lists exists."""
    for m in CLI[1:]:
        importlib.import_module(m)
    homes: dict[int, list[str]] = {}
    for m, names in exported().items():
        module = importlib.import_module(m)
        for n in names:
            assert hasattr(module, n), f"{m}.__all__ lists {n!r}, which {m} does not define"
            homes.setdefault(id(getattr(module, n)), []).append(f"{m}.{n}")
    assert [h for h in homes.values() if len(h) > 1] == []


def test_package_inits_import_only_their_public_names():
    """A package's ``__init__`` imports what its ``__all__`` lists and nothing more (an internal imported there
    would be reachable as ``jp.pkg.name`` without being public)."""
    for f in sorted(PACKAGE.rglob("__init__.py")):
        module = importlib.import_module(".".join(f.relative_to(ROOT).parent.parts))
        tree = ast.parse(f.read_text())
        imported = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                    for a in node.names}
        assert imported <= set(module.__all__), f"{f.relative_to(ROOT)}: {sorted(imported - set(module.__all__))}"


def mapped_files(text: str) -> list[str]:
    """The files the "Code map" section names in its lines ``* `jaxpar/...py`: ...``."""
    return re.findall(r"^\* `(jaxpar/[\w/]+\.py)`: \S", readme_section(text, "Code map"), re.M)


def code_map_mismatches(listed: list[str], package: Path) -> list[str]:
    actual = {str(f.relative_to(package.parent)) for f in package.rglob("*.py")}
    problems = [f"Code map names {f}, which does not exist" for f in sorted(set(listed) - actual)]
    problems += [f"Code map does not name {f}" for f in sorted(actual - set(listed))]
    problems += [f"Code map names {f} twice" for f in sorted({f for f in listed if listed.count(f) > 1})]
    return problems


def test_readme_code_map_names_every_module():
    readme = (ROOT / "README.md").read_text()
    assert code_map_mismatches(mapped_files(readme), PACKAGE) == []
    broken = readme.replace("* `jaxpar/_hlo.py`:", "* `jaxpar/plan_hlo.py`:")
    assert code_map_mismatches(mapped_files(broken), PACKAGE) == [
        "Code map names jaxpar/plan_hlo.py, which does not exist", "Code map does not name jaxpar/_hlo.py"]


@pytest.mark.parametrize("section", ["Public API", "Code map"])
def test_readme_sections_exist(section):
    assert readme_section((ROOT / "README.md").read_text(), section).strip()


# ---------------------------------------------------------------------------------------------- HLO text

HLO_READER = "jaxpar/_hlo.py"
_REGEX_CALL = re.compile(r"\bre\.(?:compile|search|match|fullmatch|findall|finditer|sub|split)\(")
# Words on a line that applies a regular expression to a program's text (HLO or StableHLO) or names it.
_PROGRAM_WORDS = ("hlo", "tensor<", "metadata=", "op_name", "dot_general", "sharding_constraint", "calls=", "body=",
                  "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def program_regexes(root: Path) -> list[str]:
    """``path:line`` of every regular expression on program text outside the one reader (:data:`HLO_READER`)
    in the package, the tests, the benchmarks and the experiments: a ``re`` call on a line naming HLO."""
    found = []
    for folder in ("jaxpar", "tests", "benchmarks", "experiments"):
        for f in sorted((root / folder).rglob("*.py")):
            if f.relative_to(root).as_posix() in (HLO_READER, "tests/test_package.py"):   # this file: its examples
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if _REGEX_CALL.search(line) and any(w in line.lower() for w in _PROGRAM_WORDS):
                    found.append(f"{f.relative_to(root).as_posix()}:{n}")
    return found


def test_only_the_hlo_reader_parses_program_text(tmp_path):
    assert program_regexes(ROOT) == []
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import re\nn = len(re.findall(r'all-gather', hlo_text))\n")
    (tmp_path / "jaxpar").mkdir()
    (tmp_path / "jaxpar" / "_hlo.py").write_text("import re\nOPS = re.compile(r'all-gather')\n")
    assert program_regexes(tmp_path) == ["tests/test_x.py:2"]


@pytest.mark.parametrize("face, name, caller", [
    ("jaxpar.sharding", "process_batch_rows", lambda jp, mesh: jp.sharding.rules.global_batch_rows(4, mesh)),
    ("jaxpar.train", "to_model_order", None), ("jaxpar.precision", "loss_scale", None),
    ("jaxpar.data", "load_text", None), ("jaxpar.models.hf", "load", None)])
def test_patching_a_package_that_was_a_module_reaches_the_code(monkeypatch, face, name, caller):
    """``jaxpar.sharding``, ``.train``, ``.precision``, ``.data`` and ``.models.hf`` were modules: a patch through
    them (``monkeypatch.setattr(jp.sharding, ...)``) reaches the module holding the code, and its undo restores it."""
    import importlib
    import jax
    import jaxpar as jp
    package = importlib.import_module(face)
    original = getattr(package, name)
    home = importlib.import_module(original.__module__)
    assert home is not package and getattr(home, name) is original
    calls = []
    patched = lambda *a, **k: (calls.append(a), original(*a, **k))[1]
    monkeypatch.setattr(package, name, patched)
    assert getattr(home, name) is patched
    if caller is not None:   # a caller inside the holding module sees the patch
        caller(jp, jp.make_mesh(data=2, devices=jax.devices()[:2]))
        assert calls
    monkeypatch.undo()
    assert getattr(home, name) is original and getattr(package, name) is original
