"""DiLoCo: each member takes H inner steps alone, then the members average how far their
parameters moved and take one outer step (SGD with Nesterov momentum) on the shared parameters.
About H times less traffic than averaging gradients every step; with `wire="int8"` about 4 times
less again.

    import plait.elastic
    from plait.diloco import DiLoCo

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)   # before join(): the first optimizer is slow to build
    comm = plait.elastic.join()
    diloco = DiLoCo(model, inner, comm, every=100, wire="int8")
    while diloco.inner_steps < total_steps:      # the group's count: a joiner starts mid-run
        diloco.update()                  # the update point: joiners come in and take the outer state
        loss = model(batch).loss
        loss.backward()
        diloco.step()                    # the inner step; every `every` steps, the outer step
        diloco.zero_grad()
    diloco.finish()                      # the model's parameters are now the outer ones, on every member

The outer state (the outer parameters, the momentum, the step counters and, in async mode, the
average not yet applied) is shared state (`plait.elastic.SharedState`): a joiner receives it at
the update point that admits it (the start of a round), striped over the members. In sync and
streaming modes the members send it from a background thread and go on with their inner steps;
the joiner sits out the rest of that round (it takes part in the round's average with weight 0)
and trains from the next one. A member lost during an average: it is retried over the members
left, and the average divides by the weight of those that took part; every member applies the
same outer step, so the outer parameters stay bit-identical.

While it communicates in the background (async mode: every round; sync and streaming modes: a
round whose `update()` returned True), the communicator is DiLoCo's: a call of your own on it
would pair with DiLoCo's in a different order on different members.

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
import time
from typing import Any, List, Optional

import numpy as np
import torch

from . import _core
from ._core import PeerLost
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
        # whether rounds end with a background average (async mode, after the first round), the
        # members' mean round time in ms at the last average (a joiner's wait for a round's end)
        self.counters = torch.zeros(5, dtype=torch.int64)
        # The counters as they were at the update point: what is shared, since `counters` moves on
        # during a catch-up in the background.
        self.counters_shared = torch.zeros(5, dtype=torch.int64)
        self.residual = torch.zeros(n) if self.error_feedback else None
        self.state = SharedState({"outer": self.outer, "momentum": self.momentum, "pending": self.pending,
                                  "counters": self.counters_shared})
        bounds = [round(i * n / fragments) for i in range(fragments + 1)]
        self.fragment_slices = [slice(bounds[i], bounds[i + 1]) for i in range(fragments)]
        self.bytes_sent = 0  # payload bytes this member contributed to averages (wire encoding included)
        self._fresh = True
        self._flight: Optional[threading.Thread] = None
        self._flight_error: Optional[BaseException] = None
        self._flight_buf: Optional[torch.Tensor] = None
        self._catchup: Optional[threading.Thread] = None
        self._catchup_error: Optional[BaseException] = None
        self._catchup_steps = 0  # `counters[0]` when the catch-up under way started
        self._sit_out = False  # a joiner's first round: it takes part in its averages with weight 0
        self._round_began = time.perf_counter()
        self.last_catchup: Optional[dict] = None  # what the last background catch-up did (`sync_shared_state`'s report)
        self.steps_during_catchup = 0  # inner steps this member took while it sent joiners the outer state

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
        changed shares the outer state. Every member calls it at the same place in its loop (every
        iteration is fine); True if the view changed.

        It communicates only at the start of a round (inner steps a multiple of `every`); other
        calls return False at once, so a round costs one small collective, not one per step. When
        the view changed, members that have trained send the outer state from a background thread
        while their inner steps go on (the round's first average waits for it); a joiner receives
        it here, then sits out the rest of the round: its next `step()` takes part in the round's
        averages with weight 0 (no inner step), and it trains from the next round on. In async
        mode the state is shared here, in the foreground, and while an average runs in the
        background (from the end of the first round on) the update point moves to the end of each
        round (waiting here would undo the overlap): this call returns False, and joiners come in
        when the round ends."""
        if self._flight is not None or int(self.counters[0]) % self.every:
            return False
        self._land_catchup()
        changed = bool(self.comm.update())
        if not changed:
            return False
        if self.mode != "async" and int(self.counters[0]) > 0:
            self._start_catchup()
            return True
        joining = self._fresh
        self.sync()
        if joining and int(self.counters[0]) > 0:
            # The members have trained: this member joins mid-run.
            if self.mode == "async":
                if int(self.counters[3]):
                    # Admitted at the end of a round: the members are starting that round's
                    # average, so it starts its part too, with weight 0 (it has not trained).
                    self._round_async_tail(weight=0)
            else:
                self._sit_out = True
        elif self.mode == "async" and int(self.counters[3]):
            self._round_async_tail()
        return True

    def sync(self) -> dict:
        """Makes the outer state bit-identical on every member now (`sync_shared_state`, in the
        foreground); a member that had none yet (a joiner) starts its inner steps from the
        outer parameters."""
        self._land_catchup()
        self._land()
        self.counters_shared.copy_(self.counters)
        self._catchup_steps = int(self.counters[0])
        report = self.comm.sync_shared_state(self.state)
        self._adopt_shared_counters()
        return report

    def step(self) -> None:
        """The inner step (`inner_optimizer.step()`), then the outer step when one is due. A
        joiner's first call after it joined mid-run takes no inner step: it takes part, with
        weight 0, in the averages left in the round under way, then moves to the round's end."""
        if self._sit_out:
            self._sit_out = False
            end = (int(self.counters[0]) // self.every + 1) * self.every
            # It waits for the members' round to end: up to a round's time (theirs, measured at
            # their last average), beyond the communicator's own timeout.
            wait = self._timeout() + 2 * int(self.counters[4]) / 1000
            applied = [self._round_sync(sl, weight=0, timeout=wait) for sl in self.fragment_slices]
            self.counters[0] = end
            self.counters[1] += int(applied[-1])
            return
        self._fresh = False  # it has trained: its parameters are its own from now on
        self.inner.step()
        self.counters[0] += 1
        t = int(self.counters[0])
        if self.mode == "streaming":
            offset = t % self.every or self.every
            for f, sl in enumerate(self.fragment_slices):
                if offset == (f + 1) * self.every // self.fragments:
                    applied = self._round_sync(sl)
                    if f == self.fragments - 1:
                        self.counters[1] += int(applied)
        elif t % self.every == 0:
            if self.mode == "sync":
                self.counters[1] += int(self._round_sync(slice(None)))
            else:
                self._round_async()

    def finish(self) -> None:
        """Call it before using the model at the end of training: waits for what runs in the
        background, applies the last average in async mode, and makes the model's parameters the
        outer parameters (the same on every member; inner steps taken since the last average,
        such as a streaming fragment's since its own, are dropped)."""
        self._land_catchup()
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

    def _timeout(self) -> float:
        return float(getattr(getattr(self.comm, "_comm", None), "timeout", 300.0))

    def _average(self, buf: torch.Tensor, weight: int = 1, timeout: Optional[float] = None) -> float:
        """Averages `buf` in place over the members, each counted with its `weight` (a joiner
        sitting out its first round: 0, its `buf` zeros); returns the weights' sum (0: nobody
        trained)."""
        if weight == 0:
            buf.zero_()
        a = buf.numpy()
        kw = {} if self.wire == "native" else {"wire": self.wire}
        if timeout is not None:
            kw["timeout"] = timeout
        self.bytes_sent += _core.wire_bytes(self.wire, a.size)
        round_seconds = time.perf_counter() - self._round_began
        if not hasattr(self.comm, "allreduce_with_retry"):  # a static group: every member trained
            self.comm.allreduce(a, "avg", out=a, **kw)
            self._round_began = time.perf_counter()
            return float(self.comm.world_size)
        # The weights' sum and the sum of the deltas must come from the same members: a member
        # lost during either fails both on every member alike, and both are run again (a failed
        # call leaves its buffer as it was). The first also sums the members' round times.
        while True:
            total = np.array([float(weight), weight * round_seconds])
            try:
                self.comm.allreduce(total, "sum", out=total, **({"timeout": timeout} if timeout else {}))
                self.comm.allreduce(a, "sum", out=a, **kw)
                break
            except PeerLost:
                continue
        self._round_began = time.perf_counter()
        if total[0] > 0:
            buf.div_(float(total[0]))
            self.counters[4] = int(1000 * total[1] / total[0])  # from the sums: the same on every member
        return float(total[0])

    def _apply(self, g: torch.Tensor, sl: slice) -> None:
        """The outer step on `outer[sl]` with the averaged delta `g`: torch's SGD with momentum
        (dampening 0), Nesterov or not."""
        m, o = self.momentum[sl], self.outer[sl]
        m.mul_(self.mu).add_(g)
        step = g.add(m, alpha=self.mu) if self.nesterov else m
        o.add_(step, alpha=-self.lr)

    def _round_sync(self, sl: slice, weight: int = 1, timeout: Optional[float] = None) -> bool:
        """Averages the delta of `sl` and takes the outer step on it; False if no member had
        trained (no step)."""
        self._land_catchup()
        delta = self._delta(sl)
        applied = self._average(delta, weight, timeout) > 0
        if applied:
            self._apply(delta, sl)
        with torch.no_grad():
            self.local[sl] = self.outer[sl]
        return applied

    def _round_async(self) -> None:
        """End of a round in async mode: this round's delta (against the outer parameters that do
        not yet hold the last average) goes to a background average; the last average, complete
        by now, is applied and the inner steps restart from the result."""
        self._land_catchup()
        self._land()
        self.counters[3] = 1  # an average starts at each round's end from now on (joiners admitted below join it)
        if bool(self.comm.update()):  # the update point of async mode
            self.sync()
        self._round_async_tail()

    def _round_async_tail(self, weight: int = 1) -> None:
        delta = self._delta(slice(None))
        had_pending = bool(int(self.counters[2]))
        if had_pending:
            self._apply(self.pending, slice(None))
            self.counters[1] += 1
            with torch.no_grad():
                self.local.copy_(self.outer)
        self.counters[2] = 0
        self._flight_buf = delta
        self._flight_weight = weight
        self._flight_total = 0.0
        self._flight_error = None
        self._flight = threading.Thread(target=self._fly, name="plait-diloco-average", daemon=True)
        self._flight.start()

    def _fly(self) -> None:
        try:
            self._flight_total = self._average(self._flight_buf, self._flight_weight)
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
        if self._flight_total > 0:  # 0: nobody trained, no outer step (zeros would still move the momentum)
            self.pending.copy_(self._flight_buf)
            self.counters[2] = 1
        self._flight_buf = None

    # -- a joiner's catch-up, in the background on the members ---------------------------------------

    def _start_catchup(self) -> None:
        """Shares the outer state (as it is at this update point) from a background thread: the
        outer state does not change before the round's first average, which waits for it."""
        self.counters_shared.copy_(self.counters)
        self._catchup_steps = int(self.counters[0])
        self._catchup_error = None
        self._catchup = threading.Thread(target=self._serve_catchup, name="plait-diloco-catchup", daemon=True)
        self._catchup.start()

    def _serve_catchup(self) -> None:
        try:
            self.last_catchup = self.comm.sync_shared_state(self.state)
        except BaseException as e:  # raised on the loop's thread where the catch-up is waited for
            self._catchup_error = e

    def _land_catchup(self) -> None:
        if self._catchup is None:
            return
        self._catchup.join()
        self._catchup = None
        self.steps_during_catchup += int(self.counters[0]) - self._catchup_steps
        if self._catchup_error is not None:
            e, self._catchup_error = self._catchup_error, None
            raise e
        self._adopt_shared_counters()

    def _adopt_shared_counters(self) -> None:
        """After a sync: the counters are the group's (plus the inner steps taken since the
        update point); a member that had no state yet starts from the outer parameters."""
        taken = int(self.counters[0]) - self._catchup_steps
        self.counters.copy_(self.counters_shared)
        self.counters[0] += taken
        if self._fresh:
            with torch.no_grad():
                self.local.copy_(self.outer)
            self._fresh = False
