"""Write a collective algorithm as a program over chunks; compile it to a plait schedule file.

A program names chunks of each rank's buffers and says, in order, where each goes and what is
reduced, as if one thread ran the whole job::

    from plait.schedule import Program

    def build(n):
        # allgather: every rank sends its block straight to every other rank
        p = Program("allgather", n, name="star")
        for r in range(n):
            mine = p.input(r, 0)             # rank r's input (an allgather input is one chunk)
            mine.copy(p.output(r, r))        # its own block, a local copy on rank r
            for q in range(n):
                if q != r:
                    mine.copy(p.output(q, r))    # a transfer from rank r to rank q
        return p

    build(4).save("star-4.json")

The compiler (`Program.compile`) puts every operation in the earliest step its data allows,
keeping the program's order wherever two operations touch the same chunk (read after write,
write after read, write after write), and lists each step's transfers between a pair in program
order on both ends, which is how the executor pairs them. The result is checked by plait's
verifier (`Program.check`, also run by `save`): every error names the rank, the step and the
chunk. Lanes (connections) and pipelining are the executor's: it splits every chunk into
segments and runs the steps once per segment, so a program never says how big a chunk is.

Buffers (chunk `i` of a buffer with n chunks is layout block `i`; see docs/schedules.md):
    input    the caller's send buffer, read only; n chunks, or 1 (allgather, gather)
    output   the caller's receive buffer; n chunks, or 1 (reduce_scatter, scatter)
    scratch  plait's memory: index `slot * n + block`; the program's highest index sets how
             many slots the schedule asks for
"""

import json
import os
from typing import Dict, List, Optional, Tuple

from . import _core

__all__ = ["Program", "Chunk", "ScheduleError", "check", "builtin", "load"]

ScheduleError = _core.ConfigError

COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "gather", "scatter", "alltoall")
_BUFFERS = ("input", "output", "scratch")


def _aliased(coll: str, n: int, rank: int, root: int) -> Dict[int, int]:
    """Output chunk -> the input chunk it shares memory with when a call runs in place."""
    if coll == "allreduce" or (coll in ("broadcast", "reduce") and rank == root):
        return {i: i for i in range(n)}
    if coll == "allgather" or (coll == "gather" and rank == root):
        return {rank: 0}
    if coll == "reduce_scatter" or (coll == "scatter" and rank == root):
        return {0: rank}
    return {}


class Chunk:
    """One chunk of one rank's buffer: `Program.input(rank, i)`, `.output(...)`, `.scratch(...)`."""

    __slots__ = ("program", "rank", "buf", "index")

    def __init__(self, program: "Program", rank: int, buf: str, index: int):
        self.program, self.rank, self.buf, self.index = program, rank, buf, index

    def copy(self, dst: "Chunk", reduce_with: Optional["Chunk"] = None) -> "Chunk":
        """dst = self (or, with `reduce_with`, dst = reduce_with (+) self). A transfer when
        `dst` is on another rank (`reduce_with` must then be on dst's rank), else a local
        operation. Returns dst."""
        self.program._op(self, dst, reduce_with)
        return dst

    def reduce(self, src: "Chunk") -> "Chunk":
        """self = self (+) src, on self's rank (a transfer when `src` is on another rank).
        Returns self."""
        self.program._op(src, self, self)
        return self

    def _ref(self) -> dict:
        return {"buf": self.buf, "index": self.index}

    def __repr__(self) -> str:
        return f"rank {self.rank} {self.buf}[{self.index}]"


