"""Build the Cython data path in native/ into mooncake_plugins._native.*, and the NIXL
backend plugin (native/nixl) into mooncake_plugins/nixl/libplugin_MOONCAKE.so.

``MOONCAKE_PUREPYTHON=1`` skips the extensions (the Python fallbacks are used); otherwise
every extension is built or the install fails. The NIXL plugin is skipped with a printed
reason where no C++20 compiler works.
"""

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

NATIVE = ["buffers", "tcp", "shm", "fast_copy", "cuda", "verbs"]
# Extra libraries per module. cuda and verbs link no CUDA or RDMA library and read no
# system header of theirs: they dlopen libcuda.so.1 / libibverbs.so.1 at first use (libdl
# for glibc < 2.34), verbs with our own declarations of the verbs ABI
# (native/verbs_abi.h), so one wheel serves machines with or without CUDA or RDMA.
LIBRARIES: dict[str, list[str]] = {"cuda": ["dl"], "verbs": ["dl"]}


def _extensions():
    if sys.implementation.name != "cpython":
        print("mooncake_plugins: pure-Python build (no native extensions, no NIXL plugin)")
        return []
    if os.environ.get("MOONCAKE_PUREPYTHON") == "1":
        print("mooncake_plugins: pure-Python data path (no Cython extensions)")
        return _nixl_plugin()
    from Cython.Build import cythonize
    from setuptools import Extension

    exts = [
        Extension(f"mooncake_plugins._native.{name}", [f"native/{name}.pyx"],
                  include_dirs=["native"], define_macros=[("_GNU_SOURCE", "1")],
                  extra_compile_args=["-O2"], libraries=LIBRARIES.get(name, []))
        for name in NATIVE
    ]
    print("mooncake_plugins: accelerated build:", ", ".join(NATIVE))
    return cythonize(exts, include_path=["native"], language_level=3, quiet=True) + _nixl_plugin()


NIXL_PLUGIN = "mooncake_plugins.nixl.libplugin_MOONCAKE"


def _nixl_plugin():
    """The NIXL backend plugin: plain C++20 against our own declarations of NIXL's plugin
    ABI (native/nixl/nixl_abi.h), so it builds with no NIXL installed."""
    from setuptools import Extension

    return [Extension(NIXL_PLUGIN, ["native/nixl/plugin.cpp"], language="c++",
                      include_dirs=["native/nixl"],
                      extra_compile_args=["-std=c++20", "-O2", "-fvisibility=hidden"])]


class BuildExt(build_ext):
    """build_ext that names the NIXL plugin as NIXL requires (``libplugin_<NAME>.so``, no
    Python ABI tag), and skips it with a clear line where the C++ compiler lacks C++20."""

    def get_ext_filename(self, fullname):
        # called with the full dotted name, and with its last part alone
        if fullname in (NIXL_PLUGIN, NIXL_PLUGIN.rpartition(".")[2]):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extension(self, ext):
        if ext.name == NIXL_PLUGIN and not self._cxx20():
            print("mooncake_plugins: NOT building the NIXL plugin: the C++ compiler does not "
                  "take -std=c++20 (install g++ >= 10 and reinstall for NIXL support)")
            return
        super().build_extension(ext)

    def _cxx20(self) -> bool:
        import tempfile

        from setuptools.errors import CompileError
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp, "probe.cpp")
            src.write_text("#include <concepts>\nstatic_assert(std::same_as<int, int>);\n")
            try:
                self.compiler.compile([str(src)], output_dir=tmp,
                                      extra_postargs=["-std=c++20"])
            except CompileError:
                return False
        return True


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
