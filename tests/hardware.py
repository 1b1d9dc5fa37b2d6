"""The one kind of skip the suite allows: missing hardware (no GPU, no AVX-512, no second machine, not x86-64).
Such a skip's reason starts with "hardware:"; under LLAMA_CI=1 (set by .ci/run) conftest turns every other skip
into a failure, so a broken build, a missing peer or a missing ../shared cannot hide behind skips in CI.

`needs(ok, what)` marks a test or module; `skip(what)` skips from inside a test."""

import platform
import shutil

import pytest

from llama.kernels import cpu
PREFIX = "hardware:"


def needs(ok: bool, what: str):
    """A skipif mark for hardware this machine lacks: `what` says what the test needs."""
    return pytest.mark.skipif(not ok, reason=f"{PREFIX} needs {what}")


def skip(what: str):
    pytest.skip(f"{PREFIX} {what}")


def allowed(reason: str) -> bool:
    return reason.startswith(PREFIX)


FLAGS = cpu.cpu_flags()
X86 = platform.machine().lower() in ("x86_64", "amd64")
CXX = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
# Where our kernels can exist at all; there a build or load error is a failure, never a hardware skip.
KERNEL_HOST = X86 and {"avx2", "fma", "f16c"} <= FLAGS and CXX is not None
VNNI = "avx512_vnni" in FLAGS
AVX512_BF16 = "avx512_bf16" in FLAGS


def _kernels_mark():
    if cpu.available():
        return pytest.mark.skipif(False, reason="")
    if KERNEL_HOST and cpu.enabled():
        return pytest.mark.skipif(True, reason="our CPU kernels failed to build or load on this x86-64 machine with "
                                               "a compiler: tests/kernels/test_build.py shows the compiler's message")
    if not cpu.enabled():
        return pytest.mark.skipif(True, reason="our CPU kernels are switched off (LLAMA_CPU_KERNELS=0)")
    return pytest.mark.skipif(True, reason=f"{PREFIX} our CPU kernels need x86-64 with AVX2, FMA and F16C and a "
                                           "C++ compiler")


# Tests of our CPU kernels: a skip only where they cannot exist.
KERNELS = _kernels_mark()


def require_kernels() -> None:
    """Inside a test or fixture: skip as KERNELS does when our kernels are not loaded."""
    if KERNELS.args[0]:
        pytest.skip(KERNELS.kwargs["reason"])
