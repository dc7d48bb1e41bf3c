"""redis-cli, the reference client, against copse (skipped where redis-cli is not installed)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

REDIS_CLI = shutil.which("redis-cli") or ("/usr/bin/redis-cli" if os.path.exists("/usr/bin/redis-cli") else None)

pytestmark = pytest.mark.skipif(REDIS_CLI is None, reason="redis-cli is not installed")


def cli(server, *args: str, input_text: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(server.port), *args],
        capture_output=True, text=True, timeout=30, input=input_text,
    )
    assert result.returncode == 0, f"redis-cli {' '.join(args)}: exit {result.returncode}\n{result.stdout}{result.stderr}"
    return result


def test_set_and_get(server, r):
    assert cli(server, "set", "a", "b").stdout == "OK\n"
    assert cli(server, "get", "a").stdout == "b\n"
    assert cli(server, "get", "missing").stdout == "\n"
    assert cli(server, "incr", "n").stdout == "1\n"
    assert cli(server, "ping").stdout == "PONG\n"


def test_scan(server, r):
    keys = {f"cli:{i}" for i in range(300)}
    r.mset({key: "v" for key in keys})
    listed = cli(server, "--scan").stdout.split()
    assert set(listed) == keys
    listed = cli(server, "--scan", "--pattern", "cli:1*").stdout.split()
    assert set(listed) == {key for key in keys if key.startswith("cli:1")}


def test_resp3_hello(server, r):
    out = cli(server, "-3", "hello", "3").stdout
    assert "proto" in out and "3" in out and "redis" in out, out
    r.set("a", "b")
    assert cli(server, "-3", "get", "a").stdout == "b\n"
    assert cli(server, "-3", "get", "missing").stdout.strip() in ("", "(nil)")


def test_info_copse(server, r):
    out = cli(server, "info", "copse").stdout
    assert "# Copse" in out
    assert "shards:4" in out
    out = cli(server, "info").stdout
    for header in ("# Server", "# Clients", "# Memory", "# Persistence", "# Stats", "# Keyspace", "# Copse"):
        assert header in out, header


def test_commands_from_stdin(server, r):
    script = "SET piped 1\nINCR piped\nGET piped\n"
    out = cli(server, input_text=script).stdout
    assert out.split() == ["OK", "2", "2"]


def test_pipe_mode(server, r):
    payload = "".join(f"SET mass:{i} {i}\r\n" for i in range(1000))
    result = cli(server, "--pipe", input_text=payload)
    assert "errors: 0, replies: 1000" in result.stdout, result.stdout
    assert r.get("mass:999") == b"999"
    assert r.dbsize() == 1000
