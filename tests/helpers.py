"""Shared test helpers: prompts of stories260K's goldens, and processors that pin a model's output."""

import contextlib

ONCE = "Once upon a time"
LILY = "Lily and Ben went to the park"
REPLACEMENT = "\ufffd"
SAMPLED = dict(temperature=1.0, top_p=1.0, max_gen_len=48)


def forcing(seq, eos_id):
    """A logits processor that forces `seq`, then EOS: makes a random model's output fully determined."""
    import torch

    def proc(ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[seq[len(ids)] if len(ids) < len(seq) else eos_id] = 0.0
        return out
    return proc


def continuation(tok, context, generated):
    """Text the generated tokens add after the context: what completion and streaming must both return."""
    return tok.decode(context + generated)[len(tok.decode(context)):]


def check_stream(deltas, final):
    assert "".join(deltas) == final
    if REPLACEMENT not in final:
        assert not any(REPLACEMENT in d for d in deltas), deltas


def build_stories(max_batch_size=4, max_seq_len=256):
    """A fresh stories260K generator (for tests that need other cache sizes than conftest's `stories`)."""
    from conftest import STORIES, need

    from llama import Llama

    need(STORIES / "consolidated.00.pth")
    return Llama.build(str(STORIES), str(STORIES / "tokenizer.model"), max_seq_len=max_seq_len,
                       max_batch_size=max_batch_size)


def hf_permute(w, n_heads):
    """transformers' convert_llama_weights_to_hf permute(): interleaved rotary pairs -> rotate-half halves."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


HF_LAYER_NAMES = {"attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
                  "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
                  "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
                  "ffn_norm.weight": "post_attention_layernorm.weight"}


def meta_to_hf(meta, n_layers, n_heads, n_kv_heads, tied=False):
    """A Meta-layout state dict in transformers' names and q/k layout (lm_head left out when tied)."""
    hf = {"model.embed_tokens.weight": meta["tok_embeddings.weight"], "model.norm.weight": meta["norm.weight"]}
    if not tied:
        hf["lm_head.weight"] = meta["output.weight"]
    for i in range(n_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        hf[p + "self_attn.q_proj.weight"] = hf_permute(meta[m + "attention.wq.weight"], n_heads)
        hf[p + "self_attn.k_proj.weight"] = hf_permute(meta[m + "attention.wk.weight"], n_kv_heads)
        for name, hf_name in HF_LAYER_NAMES.items():
            hf[p + hf_name] = meta[m + name]
    return hf


GGUF_NAMES = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
              "output.weight": "output.weight", "attention.wq.weight": "attn_q.weight",
              "attention.wk.weight": "attn_k.weight", "attention.wv.weight": "attn_v.weight",
              "attention.wo.weight": "attn_output.weight", "feed_forward.w1.weight": "ffn_gate.weight",
              "feed_forward.w2.weight": "ffn_down.weight", "feed_forward.w3.weight": "ffn_up.weight",
              "attention_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight"}


def add_sentencepiece_vocab(w, sp, unk: bool = True) -> None:
    """A sentencepiece model's vocabulary as llama.cpp's converter writes it ('llama': pieces, scores, types)."""
    n = sp.vocab_size()
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1
                       for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    if unk:
        w.add_unk_token_id(sp.unk_id())


def write_meta_gguf(path, state, params, sp_model_path, quant=None, vocab_only=False):
    """A GGUF file as llama.cpp's converter writes a Meta checkpoint: Meta's q/k row order, a sentencepiece
    ('llama') vocabulary with scores and token types, 2-D weights optionally quantized (e.g. "Q8_0") where their
    rows split into whole blocks, the others F32 (as llama.cpp falls back)."""
    import gguf
    import numpy as np
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model_path))
    w = gguf.GGUFWriter(str(path), "llama")
    if not vocab_only:
        dim, heads = params["dim"], params["n_heads"]
        w.add_context_length(2048)
        w.add_embedding_length(dim)
        w.add_block_count(params["n_layers"])
        w.add_feed_forward_length(state["layers.0.feed_forward.w1.weight"].shape[0])
        w.add_head_count(heads)
        w.add_head_count_kv(params.get("n_kv_heads", heads))
        w.add_layer_norm_rms_eps(params["norm_eps"])
        w.add_rope_freq_base(params.get("rope_theta", 10000.0))
        w.add_rope_dimension_count(dim // heads)
    add_sentencepiece_vocab(w, sp)
    for name, t in ({} if vocab_only else state).items():
        parts = name.split(".")
        gname = (GGUF_NAMES[name] if parts[0] != "layers"
                 else f"blk.{parts[1]}.{GGUF_NAMES['.'.join(parts[2:])]}")
        values = t.float().numpy()
        qtype = gguf.GGMLQuantizationType[quant] if quant is not None else None
        if qtype is not None and values.ndim == 2 and values.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            w.add_tensor(gname, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(values, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class Gate:
    """A logits processor that holds generation once a sequence has `after` tokens, until open(): a test sees a
    request mid-generation however fast the machine is, instead of racing it."""

    def __init__(self, after: int = 1, timeout: float = 120.0):
        import threading

        self.after, self.timeout = after, timeout
        self.reached, self.opened = threading.Event(), threading.Event()

    def __call__(self, ids, logits):
        if len(ids) >= self.after and not self.opened.is_set():
            self.reached.set()
            if not self.opened.wait(self.timeout):
                raise TimeoutError(f"the test did not open the gate within {self.timeout} s")
        return logits

    def open(self) -> None:
        self.opened.set()


class GatedServer:
    """The server's app (create_app) over a Llama in this process, served by uvicorn in a thread, with `gate`
    added to every request's logits processors; `requests` are the engine requests it submitted."""

    def __init__(self, gen, gate: Gate, model_name: str = "stories", api_keys=()):
        import threading
        import time
        import urllib.request

        import uvicorn
        from serve_util import free_port

        from llama.serve.app import create_app

        self.gate, self.requests = gate, []
        make_engine = gen.engine

        def engine(**kw):
            e = make_engine(**kw)
            submit = e.submit_samples

            def submit_samples(prompt, n, **params):
                params["logits_processors"] = (*params.get("logits_processors", ()), gate)
                reqs = submit(prompt, n, **params)
                self.requests.extend(reqs)
                return reqs

            e.submit_samples = submit_samples
            return e

        gen.engine = engine
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        app = create_app(lambda: gen, model_name, list(api_keys))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("the in-process server did not become healthy in time")
            time.sleep(0.05)

    def close(self) -> None:
        self.gate.open()  # a held engine thread would keep the shutdown waiting
        self.server.should_exit = True
        self.thread.join(30)


def draft_tally(patch):
    """Drafted and accepted tokens over every Speculator (a Counter), so a test can show its drafts were accepted;
    patch(obj, name, value) installs the counting wrapper (monkeypatch.setattr, or setattr in a subprocess)."""
    import collections

    from llama.core.speculation import speculative

    counts = collections.Counter()
    orig = speculative.Speculator.accepted

    def accepted(self, r, draft, n):
        counts["drafted"] += len(draft)
        counts["accepted"] += n
        return orig(self, r, draft, n)

    patch(speculative.Speculator, "accepted", accepted)
    return counts


def two_rank_stories(tmp_path, script: str, prompts) -> dict:
    """Run `script` under torchrun on 2 ranks with stories260K resharded in two; its argv: the shards, the tokenizer,
    the JSON file rank 0 writes, the prompts as JSON. Returns what rank 0 wrote."""
    import json
    import subprocess
    import sys

    import pytest
    from conftest import STORIES, rank_env

    from llama.formats.reshard import reshard

    if not (STORIES / "consolidated.00.pth").is_file():
        pytest.skip(f"shared stories260K model not found under {STORIES.parent.parent}")
    reshard(STORIES, tmp_path / "two", 2)
    (tmp_path / "run.py").write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "run.py"), str(tmp_path / "two"), str(STORIES / "tokenizer.model"),
           str(tmp_path / "out.json"), json.dumps(prompts)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=rank_env(3), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())


def logprobs_in_any_company(llm, prompts, opts, longer: str) -> tuple:
    """((tokens, logprobs) of each prompt alone on a cold cache, the same in one batch, in reverse from the blocks
    that batch cached, and through the engine in chunks of 5 beside `longer`): the caller asserts they are equal."""
    pick = lambda results: [(r["tokens"], r["logprobs"]) for r in results]  # noqa: E731
    alone = []
    for p in prompts:
        llm.clear_prefix_cache()
        alone += pick(llm.text_completion([p], **opts))
    llm.clear_prefix_cache()
    batch = pick(llm.text_completion(prompts, **opts))
    cached = pick(llm.text_completion(prompts[::-1], **opts))[::-1]
    with llm.engine(prefill_chunk=5) as engine:
        reqs = [engine.submit(p, **opts) for p in [longer] + list(prompts)]
        chunked = pick([r.result(timeout=120) for r in reqs[1:]])
    return alone, batch, cached, chunked


def assert_verify_rows_are_decode_steps(g, tag=()):
    """Each row of a 1..8-row Verify pass of `g` (a built Llama, prefix cache off) after a 20-token prompt gives
    exactly the logits of the one-token Decode step at its position: what speculation's exactness needs."""
    import torch

    from llama.core.scheduling.plan import Decode, Prefill, SetBlocks, Verify

    prompt = list(range(100, 120))
    feed = torch.randint(3, g.model.params.vocab_size, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    with g.cache.hold():
        blocks = [g.cache.pool.allocate(4)]
        g.runner.execute([SetBlocks(rows=[0], blocks=blocks),
                          Prefill(tokens=[prompt], start=0, rows=[0], last=[len(prompt) - 1], kv_len=len(prompt))])
        want = [g.runner.execute([Decode(tokens=[t], pos=[len(prompt) + i], active=[0])])[0][0]
                for i, t in enumerate(feed)]
        for rows in range(1, 9):
            got = g.runner.execute([Verify(tokens=feed[:rows], pos=[len(prompt) + i for i in range(rows)],
                                           rows=[0] * rows)])[0]
            for i in range(rows):
                assert torch.equal(got[i], want[i]), (*tag, rows, i, (got[i] - want[i]).abs().max().item())
        g.cache.pool.release(blocks[0])


def block_quantized(x):
    """x's codes times their block's scale, in float64, as our int8/int4 kernels quantize activations: blocks of 32,
    scale amax / 127 (fp32), codes rounded half to even."""
    import torch

    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0)
    return (codes.double() * d.double()).view(m, k)


def assert_rows_batch_invariant(product, x):
    """product(x[a:b]) is bitwise each row's product alone, for every leading and trailing batch of 2..len(x) rows."""
    import torch

    n = x.shape[0]
    alone = torch.cat([product(x[i : i + 1]) for i in range(n)])
    for m in range(2, n + 1):
        assert torch.equal(product(x[:m]), alone[:m]), f"{m} rows"
        assert torch.equal(product(x[n - m :]), alone[n - m :]), f"the last {m} rows"


# Qwen3's added tokens from id 151643 (its tokenizer.json): (text, special). <think>, <tool_call>, <tool_response>
# and their closings are not special: they decode as the text the reply holds.
QWEN3_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
               ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
               ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
               ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
               ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
               ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
               ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False)]


