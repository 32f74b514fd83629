"""Debian's ``redis-server`` for the shared ledger's tests: found on PATH, or installed with
apt-get (as root, or through sudo without a password) when it is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def ensure() -> str:
    """The path of ``redis-server``, installing Debian's package when it is missing."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    if shutil.which("apt-get") is None:
        raise SystemExit("redis-server is missing and apt-get is not here: install Redis >= 6")
    print("redis_server: installing Debian's redis-server with apt-get (about a minute)",
          file=sys.stderr, flush=True)  # fmt: skip
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        [*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", "redis-server"],
        check=True,
        env=env,
    )
    found = shutil.which("redis-server")
    if found is None:
        raise SystemExit("apt-get installed redis-server but it is not on PATH")
    return found
