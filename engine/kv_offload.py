"""KVOffloadConfig: the lower KV tiers of the prefix cache (engine/core/kv_tiers.py), validated.

Cached blocks the pool lets go of are kept in a host-memory tier (pinned on CUDA) and below it a disk tier
(a memory-mapped file per TP rank under `disk_path`); a prefix hit in either is loaded back before prefill."""

from dataclasses import asdict, dataclass
from typing import Any

GIB = 1 << 30


@dataclass(frozen=True)
class KVOffloadConfig:
    host_gib: float = 0.0  # host-memory tier size (0: none)
    disk_path: str | None = None  # folder for the disk tier's files (None: no disk tier)
    disk_gib: float = 0.0  # disk tier size; needs disk_path

    def __post_init__(self) -> None:
        for name in ("host_gib", "disk_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1 << 20:
                raise ValueError(f"EngineConfig.kv_offload.{name} must be a number of GiB >= 0, got {value!r}")
        if self.disk_path is not None and (not isinstance(self.disk_path, str) or not self.disk_path):
            raise ValueError(f"EngineConfig.kv_offload.disk_path must be a folder path, got {self.disk_path!r}")
        if (self.disk_path is None) != (self.disk_gib == 0):
            raise ValueError("EngineConfig.kv_offload.disk_path and disk_gib go together (both set or neither)")
        if not self.host_gib and not self.disk_gib:
            raise ValueError("EngineConfig.kv_offload needs host_gib > 0 or a disk tier (disk_path, disk_gib)")

    @classmethod
    def of(cls, value: "KVOffloadConfig | dict[str, Any] | None") -> "KVOffloadConfig | None":
        """A config from its dict form (YAML, app arguments); unknown keys are refused by name."""
        if value is None or isinstance(value, KVOffloadConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"EngineConfig.kv_offload must be a mapping or None, got {value!r}")
        unknown = set(value) - {"host_gib", "disk_path", "disk_gib"}
        if unknown:
            raise ValueError(f"EngineConfig.kv_offload has unknown fields {sorted(unknown)}")
        return cls(**value)

    def tier_slots(self, block_bytes: int) -> list[tuple[str, int]]:
        """(tier name, number of blocks) from the top tier down, for blocks of `block_bytes`."""
        out = []
        for name, gib in (("host", self.host_gib), ("disk", self.disk_gib)):
            n = int(gib * GIB) // block_bytes
            if gib and n == 0:
                raise ValueError(f"EngineConfig.kv_offload.{name}_gib ({gib}) holds no KV block of {block_bytes} bytes")
            if n:
                out.append((name, n))
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
