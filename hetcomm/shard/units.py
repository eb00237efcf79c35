"""The layer units of a fully sharded model: the groups of parameters gathered and freed
together. A unit is a module whose forward uses only its own parameters (a transformer
block); whatever no unit holds (embeddings, a tied head, the final norm, parameters
used functionally in the model's own forward) forms the root unit, which the model's
own forward and backward hold gathered throughout."""

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class UnitPlan:
    """modules[u] owns params[u]; unit 0 is the root (the model itself)."""

    modules: tuple[nn.Module, ...]
    params: tuple[tuple[nn.Parameter, ...], ...]

    def flat_order(self) -> list[nn.Parameter]:
        """The trained parameters in unit order, so that every unit is one contiguous
        range of the flat parameter space."""
        return [p for unit in self.params for p in unit]


def default_units(model: nn.Module) -> list[nn.Module]:
    """The blocks of the model's largest nn.ModuleList (by parameter count): the
    transformer blocks of a GPT, Llama or BERT. None found: the whole model is one unit."""
    best, best_count = None, 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            count = sum(p.numel() for p in module.parameters())
            if count > best_count:
                best, best_count = module, count
    return list(best) if best is not None else []


def plan_units(model: nn.Module, trained: Sequence[nn.Parameter], units: Sequence[nn.Module] | None,
               who: str) -> UnitPlan:
    """Assigns each trained parameter to the first unit holding it (a parameter shared by
    two units, or held by no unit, goes to the root). Raises ValueError naming the unit
    that is not a submodule of the model, appears twice, or holds no trained parameter."""
    units = default_units(model) if units is None else list(units)
    submodules = {id(m) for m in model.modules()}
    seen: set[int] = set()
    for index, unit in enumerate(units):
        if not isinstance(unit, nn.Module) or unit is model or id(unit) not in submodules:
            raise ValueError(f"{who}: units[{index}] is not a submodule of the model (a {type(unit).__name__}); "
                             f"expected its layer modules, e.g. list(model.blocks)")
        if id(unit) in seen:
            raise ValueError(f"{who}: units[{index}] appears twice; expected each layer module once")
        seen.add(id(unit))
    trained_ids = {id(p) for p in trained}
    holders: dict[int, int] = {}
    for index, unit in enumerate(units):
        for p in unit.parameters():
            if id(p) in trained_ids:
                holders[id(p)] = -1 if id(p) in holders else index   # held by two units: the root's
    owned: list[list[nn.Parameter]] = [[] for _ in range(len(units) + 1)]
    for p in trained:
        owned[holders.get(id(p), -1) + 1].append(p)
    for index, params in enumerate(owned[1:]):
        if not params:
            raise ValueError(f"{who}: units[{index}] ({type(units[index]).__name__}) holds no trained parameter "
                             f"of its own; leave it out")
    return UnitPlan((model, *units), tuple(tuple(params) for params in owned))
