"""A reader of compiled HLO text (`compiled.as_text()`, the optimized module libtpu scheduled): its computations and
instructions with their array shapes, dtypes and memory spaces, collectives' device groups and the mesh axes they
run over, and while loops' trip counts. planning/step_time.py costs what this reads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from functools import cached_property

import numpy as np

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+) \(.*\{$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+) = (.*)$", re.DOTALL)  # DOTALL: a kernel's config spans lines


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int  # 0 HBM; 1 VMEM; others are sync flags / SMEM
    elements: int  # as stored: the layout's tile pads the minor dimensions (stored_elements)

    @property
    def bytes(self) -> float:
        return self.elements * DTYPE_BYTES.get(self.dtype, 4)


def stored_elements(dims: tuple[int, ...], layout: str) -> int:
    """Elements an array occupies under its layout ("1,0:T(8,128)(2,1)S(1)"): its first tile pads the minor
    dimensions (in minor-to-major order) to whole tiles; later tiles ((2,1): bfloat16 pairs) pack within it. A
    float32 [8192, 100] laid out {0,1:T(8,128)} is stored as 100 rows of 8192, the 100 padded to 104 (the tile's
    8): 8192 × 104 elements, as libtpu counts it."""
    minor_to_major, _, rest = layout.partition(":")
    order = [int(d) for d in minor_to_major.split(",") if d.strip()]
    tile = re.match(r"T\(([0-9,]+)\)", rest)
    if not dims or not tile or len(order) != len(dims):
        return math.prod(dims)
    physical = [dims[d] for d in reversed(order)]  # major to minor
    for i, size in enumerate(reversed([int(t) for t in tile.group(1).split(",")])):
        if i < len(physical):
            j = len(physical) - 1 - i
            physical[j] = -(-physical[j] // size) * size
    return math.prod(physical)


def _arrays(shape: str) -> tuple[Array, ...]:
    """Every array in a (possibly nested tuple) shape, flattened in order."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        space = re.search(r"S\((\d+)\)", layout or "")
        dims = tuple(int(d) for d in dims.split(",") if d)
        out.append(Array(dtype, dims, int(space.group(1)) if space else 0, stored_elements(dims, layout)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    opcode: str
    arrays: tuple[Array, ...]  # the result (a tuple's elements flattened)
    operands: tuple[str, ...]  # operand names; for a constant, its literal
    attrs: str  # everything after the operands, metadata removed
    is_root: bool

    @property
    def bytes(self) -> float:
        return sum(a.bytes for a in self.arrays)

    @property
    def hbm_bytes(self) -> float:
        return sum(a.bytes for a in self.arrays if a.memory_space == 0)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%[\w.\-]+|\{{[^}}]*\}}|[^,\s]+)", self.attrs)
        return m.group(1) if m else None


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced HLO text: {text[start:start + 80]}")


def _instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    root, name, rest = m.groups()
    end = _matching(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.index("(")
    close = _matching(rest, paren)
    listed = re.sub(r"/\*.*?\*/", "", rest[paren + 1:close])  # drop /*index=5*/ markers
    operands = tuple(o.strip().lstrip("%") for o in listed.split(",") if o.strip())
    attrs = re.sub(r"metadata=\{[^}]*\}", "", rest[close + 1:])
    return Instr(name, rest[:paren], _arrays(shape), operands, attrs, bool(root))


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict[str, Instr]  # in program order

    @cached_property
    def root(self) -> Instr:
        return next(i for i in self.instrs.values() if i.is_root)

    @cached_property
    def users(self) -> dict[str, list[Instr]]:
        users = defaultdict(list)
        for i in self.instrs.values():
            for o in i.operands:
                users[o].append(i)
        return users

    def parameter(self, index: int) -> Instr:
        return next(i for i in self.instrs.values() if i.opcode == "parameter" and i.operands == (str(index),))


def parse_hlo(text: str) -> tuple[dict[str, Computation], str]:
    """The computations of an HLO module's text, and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in _logical_lines(text):
        header = _HEADER.match(line)
        if header:
            current = Computation(header.group(2), {})
            comps[current.name] = current
            entry = current.name if header.group(1) else entry
        elif line == "}":
            current = None
        elif current is not None and (instr := _instr(line)):
            current.instrs[instr.name] = instr
    return comps, entry


def _logical_lines(text: str) -> list[str]:
    """The text's lines, with an instruction's continuation lines (a Mosaic kernel's backend_config spans
    several) joined to it."""
    lines = []
    for line in text.splitlines():
        starts = line == "}" or line.startswith(("  %", "  ROOT ", "%", "ENTRY ")) or not line.strip()
        if starts or not lines:
            lines.append(line)
        else:
            lines[-1] += "\n" + line
    return lines



def replica_groups(attrs: str, devices: int) -> list[list[int]]:
    """The device groups of a collective, from any of HLO's spellings."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?)\))?"
                  r"\s*\{([^}]*)\}", attrs)
    if m:  # mesh['axis_0'=8,'axis_1'=1] {'axis_0'}: device ids shaped like that mesh (an iota, or device_ids=(...))
        names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        grouped = re.findall(r"'(\w+)'", m.group(3))
        ids = (_iota(m.group(2)) if m.group(2) else np.arange(devices)).reshape([int(s) for _, s in names])
        axes = [i for i, (n, _) in enumerate(names) if n in grouped]
        rest = [i for i in range(len(names)) if i not in axes]
        return ids.transpose(rest + axes).reshape(-1, math.prod(ids.shape[i] for i in axes)).tolist()
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=(\[[0-9,]+\](?:T\([0-9,]+\))?)", attrs)
    if m:  # [groups, size]<=[reshape]T(perm): iota, reshaped, transposed, cut into rows
        return _iota(m.group(2)).reshape(-1, int(m.group(1).split(",")[-1])).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))] if m else []
    return [g for g in groups if g] or [list(range(devices))]


