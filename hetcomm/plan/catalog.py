"""The planner's database of GPUs and interconnects: the built-in tables (devices.csv,
links.csv), users' own files that correct or extend them, and lookup by any common
spelling of a name, including what torch.cuda.get_device_name() and nvidia-smi print."""

import csv
import difflib
import importlib.resources
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetcomm.amp import PRECISIONS

DEVICE_COLUMNS = ("name", "label", "aliases", "architecture", "capability", "fp32_tflops", "fp16_tflops",
                  "bf16_tflops", "tensor_cores", "memory_gib", "bandwidth_gbs")
LINK_COLUMNS = ("name", "label", "aliases", "scope", "bandwidth_gbs", "latency_us")
_EXPECTED_HEADERS = (f"expected the devices header\n  {','.join(DEVICE_COLUMNS)}\n"
                     f"or the links header\n  {','.join(LINK_COLUMNS)}")

# Words that vendors and drivers put in front of a model name, or leave out, inconsistently.
_BRAND_WORDS = frozenset({"nvidia", "geforce", "tesla", "quadro"})
_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")

# A bandwidth given directly instead of an interconnect's name: "10gbit", "25Gbit/s@20us", "3.2GB/s".
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?"
_CUSTOM_LINK = re.compile(rf"(?P<bandwidth>{_NUMBER})\s*(?P<unit>gbit/s|gbit|gbps|gb/s)"
                          rf"(?:\s*@\s*(?P<latency>{_NUMBER})\s*us)?", re.IGNORECASE)
_CUSTOM_LATENCY_US = 30.0


@dataclass(frozen=True)
class Device:
    """One GPU model's public peak figures (boost clock, dense math)."""

    name: str
    label: str
    aliases: tuple[str, ...]
    architecture: str
    capability: tuple[int, int]
    fp32_tflops: float
    fp16_tflops: float
    bf16_tflops: float | None
    tensor_cores: bool
    memory_gib: float
    bandwidth_gbs: float
    source: str  # "built-in" or the path of the user file that defined it

    def peak_tflops(self, precision: str) -> float:
        """Peak rate of the math that training in this precision runs on (fp32, fp16 or bf16)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
        if precision == "bf16" and self.bf16_tflops is None:
            major, minor = self.capability
            raise ValueError(f"{self.name} ({self.label}) has no native bf16 (compute capability {major}.{minor}, "
                             f"bf16 needs 8.0); use fp16 or fp32")
        return getattr(self, f"{precision}_tflops")


@dataclass(frozen=True)
class Link:
    """An interconnect's effective all-reduce bandwidth per rank and its latency per message."""

    name: str
    label: str
    aliases: tuple[str, ...]
    scope: str  # "node", "network", or "custom" for a bandwidth given directly
    bandwidth_gbs: float
    latency_us: float
    source: str  # "built-in", the path of the user file that defined it, or "custom"


class UnknownName(ValueError):
    """A GPU or interconnect name that matches nothing in the catalog."""


def normalise(text: str) -> str:
    """The key names are matched by: lowercase, brand words and punctuation dropped,
    so "NVIDIA GeForce RTX 2080 Ti", "rtx-2080ti" and "RTX 2080 Ti" are all "rtx2080ti"."""
    return "".join(word for word in re.split(r"[^a-z0-9]+", text.lower()) if word not in _BRAND_WORDS)


class Catalog:
    """The GPUs and interconnects the planner knows, by canonical name, in database order."""

    devices: dict[str, Device]
    links: dict[str, Link]

    def __init__(self, devices: dict[str, Device], links: dict[str, Link]):
        self.devices = devices
        self.links = links
        self._device_keys = _index(devices, "GPU")
        self._link_keys = _index(links, "interconnect")

    def device(self, text: str) -> Device:
        return self.devices[_find(text, self._device_keys, self.devices, "GPU")]

    def link(self, text: str) -> Link:
        """An interconnect by name, or one given directly as a bandwidth (see _custom_link)."""
        custom = _custom_link(text)
        if custom is not None:
            return custom
        return self.links[_find(text, self._link_keys, self.links, "interconnect",
                                "; or give a bandwidth, like 10Gbit/s or 1.2GB/s@30us")]


