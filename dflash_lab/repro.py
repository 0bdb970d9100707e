"""Reproducible, offline runs: seeds, deterministic kernels, no network.

Notebooks call ``runtime.seed_everything`` in their first code cell so that the
small numbers nbval compares come out the same on every run on the same machine,
and print them through ``rounded`` so that a last-bit difference in float32 does
not show up as a diff:

    from dflash_lab.repro import rounded
    from dflash_lab.runtime import seed_everything
    seed_everything(0)
    print(rounded(stats.per_position_acceptance_rate))   # [0.8125, 0.5, ...]

Tests (and the notebook kernels that ``pytest --nbval`` starts) run with
``OFFLINE_ENV`` set and with ``block_network()`` active, so an accidental hub
download fails at once instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def rounded(x, digits: int = 4):
    """``x`` with every float rounded to ``digits`` decimals (tensors become lists).

    Works through dicts, lists, tuples, numpy arrays and torch tensors; ints,
    strings and bools pass through unchanged.
    """
    if isinstance(x, (int, str)) or x is None:  # bools are ints
        return x
    if isinstance(x, float):  # numpy float64 too: returned as a plain float, so it prints as one
        r = round(float(x), digits)
        return 0.0 if r == 0 else r  # no "-0.0"
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(rounded(v, digits) for v in x)
    if hasattr(x, "tolist"):  # torch tensors, numpy arrays and scalars
        return rounded(x.tolist(), digits)
    return x


# ---------------------------------------------------------------------------
# No network: environment variables and a loopback-only socket guard
# ---------------------------------------------------------------------------


def set_offline_env() -> None:
    """Turn the Hugging Face libraries offline (kept if the caller already chose)."""
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)


class NetworkBlockedError(RuntimeError):
    """A connection to a non-loopback address was attempted while the guard was on.

    A RuntimeError rather than an OSError so that retrying HTTP clients do not
    swallow it as a transient network failure.
    """


def is_loopback(family: int, address) -> bool:
    """True for unix sockets, 127.0.0.0/8, ::1 and 'localhost'."""
    if family == getattr(socket, "AF_UNIX", object()) or isinstance(address, (str, bytes)):
        return True
    host = address[0] if isinstance(address, tuple) and address else address
    if isinstance(host, bytes):
        host = host.decode()
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        ip = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        return False  # a host name other than localhost: never resolve it here
    if getattr(ip, "ipv4_mapped", None) is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def install_network_guard():
    """Make every non-loopback socket connection raise NetworkBlockedError.

    Patches ``socket.socket.connect``/``connect_ex`` (which ``create_connection``,
    urllib3, requests, httpx and asyncio all go through) and
    ``socket.create_connection``. Only Python-level sockets of THIS process are
    guarded: a subprocess (e.g. a Jupyter kernel) needs the guard installed in
    itself, and C-level sockets (zmq, gloo) are not affected. Returns a function
    that removes the guard.
    """
    cls = socket.socket
    real_connect, real_connect_ex, real_create = cls.connect, cls.connect_ex, socket.create_connection

    def refuse(address):
        return NetworkBlockedError(
            f"network access is blocked (offline run): refused a connection to {address!r}; "
            "only loopback addresses are allowed"
        )

    def connect(self, address):
        if not is_loopback(self.family, address):
            raise refuse(address)
        return real_connect(self, address)

    def connect_ex(self, address):
        if not is_loopback(self.family, address):
            raise refuse(address)
        return real_connect_ex(self, address)

    def create_connection(address, *args, **kwargs):
        if not is_loopback(socket.AF_INET, address):
            raise refuse(address)
        return real_create(address, *args, **kwargs)

    cls.connect, cls.connect_ex, socket.create_connection = connect, connect_ex, create_connection

    def remove():
        cls.connect, cls.connect_ex, socket.create_connection = real_connect, real_connect_ex, real_create

    return remove


@contextlib.contextmanager
def block_network():
    """Within the block, any socket connection except loopback raises NetworkBlockedError."""
    remove = install_network_guard()
    try:
        yield
    finally:
        remove()


KERNEL_STARTUP = """\
# Written by dflash_lab.repro.write_ipython_startup: offline, loopback-only kernel.
from dflash_lab.repro import install_network_guard as _install_network_guard, set_offline_env as _set_offline_env
_set_offline_env()
_install_network_guard()
del _install_network_guard, _set_offline_env
"""


def write_ipython_startup(ipython_dir) -> None:
    """Make IPython (and so every Jupyter kernel) started with IPYTHONDIR=ipython_dir run offline.

    Environment variables reach a kernel by inheritance; socket patches do not,
    so the kernel installs the guard itself from its profile's startup file.
    """
    from pathlib import Path

    startup = Path(ipython_dir) / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-dflash-lab-offline.py").write_text(KERNEL_STARTUP)
