"""The control plane imports without the training stack, `service` never imports `api`, and no module of shunter's
own packages imports itself through others (an import cycle)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "service", "workers", "bench")

BLOCK_TRAINING_STACK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'transformers', 'deepspeed', 'accelerate'}:
            raise ImportError(f'control plane imported {name}')
sys.meta_path.insert(0, Block())
"""


def test_control_plane_imports_without_torch() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for pkg in ("api", "service")
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py" and "migrations" not in p.parts  # Alembic runs those, not imports
    )
    code = BLOCK_TRAINING_STACK + "".join(f"import {m}\n" for m in modules) + "from api.app import create_app\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_service_never_imports_api() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "service").rglob("*.py")
        if any(line.startswith(("from api", "import api")) for line in p.read_text().splitlines())
    ]
    assert offenders == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The project modules `module` imports anywhere in its source: inside functions too (a lazy import still runs,
    and only postpones the cycle to the first call), and under `if TYPE_CHECKING:` (it never runs, but a cycle a
    type checker needs is still two modules that know each other: issue 36).

    An import names one module: `from a.b import c` is a.b.c when that is a module, else a.b; `import a.b.c` is
    a.b.c. The parent packages Python initialises on the way are not edges: counting them would make every
    package whose `__init__` imports a submodule lazily look cyclic.
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def known_prefix(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(known_prefix(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found.add(child if child in known else known_prefix(source))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found - {"", module}


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, for every module of api, service and workers."""
    files = {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    return {module: _imports(path, module, set(files)) for module, path in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) through each strongly connected component of `graph` (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for component in components:
        start = min(component)
        paths = {start: [start]}  # breadth first inside the component: the shortest way back to `start`
        queue = [start]
        while queue:
            node = queue.pop(0)
            for target in sorted(graph[node] & component):
                if target == start:
                    cycles.append([*paths[node], start])
                    queue = []
                    break
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    queue.append(target)
    return cycles


def test_import_cycle_finder_finds_and_names_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert {"api.app", "service.dispatch.dispatcher", "workers.checkpoint", "workers.strategies"} <= set(graph)
    assert "workers.checkpoint" in graph["workers.strategies.common"]  # imports inside functions count
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


# service/'s folders from the bottom up: each imports only those before it (and itself). The modules directly in
# service/ (the wiring, the estimate, the metrics) sit above them all. docs/architecture.md draws this.
SERVICE_LAYERS = (
    "core",
    "spec",
    "policy",
    "config",
    "store",
    "tenancy",
    "workflows",
    "lifecycle",
    "backends",
    "dispatch",
)
# What may import each outside package, from service/: workers/ run inside Ray, beside users' code, and take the
# spec, its vocabulary, the stall rule they watch by, and the local head's port picking; never the database.
OUTSIDE_MAY_IMPORT = {
    "workers": {"core", "spec", "policy.stall", "backends.ray_local", "tenancy.code_manifest"},
}


def _layer(module: str) -> int | None:
    """The index of `module`'s folder in SERVICE_LAYERS; len(SERVICE_LAYERS) for service/'s own top modules."""
    parts = module.split(".")
    if parts[0] != "service" or len(parts) == 1:
        return None
    return SERVICE_LAYERS.index(parts[1]) if parts[1] in SERVICE_LAYERS else len(SERVICE_LAYERS)


def folder_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up or sideways between service/'s folders, and workers/ imports outside what they may take."""
    found = []
    for module, targets in graph.items():
        for target in sorted(targets):
            here, there = _layer(module), _layer(target)
            if here is not None and there is not None and there > here:
                found.append(f"{module} -> {target}")
            top = module.split(".")[0]
            if top in OUTSIDE_MAY_IMPORT and target.startswith("service."):
                part = target.removeprefix("service.")
                if not any(part == ok or part.startswith(ok + ".") for ok in OUTSIDE_MAY_IMPORT[top]):
                    found.append(f"{module} -> {target}")
    return found


def test_folder_rule_finds_imports_that_go_up() -> None:
    graph = {
        "service.policy.retry": {"service.core.enums", "service.store.models"},
        "service.runtime": {"service.dispatch.dispatcher"},
        "service.core.errors": {"service.runtime"},
        "workers.driver": {"service.spec.job", "service.store.db"},
    }
    assert folder_violations(graph) == [
        "service.policy.retry -> service.store.models",
        "service.core.errors -> service.runtime",
        "workers.driver -> service.store.db",
    ]


def test_service_folders_import_only_those_below_them() -> None:
    graph = import_graph()
    folders = {p.name for p in (ROOT / "service").iterdir() if (p / "__init__.py").exists()} - {"migrations"}
    assert folders == set(SERVICE_LAYERS), "a new folder goes into SERVICE_LAYERS, at its place"
    assert folder_violations(graph) == []


def test_folders_stay_small_and_say_what_they_hold() -> None:
    """At most 15 modules directly in service/ and in each of its folders; each folder's `__init__` has a docstring
    (what it holds, what it may import) and no code."""
    for folder in [ROOT / "service", *(ROOT / "service" / name for name in SERVICE_LAYERS)]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 15, (folder, len(modules))
        tree = ast.parse((folder / "__init__.py").read_text())
        assert ast.get_docstring(tree), folder
        assert len(tree.body) == 1, f"{folder}/__init__.py holds more than its docstring"


def test_modules_stay_small() -> None:
    """One concern per module (STYLE.md): nothing under api/, service/, workers/ or bench/ grows past 400 lines
    (Alembic's migrations aside: they are generated)."""
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if "migrations" not in p.parts
    }
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_job_events_have_one_writer() -> None:
    """`service.lifecycle.state.record_event` is the only code that builds a JobEvent row (so every one has a known
    kind)."""
    writers = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "JobEvent":
                    writers.append(str(path.relative_to(ROOT)))
    assert writers == ["service/lifecycle/state.py"]


def test_the_api_never_calls_ray() -> None:
    """No module under api/ calls a method of the cluster backend (`service.core.backend.Backend`) on it: reading a
    running attempt's log goes through `service.lifecycle.log_reads`, and everything else through the service or the
    dispatcher (issue 36, item 6)."""
    backend_methods = {"info", "submit", "stop", "logs", "log_range", "log_stream", "cluster", "dump_stacks",
                       "list_submission_ids", "request_resources"}  # fmt: skip
    calls = []
    for path in (ROOT / "api").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in backend_methods
            ):
                owner = node.func.value
                named = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if named in {"ray", "backend"}:
                    calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []


def test_settings_parse_and_build_no_policy() -> None:
    """`service/config/settings.py` is a leaf (issue 36, item 5): it imports nothing of shunter's but the vocabulary
    (`core`), the spec's parse models and the token grants; the rules it configures are built by
    `service.config.policies`, where a process is wired."""
    tree = ast.parse((ROOT / "service" / "config" / "settings.py").read_text())
    ours = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
            and node.module.split(".")[0] in {"service", "api", "workers"}}  # fmt: skip
    allowed = ("service.core.", "service.spec.", "service.config.tokens")
    assert ours and all(m.startswith(allowed) for m in ours), sorted(ours)


