from django.conf import settings
from django.http import JsonResponse


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
