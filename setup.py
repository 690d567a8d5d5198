"""Build ferro's compiled core. Metadata lives in pyproject.toml."""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# FERRO_DEBUG_BUILD=1 keeps assertions and adds debug symbols for valgrind and gdb.
debug = os.environ.get("FERRO_DEBUG_BUILD") == "1"
# -fwrapv: integer reductions wrap on overflow, as NumPy's do, instead of being undefined.
compile_args = ["-O0", "-g", "-fwrapv"] if debug else ["-O3", "-fwrapv"]


def core_module(name: str) -> Extension:
    """One compiled module of ``ferro/_core``, built with the shared flags."""
    return Extension(
        f"ferro._core.{name}",
        [f"ferro/_core/{name}.pyx"],
        include_dirs=["ferro/_core"],
        extra_compile_args=compile_args,
        libraries=["m"],
        define_macros=[] if debug else [("NDEBUG", "1")],
    )


extensions = [core_module(name) for name in ("state", "status", "transport", "reduce", "direct", "collectives", "shm", "arena", "foreign")]
cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class ParallelBuildExt(build_ext):
    """Compile the modules side by side, one per core, unless ``--parallel`` / ``-j`` says otherwise."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = cores


setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": "3", "embedsignature": True},
        # C from Cython for the nine modules, side by side as well.
        nthreads=cores,
    ),
    cmdclass={"build_ext": ParallelBuildExt},
)
