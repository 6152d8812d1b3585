"""The README's main command: `make lab` starts JupyterLab on the quickstart and prints the
URL, headless (here as root too)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_make_lab_prints_a_working_url() -> None:
    port = _free_port()
    proc = subprocess.Popen(
        ["make", "lab", f"PORT={port}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = None
    lines: list[str] = []
    try:
        deadline = time.time() + 120
        assert proc.stdout is not None
        while time.time() < deadline and url is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(rf"(http://127\.0\.0\.1:{port}/lab\?token=\w+)", line)
            if m:
                url = m.group(1)
        assert url, "no URL printed:\n" + "".join(lines[-20:])
        page = url.replace("/lab?", "/lab/tree/notebooks/01_quickstart.ipynb?")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
        body = ""
        for _ in range(60):  # the URL is logged a moment before the socket accepts
            try:
                with opener.open(page, timeout=30) as r:
                    assert r.status == 200
                    body = r.read().decode()
                    break
            except OSError:
                time.sleep(0.5)
        assert "JupyterLab" in body, "the quickstart page did not load"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
