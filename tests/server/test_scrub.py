"""The online scrub of a serving store: the SCRUB command, the last scrub in INFO, and
`copse check --online`, on a healthy store and on one whose slab file was damaged under it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import redis

from support import COPSE_BIN

PASSWORD = "scrub pass"


def scrub(client: redis.Redis) -> dict:
    """SCRUB's reply as a dict (a map in RESP3, a flat array of names and values in RESP2)."""
    reply = client.execute_command("SCRUB")
    if isinstance(reply, list):
        reply = dict(zip(reply[::2], reply[1::2]))
    text = lambda v: v.decode() if isinstance(v, bytes) else v
    return {text(k): ([text(p) for p in v] if isinstance(v, list) else v) for k, v in reply.items()}


def check_online(server, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(COPSE_BIN), "check", "--online", "--addr", f"127.0.0.1:{server.port}", *extra],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_healthy_store_scrubs_clean_and_info_shows_the_last_scrub(make_server, protocol):
    server = make_server(shards=2)
    client = server.client(protocol)
    assert client.info("copse")["last_scrub_status"] == "never"
    assert client.info("copse")["scrub_in_progress"] == 0
    for i in range(300):
        # Small values and multi-page ones.
        client.set(f"key{i}", os.urandom(20_000 if i % 10 == 0 else 50))
    report = scrub(client)
    assert report["problems_found"] == 0, report
    assert report["problems"] == []
    assert report["items_checked"] >= 300, report
    assert report["pages_checked"] > 0, report
    info = client.info("copse")
    assert info["last_scrub_status"] == "ok"
    assert info["last_scrub_items_checked"] == report["items_checked"]
    assert info["last_scrub_problems"] == 0
    assert info["last_scrub_finished_unix"] > 1_700_000_000
    assert info["scrub_in_progress"] == 0


def test_check_online_of_a_healthy_store_with_a_password_exits_0(make_server):
    server = make_server("--requirepass", PASSWORD)
    client = server.client(2, password=PASSWORD)
    client.mset({f"k{i}": i for i in range(100)})
    refused = check_online(server)
    assert refused.returncode == 3, refused
    assert refused.stderr.startswith("copse: SCRUB on"), refused.stderr
    done = check_online(server, "--password", PASSWORD)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["addr"] == f"127.0.0.1:{server.port}"
    assert report["problems_found"] == 0 and report["problems"] == []
    assert report["items_checked"] >= 100


def find_in_slabs(data_dir, needle: bytes) -> tuple[str, int]:
    """The slab file and offset holding `needle` (exactly once in the store)."""
    found = []
    for root, _, files in os.walk(data_dir):
        for name in files:
            if name.endswith(".slab"):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    image = f.read()
                at = image.find(needle)
                while at >= 0:
                    found.append((path, at))
                    at = image.find(needle, at + 1)
    assert len(found) == 1, found
    return found[0]


def test_a_damaged_item_is_found_online_with_its_place_and_never_returned(make_server):
    server = make_server(shards=1)
    client = server.client(2)
    for i in range(50):
        client.set(f"fine{i}", f"value{i}")
    victim = os.urandom(20_000)  # multi-page: every GET reads it from the device
    client.set("victim", victim)
    path, at = find_in_slabs(server.data_dir, victim[:64])
    with open(path, "r+b") as f:
        f.seek(at + 10_000)
        byte = f.read(1)
        f.seek(at + 10_000)
        f.write(bytes([byte[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())

    with pytest.raises(redis.ResponseError, match="corrupt"):
        client.get("victim")
    result = check_online(server)
    assert result.returncode == 2, result
    assert result.stderr.startswith("copse: check found"), result.stderr
    report = json.loads(result.stdout)
    # The page pass reads multi-page slots only through their items: the item, and its slot.
    assert report["problems_found"] >= 1, report
    assert any("checksum mismatch" in p and "class" in p and "slot" in p for p in report["problems"]), report
    info = client.info("copse")
    assert info["last_scrub_status"] == "problems"
    assert info["last_scrub_problems"] == report["problems_found"]
    # Everything else still reads, and the server keeps serving writes.
    assert client.get("fine7") == b"value7"
    client.set("after", "scrub")
    assert client.get("after") == b"scrub"


def test_check_online_without_a_server_or_with_a_bad_address_exits_3():
    unreachable = subprocess.run(
        [str(COPSE_BIN), "check", "--online", "--addr", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert unreachable.returncode == 3, unreachable
    assert unreachable.stderr.startswith("copse: connecting to 127.0.0.1:1"), unreachable.stderr
    malformed = subprocess.run(
        [str(COPSE_BIN), "check", "--online", "--addr", "nowhere"],
        capture_output=True, text=True, timeout=60,
    )
    assert malformed.returncode == 3
    assert "expected host:port" in malformed.stderr
    # --addr means nothing without --online.
    usage = subprocess.run(
        [str(COPSE_BIN), "check", "--addr", "127.0.0.1:6380"],
        capture_output=True, text=True, timeout=60,
    )
    assert usage.returncode == 3
