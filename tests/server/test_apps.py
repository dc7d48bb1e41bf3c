"""Real applications against a real `copse serve` (issue 24's must-shows), unchanged: Celery 5
with the redis broker and result backend (a worker runs tasks, one with a retry, one with a
countdown, and the caller gets the results), and Django's cache framework through both the
built-in RedisCache and django-redis (set with timeout, expiry, incr, get_many/set_many,
delete_pattern). Installed by `make test-deps`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

APPS = Path(__file__).parent / "apps"


def test_celery_worker_runs_tasks_with_retry_and_countdown(make_server):
    pytest.importorskip("celery")
    server = make_server()
    env = dict(os.environ, COPSE_PORT=str(server.port), PYTHONPATH=str(APPS))
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_tasks", "worker", "--pool=solo",
         "--loglevel=WARNING", "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=APPS, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        os.environ["COPSE_PORT"] = str(server.port)
        sys.path.insert(0, str(APPS))
        import celery_tasks

        assert celery_tasks.add.delay(2, 3).get(timeout=60) == 5
        started = time.time()
        assert celery_tasks.add.apply_async((40, 2), countdown=2).get(timeout=60) == 42
        assert time.time() - started >= 1.5, "the countdown was not honoured"
        assert celery_tasks.flaky.delay("flaky:marker").get(timeout=60) == "ok after retry"
        results = [celery_tasks.add.delay(i, i) for i in range(20)]
        assert [result.get(timeout=60) for result in results] == [2 * i for i in range(20)]
    finally:
        worker.terminate()
        output = worker.communicate(timeout=60)[0].decode(errors="replace")
        sys.path.remove(str(APPS))
    # The worker met no error from the server (a refused command shows as a ResponseError).
    assert "ResponseError" not in output and "unknown command" not in output, output[-3000:]


def django_run(port: int) -> str:
    """Runs the cache checks in a fresh interpreter (Django is configured once per process)."""
    code = f'''
import time, django
from django.conf import settings
settings.configure(CACHES={{
    "default": {{"BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": "redis://127.0.0.1:{port}/0"}},
    "dr": {{"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1:{port}/1"}},
}})
django.setup()
from django.core.cache import caches
for name in ("default", "dr"):
    c = caches[name]
    c.clear()
    c.set("a", 1, timeout=100)
    c.set("b", {{"x": 2}}, timeout=None)
    assert c.get("a") == 1 and c.get("b") == {{"x": 2}}
    assert c.incr("a") == 2 and c.incr("a", 5) == 7
    assert c.get_many(["a", "b", "zz"]) == {{"a": 7, "b": {{"x": 2}}}}
    c.set_many({{"m1": 1, "m2": 2, "m3": 3}}, timeout=50)
    assert c.get_many(["m1", "m2", "m3"]) == {{"m1": 1, "m2": 2, "m3": 3}}
    c.set("short", 1, timeout=1)
    time.sleep(1.3)
    assert c.get("short") is None, "a 1 s timeout did not expire"
    assert c.add("a", 5) is False and c.add("new", 5) is True
    assert c.get_or_set("g", 7) == 7 and c.has_key("g")
    assert c.delete("a") and not c.has_key("a")
    if name == "dr":
        assert c.ttl("m1") > 0
        assert c.delete_pattern("m*") == 3
        assert c.get_many(["m1", "m2", "m3"]) == {{}}
print("django ok")
'''
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def test_django_cache_backends(server):
    pytest.importorskip("django")
    pytest.importorskip("django_redis")
    output = django_run(server.port)
    assert "django ok" in output, output[-3000:]
