"""The build identity: which code a gpud or gpuctl runs, as a short digest of that code.

Every release of gpud reports ``0.1.0`` until the version is bumped, so the version alone
cannot tell an operator that a node's package was upgraded (``git pull``, ``pip install``)
while its gpud still runs the old code, nor which nodes of a rolling upgrade already run the
new one. The build identity can: it is the first 12 hex digits of a SHA-256 over the
``.py`` files of the packages the wheel ships (:data:`PACKAGES`), each as its path relative
to the install root (sorted, ``/``-separated), its length and its bytes.

Why a digest of the code rather than a git commit or a build stamp:

* the same code gives the same build on every node, however it was installed, and any
  change (one byte) gives another;
* it needs no git, nor any step at build time: a wheel, an sdist and an editable install
  (``pip install -e``) of the same tree all report the same build;
* it is what runs: gpud computes it once at start, so after an upgrade without a restart
  ``gpuctl version`` (computed again by the new client) and the daemon's disagree.

``__pycache__`` and other files (the ``.pyi`` stubs, the simulated MPS tool's shell script)
are not part of it. Computing it reads about 180 files, 2 MB: under 10 ms once the files
are in the page cache (the daemon at start, ``gpuctl version``, ``gpud --version``;
nothing else in ``gpuctl`` computes it).

A file that cannot be read (permissions, a file removed while walking) gives
:data:`UNKNOWN` rather than an error: the identity is for display and comparison only.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

# hashlib and logging are imported when a digest is computed: gpuctl imports this module
# for --version, and its other commands should not pay for them (a tenth of its start-up).

PACKAGES = ("gpud", "colocate", "netshaper")
"""The packages the wheel ships (pyproject's ``tool.setuptools.packages.find``)."""

LENGTH = 12
"""Hex digits of the digest kept: 48 bits, unique among any cluster's builds."""

UNKNOWN = "unknown"
"""The build when a file of the code could not be read."""


def digest(root: Path, packages: Iterable[str] = PACKAGES) -> str:
    """The build identity of the packages under ``root`` (the directory that holds them:
    ``site-packages``, or the source tree for an editable install); :data:`UNKNOWN` when a
    file cannot be read. A package absent under ``root`` contributes nothing."""
    import hashlib

    h = hashlib.sha256()
    try:
        files = sorted(
            (path.relative_to(root).as_posix(), path)
            for package in packages
            for path in (root / package).rglob("*.py")
            if "__pycache__" not in path.parts
        )
        for rel, path in files:
            data = path.read_bytes()
            h.update(rel.encode())
            h.update(b"\0")
            h.update(len(data).to_bytes(8, "big"))
            h.update(data)
    except OSError as err:
        import logging

        logging.getLogger(__name__).warning(
            "cannot compute the build identity under %s: %s", root, err
        )
        return UNKNOWN
    return h.hexdigest()[:LENGTH]


def installed_root() -> Path:
    """Where the running code's packages are: the directory above ``gpud/``."""
    return Path(__file__).resolve().parent.parent


@functools.cache
def current() -> str:
    """The build identity of the code this process runs (computed on the first call)."""
    return digest(installed_root())


def describe(version: str, build: str) -> str:
    """``0.1.0 (build 3f2a9c1d04ab)``: how a version and build are shown together."""
    return f"{version} (build {build})"


class VersionAction(argparse.Action):
    """``--version`` printing ``PROG VERSION (build ID)``: the build is computed only when
    the flag is given, so nothing else pays for it."""

    def __init__(self, option_strings: Sequence[str], dest: str, version: str) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and build, and exit")
        self.version = version

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog} {describe(self.version, current())}")  # stdout, as argparse's
        parser.exit()
