"""The build identity (gpud.build): a digest of the code, on small trees under tmp_path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpud import build
from gpud.cli.main import main as gpuctl_main
from gpud.main import build_parser as gpud_parser


def _tree(root: Path) -> Path:
    for rel, text in {
        "gpud/__init__.py": "x = 1\n",
        "gpud/v1/node_pb2.py": "# generated\n",
        "colocate/__init__.py": "",
        "netshaper/leveller.py": "def f(): ...\n",
        "gpud/sim_tools/nvidia-cuda-mps-control": "#!/bin/sh\n",  # not a .py: not counted
        "tests/test_x.py": "assert True\n",  # not a shipped package
    }.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_same_files_same_build(tmp_path: Path) -> None:
    a = build.digest(_tree(tmp_path / "a"))
    b = build.digest(_tree(tmp_path / "b"))  # another install root, the same code
    assert a == b
    assert re.fullmatch(r"[0-9a-f]{12}", a)


def test_one_changed_byte_changes_the_build(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    before = build.digest(root)
    (root / "netshaper/leveller.py").write_text("def g(): ...\n")
    assert build.digest(root) != before
    (root / "netshaper/leveller.py").write_text("def f(): ...\n")
    assert build.digest(root) == before  # reverted: the same build again


def test_what_is_not_shipped_code_is_not_counted(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    before = build.digest(root)
    (root / "tests/test_x.py").write_text("assert False\n")
    (root / "gpud/sim_tools/nvidia-cuda-mps-control").write_text("#!/bin/bash\n")
    cache = root / "gpud/__pycache__"
    cache.mkdir()
    (cache / "stale.py").write_text("compiled elsewhere\n")
    assert build.digest(root) == before


def test_a_renamed_file_is_another_build(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    before = build.digest(root)
    (root / "colocate/__init__.py").rename(root / "colocate/other.py")
    assert build.digest(root) != before


def test_an_unreadable_file_degrades_to_unknown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file that cannot be read (here: removed between the walk and the read, as a
    dangling link is; root reads a mode-000 file) gives "unknown", not an error."""
    root = _tree(tmp_path)
    (root / "gpud/gone.py").symlink_to(root / "gpud/nowhere.py")
    assert build.digest(root) == build.UNKNOWN
    assert "cannot compute the build identity" in caplog.text


def test_the_running_code_has_a_build() -> None:
    assert build.current() == build.digest(build.installed_root())
    assert build.current() != build.UNKNOWN


def test_version_flags_show_the_build(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        gpud_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"gpud 0.1.0 (build {build.current()})\n"
    assert gpuctl_main(["--version"], env={}) == 0
    assert capsys.readouterr().out == f"gpuctl 0.1.0 (build {build.current()})\n"
