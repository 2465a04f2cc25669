"""DiLoCo: each member takes H inner steps alone, then the members average how far their
parameters moved and take one outer step (SGD with Nesterov momentum) on the shared parameters.
About H times less traffic than averaging gradients every step; with `wire="int8"` about 4 times
less again.

    import plait.elastic
    from plait.diloco import DiLoCo

    comm = plait.elastic.join()
    diloco = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-3), comm, every=100, wire="int8")
    while True:
        diloco.update()                  # the update point: joiners come in and take the outer state
        loss = model(batch).loss
        loss.backward()
        diloco.step()                    # the inner step; every `every` steps, the outer step
        diloco.zero_grad()

The outer state (the outer parameters, the momentum, the step counters and, in async mode, the
average not yet applied) is shared state (`plait.elastic.SharedState`): a joiner receives it at
the update point that admits it, striped over the members, and starts its inner steps from the
outer parameters. A member lost during an average: it is retried over the members left, and the
average divides by those that took part; every member applies the same outer step, so the outer
parameters stay bit-identical.

Modes: `mode="sync"` (the average is waited for at the end of each round), `"async"` (the
average of round t runs in the background during the inner steps of round t+1 and is applied at
the end of round t+1, as in PCCL's async DiLoCo), `"streaming"` with `fragments=F` (the
parameters are cut in F fragments, each averaged and stepped at its own inner step of the round,
so the traffic is spread over the round).

The model's parameters must be float32 CPU tensors: DiLoCo keeps them in one flat buffer (each
parameter's `.data` becomes a view of it), so an outer step is a few vector operations.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional

import numpy as np
import torch

from . import _core
from ._shared_state import SharedState

MODES = ("sync", "async", "streaming")


class DiLoCo:
    """See the module's docstring. `comm`: an elastic communicator (`plait.elastic.join()`) or a
    static `plait.Communicator`; `every`: H, the inner steps per round; `wire`: how the average
    travels ("f32", "bf16", "f16", "int8"); `error_feedback` (default: on for a lossy wire): what
    the wire rounded away from this member's contribution is added to its next one."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, comm: Any, *,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True, every: int = 100,
                 wire: str = "f32", error_feedback: Optional[bool] = None, mode: str = "sync", fragments: int = 1) -> None:
        if mode not in MODES:
            raise ValueError(f"DiLoCo: mode must be one of {MODES}, got {mode!r}")
        if int(every) < 1:
            raise ValueError(f"DiLoCo: every must be at least 1, got {every}")
        fragments = int(fragments) if mode == "streaming" else 1
        if not 1 <= fragments <= int(every):
            raise ValueError(f"DiLoCo: fragments must be between 1 and every ({every}), got {fragments}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise ValueError(f"DiLoCo: parameters must be float32 CPU tensors, one is {p.dtype} on {p.device}")
        self.inner = inner_optimizer
        self.comm = comm
        self.lr, self.mu, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        self.every, self.mode, self.fragments = int(every), mode, fragments
        self.wire = _core.wire_name(wire or "native")  # "f32" and the like are "native"
        self.error_feedback = (self.wire != "native") if error_feedback is None else bool(error_feedback)
        # The parameters live in one flat buffer, so the round's delta is one subtraction.
        n = sum(p.numel() for p in self.params)
        self.local = torch.empty(n, dtype=torch.float32)
        at = 0
        with torch.no_grad():
            for p in self.params:
                view = self.local[at:at + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                at += p.numel()
        self.outer = self.local.clone()  # the outer (shared) parameters
        self.momentum = torch.zeros(n)
        self.pending = torch.zeros(n)  # async: the last average, applied at the end of the next round
        # inner steps taken, rounds applied, whether `pending` holds an average not yet applied,
        # whether rounds end with a background average (async mode, after the first round)
        self.counters = torch.zeros(4, dtype=torch.int64)
        self.residual = torch.zeros(n) if self.error_feedback else None
        self.state = SharedState({"outer": self.outer, "momentum": self.momentum, "pending": self.pending,
                                  "counters": self.counters})
        bounds = [round(i * n / fragments) for i in range(fragments + 1)]
        self.fragment_slices = [slice(bounds[i], bounds[i + 1]) for i in range(fragments)]
        self.bytes_sent = 0  # payload bytes this member contributed to averages (wire encoding included)
        self._fresh = True
        self._flight: Optional[threading.Thread] = None
        self._flight_error: Optional[BaseException] = None
        self._flight_buf: Optional[torch.Tensor] = None

    # -- the loop's calls --------------------------------------------------------------------------

    @property
    def inner_steps(self) -> int:
        return int(self.counters[0])

    @property
    def rounds(self) -> int:
        """Outer steps applied (whole rounds; in streaming mode, rounds whose every fragment was)."""
        return int(self.counters[1])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def update(self) -> bool:
        """The update point (elastic mode): admits joiners (`comm.update()`), and when the view
        changed shares the outer state (`sync`). Every member calls it at the same place in its
        loop. True if the view changed. In async mode, while an average runs in the background
        (from the end of the first round on), the update point moves to the end of each round
        (waiting here would undo the overlap): this call returns False, and joiners come in when
        the round ends."""
        if self._flight is not None:
            return False
        changed = bool(self.comm.update())
        if changed:
            self.sync()
            if self.mode == "async" and int(self.counters[3]):
                # A joiner admitted at the end of a round: the members are starting that round's
                # average, so it starts its part too (its delta is zero: it has not trained yet).
                self._round_async_tail()
        return changed

    def sync(self) -> dict:
        """Makes the outer state bit-identical on every member (`sync_shared_state`); a member
        that had none yet (a joiner) starts its inner steps from the outer parameters."""
        self._land()
        report = self.comm.sync_shared_state(self.state)
        if self._fresh:
            with torch.no_grad():
                self.local.copy_(self.outer)
            self._fresh = False
        return report

    def step(self) -> None:
        """The inner step (`inner_optimizer.step()`), then the outer step when one is due."""
        self.inner.step()
        self.counters[0] += 1
        t = int(self.counters[0])
        if self.mode == "streaming":
            offset = t % self.every or self.every
            for f, sl in enumerate(self.fragment_slices):
                if offset == (f + 1) * self.every // self.fragments:
                    self._round_sync(sl)
                    if f == self.fragments - 1:
                        self.counters[1] += 1
        elif t % self.every == 0:
            if self.mode == "sync":
                self._round_sync(slice(None))
                self.counters[1] += 1
            else:
                self._round_async()

    def finish(self) -> None:
        """Async mode: waits for the last average and applies it (call it before using the model
        at the end of training). A no-op in the other modes."""
        self._land()
        if self.mode == "async" and int(self.counters[2]):
            self._apply(self.pending, slice(None))
            self.counters[2] = 0
            self.counters[1] += 1
            with torch.no_grad():
                self.local.copy_(self.outer)

    # -- rounds ------------------------------------------------------------------------------------

    def _delta(self, sl: slice) -> torch.Tensor:
        """This member's contribution: how far it moved from the outer parameters (plus what the
        wire rounded away last time), with the error feedback for the next one kept."""
        delta = self.outer[sl] - self.local[sl]
        if self.residual is not None:
            delta += self.residual[sl]
            sent = delta.clone()
            a = sent.numpy()
            _core.wire_round_trip(self.wire, a.ctypes.data, a.nbytes)
            self.residual[sl] = delta - sent
        return delta

    def _average(self, buf: torch.Tensor) -> None:
        a = buf.numpy()
        kw = {} if self.wire == "native" else {"wire": self.wire}
        retry = getattr(self.comm, "allreduce_with_retry", None)
        if retry is not None:
            retry(a, "avg", out=a, **kw)
        else:
            self.comm.allreduce(a, "avg", out=a, **kw)
        self.bytes_sent += _core.wire_bytes(self.wire, a.size)

    def _apply(self, g: torch.Tensor, sl: slice) -> None:
        """The outer step on `outer[sl]` with the averaged delta `g`: torch's SGD with momentum
        (dampening 0), Nesterov or not."""
        m, o = self.momentum[sl], self.outer[sl]
        m.mul_(self.mu).add_(g)
        step = g.add(m, alpha=self.mu) if self.nesterov else m
        o.add_(step, alpha=-self.lr)

    def _round_sync(self, sl: slice) -> None:
        delta = self._delta(sl)
        self._average(delta)
        self._apply(delta, sl)
        with torch.no_grad():
            self.local[sl] = self.outer[sl]

    def _round_async(self) -> None:
        """End of a round in async mode: this round's delta (against the outer parameters that do
        not yet hold the last average) goes to a background average; the last average, complete
        by now, is applied and the inner steps restart from the result."""
        self._land()
        self.counters[3] = 1  # an average starts at each round's end from now on (joiners admitted below join it)
        if bool(self.comm.update()):  # the update point of async mode
            self.sync()
        self._round_async_tail()

    def _round_async_tail(self) -> None:
        delta = self._delta(slice(None))
        had_pending = bool(int(self.counters[2]))
        if had_pending:
            self._apply(self.pending, slice(None))
            self.counters[1] += 1
            with torch.no_grad():
                self.local.copy_(self.outer)
        self.counters[2] = 0
        self._flight_buf = delta
        self._flight_error = None
        self._flight = threading.Thread(target=self._fly, name="plait-diloco-average", daemon=True)
        self._flight.start()

    def _fly(self) -> None:
        try:
            self._average(self._flight_buf)
        except BaseException as e:  # raised on the loop's thread at the next landing
            self._flight_error = e

    def _land(self) -> None:
        """Waits for the average under way (async) and keeps its result as `pending`."""
        if self._flight is None:
            return
        self._flight.join()
        self._flight = None
        if self._flight_error is not None:
            e, self._flight_error = self._flight_error, None
            raise e
        self.pending.copy_(self._flight_buf)
        self.counters[2] = 1
        self._flight_buf = None

