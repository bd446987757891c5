"""The ``agent`` section of the run's config: episodes played by an agent program through the
OpenAI-compatible gateway (``asyncrl.generators.gateway``). Declarations only."""

from __future__ import annotations

from pydantic import Field, field_validator

from asyncrl.configbase import Config


class AgentConfig(Config):
    """An agent program plays each episode; its model calls go through the gateway."""

    command: list[str] | None = None
    """The program's argv, e.g. ``["python", "agents/solve.py"]``, started once per episode with
    the task on stdin and the gateway's URL and token in its environment. None: no agent."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Seconds an episode may last, model calls included; past it the program's process group is
    killed and the episode is unscored, reason ``agent_timeout``."""
    host: str = "127.0.0.1"
    """Address the gateway binds to. The loopback default keeps it to programs on this machine;
    another address exposes the policy to whoever can reach it (each episode still needs its token)."""
    port: int = Field(0, ge=0, le=65535)
    """Port the gateway binds to; 0: any free port (agents get the URL, never guess it)."""
    max_calls: int = Field(64, ge=1)
    """Model calls one episode may make; a call past it is refused (400)."""
    max_request_bytes: int = Field(4 << 20, ge=1024)
    """Largest request body the gateway reads; a larger one is refused (413)."""

    @field_validator("command")
    @classmethod
    def _not_empty(cls, command: list[str] | None) -> list[str] | None:
        if command is not None and (not command or not command[0]):
            raise ValueError(f"command ({command!r}) must name a program (a non-empty argv list) or be None")
        return command