class Program:
    """A schedule being written: `collective` (one of COLLECTIVES) over `nranks` ranks.

    `name` is how `PLAIT_ALGO` will call it (letters, digits, `_`, `-`, `.`; not a built-in's
    name); `root` for rooted collectives; `when` the registry's block (`min_bytes`,
    `max_bytes`, `topology`) saying where it applies; `description` free text."""

    def __init__(self, collective: str, nranks: int, *, name: str, root: int = 0, description: str = "",
                 when: Optional[dict] = None):
        if collective not in COLLECTIVES:
            raise ScheduleError(f"unknown collective {collective!r}: one of {', '.join(COLLECTIVES)}")
        if not isinstance(nranks, int) or nranks < 1:
            raise ScheduleError(f"nranks must be a positive integer, not {nranks!r}")
        if not 0 <= root < nranks:
            raise ScheduleError(f"root {root} is out of range for {nranks} ranks")
        self.collective, self.nranks, self.name, self.root = collective, nranks, name, root
        self.description, self.when = description, dict(when or {})
        self._ops: List[Tuple[Chunk, Chunk, Optional[Chunk]]] = []

    # -- chunks ---------------------------------------------------------------------------------

    def input(self, rank: int, index: int) -> Chunk:
        return self._chunk(rank, "input", index)

    def output(self, rank: int, index: int) -> Chunk:
        return self._chunk(rank, "output", index)

    def scratch(self, rank: int, index: int) -> Chunk:
        return self._chunk(rank, "scratch", index)

    def _chunk(self, rank: int, buf: str, index: int) -> Chunk:
        if not 0 <= rank < self.nranks:
            raise ScheduleError(f"{self.name}: rank {rank} is out of range for {self.nranks} ranks")
        if not isinstance(index, int) or index < 0:
            raise ScheduleError(f"{self.name}: {buf} chunk index must be a non-negative integer, not {index!r}")
        return Chunk(self, rank, buf, index)

    def _op(self, src: Chunk, dst: Chunk, base: Optional[Chunk]) -> None:
        for c in (src, dst, base):
            if c is not None and c.program is not self:
                raise ScheduleError(f"{self.name}: {c!r} belongs to another program")
        if dst.buf == "input":
            raise ScheduleError(f"{self.name}: {dst!r} is written, but the input is read only")
        if base is not None and base.rank != dst.rank:
            raise ScheduleError(f"{self.name}: reduce_with {base!r} must be on the destination's rank {dst.rank}")
        if src.rank == dst.rank and (src.buf, src.index) == (dst.buf, dst.index):
            raise ScheduleError(f"{self.name}: {src!r} is copied or reduced into itself")
        self._ops.append((src, dst, base))

    # -- compiling ------------------------------------------------------------------------------

    def compile(self) -> dict:
        """The schedule file (a dict; `to_json` for its text), not yet verified."""
        n = self.nranks
        aliases = [_aliased(self.collective, n, r, self.root) for r in range(n)]

        def key(c: Chunk):
            return (c.rank, c.buf, c.index)

        def partner(c: Chunk):
            """The chunk `c` shares memory with in place, if any."""
            if c.buf == "output" and c.index in aliases[c.rank]:
                return (c.rank, "input", aliases[c.rank][c.index])
            if c.buf == "input":
                for o, i in aliases[c.rank].items():
                    if i == c.index:
                        return (c.rank, "output", o)
            return None

        class State:
            __slots__ = ("w", "acc", "rt", "rl")

            def __init__(self):
                self.w = -1  # step of the last write (-1: the initial contents)
                self.acc = -1  # the step whose transfers accumulate into it, if that was the last write
                self.rt = -1  # last step a transfer read it
                self.rl = -1  # last step a local operation read it

        state: Dict[tuple, State] = {}

        def st(k) -> State:
            return state.setdefault(k if isinstance(k, tuple) else key(k), State())

        def written(dst: Chunk, src: Chunk, base: Optional[Chunk]) -> List[State]:
            """The states a write of `dst` must be ordered after: its own, and in place its
            partner's (unless it plainly copies the partner onto itself, a no-op in place)."""
            out = [st(dst)]
            p = partner(dst)
            if p is not None and not (base is None and p == key(src)):
                out.append(st(p))
            return out

        steps: List[List[dict]] = []

        def step(rank: int, k: int) -> dict:
            while len(steps) <= k:
                steps.append([{"sends": [], "recvs": [], "locals": []} for _ in range(n)])
            return steps[k][rank]

        for src, dst, base in self._ops:
            s = st(src)
            ws = written(dst, src, base)
            if src.rank != dst.rank:
                # Only a base that is the destination itself accumulates: one that shares its
                # memory in place only is a separate chunk out of place.
                accumulate = base is not None and key(base) == key(dst)
                k = s.w + 1
                for x in ws:
                    k = max(k, x.rt + 1, x.rl + 1, x.acc if accumulate and x.acc == x.w else x.w + 1)
                if base is not None and not accumulate:
                    k = max(k, st(base).w + 1)
                recv = {"peer": src.rank, "dst": dst._ref()}
                if base is not None:
                    recv["reduce_with"] = base._ref()
                step(src.rank, k)["sends"].append({"peer": dst.rank, "src": src._ref()})
                step(dst.rank, k)["recvs"].append(recv)
                s.rt = max(s.rt, k)
                if base is not None and not accumulate:
                    b = st(base)
                    b.rt = max(b.rt, k)
                for x in ws:
                    x.acc = k if accumulate else -1
                    x.w = k
            else:
                # Locals run after their step's transfers, one after another in listed order.
                reads = [s] + ([st(base)] if base is not None else [])
                k = max([max(r.w, 0) for r in reads] + [max(x.rt, x.rl, x.w) for x in ws] + [0])
                ops = step(dst.rank, k)["locals"]
                if base is None:
                    ops.append({"copy": {"src": src._ref(), "dst": dst._ref()}})
                elif key(base) == key(dst):
                    ops.append({"reduce": {"src": src._ref(), "dst": dst._ref()}})
                else:
                    # dst = base (+) src as a copy, then a reduction. Copy first the operand that
                    # is dst's own memory in place (a no-op there), or it would be overwritten
                    # before it is read.
                    first, second = (src, base) if key(src) == partner(dst) else (base, src)
                    ops.append({"copy": {"src": first._ref(), "dst": dst._ref()}})
                    ops.append({"reduce": {"src": second._ref(), "dst": dst._ref()}})
                for r in reads:
                    r.rl = max(r.rl, k)
                for x in ws:
                    x.acc = -1
                    x.w = k
        slots = 0
        for src, dst, base in self._ops:
            for c in (src, dst, base):
                if c is not None and c.buf == "scratch":
                    slots = max(slots, c.index // n + 1)
        ranks = [[{key: v for key, v in steps[k][r].items() if v} for k in range(len(steps))] for r in range(n)]
        out = {"format": "plait.schedule", "version": 1}
        if self.description:
            out["description"] = self.description
        if self.when:
            out["when"] = dict(self.when)
        out.update({"name": self.name, "collective": self.collective, "nranks": n, "root": self.root,
                    "scratch_slots": slots, "ranks": ranks})
        return out

    def to_json(self) -> str:
        """The schedule file's text: one line per step."""
        return _format(self.compile())

    def check(self) -> dict:
        """Compiles and verifies (out of place and in place); returns the schedule's facts
        (steps, transfers, digest...). Raises ScheduleError saying what is wrong."""
        return _core.check_schedule(self.to_json(), f"{self.name} (compiled)")

    def save(self, path: str) -> dict:
        """Checks, then writes the schedule file to `path`; returns its facts."""
        facts = self.check()
        with open(path, "w") as f:
            f.write(self.to_json())
        return facts


def _format(doc: dict) -> str:
    """Pretty JSON with each step on one line (as plait writes built-ins)."""
    head = {k: v for k, v in doc.items() if k != "ranks"}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v)},")
    lines.append('  "ranks": [')
    for i, prog in enumerate(doc["ranks"]):
        lines.append("    [")
        for j, s in enumerate(prog):
            lines.append("      " + json.dumps(s, separators=(",", ":")) + ("," if j + 1 < len(prog) else ""))
        lines.append("    ]" + ("," if i + 1 < len(doc["ranks"]) else ""))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def paths_setting(schedules, what: str = "schedules") -> str:
    """`schedules=` (a path, or a list of paths: schedule files and directories of them) as
    PLAIT_SCHEDULES spells it."""
    items = [schedules] if isinstance(schedules, (str, os.PathLike)) else list(schedules)
    for p in items:
        if not isinstance(p, (str, os.PathLike)):
            raise _core.InvalidArgumentError(f"{what}: schedules must be paths (str or os.PathLike), got {type(p).__name__}")
    return os.pathsep.join(os.fspath(p) for p in items)


