"""Building our C++ kernels: one object per source, compiled in parallel, each kept until its source, the headers,
the flags, PyTorch or the compiler change, then linked into one library.

Why: compiling the sources in one g++ call took about 100 s on a 2-core machine, on a user's first run. Now
`pip install -e .` builds the libraries into the package (setup.py runs `python -m llama.kernels.build` against
the PyTorch already installed), and a first use only builds (into $LLAMA_CACHE/kernels/) when the install could not:
no compiler then, a source edited since, another PyTorch. Either way a changed source recompiles its own object only.

    python llama/kernels/build.py [--out DIR] [--jobs N]    # both libraries into DIR (default: the package's)

It runs as a plain script too (setup.py does so before the package's dependencies are installed): it needs only
the standard library and PyTorch (tqdm for a progress bar where it is installed).
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

CSRC = Path(__file__).parent / "csrc"
PACKAGE_BUILD = Path(__file__).parent / "_build"  # what `pip install` built (git-ignored)


@dataclass(frozen=True)
class Library:
    """One shared library of ops: its sources, the headers they include, and the compiler flags."""

    name: str
    sources: Tuple[Path, ...]
    headers: Tuple[Path, ...]
    flags: Tuple[str, ...]


def compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _torch_flags() -> Tuple[List[str], List[str]]:
    """(compile flags, link flags) for the installed PyTorch."""
    import torch
    from torch.utils import cpp_extension

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    link = [a for p in cpp_extension.library_paths() for a in (f"-L{p}", f"-Wl,-rpath,{p}")]
    return [abi, *(f"-I{p}" for p in cpp_extension.include_paths())], link + ["-lc10", "-ltorch_cpu"]


def _environment(cxx: str) -> bytes:
    import torch

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return f"|{torch.__version__}|{version}|{torch._C._GLIBCXX_USE_CXX11_ABI}".encode()


def object_key(lib: Library, source: Path, env: bytes) -> str:
    h = hashlib.sha256(source.read_bytes())
    for header in lib.headers:
        h.update(header.read_bytes())
    h.update(f"|{lib.flags}".encode() + env)
    return h.hexdigest()[:20]


def library_key(lib: Library, cxx: str) -> str:
    """What the library is built from: every object's key. A library with this key is current."""
    env = _environment(cxx)
    return hashlib.sha256("|".join(object_key(lib, s, env) for s in lib.sources).encode()).hexdigest()[:24]