def _iota(text: str) -> np.ndarray:
    """HLO's iota of device ids, `[2,4]T(1,0)`: arange, reshaped, transposed; flattened."""
    m = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    reshape = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    return (ids.transpose([int(x) for x in m.group(2).split(",")]) if m.group(2) else ids).reshape(-1)


def torus_extents(groups: list[list[int]], mesh_shape: dict[str, int], torus: np.ndarray | None = None) -> list[int]:
    """How many chips the largest group spans along each torus dimension it varies over, from `torus`, the chips'
    coordinates in mesh position order ([devices, dims]); without it, along each mesh axis."""
    group = np.asarray(max(groups, key=len))
    if torus is None:
        torus = np.stack(np.unravel_index(np.arange(math.prod(mesh_shape.values())), tuple(mesh_shape.values())), -1)
    extents = [len(np.unique(torus[group, d])) for d in range(torus.shape[1])]
    return [e for e in extents if e > 1]


def mesh_axis(groups: list[list[int]], mesh_shape: dict[str, int]) -> str:
    """The mesh axes along which a group's devices differ (device id i is position i of the mesh, row-major)."""
    coords = np.stack(np.unravel_index(np.asarray(groups), tuple(mesh_shape.values())), -1)  # [groups, size, axes]
    varies = (coords != coords[:, :1]).any(axis=(0, 1))
    return "+".join(name for name, v in zip(mesh_shape, varies) if v) or "none"




def called(instr: Instr, *keys: str) -> list[str]:
    names = []
    for key in keys:
        value = instr.attr(key)
        names += [n.strip().lstrip("%") for n in value.strip("{}").split(",")] if value else []
    return names


def memory_space(comp: Computation, name: str) -> int:
    return comp.instrs[name].arrays[0].memory_space if name in comp.instrs else 0



def trip_count(instr: Instr, comp: Computation, comps: dict[str, Computation]) -> int | None:
    """A while loop's trip count: libtpu's `known_trip_count` if given, else read off `i < N` in its condition."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
    if known:
        return int(known.group(1))
    cond = comps[called(instr, "condition")[0]]
    root = cond.root
    direction = re.search(r"direction=(\w+)", root.attrs)
    if root.opcode != "compare" or not direction or len(root.operands) != 2:
        return None
    lhs, rhs = (cond.instrs.get(o) for o in root.operands)
    if not (lhs and rhs and lhs.opcode == "get-tuple-element" and rhs.opcode == "constant"):
        return None
    bound, index = int(rhs.operands[0]), int(lhs.attr("index"))
    start = _initial_value(instr, comp, index)
    extra = {"LT": 0, "LE": 1, "NE": 0}.get(direction.group(1))
    return None if extra is None else max(bound - start + extra, 0)


def _initial_value(instr: Instr, comp: Computation, index: int) -> int:
    """The loop counter's start, when it is a literal in the while's operand tuple; scans start at 0."""
    init = comp.instrs.get(instr.operands[0])
    value = comp.instrs.get(init.operands[index]) if init and init.opcode == "tuple" else None
    while value is not None and value.opcode == "copy":
        value = comp.instrs.get(value.operands[0])
    if value is not None and value.opcode == "constant":
        try:
            return int(value.operands[0])
        except ValueError:
            pass
    return 0
