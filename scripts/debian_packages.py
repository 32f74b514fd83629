"""Debian's packages that the tests run as programs (``redis-server``, headless ``chromium``):
found on PATH, or installed with apt-get (as root, or through sudo without a password) when
missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def ensure(command: str, package: str, *, minutes: str = "about a minute") -> str:
    """The path of ``command``, installing Debian's ``package`` when it is not on PATH."""
    found = shutil.which(command)
    if found is not None:
        return found
    if shutil.which("apt-get") is None:
        raise SystemExit(f"{command} is missing and apt-get is not here: install {package}")
    print(f"debian_packages: installing Debian's {package} with apt-get ({minutes})",
          file=sys.stderr, flush=True)  # fmt: skip
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        [*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", package],
        check=True,
        env=env,
    )
    found = shutil.which(command)
    if found is None:
        raise SystemExit(f"apt-get installed {package} but {command} is not on PATH")
    return found
