from django.urls import path

from . import bulk, jobs, preview, runs

urlpatterns = [
    path("jobs/", jobs.JobListApi.as_view(), name="job-list"),
    path("jobs/bulk/", bulk.JobBulkApi.as_view(), name="job-bulk"),
    path("jobs/<uuid:job_id>/", jobs.JobDetailApi.as_view(), name="job-detail"),
    path("jobs/<uuid:job_id>/runs/", runs.JobRunListApi.as_view(), name="job-runs"),
    path("jobs/<uuid:job_id>/history/", jobs.JobHistoryApi.as_view(), name="job-history"),
    path("jobs/<uuid:job_id>/graph/", jobs.JobGraphApi.as_view(), name="job-graph"),
    path("jobs/<uuid:job_id>/pause/", jobs.JobPauseApi.as_view(), name="job-pause"),
    path("jobs/<uuid:job_id>/resume/", jobs.JobResumeApi.as_view(), name="job-resume"),
    path("jobs/<uuid:job_id>/trigger/", jobs.JobTriggerApi.as_view(), name="job-trigger"),
    path("jobs/<uuid:job_id>/backfill/", jobs.JobBackfillApi.as_view(), name="job-backfill"),
    path("schedules/preview/", preview.SchedulePreviewApi.as_view(), name="schedule-preview"),
    path("runs/", runs.RunListApi.as_view(), name="run-list"),
    path("jobs/<uuid:job_id>/cancel/", jobs.JobCancelApi.as_view(), name="job-cancel"),
    path("runs/<uuid:run_id>/", runs.RunDetailApi.as_view(), name="run-detail"),
    path("runs/<uuid:run_id>/cancel/", runs.RunCancelApi.as_view(), name="run-cancel"),
    path("runs/<uuid:run_id>/replay/", runs.RunReplayApi.as_view(), name="run-replay"),
]
