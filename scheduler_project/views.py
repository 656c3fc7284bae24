"""The pages that tie the product together: the landing page at `/`, the API's root at
`/api/v1/`, the API docs page (a signed-out visitor is sent to sign in) and the JSON 404
of every path under /api/."""

from __future__ import annotations

import re
import uuid

from django.contrib.auth.views import redirect_to_login
from django.http import JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.views import defaults
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularSwaggerView
from rest_framework import exceptions, permissions, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

# name of the URL -> what it is, as /api/v1/ lists them.
API_ROOTS = {
    "job-list": "Jobs: list (GET) and create (POST)",
    "job-bulk": "Create up to 1,000 jobs in one request (POST)",
    "run-list": "Runs of every visible job (GET)",
    "schedule-preview": "The next fires of a schedule, before creating a job (POST)",
    "schema": "The OpenAPI schema",
    "api-docs": "The API's documentation page (Swagger UI)",
}


class RootOutput(serializers.Serializer):
    class Root(serializers.Serializer):
        name = serializers.CharField()
        url = serializers.URLField()
        description = serializers.CharField()

    detail = serializers.CharField()
    roots = Root(many=True)
    per_object = serializers.DictField(child=serializers.CharField())


class ApiRootApi(APIView):
    """What the API offers, with links; open to anyone (it names paths, no data)."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]
    throttle_classes: list = []

    @extend_schema(responses=RootOutput, auth=[])
    def get(self, request):
        roots = {name: request.build_absolute_uri(reverse(name)) for name in API_ROOTS}
        return Response(
            {
                "detail": "Durable job scheduler API v1. Authenticate with "
                "`Authorization: Token <key>` (docs/api.md, Access).",
                "roots": [
                    {"name": name, "url": roots[name], "description": text}
                    for name, text in API_ROOTS.items()
                ],
                "per_object": {
                    "job": "/api/v1/jobs/{job_id}/ (runs/, history/, pause/, resume/, "
                    "trigger/, backfill/, cancel/)",
                    "run": "/api/v1/runs/{run_id}/ (cancel/, replay/, logs/)",
                },
            }
        )


def landing(request):
    """`/`: links to the admin, the dashboard and the API docs; signed out, to sign in."""
    return render(request, "scheduler_project/landing.html", {"title": "Durable job scheduler"})


class ApiDocsView(SpectacularSwaggerView):
    """The Swagger UI page; a visitor who is not signed in (no session, no token) is sent
    to the admin's login page, and comes back here after it."""

    def handle_exception(self, exc):
        if isinstance(exc, exceptions.NotAuthenticated):
            return redirect_to_login(self.request.get_full_path(), reverse("admin:login"))
        return super().handle_exception(exc)


# /api/v1/jobs/<x>/... and /api/v1/runs/<x>/...: the path's id, named as the views name it.
_OBJECT_PATH = re.compile(r"^/api/v1/(?P<kind>jobs|runs)/(?P<id>[^/]+)(/|$)")
_NOT_IDS = {"jobs": {"bulk"}, "runs": set()}


def _not_a_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return True
    return False


def not_found(request, exception=None):
    """handler404: under /api/, a JSON 404 (naming the path's id when it is not a UUID);
    elsewhere Django's page."""
    path = request.path
    if not path.startswith("/api/"):
        return defaults.page_not_found(request, exception)
    found = _OBJECT_PATH.match(path)
    if found and found["id"] not in _NOT_IDS[found["kind"]] and _not_a_uuid(found["id"]):
        field = "job_id" if found["kind"] == "jobs" else "run_id"
        return JsonResponse(
            {
                "detail": f"No {found['kind'][:-1]} has the id {found['id'][:64]!r}.",
                field: ["Must be a UUID, e.g. 3f2b8c1e-8d4a-4c7e-9b1a-0e5f6a7b8c9d."],
            },
            status=404,
        )
    return JsonResponse(
        {"detail": f"No API endpoint at {path[:200]}; GET /api/v1/ lists them."}, status=404
    )
