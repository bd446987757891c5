"""A reference server of the HTTP environment protocol (``asyncrl.tasks.environments.http``): the
guessing game of ``asyncrl.tasks.environments.guess_number``, for the tests and for users to copy.

It depends on aiohttp only. Each route takes a JSON body with ``"protocol": 1`` and the episode's
``episode_id``:

- ``/reset`` ``{"row"}`` starts a game whose secret is the row's ``answer`` and answers
  ``{"messages": []}`` (or ``first_message`` as a user message);
- ``/step`` ``{"turn", "text"}`` answers ``{"messages", "reward", "done"}`` by the game's rules;
- ``/close`` forgets the episode.

A request repeated with the same ``Idempotency-Key`` gets the reply it got the first time and
changes nothing: a client's retry of a step whose reply was lost is not a second guess. (A real
server would bound this memory; here it lives as long as the episode.) With ``api_key`` set, a
request without ``Authorization: Bearer <api_key>`` is answered 401.

For the tests, ``faults`` makes it misbehave (``Fault``: hang, answer an error status n times
then recover, with or without ``Retry-After``, malformed JSON, a reply of the wrong shape, an
oversized reply, or a step applied whose reply is lost), and ``requests`` records what it was
sent. Run it on its own with ``python tests/tasks/environments/http_env_server.py --port 8000``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from dataclasses import dataclass, field

from aiohttp import web

PROTOCOL = 1
_INTEGER = re.compile(r"-?\d+")


@dataclass
class Fault:
    """How the server misbehaves on its next ``times`` requests to ``route``."""

    kind: str
    """``status`` (answer ``status`` with ``body``, and ``Retry-After: retry_after`` if set),
    ``hang`` (answer nothing for ``hang_s``), ``malformed`` (truncated JSON), ``wrong_shape`` (JSON
    without ``done``), ``reply`` (``body`` with status 200), ``huge`` (a 2 MiB reply) or
    ``lost_reply`` (apply the step, then answer 500)."""
    times: int = 1
    status: int = 500
    retry_after: float | None = None
    body: str = '{"error": "as asked"}'
    route: str = "step"
    hang_s: float = 3600.0


@dataclass
class Game:
    secret: int
    turns: int = 0
    replies: dict[str, dict] = field(default_factory=dict)
    """Idempotency-Key -> the reply it got."""


@dataclass
class Seen:
    route: str
    headers: dict[str, str]
    body: dict
    at: float = field(default_factory=time.monotonic)


class GuessServer:
    """The game's server on 127.0.0.1 (``start`` returns its URL, on an ephemeral port)."""

    def __init__(self, turn_cost: float = 0.0, api_key: str | None = None, first_message: str | None = None):
        self.turn_cost, self.api_key, self.first_message = turn_cost, api_key, first_message
        self.games: dict[str, Game] = {}
        self.faults: list[Fault] = []
        self.requests: list[Seen] = []
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{route:reset|step|close}", self.handle)
        return app

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app(), shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def stop(self) -> None:
        self._stopping.set()  # hanging handlers give up
        if self._runner is not None:
            await self._runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        route = request.match_info["route"]
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        self.requests.append(Seen(route, dict(request.headers), body))
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "unauthorized"}, status=401)
        if not isinstance(body, dict) or body.get("protocol") != PROTOCOL:
            return web.json_response({"error": f"this server speaks protocol {PROTOCOL}"}, status=400)
        fault = next((f for f in self.faults if f.route == route and f.times > 0), None)
        if fault is not None:
            fault.times -= 1
            if fault.kind != "lost_reply":
                return await self._misbehave(fault)
        key = request.headers.get("Idempotency-Key")
        episode = str(body.get("episode_id"))
        game = self.games.get(episode)
        if key is not None and game is not None and key in game.replies:
            reply = game.replies[key]  # a retry: the same answer, nothing applied twice
        elif route == "reset":
            if not isinstance(body.get("row"), dict) or "answer" not in body["row"]:
                return web.json_response({"error": "a reset needs the row and its answer"}, status=400)
            self.games[episode] = game = Game(secret=int(str(body["row"]["answer"]).strip()))
            first = [{"role": "user", "content": self.first_message}] if self.first_message else []
            reply = {"protocol": PROTOCOL, "messages": first}
        elif game is None:
            return web.json_response({"error": f"unknown episode {episode!r}"}, status=404)
        elif route == "step":
            if not isinstance(body.get("text"), str) or not isinstance(body.get("turn"), int):
                return web.json_response({"error": "a step needs its turn and text"}, status=400)
            reply = self._step(game, body["text"])
        else:
            del self.games[episode]
            return web.json_response({"protocol": PROTOCOL})
        if key is not None and game is not None:
            game.replies[key] = reply
        if fault is not None:  # lost_reply: applied above, answered as a failure
            return web.json_response({"error": "the reply was lost"}, status=500)
        return web.json_response(reply)

    def _step(self, game: Game, text: str) -> dict:
        """The guessing game's rules, as ``GuessNumber.step``."""
        game.turns += 1
        guesses = _INTEGER.findall(text)
        if not guesses:
            return {"messages": [{"role": "user", "content": "a number?"}], "done": False}
        guess = int(guesses[-1])
        if guess == game.secret:
            return {"reward": max(0.0, 1.0 - self.turn_cost * (game.turns - 1)), "done": True}
        hint = "higher" if guess < game.secret else "lower"
        return {"messages": [{"role": "user", "content": hint}], "reward": 0.0, "done": False}

    async def _misbehave(self, fault: Fault) -> web.StreamResponse:
        if fault.kind == "hang":
            try:
                await asyncio.wait_for(self._stopping.wait(), fault.hang_s)
            except asyncio.TimeoutError:
                pass
            return web.json_response({"error": "too late"}, status=503)
        if fault.kind == "status":
            headers = {} if fault.retry_after is None else {"Retry-After": f"{fault.retry_after:g}"}
            return web.Response(text=fault.body, status=fault.status, headers=headers, content_type="application/json")
        if fault.kind == "malformed":
            return web.Response(text='{"done": tru', content_type="application/json")
        if fault.kind == "reply":
            return web.Response(text=fault.body, content_type="application/json")
        if fault.kind == "wrong_shape":
            return web.json_response({"messages": "higher"})
        if fault.kind == "huge":
            return web.json_response({"messages": [], "done": False, "pad": "x" * (2 << 20)})
        raise ValueError(f"fault kind ({fault.kind!r}) is not one the server knows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--turn-cost", type=float, default=0.0)
    args = parser.parse_args()
    web.run_app(GuessServer(turn_cost=args.turn_cost).app(), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
