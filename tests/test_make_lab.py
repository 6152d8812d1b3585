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
            m = re.search(
                rf"(http://127\.0\.0\.1:{port}/lab/tree/notebooks/01_quickstart\.ipynb"
                r"\?token=\w+)",
                line,
            )
            if m:
                url = m.group(1)
        # the printed URL opens the quickstart itself (not the Launcher)
        assert url, "no quickstart URL printed:\n" + "".join(lines[-20:])
        page = url
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
        # the server root is the repository: the README is in the file browser
        readme = page.replace(
            "/lab/tree/notebooks/01_quickstart.ipynb?", "/api/contents/README.md?"
        )
        with opener.open(readme, timeout=30) as r:
            assert r.status == 200 and b"nbdebug" in r.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _load_config() -> dict:
    import runpy
    from types import SimpleNamespace

    class _Section(SimpleNamespace):
        pass

    class _Config(dict):
        def __getattr__(self, name):
            return self.setdefault(name, _Section())

    cfg = _Config()
    ns = runpy.run_path(
        str(ROOT / "jupyter_server_config.py"), init_globals={"get_config": lambda: cfg}
    )
    return {"cfg": cfg, "hook": ns["strip_lesson_outputs"]}


def test_lessons_are_saved_without_outputs_and_other_notebooks_as_they_are() -> None:
    loaded = _load_config()
    hook, cfg = loaded["hook"], loaded["cfg"]
    assert cfg["ContentsManager"].pre_save_hook is hook
    assert cfg["LabApp"].default_url == "/lab/tree/notebooks/01_quickstart.ipynb"
    assert Path(cfg["ServerApp"].root_dir) == ROOT

    def model() -> dict:
        cell = {"cell_type": "code", "source": "1", "outputs": [{"output_type": "stream"}]}
        cell["execution_count"] = 3
        return {"type": "notebook", "content": {"cells": [cell, {"cell_type": "markdown"}]}}

    manager = type("CM", (), {"root_dir": str(ROOT)})()
    lesson = model()
    hook(lesson, "notebooks/01_quickstart.ipynb", manager)
    code = lesson["content"]["cells"][0]
    assert code["outputs"] == [] and code["execution_count"] is None
    mine = model()
    hook(mine, "scratch/mine.ipynb", manager)
    assert mine == model(), "a notebook outside notebooks/ is saved with its outputs"
