"""The layers of hetcomm/ import downwards only: kernels know nothing of distribution,
communication nothing of models, and the loop, the trainer, the planner and the
integrations compose what lies below them. A module may import its own package and any
lower layer's, never a higher one's (found by reading every import statement, so an
import inside a function counts too)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hetcomm"

# Lowest first. A name is a subpackage or a top-level module of hetcomm/.
LAYERS = [
    {"files", "reference", "checks", "amp", "per_rank", "simulated", "_version"},   # tensors and files only
    {"_C", "_extension", "_python_ops", "ops", "triton", "optim"},                   # the operators
    {"comm"},                                                                        # communication
    {"balance"},                                                                     # balancing: numbers
    {"shard"},                                                                       # sharded state
    {"loop"},                                                                        # any model's loop
    {"train", "plan", "integrations", "info", "demo", "cli", "__main__", "__init__"},
]
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_parts(tree: ast.AST) -> set[str]:
    """The hetcomm subpackages and modules a module's imports name."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] if "." in alias.name else "__init__"
                      for alias in node.names if alias.name.split(".")[0] == "hetcomm"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "hetcomm":
            if "." in node.module:
                found.add(node.module.split(".")[1])
            else:   # from hetcomm import ops: the module if there is one, else hetcomm/__init__
                found |= {alias.name if alias.name in LAYER else "__init__" for alias in node.names}
    return found


def upward_imports() -> list[str]:
    faults = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(path)
        for name in sorted(imported_parts(ast.parse(path.read_text(), str(path)))):
            if LAYER[name] > LAYER[part]:
                faults.append(f"{path.relative_to(PACKAGE.parent)} ({part}) imports hetcomm.{name}")
    return faults


def test_every_part_of_the_package_has_a_layer():
    parts = {part_of(p) for p in PACKAGE.rglob("*.py")}
    assert parts <= set(LAYER), f"give these a layer in LAYERS: {sorted(parts - set(LAYER))}"


def test_no_module_imports_a_higher_layer():
    assert upward_imports() == []


def test_an_upward_import_is_found():
    """The check itself: the import that used to run from shard up to loop is named."""
    tree = ast.parse("def f():\n    from hetcomm.loop.checkpoint import read\n")
    assert imported_parts(tree) == {"loop"} and LAYER["loop"] > LAYER["shard"]
    assert imported_parts(ast.parse("from hetcomm import ops, WeightedReducer")) == {"ops", "__init__"}
