"""The cluster string: machines separated by commas, the card groups of one machine
joined by "+", a group being an optional count and a GPU name.

    "2x1080ti,1xv100,4xt4"      three machines: two 1080 Ti, one V100, four T4
    "2x1080ti+1xv100,4xt4"      two machines: the 1080 Tis and the V100 share one

Cards of one machine talk over its internal link (PCIe, NVLink), machines over the
network; the ring all-reduce runs at the pace of the slowest link it crosses."""

import re
from dataclasses import dataclass

from hetcomm.plan.catalog import Catalog, Device

_GROUP = re.compile(r"^(?:(\d+)\s*[x×*]\s*)?(\S.*?)$")
MAX_DEVICES = 1_000_000


@dataclass(frozen=True)
class ClusterDevice:
    device: Device
    node: int


def parse_cluster(text: str, catalog: Catalog) -> list[ClusterDevice]:
    """The devices of `text`, machine by machine, in the order written (that order is
    the ranks'). ValueError naming the part at fault; unknown names suggest the
    nearest known ones."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("--cluster is empty: expected cards such as \"2x1080ti,1xv100,4xt4\"")
    devices: list[ClusterDevice] = []
    for node, machine in enumerate(text.split(",")):
        if not machine.strip():
            raise ValueError(f"--cluster {text!r}: machine {node + 1} is empty (two commas, or a trailing one)")
        for group in machine.split("+"):
            match = _GROUP.match(group.strip())
            if not match:
                raise ValueError(f"--cluster {text!r}: {group.strip()!r} is not COUNTxNAME (e.g. 4xt4) or NAME")
            count = int(match.group(1)) if match.group(1) else 1
            if count < 1:
                raise ValueError(f"--cluster {text!r}: {group.strip()!r} has a count of {count}; expected 1 or more")
            if len(devices) + count > MAX_DEVICES:
                raise ValueError(f"--cluster {text!r}: more than {MAX_DEVICES:,} devices")
            try:
                device = catalog.device(match.group(2))
            except ValueError as error:
                raise ValueError(f"--cluster {text!r}: {error}") from None
            devices.extend([ClusterDevice(device, node)] * count)
    return devices
