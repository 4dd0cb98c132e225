"""cffi build script (out-of-line API mode) for the Ludo C core: kvcompassd.core._ludo_cffi.

The cdef is the part of ludo.h between the CDEF-BEGIN and CDEF-END markers, so the header stays
the single source of the public API.
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SOURCES = ("ludo_wire.c", "ludo_locator.c", "ludo_table.c", "ludo_stream.c", "ludo_view.c", "ludo_export.c", "ludo_bench.c", "ludo_plan.c")


def _cdef_text() -> str:
    header = (HERE / "ludo.h").read_text()
    start = header.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
    return header[start : header.index("/* CDEF-END */")]


def _relative(path: Path) -> str:
    # setuptools wants source paths relative to the project root (the working directory).
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text())
ffibuilder.set_source(
    "kvcompassd.core._ludo_cffi",
    '#include "ludo.h"',
    sources=[_relative(HERE / name) for name in SOURCES],
    include_dirs=[_relative(HERE)],
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"],
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
