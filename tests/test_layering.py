"""The package's layering rules, checked two ways: every import statement in the source (lazy
ones inside functions included), and what importing every module of a layer really loads.

- ``kvcompassd.core`` (the sans-IO discovery plane) imports nothing of the project outside it.
- ``kvcompassd.sim`` never reaches the transport (QUIC, sockets): it drives the core directly.
- ``kvcompassd.wire`` (messages and their codec) never reaches the transport either.
- The transport's sans-IO modules (``framing``, ``protocol``) import no I/O: no asyncio, sockets,
  aioquic, nor the transport's asyncio modules.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvcompassd"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names, relative ones resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            # ``from kvcompassd import wire`` names a module too.
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _layer_files(layer: str) -> list[Path]:
    root = PACKAGE / layer
    return sorted(root.rglob("*.py")) if root.is_dir() else [PACKAGE / f"{layer}.py"]


def _project_imports(path: Path) -> set[str]:
    return {m for m in _imports(path) if m == "kvcompassd" or m.startswith("kvcompassd.")}


def _is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _loaded_after_importing(layer: str) -> list[str]:
    """The project modules loaded by importing every module of ``layer``, in a fresh interpreter."""
    modules = [_module_name(p) for p in _layer_files(layer)]
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "print(json.dumps(sorted(k for k in sys.modules if k == 'kvcompassd' or k.startswith('kvcompassd.'))))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_core_imports_nothing_of_the_project_outside_it():
    offenders = {str(p.relative_to(PACKAGE.parent)): sorted(m for m in _project_imports(p)
                                                             if m != "kvcompassd" and not _is_under(m, "kvcompassd.core"))
                 for p in _layer_files("core")}
    assert {k: v for k, v in offenders.items() if v} == {}
    loaded = _loaded_after_importing("core")
    assert [m for m in loaded if m != "kvcompassd" and not _is_under(m, "kvcompassd.core")] == []


@pytest.mark.parametrize("layer", ["sim", "wire"])
def test_the_simulator_and_the_wire_never_reach_the_transport(layer):
    forbidden = ("kvcompassd.transport", "kvcompassd.daemon", "aioquic")
    direct = {str(p.relative_to(PACKAGE.parent)): sorted(m for m in _imports(p) if any(_is_under(m, f) for f in forbidden))
              for p in _layer_files(layer)}
    assert {k: v for k, v in direct.items() if v} == {}
    loaded = _loaded_after_importing(layer)
    assert [m for m in loaded if any(_is_under(m, f) for f in forbidden)] == []
    assert len(loaded) > 1  # the check did import the layer


@pytest.mark.parametrize("module", ["framing", "protocol"])
def test_the_transports_sans_io_modules_import_no_io(module):
    path = PACKAGE / "transport" / f"{module}.py"
    io = ("asyncio", "socket", "selectors", "ssl", "uvloop", "aioquic", "kvcompassd.transport.connection",
          "kvcompassd.transport.node", "kvcompassd.transport.exchange", "kvcompassd.transport.aioquic_tweaks")
    imported = _imports(path)
    assert imported  # the check did read the module
    assert sorted(m for m in imported if any(_is_under(m, f) for f in io)) == []


def test_the_checker_sees_relative_lazy_and_from_package_imports(monkeypatch):
    """The rule checks cannot pass by not seeing an import."""
    fake = PACKAGE / "core" / "__layering_probe__.py"
    source = ("def f():\n    from ..wire import encode\n    from kvcompassd import transport\n"
              "    import kvcompassd.engine.kvevents\n")
    # Parse a probe as if it sat in core, without writing into the package.
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == fake else Path.read_bytes(self).decode())
    assert _project_imports(fake) >= {"kvcompassd.wire", "kvcompassd.transport", "kvcompassd.engine.kvevents"}