def write_qwen3_tokenizer(d):
    """Qwen3's tokenizer as its tokenizer.json and tokenizer_config.json have it, in d: the Qwen2 BPE vocabulary
    llama.cpp tests with (models/ggml-vocab-qwen2.gguf, 151936 ids), its padding ids from 151643 named as Qwen3's
    added tokens, and Qwen3's real chat template (models/templates/Qwen-Qwen3-0.6B.jinja); no BOS, EOS
    <|im_end|>. Returns the tokenizer.json's path. Both trees come from llama-cpp-python's sdist (tests/peers.py)."""
    import json
    import warnings
    from pathlib import Path

    import peers

    from llama.formats.gguf_file import open_reader
    from llama.tokenizers import huggingface

    path = peers.llama_cpp_tree() / "models" / "ggml-vocab-qwen2.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = json.loads(huggingface.from_gguf(open_reader(path), path).tok.to_str())
    vocab, added = spec["model"]["vocab"], {a["id"]: a for a in spec["added_tokens"]}
    names = {i: t for t, i in vocab.items()}
    for k, (text, special) in enumerate(QWEN3_ADDED):
        i = 151643 + k
        del vocab[names[i]]
        vocab[text] = i
        added[i].update(content=text, special=special)
    d = Path(d)
    (d / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": peers.template("Qwen-Qwen3-0.6B.jinja")}))
    return d / "tokenizer.json"


def build_qwen3_chat(d, max_seq_len: int = 1024, max_batch_size: int = 2):
    """A random-weight Llama-architecture model (dim 64, two layers) over write_qwen3_tokenizer's vocabulary:
    what the chat template, the reasoning split and the tool-call parsing see of a Qwen3 model."""
    from llama import Llama
    from llama.hub.demo import write_random_checkpoint

    tokenizer = write_qwen3_tokenizer(d)
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "norm_eps": 1e-6,
              "vocab_size": 151936}
    write_random_checkpoint(d / "ckpt", params)
    return Llama.build(str(d / "ckpt"), str(tokenizer), max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                       compile=False)



