"""The README's "use it in your own script" example runs exactly as written, and trains."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    section = (ROOT / "README.md").read_text().split("## Use it in your own script", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs_and_trains(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the block sets it itself
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out.stdout).groups())
    assert last < 0.2 * first, out.stdout
    assert "PartitionSpec('fsdp', 'tensor')" in out.stdout or "P('fsdp', 'tensor')" in out.stdout, out.stdout
