"""The reward worker process: groups in, scored (or unscored-with-reason) groups out to the buffer.

One asyncio loop per process scores up to ``reward.concurrency`` groups at once (each reward of
``reward.rewards`` may itself run many HTTP requests per group), so a slow judge does not
serialize the stream. Queues are bounded: at most ``queue_groups`` groups wait to be scored; past
that the worker stops reading its input and ZeroMQ's high-water marks push back on the senders.

**How several workers share the stream (hot plug).** The first worker (``reward-0``, started by
the controller) *owns* the input: it binds the PULL at ``reward_in`` that every generator pushes
to, as before. It also binds a ROUTER at ``reward_share``. A hot-plugged worker
(``asyncrl reward-worker --connect RUN_DIR``) connects a DEALER there and asks for work —
``want_groups {max_groups: free slots}`` — whenever it has room; the owner replies at once with
up to that many groups from its waiting queue (possibly none). So work is pulled, never pushed:

- nothing is queued towards a worker that did not ask, so a worker that leaves or dies loses at
  most what it was already scoring, and a leaving worker loses nothing: on SIGTERM/SIGINT or a
  stop it stops asking, waits for the reply to its last request, finishes and forwards every group
  it holds, reports its final counters to the controller, and exits;
- the owner's ROUTER is ``ROUTER_MANDATORY``: a reply to a peer that has gone raises instead of
  vanishing, and the groups go back to the owner's queue;
- idle workers take work in proportion to their free slots; the owner scores what nobody takes.

What blocks: the owner reading ``reward_in`` (stops while its queue is full), every worker's PUSH
to the buffer (a group waits in the worker, counted as held, until the buffer takes it; intake
pauses meanwhile). What is dropped: nothing in the worker. A group some reward left unscored
(after the HTTP client's retries) is either forwarded unscored — the buffer drops it, counted by
``Group.unscored_reason`` — (``on_failure: drop``) or scored again later, up to
``max_requeues`` times, then forwarded unscored (``on_failure: requeue``). Scored again, the
HTTP rewards re-request only the samples they have not scored yet (the worker keeps their results
with the group; a requeued group the owner hands to a peer is scored whole there).

**One rate budget per API key.** The HTTP rewards' ``concurrency``, ``rpm`` and ``tpm`` hold for
the whole run, not per worker: the owner leases every live worker a share of each budget, and a
dead worker's share goes back to the others (``asyncrl.rewards.budget``).

Which rewards score a group: those of ``reward.by_task[group.task]`` when the config names its
task there (a source of a mix), else ``reward.rewards``.

Ledger (``asyncrl.controller.accounting``): each worker reports ``received`` = samples it took to score
(the owner: from generators, minus what it handed to peers; a peer: what it was handed),
``forwarded`` to the buffer and ``held`` at exit, so the sums over role ``reward`` reconcile with
any number of workers that came and went.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from asyncrl.rewards.base import Reward
from asyncrl.rewards.budget import RateBudgets
from asyncrl.rewards.config import RewardConfig
from asyncrl.rewards.context import RewardContext
from asyncrl.rewards.registry import build_reward
from asyncrl.rewards.worker import RewardWorker

log = logging.getLogger(__name__)


def build_rewards(
    cfg: RewardConfig, task_metadata: dict[str, dict] | None = None, budgets: RateBudgets | None = None
) -> list[tuple[Reward, float]]:
    """The default rewards (``reward.rewards``) with their weights; the HTTP ones draw on ``budgets``."""
    return [(build_reward(spec, task_metadata, budgets), spec.weight) for spec in cfg.rewards]


def build_rewards_by_task(
    cfg: RewardConfig, task_metadata: dict[str, dict] | None = None, budgets: RateBudgets | None = None
) -> dict[str, list[tuple[Reward, float]]]:
    """Each task's own rewards (``reward.by_task``), by task name."""
    return {
        name: [(build_reward(spec, task_metadata, budgets), spec.weight) for spec in specs]
        for name, specs in cfg.by_task.items()
    }


def run_reward_worker(ctx: RewardContext, owner: bool = True) -> None:
    """The controller's reward worker (owner of the input), or a hot-plugged one (``owner=False``)."""
    metadata = ctx.cfg.task.metadata_by_task()
    budgets = RateBudgets()  # one limiter per API key and host, shared by this process's rewards
    rewards = build_rewards(ctx.cfg.reward, metadata, budgets)
    by_task = build_rewards_by_task(ctx.cfg.reward, metadata, budgets)
    worker = RewardWorker(ctx, rewards, owner, by_task, budgets)

    def leave(signum, _frame):
        log.info("%s: signal %d: finishing what it holds, then leaving", ctx.name, signum)
        worker.leave = True

    if not owner:
        signal.signal(signal.SIGTERM, leave)
        signal.signal(signal.SIGINT, leave)
    try:
        asyncio.run(worker.run())
    except BaseException:
        # No final report: a process that reported one has finished, and its exit is not taken
        # for a death, so the controller would neither restart it nor stop the run.
        worker.close()
        raise
    ctx.emit(worker.final_report())
    worker.close()
