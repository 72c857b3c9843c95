"""The app's `admission` and `request_router` arguments: pydantic models built from the cluster layer's own
dataclasses (AdmissionConfig, RouterConfig), so each setting is declared once, in cluster/. Each model takes its
dataclass's fields, less those the app fills in, plus `enabled` (false: that part is off). An unknown field fails
validation naming it; the dataclass's rules (watermark order, ranges) are checked by AppArgs, naming the field."""

import dataclasses
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.routing import RouterConfig

# how admission and the KV-aware router rank replicas: set once, under request_router; admission ranks with the
# same values (whether or not the KV-aware router is enabled), so it reserves where the router sends
RANKING = ("affinity_weight", "headroom_weight", "queue_weight", "lora_affinity")


class Switchable(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = True

    def settings(self) -> dict[str, Any]:
        """The dataclass's fields this model holds, as keyword arguments."""
        return self.model_dump(exclude={"enabled"})


def switchable(name: str, cls: type, exclude: tuple[str, ...], doc: str) -> type[Switchable]:
    """A Switchable holding the fields of dataclass `cls` except `exclude`, with the dataclass's defaults."""
    hints = get_type_hints(cls)
    fields: dict[str, Any] = {
        f.name: (
            hints[f.name],
            f.default if f.default_factory is dataclasses.MISSING else Field(default_factory=f.default_factory),
        )
        for f in dataclasses.fields(cls)
        if f.name not in exclude
    }
    return create_model(name, __base__=Switchable, __doc__=doc, **fields)


AdmissionArgs = switchable(
    "AdmissionArgs",
    AdmissionConfig,
    ("block_size", *RANKING),
    "The admission actor (cluster/admission_controller.py); enabled false: none, routers admit every request.",
)
RequestRouterArgs = switchable(
    "RequestRouterArgs",
    RouterConfig,
    ("block_size",),
    "The KV-aware request router (cluster/routing.py); enabled false: Ray Serve's default router.",
)
