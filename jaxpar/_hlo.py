"""The one reader of XLA programs' text: a compiled program's HLO (FLOPs, bytes accessed and collectives by mesh
axis; instructions, loop depths, named scopes) and a lowered program's StableHLO (its dots' operand types, its
sharding constraints).

``compiled.cost_analysis()`` counts the body of a ``while`` loop once, whatever its trip count; a GPT with
``scan_layers=True`` or a pipeline (one ``lax.scan`` step per tick) then looks many times cheaper than it is.
This module walks the HLO call graph instead: a ``while`` body counts ``known_trip_count`` times (XLA writes it
into the loop's ``backend_config``), a ``conditional`` counts its costliest branch (the pipeline's ``lax.switch``
over actions: the devices run in lockstep, so a tick takes as long as its slowest action), fusions and calls
once per call.

Per program (per device, SPMD):

* ``flops``: ``2 * prod(output dims) * prod(contracted dims)`` for every ``dot`` of any element type (fp8 ones
  included) and every cuBLAS GEMM ``custom-call`` of XLA:GPU (matmuls dominate a transformer; elementwise work
  and cuDNN attention calls are left out);
* ``bytes``: output plus operand bytes of every top-level instruction (a fusion counts its inputs and output,
  not its internals), as XLA's ``HloCostAnalysis`` counts "bytes accessed";
* collectives: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``, ``collective-permute``
  (and their async ``-start`` forms), each with its payload bytes (the full, unsharded buffer: an all-gather's
  output, a reduce-scatter's input) and the mesh axes its replica groups span. Payloads are read from the
  operands: XLA:GPU's async ``-start`` result is the tuple ``((inputs), (outputs))`` of its combined buffers
  (all-reduce-start: the outputs alone), so its result type would count them twice. A collective's HBM bytes
  are its input plus its output, once.

Replica groups name logical device ids: with ``use_global_device_ids`` (SPMD partitioning, as ``jax.jit``
emits) id ``i`` is the ``i``-th device of the executable's device assignment, which for a ``jax.jit`` over a
``Mesh`` is ``mesh.devices.flat``. A group's mesh axes are those along which its members' mesh coordinates
differ. The three printed forms are read: explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[4,2]T(1,0)``, and the
named form ``mesh['axis_0'=16,'axis_1'=64], device_ids=([8,16,8]T(1,0,2)) {'axis_0'}``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Bytes per element of every array type HLO prints (xla/xla_data.proto's PrimitiveType; the sub-byte types packed).
_DTYPE_BYTES = {"pred": 1, "s1": 0.125, "u1": 0.125, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16, "f4e2m1fn": 0.5, "f6e2m3fn": 0.75, "f6e3m2fn": 0.75,
                **dict.fromkeys(("f8e5m2", "f8e4m3", "f8e4m3fn", "f8e4m3b11fnuz", "f8e5m2fnuz", "f8e4m3fnuz", "f8e3m4",
                                 "f8e8m0fnu"), 1)}
NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "iota", "copy-start", "copy-done"}
# Elementwise ops :meth:`Walker.traffic` looks through from a fusion parameter to a slice or in-place update: XLA:CPU
# wraps a bf16 buffer's update in converts to f32 and back (its bf16 work is f32), which a GPU program does not.
_LOOK_THROUGH = {"convert", "bitcast", "copy"}
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str        # the printed result type, e.g. "f32[8,4]{1,0}" or "(f32[], s32[])"
    opcode: str
    operands: list[str]
    attrs: str        # everything after the operand list
    args: str = ""    # the operand list as printed (a parameter's index)


@dataclasses.dataclass
class Collective:
    """One collective instruction: its kind, payload bytes per execution, executions, and mesh axes."""
    kind: str
    bytes: float
    count: float
    axes: tuple[str, ...]
    group_size: int


def _match_paren(text: str, start: int) -> int:
    """Index just past the bracket closing the one at ``text[start]``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in pairs.values():
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced brackets in HLO text near {text[start:start + 80]!r}")


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    end = _match_paren(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    close = _match_paren(rest, op.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", rest[op.end():close - 1])
    return Instr(name, shape, op.group(1), operands, rest[close:], rest[op.end():close - 1])


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    """``({computation name: instructions}, entry computation name)`` of an HLO module's text."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            instr = _parse_instr(line)
            if instr is not None:
                comps[current].append(instr)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text (pass compiled.as_text())")
    return comps, entry


def array_dims(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The ``(dtype, dims)`` of every array in a printed shape (one, or a tuple's elements)."""
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(shape)
            if d in _DTYPE_BYTES]


def shape_bytes(shape: str) -> float:
    return sum(_DTYPE_BYTES[d] * math.prod(dims) for d, dims in array_dims(shape))


def _iota(dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def _parse_iota(text: str) -> tuple[np.ndarray, list[int]]:
    """``[8,16,8]T(1,0,2)`` (or ``[a,b]<=[dims]T(perm)``) -> (flat ids, the leading reshape dims)."""
    m = re.match(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", text)
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")] if m.group(2) else shape
    perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else None
    return _iota(dims, perm), shape


def attribute(attrs: str, key: str) -> str | None:
    """The raw text of attribute ``key=...`` (a bracketed value, or up to the next comma)."""
    i = attrs.find(key + "=")
    if i < 0:
        return None
    j = i + len(key) + 1
    if attrs[j] == "[":   # iota form: [groups,size]<=[dims]T(perm)
        return re.match(r"\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?", attrs[j:]).group(0)
    if attrs[j] in "{(":
        return attrs[j:_match_paren(attrs, j)]
    if attrs.startswith("mesh[", j):
        end = _match_paren(attrs, j + 4)
        tail = attrs[end:]
        dev = re.match(r",\s*device_ids=", tail)
        if dev:
            k = end + dev.end()
            end = _match_paren(attrs, k)
        red = re.match(r"\s*\{[^}]*\}", attrs[end:])
        return attrs[j:end + (red.end() if red else 0)]
    m = re.match(r"[^,\s]+", attrs[j:])
    return m.group(0) if m else ""


def replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """The groups of logical device ids of a collective's ``replica_groups`` (every device when empty)."""
    text = attribute(attrs, "replica_groups")
    if text is None or text in ("{}", "{{}}"):
        return [list(range(num_devices))]
    if text.startswith("{"):
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
    if text.startswith("["):
        ids, shape = _parse_iota(text)
        return ids.reshape(shape).tolist()
    if text.startswith("mesh["):
        axes = re.findall(r"'([^']+)'=(\d+)", text[5:_match_paren(text, 4)])
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        dev = re.search(r"device_ids=\((.*)\)", text)
        ids = _parse_iota(dev.group(1))[0] if dev else np.arange(math.prod(sizes))
        red = re.search(r"\{([^}]*)\}\s*$", text)
        over = re.findall(r"'([^']+)'", red.group(1)) if red else names
        grid = ids.reshape(sizes)
        keep = [i for i, n in enumerate(names) if n not in over]
        moved = np.transpose(grid, keep + [i for i, n in enumerate(names) if n in over])
        size = math.prod(sizes[i] for i, n in enumerate(names) if n in over)
        return moved.reshape(-1, size).tolist()
    raise ValueError(f"unrecognised replica_groups form {text[:80]!r}")


def permute_pairs(attrs: str) -> list[list[int]]:
    text = attribute(attrs, "source_target_pairs") or "{}"
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", text)]


def group_axes(groups: Sequence[Sequence[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (in mesh order) along which the members of any group differ; ``()`` for trivial groups.

    ``mesh_shape`` maps axis names to sizes in the mesh's order; id ``i`` sits at
    ``np.unravel_index(i, sizes)``.
    """
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying: set[int] = set()
    for g in groups:
        if len(g) < 2:
            continue
        coords = np.array(np.unravel_index(np.asarray(g), sizes)).T
        varying.update(np.nonzero((coords != coords[0]).any(axis=0))[0].tolist())
    return tuple(names[i] for i in sorted(varying))


def operand_bytes(instr: Instr, shapes: dict[str, str]) -> float:
    """Bytes of an instruction's operands: their printed types when the operand list carries them (``f32[8]{0}
    %x``), else their shapes in ``shapes`` (the computation's ``{name: shape}``; jax's ``as_text()`` prints bare
    names). A ``collective-permute`` counts its first operand only (its in-place form adds the output buffer and
    offsets)."""
    names = instr.operands[:1] if instr.opcode.startswith("collective-permute") else instr.operands
    typed = sum(shape_bytes(t) for t in re.split(r"%[\w.\-]+", instr.args)[:len(names)])  # the type before each name
    return typed or sum(shape_bytes(shapes.get(o, "")) for o in names)


def collective_payload(instr: Instr, kind: str, group: int, shapes: dict[str, str]) -> float:
    """Bytes of the full buffer a collective moves (all-gather: its output, ``group`` times its input; every other
    kind: its input), read from the operands: an async ``-start``'s result is the tuple of its operands and
    results (``((inputs), (outputs))``; all-reduce-start: the outputs alone), which would count the buffers twice."""
    moved = operand_bytes(instr, shapes)
    return moved * group if kind == "all-gather" else moved


def _io_bytes(payload: float, kind: str, group: int) -> float:
    """HBM bytes a collective reads and writes: its input plus its output (a fraction ``1 / group`` of the payload
    for a gather's input and a scatter's output), counted once whatever the async tuple holds."""
    return payload * (1 + 1 / group) if kind in ("all-gather", "reduce-scatter") else 2 * payload


_GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_JSON_DIMS = r'"{}_contracting_dimensions"\s*:\s*\[([^\]]*)\]'


def dot_flops(instr: Instr, shapes: dict[str, str]) -> float:
    """``2 * prod(output dims) * prod(contracted dims)`` of a ``dot`` or of a cuBLAS GEMM ``custom-call`` (XLA:GPU
    writes the dot's dimension numbers into its ``backend_config``; its result is ``(output, workspace)``)."""
    out = array_dims(instr.shape)
    lhs = array_dims(shapes.get(instr.operands[0], "")) if instr.operands else []
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    if instr.opcode == "custom-call":
        m = re.search(_JSON_DIMS.format("lhs"), instr.attrs)
        dims = [d.strip().strip('"') for d in m.group(1).split(",")] if m else []
    else:
        dims = m.group(1).split(",") if m else []
    if not out or not lhs or m is None:
        return 0.0
    contracted = math.prod(lhs[0][1][int(d)] for d in dims if d)
    return 2.0 * math.prod(out[0][1]) * contracted


def is_gemm_call(instr: Instr) -> bool:
    """Whether ``instr`` is a cuBLAS / cuBLASLt GEMM ``custom-call`` (XLA:GPU's rewrite of a ``dot``)."""
    target = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
    return instr.opcode == "custom-call" and target is not None and target.group(1) in _GEMM_CALLS


def callees(instr: Instr) -> list[tuple[str, str]]:
    """``[(role, computation)]`` of the computations an instruction calls (reducers excluded)."""
    out = []
    for role in ("calls", "body", "condition", "true_computation", "false_computation"):
        m = re.search(rf"\b{role}=%?([\w.\-]+)", instr.attrs)
        if m:
            out.append((role, m.group(1)))
    m = re.search(r"branch_computations=\{([^}]*)\}", instr.attrs)
    if m:
        out.extend(("branch", c.strip().lstrip("%")) for c in m.group(1).split(","))
    if instr.opcode == "call":
        m = re.search(r"to_apply=%?([\w.\-]+)", instr.attrs)
        if m:
            out.append(("calls", m.group(1)))
    return out


def trip_count(instr: Instr) -> float | None:
    m = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', instr.attrs)
    return float(m.group(1)) if m else None


class Walker:
    """Costs of a computation with its callees: a dict of metric -> value (FLOPs, bytes, collectives)."""

    def __init__(self, comps: dict[str, list[Instr]], mesh_shape: dict[str, int]):
        self.comps, self.mesh_shape = comps, mesh_shape
        self.num_devices = math.prod(mesh_shape.values())
        self.unknown_trips = 0
        self._memo: dict[tuple[str, bool], dict] = {}

    def cost(self, name: str, fused: bool = False) -> dict:
        key = (name, fused)
        if key not in self._memo:
            self._memo[key] = self._cost(name, fused)
        return self._memo[key]

    def _cost(self, name: str, fused: bool) -> dict:
        instrs = self.comps.get(name, [])
        shapes = {i.name: i.shape for i in instrs}
        total: dict = defaultdict(float)
        for instr in instrs:
            if instr.opcode in ("dot", "convolution") or is_gemm_call(instr):
                total["flops"] += dot_flops(instr, shapes)
            kind = instr.opcode.removesuffix("-start")
            if kind in COLLECTIVES:
                self._collective(instr, kind, total, shapes, fused)
            elif not fused and instr.opcode not in NO_TRAFFIC and not instr.opcode.endswith("-done"):
                total["bytes"] += self.traffic(instr, shapes)
            self._add_callees(instr, total)
        return dict(total)

    def traffic(self, instr: Instr, shapes: dict[str, str]) -> float:
        """Output plus operand bytes; slices read only what they output and in-place updates touch only the
        update, also when a fusion slices or updates its parameters (through converts, bitcasts and copies:
        ``convert(dynamic-update-slice(convert(buffer), update))`` is XLA:CPU's form of an in-place bf16
        update)."""
        if instr.opcode == "dynamic-slice":
            return 2 * shape_bytes(instr.shape)
        if instr.opcode == "dynamic-update-slice":
            return 2 * shape_bytes(shapes.get(instr.operands[1], ""))
        operand = [shape_bytes(shapes.get(o, "")) for o in instr.operands]
        out = shape_bytes(instr.shape)
        body = self.comps.get(dict(callees(instr)).get("calls", ""), []) if instr.opcode == "fusion" else []
        if body:
            users: dict[str, list[Instr]] = defaultdict(list)
            for i in body:
                for o in i.operands:
                    users[o].append(i)
            local = {i.name: i.shape for i in body}
            for p in (i for i in body if i.opcode == "parameter"):
                k, cur = int(p.args or 0), p.name
                while len(users.get(cur, [])) == 1 and users[cur][0].opcode in _LOOK_THROUGH:
                    cur = users[cur][0].name
                us = users.get(cur, [])
                if k >= len(operand) or not us or any(u.operands[0] != cur for u in us):
                    continue
                if all(u.opcode == "dynamic-slice" for u in us):
                    operand[k] = sum(shape_bytes(u.shape) for u in us)
                elif all(u.opcode == "dynamic-update-slice" for u in us):
                    operand[k], out = 0.0, sum(shape_bytes(local.get(u.operands[1], "")) for u in us)
        return out + sum(operand)

    def _collective(self, instr: Instr, kind: str, total: dict, shapes: dict[str, str], fused: bool) -> None:
        if kind == "collective-permute":
            groups = permute_pairs(instr.attrs)
            size = 2
        else:
            groups = replica_groups(instr.attrs, self.num_devices)
            size = max(len(g) for g in groups)
        payload = collective_payload(instr, kind, size, shapes)
        if not fused:
            total["bytes"] += _io_bytes(payload, kind, size)
        axes = group_axes(groups, self.mesh_shape)
        if not axes:
            return
        label = "+".join(axes)
        total[("coll_bytes", kind, label, size)] += payload
        total[("coll_count", kind, label, size)] += 1

    def _add_callees(self, instr: Instr, total: dict) -> None:
        called = callees(instr)
        branches = [c for role, c in called if role in ("branch", "true_computation", "false_computation")]
        for role, comp in called:
            if role in ("branch", "true_computation", "false_computation"):
                continue
            times = 1.0
            if instr.opcode == "while":
                trips = trip_count(instr)
                if trips is None:
                    self.unknown_trips += 1
                    trips = 1.0
                times = trips + (1.0 if role == "condition" else 0.0)
            for k, v in self.cost(comp, fused=fused_call(instr)).items():
                total[k] += times * v
        if branches:
            costs = [self.cost(b) for b in branches]
            worst = max(costs, key=lambda c: (c.get("flops", 0.0), c.get("bytes", 0.0)))
            for k, v in worst.items():
                total[k] += v


def fused_call(instr: Instr) -> bool:
    """Whether the callee of ``instr`` runs as one kernel (a fusion): its internals move no memory of their own."""
    return instr.opcode == "fusion"


@dataclasses.dataclass
class HloStats:
    """Per-device costs of one execution of the program (loops unrolled by their trip counts)."""
    flops: float
    bytes_accessed: float
    collectives: list[Collective]
    unknown_trip_counts: int      # while loops whose trip count XLA did not record (counted once)

    def bytes_by(self, key: str = "kind") -> dict[str, float]:
        """Collective payload bytes summed by ``"kind"``, ``"axes"`` or ``"kind/axes"``."""
        out: dict[str, float] = defaultdict(float)
        for c in self.collectives:
            label = {"kind": c.kind, "axes": "+".join(c.axes), "kind/axes": f"{c.kind}/{'+'.join(c.axes)}"}[key]
            out[label] += c.bytes * c.count
        return dict(out)


def analyze(text: str, mesh_shape: dict[str, int]) -> HloStats:
    """FLOPs, bytes accessed and collectives of an HLO module's text (``compiled.as_text()``), per device.

    Args:
      text: the compiled (SPMD-partitioned) HLO module text.
      mesh_shape: axis name -> size in the mesh's order (``dict(mesh.shape)``); replica group ids are
        positions in ``mesh.devices.flat``.

    Raises:
      ValueError: text without an ENTRY computation, or replica groups in a form this parser does not know.
    """
    comps, entry = parse_module(text)
    walker = Walker(comps, dict(mesh_shape))
    cost = walker.cost(entry)
    colls = [Collective(kind, cost[("coll_bytes", kind, label, size)] / n, n, tuple(label.split("+")), size)
             for (tag, kind, label, size), n in ((k, v) for k, v in cost.items() if isinstance(k, tuple))
             if tag == "coll_count"]
    return HloStats(cost.get("flops", 0.0), cost.get("bytes", 0.0), colls, walker.unknown_trips)


@dataclasses.dataclass
class CollectiveSite:
    """One collective instruction where it stands in the program (not summed with others)."""
    kind: str
    computation: str
    bytes: float                 # payload per execution (as :class:`Collective`)
    runs: float                  # executions per run of the program: trip counts of the loops around it
    loop_depth: int              # how many ``while`` bodies enclose it (0: outside every loop)
    axes: tuple[str, ...]
    groups: list[list[int]]      # replica groups (a permute: its source-target pairs)
    scalar: bool                 # a result of at most 8 bytes (a loss or metric reduction)
    dtypes: tuple[str, ...] = ()  # the element types of its operands, sorted
    is_async: bool = False       # an async ``-start`` (its ``-done`` elsewhere in the schedule)


def runs_per_computation(comps: dict[str, list[Instr]], entry: str) -> dict[str, tuple[float, int]]:
    """``{computation: (runs per program run, loop depth)}``. A ``while`` body runs its trip count times per run
    of its caller; every branch of a ``conditional`` is counted on each run (an upper bound for one branch)."""
    out: dict[str, tuple[float, int]] = {}

    def visit(name: str, runs: float, depth: int) -> None:
        old = out.get(name, (0.0, 0))
        out[name] = (old[0] + runs, max(old[1], depth))
        for instr in comps.get(name, []):
            for role, callee in callees(instr):
                if callee not in comps:
                    continue
                times, deeper = 1.0, 0
                if instr.opcode == "while":
                    times = (trip_count(instr) or 1.0) + (1.0 if role == "condition" else 0.0)
                    deeper = int(role == "body")
                visit(callee, runs * times, depth + deeper)
    visit(entry, 1.0, 0)
    return out


def collective_sites(text: str, mesh_shape: dict[str, int]) -> list[CollectiveSite]:
    """Every collective of an HLO module's text with the loop depth it runs at and its runs per program run
    (e.g. to show which reductions run inside a pipeline's tick loop). Arguments as for :func:`analyze`.

    Raises:
      ValueError: as for :func:`analyze`.
    """
    comps, entry = parse_module(text)
    runs = runs_per_computation(comps, entry)
    num_devices = math.prod(mesh_shape.values())
    sites = []
    for comp, instrs in comps.items():
        shapes = {i.name: i.shape for i in instrs}
        for instr in instrs:
            kind = instr.opcode.removesuffix("-start")
            if kind not in COLLECTIVES or comp not in runs:
                continue
            groups = (permute_pairs(instr.attrs) if kind == "collective-permute"
                      else replica_groups(instr.attrs, num_devices))
            size = 2 if kind == "collective-permute" else max(len(g) for g in groups)
            n, depth = runs[comp]
            dtypes = sorted({d for o in instr.operands for d, _ in array_dims(shapes.get(o, ""))})
            sites.append(CollectiveSite(kind, comp, collective_payload(instr, kind, size, shapes), n, depth,
                                        group_axes(groups, mesh_shape), groups, operand_bytes(instr, shapes) <= 8,
                                        tuple(dtypes), instr.opcode.endswith("-start")))
    return sites


def upcast_copies(text: str) -> list[float]:
    """Bytes of each float32 copy of a whole bfloat16 buffer at the top level of the program (a ``convert``, or
    a fusion that only converts), largest first. XLA:CPU computes bf16 work in float32 and materialises such
    copies (e.g. of a scanned stack of saved activations); a GPU program keeps them in bf16."""
    comps, _ = parse_module(text)
    fused = {c for instrs in comps.values() for i in instrs if i.opcode == "fusion" for _, c in callees(i)}
    out = []
    for name, instrs in comps.items():
        if name in fused:
            continue
        shapes = {i.name: i.shape for i in instrs}
        for i in instrs:
            body = [j for j in comps.get(dict(callees(i)).get("calls", ""), []) if j.opcode != "parameter"]
            only_convert = i.opcode == "convert" or (i.opcode == "fusion" and len(body) == 1 and body[0].opcode == "convert")
            src = array_dims(shapes.get(i.operands[0], "")) if i.operands else []
            dst = array_dims(i.shape)
            if only_convert and len(dst) == 1 and dst[0][0] == "f32" and src and src[0][0] == "bf16":
                out.append(shape_bytes(i.shape))
    return sorted(out, reverse=True)


# ------------------------------------------------------------------------------------- the text as a whole

_METADATA = re.compile(r", metadata=\{[^}]*\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# StableHLO (``lowered.as_text()``): one op a line, its operand types after the last " : ".
_STABLE_DOT = re.compile(r"stablehlo\.dot_general\b.*:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)")
_STABLE_REDUCTION = re.compile(r'"stablehlo\.(all_reduce|reduce_scatter)"[^\n]*\n\s*\^bb0\(%\w+: tensor<(\w+)>')
_STABLE_CONSTRAINT = re.compile(r"sharding_constraint %[\w#.]+ (<@[^>]*>) : tensor<(?:([\dx]*)x)?([a-z]\w*)>")


def program_text(text: str) -> str:
    """An HLO module's text without its debug tables (``FileNames`` onwards) and instruction metadata: what the
    program computes, so two compiles compare equal across edits that only move source lines."""
    return _METADATA.sub("", text.split("\nFileNames")[0])


def scopes(text: str) -> set[str]:
    """Every ``jax.named_scope`` name in the instructions' metadata (the parts of their ``op_name`` paths)."""
    return {part for name in _OP_NAME.findall(text) for part in name.split("/")}


def collective_counts(text: str) -> dict[str, int]:
    """Collective instructions of an HLO module by kind (:data:`COLLECTIVES`; an async ``-start`` counted, its
    ``-done`` not), over every computation."""
    comps, _ = parse_module(text)
    ops = [i.opcode.removesuffix("-start") for instrs in comps.values() for i in instrs]
    return {k: ops.count(k) for k in COLLECTIVES}


def loop_depths(text: str) -> dict[str, tuple[list[Instr], int]]:
    """``{computation: (instructions, loop depth)}`` of an HLO module: how many ``while`` bodies enclose each
    computation reached from the entry (0: outside every loop; a loop's condition is at the loop's depth;
    reducers and computations not reached are left out)."""
    comps, entry = parse_module(text)
    return {name: (comps[name], depth) for name, (_, depth) in runs_per_computation(comps, entry).items()
            if name in comps}


def _element_type(tensor: str) -> str:
    """``"bf16"`` of ``tensor<16x64xbf16>`` (or of the scalar ``tensor<bf16>``)."""
    return tensor[len("tensor<"):-1].split("x")[-1]


def stablehlo_dots(text: str) -> list[tuple[str, str]]:
    """The operand element types ``(lhs, rhs)`` of every ``stablehlo.dot_general`` of a lowered program's text
    (``lowered.as_text()``), in program order, e.g. ``("bf16", "bf16")`` or ``("f8E4M3FN", "f8E5M2")``."""
    return [(_element_type(a), _element_type(b)) for a, b in _STABLE_DOT.findall(text)]


def stablehlo_reductions(text: str) -> list[tuple[str, str]]:
    """``(kind, element type)`` of every ``all_reduce`` / ``reduce_scatter`` of a lowered program's text, in
    program order, e.g. ``("all_reduce", "f32")``: the type its reducer sums in."""
    return _STABLE_REDUCTION.findall(text)


def sharding_constraints(text: str) -> list[tuple[str, str, str]]:
    """``(sharding, dims, element type)`` of every ``sharding_constraint`` of a lowered program's text, e.g.
    ``('<@mesh, [{}, {"tensor"}]>', "64x256", "bf16")`` (dims ``""`` for a scalar)."""
    return _STABLE_CONSTRAINT.findall(text)


__all__ = ["COLLECTIVES", "Collective", "CollectiveSite", "HloStats", "Instr", "NO_TRAFFIC", "Walker", "analyze",
           "array_dims", "attribute", "callees", "collective_counts", "collective_payload", "collective_sites",
           "dot_flops", "fused_call", "group_axes", "is_gemm_call", "loop_depths", "operand_bytes", "parse_module",
           "permute_pairs", "program_text", "replica_groups", "runs_per_computation", "scopes", "shape_bytes",
           "sharding_constraints", "stablehlo_dots", "stablehlo_reductions", "trip_count", "upcast_copies"]
