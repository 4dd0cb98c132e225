"""Ablation switches of the paper's §5.4: disable one mechanism at a time.

- ``load_aware=False`` ("No-load-aware"): the estimated queueing time is removed from the joint
  score, so ``Tq`` and the capacity price ``lambda`` (computed from ``Tq``) are taken as 0.
- ``cross_region=False`` ("No-xregion-reuse"): the paper "disables cross-region lookups and
  forwarding", so remote matches count as 0 *and* remote workers are not eligible; requests
  stay in their region (if the edge's region has no worker at all, remote workers stay eligible
  without matches, since the request must go somewhere).
- ``tier_aware=False`` ("Tier-blind"): DRAM hits are priced like VRAM hits (no ``gamma`` reload).
- ``migration=False`` ("No-KV-migration"): the hot-prefix migration planner never plans.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Ablation", "FULL"]


@dataclass(frozen=True, slots=True)
class Ablation:
    load_aware: bool = True
    cross_region: bool = True
    tier_aware: bool = True
    migration: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"Ablation.{f.name} must be a bool, got {getattr(self, f.name)!r}")

    @classmethod
    def without(cls, *mechanisms: str) -> Ablation:
        """``Ablation.without("load_aware")``: everything on except the named mechanisms."""
        names = {f.name for f in fields(cls)}
        for name in mechanisms:
            if name not in names:
                raise ValueError(f"unknown mechanism {name!r} (expected one of: {', '.join(sorted(names))})")
        return cls(**{name: False for name in mechanisms})

    @property
    def disabled(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if not getattr(self, f.name))


FULL = Ablation()
