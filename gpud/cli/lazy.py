"""Generated gRPC modules that load on first use, so that gpuctl starts quickly.

``gpuctl --help`` builds every command group's parser, and each group module names its
generated messages at the top (``from gpud.v1 import mig_pb2 as pb``). Importing them all
would load protobuf and every service's descriptors for a command that needs none of them
(and ``gpuctl status`` needs only ``node``'s). :func:`defer` registers such modules with the
standard library's :class:`importlib.util.LazyLoader`: the ``from ... import`` binds a
module object at once, and the module body runs when an attribute is first read.

The package imports stay ordinary and type-checked; only when they execute changes.
"""

from __future__ import annotations

import importlib.util
import sys

# Generated code under gpud.v1 (tools/protogen), one pair per service.
GENERATED = tuple(
    f"gpud.v1.{service}_{suffix}"
    for service in ("node", "mig", "mps", "jobs")
    for suffix in ("pb2", "pb2_grpc")
)


def defer(*names: str) -> None:
    """Make each module in ``names`` load on first attribute access (already loaded: kept).

    The module is also set as its parent package's attribute, so that
    ``from package import module`` finds it without running it.
    """
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            raise ImportError(f"no module named {name!r}", name=name)
        loader = importlib.util.LazyLoader(spec.loader)
        spec.loader = loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loader.exec_module(module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
