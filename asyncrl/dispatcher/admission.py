"""The staleness budget: how many more groups may be dispatched now (AReaL's rule).

With B groups per optimizer step, max staleness s and v the policy version that will sample the
prompt, a new prompt is admitted only while

    accepted + running < (s + v + 1) · B

where ``accepted + running`` counts groups dispatched and not dropped (dropped groups never
become a training step, so they free their slot), less those queued to go out again after a
failure (``unsent``): they hold no slot until sent, and are then charged like a new prompt.
The rule counts B groups trained per version; a step that trains fewer (the learner refuses a
copy of a group it trained before, which a restarted buffer can hand out) is charged the
groups it lacks (``short``), or each such step would let that many more run for good. Taken in order, the i-th group is trained at
learner version ⌊i / B⌋ ≤ s + v, so its staleness stays within s and the buffer's gate has
nothing to drop. v is the version the *requesting generator serves* (it says so in its request),
not the learner's: a generator lags the learner by up to the broadcast period, and admitting
against the learner's version let a third of the demo's samples go stale before training.

s is ``buffer.max_staleness`` unless ``dispatcher.ahead_versions`` sets a smaller one: the rule
then keeps that many versions' groups ahead, and each still has the whole bound to be trained
in. Taken in order, groups within the bound are never dropped; a prioritized sampler does not
take them in order, and with the learner the slower side the buffer holds (s + 1) · B groups, of
which the ones it passes over turn stale. A smaller lead leaves it less choice and less to drop.

Filtered groups (``buffer.zero_variance``: every answer scored alike, DAPO's dynamic sampling)
follow the rule of every drop: a group holds its slot from its dispatch until the buffer reports
it dropped, then frees it once (by id, ``Outstanding.settle``: a copy's drop frees nothing more,
and a copy sent again after a failure that is stored after the drop takes the slot back), and
the dispatcher refills the slot with a new prompt charged like any other, at the version of
the generator that asks. That is the one choice that neither over-admits nor starves:

- Never over-admits: ``dispatched - dropped`` counts the groups that may still be trained, and a
  slot is freed only once its group is known never to be, so at every dispatch the trainable
  groups dispatched stay within (s + v + 1) · B exactly as without a filter. The learner's batches
  are full (the buffer hands out B stored groups), so the i-th trainable group is still trained
  at version ⌊i / B⌋ ≤ s + v. Freeing slots ahead of the drops instead, for the share expected to
  be filtered (verl's ``gen_batch_size`` > ``train_batch_size``), lets more than that run
  whenever fewer groups are filtered than expected, and the last ones turn stale.
- Never starves: a filtered group that kept its slot would hold it for good (it is never trained,
  and the bound grows by B per step only as B trainable groups are trained): each one shrinks the
  lead for the rest of the run, and after (s + 1) · B of them the learner waits for groups that
  the dispatcher waits for a version to admit.

The cost: a group to be filtered holds its slot while it is sampled and scored, so with a share p
filtered about (1 - p) · (s + 1) · B trainable groups run ahead, and at s = 0 (synchronous) a step
waits for the refills' round trip, as DAPO waits for its extra generation batches.

Worked example, B = 4, s = 1, generators serving v = 0: the bound is (1 + 0 + 1) · 4 = 8.

    dispatch g0..g7                      dispatched 8,  dropped 0: capacity 8 - 8 = 0
    g2 and g5 answered all alike         dispatched 8,  dropped 2: capacity 8 - 6 = 2
    refill g8, g9 (sampled by v = 0)     dispatched 10, dropped 2: capacity 8 - 8 = 0
    step 1 trains g0 g1 g3 g4            bound 12:                 capacity 12 - 8 = 4

The trainable groups in order are g0 g1 g3 g4 | g6 g7 g8 g9 | ...: the refills are the 7th and
8th, trained by the step from version 1, staleness 1 ≤ s. Had g8 and g9 been sent at dispatch to
cover the expected drops and nobody had been filtered, they would have been the 9th and 10th,
trained from version 2: staleness 2 > s. Had g2 and g5 kept their slots, g8 and g9 never went out,
and the lead stays two groups short for the rest of the run.

Under ``buffer.max_staleness: auto`` the learner moves the bound (``set_bound``, from the buffer's
status, which carries it with the version the gate applies it at). A raise admits more at once; a
lowering admits nothing until the versions catch up, and the groups already out beyond the new
bound are dropped by the gate as stale, which frees their slots like any drop.
"""

