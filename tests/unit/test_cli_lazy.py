"""gpuctl's deferred generated modules know every proto file and what each imports."""

from __future__ import annotations

import re
from pathlib import Path

from gpud.cli.lazy import PROTO_IMPORTS

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto" / "gpud" / "v1"


def test_every_proto_file_and_its_imports_are_known() -> None:
    found = {}
    for proto in sorted(PROTO_DIR.glob("*.proto")):
        imports = re.findall(r'^import\s+"gpud/v1/(\w+)\.proto";', proto.read_text(), re.M)
        found[proto.stem] = tuple(sorted(imports))
    assert {k: tuple(sorted(v)) for k, v in PROTO_IMPORTS.items()} == found
