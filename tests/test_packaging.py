"""A built wheel (as a Docker image or `pip install .` gets) holds every package the code imports."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_package(tmp_path):
    pytest.importorskip("setuptools")
    shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools builds in-tree: no stale copies
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(ROOT)], check=True, cwd=tmp_path, timeout=300)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    (wheel,) = tmp_path.glob("trellis-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = [d for d in ROOT.iterdir() if (d / "__init__.py").is_file() and d.name != "tests"]
    packages = sorted(str(p.parent.relative_to(ROOT)) for d in tops for p in d.rglob("__init__.py"))
    assert packages, "no packages found"
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"packages left out of the wheel: {missing}"
    assert "trellis/tulip/v1/tulip_pb2.py" in names  # the generated stubs travel too
    assert "presets/nmt_nfkc.charsmap.gz" in names  # the stand-in tokenizer's normalizer


# --- the import graph (docs/structure.md's picture) ----------------------------------------------------
PRODUCT = ("trellis", "presets", "rose", "tulip", "ivy", "deploy", "jobs")
# package -> the packages it must never import (at module level or inside a function)
NEVER = {
    "ivy": {"tulip", "rose", "presets", "benchmarks", "jobs"},  # the gateway stands on the contracts alone
    "rose": {"ivy", "tulip", "presets", "benchmarks", "jobs"},  # the engine imports no service
    "trellis": {"ivy", "tulip", "rose", "benchmarks", "deploy", "jobs"},  # the contracts import none of them
    "tulip": {"ivy", "benchmarks", "jobs"},
    "presets": {"ivy", "tulip", "rose", "benchmarks", "jobs"},
    "deploy": {"jobs"},
    "jobs": {"benchmarks", "deploy"},  # bulk jobs stand on the services; nothing but benchmarks imports them
}


def _modules() -> dict[str, Path]:
    out = {}
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules) -> list[tuple[str, int, bool]]:
    """(module imported, line, at module level) for each import of `path` that names a module of ours;
    `from P import M` counts as an import of P.M where that is a module."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(n) for n in tree.body}
    top_level |= {id(n) for node in tree.body if isinstance(node, (ast.If, ast.Try)) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in modules and n.split(".")[0] in PRODUCT + ("benchmarks",):
                n = n.rpartition(".")[0]  # `import a.b.c` of a name inside a module: that module
            if n.split(".")[0] in PRODUCT + ("benchmarks",):
                out.add((n, node.lineno, id(node) in top_level))
    return sorted(out)


def test_import_graph_has_no_upward_import_and_no_circle():
    """Ivy imports neither tulip nor rose, ROSE no service, trellis none of the three (presets only inside
    a function: a `preset:NAME` reference loads it), and no modules of the product packages import each
    other in a circle (imports inside functions counted)."""
    modules = _modules()
    graph, bad = {}, []
    for name, path in modules.items():
        edges = _imports(name, path, modules)
        graph[name] = {m for m, _, _ in edges if m in modules and m != name}
        top = name.split(".")[0]
        for m, line, module_level in edges:
            where = f"{path.relative_to(ROOT)}:{line} imports {m}"
            if m.split(".")[0] in NEVER.get(top, ()):
                bad.append(where)
            elif top == "trellis" and m.split(".")[0] == "presets" and module_level:
                bad.append(where + " at module level (only a preset: reference may load it)")
    assert not bad, "\n".join(bad)

    # circles: strongly connected components of more than one module (Tarjan's, iteratively)
    index, low, on, stack, circles, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    circles.append(sorted(comp))
    assert not circles, f"modules importing each other in a circle: {circles}"
    assert len(graph) > 100 and graph["ivy.balancer"] >= {"trellis.client"}  # the graph was read


def test_config_and_contracts_load_without_torch():
    """Tulip's config (read by `trellis serve` and the CLI's --help) and the contracts load no torch:
    the engine's names they need live in torch-free modules (rose.backends, rose.extras)."""
    code = ("import sys, tulip.config, trellis.client, trellis.modelref, trellis.options, trellis.postprocess; "
            "sys.exit(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ivy', 'presets'}) or None)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
