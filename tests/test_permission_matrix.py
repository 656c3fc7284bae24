"""The permission matrix (docs/security.md), generated from the URL conf: every route x
every method it serves x (anonymous, owner, other owner, staff without the operators group,
operator, superuser) x (own object, other's object), with the expected answer of each.

A route added to the URL conf without a row in ROUTES fails
`test_every_route_has_a_row`; so does a row whose route is gone.
"""

from __future__ import annotations

import dataclasses

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from jobs.models import BulkOperation
from tests import factories

ANONYMOUS, OWNER, OTHER_OWNER, STAFF, OPERATOR, SUPERUSER = (
    "anonymous", "owner", "other owner", "staff", "operator", "superuser",
)  # fmt: skip
PRINCIPALS = (ANONYMOUS, OWNER, OTHER_OWNER, STAFF, OPERATOR, SUPERUSER)
OWN, OTHERS = "own object", "other's object"
OK = "ok"  # passed authentication and visibility: anything but 401, 403 and 404


@dataclasses.dataclass(frozen=True)
class Row:
    methods: tuple[str, ...]
    # who may: "tenant" (the object's owner, operators, superusers; others get 404),
    # "authenticated" (anyone with credentials; lists show only what the user may see),
    # "operator" (operators and superusers; others 403), "probe" (anyone), "admin" (the
    # admin's door: staff and superusers), "redirect" (anyone: an old address), "dashboard"
    # (a signed-in session of staff, an operator or a superuser; anonymous: to the
    # login page; its lists of jobs and runs follow the API's visibility), "docs" (anyone
    # with credentials; anonymous: to the login page).
    access: str


