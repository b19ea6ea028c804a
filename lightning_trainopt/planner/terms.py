"""The unit of every estimate: one itemised term (what, where, how many bytes, and the formula that gave them)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["CATEGORIES", "LOCATIONS", "PHASES", "MemoryEstimate", "Term", "numel_text"]

CATEGORIES = ("params", "grads", "optimizer_states", "activations", "other")
LOCATIONS = ("device", "cpu", "nvme")
PHASES = ("all", "backward", "step", "in_step", "build")


def numel_text(n: float) -> str:
    """An element count as formulas show it: ``6.74e9`` from a million up, ``12,288`` below."""
    return f"{n / 1e9:.3g}e9" if n >= 1e6 else f"{int(n):,}"


@dataclass(frozen=True)
class Term:
    """One line of a memory derivation.

    Args:
        category: one of :data:`CATEGORIES`.
        location: one of :data:`LOCATIONS`; on a CPU-only run ``device`` is the CPU process's own memory.
        label: what the bytes are (``"bf16 weights"``).
        nbytes: bytes per device (per rank).
        formula: the arithmetic, readable by a user (``"2 B x 6.74e9 / 4"``).
        phase: ``all`` when the bytes live through the whole step; ``backward`` when they exist only while
            activations do (forward end / backward start); ``step`` from the end of backward through the optimizer
            step (gradients under ``zero_grad(set_to_none=True)``); ``in_step`` only inside ``optimizer.step()``
            (DeepSpeed's fp32 gradient partition, foreach temporaries); ``build`` while ``configure_model`` builds the
            model and the strategy takes it over, before the first step: none of the other phases' bytes exist yet, so
            build terms are compared with the step's peak, never added to it.
    """

    category: str
    location: str
    label: str
    nbytes: int
    formula: str = ""
    phase: str = "all"

    @property
    def transient(self) -> bool:
        """Whether a snapshot taken just before ``optimizer.step()`` misses these bytes."""
        return self.phase in ("backward", "in_step")

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"Term.category={self.category!r}: use one of {CATEGORIES}")
        if self.phase not in PHASES:
            raise ValueError(f"Term.phase={self.phase!r}: use one of {PHASES}")
        if self.location not in LOCATIONS:
            raise ValueError(f"Term.location={self.location!r}: use one of {LOCATIONS}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes as a list of itemised :class:`Term` s, with totals by category and location.

    Example::

        est = MemoryEstimate((Term("params", "device", "fp32 weights", 400),))
        est.bytes("params")  # 400
    """

    terms: tuple[Term, ...] = field(default_factory=tuple)

    def __add__(self, other: MemoryEstimate) -> MemoryEstimate:
        return MemoryEstimate(self.terms + other.terms)

    @classmethod
    def of(cls, terms: Iterable[Term]) -> MemoryEstimate:
        """Build from any iterable, dropping zero-byte terms."""
        return cls(tuple(t for t in terms if t.nbytes))

    def bytes(self, category: str | None = None, location: str = "device", resident_only: bool = False) -> int:
        """Sum of the step's terms of ``category`` (all categories when ``None``) held at ``location``.

        Build terms are not part of a step and are left out (:meth:`build_bytes`, :meth:`peak`).

        Args:
            category: one of :data:`CATEGORIES`, or ``None`` for all.
            location: one of :data:`LOCATIONS`.
            resident_only: only what a snapshot just before ``optimizer.step()`` sees (no activations, no
                in-step temporaries).
        """
        return sum(
            t.nbytes
            for t in self.terms
            if t.location == location
            and t.phase != "build"
            and (category is None or t.category == category)
            and not (resident_only and t.transient)
        )

    def _phase(self, phase: str, location: str) -> int:
        return sum(t.nbytes for t in self.terms if t.location == location and t.phase == phase)

    def build_bytes(self, location: str = "device") -> int:
        """Bytes ``location`` holds at the peak of building the model (the ``build`` terms), before any step."""
        return self._phase("build", location)

    def peak(self, location: str = "device") -> int:
        """Predicted peak: the larger of the build and a step, a step being what lives all step plus the larger of
        the backward-phase and step-phase terms."""
        step = self._phase("all", location) + max(
            self._phase("backward", location), self._phase("step", location) + self._phase("in_step", location)
        )
        return max(self.build_bytes(location), step)

    def held(self, location: str) -> int:
        """The most bytes ``location`` holds, counted conservatively: every step term at once, or the build if that
        is larger (host RAM: offloaded states, or FSDP2's full model built in host memory before it is sharded)."""
        return max(self.bytes(location=location), self.build_bytes(location))

    def per_device(self) -> dict[str, int]:
        """``{params, grads, optimizer_states, activations, other, total}`` bytes on the device."""
        out = {c: self.bytes(c) for c in CATEGORIES}
        out["total"] = sum(out.values())
        return out

    def by_location(self, category: str) -> dict[str, int]:
        """``{device, cpu, nvme}`` bytes of one category (the shape of metrics.json ``memory_breakdown``)."""
        return {loc: self.bytes(category, loc) for loc in LOCATIONS}
