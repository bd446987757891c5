"""Keep serving the starting weights while the held-out round before RL runs beside training.

With ``eval.overlap_before`` the controller says go at once and scores the starting weights
beside the first learner steps, instead of holding every process until that round is done. The
round must still score version 0, so the controller's go carries ``hold_weights_s``: the
generator applies no publication (they wait in its subscription, the newest kept) until the
controller's ``ReleaseWeightsCommand`` says the round is over, or for at most that many seconds
(the round's own bound, which the controller computes from its request timeouts: past it the
round has failed anyway). Meanwhile the generator samples with version 0, as it would have
before go; the learner trains on those samples within the staleness bound, so an on-policy run
(``buffer.max_staleness: 0``) waits for the release after its first step and an asynchronous
one goes on for up to ``max_staleness`` steps.
"""

from __future__ import annotations

import logging
import time

from asyncrl.generators.context import GeneratorContext

log = logging.getLogger(__name__)


class WeightsHold:
    """Whether a publication may be applied now: ``held()`` reads the context's go and release.

    >>> from asyncrl.wire.messages import GoCommand
    >>> class Ctx: name, go_command, weights_released = "generator-0", None, False
    >>> now = [0.0]
    >>> hold = WeightsHold(Ctx, clock=lambda: now[0])
    >>> hold.held()                                      # no go yet: nothing published to hold
    False
    >>> Ctx.go_command = GoCommand(hold_weights_s=30.0); hold.held()
    True
    >>> Ctx.weights_released = True; hold.held()         # the round is answered
    False
    >>> Ctx.weights_released = False; hold = WeightsHold(Ctx, clock=lambda: now[0])
    >>> hold.held(), (now.__setitem__(0, 31.0), hold.held())[1]   # past its bound: released by itself
    (True, False)
    """

    def __init__(self, ctx: GeneratorContext, clock=time.monotonic):
        self.ctx = ctx
        self.clock = clock
        self.until: float | None = None
        """``clock()`` at which the hold ends by itself, once the go that asked for it came."""
        self.over = False

    def held(self) -> bool:
        if self.over:
            return False
        go = self.ctx.go_command
        if go is None:
            return False
        if go.hold_weights_s <= 0 or self.ctx.weights_released:
            self.over = True
            if go.hold_weights_s > 0:
                log.info("%s: the round before RL is answered: applying publications again", self.ctx.name)
            return False
        if self.until is None:
            self.until = self.clock() + go.hold_weights_s
            log.info(
                "%s: serving the starting weights until the round before RL is answered (at most %.0f s)",
                self.ctx.name,
                go.hold_weights_s,
            )
        if self.clock() < self.until:
            return True
        self.over = True
        log.warning(
            "%s: the starting weights were not released within %.0f s (the round's bound): applying publications",
            self.ctx.name,
            go.hold_weights_s,
        )
        return False
