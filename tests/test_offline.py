"""The suite runs offline: HF libraries are told so, and only loopback sockets connect."""

from __future__ import annotations

import os
import socket
import urllib.request

import pytest

from dflash_lab.repro import NetworkBlockedError, is_loopback, write_ipython_startup

BLOCKED = [("192.0.2.1", 443), ("8.8.8.8", 53), ("huggingface.co", 443)]  # TEST-NET, public, a name


def test_huggingface_libraries_are_offline():
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE


@pytest.mark.parametrize("address", BLOCKED, ids=lambda a: a[0])
def test_guard_refuses_a_non_loopback_connect(address):
    with socket.socket() as s, pytest.raises(NetworkBlockedError, match=r"refused a connection to \('" + address[0]):
        s.connect(address)
    with socket.socket() as s, pytest.raises(NetworkBlockedError, match=address[0]):
        s.connect_ex(address)
    with pytest.raises(NetworkBlockedError, match=address[0]):
        socket.create_connection(address, timeout=1)


def test_guard_refuses_ipv6_and_is_not_swallowed_by_http_clients():
    with socket.socket(socket.AF_INET6) as s, pytest.raises(NetworkBlockedError, match="2001:db8::1"):
        s.connect(("2001:db8::1", 443, 0, 0))
    with pytest.raises(NetworkBlockedError, match="192.0.2.1"):  # urllib turns OSErrors into URLError
        urllib.request.urlopen("http://192.0.2.1/", timeout=1)


def test_guard_allows_loopback_tcp_and_unix_sockets(tmp_path):
    for family, host in [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]:
        try:
            server = socket.socket(family)
            server.bind((host, 0))
        except OSError:
            continue  # no IPv6 on this machine
        with server:
            server.listen(1)
            with socket.create_connection(server.getsockname()[:2], timeout=5):
                pass
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "s"))
        server.listen(1)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(tmp_path / "s"))
    assert is_loopback(socket.AF_INET, ("127.8.9.1", 1)) and is_loopback(socket.AF_INET6, ("::ffff:127.0.0.1", 1, 0, 0))
    assert not is_loopback(socket.AF_INET, ("10.0.0.1", 1))


def test_notebook_kernels_start_offline_and_guarded(tmp_path):
    """What `pytest --nbval` relies on: env vars are inherited, the guard comes from the startup file."""
    from jupyter_client.manager import start_new_kernel

    write_ipython_startup(tmp_path)
    env = {**os.environ, "IPYTHONDIR": str(tmp_path)}
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    outputs = []
    try:
        kc.execute_interactive(
            "import os, socket\nprint(os.environ['HF_HUB_OFFLINE'])\nsocket.create_connection(('192.0.2.1', 80))",
            timeout=60, output_hook=lambda m: outputs.append(m["content"]),
        )
    finally:
        km.shutdown_kernel(now=True)
    assert any(o.get("text", "").strip() == "1" for o in outputs), outputs
    assert any(o.get("ename") == "NetworkBlockedError" for o in outputs), outputs
