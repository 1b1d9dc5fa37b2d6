"""download.sh against a local HTTP server serving a fake model tree: good path, corruption, prompts, resume."""

import functools
import hashlib
import os
import re
import shutil
import subprocess
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import REPO

SCRIPT = REPO / "download.sh"
MODELS = {"7B": ("llama-2-7b", 1), "7B-chat": ("llama-2-7b-chat", 1), "13B": ("llama-2-13b", 2),
          "13B-chat": ("llama-2-13b-chat", 2), "70B": ("llama-2-70b", 8), "70B-chat": ("llama-2-70b-chat", 8)}

pytestmark = pytest.mark.skipif(shutil.which("wget") is None or shutil.which("bash") is None,
                                reason="download.sh needs bash and wget (apt-get install -y wget)")


class RangeHandler(SimpleHTTPRequestHandler):
    """http.server plus `Range: bytes=N-`, as a CDN serves it, so wget --continue can resume."""

    ranges = []  # Range headers received, to show wget resumed rather than restarted

    def send_head(self):
        if self.headers.get("Range"):
            self.ranges.append((self.path.split("?")[0], self.headers["Range"]))
        m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if not m or not os.path.isfile(path):
            return super().send_head()
        size, start = os.path.getsize(path), int(m.group(1))
        if start >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        f = open(path, "rb")
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.send_header("Content-Length", str(size - start))
        self.end_headers()
        return f

    def log_message(self, *args):
        pass


def write_checklist(d: Path, names):
    (d / ("tokenizer_checklist.chk" if names == ["tokenizer.model"] else "checklist.chk")).write_text(
        "".join(f"{hashlib.md5((d / n).read_bytes()).hexdigest()}  {n}\n" for n in names))


