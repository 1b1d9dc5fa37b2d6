"""Starting the real server (python -m llama.serve) as a subprocess on 127.0.0.1 with a free port."""

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from conftest import error_lines, rank_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, ckpt_dir, *args: str, tokenizer=None, timeout: float = 120, nproc: int = 1, env=None):
        """ckpt_dir None: no --ckpt_dir (the default model); env: extra environment variables."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      "--nproc_per_node", str(nproc)]
        where = [] if ckpt_dir is None else ["--ckpt_dir", str(ckpt_dir)]
        cmd = [*launch, "-m", "llama.serve", *where, "--port", str(self.port), "--log-level", "warning", *args]
        if tokenizer:
            cmd += ["--tokenizer_path", str(tokenizer)]
        self.proc = subprocess.Popen(cmd, env={**rank_env(nproc), **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited: " + error_lines(self.proc.stderr.read()))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError("the server did not become healthy in time")
            time.sleep(0.2)

    def client(self, api_key: str = "none", **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
