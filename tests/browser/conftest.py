"""JupyterLab in headless Chromium: the fixtures behind test_notebooks_in_browser.py.

One JupyterLab server runs for the whole session, on 127.0.0.1 with a random
free port and a random token, in a temporary root that holds a copy of the
notebooks (and links to the checkpoints they load). Its settings turn off the
news pop-up and the update check, start the notebook's own kernel without the
"Select Kernel" dialog, and attach every cell to the DOM (windowing off), so
that what the test reads is what a person would scroll to. The server is
stopped - SIGTERM, then SIGKILL - whether the tests pass or fail.

Chromium is Debian's (`make browser` installs it); Playwright drives it and
never downloads a browser. The page may reach nothing but the lab server.

Environment knobs:
    DFLASH_LAB_CHROMIUM           the Chromium executable (default /usr/bin/chromium)
    DFLASH_LAB_BROWSER_NOTEBOOKS  a folder of notebooks to test instead of notebooks/
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash_lab.repro import set_offline_env, write_ipython_startup

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("DFLASH_LAB_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",  # the CI container runs as root
    "--headless",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = REPO / "test-output" / "screenshots"
# Top-level folders a notebook may reach through a relative path (../checkpoints/...).
LINKED_DIRS = ("checkpoints", "benchmarks", "dflash_lab")

# JupyterLab user settings for the test root: no news, no update check, no
# kernel dialog, every cell attached to the DOM.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
}


def notebooks_dir() -> Path:
    return Path(os.environ.get("DFLASH_LAB_BROWSER_NOTEBOOKS", REPO / "notebooks")).resolve()


def pytest_generate_tests(metafunc):
    if "notebook" in metafunc.fixturenames:
        paths = sorted(notebooks_dir().glob("*.ipynb"))
        metafunc.parametrize("notebook", paths, ids=[p.stem for p in paths])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LabServer:
    url: str  # http://127.0.0.1:PORT
    token: str
    root: Path  # the server's root_dir; notebooks live in root / "notebooks"
    log: Path  # server (and kernel) stdout+stderr

    def api(self, method: str, path: str) -> object:
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Free the memory a notebook's models took before the next notebook starts."""
        for session in self.api("GET", "/api/sessions") or []:
            self.api("DELETE", f"/api/sessions/{session['id']}")


def _make_root(root: Path, source: Path) -> None:
    shutil.copytree(
        source, root / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "src")
    )
    for name in LINKED_DIRS:
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)
    settings = root / ".lab" / "settings"
    for plugin, values in LAB_SETTINGS.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    # kernels run offline, with the loopback-only socket guard (as under nbval)
    write_ipython_startup(root / ".jupyter" / "ipython")


def _start_lab(root: Path, log_path: Path) -> tuple[subprocess.Popen, str, str]:
    token = secrets.token_hex(16)
    port = free_port()
    set_offline_env()
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(root / ".jupyter" / "config"),
        JUPYTER_RUNTIME_DIR=str(root / ".jupyter" / "runtime"),
        IPYTHONDIR=str(root / ".jupyter" / "ipython"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONHASHSEED="0",
        # the kernel is this interpreter: put its bin/ first so "python" is this venv's
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    cmd = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        "--ServerApp.allow_root=True",  # CI containers run as root
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        f"--LabApp.user_settings_dir={root / '.lab' / 'settings'}",
        f"--LabApp.workspaces_dir={root / '.lab' / 'workspaces'}",
    ]  # fmt: skip
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()
    return proc, f"http://127.0.0.1:{port}", token


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (server and kernels), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    pgid = os.getpgid(proc.pid)
    os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=10)
    try:  # kernels it started are in the same group; make sure none outlive it
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_until_up(proc: subprocess.Popen, url: str, token: str, log: Path, timeout: float = 180) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            req = urllib.request.Request(f"{url}/api/status", headers={"Authorization": f"token {token}"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"JupyterLab did not answer within {timeout:.0f}s; its log:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} not found: the browser tests need Debian's chromium. "
            "Install it with `make browser` (apt-get install chromium), or point "
            "DFLASH_LAB_CHROMIUM at a Chromium executable.",
            pytrace=False,
        )
    return CHROMIUM


@pytest.fixture(scope="session")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory) -> LabServer:
    source = notebooks_dir()
    root = tmp_path_factory.mktemp("lab-root")
    _make_root(root, source)
    log = root.parent / f"{root.name}-jupyterlab.log"
    proc = None
    try:
        for _attempt in range(3):  # the random port can be taken between probe and bind
            proc, url, token = _start_lab(root, log)
            if _wait_until_up(proc, url, token, log):
                break
            _stop(proc)
        else:
            raise RuntimeError(f"JupyterLab did not start; its log:\n{log.read_text()[-4000:]}")
        yield LabServer(url=url, token=token, root=root, log=log)
    finally:
        if proc is not None:
            _stop(proc)


@pytest.fixture(scope="session")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def lab_page(browser, lab_server):
    """A fresh browser context that can reach the lab server and nothing else."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.route(
        "**/*",
        lambda route: route.continue_()
        if route.request.url.startswith(lab_server.url)
        else route.abort(),
    )
    page = context.new_page()
    try:
        yield page
    finally:
        context.close()
        try:
            lab_server.shutdown_kernels()
        except OSError:
            pass
