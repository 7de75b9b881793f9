"""The children of one `pdserve up` (pdserve.launcher): its private folder and secrets, the
private Redis, the service processes and the router, supervised (a dead one restarted with
backoff, a hung service killed and restarted: pdserve.hang_watch) and stopped in order (router,
services, Redis). The private folders of `pdserve up`s that died without cleaning up (SIGKILL)
are removed at the start (pdserve.private_dirs)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from pdserve.hang_watch import HeartbeatWatch
from pdserve.internal_auth import load_redis_password
from pdserve.private_dirs import make_private_dir, remove_orphaned_dirs
from pdserve.registry import RedisServer
from pdserve.supervisor import Child, die_with_parent_wrapper, is_running, say, stop_children

SERVICE_GRACE_S = 10.0
ROUTER_EXIT_S = 5.0  # after its --shutdown-timeout: the router's error events, then its exit
SECRET_ENVS = ("PDSERVE_INTERNAL_SECRET_FILE", "PDSERVE_INTERNAL_SECRET")


class StartupError(RuntimeError):
    pass


def health(url: str) -> dict | None:
    """The router's /health JSON when it answers 200, else None."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return json.loads(response.read()) if response.status == 200 else None
    except (OSError, ValueError, urllib.error.URLError):
        return None


def split_redis_password(url: str) -> tuple[str, str | None]:
    """(the URL without its password, the password or None): the password travels apart."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url, None
    user = urllib.parse.quote(parts.username or "", safe="")
    netloc = (f"{user}@" if user else "") + parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), urllib.parse.unquote(parts.password)


class Stack:
    """The children of one `pdserve up` (and the private folder of its secret), supervised."""

    def __init__(self) -> None:
        for folder in remove_orphaned_dirs():
            say(f"removed {folder}: left behind by a process that is gone")
        self.folder = make_private_dir("pdserve-up-")  # mode 0700
        self.env: dict[str, str] = {}  # the secrets' variables, for every child
        self.redis: RedisServer | None = None  # the private one
        self.redis_url = ""
        self.services: list[Child] = []
        self.router: Child | None = None
        self.watch: HeartbeatWatch | None = None  # the services' heartbeats, once the stack is up

    @property
    def children(self) -> list[Child]:
        return self.services + ([self.router] if self.router else [])

    def make_secrets(self, redis_url: str | None) -> None:
        """Step 2-3: the internal secret (PDSERVE_INTERNAL_SECRET(_FILE) of our environment, else
        a new one in a 0600 file), and Redis: `redis_url` (its password moved to the
        environment), else a private redis-server with a random password."""
        if not any(os.environ.get(name) for name in SECRET_ENVS):
            path = self.folder / "internal-secret"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32))
            self.env["PDSERVE_INTERNAL_SECRET_FILE"] = str(path)
        if redis_url:
            self.redis_url, password = split_redis_password(redis_url)
        else:
            password = secrets.token_hex(32)
            try:
                binary = die_with_parent_wrapper("redis-server", self.folder)
                self.redis = RedisServer(binary=binary, password=password).start()
            except RuntimeError as e:
                raise StartupError(str(e)) from e
            self.redis_url = split_redis_password(self.redis.url)[0]
            say(f"redis at {self.redis_url} (its password in the children's environment)")
        if password is not None:
            self.env["PDSERVE_REDIS_PASSWORD"] = password

    def watch_heartbeats(self, timeout_s: float, start_grace_s: float) -> None:
        """From now on `supervise` kills and restarts a service whose heartbeat stays away for
        `timeout_s` (`start_grace_s` for the first beat after a restart); 0: never."""
        if timeout_s > 0:
            password = self.env.get("PDSERVE_REDIS_PASSWORD") or load_redis_password()
            self.watch = HeartbeatWatch(self.redis_url, password, timeout_s, start_grace_s)

    def failure(self) -> str | None:
        return next((f for f in (c.failure() for c in self.children) if f), None)

    def supervise(self) -> str | None:
        """Restart dead children (with backoff), kill hung services (restarted in turn); a message
        when the stack cannot go on."""
        now = time.monotonic()
        for child in self.children:
            child.poll_restart(now)
        for child, why in self.watch.hung(self.services, now) if self.watch else []:
            child.kill_hung(why, now)
        if self.redis is not None and not is_running(self.redis.pid or 0):
            say("the private redis-server died: starting it again on its port")
            try:
                self.redis.restart()  # empty: the services register again within a heartbeat
            except RuntimeError as e:
                return f"the private redis-server died and did not start again: {e}"
            say(f"restarted redis (pid {self.redis.pid})")
        return None

    def stop(self, shutdown_timeout_s: float, hurry: threading.Event) -> None:
        if self.router is not None:
            say(f"stopping the router (up to {shutdown_timeout_s:g}s for open streams)")
            stop_children([self.router], shutdown_timeout_s + ROUTER_EXIT_S, hurry)
        if self.services:
            say(f"stopping {len(self.services)} service(s)")
            stop_children(self.services, SERVICE_GRACE_S, hurry)
        if self.redis is not None:
            say("stopping redis")
            self.redis.stop()
        if self.watch is not None:
            self.watch.close()
        shutil.rmtree(self.folder, ignore_errors=True)
