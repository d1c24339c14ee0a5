"""Exact detection distributions from the policy, and the cron workaround's, on a 10 ms grid.

mlxwatch (``mlxwatch/daemon/watcher.py``): after each healthy probe the watcher sleeps
``interval`` x J (J uniform on 0.9..1.1). A fault that starts at a random moment meets the next
probe after R, the residual of a gap of length interval x J (density P(gap > r) / E[gap]:
flat up to 0.9 x interval, then falling linearly to 0 at 1.1 x interval). That probe fails
after d1 (``first_token_timeout`` when the server hangs, a few ms when it refuses or answers
an error), the watcher sleeps ``suspect_interval`` x J, the second probe fails after d2: the
verdict (``failures`` = 2). So

    onset -> verdict = R + d1 + suspect_interval x J + d2

with d1, d2 taken per trial from how the real probes failed in the real-time run (a timeout
becomes the config's ``first_token_timeout``; a fast failure keeps its measured duration). The
later columns (bundle, restart, first healthy probe) are measured costs, added as their
empirical distributions (every measured value equally likely, independent of the phase).

cron: a request every ``period`` s, fixed phase, so the fault meets the next one after
U(0, period); the request fails after ``timeout`` if the server hangs, or after its measured
time if it errors; the restart follows at once (no capture, no check that it worked).

Everything is convolved exactly on a grid (numpy); quantiles come from the resulting CDF.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

DT = 0.01  # seconds per grid step
JITTER = 0.10


@dataclass
class Dist:
    """A probability mass function on the grid 0, DT, 2 DT, ..."""

    pmf: np.ndarray

    @classmethod
    def point(cls, x: float) -> "Dist":
        pmf = np.zeros(int(round(x / DT)) + 1)
        pmf[-1] = 1.0
        return cls(pmf)

    @classmethod
    def empirical(cls, xs: Iterable[float]) -> "Dist":
        xs = [max(0.0, float(x)) for x in xs]
        if not xs:
            raise ValueError("no samples")
        pmf = np.zeros(int(round(max(xs) / DT)) + 1)
        for x in xs:
            pmf[int(round(x / DT))] += 1.0 / len(xs)
        return cls(pmf)

    @classmethod
    def uniform(cls, lo: float, hi: float) -> "Dist":
        n0, n1 = int(round(lo / DT)), int(round(hi / DT))
        pmf = np.zeros(n1 + 1)
        pmf[n0:n1 + 1] = 1.0
        return cls(pmf / pmf.sum())

    @classmethod
    def residual(cls, interval: float, jitter: float = JITTER) -> "Dist":
        """Time from a random moment to the next probe start, gaps interval x U(1-j, 1+j)."""
        lo, hi = interval * (1 - jitter), interval * (1 + jitter)
        r = np.arange(0, int(round(hi / DT)) + 1) * DT
        survival = np.clip((hi - r) / (hi - lo), 0.0, 1.0)  # P(gap > r)
        return cls(survival / survival.sum())

    def __add__(self, other: "Dist") -> "Dist":
        n = len(self.pmf) + len(other.pmf) - 1
        size = 1 << (n - 1).bit_length()
        out = np.fft.irfft(np.fft.rfft(self.pmf, size) * np.fft.rfft(other.pmf, size), size)[:n]
        out = np.clip(out, 0.0, None)
        return Dist(out / out.sum())

    def quantile(self, q: float) -> float:
        cdf = np.cumsum(self.pmf)
        return float(np.searchsorted(cdf, q - 1e-12) * DT)

    def support(self) -> tuple[float, float]:
        nz = np.nonzero(self.pmf > 1e-12)[0]
        return float(nz[0] * DT), float(nz[-1] * DT)

    def mean(self) -> float:
        return float((np.arange(len(self.pmf)) * DT * self.pmf).sum())

    def summary(self) -> dict[str, float]:
        lo, hi = self.support()
        return {"min": lo, "p10": self.quantile(0.10), "median": self.quantile(0.5), "p90": self.quantile(0.90),
                "max": hi, "mean": self.mean()}


def mixture(dists: list[Dist]) -> Dist:
    n = max(len(d.pmf) for d in dists)
    out = np.zeros(n)
    for d in dists:
        out[:len(d.pmf)] += d.pmf / len(dists)
    return Dist(out)


def mlxwatch_detection(interval: float, suspect_interval: float, probe_pairs: list[tuple[float, float]]) -> Dist:
    """onset -> verdict for ``failures`` = 2: R + d1 + suspect x J + d2, mixed over the (d1, d2) seen."""
    base = Dist.residual(interval) + Dist.uniform(suspect_interval * (1 - JITTER), suspect_interval * (1 + JITTER))
    return base + Dist.empirical([d1 + d2 for d1, d2 in probe_pairs])


def cron_detection(period: float, failure_times: list[float]) -> Dist:
    return Dist.uniform(0.0, period) + Dist.empirical(failure_times)


def ks_distance(dist: Dist, samples: list[float]) -> float:
    """Kolmogorov-Smirnov distance between the model and measured samples (a model check)."""
    cdf = np.cumsum(dist.pmf)
    xs = sorted(samples)
    worst = 0.0
    for i, x in enumerate(xs):
        k = min(len(cdf) - 1, max(0, int(round(x / DT))))
        worst = max(worst, abs(cdf[k] - (i + 1) / len(xs)), abs(cdf[k] - i / len(xs)))
    return worst
