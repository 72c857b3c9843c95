"""The package's import graph: only `conveyor` is installed, and module-level imports form no cycle (a cycle
makes import order matter and hides which module is the lower layer). Imports inside functions are lazy by
intent and not counted; `engine/` imports nothing of cluster/ or deployments/ (DESIGN.md)."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import conveyor

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "conveyor": ROOT / "conveyor",
    "conveyor.engine": ROOT / "engine",
    "conveyor.kernels": ROOT / "kernels",
    "conveyor.cluster": ROOT / "cluster",
    "conveyor.deployments": ROOT / "deployments",
}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ours that `name` imports at module level (outside functions and TYPE_CHECKING blocks)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, ast.Import):
                targets = [a.name for a in sub.names]
            elif isinstance(sub, ast.ImportFrom):
                base = (
                    importlib.util.resolve_name("." * sub.level + (sub.module or ""), package)
                    if sub.level
                    else sub.module or ""
                )
                targets = [f"{base}.{a.name}" for a in sub.names] + [base]
            else:
                continue
            for t in targets:
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: module_level_imports(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_only_conveyor_is_installed(tmp_path: Path) -> None:
    """Outside the checkout (a user's process) the project's only top-level name is conveyor: no other name
    resolves to one of the checkout's folders (`kernels` may resolve to Hugging Face's distribution)."""
    code = (
        "import importlib.util as u, conveyor.engine, conveyor.kernels; "
        "print([n for n in ('engine', 'kernels', 'cluster', 'deployments', 'benchmarks', 'tests') "
        f"if (s := u.find_spec(n)) and str(s.origin).startswith({str(ROOT) + '/'!r} + n + '/')])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert Path(conveyor.__file__).resolve().parent == ROOT / "conveyor"


def test_the_wheel_lists_every_package() -> None:
    """A non-editable install ships only the packages pyproject.toml names: each source folder with an
    __init__.py is one of them (an editable install would hide a missing one)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert {name for name, path in modules().items() if path.name == "__init__.py"} == listed


def test_the_checkout_does_not_shadow_installed_distributions() -> None:
    """Started inside the checkout (its root first on sys.path), importing conveyor moves the root last, so an
    installed distribution named like one of its folders (Hugging Face's `kernels`) is the one imported."""
    code = "import sys, conveyor; print(sys.path.index(sys.argv[1]) == len(sys.path) - 1)"
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 60
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_engine_imports_no_serving_layer() -> None:
    for name, deps in import_graph().items():
        if name.startswith(("conveyor.engine", "conveyor.kernels")):
            assert not {d for d in deps if d.startswith(("conveyor.cluster", "conveyor.deployments"))}, name
        if name.startswith("conveyor.kernels"):
            assert not {d for d in deps if d.startswith("conveyor.engine")}, name


def test_a_cycle_is_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# The engine's layers, lowest first: a module imports (at module level) only modules of its own layer or below.
ENGINE_LAYERS = {
    "checkpoints": 0,
    "stats": 0,
    "sampling_params": 0,
    "lora_request": 0,
    "model": 1,
    "config": 2,
    "resolved_config": 2,
    "kv_offload": 2,
    "step": 2,
    "execution": 3,
    "core": 4,
    "process": 5,
    "frontend": 6,
}


def engine_layer(module: str) -> int:
    return ENGINE_LAYERS[module.split(".")[2]]


def test_the_engine_packages_are_layered() -> None:
    """frontend > process > core > execution > model > checkpoints: the data flows one way (DESIGN.md)."""
    graph = import_graph()
    engine = [m for m in graph if m.startswith("conveyor.engine.")]
    assert {m.split(".")[2] for m in engine} == set(ENGINE_LAYERS)
    upward = [
        f"{m} -> {d}"
        for m in engine
        for d in graph[m]
        if d.startswith("conveyor.engine.") and engine_layer(d) > engine_layer(m)
    ]
    assert not upward, upward
