"""Batch-axis communication of the pipelined GPT train step, read from its compiled HLO, and its step time.

    python benchmarks/pipeline_comm.py [--microbatches 4 16] [--meshes dpt dpf] [--time] [--paths step action]

Prints one JSON object. For each mesh (``dpt``: data=2 x pipe=2 x tensor=2; ``dpf``: data=2 x pipe=2 x fsdp=2),
each number of microbatches ``m`` and each communication path, the GPT train step
(``jp.train.make_train_step(Pipeline(model.embed, model.stage, model.head_loss, one_f_one_b(2, m)), sgd)``,
4 layers, d_model 64, microbatch of 8 rows x 16 tokens) is compiled and its optimized HLO read
(:func:`collectives`):

* every collective (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute), whether it runs
  inside the pipeline's tick loop (a ``while`` body, or a computation called from one) or outside, the mesh
  axes its replica groups span (device ``i`` of a group is ``mesh.devices.flat[i]``), its bytes (the larger
  of its operand and result: a reduce-scatter is counted by what it reduces, an all-gather by what it
  gathers) and its executed bytes per step, op bytes times the trip counts of the loops around it (a
  collective inside a ``lax.switch`` branch of the tick is counted on every tick: an upper bound);
* ``grad_in_loop``: the non-scalar all-reduces / reduce-scatters over a batch axis (``data``, ``fsdp``) inside
  a loop, that is the per-microbatch gradient reductions the step-once path removes (scalar loss and
  metric reductions are left out: they may stay in the loop).

Paths (the private ``_comm`` switch of :class:`jaxpar.pipeline.Pipeline`, the runtime's ``comm`` argument):
``action`` is the old path (``shard_map`` manual over ``pipe`` only: GSPMD reduces the data-parallel
gradient inside every backward action), ``step`` the new one with ``fsdp_gather='step'``, ``step-action``
with ``fsdp_gather='action'``. ``--time`` also times each step (median of 5 after 2 warm-ups) side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax

import jaxpar as jp
from jaxpar.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=61, num_layers=4, num_heads=4, d_model=64, max_seq_len=16)
MICROBATCH_ROWS = 8
MESHES = {"dpt": {"data": 2, "pipe": 2, "tensor": 2}, "dpf": {"data": 2, "pipe": 2, "fsdp": 2}}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1,
                "s64": 8, "u64": 8, "s16": 2, "u16": 2}
PATHS = {"action": {"_comm": "action"}, "step": {"fsdp_gather": "step"}, "step-action": {"fsdp_gather": "action"}}


def _shape_bytes(text: str) -> int:
    """Bytes of every ``dtype[dims]`` in ``text`` (a tuple shape sums its parts)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _computations(hlo: str) -> dict[str, list[str]]:
    """``{computation name: its instruction lines}`` of an HLO module's text."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif name is not None and line.startswith(" "):
            comps[name].append(line.strip())
    return comps


def _multipliers(comps: dict[str, list[str]]) -> dict[str, tuple[int, int]]:
    """``{computation: (times it runs per step, loop depth)}``: a while body runs its trip count times
    (``known_trip_count``) per run of its caller; other called computations once."""
    calls: dict[str, list[tuple[str, int, int]]] = {c: [] for c in comps}
    for caller, lines in comps.items():
        for line in lines:
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            body = re.search(r"body=%?([\w.\-]+)", line)
            callees = re.findall(r"(?:to_apply|calls|condition|body|true_computation|false_computation)=%?([\w.\-]+)",
                                 line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                callees += [c.strip().lstrip("%") for c in group.split(",")]
            for c in callees:
                if c in comps:
                    is_body = body is not None and c == body.group(1)
                    calls[c].append((caller, int(trip.group(1)) if (is_body and trip) else 1, int(is_body)))
    memo: dict[str, tuple[int, int]] = {}

    def mult(c: str) -> tuple[int, int]:
        if c not in memo:
            memo[c] = (1, 0)
            if calls[c]:
                runs = [(mult(p)[0] * n, mult(p)[1] + d) for p, n, d in calls[c]]
                memo[c] = (sum(r for r, _ in runs), max(d for _, d in runs))
        return memo[c]
    return {c: mult(c) for c in comps}


def _axes_of(groups: list[list[int]], mesh) -> list[str]:
    """The mesh axes along which the devices of a replica group differ."""
    coords = [np.unravel_index(i, mesh.devices.shape) for i in groups[0]] if groups and groups[0] else []
    return [a for k, a in enumerate(mesh.axis_names) if len({c[k] for c in coords}) > 1]


def _iota(num_devices: int, dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(num_devices).reshape([int(d) for d in dims.split(",")])
    return (ids.transpose([int(d) for d in perm.split(",")]) if perm else ids).reshape(-1)


def _groups(line: str, num_devices: int) -> list[list[int]]:
    """A collective's replica groups (explicit ``{{..},{..}}`` or iota ``[n,k]<=[dims]T(perm)``)."""
    explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if explicit:
        return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        n, k = int(iota.group(1)), int(iota.group(2))
        return _iota(num_devices, iota.group(3), iota.group(4)).reshape(n, k).tolist()
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                     r"(?: \{([^}]*)\})?", line)
    if mesh:   # mesh['a'=2,'b'=4], device_ids=([..]T(..)) {'a'}: groups along the braced axes of that mesh
        names = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        ids = (_iota(num_devices, mesh.group(2), mesh.group(3)) if mesh.group(2) else np.arange(num_devices))
        ids = ids.reshape([int(s) for _, s in names])
        over = [k for k, (a, _) in enumerate(names) if f"'{a}'" in (mesh.group(4) or "")] or list(range(len(names)))
        keep = [k for k in range(len(names)) if k not in over]
        return ids.transpose(keep + over).reshape(-1, int(np.prod([ids.shape[k] for k in over]))).tolist()
    pairs = re.search(r"source_target_pairs=\{([\d,{}]*)\}", line)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    return [list(range(num_devices))]