from __future__ import annotations


class Admission:
    """The staleness budget, as a pure object the service and the tests share.

    >>> a = Admission(batch_groups=4, max_staleness=1)
    >>> a.capacity()  # (1 + 0 + 1) * 4
    8
    """

    def __init__(self, batch_groups: int, max_staleness: int | None, ahead: int | None = None):
        if batch_groups < 1:
            raise ValueError(f"batch_groups ({batch_groups}) must be >= 1")
        if ahead is not None and (ahead < 0 or (max_staleness is not None and ahead > max_staleness)):
            raise ValueError(f"ahead ({ahead}) must be in [0, max_staleness ({max_staleness})]")
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.lead = ahead
        """``dispatcher.ahead_versions``: the rule's s when set, else the bound."""
        self.ahead = max_staleness if ahead is None else ahead
        """The rule's s: versions of groups dispatched ahead."""
        self.version = 0
        self.dispatched = 0
        self.dropped = 0
        self._buffer_dropped: int | None = None  # the last count the buffer reported
        self.trained_by_version: dict[int, int] = {}
        """Groups each step trained, as reported (a step not heard of counts as B)."""
        self.short_before = 0
        """Groups lacking from the steps folded (``fold``) or restored from a checkpoint."""

    def set_bound(self, max_staleness: int) -> None:
        """The learner set a new staleness bound (``buffer.max_staleness: auto``).

        >>> a = Admission(batch_groups=4, max_staleness=1)
        >>> a.set_bound(3); a.capacity()  # (3 + 0 + 1) * 4
        16
        """
        if max_staleness < 0 or (self.lead is not None and self.lead > max_staleness):
            raise ValueError(f"max_staleness ({max_staleness}) must be >= 0 and >= ahead ({self.lead})")
        self.max_staleness = max_staleness
        self.ahead = max_staleness if self.lead is None else self.lead

    def capacity(self, version: int | None = None, unsent: int = 0) -> int:
        """How many more groups may be dispatched now, to be sampled by ``version`` (default: the
        learner's version, the most any generator can serve), with ``unsent`` groups queued to go
        out again (they hold no slot until sent)."""
        if self.ahead is None:
            return 1 << 30
        v = self.version if version is None else min(version, self.version)
        bound = (self.ahead + v + 1) * self.batch_groups
        return max(0, bound - (self.dispatched - self.dropped - unsent) - self.short())

    def count_trained(self, version: int, groups: int) -> None:
        """The step that produced ``version`` trained ``groups`` groups (a report may repeat)."""
        self.trained_by_version[int(version)] = int(groups)

    def short(self, upto: int | None = None) -> int:
        """Groups the steps (up to version ``upto``) trained fewer than B each."""
        return self.short_before + sum(
            max(0, self.batch_groups - n) for v, n in self.trained_by_version.items() if upto is None or v <= upto
        )

    def fold(self, version: int) -> None:
        """A checkpoint at ``version`` is committed: keep its steps' shortfall as one number."""
        self.short_before = self.short(version)
        self.trained_by_version = {v: n for v, n in self.trained_by_version.items() if v > version}

    def behind(self, version: int, unsent: int = 0) -> bool:
        """True when a generator serving ``version`` gets nothing now but would at the learner's
        version: it should load the newer weights and ask again rather than wait."""
        return version < self.version and self.capacity(version, unsent) == 0 and self.capacity(None, unsent) > 0

    def update(self, version: int, dropped_groups: int | None = None) -> None:
        """The buffer's status: the learner's version and the groups it has dropped so far. That
        count starts again from 0 when a dead buffer is restarted empty, and from its snapshot's
        count after a restore: only its increases are added here."""
        self.version = max(self.version, version)
        if dropped_groups is None:
            return
        last, self._buffer_dropped = self._buffer_dropped, dropped_groups
        if last is None:  # first report: the larger of our own (restored) count and the buffer's
            self.dropped = max(self.dropped, dropped_groups)
        elif dropped_groups >= last:
            self.dropped += dropped_groups - last
        else:  # a buffer restarted empty counts from 0 again
            self.dropped += dropped_groups

    def may_sample(self, version: int) -> bool:
        """Whether groups sampled by ``version`` would be within the staleness bound now."""
        return self.max_staleness is None or self.version - version <= self.max_staleness
