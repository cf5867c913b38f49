"""Build: the pure-Python packages plus one plain shared library, ``oxygen_torch/_oxygen.so``.

The library is C++17 with a C ABI, loaded with ``ctypes`` and by ``CUDAPluggableAllocator``. It
links neither torch nor the CUDA toolkit: ``cuda.h`` only supplies declarations, and the driver is
opened with ``dlopen("libcuda.so.1")`` at run time, so the build needs nothing but a C++ compiler.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _cuda_include_candidates():
    """Where ``cuda.h`` may be, in the order the build looks."""
    # 1. the nvidia-cuda-runtime-cu12 wheel (our build requirement), and its CUDA 13 sibling
    for mod, sub in (("nvidia.cuda_runtime", "include"), ("nvidia", "cu13/include")):
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            yield Path(loc) / sub
    # 2. a toolkit
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            yield Path(os.environ[env]) / "include"
    yield Path("/usr/local/cuda/include")


def find_cuda_include():
    tried = []
    for path in _cuda_include_candidates():
        tried.append(str(path))
        if (path / "cuda.h").is_file():
            return str(path)
    sys.exit(
        "oxygen_torch build: cuda.h not found (needed for declarations only; no GPU or toolkit "
        "is required). Install it with `pip install nvidia-cuda-runtime-cu12`, or set CUDA_HOME. "
        "Looked in: " + ", ".join(tried)
    )


class BuildSharedLib(build_ext):
    """Builds a plain shared library ``_oxygen.so`` (no Python ABI tag: it is not a module)."""

    def get_ext_filename(self, fullname):
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext):
        ext.include_dirs.append(find_cuda_include())
        super().build_extension(ext)


native = Extension(
    "oxygen_torch._oxygen",
    sources=sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp")),
    include_dirs=[str(CSRC.relative_to(ROOT))],
    language="c++",
    extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra"],
    extra_link_args=["-ldl", "-lpthread"],
    depends=sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.h")),
)

setup(
    packages=[
        "oxygen_torch",
        "oxygen_torch.pool",
        "oxygen_torch.kv",
        "oxygen_torch.compile",
        "oxygen_torch.integrations",
        "oxygen_torch.integrations.hf",
        "oxygen_torch.tools",
        "oxygen_torch.triton_kernels",
    ],
    # triton_kernels/ sits at the top level but installs as oxygen_torch.triton_kernels: the bare
    # name `triton_kernels` is taken by other published packages and would shadow them.
    package_dir={"oxygen_torch.triton_kernels": "triton_kernels"},
    ext_modules=[native],
    cmdclass={"build_ext": BuildSharedLib},
)
