import sys

from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.http import JsonResponse
from django.views import defaults


class BodySizeLimitMiddleware:
    """Answers 413 in JSON for a body over DATA_UPLOAD_MAX_MEMORY_SIZE, before anything
    reads it (Django's own answer is an HTML 400)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if limit is not None and length > limit:
            return JsonResponse(
                {"detail": f"Request body of {length} bytes; the limit is {limit}."}, status=413
            )
        return self.get_response(request)


# Seconds a client is told to wait before retrying while the database is unreachable.
DATABASE_RETRY_AFTER_SECONDS = 5


def database_unavailable(exc: BaseException) -> JsonResponse:
    response = JsonResponse(
        {"detail": f"The database is unavailable ({type(exc).__name__}); retry shortly."},
        status=503,
    )
    response["Retry-After"] = str(DATABASE_RETRY_AFTER_SECONDS)
    return response


class DatabaseUnavailableMiddleware:
    """A database that refuses connections, is down or dropped the connection answers 503
    in JSON with Retry-After, not a 500 page: the request may be retried as it is. (A
    statement the database refused for its content is an IntegrityError or a
    ProgrammingError, not one of these, and stays a 500.)"""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if isinstance(exception, OperationalError | InterfaceError):
            return database_unavailable(exception)
        return None


def server_error(request, *args, **kwargs):
    """handler500: the same 503 for a database error raised outside a view (in another
    middleware), Django's own 500 page for anything else."""
    exc = sys.exc_info()[1]
    if isinstance(exc, OperationalError | InterfaceError):
        return database_unavailable(exc)
    return defaults.server_error(request, *args, **kwargs)