def check(text: str, origin: str = "<schedule>", custom: bool = True) -> dict:
    """Verifies a schedule file's text; returns its facts or raises ScheduleError."""
    return _core.check_schedule(text, origin, custom)


def builtin(collective: str, algorithm: str, nranks: int, root: int = 0, name: Optional[str] = None) -> str:
    """A built-in algorithm's schedule file (rank order, no measured links); `name` renames it,
    which makes it a custom schedule that could be registered."""
    return _core.schedule_file(collective, algorithm, nranks, root, name)


def load(path: str, nranks: Optional[int] = None) -> Tuple[str, str]:
    """(schedule file text, origin) from `path`: a `.json` schedule file, or a `.py` program
    with `build(nranks)` returning a Program (then `nranks` is required)."""
    if path.endswith(".py"):
        if nranks is None:
            raise ScheduleError(f"{path}: a program file needs the number of ranks to build for")
        import importlib.util

        spec = importlib.util.spec_from_file_location(f"plait_schedule_{abs(hash(path))}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        build = getattr(mod, "build", None)
        if build is None:
            raise ScheduleError(f"{path}: a program file must define build(nranks) returning a plait.schedule.Program")
        try:
            prog = build(nranks)
        except (ValueError, ScheduleError) as e:
            # A program may refuse a size it is not written for; say so without a traceback.
            raise ScheduleError(f"{path}: build({nranks}): {e}") from e
        if not isinstance(prog, Program):
            raise ScheduleError(f"{path}: build({nranks}) returned {type(prog).__name__}, not a Program")
        return prog.to_json(), f"{os.path.basename(path)} (nranks={nranks})"
    with open(path) as f:
        return f.read(), path
