"""FSDP2's gathered units: what ``fully_shard`` holds unsharded on a rank during forward and backward.

Read in torch 2.13 ``distributed/fsdp/_fully_shard/`` (``_fsdp_param_group.py``, ``_fsdp_collectives.py``,
``_fsdp_state.py``) for the units ``parallel/fsdp.py``'s ``apply_fully_shard`` makes: one per wrapped block, then one
root unit for the parameters outside every block (embedding, final norm, output head), all with
``reshard_after_forward=True`` passed explicitly (so torch's "the root does not reshard" default does not apply).

- ``unshard`` allocates the unit's all-gather output (the whole unit: ``world`` x its padded shards);
  ``wait_for_unshard`` copies it out into per-parameter unsharded tensors (the whole unit again). In backward the
  all-gather output is freed right after the copy-out; ``pre_backward`` then prefetches the next unit of the backward
  order (``_backward_prefetch``): its all-gather output is live while the current unit computes.
- Backward writes each parameter's full gradient (the unit's size, parameter dtype); ``post_backward`` reshards,
  copies the gradients into a reduce-scatter input of the unit's size and frees them, and keeps that input
  (``reduce_scatter_states``, ``reduce_scatter_max_input_buffers`` 1) until the next unit's ``post_backward``.
- The root unit's ``post_backward`` runs once backward has finished (its forward inputs are token ids): the root stays
  gathered through the whole backward, and the output head's full gradient, made first, lives as long.

So while block ``i`` computes its gradients a rank holds: the root unit and the head's gradient, block ``i``'s
parameters and gradients, block ``i-1``'s prefetched all-gather output and block ``i+1``'s reduce-scatter input:
four block units at once (three with 2 blocks, two with 1). With ``reshard_after_forward=False`` every unit stays
gathered from its forward to its backward and nothing is re-gathered. Forward holds less (the root, the current
block and two all-gather outputs). Mixed precision keeps the parameters' dtype here (no ``MixedPrecisionPolicy``:
Lightning autocasts), so gathered parameters and gradients take the weights' bytes.
Checked against the allocations of a 2-process gloo run in ``bench/planner_fsdp.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_trainopt.planner.terms import Term
from lightning_trainopt.planner.terms import numel_text as _gb

__all__ = ["FSDPUnits", "gpt_fsdp_units"]


@dataclass(frozen=True)
class FSDPUnits:
    """A model's FSDP2 units, in parameter elements.

    Args:
        blocks: elements of each wrapped block, in forward order.
        root: elements of the parameters outside every block (the root unit).
        head: elements of the root-unit parameters whose gradient backward makes first (the output head).

    Example::

        FSDPUnits(blocks=(803_328,) * 4, root=131_328, head=65_536)
    """

    blocks: tuple[int, ...]
    root: int = 0
    head: int = 0

    @classmethod
    def per_parameter(cls, numels: Sequence[int]) -> FSDPUnits:
        """Each parameter its own unit and no root unit: the fallback when the model's modules are unknown."""
        return cls(blocks=tuple(numels))

    def gathered_terms(self, param_bytes: int, grad_bytes: int, reshard_after_forward: bool = True) -> list[Term]:
        """The unsharded parameters, gradients and reduce-scatter inputs at the backward peak (``backward`` terms).

        Args:
            param_bytes: bytes per element of the parameters (and of the all-gather buffers).
            grad_bytes: bytes per element of the gradients (and of the reduce-scatter input).
            reshard_after_forward: the units free their gathered parameters after forward.
        """
        n_blocks = len(self.blocks)
        big = max(self.blocks, default=0)
        terms = [
            Term(
                "other",
                "device",
                "FSDP2 root unit gathered through backward",
                param_bytes * self.root,
                f"{param_bytes} B x {_gb(self.root)} (embedding, final norm, head)",
                phase="backward",
            ),
            Term(
                "other",
                "device",
                "FSDP2 head's full gradient (reduced after backward)",
                grad_bytes * self.head,
                f"{grad_bytes} B x {_gb(self.head)}",
                phase="backward",
            ),
        ]
        # While block i computes: its parameters and full gradients, block i-1's prefetched all-gather output (from
        # the 2nd block on) and block i+1's reduce-scatter input (up to the last block): 2, 3 or 4 units.
        neighbours = min(max(n_blocks - 1, 0), 2)
        if reshard_after_forward:
            param_numel = (1 + min(neighbours, 1)) * big if n_blocks else 0
            label = "FSDP2 block units gathered (computing + prefetched)"
            param_formula = f"{param_numel // big if big else 0} x {param_bytes} B x {_gb(big)} (largest block)"
            grad_units = (1 + neighbours - min(neighbours, 1)) if n_blocks else 0
        else:
            # Every block stays gathered from its forward to its backward; nothing is prefetched.
            param_numel = sum(self.blocks)
            label = "FSDP2 block units gathered (every block: reshard_after_forward=False)"
            param_formula = f"{param_bytes} B x {_gb(param_numel)}"
            grad_units = (1 + min(neighbours, 1)) if n_blocks else 0
        terms.append(Term("other", "device", label, param_bytes * param_numel, param_formula, phase="backward"))
        terms.append(
            Term(
                "other",
                "device",
                "FSDP2 block gradients (computing + kept reduce-scatter input)",
                grad_bytes * grad_units * big,
                f"{grad_units} x {grad_bytes} B x {_gb(big)} (largest block)",
                phase="backward",
            )
        )
        return terms


def gpt_fsdp_units(
    vocab_size: int, d_model: int, kv_dim: int, ffn_hidden: int, n_layers: int, tie_embeddings: bool
) -> FSDPUnits:
    """The units ``apply_fully_shard(shard_modules=["Block"])`` makes of :class:`~lightning_trainopt.models.GPT`."""
    d = d_model
    block = 2 * d * d + 2 * d * kv_dim + 3 * d * ffn_hidden + 2 * d
    head = vocab_size * d
    root = head + d + (0 if tie_embeddings else head)
    return FSDPUnits(blocks=(block,) * n_layers, root=root, head=head)