def load_catalog(extra_files: Sequence[str | os.PathLike] = ()) -> Catalog:
    """The built-in tables, then the files named in HETCOMM_DEVICES (separated by
    os.pathsep), then extra_files. Each file holds devices or links, as its header says;
    a row whose name is already known replaces the earlier one, so users can correct a
    figure without copying the whole table."""
    devices: dict[str, Device] = {}
    links: dict[str, Link] = {}
    tables = {DEVICE_COLUMNS: (devices, _device), LINK_COLUMNS: (links, _link)}
    # Through importlib.resources rather than a path, so that it works from a wheel or a zip.
    builtin = importlib.resources.files("hetcomm") / "plan"
    for filename in ("devices.csv", "links.csv"):
        _read_table(builtin.joinpath(filename).read_text(encoding="utf-8"), f"built-in {filename}", "built-in",
                    tables)
    user_files = [(path, "file named in HETCOMM_DEVICES")
                  for path in os.environ.get("HETCOMM_DEVICES", "").split(os.pathsep) if path]
    user_files += [(path, "device file") for path in extra_files]
    for path, origin in user_files:
        try:
            with open(path, encoding="utf-8-sig", newline="") as file:  # -sig: spreadsheets write a BOM
                text = file.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"{origin} {os.fspath(path)!r} does not exist") from None
        _read_table(text, os.fspath(path), os.fspath(path), tables)
    return Catalog(devices, links)


def _index(entries: dict, kind: str) -> dict[str, str]:
    """Every spelling's key -> canonical name. Two rows answering to one key would make
    lookup depend on row order, so that is an error naming both."""
    keys: dict[str, str] = {}
    for entry in entries.values():
        for spelling in (entry.name, entry.label, *entry.aliases):
            key = normalise(spelling)
            if not key:  # a label of brand words only; the name always has a key
                continue
            owner = keys.setdefault(key, entry.name)
            if owner != entry.name:
                raise ValueError(f"{kind} {owner!r} ({entries[owner].source}) and {kind} {entry.name!r} "
                                 f"({entry.source}) both answer to {spelling!r}; rename one, or remove the alias")
    return keys


def _find(text: str, keys: dict[str, str], entries: dict, kind: str, also: str = "") -> str:
    key = normalise(text)
    if key in keys:
        return keys[key]
    # Many keys map to one name: rank all close keys, keep the first three distinct names.
    # A cutoff of 0.5 lets a one-character slip in a two-character name ("t5") find "t4".
    close = difflib.get_close_matches(key, keys, n=len(keys), cutoff=0.5)
    nearest = list(dict.fromkeys(keys[match] for match in close))[:3]
    if nearest:
        hint = "nearest known: " + ", ".join(f"{name} ({entries[name].label})" for name in nearest)
    else:
        hint = "known: " + ", ".join(entries)
    raise UnknownName(f"unknown {kind} {text!r}; {hint}{also}")


def _custom_link(text: str) -> Link | None:
    """A bandwidth given directly: Gbit, Gbit/s or Gbps for gigabits, GB/s (capital B)
    for gigabytes per second, optionally followed by @<latency>us. Figures are taken as
    given, with no allowance for protocol overhead. None if text is not of this form."""
    match = _CUSTOM_LINK.fullmatch(text.strip())
    if match is None:
        return None
    unit = match["unit"]
    if unit.lower() == "gb/s" and unit != "GB/s":
        raise ValueError(f"interconnect {text!r}: {unit!r} could mean gigabits or gigabytes; "
                         f"write Gbit/s or GB/s")
    bandwidth = float(match["bandwidth"]) / (1 if unit == "GB/s" else 8)
    latency = float(match["latency"]) if match["latency"] else _CUSTOM_LATENCY_US
    if not (math.isfinite(bandwidth) and bandwidth > 0 and math.isfinite(latency) and latency > 0):
        raise ValueError(f"interconnect {text!r}: bandwidth and latency must be positive")
    return Link(name=text, label=f"{bandwidth:g} GB/s, {latency:g} us", aliases=(), scope="custom",
                bandwidth_gbs=bandwidth, latency_us=latency, source="custom")


