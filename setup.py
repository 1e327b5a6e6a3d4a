"""Builds verispec's C++ CPU kernels (src/verispec/csrc) as a PyTorch extension, verispec._C.

Everything else about the package lives in pyproject.toml. The kernels are compiled against the torch
already installed, so install with `pip install --no-build-isolation ...` (see README): an isolated build
would fetch a second torch (on PyPI, a multi-GB CUDA build). Without torch at build time the package
installs without the kernels and runs on PyTorch's own operators (slower drafts), saying so once.
"""

from pathlib import Path

from setuptools import setup

CSRC = Path("src/verispec/csrc")

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # isolated build without torch: pure-Python install
    print("verispec: torch not importable at build time; building without the C++ kernels "
          "(install with --no-build-isolation to get them)")
    setup()
else:
    setup(
        ext_modules=[CppExtension(
            "verispec._C",
            sources=sorted(str(p) for p in CSRC.glob("*.cpp")),
            # OpenMP: at::parallel_for splits output tiles over cores. -fno-trapping-math lets loops with float
            # compares and selects vectorize (exp, clamps); values are unchanged (no -ffast-math reassociation).
            extra_compile_args=["-O3", "-fopenmp", "-fno-trapping-math"],
            extra_link_args=["-fopenmp"],
        )],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )
