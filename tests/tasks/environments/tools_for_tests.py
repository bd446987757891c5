"""Tool functions as a configuration names them, for the tests of ``ToolRunner`` (imported by its child)."""

import asyncio
import os
import time


def add(a, b):
    return a + b


def echo(text):
    return text


async def later(text):
    await asyncio.sleep(0.01)
    return {"text": text, "n": len(text)}


def fails(message):
    raise ValueError(message)


def hangs():
    time.sleep(60)


def exits():
    os._exit(3)


def hogs(mib):
    return len(bytearray(mib << 20))


def a_set():
    return {1, 2}


def pid():
    return os.getpid()