class _Row:
    """One data row, so that every complaint names its file, line and column."""

    def __init__(self, where: str, line: int, values: dict[str, str]):
        self.where, self.line, self.values = where, line, values

    def error(self, column: str, expected: str) -> ValueError:
        return ValueError(f"{self.where}:{self.line}: column {column!r} = {self.values[column]!r}: expected {expected}")

    def name(self) -> str:
        value = self.values["name"]
        if not (_NAME.fullmatch(value) and normalise(value)):
            raise self.error("name", "lowercase letters, digits and '-', not only a brand word")
        return value

    def text(self, column: str) -> str:
        if not self.values[column]:
            raise self.error(column, "a non-empty text")
        return self.values[column]

    def aliases(self) -> tuple[str, ...]:
        aliases = tuple(alias.strip() for alias in self.values["aliases"].split(";") if alias.strip())
        if not all(normalise(alias) for alias in aliases):
            raise self.error("aliases", "names separated by ';', each with more than brand words and punctuation")
        return aliases

    def number(self, column: str) -> float:
        try:
            value = float(self.values[column])
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise self.error(column, "a positive number")
        return value

    def choice(self, column: str, options: tuple[str, ...]) -> str:
        value = self.values[column].lower()
        if value not in options:
            raise self.error(column, " or ".join(options))
        return value


def _device(row: _Row, source: str) -> Device:
    capability = re.fullmatch(r"(\d+)\.(\d+)", row.values["capability"])
    if capability is None:
        raise row.error("capability", "major.minor, like 6.1")
    return Device(name=row.name(), label=row.text("label"), aliases=row.aliases(),
                  architecture=row.text("architecture"), capability=(int(capability[1]), int(capability[2])),
                  fp32_tflops=row.number("fp32_tflops"), fp16_tflops=row.number("fp16_tflops"),
                  bf16_tflops=row.number("bf16_tflops") if row.values["bf16_tflops"] else None,
                  tensor_cores=row.choice("tensor_cores", ("yes", "no")) == "yes",
                  memory_gib=row.number("memory_gib"), bandwidth_gbs=row.number("bandwidth_gbs"), source=source)


def _link(row: _Row, source: str) -> Link:
    return Link(name=row.name(), label=row.text("label"), aliases=row.aliases(),
                scope=row.choice("scope", ("node", "network")), bandwidth_gbs=row.number("bandwidth_gbs"),
                latency_us=row.number("latency_us"), source=source)


def _read_table(text: str, where: str, source: str, tables: dict[tuple[str, ...], tuple[dict, Callable]]) -> None:
    """Reads one CSV file into the table its header names; where is what errors call it."""
    header = table = parse = None
    defined_on: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        # csv has no comments; these files explain themselves in lines starting with '#'.
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cells = [cell.strip() for cell in next(csv.reader([line]))]
        if header is None:
            if tuple(cells) not in tables:
                raise ValueError(f"{where}:{number}: unknown header {','.join(cells)}; {_EXPECTED_HEADERS}")
            header = tuple(cells)
            table, parse = tables[header]
            continue
        if len(cells) < len(header):
            missing = ", ".join(repr(column) for column in header[len(cells):])
            raise ValueError(f"{where}:{number}: missing column(s) {missing}")
        if len(cells) > len(header):
            raise ValueError(f"{where}:{number}: {len(cells) - len(header)} extra column(s) after {header[-1]!r}")
        entry = parse(_Row(where, number, dict(zip(header, cells))), source)
        # Replacing is for a later file; the same name twice in one file is a slip.
        if entry.name in defined_on:
            raise ValueError(f"{where}:{number}: {entry.name!r} is already defined on line {defined_on[entry.name]}")
        defined_on[entry.name] = number
        table[entry.name] = entry
    if header is None:
        raise ValueError(f"{where}: no header row; {_EXPECTED_HEADERS}")
