"""Rewards. A user's reward function returns a number, a per-token array or ``Unscored(reason)``."""

from asyncrl.rewards.unscored import Unscored

__all__ = ["Unscored"]
