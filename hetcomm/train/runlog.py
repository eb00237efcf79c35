"""What a run writes to its directory: one JSON line per step (steps.jsonl), the run's
configuration (run.json) and its summary (summary.json). Only rank 0 writes."""

import json
import os
from pathlib import Path


class RunLog:
    """resume_step: the step a resumed run continues from; the steps the run had logged
    from there on (after the checkpoint it resumes, before it was stopped) are dropped,
    so that every step is logged once. None: a new run, which starts the log afresh."""

    def __init__(self, run_dir: Path, config: dict, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "run.json").write_text(json.dumps(config, indent=1) + "\n")
        (self.run_dir / "summary.json").unlink(missing_ok=True)   # written again when this run ends
        path = self.run_dir / "steps.jsonl"
        if resume_step is not None and path.is_file():
            kept = [line for line in path.read_text().splitlines() if _step_before(line, resume_step)]
            temporary = path.with_name(".steps.jsonl.tmp")
            temporary.write_text("".join(line + "\n" for line in kept))
            os.replace(temporary, path)
        self._steps = open(path, "a" if resume_step is not None else "w")

    def step(self, record: dict) -> None:
        self._steps.write(json.dumps(record) + "\n")
        self._steps.flush()

    def summary(self, record: dict) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps(record, indent=1) + "\n")

    def close(self) -> None:
        self._steps.close()


def _step_before(line: str, step: int) -> bool:
    """Whether a log line is a step record of a step before `step` (a line cut short by
    a kill is no record)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] < step


def read_steps(run_dir: Path, required: tuple[str, ...] = ()) -> list[dict]:
    """The step records of a run. ValueError naming the file and the line when one is
    not a JSON object, lacks a key of `required`, or does not follow the step before
    (a step logged twice: a log appended to by a resumed run that did not cut it back)."""
    path = Path(run_dir) / "steps.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no steps.jsonl here; is it a hetcomm run directory?")
    steps = [_step_record(path, number, line, required)
             for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not steps:
        raise ValueError(f"{path}: holds no steps")
    for number, (before, record) in enumerate(zip(steps, steps[1:]), 2):
        if "step" in record and "step" in before and record["step"] != before["step"] + 1:
            raise ValueError(f"{path}, record {number}: step {record['step']} follows step {before['step']}; "
                             f"each step must be logged once, in order")
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
