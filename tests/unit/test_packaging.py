"""What an operator installs: the runtime packages' imports match the dependencies that
pyproject.toml declares, and the wheel holds every file of those packages."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gpud", "netshaper", "colocate")
# Not on PyPI (rdma-core ships it): imported inside a function that falls back without it.
NOT_ON_PYPI = {"pyverbs"}


def _dist(requirement: str) -> str:
    return _norm(re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0])


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(node: ast.AST, *, in_function: bool) -> Iterator[tuple[str, bool]]:
    """(top-level module, whether the import runs only when a function is called)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield alias.name.split(".")[0], in_function
        elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
            yield child.module.split(".")[0], in_function
        inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
        yield from _imports(child, in_function=inner)


def _third_party_imports() -> dict[str, dict[str, bool]]:
    """Each third-party module the runtime packages import: file -> only inside functions."""
    found: dict[str, dict[str, bool]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for top, lazy in _imports(tree, in_function=False):
                if top in sys.stdlib_module_names or top in (*PACKAGES, "__future__"):
                    continue
                where = found.setdefault(top, {})
                rel = str(path.relative_to(ROOT))
                where[rel] = where.get(rel, True) and lazy
    return found


def test_runtime_imports_match_the_declared_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_dist(r) for r in project["dependencies"]}
    extras = {_dist(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    providers = importlib.metadata.packages_distributions()
    imported: set[str] = set()
    for top, files in sorted(_third_party_imports().items()):
        if top in NOT_ON_PYPI:
            assert all(files.values()), f"{top} imported at module level: {files}"
            continue
        dists = {_norm(d) for d in providers.get(top, [])}
        assert dists, f"{top} (imported by {sorted(files)}) is not installed"
        imported |= dists
        assert dists & (required | extras), f"{top} ({sorted(dists)}) is not declared"
        if not dists & required:
            # an extra's module loads only where its feature is configured
            eager = sorted(f for f, lazy in files.items() if not lazy)
            assert not eager, f"{top} is an extra but imported at module level by {eager}"
    # a required dependency nothing imports is installed on every node for nothing
    assert required <= imported, f"declared but never imported: {sorted(required - imported)}"


def test_the_wheel_holds_every_file_of_the_packages(tmp_path: Path) -> None:
    src = tmp_path / "src"
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=junk)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    build = "from setuptools import build_meta; print(build_meta.build_wheel(%r))"
    result = subprocess.run(
        [sys.executable, "-c", build % str(tmp_path / "dist")],
        cwd=src,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    wheel = tmp_path / "dist" / result.stdout.split()[-1]
    with zipfile.ZipFile(wheel) as zf:
        infos = {i.filename: i for i in zf.infolist()}
        entry_points = zf.read(
            next(n for n in infos if n.endswith(".dist-info/entry_points.txt"))
        ).decode()
    shipped = {n for n in infos if ".dist-info/" not in n}
    expected = {
        str(p.relative_to(src)) for package in PACKAGES for p in (src / package).rglob("*")
    } - {str(p.relative_to(src)) for p in src.rglob("*") if p.is_dir()}
    assert shipped == expected, (sorted(expected - shipped), sorted(shipped - expected))
    # the fake control daemon under the real program's name is run as is
    mode = infos["gpud/sim_tools/nvidia-cuda-mps-control"].external_attr >> 16
    assert mode & 0o111
    assert "gpud = gpud:daemon_entry" in entry_points
    assert "gpuctl = gpud.cli:entry" in entry_points
