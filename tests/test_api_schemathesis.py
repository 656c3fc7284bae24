"""schemathesis against the OpenAPI schema, in-process through the WSGI app: for generated
requests (valid and invalid) to every operation, no 5xx, and every documented response
matches its schema. Bounded: a few examples per operation."""

from __future__ import annotations

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
)

from jobs.services import job_trigger
from tests.factories import token_for

EXAMPLES_PER_OPERATION = 12


# Built from the code at import (no request, no database): the same document /api/schema/
# serves. (schemathesis' lazy fixture loader does not work with pytest 9.)
schema = schemathesis.openapi.from_dict(SchemaGenerator().get_schema(request=None, public=True))
schema.app = get_wsgi_application()


@pytest.fixture
def token(user) -> str:
    return token_for(user)


@pytest.fixture
def job_and_run(make_job, user):
    """A job of the user's, and a run of it: generated ids would only ever meet 404."""
    job = make_job(schedule={"kind": "cron", "expression": "0 * * * *", "timezone": "UTC"})
    return job_trigger(job=job, actor=user, now=timezone.now())


@pytest.fixture
def calendar(user):
    """A calendar of the user's, for the same reason."""
    from jobs.calendar_services import calendar_create
    from jobs.calendars import calendar_spec_check

    return calendar_create(owner=user, name="c", spec=calendar_spec_check({}), now=timezone.now())


@pytest.fixture(autouse=True)
def keep_the_test_connection():
    """The WSGI handler closes the database connection after each request, which would close
    the test's transaction; Django's own test client disconnects the same receivers."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@pytest.mark.django_db
def test_no_server_errors_and_responses_match_the_schema(case, token, job_and_run, calendar):
    if "job_id" in (case.path_parameters or {}):
        case.path_parameters["job_id"] = str(job_and_run.job_id)
    if "run_id" in (case.path_parameters or {}):
        case.path_parameters["run_id"] = str(job_and_run.id)
    if "calendar_id" in (case.path_parameters or {}):
        case.path_parameters["calendar_id"] = str(calendar.id)
    case.call_and_validate(
        headers={"Authorization": f"Token {token}"},
        checks=[not_a_server_error, response_schema_conformance, content_type_conformance],
    )