def test_the_admission_sequence_is_written_once() -> None:
    """Plan, reclaim, preemption and growth are called in one place, `service.policy.admission_pass`, which the
    dispatcher's admission and the start forecast both run (issue 36): a copy cannot drift from the real pass."""
    steps = {("scheduler", "plan"), ("scheduler", "reclaim"), ("scheduler", "preemption"), ("growth", "grow")}
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    owner = node.func.value
                    if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in steps:
                        found.setdefault(str(path.relative_to(ROOT)), []).append(node.func.attr)
                if isinstance(node, ast.ImportFrom) and (node.module or "").endswith(("scheduler", "growth")):
                    taken = {a.name for a in node.names} & {name for _, name in steps}
                    if taken:
                        found.setdefault(str(path.relative_to(ROOT)), []).extend(sorted(taken))
    assert found == {"service/policy/admission_pass.py": ["plan", "reclaim", "preemption", "grow"]}


def test_what_an_end_reason_means_is_one_table() -> None:
    """Nothing outside `service.policy.end_reasons` lists end reasons to decide what they mean: the sets it derives
    (retryable, claimable, to confirm, the driver's account) and the job's end state are read from its rows."""
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.Set, ast.Tuple, ast.List)) and len(node.elts) > 1:
                    members = [e for e in node.elts if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
                               and e.value.id == "EndReason"]  # fmt: skip
                    assert len(members) < 2, f"{path.relative_to(ROOT)}:{node.lineno} lists end reasons"


def test_the_tree_type_checks(tmp_path: Path) -> None:
    """Issue 36, item 7: `mypy api service workers`, from the repository root with pyproject.toml's [tool.mypy], exits
    0; the pure decisions (service/policy/) under `--strict`'s per-module flags, in the same run."""
    out = subprocess.run([sys.executable, "-m", "mypy", "api", "service", "workers", "--cache-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:]


def test_no_module_of_ours_is_kept_from_the_type_checker_and_every_ignore_says_why() -> None:
    """No `exclude`, `ignore_errors` or `follow_imports = skip` for shunter's own modules, the policy package strict,
    and each `type: ignore` with its code and the reason beside it (issue 36, item 7)."""
    import re

    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "exclude" not in config and not config.get("ignore_errors")
    ours = ("api", "service", "workers")
    for override in config.get("overrides", []):
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        if any(m.split(".")[0] in ours for m in modules):
            assert not override.get("ignore_errors") and override.get("follow_imports") != "skip", override
    policy = next(o for o in config["overrides"] if o["module"] == ["service.policy.*"])
    assert policy["disallow_untyped_defs"] and policy["disallow_any_generics"] and policy["warn_return_any"]
    bare = []
    for package in ours:
        for path in (ROOT / package).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "type: ignore" in line and not re.search(r"# type: ignore\[[a-z, -]+\]  # \S", line):
                    bare.append(f"{path.relative_to(ROOT)}:{number}")
    assert bare == [], bare
