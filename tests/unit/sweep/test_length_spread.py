"""Spread request lengths: the same per request index for every variant, around max_tokens."""

import asyncio

from specgate.sweep.load_client import closed_loop, spread_length


def test_lengths_spread_around_max_tokens_and_repeat():
    lengths = [spread_length(128, 0.5, i) for i in range(500)]
    assert lengths == [spread_length(128, 0.5, i) for i in range(500)]
    assert 96 <= min(lengths) and max(lengths) <= 160 and len(set(lengths)) > 40
    assert abs(sum(lengths) / len(lengths) - 128) < 3
    assert {spread_length(128, 0.0, i) for i in range(20)} == {128}


def test_the_closed_loop_asks_each_request_for_its_length(tmp_path):
    """A real HTTP server on 127.0.0.1 that streams back as many tokens as each request asks for."""
    from aiohttp import web

    asked = []

    async def chat(request):
        body = await request.json()
        asked.append(body["max_tokens"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await resp.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": 1}}
        await resp.write(b"data: " + __import__("json").dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    async def run():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            records, _ = await closed_loop(f"http://127.0.0.1:{port}", "m", [[{"role": "user", "content": "hi"}]], 2, 12,
                                           max_tokens=40, ignore_eos=True, length_spread=0.5)  # fmt: skip
        finally:
            await runner.cleanup()
        return records

    records = asyncio.run(run())
    assert sorted(asked) == sorted(spread_length(40, 0.5, i) for i in range(12))
    assert [r.output_tokens for r in records] == [spread_length(40, 0.5, i) for i in range(12)]
