"""Build of the optional compiled fingerprint kernel (v2); everything else is in pyproject.toml.

The kernel is optional: where no C compiler is available the build goes on without it and
unickpt computes the same fingerprints with numpy (about 2 to 3x slower).
"""

import sys

from setuptools import Extension, setup

args = [] if sys.platform == "win32" else ["-O3", "-std=c99", "-Wall", "-Wno-unused-function"]

setup(
    ext_modules=[
        Extension(
            "unickpt.spec._fp2kernel",
            sources=["unickpt/spec/_fp2kernel.c"],
            extra_compile_args=args,
            optional=True,
        ),
    ]
)