ROUTES = {
    "": Row(("GET",), "probe"),  # the landing page: links, or a link to sign in
    "api/v1/": Row(("GET",), "probe"),  # the API's root: its paths, no data
    "admin/login/": Row(("GET",), "probe"),  # the admin's login page (jobs.throttling)
    "admin/": Row(("GET",), "admin"),
    "admin/dispatch/<path:rest>": Row(("GET",), "redirect"),
    "api/v1/jobs/": Row(("GET", "POST"), "authenticated"),
    "api/v1/jobs/bulk/": Row(("POST",), "authenticated"),
    "api/v1/jobs/bulk/pause/": Row(("POST",), "authenticated"),  # one's own jobs only
    "api/v1/jobs/bulk/resume/": Row(("POST",), "authenticated"),
    "api/v1/jobs/bulk/cancel/": Row(("POST",), "authenticated"),
    "api/v1/runs/bulk/cancel/": Row(("POST",), "authenticated"),  # one's own runs only
    "api/v1/runs/bulk/replay/": Row(("POST",), "authenticated"),
    "api/v1/operations/<uuid:operation_id>/": Row(("GET",), "tenant"),
    "api/v1/jobs/<uuid:job_id>/": Row(("GET", "PATCH", "DELETE"), "tenant"),
    "api/v1/jobs/<uuid:job_id>/runs/": Row(("GET",), "tenant"),
    "api/v1/jobs/<uuid:job_id>/history/": Row(("GET",), "tenant"),
    "api/v1/jobs/<uuid:job_id>/graph/": Row(("GET",), "tenant"),
    "api/v1/jobs/<uuid:job_id>/pause/": Row(("POST",), "tenant"),
    "api/v1/jobs/<uuid:job_id>/resume/": Row(("POST",), "tenant"),
    "api/v1/jobs/<uuid:job_id>/trigger/": Row(("POST",), "tenant"),
    "api/v1/jobs/<uuid:job_id>/backfill/": Row(("POST",), "tenant"),
    "api/v1/jobs/<uuid:job_id>/cancel/": Row(("POST",), "tenant"),
    "api/v1/jobs/<uuid:job_id>/occurrences/": Row(("GET",), "tenant"),
    "api/v1/schedules/preview/": Row(("POST",), "authenticated"),
    "api/v1/calendars/": Row(("GET", "POST"), "authenticated"),
    "api/v1/calendars/<uuid:calendar_id>/": Row(("GET", "PATCH", "DELETE"), "tenant"),
    "api/v1/calendars/<uuid:calendar_id>/import/": Row(("POST",), "tenant"),
    "api/v1/runs/": Row(("GET",), "authenticated"),
    "api/v1/runs/<uuid:run_id>/": Row(("GET",), "tenant"),
    "api/v1/runs/<uuid:run_id>/cancel/": Row(("POST",), "tenant"),
    "api/v1/runs/<uuid:run_id>/replay/": Row(("POST",), "tenant"),
    "api/v1/runs/<uuid:run_id>/logs/": Row(("GET",), "tenant"),
    "api/v1/webhooks/": Row(("GET", "POST"), "authenticated"),
    "api/v1/webhooks/<uuid:webhook_id>/": Row(("GET", "PATCH", "DELETE"), "tenant"),
    "api/v1/webhooks/<uuid:webhook_id>/test/": Row(("POST",), "tenant"),
    "api/v1/webhooks/<uuid:webhook_id>/deliveries/": Row(("GET",), "tenant"),
    "api/v1/queues/": Row(("GET",), "operator"),
    "api/v1/queues/<str:name>/": Row(("GET", "PATCH"), "operator"),
    "api/v1/queues/<str:name>/pause/": Row(("POST",), "operator"),
    "api/v1/queues/<str:name>/resume/": Row(("POST",), "operator"),
    "api/schema/": Row(("GET",), "authenticated"),
    "api/docs/": Row(("GET",), "docs"),
    "healthz": Row(("GET",), "probe"),
    "readyz": Row(("GET",), "probe"),
    "metrics": Row(("GET",), "operator"),
    "dashboard/": Row(("GET",), "dashboard"),
    "dashboard/panel/": Row(("GET",), "dashboard"),
}
# Routes of the URL conf not in the matrix, each with its reason.
NOT_IN_MATRIX = {
    # The admin's own pages: Django's model permissions decide them
    # (test_staff_without_permissions_is_refused_by_the_admin); "admin/" stands for its door.
    "admin/<admin pages>": "the admin's model permissions",
    # Served only when SCHEDULER_SERVE_STATIC (standalone): public files (CSS, Swagger UI).
    "^static/(?P<path>.*)$": "public static files",
}


def _routes(resolver=None, prefix: str = "") -> set[str]:
    routes = set()
    for entry in (resolver or get_resolver()).url_patterns:
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            if route == "admin/":
                routes |= {"admin/", "admin/<admin pages>"}
            else:
                routes |= _routes(entry, route)
        elif isinstance(entry, URLPattern):
            routes.add(route)
    return routes


def test_every_route_has_a_row():
    routes = _routes()
    assert routes - set(ROUTES) - set(NOT_IN_MATRIX) == set(), "routes without a row"
    assert set(ROUTES) - routes == set(), "rows of routes that are gone"


def expected(row: Row, principal: str, whose: str) -> str | int:
    if row.access in ("probe", "redirect"):
        return OK
    if row.access == "admin":
        return OK if principal in (STAFF, SUPERUSER) else 302
    if row.access == "docs":
        return 302 if principal == ANONYMOUS else OK
    if row.access == "dashboard":
        if principal == ANONYMOUS:
            return 302
        return OK if principal in (STAFF, OPERATOR, SUPERUSER) else 403
    if principal == ANONYMOUS:
        return 401
    if row.access == "authenticated":
        return OK
    cross_owner = principal in (OPERATOR, SUPERUSER)
    if row.access == "operator":
        return OK if cross_owner else 403
    return OK if whose == OWN or cross_owner else 404


CASES = [
    pytest.param(route, method, principal, whose, id=f"{method} {route} {principal} {whose}")
    for route, row in ROUTES.items()
    for method in row.methods
    for principal in PRINCIPALS
    for whose in (OWN, OTHERS)
]


