"""The reward worker process: groups in from generators, scored groups out to the buffer.

Input is a PULL socket (bound), so any number of generators push to it; output is a PUSH to the
buffer, which blocks while the buffer applies backpressure. A frame that does not decode to a
valid group (malformed, other schema, NaN logprobs, oversized) is rejected by the receiver,
counted, and logged once; the worker keeps serving.

On stop it drains: it keeps scoring until its input has been silent for ``reward.drain_s``, so
nothing the generators sent before they exited is left behind.
"""

from __future__ import annotations

import logging
import time

from pydantic import Field

from asyncrl.configbase import Config
from asyncrl.metrics import REWARD_SECONDS, SAMPLES
from asyncrl.rewards.rules import score_group
from asyncrl.transport import StreamReceiver, StreamSender
from asyncrl.wire import encode_group

log = logging.getLogger(__name__)


class RewardConfig(Config):
    drain_s: float = Field(1.0, gt=0)
    """On stop, seconds of silence on the input after which the worker has drained and exits."""


def run_reward_worker(ctx) -> None:
    inbox = StreamReceiver(ctx.endpoints.reward_in, name="reward.in")
    outbox = StreamSender(ctx.endpoints.buffer_in, name="reward.out")
    received = forwarded = 0
    ctx.emit("ready")
    last_input = time.monotonic()
    while True:
        stopping = ctx.stop_requested()
        if stopping and time.monotonic() - last_input > ctx.cfg.reward.drain_s:
            break
        msg = inbox.recv(timeout=0.1)
        if msg is None:
            continue
        last_input = time.monotonic()
        kind, body = msg
        if kind != "group":
            continue
        group = score_group(body["group"])
        received += len(group.samples)
        REWARD_SECONDS.observe(group.reward_s)
        outbox.send_until_taken(encode_group(group), ctx.cfg.generator.send_timeout_s)  # backpressure: wait, never drop
        forwarded += len(group.samples)
        SAMPLES.labels("scored").inc(len(group.samples))
    ctx.emit("final", received=received, forwarded=forwarded, held=received - forwarded, rejected_frames=inbox.rejected)
    inbox.close()
    outbox.close()
