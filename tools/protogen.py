"""Generate gpud's protobuf and gRPC code from ``proto/gpud/v1/*.proto`` into ``gpud/v1/``.

::

    python -m tools.protogen          # regenerate gpud/v1/ (committed)
    python -m tools.protogen --check  # fail, with a diff, if gpud/v1/ is not what it would be

For every ``NAME.proto`` it writes ``NAME_pb2.py`` and ``NAME_pb2_grpc.py`` (protoc and the
gRPC plugin bundled with the pinned grpcio-tools) and ``NAME_pb2.pyi`` / ``NAME_pb2_grpc.pyi``
(mypy-protobuf), so servicers and clients type-check under ``mypy --strict``. Output is
generated into a temporary directory first: a protoc error leaves the committed files as
they were. Generated files whose ``.proto`` is gone are removed.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PACKAGE = Path("gpud") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")

INIT_TEXT = '''"""Generated protobuf and gRPC code for the ``gpud.v1`` API.

Do not edit: the sources are ``proto/gpud/v1/*.proto``; regenerate with
``python -m tools.protogen`` (``--check`` verifies the committed files).
"""
'''


class ProtogenError(Exception):
    """protoc failed, or a plugin is missing."""


def _plugin(name: str) -> str:
    """The path of a protoc plugin installed next to this interpreter (the venv's bin/)."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ProtogenError(f"{name} not found: install the dev group (mypy-protobuf)")
    return found


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    return sorted((proto_root / PACKAGE).glob("*.proto"))


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Generate every proto under ``proto_root/gpud/v1`` into ``out_root/gpud/v1``.

    Returns the generated files' paths relative to ``out_root``.
    """
    from grpc_tools import protoc  # dev dependency: imported only when generating

    protos = proto_files(proto_root)
    if not protos:
        raise ProtogenError(f"no .proto files under {proto_root / PACKAGE}")
    well_known = resources.files("grpc_tools") / "_proto"
    (out_root / PACKAGE).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"--proto_path={proto_root}",
        f"--proto_path={well_known}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        # "quiet": the mypy plugins otherwise print every file they write to stderr.
        f"--mypy_out=quiet:{out_root}",
        f"--mypy_grpc_out=quiet:{out_root}",
        *(str(p.relative_to(proto_root)) for p in protos),
    ]
    # protoc resolves the relative file names against --proto_path, so they come out as
    # gpud/v1/NAME_pb2.py with imports "from gpud.v1 import ..." whatever the cwd is.
    rc = protoc.main(args)
    if rc != 0:
        raise ProtogenError(f"protoc failed with exit status {rc}")
    (out_root / PACKAGE / "__init__.py").write_text(INIT_TEXT, encoding="utf-8")
    return sorted(p.relative_to(out_root) for p in (out_root / PACKAGE).iterdir() if p.is_file())


def _owned(directory: Path) -> set[str]:
    """Names in ``directory`` that protogen writes (generated files and ``__init__.py``)."""
    if not directory.is_dir():
        return set()
    return {
        p.name
        for p in directory.iterdir()
        if p.is_file() and (p.name == "__init__.py" or p.name.endswith(GENERATED_SUFFIXES))
    }


def diff(expected_root: Path, actual_root: Path) -> str:
    """A unified diff from the committed files (actual) to freshly generated ones (expected)."""
    expected_dir, actual_dir = expected_root / PACKAGE, actual_root / PACKAGE
    out: list[str] = []
    for name in sorted(_owned(expected_dir) | _owned(actual_dir)):
        exp, act = expected_dir / name, actual_dir / name
        exp_lines = (
            exp.read_text(encoding="utf-8").splitlines(keepends=True) if exp.exists() else []
        )
        act_lines = (
            act.read_text(encoding="utf-8").splitlines(keepends=True) if act.exists() else []
        )
        if exp_lines == act_lines and exp.exists() == act.exists():
            continue
        out.extend(
            difflib.unified_diff(
                act_lines,
                exp_lines,
                fromfile=f"{PACKAGE / name} (committed)" if act.exists() else "/dev/null",
                tofile=f"{PACKAGE / name} (generated)" if exp.exists() else "/dev/null",
            )
        )
        if out and not out[-1].endswith("\n"):
            out.append("\n")
    return "".join(out)


def write(repo: Path = REPO, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Regenerate into ``repo/gpud/v1``; remove generated files whose proto is gone."""
    with tempfile.TemporaryDirectory(prefix="protogen-") as tmp:
        files = generate(Path(tmp), proto_root)
        target = repo / PACKAGE
        target.mkdir(parents=True, exist_ok=True)
        fresh = {f.name for f in files}
        for stale in _owned(target) - fresh:
            (target / stale).unlink()
        for f in files:
            shutil.copyfile(Path(tmp) / f, repo / f)
    return files


def check(repo: Path = REPO, proto_root: Path = PROTO_ROOT) -> str:
    """The diff between the committed ``gpud/v1`` and a fresh generation; empty when equal."""
    with tempfile.TemporaryDirectory(prefix="protogen-") as tmp:
        generate(Path(tmp), proto_root)
        return diff(Path(tmp), repo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.protogen", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temporary directory and fail with a diff if gpud/v1 differs",
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            text = check()
            if text:
                sys.stdout.write(text)
                print(
                    "gpud/v1 is out of date with proto/: run `python -m tools.protogen`",
                    file=sys.stderr,
                )
                return 1
            print("gpud/v1 is up to date")
            return 0
        files = write()
    except ProtogenError as err:
        print(f"protogen: {err}", file=sys.stderr)
        return 1
    for f in files:
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
