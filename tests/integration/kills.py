"""Killing a running pipeline's processes at chosen learner steps (the resilience tests)."""

import os
import signal

from tests.waits import wait_until


def kill_at_steps(controller, plan, killed):
    """SIGKILL the named process once the learner has taken that many steps (of this history)."""
    for step, name in plan:
        wait_until(
            lambda step=step: (
                controller.progress.steps_seen >= step
                and controller.supervisor.training
                and not controller.supervisor.restart_due
            ),
            f"the learner's step {step} with no restart due, to kill {name}",
            timeout=600,
            interval=0.05,
        )
        os.kill(controller.fleet.pid(name), signal.SIGKILL)
        killed.append(name)
