"""The process roles of a run, declared once: every list of roles in the package derives from
``ROLES`` (the entry point's choices, which role binds which address, the start and stop orders,
the placement sections, the roles a process can join a run in).

``ROLES`` is in dataflow order, the order a sample moves in and the order the run stops in (each
stage drains into the next before that one stops). The start order is ``start``: the roles that
bind addresses first, receivers of the stream before its senders, the generators (which only
connect) last. A role's entry function is named by its dotted path, so this table imports no role
and each process imports only its own (vLLM and DeepSpeed load where they are used).

    >>> [role.name for role in ROLES]
    ['dispatcher', 'generator', 'reward', 'buffer', 'learner', 'reference']
    >>> [role.name for role in start_order()]
    ['buffer', 'reward', 'dispatcher', 'learner', 'reference', 'generator']
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    """One kind of component process."""

    name: str
    """The role's name: in ``asyncrl.fleet.child ROLE``, events' ``role``, placement sections."""
    entry: str
    """``module:function`` of its main loop, called with its context (and the model directory
    when ``takes_model``)."""
    takes_model: bool
    """Whether the entry function takes the model directory after the context."""
    binds: tuple[str, ...]
    """The ``asyncrl.wire.endpoints.Endpoints`` fields it binds (every other process connects)."""
    start: int
    """Its place in the start order (0 first)."""
    joinable: bool = False
    """A process of it can join a running run by address (``asyncrl generator|reward-worker --connect``)."""
    optional: bool = False
    """Started only when the run's config asks for it (the reference: ``algorithm.kl.reference: process``)."""


ROLES: tuple[Role, ...] = (
    Role(
        "dispatcher",
        "asyncrl.dispatcher.process:run_dispatcher",
        takes_model=True,
        binds=("dispatcher",),
        start=2,
    ),
    Role(
        "generator",
        "asyncrl.generators.multiplex:run_generator_process",
        takes_model=True,
        binds=(),
        start=5,
        joinable=True,
    ),
    Role(
        "reward",
        "asyncrl.rewards.process:run_reward_worker",
        takes_model=False,
        binds=("reward_in", "reward_share"),  # the owner reward worker's
        start=1,
        joinable=True,
    ),
    Role(
        "buffer",
        "asyncrl.buffer.process:run_buffer",
        takes_model=False,
        binds=("buffer_in", "buffer_requests", "buffer_status"),
        start=0,
    ),
    Role(
        "learner",
        "asyncrl.learner.process:run_learner",
        takes_model=True,
        binds=("weights", "weights_stream"),
        start=3,
    ),
    Role(
        "reference",
        "asyncrl.learner.reference:run_reference",
        takes_model=True,
        binds=("reference",),
        start=4,
        optional=True,
    ),
)
"""Every role, in dataflow order."""

ROLE_NAMES: tuple[str, ...] = tuple(role.name for role in ROLES)
"""The names of ``ROLES``, in dataflow order."""

JOINABLE: tuple[str, ...] = tuple(role.name for role in ROLES if role.joinable)
"""Roles a process can join a running run in by address."""


def role(name: str) -> Role:
    """The role called ``name``."""
    for r in ROLES:
        if r.name == name:
            return r
    raise ValueError(f"role ({name!r}) must be one of {', '.join(ROLE_NAMES)}")


def start_order() -> list[Role]:
    """Every role, in the order a run starts them."""
    return sorted(ROLES, key=lambda r: r.start)


def _check(roles: tuple[Role, ...]) -> None:
    starts = sorted(r.start for r in roles)
    if starts != list(range(len(roles))):
        raise ValueError(f"the roles' start places ({starts}) must be 0..{len(roles) - 1}, each once")
    if len(set(ROLE_NAMES)) != len(roles):
        raise ValueError(f"role names ({ROLE_NAMES}) must be distinct")


_check(ROLES)
