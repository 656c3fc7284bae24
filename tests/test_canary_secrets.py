"""Canary secrets at several depths in a job's args and kwargs, and in the result its
handler returns, never appear in any admin page, in the run's logs or in its stored result
(docs/security.md), while the API still returns the owner's own args as given; nor does an
API key, in the admin or in a dump of the token table."""

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from dispatch.worker import run_execute_delivery
from jobs.models import ApiToken, Attempt, Run
from jobs.registry import _handlers
from jobs.tokens import token_create
from tests.factories import api_client, stored_lines

ARGS = [{"password": "canary-a1"}, ["x", {"deep": {"api_key": ["canary-a2"]}}]]
KWARGS = {
    "token": {"nested": "canary-k1"},
    "config": {"db": "postgres://app:canary-k2@db/x", "creds": [{"secret": "canary-k3"}]},
    "note": "login with password canary-k4",
    "Authorization": "Bearer canary-k5",
}


def _admin_pages(client) -> dict[str, str]:
    """Every registered model's list page and the change page of each of its objects, and
    each attempt's log page: url -> content."""
    pages = {}
    for model, model_admin in admin.site._registry.items():
        opts = model._meta
        urls = [reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")]
        for pk in model_admin.get_queryset(None).values_list("pk", flat=True)[:20]:
            urls.append(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk]))
        for url in urls:
            response = client.get(url)
            assert response.status_code == 200, url
            pages[url] = response.content.decode()
    for attempt in Attempt.objects.all():
        url = reverse("admin:logs_app_attempt_log", args=[attempt.id])
        pages[url] = client.get(url).content.decode()
    return pages


@pytest.mark.django_db(transaction=True)
def test_canaries_never_surface_in_the_admin_logs_or_stored_result(client, user, queued_run):
    run = queued_run(task="scheduler.echo", args=ARGS, kwargs=KWARGS)
    run_execute_delivery(
        run_id=str(run.id), handler=_handlers["scheduler.echo"], worker="w", message_id="m"
    )
    run.refresh_from_db()
    assert run.state == "succeeded"

    assert "canary" not in repr(run.result)
    assert run.result["kwargs"]["config"]["db"] == "postgres://app:[REDACTED]@db/x"
    logs = "\n".join(line["text"] for line in stored_lines(run))
    assert "echo run" in logs and "canary" not in logs

    _, key = token_create(owner=user, now=timezone.now(), name="ci")
    superuser = get_user_model().objects.create_superuser("root", "r@example.com", "pw")
    client.force_login(superuser)
    pages = _admin_pages(client)
    assert "/admin/jobs/apitoken/" in pages
    assert not [url for url, page in pages.items() if key in page]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {ApiToken._meta.db_table}")
        assert key not in repr(cursor.fetchall())
    assert f"/admin/jobs/job/{run.job_id}/change/" in pages
    assert f"/admin/jobs/run/{run.id}/change/" in pages
    assert any("[REDACTED]" in page for page in pages.values())
    leaked = [url for url, page in pages.items() if "canary" in page]
    assert leaked == []

    # The owner's own data, through the API, as given.
    body = api_client(user).get(f"/api/v1/jobs/{run.job_id}/").json()
    assert body["args"] == ARGS
    assert body["kwargs"]["token"] == {"nested": "canary-k1"}
    assert Run.objects.filter(id=run.id).exists()
