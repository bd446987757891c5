"""The learner's data-parallel group: this rank's place in it and the collectives asyncrl adds.

DeepSpeed owns the gradient collectives (its all-reduce, reduce-scatter and ZeRO-3 gathers run on
the default process group: gloo on CPUs, NCCL on GPUs). The learner adds a few of its own, on a
gloo group so that they carry CPU tensors and Python objects whatever the backend:

- ``broadcast``: rank 0's order for the next step (``asyncrl.learner.rank_orders``);
- ``all_sum``: per-row results each rank computed for its own rows (reference logprobs, the
  critic's advantages), summed into the whole batch on every rank;
- ``all_gather``: the step's figures, so that every figure is the whole batch's;
- ``barrier``: every rank wrote its part of a checkpoint.

With sequence parallelism (``learner.sequence_parallel: N``) the ranks form groups of N
consecutive ranks (``seq_group``, on the default backend: the attention's all-to-alls carry
device tensors) that share every row of their data-parallel share (``asyncrl.learner.ulysses``):
the batch is cut over the ``data_world = world / N`` data-parallel ranks (``data_rank``), and
a per-row result that every rank of a sequence-parallel group holds is filled in by its first
rank only (``seq_lead``) before ``all_sum``. DeepSpeed still averages gradients over all
``world`` ranks: the N shards' gradients of one row sum to that row's (each rank backpropagates
its own positions), so a loss scaled by ``world`` gives the one-rank gradient as before.

Every collective, DeepSpeed's included, runs inside ``collective(name, version)``, which writes
where this rank is into the group's rendezvous store before it waits. A collective that does not
complete within ``learner.trainer.collective_timeout_s`` (a rank died, hangs, or is stuck on
something else) raises ``CollectiveError`` naming the collective, this rank, the version, and
where every other rank last said it was: the hung one is the one not at the same collective.
The error ends the process; the controller restores the whole group from the last checkpoint,
as for one learner.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a group of several ranks needs it: a group of one stays light
    import torch

WHERE_KEY = "asyncrl/where/{rank}"
"""The rendezvous store's key for where a rank is: the collective it entered last, and the version."""


class CollectiveError(RuntimeError):
    """A learner collective failed or did not complete within the group's timeout."""