def _compile(cxx: str, lib: Library, source: Path, obj: Path, cflags: List[str]) -> float:
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".o", dir=obj.parent)
    os.close(fd)
    flags = [f for f in lib.flags if f != "-shared"]
    try:
        done = subprocess.run([cxx, *flags, *cflags, "-c", str(source), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, obj)  # whole or absent
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return time.perf_counter() - start


class _Lines:
    """tqdm's interface as one line per finished source, where tqdm is not installed (setup.py's build)."""

    def __init__(self, total: int, desc: str, quiet: bool):
        self.total, self.desc, self.quiet, self.done, self.note = total, desc, quiet, 0, ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set_postfix_str(self, note: str) -> None:
        self.note = note

    def update(self) -> None:
        self.done += 1
        if not self.quiet:
            print(f"{self.desc}: {self.done}/{self.total} ({self.note})", file=sys.stderr, flush=True)


def _progress(total: int, desc: str, quiet: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, desc, quiet)
    return tqdm(total=total, desc=desc, unit="file", disable=quiet, file=sys.stderr)


def build(lib: Library, out_dir: Path, cxx: str, jobs: Optional[int] = None, quiet: bool = False) -> Path:
    """out_dir/<lib.name>.so (with its key in out_dir/<lib.name>.key), compiling only the objects that are not in
    out_dir/obj/ already, `jobs` at a time (default: the CPUs), and linking them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "obj").mkdir(exist_ok=True)
    env = _environment(cxx)
    cflags, lflags = _torch_flags()
    objects = [out_dir / "obj" / f"{s.stem}-{object_key(lib, s, env)}.o" for s in lib.sources]
    todo = [(s, o) for s, o in zip(lib.sources, objects) if not o.exists()]
    start = time.perf_counter()
    if todo:
        workers = max(1, jobs or os.cpu_count() or 1)
        if not quiet:
            print(f"note: compiling {lib.name} into {out_dir}: {len(todo)} of {len(objects)} sources, {workers} at a "
                  f"time (each source's time is shown as it ends)", file=sys.stderr)
        with ThreadPoolExecutor(workers) as pool, _progress(len(todo), f"compiling {lib.name}", quiet) as bar:
            for (source, _), seconds in zip(todo, pool.map(lambda t: _compile(cxx, lib, t[0], t[1], cflags), todo)):
                bar.set_postfix_str(f"{source.name} {seconds:.0f} s")
                bar.update()
    out = out_dir / f"{lib.name}.so"
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cxx, "-shared", "-fopenmp", *map(str, objects), "-o", tmp, *lflags],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} could not link {lib.name}: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users from loading it
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    (out_dir / f"{lib.name}.key").write_text(library_key(lib, cxx))
    if not quiet and todo:
        print(f"note: {lib.name} built in {time.perf_counter() - start:.0f} s ({len(todo)} of {len(objects)} "
              f"sources compiled) into {out_dir}", file=sys.stderr)
    return out


def packaged(lib: Library, cxx: str) -> Optional[Path]:
    """The library `pip install` built into the package, where it is current (same key), else None."""
    so, key = PACKAGE_BUILD / f"{lib.name}.so", PACKAGE_BUILD / f"{lib.name}.key"
    if so.exists() and key.exists() and key.read_text().strip() == library_key(lib, cxx):
        return so
    return None


def locked_build(lib: Library, out_dir: Path, cxx: str) -> Path:
    """build() under a file lock: another process may be building the same library; a current one is reused."""
    import fcntl  # POSIX; only reached on x86 with a compiler

    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        so, key = out_dir / f"{lib.name}.so", out_dir / f"{lib.name}.key"
        if so.exists() and key.exists() and key.read_text().strip() == library_key(lib, cxx):
            return so
        return build(lib, out_dir, cxx)


# Our kernels (llama/kernels/cpu.py), and llama.cpp's arithmetic (llama/kernels/ggml_arith.py, LLAMA_GGML_ARITH=1).
# -ffp-contract=off: results are tested bit for bit, so no fused multiply-add the sources do not write.
CPU_KERNELS = Library(
    "cpu_kernels",
    tuple(CSRC / n for n in ("cpu_kernels.cpp", "decode_ops.cpp", "decode_layers.cpp", "gguf_blocks.cpp",
                             "gguf_gemm.cpp", "gguf_float.cpp", "gguf_x16.cpp")),
    tuple(CSRC / n for n in ("simd.h", "ops.h", "float_tiles.h", "int4_tiles.h", "gguf_dot.h", "gguf_format.h",
                             "gguf_simd.h", "gguf_copies.h", "gguf_gemm.h", "check.h", "gguf_x8.h", "gguf_x8_dot.h",
                             "gguf_rows.h", "gguf_krows.h")),
    ("-O3", "-std=c++20", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp", "-w"))
GGML_ARITH = Library(
    "ggml_arith",
    (CSRC / "ggml_arith.cpp", CSRC / "ggml_tiled.cpp"),
    tuple(CSRC / n for n in ("check.h", "gguf_format.h", "gguf_x8.h")),
    ("-O2", "-std=c++20", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp", "-w"))


def libraries() -> Sequence[Library]:
    return CPU_KERNELS, GGML_ARITH


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llama.kernels.build", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=PACKAGE_BUILD)
    p.add_argument("--jobs", type=int, default=None)
    a = p.parse_args(argv)
    cxx = compiler()
    if cxx is None:
        print("note: no C++ compiler: llama's CPU kernels are built at first use once one is installed",
              file=sys.stderr)
        return 0
    for lib in libraries():
        build(lib, a.out, cxx, a.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
