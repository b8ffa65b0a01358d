"""Builds ext_proc's native gRPC front when gRPC C++ is installed (Debian: libgrpc++-dev), and skips it otherwise.

Everything else about the package is in pyproject.toml. The front is optional: without it ext_proc serves on
grpcio's aio server (``grpc_front = "auto"`` picks whichever is there; docs/design.md, "ext_proc's gRPC fronts").
"""

from __future__ import annotations

import shlex
import subprocess
import sys

from setuptools import Extension, setup


def grpc_flags() -> tuple[list[str], list[str]] | None:
    """Compile and link flags for gRPC C++ from pkg-config; None when it (or pkg-config) is missing."""
    try:
        cflags = subprocess.run(["pkg-config", "--cflags", "grpc++"], capture_output=True, text=True, check=True)
        libs = subprocess.run(["pkg-config", "--libs", "grpc++"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return shlex.split(cflags.stdout), shlex.split(libs.stdout)


def native_front() -> list[Extension]:
    flags = grpc_flags()
    if flags is None:
        print("inferlb: gRPC C++ not found (pkg-config grpc++): ext_proc's native front is not built; "
              "ext_proc will serve on grpcio", file=sys.stderr)
        return []
    cflags, libs = flags
    return [Extension(
        "ext_proc._native_front", sources=["ext_proc/native/front.cc"], language="c++",
        extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", *cflags], extra_link_args=libs,
        optional=True,  # a failed compile leaves ext_proc on grpcio rather than failing the install
    )]


setup(ext_modules=native_front())
