"""The ASGI app: OpenAI-compatible endpoints over one Engine (llama/core/frontend/engine.py).

Each accepted HTTP request becomes `len(prompts) * n` engine requests. A thread per engine request turns its
blocking delta iterator into events on the event loop; the response (whole or server-sent events) is produced
while a watcher listens for the client's disconnect, which cancels every engine request of that HTTP request at
once, so their slots free up at the engine's next step.
"""

import asyncio
import contextlib
import hashlib
import hmac
import json
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from llama.core.frontend.engine import EngineStopped
from llama.serve import protocol, thinking, tokens, tools
from llama.serve.metrics import CONTENT_TYPE, Metrics
from llama.serve.protocol import APIError

STATIC = Path(__file__).parent / "static"
PAGE_SCRIPTS = ("chat.js", "markdown.js")  # what the chat page loads from /static/
_END = object()


class State:
    """What the endpoints share: the generator and engine once loaded, the admission count, the metrics."""

    def __init__(self, load: Callable, model_name: str, api_keys: Sequence[str], max_queue: int,
                 prefill_chunk: int = 128, share_prefix_cache: bool = False):
        self.load, self.model_name, self.prefill_chunk = load, model_name, prefill_chunk
        self.share_prefix_cache = share_prefix_cache
        self.api_keys = [k.encode() for k in api_keys]
        self.max_queue = max_queue
        self.generator = self.engine = None
        self.load_error: Optional[BaseException] = None
        self.active = 0  # engine requests submitted and not yet settled
        self.lock = threading.Lock()
        self.metrics = Metrics()

    def start_loading(self) -> None:
        def run():
            try:
                gen = self.load()
                self.engine = gen.engine(prefill_chunk=self.prefill_chunk)
                self.generator = gen
            except BaseException as e:  # reported by /health and every endpoint
                self.load_error = e

        threading.Thread(target=run, name="llama-serve-load", daemon=True).start()

    # -------------------------------------------------------------------------------------------- checks
    def authorize(self, request: HTTPRequest) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        given = header[7:].strip().encode() if header[:7].lower() == "bearer " else b""
        ok = False
        for key in self.api_keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def cache_salt(self, request: HTTPRequest) -> str:
        """Prefix-cache isolation: each API key its own cached blocks (a shared cache leaks timing between
        tenants), unless the operator shares them (--share-prefix-cache)."""
        if self.share_prefix_cache or not self.api_keys:
            return ""
        return hashlib.sha256(request.headers.get("authorization", "").encode()).hexdigest()

    def ready(self):
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error!r}", kind="server_error",
                           code="model_load_failed")
        if self.engine is None:
            raise APIError(503, "the model is still loading", kind="server_error", code="loading",
                           headers={"Retry-After": "5"})
        if not self.engine.alive:  # its thread stopped on an error: every request would fail; restart the server
            raise APIError(503, f"the engine stopped after an error: {self.engine.error!r}; restart the server",
                           kind="server_error", code="engine_stopped")
        return self.engine

    def admit(self, count: int) -> None:
        limit = self.generator.max_batch_size + self.max_queue
        if count > limit:
            raise protocol.bad("n", f"this request needs {count} sequences (prompts x n); this server runs at most "
                                    f"{limit} at once (max_batch_size + max_queue)")
        with self.lock:
            if self.active + count > limit:
                raise APIError(429, f"the server is busy: {self.active} sequences running or queued, limit {limit}"
                                    " (max_batch_size + --max-queue); retry later", code="queue_full",
                               headers={"Retry-After": "1"})
            self.active += count

    def release(self, count: int = 1) -> None:
        with self.lock:
            self.active -= count

    def update_gauges(self) -> None:
        if self.engine is None:
            return
        running = sum(s is not None for s in list(self.engine.slots))
        self.metrics.running.set(running)
        self.metrics.waiting.set(max(0, self.active - running))
        if self.generator is not None:
            self.metrics.kv_pool(self.generator.cache.pool)
        self.metrics.speculation(self.engine.stats)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Watched(Response):
    """Runs produce(send) while listening for the client's disconnect; on disconnect calls on_disconnect() and
    stops producing."""

    def __init__(self, produce, on_disconnect):
        self.produce, self.on_disconnect = produce, on_disconnect
        self.background = None

    async def __call__(self, scope, receive, send):
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass

        task, watcher = asyncio.ensure_future(self.produce(send)), asyncio.ensure_future(watch())
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done and not task.done():
            self.on_disconnect()
            task.cancel()
        watcher.cancel()
        try:
            await task
        except (asyncio.CancelledError, OSError):
            pass