def collectives(hlo: str, mesh) -> list[dict]:
    """Every collective of a compiled module: op, where (``loop`` / ``outside``), mesh axes, bytes, executed
    bytes per step, whether its result is a scalar."""
    comps = _computations(hlo)
    mult = _multipliers(comps)
    out = []
    for comp, lines in comps.items():
        for line in lines:
            op = re.search(r"^%?[\w.\-]+ = (.+?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", line)
            if not op:
                continue
            result_bytes = _shape_bytes(op.group(1))
            operand_bytes = _shape_bytes(line[op.end():].split("), ")[0])
            nbytes = max(result_bytes, operand_bytes)
            runs, depth = mult[comp]
            groups = _groups(line, mesh.devices.size)
            out.append({"op": op.group(2), "where": "loop" if depth else "outside",
                        "axes": "+".join(_axes_of(groups, mesh)) if op.group(2) != "collective-permute" else "pipe",
                        "groups": str(groups[:4]), "bytes": nbytes, "executed_bytes": nbytes * runs,
                        "scalar": result_bytes <= 8})
    return out


def summarize(colls: list[dict]) -> dict:
    """Per (where, op, axes): count, bytes and executed bytes; and the in-loop batch-axis gradient reductions."""
    table: dict[str, dict] = {}
    for c in colls:
        k = f"{c['where']} {c['op']} over {c['axes'] or '-'}"
        t = table.setdefault(k, {"count": 0, "bytes": 0, "executed_bytes": 0, "groups": c["groups"]})
        t["count"] += 1
        t["bytes"] += c["bytes"]
        t["executed_bytes"] += c["executed_bytes"]
    batch = lambda c: any(a in c["axes"].split("+") for a in ("data", "fsdp"))
    grad_in_loop = [c for c in colls if c["where"] == "loop" and batch(c) and not c["scalar"]
                    and c["op"] in ("all-reduce", "reduce-scatter")]
    return {"by_kind": dict(sorted(table.items())),
            "grad_in_loop": len(grad_in_loop),
            "batch_bytes_executed": sum(c["executed_bytes"] for c in colls if batch(c)),
            "batch_bytes_executed_in_loop": sum(c["executed_bytes"] for c in colls if batch(c) and c["where"] == "loop")}


def build(mesh_name: str, m: int, path: str, devices=None):
    """``(step, state, batch, mesh)`` of the GPT step on a named mesh with ``m`` microbatches and a path."""
    mesh = jp.make_mesh(**MESHES[mesh_name], devices=devices or jax.devices()[:8])
    model, tx = GPT(CFG), optax.sgd(0.1)
    pipe = jp.pipeline.Pipeline(model.embed, model.stage, model.head_loss, jp.pipeline.one_f_one_b(2, m),
                                **PATHS[path])
    step = jp.train.make_train_step(pipe, tx, mesh=mesh, donate=False)
    state = jp.train.init_state(model.init, tx, 0, mesh=mesh)
    rng = np.random.default_rng(0)
    shape = (MICROBATCH_ROWS * m, CFG.max_seq_len)
    batch = {k: rng.integers(0, CFG.vocab_size, shape, dtype=np.int32) for k in ("inputs", "targets")}
    return step, state, batch, mesh


def step_hlo(mesh_name: str, m: int, path: str) -> tuple[str, object]:
    """The optimized HLO text of the compiled step and its mesh."""
    step, state, batch, mesh = build(mesh_name, m, path)
    return step.lower(state, batch).compile().as_text(), mesh


def time_step(step, state, batch, reps: int = 5) -> float:
    for _ in range(2):
        jax.block_until_ready(step(state, batch))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args()
    out = {"jax": jax.__version__, "config": dataclasses.asdict(CFG), "microbatch_rows": MICROBATCH_ROWS,
           "load": os.getloadavg(), "results": {}}
    for mesh_name in args.meshes:
        for m in args.microbatches:
            for path in args.paths:
                if path == "step-action" and "fsdp" not in MESHES[mesh_name]:
                    continue
                step, state, batch, mesh = build(mesh_name, m, path)
                hlo = step.lower(state, batch).compile().as_text()
                r = summarize(collectives(hlo, mesh))
                if args.time:
                    r["step_seconds"] = time_step(step, state, batch)
                out["results"][f"{mesh_name} m={m} {path}"] = r
                print(f"# {mesh_name} m={m} {path}: grad_in_loop {r['grad_in_loop']}", flush=True)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
