"""The one table of GPU figures: every datasheet number jaxpar uses (MFU peaks, the planner's roofline, GPU targets).

Each :class:`Datasheet` row holds one GPU's per-GPU figures, each from a named NVIDIA document (:data:`SOURCES`):
dense (no structured sparsity) bf16 and fp8 tensor-core peaks in FLOP/s (NVIDIA prints twice these "with
sparsity"), HBM capacity in bytes (the datasheet's GB = 1e9 bytes) and bandwidth in bytes/s, the NVLink bandwidth
of one GPU to the others of its host and the InfiniBand bandwidth of one GPU across hosts, both per direction in
bytes/s (NVIDIA prints NVLink as both directions together: 900 GB/s is 450 GB/s each way; the InfiniBand figure
is the DGX systems' one ConnectX NIC per GPU). ``target_config`` names the XLA ``GpuTargetConfigProto`` text
file shipped in ``jaxpar/tools/target_configs/`` that :func:`jaxpar.plan.gpu_target` compiles for.

Readers: :func:`jaxpar.tools.metrics.datasheet_peak_flops` (a device's ``device_kind`` -> bf16 peak),
:data:`jaxpar.tools.metrics.GPU_DATASHEETS` / :func:`jaxpar.plan.gpu` (planning names) and
:func:`jaxpar.plan.gpu_target`. Names are lower case; old names (``h100-80gb``, ``a100-80gb``) are aliases.
"""

from __future__ import annotations

import dataclasses
import re

# The documents the figures come from (NVIDIA datasheets and DGX user guides).
SOURCES: dict[str, str] = {
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 312 TFLOPS bf16, 2,039 GB/s, NVLink 600 GB/s); "
            "DGX A100 user guide (one ConnectX-6 HDR 200 Gb/s NIC per GPU)",
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (SXM: 989 TFLOPS bf16, 1,979 fp8, 80 GB, 3.35 TB/s, NVLink "
            "900 GB/s; PCIe: 756 / 1,513, 2 TB/s, NVLink bridge 600 GB/s; NVL: 835 / 1,671, 94 GB, 3.9 TB/s, NVLink "
            "bridge 600 GB/s); DGX H100 user guide (one ConnectX-7 400 Gb/s NIC per GPU)",
    "h200": "NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS bf16, 1,979 fp8, 141 GB, 4.8 TB/s, NVLink "
            "900 GB/s; NVL: 835 / 1,671, NVLink bridge 900 GB/s); DGX H200 user guide (one ConnectX-7 400 Gb/s NIC "
            "per GPU)",
    "b200": "NVIDIA DGX B200 datasheet (8 GPUs: 72 PFLOPS fp8 and 36 PFLOPS bf16 with sparsity, 1,440 GB HBM3e, "
            "64 TB/s, NVLink 5 at 1.8 TB/s per GPU, 8 ConnectX-7 400 Gb/s NICs): per GPU 2.25 PFLOPS bf16 and "
            "4.5 PFLOPS fp8 dense, 180 GB, 8 TB/s",
}


@dataclasses.dataclass(frozen=True)
class Datasheet:
    """One GPU's figures (per GPU; FLOP/s dense; bytes; bytes/s per direction). ``fp8_flops`` is None for a GPU
    without fp8 tensor cores; ``infiniband_bytes_per_s`` None for a part with no DGX system (no NIC per GPU);
    ``target_config`` None where no XLA target file ships. ``kind`` is the regular expression matched (case
    insensitive, as a word) against a device's ``device_kind`` (``"NVIDIA H100 80GB HBM3"``)."""
    name: str
    aliases: tuple[str, ...]
    kind: str
    bf16_flops: float
    fp8_flops: float | None
    memory_bytes: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    infiniband_bytes_per_s: float | None
    source: str = dataclasses.field(repr=False)
    target_config: str | None = None

    def matches(self, device_kind: str) -> bool:
        """Whether ``device_kind`` (a jax device's) is this GPU."""
        return re.search(rf"\b{self.kind}\b", device_kind, re.IGNORECASE) is not None


# Matched against device kinds in this order: the specific parts (NVL, PCIe) before the family's SXM row.
DATASHEETS: tuple[Datasheet, ...] = (
    Datasheet("h200-nvl", (), "H200 NVL", 835e12, 1671e12, 141e9, 4.8e12, 450e9, None, SOURCES["h200"]),
    Datasheet("h200", ("h200-sxm",), "H200", 989e12, 1979e12, 141e9, 4.8e12, 450e9, 50e9, SOURCES["h200"],
              "h200.txtpb"),
    Datasheet("h100-nvl", (), "H100 NVL", 835e12, 1671e12, 94e9, 3.9e12, 300e9, None, SOURCES["h100"]),
    Datasheet("h100-pcie", (), "H100 PCIe", 756e12, 1513e12, 80e9, 2.0e12, 300e9, None, SOURCES["h100"]),
    Datasheet("h100", ("h100-80gb", "h100-sxm"), "H100", 989e12, 1979e12, 80e9, 3.35e12, 450e9, 50e9,
              SOURCES["h100"], "h100_sxm.txtpb"),
    Datasheet("a100", ("a100-80gb", "a100-sxm"), "A100", 312e12, None, 80e9, 2.039e12, 300e9, 25e9, SOURCES["a100"],
              "a100_sxm_80.txtpb"),
    Datasheet("b200", (), "B200", 2.25e15, 4.5e15, 180e9, 8e12, 900e9, 50e9, SOURCES["b200"], "b200.txtpb"),
)


def names() -> list[str]:
    """Every accepted name (row names and aliases), sorted."""
    return sorted(n for d in DATASHEETS for n in (d.name, *d.aliases))


def datasheet(name: str) -> Datasheet:
    """The row named ``name`` (or one of its aliases; case insensitive).

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    key = name.lower() if isinstance(name, str) else name
    for d in DATASHEETS:
        if key == d.name or key in d.aliases:
            return d
    raise ValueError(f"GPU {name!r} is not in the datasheet table; use one of {names()}")


def for_device_kind(device_kind: str) -> Datasheet | None:
    """The first row whose ``kind`` matches ``device_kind`` (e.g. ``"NVIDIA H100 PCIe"`` -> ``h100-pcie``), or
    None (a CPU, an unlisted GPU)."""
    return next((d for d in DATASHEETS if d.matches(device_kind)), None)


__all__ = ["DATASHEETS", "Datasheet", "SOURCES", "datasheet", "for_device_kind", "names"]