class Job:
    """One HTTP generation request in flight: its engine requests and the events their threads report."""

    def __init__(self, state: State, spec: protocol.Job, reqs: List, loop):
        self.state, self.spec, self.reqs, self.loop = state, spec, reqs, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrival = time.perf_counter()
        for i, r in enumerate(reqs):
            threading.Thread(target=self._pump, args=(i, r), name=f"llama-serve-pump-{r.id}", daemon=True).start()

    def _pump(self, i: int, r) -> None:
        m = self.state.metrics
        first = None
        try:
            for text in r:
                if first is None:
                    first = time.perf_counter()
                    m.ttft.observe(first - self.arrival)
                self.loop.call_soon_threadsafe(self.events.put_nowait, (i, text))
        except BaseException:  # the request's error is reported from r.error
            pass
        finally:
            self.state.release()
            reason = protocol.finish_reason(r) or "error"
            m.finished.labels(reason).inc()
            m.prompt_tokens.inc(len(r.prompt))
            m.generated_tokens.inc(r.tokens_generated)
            if first is not None and r.tokens_generated > 1:
                m.tpot.observe((time.perf_counter() - first) / (r.tokens_generated - 1))
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (i, _END))
            except RuntimeError:  # the event loop has closed (server shutting down)
                pass

    def cancel(self) -> None:
        for r in self.reqs:
            r.cancel()

    async def whole(self, send) -> None:
        left = len(self.reqs)
        while left:
            _, item = await self.events.get()
            left -= item is _END
        err = next((r.error for r in self.reqs if r.error is not None), None)
        if err is not None:
            e = engine_error(err)
            await send_response(send, error_response(e))
            return
        gen = self.state.generator
        response = protocol.whole(self.spec, self.reqs, gen.tokenizer)
        thinking.apply_whole(self.spec, self.reqs, response, gen)  # the think block first: calls are in the content
        tools.apply_whole(self.spec, response)
        await send_response(send, JSONResponse(response))

    async def stream(self, send) -> None:
        spec, tok = self.spec, self.state.generator.tokenizer
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})

        async def event(obj) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        first = [True] * len(self.reqs)
        for i, r in enumerate(self.reqs):
            if spec.chat:
                await event(protocol.chunk(spec, [protocol.delta_choice(spec, i, "", first=True)]))
            elif spec.echo:
                await event(protocol.chunk(spec, [protocol.delta_choice(spec, i, tok.decode(r.prompt))]))
            first[i] = False
        left = len(self.reqs)
        thinks = thinking.streams(spec, self.reqs, self.state.generator)
        calls = [tools.ToolStream(spec, i) for i in range(len(self.reqs))] if spec.tools is not None else None

        def choices(i, parts):  # (reasoning, content): reasoning first, then the content through the tool calls
            out = thinking.deltas(spec, i, (parts[0], ""))
            if parts[1]:
                out += calls[i].feed(parts[1]) if calls else [protocol.delta_choice(spec, i, parts[1])]
            return out

        while left:
            i, item = await self.events.get()
            if item is not _END:
                for d in choices(i, thinks[i].feed(item) if thinks else ("", item)):
                    await event(protocol.chunk(spec, [d]))
                continue
            left -= 1
            r = self.reqs[i]
            if r.error is not None:
                self.cancel()
                await event(engine_error(r.error).body())
                break
            for d in choices(i, thinks[i].finish()) if thinks else []:
                await event(protocol.chunk(spec, [d]))
            lp, reason = None, protocol.finish_reason(r)
            if calls:
                last, reason = calls[i].finish(reason)
                for d in last:
                    await event(protocol.chunk(spec, [d]))
            if spec.logprobs:
                lp = protocol.logprobs_block(spec, r.prediction)
            await event(protocol.chunk(spec, [protocol.delta_choice(spec, i, None if spec.chat else "", reason, lp)]))
        else:
            if spec.include_usage:
                prompt = sum(len(self.reqs[k * spec.n].prompt) for k in range(len(spec.prompts)))
                cached = sum(self.reqs[k * spec.n].reused for k in range(len(spec.prompts)))
                out = protocol.chunk(spec, [], protocol.usage(prompt, sum(r.tokens_generated for r in self.reqs),
                                                              cached, self.reqs))
                await event(out)
            await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_response(send, response: Response) -> None:
    async def no_receive():
        return {"type": "http.disconnect"}

    await response({"type": "http"}, no_receive, send)


def engine_error(err: BaseException) -> APIError:
    """An engine request's error: bad input (ValueError/TypeError) is the client's 400, a stopped engine 503,
    anything else a 500."""
    if isinstance(err, EngineStopped):
        return APIError(503, str(err), kind="server_error", code="engine_stopped")
    if isinstance(err, (ValueError, TypeError)):
        msg = str(err)
        param = "messages" if "dialog" in msg or "message" in msg else ("prompt" if "prompt" in msg else None)
        param = "prediction" if msg.startswith("prediction") else param
        return APIError(400, msg, param=param, code="invalid_value")
    return APIError(500, f"generation failed: {err}", kind="server_error", code="engine_error")


def with_grammar(spec) -> None:
    """spec's response_format as a grammar among its sampling params; a 400 naming response_format if it cannot
    be one."""
    try:
        from llama.sample.grammar import Grammar

        spec.params["grammar"] = Grammar.from_response_format(spec.response_format)
    except ImportError as e:
        raise protocol.bad("response_format", f"structured outputs need llguidance ({e}): "
                                              "pip install -e '.[serve]'") from None
    except ValueError as e:
        raise protocol.bad("response_format", str(e)) from None


