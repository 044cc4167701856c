"""Debian packages that some tests need, installed with apt on first use where the tests run as root."""
from __future__ import annotations

import os
import shutil
import subprocess


def install(packages: list[str]) -> None:
    """`apt-get install` them, or say how to, where this process may not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"install Debian's {' '.join(packages)} (apt-get install {' '.join(packages)})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *packages],
                   check=True, env=env, stdout=subprocess.DEVNULL)