def _user(principal: str):
    users = get_user_model()
    name = principal.replace(" ", "-")
    if principal == SUPERUSER:
        return users.objects.create_superuser(name, f"{name}@example.com", "pw")
    if principal == OPERATOR:
        return factories.operator(name)
    return users.objects.create_user(name, is_staff=principal == STAFF)


def _run_of(owner):
    """A run of `owner`'s one-time job, claimed (so it has an attempt and a log)."""
    run = factories.queued_run(owner)
    factories.claim(run)
    return run


def _calendar_of(owner):
    from jobs.calendars import calendar_spec_check
    from jobs.models import Calendar

    return Calendar.objects.create(owner=owner, name="c", spec=calendar_spec_check({}))


def _webhook_of(owner):
    from jobs.models import Webhook

    return Webhook.objects.create(owner=owner, url="https://hooks.example.com/",
                                  events=["run.failed"], secret="whsec_matrix")  # fmt: skip


@pytest.mark.django_db
@pytest.mark.parametrize(("route", "method", "principal", "whose"), CASES)
def test_permission_matrix(route, method, principal, whose):
    owner = _user(OWNER) if principal in (ANONYMOUS, OWNER) else None
    me = owner or _user(principal)
    other = _user(OTHER_OWNER if principal != OTHER_OWNER else OWNER)
    run = _run_of(me if whose == OWN else other)
    calendar = _calendar_of(me if whose == OWN else other)
    webhook = _webhook_of(me if whose == OWN else other)
    operation = BulkOperation.objects.create(owner=me if whose == OWN else other,
                                             action="runs.cancel")  # fmt: skip
    url = "/" + route.replace("<uuid:job_id>", str(run.job_id)).replace(
        "<uuid:run_id>", str(run.id)
    ).replace("<path:rest>", "outboxmessage/").replace(
        "<uuid:calendar_id>", str(calendar.id)
    ).replace("<uuid:webhook_id>", str(webhook.id)).replace(
        "<str:name>", settings.SCHEDULER_QUEUES[0]
    ).replace("<uuid:operation_id>", str(operation.id))
    client = APIClient()
    if principal != ANONYMOUS:
        client.credentials(HTTP_AUTHORIZATION=f"Token {factories.token_for(me)}")
        if ROUTES[route].access in ("admin", "dashboard"):
            client.force_login(me)
    response = getattr(client, method.lower())(url, {}, format="json")
    want = expected(ROUTES[route], principal, whose)
    if want == OK:
        assert response.status_code not in (401, 403, 404), (url, response.content[:300])
        assert response.status_code < 500
    else:
        assert response.status_code == want, (url, response.content[:300])


@pytest.mark.django_db
def test_lists_show_other_owners_objects_to_operators_only(client):
    owner, staff, operator = _user(OWNER), _user(STAFF), _user(OPERATOR)
    run = _run_of(owner)
    for user, sees in ((owner, True), (staff, False), (operator, True)):
        api = factories.api_client(user)
        for url, wanted in (("/api/v1/jobs/", str(run.job_id)), ("/api/v1/runs/", str(run.id))):
            ids = [item["id"] for item in api.get(url).json()["results"]]
            assert (wanted in ids) is sees, (user.username, url)


@pytest.mark.django_db
def test_staff_without_permissions_is_refused_by_the_admin(client):
    from django.contrib.auth.models import Permission

    staff = _user(STAFF)
    run = _run_of(_user(OWNER))
    client.force_login(staff)
    assert client.get("/admin/").status_code == 200
    assert client.get("/admin/jobs/job/").status_code == 403
    assert client.get(f"/admin/jobs/job/{run.job_id}/change/").status_code == 403
    staff.user_permissions.add(Permission.objects.get(codename="view_job"))
    assert client.get("/admin/jobs/job/").status_code == 200
    assert client.get(f"/admin/jobs/job/{run.job_id}/change/").status_code == 200
    assert client.get("/admin/jobs/apitoken/").status_code == 403
