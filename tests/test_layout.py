"""The package layout's rules (#16): ``rewards/`` is the ground floor, and what builds on it imports it, never
the other way round."""

from __future__ import annotations

import ast
import re

import pytest

from tests.conftest import REPO

SHIMS = {"rewards/filter_tasks.py"}
"""``python -m rewards.filter_tasks``: the documented command, kept as a thin shim over dna_factory.filter."""


def _imported_modules(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_rewards_imports_nothing_from_dna_factory():
    offenders = {
        path.relative_to(REPO).as_posix(): sorted(
            m for m in _imported_modules(path) if m.split(".")[0] == "dna_factory"
        )
        for path in sorted((REPO / "rewards").rglob("*.py"))
        if path.relative_to(REPO).as_posix() not in SHIMS
    }
    offenders = {path: modules for path, modules in offenders.items() if modules}
    assert not offenders, f"rewards/ must not import dna_factory/: {offenders}"


# --- The import graph (#16 item 1) -------------------------------------------------------------------------------

PACKAGES = ("dna_factory", "rewards")
USERS = ("dna_factory", "rewards", "scripts", "bench")
"""Where a module's importers are looked for (tests are not a module's users)."""


def _module_of(path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _our_modules() -> dict[str, object]:
    return {_module_of(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(path, module: str, modules) -> set[str]:
    """Every module of ours that importing ``module`` may execute: each import statement anywhere in the
    file (module level, inside functions, under TYPE_CHECKING), with the parent packages Python runs first
    (except the module's own ancestors: those are already running when it is imported)."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, module, path.name == "__init__.py")
            named.add(source)
            named |= {f"{source}.{alias.name}" for alias in node.names}
    found = set()
    for name in named:
        parts = name.split(".")
        found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    return {m for m in found if m in modules and m != module and m not in ancestors}


def _import_graph() -> dict[str, set[str]]:
    modules = _our_modules()
    return {module: _edges(path, module, modules) for module, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_even_through_imports_inside_functions():
    """An import inside a function may defer a heavy library; it must never be what keeps a cycle alive."""
    cycles = _cycles(_import_graph())
    assert not cycles, f"import cycles (counting imports inside functions): {cycles}"


def test_no_module_in_the_package_root_belongs_to_a_wing():
    """A root module of dna_factory/ that only one wing (a sub-package) imports lives in that wing."""
    graph = _import_graph()
    for folder in USERS[2:]:
        for path in sorted((REPO / folder).rglob("*.py")):
            graph[_module_of(path)] = _edges(path, _module_of(path), _our_modules())
    for path in sorted(REPO.glob("*.py")):
        graph[path.stem] = _edges(path, path.stem, _our_modules())
    root = {
        m
        for m in graph
        if m.count(".") == 1
        and m.startswith("dna_factory.")
        and (REPO / (m.replace(".", "/") + ".py")).is_file()
    }
    misplaced = {}
    for module in sorted(root):
        importers = {user for user, targets in graph.items() if module in targets}
        homes = {
            user.split(".")[1] if user.startswith("dna_factory.") and user.count(".") >= 2 else user
            for user in importers
        }
        wings = {home for home in homes if (REPO / "dna_factory" / home).is_dir()}
        if len(homes) == 1 and wings:
            misplaced[module] = wings.pop()
    assert not misplaced, f"root modules only one wing uses (move them into it): {misplaced}"


def test_no_module_imports_through_its_own_package_face():
    """#39: a package's ``__init__`` hands names on; its own modules import each other by their full names
    (``from rewards.sandbox.execute import ...``), never ``from rewards.sandbox import ...``, so the face holds no
    code its parts call and no part waits on the face being half-imported."""
    offenders = []
    for module, path in _our_modules().items():
        if "." not in module:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                source = node.module
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(node, module, path.name == "__init__.py")
            else:
                continue
            face_of = module if path.name == "__init__.py" else module.rpartition(".")[0]
            if face_of == source or face_of.startswith(source + "."):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} from {source} import ...")
    assert offenders == [], offenders


DEFERRED = (
    "torch", "transformers", "trl", "datasets", "peft", "vllm", "accelerate", "deepspeed", "safetensors", "pandas",
    "matplotlib", "pyarrow", "numpy", "bm25s", "wandb", "inspect_ai", "huggingface_hub", "langdetect", "math_verify",
    "jinja2", "tqdm",
)  # fmt: skip
"""Libraries an import inside a function may defer without a comment: each costs from a tenth of a second to
several seconds to import, and ``--help``, ``--dry_run`` and a recipe error answer without them."""


def _unexplained_imports_inside_functions() -> list[str]:
    found = []
    for folder in PACKAGES:
        for path in sorted((REPO / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for function in ast.walk(ast.parse("\n".join(lines), str(path))):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if not isinstance(node, (ast.Import, ast.ImportFrom)):
                        continue
                    name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    said = any("#" in lines[i] for i in range(node.lineno - 2, node.end_lineno) if i >= 0)
                    if not said and (name or "").split(".")[0] not in DEFERRED:
                        found.append(
                            f"{path.relative_to(REPO)}:{node.lineno} {lines[node.lineno - 1].strip()}"
                        )
    return sorted(set(found))


def test_an_import_inside_a_function_says_why():
    """#39: imports stand at the top of a module. One inside a function defers a heavy library (:data:`DEFERRED`)
    or carries a comment, on its line or the line above, that says why (a library only one path needs)."""
    found = _unexplained_imports_inside_functions()
    assert found == [], f"{len(found)} imports inside functions with no reason: {found}"


def test_no_module_is_past_500_lines():
    """A module past about 500 lines holds two concerns: it is split (rewards/sandbox/channel.py was 530: the wire
    protocol and the rules for which modules the tests may trust, now rewards/sandbox/trusted.py)."""
    long = {
        path.relative_to(REPO).as_posix(): n
        for folder in PACKAGES
        for path in sorted((REPO / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert long == {}, long


def test_the_package_root_holds_at_most_six_modules():
    """#39: the root of ``dna_factory/`` is the package's face and the few modules every wing uses; each other
    concern (configuration, inputs, a run's life, serving, the pipeline) is a wing."""
    root = sorted(p.name for p in (REPO / "dna_factory").glob("*.py") if p.name != "__init__.py")
    assert len(root) <= 6, f"{len(root)} root modules (at most 6; move each into its wing): {root}"


WINGS = {
    "grpo": ("stage", "keys", "dynamic_sampling"),
    "async_grpo": ("stage", "trainer", "tree_attention", "weight_sync"),
    "distill": ("stage", "trainers", "teacher_server", "tokenizer_alignment"),
    "eval": ("keys", "staging", "callback", "harness", "tasks"),
    "stages": ("base", "sft", "dpo"),
    "configuration": ("config", "config_types", "validation", "provenance"),
    "inputs": ("data", "data_files", "prompts", "loading", "preview", "row_lengths", "input_fingerprint"),
    "run": ("runner", "resume", "run_files", "run_callbacks", "interrupt", "process_group", "launch"),
    "serving": ("vllm_server", "services"),
    "pipeline": ("chain", "recipe", "state", "eval_server", "report"),
}


def test_each_feature_is_one_wing():
    missing = [
        f"dna_factory/{wing}/{name}.py"
        for wing, names in WINGS.items()
        for name in names
        if not (REPO / "dna_factory" / wing / f"{name}.py").is_file()
    ]
    assert not missing, f"missing wing modules: {missing}"
    from dna_factory.async_grpo import validate_async_args, validate_completion_length_against_server

    assert callable(validate_async_args) and callable(validate_completion_length_against_server)


def test_the_eval_keys_load_without_torch():
    """``--dry_run`` and ``--help`` read the checkpoint-eval keys; they must not pull torch in."""
    import subprocess
    import sys

    code = (
        "import sys, dna_factory.eval.keys; "
        "print(sorted(m for m in ('torch', 'transformers', 'trl', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_pipeline_entries_come_from_the_stage_registry():
    """Adding a stage is its module, its registry line and its defaults file; the pipeline follows."""
    from dna_factory.pipeline.recipe import ENTRIES
    from dna_factory.stages import STAGE_MODULES, get_stage

    assert ENTRIES is not None and tuple(ENTRIES) == tuple(STAGE_MODULES)
    for name in STAGE_MODULES:
        stage = get_stage(name)
        assert stage.name == name
        assert (REPO / "configs" / f"_defaults-{stage.defaults}.yaml").is_file()
        assert (REPO / f"{name}.py").is_file(), f"the entry script {name}.py"


def test_one_atomic_write():
    """#39: every atomic write goes through run_files.atomic_path / write_atomic (text and bytes alike); a
    hand-written temporary file renamed into place elsewhere is a second copy of the mechanism."""
    renames = re.compile(r"os\.replace\(|os\.rename\(|\.replace\((target|path)\)|\.rename\(")
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for folder in ("dna_factory", "rewards", "scripts")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path.name != "run_files.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if renames.search(line)
    ]
    assert found == [], found


def test_the_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    from dna_factory.run.run_files import atomic_path, write_atomic

    target = tmp_path / "weights.bin"
    write_atomic(target, b"\x00old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the writer died")
    assert target.read_bytes() == b"\x00old" and [p.name for p in tmp_path.iterdir()] == ["weights.bin"]
    write_atomic(target, (chunk for chunk in ("a", "b")))
    assert target.read_text() == "ab"


def test_the_sync_grpo_wing_does_not_import_its_async_variant():
    """#39: the stage registry picks async GRPO (``dna_factory.stages.VARIANTS``); ``grpo/`` never reaches up into
    ``async_grpo/``, not even inside a function."""
    found = {
        path.relative_to(REPO).as_posix(): sorted(m for m in _imported_modules(path) if "async_grpo" in m)
        for path in sorted((REPO / "dna_factory" / "grpo").rglob("*.py"))
    }
    assert {path: modules for path, modules in found.items() if modules} == {}


def test_the_readme_names_every_bench_script():
    """#39: README's bench/ row lists every benchmark script."""
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `bench/` |"))
    missing = [p.name for p in sorted((REPO / "bench").glob("*.py")) if f"`{p.name}`" not in row]
    assert missing == [], missing


def test_the_stage_docs_do_not_call_a_variant_a_stage():
    """#39: async GRPO is a variant of the grpo stage (stages.VARIANTS), not one of the registry's stages."""
    from dna_factory.stages import STAGE_MODULES, VARIANTS

    text = (REPO / "docs" / "stages.md").read_text()
    wings = re.findall(r"a wing whose `stage.py` declares it\s*\(([^)]*)\)", text)
    assert wings and "async_grpo" not in wings[0], wings
    assert "async_grpo" not in " ".join(STAGE_MODULES.values()) and "grpo" in VARIANTS
