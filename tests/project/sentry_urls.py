"""A URL whose view raises, for tests/project/test_integrations.py's Sentry check."""

from django.urls import path


def boom(request):
    raise RuntimeError("sentry probe: a view raised")


urlpatterns = [path("boom/", boom)]
