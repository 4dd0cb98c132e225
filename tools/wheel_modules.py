"""Load one module of an engine's wheel without the engine: the capture tools'
(``capture_engine_events.py``, ``capture_engine_loads.py``) way of running the engines' own code
on a machine without torch, the modules it imports for other work replaced by stubs."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
import zipfile
from pathlib import Path
from typing import Any


def stub_module(name: str, **attrs: Any) -> types.ModuleType:
    """A module named ``name`` holding ``attrs``, registered in ``sys.modules``."""
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def load_from_wheel(wheel: Path, inner: str, name: str, tmp: Path) -> types.ModuleType:
    """Execute ``inner`` (a path inside ``wheel``) as the module ``name``."""
    with zipfile.ZipFile(wheel) as z:
        source = z.read(inner)
    path = tmp / f"{name.replace('.', '_')}.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def wheel_version(wheel: Path) -> str:
    """The version a wheel's ``.dist-info`` names."""
    with zipfile.ZipFile(wheel) as z:
        return next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")).split("-")[1].split(".dist")[0]


def sglang_capture_args(doc: str, out: Path) -> argparse.Namespace:
    """A capture tool's command line: ``--sglang-wheel`` (required) and ``--out`` (``out``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sglang-wheel", type=Path, required=True)
    p.add_argument("--out", type=Path, default=out)
    return p.parse_args()
