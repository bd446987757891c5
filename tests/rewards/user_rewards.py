"""Reward functions as users write them, for tests of ``kind: python`` (imported by the child processes)."""

import asyncio
import os
import time

from asyncrl.rewards import Unscored


def length(completion):
    return len(completion)


async def matches(completion, answer):
    await asyncio.sleep(0.01)
    return float(completion.strip() == answer)


def per_token(completion_ids):
    return [0.5] * len(completion_ids)


def picky(completion, **kwargs):
    if completion == "0":
        return Unscored("no_answer", "the completion is zero")
    print("this goes to stderr, not into the protocol")
    return 1.0


def hangs_on_one(completion):
    if completion == "1":
        time.sleep(60)
    return 1.0


def raises_on_one(completion):
    if completion == "1":
        raise ValueError("boom")
    return 1.0


def dies_on_one(completion):
    if completion == "1":
        os._exit(3)
    return 1.0


def from_row(row, metadata, task, prompt):
    return row["a"] * metadata.get("scale", 1) + (task == "words") + (prompt == "01+02=")


def wrong_type(completion):
    return "one"


def needs_more(completion, reference):
    return 1.0
