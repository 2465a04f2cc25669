"""Authenticated links from Python: PLAIT_TOKEN / PLAIT_TOKEN_FILE and PLAIT_ENCRYPT through
init_from_env, ranks that disagree on them, and settings that cannot be used."""

import os
import socket
import sys

from test_misc import _run_all

SCRIPT = """
import sys, numpy as np, plait
try:
    comm = plait.init_from_env(timeout=float(sys.argv[1]))
except plait.PlaitError as e:
    print("failed:", type(e).__name__, e)
    sys.exit(3)
x = np.arange(1 << 20, dtype=np.float32) + comm.rank
y = comm.allreduce(x)
n = comm.world_size
assert (y == n * np.arange(1 << 20, dtype=np.float32) + n * (n - 1) / 2).all(), y[:4]
g = comm.allgather(np.array([comm.rank], np.int64))
assert g.reshape(-1).tolist() == list(range(n))
comm.close()
print("ok", comm.rank)
"""


def _world(envs, timeout_s=30):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = len(envs)
    base = {k: v for k, v in os.environ.items() if k not in ("PLAIT_TOKEN", "PLAIT_TOKEN_FILE", "PLAIT_ENCRYPT")}
    full = [dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n), **e)
            for r, e in enumerate(envs)]
    return _run_all([[sys.executable, "-c", SCRIPT, str(timeout_s)]] * n, full, timeout=90)


def test_a_world_with_a_token_file_and_encryption_computes(tmp_path):
    token = tmp_path / "token"
    token.write_text("  a secret shared by every rank\n")
    for env in ({"PLAIT_TOKEN_FILE": str(token), "PLAIT_ENCRYPT": "1"}, {"PLAIT_TOKEN": "another secret"}):
        results = _world([env] * 3)
        for r, (out, code) in enumerate(results):
            assert code == 0 and f"ok {r}" in out, f"{env}: rank {r} exit {code}:\n{out[-3000:]}"


def test_a_rank_without_the_token_is_refused_naming_the_setting():
    results = _world([{"PLAIT_TOKEN": "s3cret"}, {}], timeout_s=4)
    outs = "\n".join(out for out, _ in results)
    assert all(code == 3 for _, code in results), outs
    assert "rank 1 does not have PLAIT_TOKEN set and this rank has" in outs, outs


def test_unusable_token_and_encryption_settings_are_config_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = [
        ({"PLAIT_ENCRYPT": "yes"}, "PLAIT_ENCRYPT"),
        ({"PLAIT_TOKEN": "a", "PLAIT_TOKEN_FILE": str(empty)}, "not both"),
        ({"PLAIT_TOKEN_FILE": str(empty)}, "is empty"),
        ({"PLAIT_TOKEN_FILE": str(tmp_path / "missing")}, "cannot be read"),
        # `PLAIT_TOKEN=$UNSET_VAR` on every rank must not quietly turn the token off.
        ({"PLAIT_TOKEN": "  "}, "set but blank"),
    ]
    for env, what in cases:
        [(out, code)] = _world([env], timeout_s=5)
        assert code == 3 and "ConfigError" in out and what in out, f"{env}:\n{out[-3000:]}"
