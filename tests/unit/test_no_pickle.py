"""No pickle anywhere on a wire: nothing in the product (llumnix/, llumlet/, operator/) imports a
module that turns bytes into arbitrary objects, or calls an API that does. Everything between processes
is protobuf (proto/), JSON or raw KV bytes with a protobuf header.

Excepted, and why: `llumnix/router/workers.py` starts its router workers with multiprocessing's spawn,
which pickles the worker's arguments through a pipe from the parent to its own child (no socket,
nothing another process can write to). vLLM's own processes talk among themselves over local ZeroMQ
sockets inside the engine container; that is vLLM's code, not this project's."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("llumnix", "llumlet", "operator")
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib",
                  "jsonpickle", "multiprocessing"}
UNSAFE_CALLS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized", "loads_pickle"}
"""ZeroMQ's pickling send/receive (`socket.send_pyobj`...)."""
PICKLING_LOADERS = {("torch", "load"), ("torch", "save"), ("numpy", "load"), ("np", "load")}
ALLOWED = {("llumnix/router/workers.py", "multiprocessing")}


def _product_files() -> list[Path]:
    files = [path for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))]
    return [path for path in files if "/v1/" not in str(path)]  # generated protobuf stubs


def _findings(source: str, relative: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, relative)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        for module in modules:
            top = module.split(".")[0]
            if top in UNSAFE_MODULES and (relative, top) not in ALLOWED:
                found.append(f"{relative}:{node.lineno} imports {module}")
        if isinstance(node, ast.Attribute):
            if node.attr in UNSAFE_CALLS:
                found.append(f"{relative}:{node.lineno} calls {node.attr}")
            if isinstance(node.value, ast.Name) and (node.value.id, node.attr) in PICKLING_LOADERS:
                found.append(f"{relative}:{node.lineno} calls {node.value.id}.{node.attr} (pickle inside)")
    return found


def test_the_scan_reads_the_product() -> None:
    files = {str(path.relative_to(ROOT)) for path in _product_files()}
    assert {"llumnix/engine/kv_transport_tcp.py", "llumlet/grpc_service.py", "operator/handlers.py",
            "llumnix/router/workers.py"} <= files


def test_nothing_unpickles_or_pickles() -> None:
    assert [finding for path in _product_files()
            for finding in _findings(path.read_text(), str(path.relative_to(ROOT)))] == []


def test_the_scan_would_see_a_pickle() -> None:
    sample = "import pickle\nfrom cloudpickle import loads\nsock.recv_pyobj()\ntorch.load(f)\n"
    assert len(_findings(sample, "llumnix/sample.py")) == 4
    assert _findings("import multiprocessing\n", "llumnix/router/workers.py") == []
    assert _findings("import multiprocessing\n", "llumlet/server.py") != []
