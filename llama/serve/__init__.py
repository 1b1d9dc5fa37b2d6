"""An OpenAI-compatible HTTP server over the continuous-batching engine: `python -m llama.serve --ckpt_dir ...`
(docs/serving.md). Needs the `serve` extra: pip install -e '.[serve]'."""

from llama.serve.app import create_app

__all__ = ["create_app"]
