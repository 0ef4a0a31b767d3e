"""The committed gRPC code matches the protos, and ``--check`` notices when it does not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tools import protogen


def test_committed_code_is_up_to_date() -> None:
    assert protogen.check() == ""


def test_main_check_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert protogen.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def _copy_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(protogen.REPO / protogen.PACKAGE, repo / protogen.PACKAGE)
    return repo


def test_check_reports_an_edited_and_a_stale_file(tmp_path: Path) -> None:
    repo = _copy_repo(tmp_path)
    grpc_file = repo / protogen.PACKAGE / "node_pb2_grpc.py"
    grpc_file.write_text(grpc_file.read_text() + "# edited by hand\n")
    (repo / protogen.PACKAGE / "gone_pb2.py").write_text("# its proto was removed\n")
    text = protogen.check(repo)
    assert "-# edited by hand" in text
    assert "gpud/v1/node_pb2_grpc.py (committed)" in text
    assert "gpud/v1/gone_pb2.py (committed)" in text and "+++ /dev/null" in text
    assert "node_pb2.py" not in text.replace("node_pb2_grpc.py", "")


def test_write_regenerates_and_removes_stale_files(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / protogen.PACKAGE).mkdir(parents=True)
    (repo / protogen.PACKAGE / "gone_pb2_grpc.py").write_text("")
    (repo / protogen.PACKAGE / "notes.txt").write_text("not ours")
    files = protogen.write(repo)
    names = {f.name for f in files}
    assert {
        "__init__.py",
        "node_pb2.py",
        "node_pb2.pyi",
        "node_pb2_grpc.py",
        "node_pb2_grpc.pyi",
    } <= names
    assert not (repo / protogen.PACKAGE / "gone_pb2_grpc.py").exists()
    assert (repo / protogen.PACKAGE / "notes.txt").exists()
    assert protogen.check(repo) == ""


def test_missing_protos_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(protogen.ProtogenError, match=r"no \.proto files"):
        protogen.check(_copy_repo(tmp_path), proto_root=tmp_path / "empty")