async def submit(state: State, engine, spec, salt: str = "") -> List:
    """spec's requests, submitted off the event loop (a grammar's first use builds its vocabulary, up to seconds);
    on failure those submitted are cancelled and the admission count of the rest released."""
    reqs: List = []

    def submit_all():
        for p in spec.prompts:
            reqs.extend(engine.submit_samples(p, spec.n, cache_salt=salt, **spec.params))

    try:
        await asyncio.to_thread(submit_all)
    except BaseException:
        for r in reqs:
            r.cancel()
        state.release(len(spec.prompts) * spec.n - len(reqs))
        raise
    return reqs


async def generate(state: State, request: HTTPRequest, chat: bool):
    """/v1/completions and /v1/chat/completions: parse, admit, submit, then stream or answer whole."""
    state.authorize(request)
    engine = state.ready()
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    gen = state.generator
    spec = protocol.parse(body, chat, state.model_name, gen.max_seq_len, gen.model.vocab_size)
    if chat:
        tools.attach(spec, body, gen.formatter)
    if spec.response_format is not None:
        with_grammar(spec)
    state.admit(len(spec.prompts) * spec.n)
    reqs = await submit(state, engine, spec, state.cache_salt(request))
    failed = next((r.error for r in reqs if r.done() and r.error is not None), None)
    job = Job(state, spec, reqs, asyncio.get_running_loop())  # its threads release the admission count
    if failed is not None:
        job.cancel()
        raise engine_error(failed)
    state.metrics.requests.labels(request.url.path, "200").inc()
    return Watched(job.stream if spec.stream else job.whole, job.cancel)


def model_card(state: State) -> Dict:
    """The served model as OpenAI's /v1/models lists it (vLLM's max_model_len once it has loaded)."""
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "llama",
            **({"max_model_len": state.generator.max_seq_len} if state.generator else {})}


def routes(state: State) -> List[Route]:
    def guarded(handler):
        async def endpoint(request: HTTPRequest):
            try:
                return await handler(request)
            except APIError as e:
                if request.url.path.startswith("/v1/") and e.status != 401:
                    state.metrics.requests.labels(request.url.path, str(e.status)).inc()
                return error_response(e)

        return endpoint

    async def completions(request):
        return await generate(state, request, chat=False)

    async def chat_completions(request):
        return await generate(state, request, chat=True)

    async def models(request):
        state.authorize(request)
        return JSONResponse({"object": "list", "data": [model_card(state)]})

    async def model_by_id(request):
        state.authorize(request)
        if request.path_params["model"] != state.model_name:
            raise APIError(404, f"the model {request.path_params['model']!r} does not exist: this server serves "
                                f"{state.model_name!r}", param="model", code="model_not_found")
        return JSONResponse(model_card(state))

    def with_tokens(convert):
        async def endpoint(request):
            state.authorize(request)
            state.ready()
            gen = state.generator
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError) as e:
                raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
            return JSONResponse(convert(gen, body))

        return endpoint

    async def health(request):
        try:
            state.ready()
        except APIError as e:
            return error_response(e)
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        state.update_gauges()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def page(request):
        return FileResponse(STATIC / "chat.html", media_type="text/html")

    async def page_script(request):
        name = request.path_params["name"]
        if name not in PAGE_SCRIPTS:
            return error_response(APIError(404, f"no page script {name!r}", code="not_found"))
        return FileResponse(STATIC / name, media_type="text/javascript")

    async def page_config(request):
        return JSONResponse({"model": state.model_name, "api_key_required": bool(state.api_keys)})

    return [
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(model_by_id), methods=["GET"]),
        Route("/tokenize", guarded(with_tokens(tokens.tokenize)), methods=["POST"]),
        Route("/detokenize", guarded(with_tokens(tokens.detokenize)), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/", page, methods=["GET"]),
        Route("/static/{name}", page_script, methods=["GET"]),
        Route("/config", page_config, methods=["GET"]),
    ]


async def not_found(request, exc):
    return error_response(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))


async def method_not_allowed(request, exc):
    return error_response(APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                   kind="invalid_request_error", code="method_not_allowed"))


async def server_error(request, exc):
    return error_response(APIError(500, f"internal error: {exc!r}", code="internal_error"))


def create_app(load: Callable, model_name: str, api_keys: Sequence[str] = (), max_queue: int = 256,
               prefill_chunk: int = 128, share_prefix_cache: bool = False) -> Starlette:
    """load() builds the Llama (called once, in a background thread at startup; /health answers 503 until then).
    share_prefix_cache: API keys share cached prompt blocks (default: each key its own)."""
    state = State(load, model_name, api_keys, max_queue, prefill_chunk, share_prefix_cache)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start_loading()
        yield
        if state.engine is not None:
            state.engine.close(cancel=True)

    app = Starlette(routes=routes(state), lifespan=lifespan,
                    exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error})
    app.state.llama = state
    return app
