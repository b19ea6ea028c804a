"""Activations saved for backward stored as int8 with per-block scales, dequantised in backward."""

from __future__ import annotations

from typing import Any

from lightning_trainopt.callbacks.activation_offload import _SavedTensorsTransformCallback
from lightning_trainopt.transforms.compression import Int8Compressor

__all__ = ["ActivationCompression"]

# The Hydra node of conf/activations/int8.yaml: activations.activation_compression.<argument>.
KEY_PREFIX = "activations.activation_compression"


class ActivationCompression(_SavedTensorsTransformCallback):
    """8-bit compression of saved activations through ``saved_tensors_hooks`` (lossy: gradients change slightly).

    Floating-point activations of at least ``min_numel`` elements are stored as int8 codes plus one fp32 scale per
    ``block_size`` elements (``1 + 4 / block_size`` bytes per element instead of 4 in fp32 or 2 in bf16);
    parameters, integer tensors and small tensors are kept as they are. Combine with
    :class:`ActivationCheckpointing` freely: inside checkpointed regions checkpointing's own hooks apply, and the
    region inputs it keeps are compressed.

    Args:
        bits: only 8.
        block_size: elements per scale.
        min_numel: smallest storage worth compressing (elements).
        max_abs: storages holding a non-finite value or one of at least this magnitude (attention-mask values such
            as ``finfo.min``) are kept uncompressed: int8 blocks cannot represent them (see :class:`Int8Compressor`).

    Raises:
        ConfigError: ``bits`` other than 8, or a size that is not a positive integer.
        IncompatibleConfigError: used together with :class:`ActivationOffload`.

    Example::

        trainer = Trainer(callbacks=[ActivationCompression(bits=8)])
    """

    name = "activation_compression"

    def __init__(self, bits: int = 8, block_size: int = 64, min_numel: int = 1024, max_abs: float = 1e4) -> None:
        super().__init__()
        self.bits = bits
        self.block_size = block_size
        self.min_numel = min_numel
        self.max_abs = max_abs
        self.transform: Int8Compressor = self.make_transform()  # validates the arguments now

    def make_transform(self) -> Int8Compressor:
        return Int8Compressor(
            bits=self.bits,
            block_size=self.block_size,
            min_numel=self.min_numel,
            max_abs=self.max_abs,
            key_prefix=KEY_PREFIX,
        )

    def summary(self) -> dict[str, Any]:
        """``{"activation_compression": {bits, block_size, compressed_storages, shared_views, passed, out_of_range}}``.

        Totals over the fit; ``passed`` counts every saved tensor kept as it was, ``out_of_range`` those of them kept
        because they held a non-finite value or one of magnitude ``>= max_abs``.
        """
        return {
            "activation_compression": {
                "bits": self.bits,
                "block_size": self.block_size,
                "compressed_storages": self.transform.n_compressed,
                "shared_views": self.transform.n_shared,
                "passed": self.transform.n_passed,
                "out_of_range": self.transform.n_out_of_range,
            }
        }
