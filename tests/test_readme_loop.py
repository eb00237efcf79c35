"""The README's complete hetcomm.loop program runs as printed, on 4 CPU workers."""

import ast
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_s_training_loop_runs_as_printed(tmp_path):
    text = README.read_text()
    section = text.index("## Your own training loop")
    start = text.index("```python\n", section) + len("```python\n")
    program = tmp_path / "loop.py"
    program.write_text(text[start:text.index("```", start)])
    run = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    loss, split = run.stdout.strip().splitlines()[-1].split(", split ")
    assert float(loss.removeprefix("loss ")) < 1.0   # it learned (about 4.2 at the start)
    assert sum(ast.literal_eval(split)) == 64
