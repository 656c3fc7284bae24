from django.urls import path

from . import api

urlpatterns = [
    path("jobs/", api.JobListApi.as_view(), name="job-list"),
    path("jobs/<uuid:job_id>/", api.JobDetailApi.as_view(), name="job-detail"),
    path("jobs/<uuid:job_id>/runs/", api.JobRunListApi.as_view(), name="job-runs"),
    path("runs/", api.RunListApi.as_view(), name="run-list"),
    path("jobs/<uuid:job_id>/cancel/", api.JobCancelApi.as_view(), name="job-cancel"),
    path("runs/<uuid:run_id>/", api.RunDetailApi.as_view(), name="run-detail"),
    path("runs/<uuid:run_id>/cancel/", api.RunCancelApi.as_view(), name="run-cancel"),
    path("runs/<uuid:run_id>/replay/", api.RunReplayApi.as_view(), name="run-replay"),
]
