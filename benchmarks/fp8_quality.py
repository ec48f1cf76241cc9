"""fp8 against bf16 on the main job: experiments/charlm.py's default GPT trained ``--steps`` steps per precision.

    python benchmarks/fp8_quality.py                 # 400 steps x (bf16, fp8, fp8_current): about 25 minutes (2-core CPU)
    python benchmarks/fp8_quality.py --steps 2 --extra --num-layers 1 --eval-batches 1   # smoke test

Each run is ``experiments/charlm.py --steps N --precision P`` (same seed, the default data=2 x fsdp=2 x tensor=2
mesh of simulated CPU devices) in its own process; the final validation loss (nats/character, ``4 x
--eval-batches`` batches) is read from its ``metrics.jsonl``. The JSON gives each precision's loss, its gap to
bf16 (fp8 minus bf16: positive is worse) and the run's wall time. On CPU XLA emulates the fp8 matmuls (the
operands are fp8 values, converted to float32), so the losses are fp8's and the times are not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxpar.tools.metrics import read_jsonl  # noqa: E402

PRECISIONS = ("bf16", "fp8", "fp8_current")


def final_val_loss(out_dir: Path) -> float:
    rows = [r for r in read_jsonl(out_dir / "metrics.jsonl") if r.get("split") == "val"]
    return float(rows[-1]["loss"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more charlm flags (last)")
    args = ap.parse_args(argv)
    out = {"steps": args.steps, "extra": args.extra, "date": time.strftime("%Y-%m-%d"), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.precisions:
            start = time.perf_counter()
            cmd = [sys.executable, str(ROOT / "experiments" / "charlm.py"), "--steps", str(args.steps), "--precision",
                   p, "--out-dir", f"{tmp}/{p}", "--sample-chars", "1", *args.extra]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            out["runs"][p] = {"val_loss": round(final_val_loss(Path(tmp) / p), 4),
                              "wall_s": round(time.perf_counter() - start, 1)}
    if "bf16" in out["runs"]:
        base = out["runs"]["bf16"]["val_loss"]
        out["gap_vs_bf16"] = {p: round(r["val_loss"] - base, 4) for p, r in out["runs"].items() if p != "bf16"}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
