"""HTTP front end of the reference engine: the subset of SGLang's API that specgate uses.

  POST /v1/completions, /v1/chat/completions   OpenAI-compatible, stream and non-stream
  POST /generate                               SGLang native subset, with meta_info
  GET  /health, /health_generate, /v1/models, /server_info
Greedy only: temperature > 0 is refused with 400, since verification is greedy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from importlib.metadata import version

from aiohttp import web

from specgate.engine.reference import Engine, EngineClosed

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    pass


def _int(body: dict, key: str, default: int, lo: int = 1) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise BadRequest(f"'{key}' must be an integer >= {lo}, got {value!r}")
    return value


def _greedy_only(temperature) -> None:
    if temperature is None:
        return
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise BadRequest(f"'temperature' must be a number >= 0, got {temperature!r}")
    if temperature > 0:
        raise BadRequest("temperature > 0 is not supported: this engine decodes greedily (use temperature 0)")


class Detokenizer:
    """Incremental text for a growing token list; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, tokens: list[int]) -> str:
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new, self.sent = text[self.sent :], len(text)
        return new


class Events:
    """A request's events (async iterator) and its engine job, which a disconnect cancels."""

    def __init__(self, job, stream):
        self.job, self.stream = job, stream

    def __aiter__(self):
        return self.stream.__aiter__()


