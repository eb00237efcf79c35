"""`hetcomm plan --precision`: one precision for every card, or one per kind of card.

    auto                      each card by hetcomm.amp's policy (what `hetcomm train` does)
    fp16                      every card in fp16
    v100=fp16,1080ti=fp32     those kinds as given, the others by the policy
    fp32,v100=fp16            the V100s in fp16, every other card in fp32

Kinds are catalog names or any of their spellings ("1080 Ti", "rtx-2080ti"); tf32 is
fp32 with Ampere's TF32 matmuls, which the planner can cost (the trainer keeps fp32).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from hetcomm.amp import precision_for_capability
from hetcomm.plan.catalog import Catalog, Device, UnknownName
from hetcomm.plan.cost import PLAN_PRECISIONS, math_of

CHOICES = ("auto", *PLAN_PRECISIONS)


@dataclass(frozen=True)
class PrecisionChoice:
    default: str = "auto"
    by_device: dict[str, str] = field(default_factory=dict)   # catalog name -> precision

    def for_device(self, device: Device) -> str:
        """The precision `device` computes in; ValueError naming the card when it lacks
        the hardware for it (bf16 or tf32 before sm_80)."""
        chosen = self.by_device.get(device.name, self.default)
        if chosen == "auto":
            return precision_for_capability(device.capability)
        try:
            math_of(device, chosen)
        except ValueError as error:
            raise ValueError(f"--precision {chosen}: {error}") from None
        return chosen


def _checked(text: str, value: str) -> str:
    value = value.strip().lower()
    if value not in CHOICES:
        raise ValueError(f"--precision {text!r}: {value!r} is not one of {', '.join(CHOICES)}")
    return value


def parse_precision(text: str, catalog: Catalog, cluster_devices: Sequence[Device] = ()) -> PrecisionChoice:
    """The choice `text` writes (see the module docstring). ValueError naming the part
    at fault: an unknown precision or card, a card named twice or absent from the
    cluster, two defaults."""
    default, by_device = None, {}
    present = {device.name for device in cluster_devices}
    for part in text.split(","):
        if not part.strip():
            raise ValueError(f"--precision {text!r}: an empty entry (two commas, or a trailing one)")
        name, equals, value = part.partition("=")
        if not equals:
            if default is not None:
                raise ValueError(f"--precision {text!r}: two precisions for every card ({default!r} and "
                                 f"{part.strip()!r}); name the cards, as v100=fp16")
            default = _checked(text, name)
            continue
        try:
            device = catalog.device(name.strip())
        except UnknownName as error:
            raise ValueError(f"--precision {text!r}: {error}") from None
        if device.name in by_device:
            raise ValueError(f"--precision {text!r}: {device.name} is given twice")
        if present and device.name not in present:
            raise ValueError(f"--precision {text!r}: {device.name} is not in --cluster "
                             f"({', '.join(sorted(present))})")
        by_device[device.name] = _checked(text, value)
    return PrecisionChoice(default or "auto", by_device)
