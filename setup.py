"""Build script. Pure-Python today.

SEAM FOR THE CUDA EXTENSION: the kernels issue adds `speedtronic._C` here, built with
torch.utils.cpp_extension only when torch has CUDA and nvcc is found (SPEEDTRONIC_CUDA=auto|0|1);
an install without CUDA must never fail.
"""

from setuptools import setup


def extension_modules() -> tuple[list, dict]:
    """Return (ext_modules, cmdclass). Empty until the CUDA extension lands."""
    return [], {}


ext_modules, cmdclass = extension_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
