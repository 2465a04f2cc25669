"""Core bug repro: two async (inline=False) sends to one peer with one tag can be matched out of
order, because the point-to-point ordinal is taken on the core worker thread that runs the op
(exec::send_p2p -> fabric.p2p_ordinal; Mailbox::post_p2p for receives), not when the op is
submitted. With two workers the second send can take ordinal 0. Same for two async receives.

    python tests/torch/repro_core_p2p_order.py   # 2 ranks on loopback; expect "0 of 2000"

The torch layer avoids it by running each (peer, tag) lane's operations one at a time
(python/plait/torch/lanes.py). Not a pytest test on purpose (it documents a core issue).
"""
import datetime, os, sys, subprocess
import numpy as np

def rank_main(rank, port):
    from torch.distributed import TCPStore
    import plait._core as core
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    comm = core.Comm(store, rank, 2, timeout=30.0)
    bad = 0
    for it in range(2000):
        a = np.full(4, 1.0, np.float32); b = np.full(4, 2.0, np.float32)
        if rank == 0:
            w1 = comm.send(a.ctypes.data, a.nbytes, "f32", 1, 7)  # inline=False: core worker
            w2 = comm.send(b.ctypes.data, b.nbytes, "f32", 1, 7)
            w1.wait(); w2.wait()
        else:
            x = np.zeros(4, np.float32); y = np.zeros(4, np.float32)
            r1 = comm.recv(x.ctypes.data, x.nbytes, "f32", 0, 7)
            r2 = comm.recv(y.ctypes.data, y.nbytes, "f32", 0, 7)
            r1.wait(); r2.wait()
            if x[0] != 1.0 or y[0] != 2.0:
                bad += 1
        w = comm.barrier(); w.wait()
    if rank == 1:
        print(f"messages swapped in {bad} of 2000 iterations (expected 0)")
    comm.close()

if __name__ == "__main__":
    if len(sys.argv) > 1:
        rank_main(int(sys.argv[1]), int(sys.argv[2]))
    else:
        import socket
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        ps = [subprocess.Popen([sys.executable, __file__, str(r), str(port)]) for r in range(2)]
        for p in ps: p.wait()
