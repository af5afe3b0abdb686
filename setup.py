"""Build the optional C++ (pybind11) helpers in csrc/.

Every extension is optional: when a compiler or pybind11 is missing the build of that extension is skipped with a
warning, and the Python code falls back to its NumPy implementation.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - a failed optional build must not fail the install
            print(f"WARNING: C++ extensions not built ({exc}); NumPy fallbacks will be used", file=sys.stderr)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"WARNING: extension {ext.name} not built ({exc}); its NumPy fallback will be used", file=sys.stderr)


# Extension module -> C++ source.  Each module has a typed Python wrapper with a NumPy fallback.
CPP_EXTENSIONS: dict[str, str] = {
    "zb_pipeline.schedule._zb_auto_cpp": "csrc/zb_auto_search.cpp",
    "zb_pipeline.schedule._v_shape_cpp": "csrc/v_shape_passes.cpp",
    "megatron.data._helpers_cpp": "csrc/dataset_helpers.cpp",
}


def extensions() -> list:
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        print("WARNING: pybind11 not found; C++ extensions skipped", file=sys.stderr)
        return []
    return [
        Pybind11Extension(name, [src], cxx_std=17, extra_compile_args=["-O3"])
        for name, src in CPP_EXTENSIONS.items()
        if os.path.exists(src)
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
