"""Does a score measure the weights it is recorded against? Two checks over the eval samples.

1. The weight version averaged over every eval token equals the expected version ``v``.
2. The fraction of eval samples whose tokens carry more than one version, or a version
   other than ``v``, is zero.

The first alone is fooled by tokens from ``v - 1`` and ``v + 1`` averaging to ``v``; the
second alone cannot say by how much a score is off. A router that spreads requests over
a fleet where one engine still holds older weights fails both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles.eval.result import VERSION_MISMATCH, EvalSkipped
from miles.interfaces import EngineClient
from miles.types import Sample


@dataclass(frozen=True)
class VersionStats:
    mean_weight_version: float | None  # None: no eval token carries a version
    mixed_version_fraction: float | None  # None: no samples

    def check(self, version: int) -> None:
        """Raise ``EvalSkipped(version_mismatch)`` unless both conditions hold for ``version``."""
        if self.mean_weight_version is None or self.mixed_version_fraction is None:
            raise EvalSkipped(
                VERSION_MISMATCH,
                f"no eval token carries a weight version, so the score cannot be tied to version {version}",
                mean_weight_version=self.mean_weight_version,
                mixed_version_fraction=self.mixed_version_fraction,
            )
        problems = []
        if abs(self.mean_weight_version - version) > 1e-9:
            problems.append(f"the mean weight version of the eval tokens is {self.mean_weight_version:g}")
        if self.mixed_version_fraction > 0:
            problems.append(
                f"{self.mixed_version_fraction:.1%} of the eval samples have tokens off version {version} "
                "or from several versions"
            )
        if problems:
            raise EvalSkipped(
                VERSION_MISMATCH,
                f"expected every eval token on weight version {version}, but " + " and ".join(problems),
                mean_weight_version=self.mean_weight_version,
                mixed_version_fraction=self.mixed_version_fraction,
            )


def version_stats(samples: Sequence[Sample], version: int) -> VersionStats:
    """The two numbers of the checks for ``samples`` scored as weight version ``version``."""
    tokens = [v for s in samples for v in s.weight_versions]
    mean = sum(tokens) / len(tokens) if tokens else None
    off = sum(1 for s in samples if any(v != version for v in s.weight_versions))
    # "More than one version" is covered: a sample with two versions has one that is not `version`.
    fraction = off / len(samples) if samples else None
    return VersionStats(mean_weight_version=mean, mixed_version_fraction=fraction)


async def verify_engine_versions(engines: Sequence[EngineClient], version: int, *, what: str) -> None:
    """Every engine must report ``version`` before it is trusted to score it.

    A router spreads eval requests over the whole fleet, so one engine left on older
    weights would mix two versions into one score; this catches it before any sampling.
    """
    import asyncio

    from miles.eval.result import ENGINE_ERROR

    got = await asyncio.gather(*(e.weight_version() for e in engines), return_exceptions=True)
    failed = [f"{e.url}: {v}" for e, v in zip(engines, got, strict=True) if isinstance(v, BaseException)]
    if failed:
        raise EvalSkipped(ENGINE_ERROR, f"cannot read the weight version of {what}(s): {'; '.join(failed)}")
    wrong = [f"{e.url} reports {v}" for e, v in zip(engines, got, strict=True) if v != version]
    if wrong:
        raise EvalSkipped(
            VERSION_MISMATCH,
            f"expected every {what} on weight version {version}, but {', '.join(wrong)}",
        )
