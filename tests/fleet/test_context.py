"""The process context satisfies the interface each role declares of it, and so does a generator
loop's context in a process of several loops."""

import threading

import pytest

from asyncrl.buffer.context import BufferContext
from asyncrl.config import RunConfig, dump_config
from asyncrl.dispatcher.context import DispatcherContext
from asyncrl.fleet.context import ProcessContext
from asyncrl.generators.context import GeneratorContext
from asyncrl.generators.multiplex import LoopContext, _Merged
from asyncrl.learner.context import LearnerContext
from asyncrl.rewards.context import RewardContext
from asyncrl.wire.endpoints import Endpoints

PROTOCOLS = {
    "dispatcher": DispatcherContext,
    "generator": GeneratorContext,
    "reward": RewardContext,
    "buffer": BufferContext,
    "learner": LearnerContext,
}


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCRL_RESUME", raising=False)
    (tmp_path / "config.yaml").write_text(dump_config(RunConfig()))
    Endpoints.allocate().save(tmp_path)
    return tmp_path


@pytest.mark.parametrize("role", sorted(PROTOCOLS))
def test_the_process_context_has_every_member_its_role_declares(run_dir, role):
    ctx = ProcessContext(role, f"{role}-0", run_dir)
    try:
        assert isinstance(ctx, PROTOCOLS[role])
        members = [m for m in vars(PROTOCOLS[role]) if not m.startswith("_")]
        members += list(PROTOCOLS[role].__annotations__)
        assert all(hasattr(ctx, m) for m in members), [m for m in members if not hasattr(ctx, m)]
    finally:
        ctx.close()


def test_a_generator_loops_context_is_a_generator_context_and_forwards_nothing_else(run_dir):
    parent = ProcessContext("generator", "generator-0", run_dir)
    try:
        ctx = LoopContext(parent, "generator-3", _Merged(["generator-3"]), threading.Lock(), threading.Event())
        assert isinstance(ctx, GeneratorContext)
        assert not hasattr(ctx, "resume_dir")  # what the loop does not declare, it cannot reach
    finally:
        parent.close()
