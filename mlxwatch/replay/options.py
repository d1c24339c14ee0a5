"""What a replay may be told (``mlxwatch replay``'s options), with their defaults: the config's
where the daemon has one (the door's stall rule, the probe's limits). Cheap to import: the
argument parser shows these defaults in ``--help``."""

from __future__ import annotations

from dataclasses import dataclass

from mlxwatch.config import FrontConfig, ProbeConfig


@dataclass(frozen=True)
class ReplayOptions:
    speed: float = 1.0  # 2.0: the gaps between requests halved
    repeat: int = 1  # the whole sequence this many times (on the same server), until a hang
    stall_timeout: float = FrontConfig.stall_timeout  # the door's rule: no token to anyone this long
    first_token_timeout: float = ProbeConfig.first_token_timeout  # the probe's, cut at stall_timeout
    probe_timeout: float = ProbeConfig.timeout
    endpoint_timeout: float = ProbeConfig.endpoint_timeout
    request_timeout: float = ProbeConfig.timeout  # one replayed request: no byte this long, and it is given up


@dataclass(frozen=True)
class Budget:
    """``--shrink``'s bounds: trials, and time in all."""

    trials: int = 64
    seconds: float = 1800.0
