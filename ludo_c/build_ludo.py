"""cffi build script (out-of-line API mode) for the Ludo C core: kvcompassd.core._ludo_cffi.

The cdef is the part of ludo.h between the CDEF-BEGIN and CDEF-END markers, so the header stays
the single source of the public API.
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SOURCES = ("ludo_wire.c", "ludo_locator.c", "ludo_table.c", "ludo_stream.c", "ludo_view.c", "ludo_export.c", "ludo_bench.c", "ludo_plan.c",
           "kvc_sha256.c", "kvc_keys.c", "kvc_forward.c", "kvc_seqlock.c", "kvc_arena.c", "kvc_kvevents.c",
           "kvc_blocktree.c", "kvc_versions.c")


# Headers whose CDEF blocks make up the cffi declarations.
HEADERS = ("ludo.h", "kvc_sha256.h", "kvc_keys.h", "kvc_forward.h", "kvc_shared.h", "kvc_arena.h", "kvc_kvevents.h",
           "kvc_blocktree.h", "kvc_versions.h")


def _cdef_text() -> str:
    parts = []
    for name in HEADERS:
        header = (HERE / name).read_text()
        start = header.index("/* CDEF-BEGIN */") + len("/* CDEF-BEGIN */")
        parts.append(header[start : header.index("/* CDEF-END */")])
    return "".join(parts)


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
    "".join(f'#include "{name}"\n' for name in HEADERS),
    sources=[_relative(HERE / name) for name in SOURCES],
    include_dirs=[_relative(HERE)],
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"],
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
