"""What a run writes to its directory: one JSON line per step (steps.jsonl), the run's
configuration (run.json) and its summary (summary.json). Only rank 0 writes."""

import json
from pathlib import Path


class RunLog:
    def __init__(self, run_dir: Path, config: dict, resume: bool):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "run.json").write_text(json.dumps(config, indent=1) + "\n")
        # A resumed run appends to the steps it continues; a new run starts the file afresh.
        self._steps = open(self.run_dir / "steps.jsonl", "a" if resume else "w")

    def step(self, record: dict) -> None:
        self._steps.write(json.dumps(record) + "\n")
        self._steps.flush()

    def summary(self, record: dict) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps(record, indent=1) + "\n")

    def close(self) -> None:
        self._steps.close()


def read_steps(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "steps.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no steps.jsonl here; is it a hetcomm run directory?")
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not steps:
        raise ValueError(f"{path}: holds no steps")
    return steps
