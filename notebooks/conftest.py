"""`pytest --nbval notebooks/`: run the chapters offline.

nbval starts a Jupyter kernel as a separate process. That process inherits the
environment variables set here (so HF_HUB_OFFLINE=1 reaches it), but not this
process's socket patches. To guard the kernel too, IPYTHONDIR points it at a
throwaway profile whose startup file installs the loopback-only guard before
the first cell runs (the user's own IPython profile is left alone).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from dflash_lab.repro import install_network_guard, set_offline_env, write_ipython_startup

set_offline_env()
_cleanup = []


def pytest_configure(config):
    ipython_dir = tempfile.mkdtemp(prefix="dflash-lab-ipython-")
    write_ipython_startup(ipython_dir)
    previous = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = ipython_dir
    remove_guard = install_network_guard()  # this process talks to the kernel over loopback only

    def cleanup():
        remove_guard()
        if previous is None:
            os.environ.pop("IPYTHONDIR", None)
        else:
            os.environ["IPYTHONDIR"] = previous
        shutil.rmtree(ipython_dir, ignore_errors=True)

    _cleanup.append(cleanup)


def pytest_unconfigure(config):
    while _cleanup:
        _cleanup.pop()()
