"""A reward worker's process boundaries: groups in (from the generators, or from the owner when
hot-plugged), work shared with hot-plugged peers, scored groups out to the buffer."""

from __future__ import annotations

from collections.abc import Iterator

import zmq

from asyncrl.wire.codec import encode
from asyncrl.wire.messages import GroupMessage, Groups, Message, RateLease, Run, WantGroups
from asyncrl.wire.schema import Group
from asyncrl.wire.sockets import ReplyServer, RequestClient, StreamReceiver, StreamSender


class GroupInbox:
    """Groups from the generators (``group``, PULL bound at ``reward_in``): the owner's input.

    Blocks: never (``receive`` does not wait). The worker reads only while its queue has room
    (``reward.queue_groups``): past that, frames pile up to the high-water mark and the generators'
    sends block. Dropped: frames that fail validation and frames of other kinds (counted).
    """

    def __init__(self, address: str, name: str = "reward.in"):
        self.sock = StreamReceiver(address, name=name)

    @property
    def rejected(self) -> int:
        return self.sock.rejected

    def receive(self) -> tuple[bool, Group | None]:
        """(whether a frame was there, its group if it was one)."""
        msg = self.sock.recv(timeout=0)
        if msg is None:
            return False, None
        return True, msg[1].group if isinstance(msg[1], GroupMessage) else None

    def close(self) -> None:
        self.sock.close()


class PeerShare:
    """The owner's end of sharing (ROUTER bound at ``reward_share``, ``ROUTER_MANDATORY``):
    hot-plugged workers ask for work (``want_groups`` -> ``groups``) and for the run (``want_run`` -> ``run``);
    the owner leases them their shares of the rate budgets (``rate_lease``, unasked, before their groups).

    Blocks: never. Dropped: requests of other kinds. A reply to a peer that has gone (or is at its
    high-water mark) raises instead of vanishing: ``give`` returns False and the caller keeps the groups.
    """

    def __init__(self, address: str, name: str = "reward.share"):
        self.server = ReplyServer(address, name=name)
        self.server.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)

    def requests(self) -> Iterator[tuple[bytes, Message]]:
        """Every request already queued: (peer, message)."""
        while (req := self.server.recv(timeout=0)) is not None:
            yield req[0], req[2]

    def tell_run(self, peer: bytes, run: Run, request_id: int | None) -> None:
        self.server.reply(peer, run, request_id)

    def give(self, peer: bytes, groups: list[Group]) -> bool:
        """Hand ``groups`` to ``peer``; False (nothing handed) when it is gone or full."""
        try:
            self.server.reply(peer, Groups(groups=groups), None)
        except zmq.ZMQError:
            return False
        return True

    def lease(self, peer: bytes, lease: RateLease) -> bool:
        """Send ``peer`` its shares of the rate budgets; False when it is gone or full."""
        try:
            self.server.reply(peer, lease, None)
        except zmq.ZMQError:
            return False
        return True

    def close(self) -> None:
        self.server.close()


class ShareClient:
    """A hot-plugged worker's end of sharing: asks the owner for work (``want_groups``, DEALER).

    Blocks: never: a request the owner cannot take now (not connected yet) is not sent and is
    asked again on a later turn; replies are read without waiting. Dropped: nothing: the groups of
    a reply are taken whenever it arrives.
    """

    def __init__(self, address: str, name: str):
        self.client = RequestClient(address, name=name)

    @property
    def rejected(self) -> int:
        return self.client.rejected

    def ask(self, request: WantGroups) -> bool:
        """Send ``request`` if the owner can take it now."""
        try:
            self.client.sock.send(encode(request), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def replies(self) -> Iterator[list[Group] | RateLease]:
        """Each message already here: the groups of a reply (none for a reply of another kind), or a
        lease of the rate budgets (not a reply: the owner sends it unasked)."""
        while (msg := self.client.receive(timeout=0)) is not None:
            if isinstance(msg[1], RateLease):
                yield msg[1]
            else:
                yield msg[1].groups if isinstance(msg[1], Groups) else []

    def close(self) -> None:
        self.client.close()


class BufferOutbox:
    """Scored groups to the buffer (``group``, PUSH connected to ``buffer_in``).

    Blocks: never: ``offer`` gives up at once when the buffer takes nothing now; the worker keeps
    the group (counted as held) and stops taking in work until it goes. Dropped: nothing.
    """

    def __init__(self, address: str, name: str):
        self.stream = StreamSender(address, name=name)

    def offer(self, group: Group) -> bool:
        try:
            self.stream.send_frame(encode(GroupMessage(group=group)), timeout=0)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.stream.close()
