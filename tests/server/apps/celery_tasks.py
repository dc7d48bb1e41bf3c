"""The Celery application of test_apps.py: broker and result backend on the copse server whose
port is in COPSE_PORT."""

import os

from celery import Celery

PORT = os.environ["COPSE_PORT"]
app = Celery("celery_tasks", broker=f"redis://127.0.0.1:{PORT}/0", backend=f"redis://127.0.0.1:{PORT}/1")
app.conf.broker_connection_retry_on_startup = True
app.conf.task_default_retry_delay = 0


@app.task
def add(x, y):
    return x + y


@app.task(bind=True, max_retries=3)
def flaky(self, marker_key):
    """Fails the first time it runs for `marker_key` (noted in copse), then succeeds."""
    client = app.backend.client
    if client.incr(marker_key) == 1:
        raise self.retry(countdown=0)
    return "ok after retry"
