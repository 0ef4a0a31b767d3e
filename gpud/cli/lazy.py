"""Generated gRPC modules that load on first use, so that gpuctl starts quickly.

``gpuctl --help`` builds every command group's parser, and each group module names its
generated messages at the top (``from gpud.v1 import mig_pb2 as pb``). Importing them all
would load protobuf and every service's descriptors for a command that needs none of them
(and ``gpuctl status`` needs only ``node``'s). :func:`defer` puts a stand-in module in
their place: the ``from ... import`` binds it at once, and the real module is imported the
first time one of its attributes is read (under a lock, so two threads never import it
twice). The package imports stay ordinary and type-checked; only when they run changes.
"""

from __future__ import annotations

import _thread
import importlib
import sys
from types import ModuleType
from typing import Any

# The proto files under proto/gpud/v1 and the ones each imports (a test keeps this true):
# a generated module needs its imports' descriptors loaded before its own.
PROTO_IMPORTS: dict[str, tuple[str, ...]] = {
    "node": (),
    "mig": (),
    "mps": (),
    "jobs": (),
    "queue": ("jobs",),
    "colo": (),
    "net": (),
    "cluster": (),
}

# Generated code under gpud.v1 (tools/protogen), one pair per proto file.
GENERATED = tuple(
    f"gpud.v1.{service}_{suffix}" for service in PROTO_IMPORTS for suffix in ("pb2", "pb2_grpc")
)


class _Deferred(ModuleType):
    """Stands in for a module until one of its attributes is read."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_deferred_lock"] = _thread.allocate_lock()
        self.__dict__["_deferred_real"] = None

    def _real(self) -> ModuleType:
        with self.__dict__["_deferred_lock"]:
            real: ModuleType | None = self.__dict__["_deferred_real"]
            if real is None:
                _load_imports(self.__name__)
                if sys.modules.get(self.__name__) is self:
                    del sys.modules[self.__name__]
                real = importlib.import_module(self.__name__)  # sets the parent's attribute
                self.__dict__["_deferred_real"] = real
            return real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real(), name)


def _load_imports(name: str) -> None:
    """Load the real modules of the proto files that ``name``'s proto file imports: the
    generated code's ``from gpud.v1 import jobs_pb2`` would bind only a stand-in."""
    service = name.rpartition(".")[2].removesuffix("_grpc").removesuffix("_pb2")
    for dependency in PROTO_IMPORTS.get(service, ()):
        module = sys.modules.get(f"gpud.v1.{dependency}_pb2")
        if isinstance(module, _Deferred):
            module._real()


def defer(*names: str) -> None:
    """Stand-ins for the modules in ``names`` not imported yet.

    Each is also set as its parent package's attribute, so that ``from package import
    module`` binds it without importing the module.
    """
    for name in names:
        if name in sys.modules:
            continue
        parent, _, child = name.rpartition(".")
        stand_in = _Deferred(name)
        sys.modules[name] = stand_in
        if parent:
            setattr(importlib.import_module(parent), child, stand_in)
