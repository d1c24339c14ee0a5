"""Probes: ask a server to do work and record exactly what came back.

Each probe is a coroutine that returns a result (never raises for the server's behaviour) and
enforces its own deadline. ``run_check`` combines them into the verdict the CLI and daemon use.
"""

from mlxwatch.probes.check import CheckReport, WaitedCheck, check_until_healthy, make_client, run_check
from mlxwatch.probes.endpoints import EndpointResult, probe_endpoint
from mlxwatch.probes.generation import (
    PROBE_PROMPT,
    Failure,
    GenerationProbeResult,
    probe_generation,
)

__all__ = [
    "PROBE_PROMPT",
    "CheckReport",
    "EndpointResult",
    "Failure",
    "GenerationProbeResult",
    "WaitedCheck",
    "check_until_healthy",
    "make_client",
    "probe_endpoint",
    "probe_generation",
    "run_check",
]