class Api:
    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.started = time.time()

    # -- a request's life ---------------------------------------------------------

    def _submit(self, prompt: list[int], max_tokens: int, ignore_eos: bool):
        """Queue the request (a bad one raises BadRequest here, before any response starts);
        returns an async iterator of ("tokens", [ids]) items, then ("done", finish_reason)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_tokens(ids):
            loop.call_soon_threadsafe(events.put_nowait, ("tokens", ids))

        def on_done(reason, error):
            loop.call_soon_threadsafe(events.put_nowait, ("error", error) if error else ("done", reason))

        try:
            job = self.engine.submit(prompt, max_tokens, ignore_eos, on_tokens, on_done)
        except ValueError as e:
            raise BadRequest(str(e)) from e

        async def stream():
            while True:
                kind, payload = await events.get()
                if kind == "done":  # the finished request's own speculation counters
                    r = job.request
                    payload = (payload, {"spec_verify_ct": r.verify_steps,
                                         "spec_accept_length": r.accepted_tokens / r.verify_steps if r.verify_steps else None})  # fmt: skip
                yield kind, payload
                if kind in ("done", "error"):
                    return

        return Events(job, stream())

    async def _collect(self, prompt, max_tokens, ignore_eos) -> tuple[list[int], str, dict]:
        ids: list[int] = []
        async for kind, payload in self._submit(prompt, max_tokens, ignore_eos):
            if kind == "tokens":
                ids += payload
            elif kind == "error":
                raise web.HTTPServiceUnavailable(text=json.dumps({"error": {"message": payload}}), content_type="application/json")
            else:
                return ids, *payload
        raise RuntimeError("unreachable")

    # -- parsing ------------------------------------------------------------------

    async def _body(self, request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _prompt_ids(self, prompt) -> list[int]:
        tok = self.engine.tokenizer
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return tok(prompt, add_special_tokens=False)["input_ids"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if max(prompt) >= len(tok) or min(prompt) < 0:
                raise BadRequest("'prompt' token ids out of the vocabulary range")
            return prompt
        raise BadRequest("'prompt' must be a non-empty string or a list of token ids")

    def _chat_ids(self, messages) -> list[int]:
        from specgate.model.chat import prompt_ids

        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise BadRequest(f"'messages[{i}]' must be an object with role system/user/assistant and string content")
        return prompt_ids(self.engine.tokenizer, messages)

    # -- handlers -----------------------------------------------------------------

    async def completions(self, request):
        return await self._openai(request, chat=False)

    async def chat_completions(self, request):
        return await self._openai(request, chat=True)

    async def _openai(self, request, chat: bool):
        body = await self._body(request)
        _greedy_only(body.get("temperature"))
        prompt = self._chat_ids(body.get("messages")) if chat else self._prompt_ids(body.get("prompt"))
        max_tokens = _int(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens", 16)
        ignore_eos = bool(body.get("ignore_eos", False))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        detok = Detokenizer(self.engine.tokenizer)

        def usage(n):
            return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}

        if not body.get("stream"):
            ids, reason, _ = await self._collect(prompt, max_tokens, ignore_eos)
            text = detok.push(ids) + detok.push([])
            choice = {"index": 0, "finish_reason": reason}
            choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text, "logprobs": None}
            return web.json_response({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                      "choices": [choice], "usage": usage(len(ids))})  # fmt: skip

        events = self._submit(prompt, max_tokens, ignore_eos)  # rejects a bad request with a 400 before streaming
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload):
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())

        def chunk(text, reason=None):
            c = {"index": 0, "finish_reason": reason}
            c |= {"delta": {"content": text}} if chat else {"text": text, "logprobs": None}
            return {"id": rid, "object": chunk_obj, "created": created, "model": self.model_name, "choices": [c]}

        stream_options = body.get("stream_options") or {}
        continuous = bool(stream_options.get("continuous_usage_stats"))  # each chunk carries the running count
        n = 0
        finished = False
        try:
            async for kind, payload in events:
                if kind == "tokens":
                    n += len(payload)
                    text = detok.push(payload)
                    if text or not chat:
                        await send(chunk(text) | ({"usage": usage(n)} if continuous else {}))
                elif kind == "error":
                    await send({"error": {"message": payload, "type": "server_error"}})
                    break
                else:
                    final = chunk("", payload[0])
                    if stream_options.get("include_usage"):
                        final["usage"] = usage(n)
                    await send(final)
            finished = True
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        finally:
            if not finished:  # the client went away (or the handler was cancelled): stop decoding for it
                self.engine.cancel(events.job)
        return response

    async def generate(self, request):
        body = await self._body(request)
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("'sampling_params' must be an object")
        _greedy_only(params.get("temperature"))
        if "input_ids" in body:
            prompt = self._prompt_ids(body["input_ids"])
        else:
            prompt = self._prompt_ids(body.get("text"))
        max_new = _int(params, "max_new_tokens", 128)
        t0 = time.perf_counter()
        ids, reason, stats = await self._collect(prompt, max_new, bool(params.get("ignore_eos", False)))
        return web.json_response({
            "text": self.engine.tokenizer.decode(ids, skip_special_tokens=True),
            "output_ids": ids,
            "meta_info": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "finish_reason": {"type": reason}, "e2e_latency": time.perf_counter() - t0, **stats},
        })  # fmt: skip

    async def health(self, request):
        return web.Response(text="ok")

    async def health_generate(self, request):
        ids, _, _ = await self._collect(self.engine.tokenizer("ping", add_special_tokens=False)["input_ids"], 1, True)
        return web.Response(text="ok" if ids else "no tokens", status=200 if ids else 503)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "specgate"}]})  # fmt: skip

    async def server_info(self, request):
        stats = self.engine.stats()
        return web.json_response({
            "model_path": self.engine.cfg.target_dir, "speculative_draft_model_path": self.engine.cfg.draft_dir,
            "engine": "specgate-reference", "version": version("specgate"), "torch_version": __import__("torch").__version__,
            "internal_states": [{"avg_spec_accept_length": stats["avg_spec_accept_length"]}], **stats,
        })  # fmt: skip


@web.middleware
async def errors_as_json(request, handler):
    try:
        return await handler(request)
    except BadRequest as e:
        return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=400)
    except EngineClosed as e:
        return web.json_response({"error": {"message": str(e), "type": "server_error"}}, status=503)


def build_app(engine: Engine, model_name: str) -> web.Application:
    api = Api(engine, model_name)
    app = web.Application(middlewares=[errors_as_json])
    app.add_routes([
        web.post("/v1/completions", api.completions), web.post("/v1/chat/completions", api.chat_completions),
        web.post("/generate", api.generate), web.get("/health", api.health),
        web.get("/health_generate", api.health_generate), web.get("/v1/models", api.models),
        web.get("/server_info", api.server_info), web.get("/get_server_info", api.server_info),
    ])  # fmt: skip
    app.on_shutdown.append(lambda _app: asyncio.get_running_loop().run_in_executor(None, engine.shutdown))
    return app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 30000, model_name: str | None = None) -> None:
    app = build_app(engine, model_name or engine.cfg.target_dir)
    log.info("serving on http://%s:%d", host, port)
    web.run_app(app, host=host, port=port, print=None, handle_signals=True, shutdown_timeout=5)
