"""`RedisServer`: a private `redis-server` for `pdserve up` (when no Redis URL is given) and the
tests: no persistence, a free loopback port, a temp folder naming its owner (pdserve.private_dirs),
optionally a password.

The password reaches redis-server through its stdin (`redis-server -` reads its config there),
never through its command line, so `ps` cannot show it; `url` never contains it either: give
`password` to the clients (`InstanceRegistry(url, password=...)`, or PDSERVE_REDIS_PASSWORD).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from pdserve.private_dirs import make_private_dir
from pdserve.rpc import free_port


def _config_string(text: str) -> str:
    """`text` as a double-quoted redis.conf string (every byte escaped: any password works)."""
    return '"' + "".join(f"\\x{b:02x}" for b in text.encode()) + '"'


class RedisServer:
    """with RedisServer(password="...") as server:
    registry = InstanceRegistry(server.url, password=server.password)
    """

    def __init__(
        self,
        binary: str = "redis-server",
        host: str = "127.0.0.1",
        password: str | None = None,
        port: int = 0,
    ) -> None:
        if password is not None and not password:
            raise ValueError("password must not be empty (None: no password)")
        self.binary = binary
        self.host = host
        self.password = password
        self.port = port  # 0: a free one at each start
        self._fixed_port = port
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        """`redis://host:port/0`, without the password."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING; raises RuntimeError when it does not."""
        if shutil.which(self.binary) is None:
            raise RuntimeError(f"{self.binary} not found (apt-get install redis-server)")
        self._dir = make_private_dir("pdserve-redis-")  # a dead owner's: removed by `pdserve up`
        config = "" if self.password is None else f"requirepass {_config_string(self.password)}\n"
        for _attempt in range(3):  # the free port can be taken before redis binds it: retry
            self.port = self._fixed_port or free_port(self.host)
            args = ["--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no"]
            with open(self._dir / "redis.log", "wb") as out:
                self._proc = subprocess.Popen(
                    [self.binary, "-", *args, "--dir", str(self._dir)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.PIPE,
                )
            assert self._proc.stdin is not None
            try:  # redis reads its config up to the end of stdin, then starts
                self._proc.stdin.write(config.encode())
                self._proc.stdin.close()
            except BrokenPipeError:
                pass  # it died already: _wait_ready sees it, the log tells why
            if self._wait_ready(timeout):
                return self
        tail = (self._dir / "redis.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"redis-server did not start:\n{tail}")

    def _wait_ready(self, timeout: float) -> bool:
        assert self._proc is not None
        client = redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_connect_timeout=0.5,
            socket_timeout=0.5,
        )
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline and self._proc.poll() is None:
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.02)
        finally:
            client.close()
        self._proc.kill()
        self._proc.wait()
        return False

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Stop and start again on the same port, empty (a Redis outage, for tests)."""
        self._fixed_port = self.port
        self.stop()
        return self.start(timeout)

    def stop(self, grace: float = 5.0) -> None:
        """Terminate the server (kill it after `grace` seconds) and remove its folder."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self if self._proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
