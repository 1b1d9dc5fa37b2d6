"""An OpenAI-compatible HTTP server over the continuous-batching engine: `python -m llama.serve --ckpt_dir ...`
(docs/serving.md), its app in llama/serve/app.py (`create_app`). Needs the `serve` extra: pip install -e '.[serve]'.
Imports nothing, so its modules may import each other through the package without a cycle."""
