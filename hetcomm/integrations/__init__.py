"""hetcomm's balancing and exact weighting inside other frameworks' training loops:
`hetcomm.integrations.transformers` (a Trainer subclass), `hetcomm.integrations.lightning`
(a DDP strategy), and `BalancedBatches` + the DDP hook for any loop that builds its own
DataLoader (plain accelerate, docs/integrations.md). Each framework is an optional extra:
hetcomm imports without them, and an integration names what to install."""

import importlib
import re
from types import ModuleType

from hetcomm.integrations.batches import BalancedBatches, loader_steps_ahead
from hetcomm.integrations.hook import BalancedHookState, balanced_hook
from hetcomm.integrations.items import count_items, total_items


def require(module: str, extra: str, minimum: str | None = None) -> ModuleType:
    """`module` imported, or ImportError saying which extra installs it."""
    try:
        found = importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"hetcomm.integrations needs {module}: pip install 'hetcomm[{extra}]'") from error
    if minimum is not None and _release(found.__version__) < _release(minimum):
        raise ImportError(f"hetcomm.integrations needs {module} >= {minimum} (found {found.__version__}): "
                          f"pip install 'hetcomm[{extra}]'")
    return found


def _release(version: str) -> tuple[int, ...]:
    """"5.25.0.dev0" -> (5, 25, 0)."""
    return tuple(int(n) for n in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


__all__ = ["BalancedBatches", "BalancedHookState", "balanced_hook", "count_items", "total_items",
           "loader_steps_ahead", "require"]
