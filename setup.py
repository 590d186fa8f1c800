"""Build the Cython data path in native/ into mooncake_plugins._native.*.

``MOONCAKE_PUREPYTHON=1`` skips the extensions (the Python fallbacks are used), and an
optional module whose system headers are missing is skipped with a printed reason.
"""

import os
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
NATIVE = ["buffers", "tcp", "shm", "fast_copy", "cuda"]
# Extra libraries per module. cuda links no CUDA library and reads no CUDA header: it
# dlopens libcuda.so.1 at first use (libdl for glibc < 2.34), so one wheel serves machines
# with or without CUDA, and any CUDA 12 or 13 driver.
LIBRARIES: dict[str, list[str]] = {"cuda": ["dl"]}
# Optional modules: name -> header that must exist for it to build.
OPTIONAL: dict[str, str] = {}


def _extensions():
    if os.environ.get("MOONCAKE_PUREPYTHON") == "1" or sys.implementation.name != "cpython":
        print("mooncake_plugins: pure-Python build (no native extensions)")
        return []
    from Cython.Build import cythonize
    from setuptools import Extension

    names = list(NATIVE)
    for name, header in OPTIONAL.items():
        if Path(header).exists():
            names.append(name)
        else:
            print(f"mooncake_plugins: skipping native module {name!r}: {header} not found")
    exts = [
        Extension(f"mooncake_plugins._native.{name}", [f"native/{name}.pyx"],
                  define_macros=[("_GNU_SOURCE", "1")], extra_compile_args=["-O2"],
                  libraries=LIBRARIES.get(name, []))
        for name in names
    ]
    print("mooncake_plugins: accelerated build:", ", ".join(names))
    return cythonize(exts, include_path=["native"], language_level=3, quiet=True)


setup(ext_modules=_extensions())
