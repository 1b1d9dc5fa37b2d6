"""The peers the suite compares against, installed before it runs: tests never download.

`python tests/peers.py` (which `.ci/run` calls) does, once per machine:
- fetches llama-cpp-python's source distribution (pinned VERSION) from the package registry with pip, and
  unpacks it in PEERS (`$LLAMA_PEERS`, default `~/.cache/llama/peers/`). Its llama.cpp tree holds the files the
  tests read: convert_hf_to_gguf.py with gguf-py, the chat templates of real models (models/templates/), the
  tokenizer test vocabularies (models/ggml-vocab-*) and src/llama-vocab.cpp;
- builds and installs llama-cpp-python from that sdist with this CPU's vector extensions and AMX off (ggml's AMX
  path crashes in these VMs; docs/performance.md). `--no-build` skips this step.

A test that needs the tree and finds none skips with the command to run; under LLAMA_CI=1 that skip fails.
"""

import argparse
import os
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"


def peers_dir() -> Path:
    if os.environ.get("LLAMA_PEERS"):
        return Path(os.environ["LLAMA_PEERS"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama" / "peers"


def sdist_root() -> Path:
    return peers_dir() / f"llama_cpp_python-{VERSION}"


def llama_cpp_tree() -> Path:
    """llama.cpp's source tree inside the unpacked sdist (skips, with the command that fetches it, when absent)."""
    root = sdist_root() / "vendor" / "llama.cpp"
    if not (root / "convert_hf_to_gguf.py").is_file():
        import pytest

        pytest.skip(f"llama.cpp's tree from llama-cpp-python {VERSION}'s sdist is not in {peers_dir()}: run "
                    "`python tests/peers.py` once (.ci/run does)")
    return root


def templates() -> Path:
    """Real models' chat templates as llama.cpp keeps them (models/templates/), fetched from each model's
    Hugging Face tokenizer_config.json by llama.cpp's scripts/get_chat_template.py."""
    return llama_cpp_tree() / "models" / "templates"


def template(name: str) -> str:
    """The text of one of those templates, e.g. template("Qwen-Qwen3-0.6B.jinja")."""
    return (templates() / name).read_text(encoding="utf-8")


def cmake_args(flags: set) -> str:
    """ggml's build options for this CPU: its vector extensions named one by one (not -march=native, which would
    turn AMX on where the CPU has it), AMX off; no multimodal library (llava/mtmd: no test uses it, and it is a
    third of the build)."""
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAVA_BUILD=OFF"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        args += [f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}"
                 for name, flag in (("AVX", "avx"), ("AVX2", "avx2"), ("FMA", "fma"), ("F16C", "f16c"),
                                    ("AVX512", "avx512f"), ("AVX512_VNNI", "avx512_vnni"),
                                    ("AVX512_BF16", "avx512_bf16"))]
    return " ".join(args)


def fetch() -> Path:
    """Download the sdist with pip (a registry download) and unpack it whole into PEERS."""
    if (sdist_root() / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        return sdist_root()
    peers_dir().mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                    f"llama-cpp-python=={VERSION}", "-d", str(peers_dir())], check=True)
    sdist = peers_dir() / f"llama_cpp_python-{VERSION}.tar.gz"
    with tarfile.open(sdist) as tar:
        tar.extractall(peers_dir(), filter="data")
    sdist.unlink()
    return sdist_root()


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        return ""


def build() -> None:
    """pip install the unpacked sdist with cmake_args(); nothing when this version is installed already."""
    if installed_version() == VERSION:
        print(f"llama-cpp-python {VERSION} is installed already")
        return
    from llama.kernels.cpu import cpu_flags  # the package is installed before the peers

    env = {**os.environ, "CMAKE_ARGS": cmake_args(cpu_flags()), "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())}
    print(f"building llama-cpp-python {VERSION} from source with CMAKE_ARGS={env['CMAKE_ARGS']!r}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", str(sdist_root())], env=env, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-build", action="store_true", help="only fetch and unpack the sdist")
    args = ap.parse_args()
    start = time.monotonic()
    print(f"llama.cpp's tree: {fetch() / 'vendor' / 'llama.cpp'}", flush=True)
    if not args.no_build:
        build()
    print(f"peers ready in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