@pytest.fixture
def server(tmp_path):
    """A fake Meta download tree with correct checklists, served on 127.0.0.1 at a free port."""
    root = tmp_path / "remote"
    root.mkdir()
    (root / "LICENSE").write_text("LLAMA 2 COMMUNITY LICENSE (fake)\n")
    (root / "USE_POLICY.md").write_text("# Acceptable use (fake)\n")
    (root / "tokenizer.model").write_bytes(os.urandom(3000))
    write_checklist(root, ["tokenizer.model"])
    for path, shards in MODELS.values():
        d = root / path
        d.mkdir()
        names = []
        for s in range(shards):
            (d / f"consolidated.{s:02d}.pth").write_bytes(os.urandom(5000 + 100 * s))
            names.append(f"consolidated.{s:02d}.pth")
        (d / "params.json").write_text('{"dim": 4096}')
        write_checklist(d, names + ["params.json"])
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/*?Policy=eyJhIjoxfQ__&Signature=abc~def&Key-Pair-Id=K1"
    yield root, url
    httpd.shutdown()
    httpd.server_close()


def run(args=(), env=None, stdin=""):
    base = {k: v for k, v in os.environ.items() if k not in ("PRESIGNED_URL", "MODEL_SIZE", "TARGET_FOLDER")}
    return subprocess.run(["bash", str(SCRIPT), *args], input=stdin, capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=120)


def same_files(root: Path, out: Path, models):
    for name in ("LICENSE", "USE_POLICY.md", "tokenizer.model", "tokenizer_checklist.chk"):
        assert (out / name).read_bytes() == (root / name).read_bytes(), name
    for m in models:
        path, shards = MODELS[m]
        names = [f"consolidated.{s:02d}.pth" for s in range(shards)] + ["params.json", "checklist.chk"]
        assert sorted(p.name for p in (out / path).iterdir()) == sorted(names)
        for n in names:
            assert (out / path / n).read_bytes() == (root / path / n).read_bytes(), f"{path}/{n}"


def test_non_interactive_flags_download_and_verify(server, tmp_path):
    root, url = server
    out = tmp_path / "weights"
    proc = run(["--url", url, "--models", "7B,13B", "--target-dir", str(out)])
    assert proc.returncode == 0, proc.stderr
    same_files(root, out, ["7B", "13B"])
    assert not (out / "llama-2-70b").exists()
    assert f"{out}/llama-2-13b/consolidated.01.pth: OK" in proc.stdout
    assert "All files downloaded and verified" in proc.stdout
    # a second run resumes nothing and re-verifies (wget --continue sees complete files)
    proc = run(["--url", url, "--models", "13B", "--target-dir", str(out)])
    assert proc.returncode == 0, proc.stderr
    same_files(root, out, ["13B"])


def test_environment_variables(server, tmp_path):
    root, url = server
    out = tmp_path / "env"
    proc = run(env={"PRESIGNED_URL": url, "MODEL_SIZE": "7B-chat", "TARGET_FOLDER": str(out)})
    assert proc.returncode == 0, proc.stderr
    same_files(root, out, ["7B-chat"])


def test_corrupted_model_file_fails_naming_it(server, tmp_path):
    root, url = server
    shard = root / "llama-2-13b" / "consolidated.01.pth"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = tmp_path / "w"
    proc = run(["--url", url, "--models", "7B,13B", "--target-dir", str(out)])
    assert proc.returncode != 0
    assert re.search(r"checksum mismatch for .*llama-2-13b/consolidated\.01\.pth \(md5 [0-9a-f]{32}, expected", proc.stderr)
    assert "verification of llama-2-13b failed" in proc.stderr
    assert "consolidated.00.pth: OK" in proc.stdout  # the good files are still reported good
    assert "All files downloaded and verified" not in proc.stdout


def test_corrupted_tokenizer_stops_before_models(server, tmp_path):
    root, url = server
    (root / "tokenizer.model").write_bytes(b"truncated")
    out = tmp_path / "w"
    proc = run(["--url", url, "--models", "7B", "--target-dir", str(out)])
    assert proc.returncode != 0
    assert "checksum mismatch for" in proc.stderr and "tokenizer.model" in proc.stderr
    assert not (out / "llama-2-7b").exists()


def test_missing_file_on_server_fails_naming_it(server, tmp_path):
    root, url = server
    (root / "llama-2-7b" / "params.json").unlink()
    proc = run(["--url", url, "--models", "7B", "--target-dir", str(tmp_path / "w")])
    assert proc.returncode != 0
    assert "download of llama-2-7b/params.json failed" in proc.stderr


def test_interactive_prompts_on_stdin(server, tmp_path):
    root, url = server
    out = tmp_path / "interactive"
    proc = run(env={"TARGET_FOLDER": str(out)}, stdin=f"{url}\n7B\n")
    assert proc.returncode == 0, proc.stderr
    same_files(root, out, ["7B"])
    assert not (out / "llama-2-13b").exists()


def test_interactive_empty_model_list_means_all(server, tmp_path):
    root, url = server
    out = tmp_path / "all"
    proc = run(env={"TARGET_FOLDER": str(out)}, stdin=f"{url}\n\n")
    assert proc.returncode == 0, proc.stderr
    same_files(root, out, list(MODELS))
    assert (out / "llama-2-70b-chat" / "consolidated.07.pth").is_file()


def test_resumes_a_partial_download(server, tmp_path):
    root, url = server
    out = tmp_path / "w"
    (out / "llama-2-7b").mkdir(parents=True)
    full = (root / "llama-2-7b" / "consolidated.00.pth").read_bytes()
    (out / "llama-2-7b" / "consolidated.00.pth").write_bytes(full[:1234])
    proc = run(["--url", url, "--models", "7B", "--target-dir", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert (out / "llama-2-7b" / "consolidated.00.pth").read_bytes() == full
    assert ("/llama-2-7b/consolidated.00.pth", "bytes=1234-") in RangeHandler.ranges


@pytest.mark.parametrize("args,message", [
    (["--url", "URL", "--models", "9B"], "unknown model '9B'"),
    (["--models", "7B"], "no URL given"),
    (["--url", "https://example.com/no-star", "--models", "7B"], "has no '*'"),
    (["--bogus"], "unknown argument --bogus"),
])
def test_bad_input_fails_before_downloading(server, tmp_path, args, message):
    _, url = server
    proc = run([url if a == "URL" else a for a in args] + ["--target-dir", str(tmp_path / "w")])
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (tmp_path / "w").exists()
