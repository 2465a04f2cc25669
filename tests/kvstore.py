"""A tiny key-value store with the interface plait needs (set / get / wait / check), so that test
worlds do not pay torch's import time in every process. The test process serves it; workers connect.
Torch's TCPStore is exercised by the demo, init_from_env and some worlds (see harness.run_world)."""

import datetime
import pickle
import socket
import struct
import threading
import time

_LEN = struct.Struct("!I")


def _send(sock, obj):
    data = pickle.dumps(obj)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock):
    head = _recv_exact(sock, _LEN.size)
    return pickle.loads(_recv_exact(sock, _LEN.unpack(head)[0]))


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("kvstore: connection closed")
        buf += chunk
    return bytes(buf)


def _seconds(timeout, default):
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


class KVServer:
    """Serves a dict on 127.0.0.1:<port> from daemon threads; also usable directly in-process."""

    def __init__(self):
        self._data = {}
        self._cond = threading.Condition()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def set(self, key, value):
        if isinstance(value, str):
            value = value.encode()
        with self._cond:
            self._data[key] = bytes(value)
            self._cond.notify_all()

    def get(self, key, timeout=300.0):
        self.wait([key], timeout)
        with self._cond:
            return self._data[key]

    def check(self, keys):
        with self._cond:
            return all(k in self._data for k in keys)

    def wait(self, keys, timeout=None):
        deadline = time.monotonic() + _seconds(timeout, 300.0)
        with self._cond:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [k for k in keys if k not in self._data]
                    raise TimeoutError(f"kvstore: keys {missing} not set after {_seconds(timeout, 300.0)} s")
                self._cond.wait(left)

    def close(self):
        self._closed = True
        self._sock.close()

    def _accept(self):
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            while True:
                try:
                    cmd, args = _recv(conn)
                except (ConnectionError, OSError):
                    return
                try:
                    reply = ("ok", getattr(self, cmd)(*args))
                except Exception as e:  # sent back and raised in the client
                    reply = ("err", f"{type(e).__name__}: {e}")
                try:
                    _send(conn, reply)
                except OSError:
                    return


class KVClient:
    """Store client: set(key, bytes), get(key) (blocks until set), wait(keys, timedelta), check(keys)."""

    def __init__(self, port, host="127.0.0.1", timeout=300.0):
        self._addr = (host, port)
        self._timeout = timeout
        self._local = threading.local()  # one connection per thread: a blocked wait blocks no one else

    def _conn(self):
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.create_connection(self._addr, timeout=30)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.sock = sock
        return sock

    def _call(self, cmd, *args):
        sock = self._conn()
        _send(sock, (cmd, args))
        status, value = _recv(sock)
        if status == "err":
            if value.startswith("TimeoutError"):
                raise TimeoutError(value)
            raise RuntimeError(value)
        return value

    def set(self, key, value):
        self._call("set", key, value)

    def get(self, key):
        return self._call("get", key, self._timeout)

    def wait(self, keys, timeout=None):
        self._call("wait", list(keys), _seconds(timeout, self._timeout))

    def check(self, keys):
        return self._call("check", list(keys))