def rewrite_gguf(src, dst, tensors, fields=None) -> None:
    """A copy of the GGUF file src at dst: every metadata key as it is (those in `fields`: that value, same type),
    and the tensors `tensors(reader)` yields as (name, array, ggml type)."""
    from pathlib import Path

    import gguf
    import numpy as np

    from llama.formats import gguf_file
    reader = gguf_file.open_reader(Path(src))
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = f.types[0]
        sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, (fields or {}).get(key, f.contents()), kind, sub_type=sub)
    for name, data, qtype in tensors(reader):
        w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def first_layers_gguf(src, dst, layers: int) -> None:
    """The GGUF file src cut to its first `layers` blocks at dst: block_count and the blk.N tensors change, every
    other key and tensor is copied as it is (quantized ones in their blocks). A real model's file that llama.cpp's
    quantizer goes through several times faster."""
    import re

    def first(reader):
        for t in reader.tensors:
            m = re.match(r"blk\.(\d+)\.", t.name)
            if m is None or int(m.group(1)) < layers:
                yield t.name, t.data, t.tensor_type

    from pathlib import Path

    from llama.formats import gguf_file
    arch = gguf_file.open_reader(Path(src)).fields["general.architecture"].contents()
    rewrite_gguf(src, dst, first, {f"{arch}.block_count": layers})


