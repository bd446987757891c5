"""A generator's process boundaries: prompts from the dispatcher in, sampled groups out to the reward workers."""

from __future__ import annotations

from collections.abc import Iterator

from asyncrl.wire.codec import encode
from asyncrl.wire.messages import GroupMessage, PromptRow, Prompts, WantPrompts
from asyncrl.wire.schema import Group
from asyncrl.wire.sockets import RequestClient, StreamSender


class PromptSource:
    """Asks the dispatcher for prompts (``want_prompts``, DEALER to its ROUTER) with the version served.

    Blocks: ``ask`` waits up to ``timeout_s`` for a reply (short, because the dispatcher's admission
    is computed from the version in the request; the generator then asks again). Dropped: nothing.
    A reply that arrives after its request timed out is taken by a later ``ask`` (answers to
    earlier asks queued behind a reply are taken with it, so a generator never lags behind a
    backlog of its own replies), and what is still on its way at exit is read by ``late_replies``.
    """

    def __init__(self, address: str, name: str, generator: str, max_prompts: int, timeout_s: float):
        self.client = RequestClient(address, name=name)
        self.generator, self.max_prompts, self.timeout_s = generator, max_prompts, timeout_s

    def ask(self, version: int, dropped: list[str], max_prompts: int | None = None) -> list[PromptRow]:
        """Rows to sample (none when the dispatcher had none, or said to load newer weights first).
        ``dropped``: ids of groups dropped here since the last ask, for the dispatcher to settle;
        ``max_prompts``: at most this many (None: the ``max_prompts`` this source was built with)."""
        reply = self.client.request(self._request(version, dropped, max_prompts), timeout=self.timeout_s)
        return self._rows(reply) or []

    def send_ask(self, version: int, dropped: list[str], max_prompts: int) -> list[PromptRow] | None:
        """Ask without waiting (continuous generation): the reply is read by ``take_reply``. Returns
        the rows of a reply to an earlier ask that was already here, else None. The dispatcher holds
        the ask for ``timeout_s`` at most; ask again after that, with the version then served."""
        return self._rows(self.client.request(self._request(version, dropped, max_prompts), timeout=0))

    def take_reply(self, timeout: float) -> list[PromptRow] | None:
        """The rows of a reply that arrives within ``timeout`` s (an empty list: the dispatcher
        answered without prompts), or None when none came."""
        return self._rows(self.client.receive(timeout=timeout))

    def _request(self, version: int, dropped: list[str], max_prompts: int | None) -> WantPrompts:
        return WantPrompts(
            generator=self.generator,
            max_prompts=self.max_prompts if max_prompts is None else max_prompts,
            policy_version=version,
            timeout_s=self.timeout_s,
            dropped=dropped,
        )

    def _rows(self, reply) -> list[PromptRow] | None:
        """A reply's rows, with those of any replies queued behind it (None: no reply)."""
        if reply is None:
            return None
        rows = list(reply[1].prompts) if isinstance(reply[1], Prompts) else []
        while (more := self.client.receive(timeout=0)) is not None:
            rows.extend(more[1].prompts if isinstance(more[1], Prompts) else [])
        return rows

    def late_replies(self, wait: float) -> Iterator[list[PromptRow]]:
        """The rows of each reply still arriving, each waited for up to ``wait`` s."""
        while (late := self.client.receive(timeout=wait)) is not None:
            if isinstance(late[1], Prompts):
                yield late[1].prompts

    def close(self) -> None:
        self.client.close()


class GroupSink:
    """Sends finished groups to the reward workers (``group``, PUSH round-robin over those connected).

    Blocks: ``send`` while every reward worker is at its high-water mark, for as long as the
    backpressure lasts, warning every ``warn_every`` s. Dropped: nothing.
    """

    def __init__(self, address: str, name: str, warn_every: float):
        self.stream = StreamSender(address, name=name)
        self.warn_every = warn_every

    def send(self, group: Group) -> None:
        self.stream.send_until_taken(encode(GroupMessage(group=group)), self.warn_every)

    def close(self) -> None:
        self.stream.close()
