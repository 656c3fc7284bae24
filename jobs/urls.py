from django.urls import path

from . import api

urlpatterns = [
    path("jobs/", api.JobListApi.as_view(), name="job-list"),
    path("jobs/bulk/", api.JobBulkApi.as_view(), name="job-bulk"),
    path("jobs/<uuid:job_id>/", api.JobDetailApi.as_view(), name="job-detail"),
    path("jobs/<uuid:job_id>/runs/", api.JobRunListApi.as_view(), name="job-runs"),
    path("jobs/<uuid:job_id>/history/", api.JobHistoryApi.as_view(), name="job-history"),
    path("jobs/<uuid:job_id>/pause/", api.JobPauseApi.as_view(), name="job-pause"),
    path("jobs/<uuid:job_id>/resume/", api.JobResumeApi.as_view(), name="job-resume"),
    path("jobs/<uuid:job_id>/trigger/", api.JobTriggerApi.as_view(), name="job-trigger"),
    path("jobs/<uuid:job_id>/backfill/", api.JobBackfillApi.as_view(), name="job-backfill"),
    path("schedules/preview/", api.SchedulePreviewApi.as_view(), name="schedule-preview"),
    path("runs/", api.RunListApi.as_view(), name="run-list"),
    path("jobs/<uuid:job_id>/cancel/", api.JobCancelApi.as_view(), name="job-cancel"),
    path("runs/<uuid:run_id>/", api.RunDetailApi.as_view(), name="run-detail"),
    path("runs/<uuid:run_id>/cancel/", api.RunCancelApi.as_view(), name="run-cancel"),
    path("runs/<uuid:run_id>/replay/", api.RunReplayApi.as_view(), name="run-replay"),
]
