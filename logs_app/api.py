"""`GET /api/v1/runs/{run_id}/logs/`: one attempt's log lines, paginated by line number, with
a long-poll live tail (`follow=true`) and a plain-text download (`format=text`).

Long-polling rather than server-sent events: the web tier is plain WSGI, where a request
that waits holds one worker thread for at most `MAX_WAIT_SECONDS`, and a client's loop
over `next` is all a live tail needs.
"""

from __future__ import annotations

import contextlib
import json

from django.http import Http404, StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import Throttled
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.utils.urls import replace_query_param
from rest_framework.views import APIView

from jobs.selectors import run_get
from jobs.throttling import LogFollowThrottle

from .selectors import LogPage, log_attempts, log_page, log_text
from .tails import tail_slot

PAGE_SIZE = 1000
MAX_PAGE_SIZE = 5000
MAX_WAIT_SECONDS = 25  # a waiting request holds a WSGI worker thread: keep it short
MAX_LINE_NUMBER = 2**31 - 1  # line numbers are PostgreSQL integers
FOLLOW_RETRY_SECONDS = 5  # a tail over the bounds of logs_app.tails is told to retry after


class PlainTextRenderer(BaseRenderer):
    """`?format=text` or `Accept: text/plain`. The logs themselves are streamed by the view;
    this renders only error answers (404, 400) as text."""

    media_type = "text/plain"
    format = "text"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, dict) and set(data) == {"detail"}:
            data = data["detail"]
        return (data if isinstance(data, str) else json.dumps(data)).encode()


class LogQuery(serializers.Serializer):
    attempt = serializers.IntegerField(
        min_value=1,
        max_value=MAX_LINE_NUMBER,
        required=False,
        help_text="The attempt's number; default the latest attempt.",
    )
    after = serializers.IntegerField(
        min_value=-1,
        max_value=MAX_LINE_NUMBER,
        default=-1,
        help_text="The cursor: lines numbered after this one (default -1: from the first). "
        "`next` carries it.",
    )
    page_size = serializers.IntegerField(min_value=1, max_value=MAX_PAGE_SIZE, default=PAGE_SIZE)
    follow = serializers.BooleanField(
        default=False,
        help_text="Live tail: when there are no lines after the cursor and the attempt is "
        "running, wait until some arrive or the attempt ends (long poll).",
    )
    wait = serializers.IntegerField(
        min_value=0,
        max_value=MAX_WAIT_SECONDS,
        default=MAX_WAIT_SECONDS,
        help_text="With follow: the longest wait, in seconds.",
    )


class LogLineOutput(serializers.Serializer):
    n = serializers.IntegerField(help_text="The line's number in the attempt, from 0.")
    ts = serializers.CharField(help_text="When the worker captured it (ISO 8601, UTC).")
    stream = serializers.CharField(help_text="logger, logging, stdout, stderr or system.")
    level = serializers.CharField()
    text = serializers.CharField(allow_blank=True)


class AttemptLogOutput(serializers.Serializer):
    number = serializers.IntegerField()
    state = serializers.CharField()
    complete = serializers.BooleanField()
    line_count = serializers.IntegerField(help_text="Lines stored so far.")


class LogPageOutput(serializers.Serializer):
    run = serializers.UUIDField()
    attempt = serializers.IntegerField()
    fencing_token = serializers.IntegerField()
    attempt_state = serializers.CharField()
    complete = serializers.BooleanField(
        help_text="The attempt ended through its own worker and its manifest is stored: "
        "every line it produced is here (a lost or killed attempt's logs stay incomplete)."
    )
    lines = LogLineOutput(many=True)
    next = serializers.URLField(
        allow_null=True,
        help_text="The next page, or the position to poll while the attempt runs; null once "
        "the attempt has ended and every line was returned.",
    )
    ended = serializers.BooleanField(
        help_text="The attempt has ended and this page holds its last line."
    )
    attempts = AttemptLogOutput(many=True)