@dataclass
class DataParallel:
    """This learner process's rank in a group of ``world``; one rank: every method is a no-op."""

    rank: int = 0
    world: int = 1
    timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks (``learner.trainer.collective_timeout_s``)."""
    control: Any = None
    """The gloo process group of the learner's own collectives (None with one rank)."""
    seq_world: int = 1
    """Ranks per sequence-parallel group (``learner.sequence_parallel``); 1: none."""
    seq_group: Any = None
    """This rank's sequence-parallel process group (None when ``seq_world`` is 1)."""
    _store: Any = field(default=None, repr=False)

    @classmethod
    def of_process(cls, timeout_s: float, sequence_parallel: int = 1) -> DataParallel:
        """The group of this process, once ``torch.distributed`` is initialised (DeepSpeed's
        ``init_distributed``); a gloo group for the learner's collectives and the
        sequence-parallel groups are made here, so every rank must call it, in the same order
        relative to other group creations."""
        import torch

        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            if sequence_parallel != 1:
                raise ValueError(f"learner.sequence_parallel ({sequence_parallel}) needs as many ranks, got 1")
            return cls(timeout_s=timeout_s)
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        if world % sequence_parallel:
            raise ValueError(
                f"learner.sequence_parallel ({sequence_parallel}) must divide the learner's ranks ({world})"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        if torch.distributed.get_backend() == "gloo":
            control = torch.distributed.group.WORLD
        else:  # NCCL carries device tensors only: objects and CPU rows go over gloo
            control = torch.distributed.new_group(backend="gloo", timeout=timeout)
        seq_group = None
        if sequence_parallel > 1:  # every rank makes every group (new_group is collective), keeps its own
            for first in range(0, world, sequence_parallel):
                members = list(range(first, first + sequence_parallel))
                group = torch.distributed.new_group(members, timeout=timeout)
                if rank in members:
                    seq_group = group
        store = None
        with contextlib.suppress(Exception):  # the markers are diagnostics: without a store, none
            store = torch.distributed.distributed_c10d._get_default_store()
        return cls(rank, world, timeout_s, control, sequence_parallel, seq_group, _store=store)

    @property
    def lead(self) -> bool:
        """Rank 0: the rank that talks to the buffer, the generators and the controller."""
        return self.rank == 0

    @property
    def seq_rank(self) -> int:
        """This rank's place in its sequence-parallel group: which 1/N of the positions it holds."""
        return self.rank % self.seq_world

    @property
    def seq_lead(self) -> bool:
        """The first rank of its sequence-parallel group: the one that fills in per-row results."""
        return self.seq_rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel index: which share of the batch's groups it trains."""
        return self.rank // self.seq_world

    @property
    def data_world(self) -> int:
        """Data-parallel ranks: groups of ``seq_world`` ranks that train different rows."""
        return self.world // self.seq_world

    @contextlib.contextmanager
    def collective(self, name: str, version: int) -> Iterator[None]:
        """Run the block (which enters collectives) as ``name`` at ``version``: its failure or
        timeout becomes a ``CollectiveError`` that names the collective and every rank's place."""
        if self.world == 1:
            yield
            return
        self._mark(f"{name} (version {version})")
        try:
            yield
        except CollectiveError:
            raise
        except Exception as e:  # a timeout, or a peer that closed its connection (it died)
            raise CollectiveError(
                f"learner rank {self.rank} of {self.world}: collective '{name}' at version {version} failed "
                f"or exceeded learner.trainer.collective_timeout_s ({self.timeout_s:g} s); "
                f"where each rank last was: {self.whereabouts()}; cause: {type(e).__name__}: {e}"
            ) from e

    def broadcast(self, obj: Any, name: str, version: int) -> Any:
        """Rank 0's ``obj`` on every rank (other ranks pass None)."""
        if self.world == 1:
            return obj
        import torch

        box = [obj]
        with self.collective(name, version):
            torch.distributed.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_sum(self, tensor: torch.Tensor, name: str, version: int) -> torch.Tensor:
        """Sum the CPU ``tensor`` over the ranks, in place (each rank fills its own rows, zeros
        elsewhere: the sum is the whole batch's); returns it."""
        if self.world > 1:
            import torch

            with self.collective(name, version):
                torch.distributed.all_reduce(tensor, group=self.control)
        return tensor

    def all_gather(self, obj: Any, name: str, version: int) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world == 1:
            return [obj]
        import torch

        out: list[Any] = [None] * self.world
        with self.collective(name, version):
            torch.distributed.all_gather_object(out, obj, group=self.control)
        return out

    def barrier(self, name: str, version: int) -> None:
        """Wait until every rank is here."""
        if self.world > 1:
            import torch

            with self.collective(name, version):
                torch.distributed.barrier(group=self.control)

    def whereabouts(self) -> str:
        """Where each rank last said it was (from the rendezvous store), or why that is unknown."""
        if self._store is None:
            return "unknown (no rendezvous store)"
        places = []
        with contextlib.suppress(Exception):  # only on the way out: a dead rank 0 must not hang it
            self._store.set_timeout(datetime.timedelta(seconds=2))
        for rank in range(self.world):
            try:
                place = self._store.get(WHERE_KEY.format(rank=rank)).decode()
            except Exception as e:  # rank 0 hosts the store: when it died, nobody can be asked
                place = f"unknown ({type(e).__name__})"
            places.append(f"rank {rank}: {place}")
        return "; ".join(places)

    def _mark(self, place: str) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(WHERE_KEY.format(rank=self.rank), place)
