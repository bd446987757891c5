"""A real HTTP server on 127.0.0.1 for reward tests and the benchmark, run in a background thread.

``FaultServer(behaviour)`` serves POST on any path; ``behaviour(key, attempt, body)`` (key = the
sample uid of the ``Idempotency-Key`` header ``reward:uid``, attempt = 1, 2, ... per uid) returns
what to do: ``("ok", score)``, ``("status", code, retry_after)``, ``("sleep", seconds, score)``,
``("garbage",)``, ``("truncated",)`` (a JSON body cut short), ``("json", object)`` or
``("chat", content)`` (an OpenAI chat-completions reply; content as given: a string, a list of
parts, a number...) or ``("huge", nbytes, chunked)`` (a valid JSON reply of ``nbytes`` bytes, streamed
in 64 KiB writes of one buffer; chunked: without a Content-Length) or ``("plain", text)`` (a body
labelled text/plain, without a charset). It records every request's full key, headers and arrival time (monotonic)
and the most requests it ever had in flight at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from aiohttp import web


class FaultServer:
    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.attempts: Counter[str] = Counter()  # per sample uid
        self.keys: Counter[str] = Counter()  # per full Idempotency-Key
        self.headers: list[dict] = []
        self.arrivals: list[float] = []
        self.in_flight = self.max_in_flight = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self._ready.wait(10), "the fault server did not start"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/score"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)  # cut sleeping handlers short
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _handle(self, request: web.Request) -> web.Response:
        self.arrivals.append(time.monotonic())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.Response:
        full_key = request.headers.get("Idempotency-Key", "")
        key = full_key.split(":", 1)[1] if ":" in full_key else full_key
        self.keys[full_key] += 1
        self.attempts[key] += 1
        self.headers.append(dict(request.headers))
        body = await request.json()
        action = self.behaviour(key, self.attempts[key], body)
        if action[0] == "plain":
            return web.Response(body=action[1].encode(), headers={"Content-Type": "text/plain"})
        if action[0] == "huge":
            return await self._huge(request, action[1], action[2])
        if action[0] == "sleep":
            await asyncio.sleep(action[1])
            action = ("ok", action[2])
        if action[0] == "ok":
            return web.json_response({"score": action[1]})
        if action[0] == "json":
            return web.json_response(action[1])
        if action[0] == "chat":
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": action[1]}}]})
        if action[0] == "status":
            headers = {"Retry-After": str(action[2])} if action[2] is not None else {}
            return web.Response(status=action[1], text="fault", headers=headers)
        text = '{"score": 0.' if action[0] == "truncated" else "{not json"
        return web.Response(status=200, text=text, content_type="application/json")

    async def _huge(self, request: web.Request, nbytes: int, chunked: bool) -> web.StreamResponse:
        head, tail = b'{"score": 1.0, "pad": "', b'"}'
        chunk = b"x" * (1 << 16)  # one buffer written again and again: the server holds no more
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        if not chunked:
            resp.content_length = nbytes
        await resp.prepare(request)
        pad = nbytes - len(head) - len(tail)
        try:
            await resp.write(head)
            while pad > 0:
                await resp.write(chunk if pad >= len(chunk) else chunk[:pad])
                pad -= len(chunk)
            await resp.write(tail)
            await resp.write_eof()
        except (ConnectionError, RuntimeError):  # the client stopped reading and closed
            pass
        return resp

    def close(self) -> None:
        async def stop():
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