class RunLogsApi(APIView):
    renderer_classes = [JSONRenderer, PlainTextRenderer]
    # A long poll holds a web worker thread: its own, tighter rate besides the user's.
    throttle_classes = [*api_settings.DEFAULT_THROTTLE_CLASSES, LogFollowThrottle]

    @extend_schema(
        parameters=[LogQuery],
        responses={
            (200, "application/json"): LogPageOutput,
            (200, "text/plain"): OpenApiTypes.STR,
            (404, "application/json"): OpenApiTypes.OBJECT,
            (404, "text/plain"): OpenApiTypes.STR,
            (400, "application/json"): OpenApiTypes.OBJECT,
            (400, "text/plain"): OpenApiTypes.STR,
            (429, "application/json"): OpenApiTypes.OBJECT,
        },
        examples=[
            OpenApiExample(
                "A running attempt",
                response_only=True,
                status_codes=["200"],
                value={
                    "run": "6f1c8a4e-2d0b-4c1e-9a57-0b3c2f6e9d10",
                    "attempt": 1,
                    "fencing_token": 1,
                    "attempt_state": "running",
                    "complete": False,
                    "lines": [
                        {
                            "n": 0,
                            "ts": "2030-01-01T12:00:00.120000+00:00",
                            "stream": "logger",
                            "level": "INFO",
                            "text": "charging 42",
                        }
                    ],
                    "next": "https://scheduler.example/api/v1/runs/6f1c8a4e-2d0b-4c1e-9a57-"
                    "0b3c2f6e9d10/logs/?attempt=1&after=0",
                    "ended": False,
                    "attempts": [
                        {"number": 1, "state": "running", "complete": False, "line_count": 1}
                    ],
                },
            )
        ],
    )
    def get(self, request, run_id):
        query = LogQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        wait = params["wait"] if params["follow"] else 0
        # A tail that may not wait is refused before anything is read: the refusal must
        # cost the web worker next to nothing (logs_app.tails).
        with tail_slot(user_id=request.user.pk) if wait else contextlib.nullcontext(True) as may:
            if not may:
                raise Throttled(
                    wait=FOLLOW_RETRY_SECONDS,
                    detail="Too many live tails are waiting (this host's or yours): retry in "
                    f"{FOLLOW_RETRY_SECONDS} s, or read without follow.",
                )
            return self._answer(request, run_id=run_id, params=params, wait=wait)

    def _answer(self, request, *, run_id, params: dict, wait: int):
        run = run_get(user=request.user, run_id=run_id)
        if run is None:
            raise Http404
        attempts = log_attempts(run=run)
        number = params.get("attempt", attempts[-1].number if attempts else None)
        attempt = next((a for a in attempts if a.number == number), None)
        if attempt is None:
            raise Http404
        if request.accepted_renderer.format == PlainTextRenderer.format:
            response = StreamingHttpResponse(
                log_text(attempt=attempt), content_type="text/plain; charset=utf-8"
            )
            response["Content-Disposition"] = (
                f'inline; filename="run-{run.id}-attempt-{attempt.number}.log"'
            )
            return response
        page = log_page(
            attempt_id=attempt.id,
            after=params["after"],
            page_size=params["page_size"],
            wait_seconds=wait,
        )
        attempt = page.attempt
        if params["follow"]:
            attempts = log_attempts(run=run)  # as of this page: it may have waited
        return Response(
            LogPageOutput(
                {
                    "run": run.id,
                    "attempt": attempt.number,
                    "fencing_token": attempt.fencing_token,
                    "attempt_state": attempt.state,
                    "complete": attempt.complete,
                    "lines": page.lines,
                    "next": None if page.ended else _next_url(request, page, params["after"]),
                    "ended": page.ended,
                    "attempts": attempts,
                }
            ).data
        )


def _next_url(request, page: LogPage, after: int) -> str:
    url = request.build_absolute_uri()
    url = replace_query_param(url, "attempt", page.attempt.number)
    return replace_query_param(url, "after", page.lines[-1]["n"] if page.lines else after)
