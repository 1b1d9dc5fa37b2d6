"""The package's layout holds: llama.* modules import one another without a cycle (imports inside functions
included), dependencies point down the layers below, the command-line entry points are leaves nothing imports,
`python -m llama.quantize` runs without runpy's RuntimeWarning, and no module or function outgrows the project's
limits. Read from the source with `ast`: nothing is imported."""

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

from conftest import REPO, rank_env

PACKAGE = REPO / "llama"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80

# Command-line entry points (`python -m ...`): nothing may import them, or runpy warns that the module is in
# sys.modules before it runs.
LEAVES = ("llama.quantize", "llama.reshard", "llama.convert", "llama.batch", "llama.perplexity", "llama.serve.__main__",
          "llama.__main__")

# Dependencies point one way: a module may import its own layer or lower ones, never a higher one. A module's
# layer is that of its longest listed prefix (a package's modules default to the package's layer; the modules of
# a package that spans layers are placed one by one). "llama" is the root package alone; an unplaced module fails.
LAYERS: List[tuple] = [
    ("llama.settings",),  # the environment, read once
    ("llama.kernels", "llama.distributed.parallel"),  # our C++ kernels and products; devices, process groups
    ("llama.layers", "llama.rope", "llama.sizes", "llama.model_args"),  # parallel linear layers holding a linear
    # method; fusion; the hyperparameters
    ("llama.quantization", "llama.model", "llama.moe"),  # the linear methods; the transformer and its experts
    ("llama.formats", "llama.tokenizers", "llama.tokenizer", "llama.llama4", "llama.sample", "llama.compilation",
     "llama.kernels.int4_pack_store", "llama.hub", "llama.loading.memory", "llama.loading.preload"),  # files,
    # text, tokens, compiled steps; fetching a model; what loading it takes in memory
    ("llama.config",),  # the typed configuration: options checked and resolved once, before anything loads
    ("llama.core",),  # requests, plan, scheduler, runner, engine, KV cache
    ("llama.distributed", "llama.loading", "llama.llama4.model"),  # pipeline stages (an Execution for the runner);
    # the model factory; Meta's Llama 4 Transformer, which keeps a KV cache of its own
    ("llama.generation", "llama.llama4.generation"),  # the Llama facade; Meta's Llama4 generator over it
    ("llama.serve", "llama.cli", "llama.quantization.cli", "llama", *LEAVES),  # user-facing
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: Dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def nearest_module(name: str) -> Optional[str]:
    """The llama module that `import name` loads (a name imported from a module resolves to the module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def init_imports(package: str) -> bool:
    """Whether package's __init__.py imports anything (then importing from the package runs those imports)."""
    init = REPO / package.replace(".", "/") / "__init__.py"
    return init.is_file() and any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(ast.parse(
        init.read_text())))


def imported(module: str, path: Path, node: ast.AST) -> List[str]:
    """The llama.* modules an Import/ImportFrom node names, relative imports resolved against `module`."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module
        names = [f"{prefix}.{a.name}" for a in node.names]  # a submodule, or a name defined in prefix
        if prefix != "llama" and init_imports(prefix):
            names.append(prefix)  # `from pkg import x` runs pkg/__init__.py first (the root's is everyone's)
    found = [nearest_module(n) for n in names if n == "llama" or n.startswith("llama.")]
    return [m for m in found if m is not None and m != module]


def import_graph() -> Dict[str, Set[str]]:
    """Every llama module -> the llama modules it imports anywhere (module level, functions, conditionals)."""
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = {dep for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for dep in imported(module, path, node)}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Cycle paths (a -> ... -> a), one for each edge back into the path of a depth-first walk: none when the
    graph has no cycle."""
    found, state = [], {}  # state: 1 on the current path, 2 finished

    def visit(node: str, path: List[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def layer(module: str) -> int:
    best, index = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or (p != "llama" and module.startswith(p + "."))) and len(p) > best:
                best, index = len(p), i
    if index is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: place it")
    return index


def test_the_resolver_sees_every_kind_of_import():
    """Relative, absolute, `from package import module`, and imports inside functions, on real modules."""
    graph = import_graph()
    assert "llama.settings" in graph["llama.kernels.cpu"]  # from llama import settings
    assert "llama.compilation.step_store" in graph["llama.compilation.compiled_decode"]  # from pkg import module
    assert "llama.generation" in graph["llama.cli.batch"]  # inside main()
    assert "llama.core.frontend.engine" in graph["llama"]  # relative, from the package's __init__
    assert "llama.formats.checklist" in graph["llama.formats.meta_checkpoint"]  # from module import names


def test_no_import_cycle():
    found = [c for c in cycles(import_graph())]
    assert not found, "import cycle(s): " + "; ".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_reports_the_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_dependencies_point_down_the_layers():
    graph = import_graph()
    for module in graph:
        layer(module)  # every module is placed
    up = sorted((m, dep) for m, deps in graph.items() for dep in deps
                if layer(dep) > layer(m))
    assert not up, "imports of a higher layer: " + "; ".join(
        f"{m} (layer {layer(m)}) -> {dep} (layer {layer(dep)})" for m, dep in up)


def test_entry_points_are_leaves():
    graph = import_graph()
    for leaf in LEAVES:
        assert leaf in MODULES, leaf
        importers = sorted(m for m, deps in graph.items() if leaf in deps)
        assert not importers, f"{leaf} is a `python -m` entry point, yet {importers} import it"


def test_python_m_quantize_runs_without_a_runtime_warning():
    """runpy's "found in sys.modules ... unpredictable behaviour" is a RuntimeWarning: made an error here."""
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "llama.quantize", "--help"],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=rank_env(1))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout and "RuntimeWarning" not in proc.stderr


def test_import_llama_leaves_the_heavy_optional_modules_unloaded():
    """Every process pays `import llama` (a torchrun rank, a server, a CLI call): gguf (with the mistral_common it
    imports, 0.8 s) loads with the first GGUF file read, Dynamo (2-9 s) with the first compiled step."""
    code = ("import sys, llama; from llama import Llama; "
            "print(sorted(m for m in ('gguf', 'mistral_common', 'torch._dynamo', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=rank_env(1))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def sizes():
    """(path, lines) of every module and (path:function, lines) of every function (nested ones too)."""
    modules, functions = {}, {}
    for path in MODULES.values():
        text = path.read_text()
        rel = str(path.relative_to(REPO))
        modules[rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[f"{rel}:{node.name}"] = max(functions.get(f"{rel}:{node.name}", 0),
                                                      node.end_lineno - node.lineno + 1)
    return modules, functions


def test_no_module_over_500_lines():
    modules, _ = sizes()
    over = {p: n for p, n in modules.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_function_over_80_lines():
    _, functions = sizes()
    over = {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def test_the_docs_layer_table_is_this_ones():
    """docs/architecture.md's layer table lists LAYERS, one row per layer in order (module names without the
    `llama.` prefix; the last row ends with the leaves, named together)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("| layer (low to high) |"):].split("\n\n", 1)[0].splitlines()[2:]
    rows = [re.findall(r"`([\w.]+)`", line.split("|")[1]) for line in table]
    want = [[name.removeprefix("llama.") for name in layer if name not in LEAVES] for layer in LAYERS]
    assert rows == want, "docs/architecture.md's layer table differs from LAYERS: " + str(list(zip(rows, want)))
