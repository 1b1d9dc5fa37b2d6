"""llama/kernels/build.py: one object per source, compiled in parallel and kept until something it depends on
changes; the package's own build (pip install) is used where current, the cache's otherwise."""

import os
import platform
from pathlib import Path

import pytest

from llama.kernels import build
from llama.kernels import cpu
CXX = build.compiler()
needs_compiler = pytest.mark.skipif(CXX is None, reason="hardware: no C++ compiler on this machine")


def tiny_library(tmp_path: Path) -> build.Library:
    """Two sources and a header, no torch includes: compiles in a second."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.h").write_text("int twice(int x);\n")
    (tmp_path / "src" / "a.cpp").write_text('#include "a.h"\nint twice(int x) { return 2 * x; }\n')
    (tmp_path / "src" / "b.cpp").write_text('#include "a.h"\nextern "C" int four(void) { return twice(2); }\n')
    src = tmp_path / "src"
    return build.Library("tiny", (src / "a.cpp", src / "b.cpp"), (src / "a.h",), ("-O0", "-fPIC", "-shared"))


def call_four(so: Path, tmp_path: Path) -> int:
    """four() from a fresh copy of the library (dlopen returns an already loaded path's old handle)."""
    import ctypes
    import shutil
    import uuid

    copy = tmp_path / f"{uuid.uuid4().hex}.so"
    shutil.copy(so, copy)
    return ctypes.CDLL(str(copy)).four()


def counting(monkeypatch) -> list:
    compiled = []
    real = build._compile
    monkeypatch.setattr(build, "_compile", lambda cxx, lib, source, obj, flags: compiled.append(source.name) or
                        real(cxx, lib, source, obj, flags))
    return compiled


@needs_compiler
def test_each_source_compiles_once_and_a_change_recompiles_only_its_object(tmp_path, monkeypatch):
    lib, out = tiny_library(tmp_path), tmp_path / "out"
    compiled = counting(monkeypatch)
    so = build.build(lib, out, CXX, jobs=2, quiet=True)
    assert sorted(compiled) == ["a.cpp", "b.cpp"] and call_four(so, tmp_path) == 4
    compiled.clear()
    build.build(lib, out, CXX, quiet=True)
    assert compiled == []  # nothing changed: link only
    lib.sources[0].write_text('#include "a.h"\nint twice(int x) { return x + x + 1; }\n')
    build.build(lib, out, CXX, quiet=True)
    assert compiled == ["a.cpp"]
    assert call_four(so, tmp_path) == 5
    lib.headers[0].write_text("int twice(int x);  // a header change recompiles every source\n")
    compiled.clear()
    build.build(lib, out, CXX, quiet=True)
    assert sorted(compiled) == ["a.cpp", "b.cpp"]


@needs_compiler
def test_a_compile_error_names_the_source_and_the_compiler_s_message(tmp_path):
    lib = tiny_library(tmp_path)
    lib.sources[1].write_text("int broken( {\n")
    with pytest.raises(RuntimeError, match=r"failed on b\.cpp: .*error"):
        build.build(lib, tmp_path / "out", CXX, quiet=True)


@needs_compiler
def test_the_package_build_is_used_only_while_current(tmp_path, monkeypatch):
    lib = tiny_library(tmp_path)
    monkeypatch.setattr(build, "PACKAGE_BUILD", tmp_path / "package")
    assert build.packaged(lib, CXX) is None  # nothing built at install
    so = build.build(lib, tmp_path / "package", CXX, quiet=True)
    assert build.packaged(lib, CXX) == so
    lib.sources[1].write_text('#include "a.h"\nextern "C" int four(void) { return twice(2) + 0; }\n')
    assert build.packaged(lib, CXX) is None  # a source edited since the install: the cache builds instead
    compiled = counting(monkeypatch)
    cached = build.locked_build(lib, tmp_path / "cache", CXX)
    assert cached.exists() and sorted(compiled) == ["a.cpp", "b.cpp"]
    compiled.clear()
    assert build.locked_build(lib, tmp_path / "cache", CXX) == cached and compiled == []


x86 = platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma", "f16c"} <= cpu.cpu_flags()


@pytest.mark.skipif(not (x86 and CXX), reason="hardware: our kernels need x86-64 with AVX2/FMA/F16C and a compiler")
def test_the_kernels_load_wherever_x86_64_and_a_compiler_exist():
    """A build error must fail the suite, not turn the kernels' tests into skips: build them here and show the
    compiler's message if it fails."""
    if cpu.enabled() and not cpu.available():
        path = build.locked_build(build.CPU_KERNELS, cpu.cache_dir() / "kernels" / "cpu", CXX)  # raises
        pytest.fail(f"the kernels built ({path}) but did not load")
    assert cpu.available() or not cpu.enabled()


@pytest.mark.skipif(os.environ.get("LLAMA_CI") != "1", reason="checks what `bash .ci/run`'s pip install built "
                                                             "(under LLAMA_CI=1 only)")
@pytest.mark.skipif(not (x86 and CXX), reason="hardware: our kernels need x86-64 with AVX2/FMA/F16C and a compiler")
def test_the_install_built_the_kernels_into_the_package():
    assert build.packaged(build.CPU_KERNELS, CXX) is not None, "pip install -e . did not build the kernels"
    assert build.packaged(build.GGML_ARITH, CXX) is not None
