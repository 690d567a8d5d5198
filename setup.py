"""Build ferro's compiled core. Metadata lives in pyproject.toml."""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

# FERRO_DEBUG_BUILD=1 keeps assertions and adds debug symbols for valgrind and gdb.
debug = os.environ.get("FERRO_DEBUG_BUILD") == "1"
compile_args = ["-O0", "-g"] if debug else ["-O3"]

extensions = [
    Extension(
        "ferro._core.transport",
        ["ferro/_core/transport.pyx"],
        include_dirs=["ferro/_core"],
        extra_compile_args=compile_args,
        define_macros=[] if debug else [("NDEBUG", "1")],
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": "3", "embedsignature": True},
    ),
)
