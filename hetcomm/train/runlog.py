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


def read_steps(run_dir: Path, required: tuple[str, ...] = ()) -> list[dict]:
    """The step records of a run. ValueError naming the file and the line when one is
    not a JSON object or lacks a key of `required`."""
    path = Path(run_dir) / "steps.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no steps.jsonl here; is it a hetcomm run directory?")
    steps = [_step_record(path, number, line, required)
             for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not steps:
        raise ValueError(f"{path}: holds no steps")
    return steps


def _step_record(path: Path, number: int, line: str, required: tuple[str, ...]) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}, line {number}: not JSON ({error})") from None
    if not isinstance(record, dict):   # the file's content is wrong, not an argument's type: ValueError
        raise ValueError(f"{path}, line {number}: expected a JSON object (a step's record)")  # noqa: TRY004
    missing = [key for key in required if key not in record]
    if missing:
        raise ValueError(f"{path}, line {number}: the step's record has no {', '.join(missing)}")
    return record
