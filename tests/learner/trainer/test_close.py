"""A closed trainer gives its DeepSpeed engines back: their hooks and buffers, and with them the
address space the kernel counts when the process forks (``deepspeed_setup.release_engine``)."""

import gc
import os

import pytest

from asyncrl.learner.deepspeed_setup import release_engines
from asyncrl.learner.trainer import PolicyTrainer
from tests.learner.trainer.steps import config

pytestmark = pytest.mark.slow  # DeepSpeed engines

GiB = 1 << 30


def private_writable_bytes() -> int:
    """The process's private writable mappings: what the kernel charges a fork with."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            if "w" in perms and perms.endswith("p"):
                start, end = (int(x, 16) for x in span.split("-"))
                total += end - start
    return total


def test_a_closed_zero3_trainer_gives_its_buckets_back(model_dir, groups):
    release_engines()  # what earlier modules in this process left
    gc.collect()
    before = private_writable_bytes()
    trainer = PolicyTrainer(model_dir, config(3))
    trainer.train_step(groups)
    held = private_writable_bytes() - before
    # DeepSpeed's default reduce buckets, 5e8 fp32 elements twice over, whatever the model's size
    assert held > 1 * GiB, held
    trainer.close()
    del trainer
    gc.collect()
    assert private_writable_bytes() - before < 0.1 * held


def test_engines_not_closed_are_released_all_at_once(model_dir, groups):
    gc.collect()
    before = private_writable_bytes()
    for _ in range(2):
        PolicyTrainer(model_dir, config(3)).train_step(groups)  # dropped, never closed
    gc.collect()
    assert private_writable_bytes() - before > 2 * GiB  # neither was collected
    assert release_engines() == 2
    gc.collect()
    assert private_writable_bytes() - before < 0.5 * GiB
    pid = os.fork()  # the process can still fork
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