# A new process's peak RSS growth (VmHWM) loading the last of these GGUF files in bf16 and decoding two tokens, a
# tiny file loaded first so that what any load costs besides the weights is in the base.
PEAK_PROBE = """
import contextlib
import json, sys
from llama import Llama
hwm = lambda: int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
peaks = []
for path in sys.argv[1:]:  # a tiny file first: what any load costs besides the weights is then in the base
    base = hwm()
    g = Llama.build(path, None, max_seq_len=16, max_batch_size=1, compile=False, dtype="bfloat16", preload=True)
    out = g.generate([[1, 5, 6]], max_gen_len=2, temperature=0)
    peaks.append(hwm() - base)
    del g
print(json.dumps({"peak": peaks[-1]}))
"""



@contextlib.contextmanager
def transformers_reading_gguf():
    """A context in which transformers' GGUF loader (the reference of the tests that read a GGUF file with it) skips
    two of gguf-py's costs, 20-40 s of the suite: the file's metadata is parsed by our reader (llama/formats/
    gguf_reader.py, whose parse equals gguf's field for field, tensor for tensor: tests/formats/test_gguf_file.py),
    and gguf.get_tensor_name_map is memoized (transformers builds it once per tensor, 397 times for SmolLM2). The
    names, dequantization, tokenizer and model transformers makes of them are its own."""
    import functools

    import gguf
    import pytest

    from llama.formats.gguf_reader import Reader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", Reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield


@contextlib.contextmanager
def ready_client(app, timeout: float = 120.0):
    """Starlette's TestClient of a server app once its model is in: the app loads it in a background thread and
    answers 503 "the model is still loading" until then, as a server should; a test's first request met that on
    a busy machine. Waits for /health to stop answering 503 (at most `timeout` seconds)."""
    import time

    from starlette.testclient import TestClient

    with TestClient(app) as client:
        deadline = time.monotonic() + timeout
        while client.get("/health").status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.01)
        yield client
