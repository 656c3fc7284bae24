from django.urls import path

from .api import RunLogsApi

urlpatterns = [
    path("runs/<uuid:run_id>/logs/", RunLogsApi.as_view(), name="run-logs"),
]
