from django.urls import path

from . import bulk, calendars, jobs, operations, preview, runs, webhooks

urlpatterns = [
    path("jobs/", jobs.JobListApi.as_view(), name="job-list"),
    path("jobs/bulk/", bulk.JobBulkApi.as_view(), name="job-bulk"),
    path("jobs/bulk/pause/", operations.JobBulkPauseApi.as_view(), name="job-bulk-pause"),
    path("jobs/bulk/resume/", operations.JobBulkResumeApi.as_view(), name="job-bulk-resume"),
    path("jobs/bulk/cancel/", operations.JobBulkCancelApi.as_view(), name="job-bulk-cancel"),
    path("runs/bulk/cancel/", operations.RunBulkCancelApi.as_view(), name="run-bulk-cancel"),
    path("runs/bulk/replay/", operations.RunBulkReplayApi.as_view(), name="run-bulk-replay"),
    path(
        "operations/<uuid:operation_id>/",
        operations.OperationDetailApi.as_view(),
        name="operation-detail",
    ),
    path("jobs/<uuid:job_id>/", jobs.JobDetailApi.as_view(), name="job-detail"),
    path("jobs/<uuid:job_id>/runs/", runs.JobRunListApi.as_view(), name="job-runs"),
    path("jobs/<uuid:job_id>/history/", jobs.JobHistoryApi.as_view(), name="job-history"),
    path("jobs/<uuid:job_id>/graph/", jobs.JobGraphApi.as_view(), name="job-graph"),
    path("jobs/<uuid:job_id>/pause/", jobs.JobPauseApi.as_view(), name="job-pause"),
    path("jobs/<uuid:job_id>/resume/", jobs.JobResumeApi.as_view(), name="job-resume"),
    path("jobs/<uuid:job_id>/trigger/", jobs.JobTriggerApi.as_view(), name="job-trigger"),
    path("jobs/<uuid:job_id>/backfill/", jobs.JobBackfillApi.as_view(), name="job-backfill"),
    path(
        "jobs/<uuid:job_id>/occurrences/",
        calendars.JobOccurrencesApi.as_view(),
        name="job-occurrences",
    ),
    path("calendars/", calendars.CalendarListApi.as_view(), name="calendar-list"),
    path(
        "calendars/<uuid:calendar_id>/",
        calendars.CalendarDetailApi.as_view(),
        name="calendar-detail",
    ),
    path(
        "calendars/<uuid:calendar_id>/import/",
        calendars.CalendarImportApi.as_view(),
        name="calendar-import",
    ),
    path("schedules/preview/", preview.SchedulePreviewApi.as_view(), name="schedule-preview"),
    path("runs/", runs.RunListApi.as_view(), name="run-list"),
    path("jobs/<uuid:job_id>/cancel/", jobs.JobCancelApi.as_view(), name="job-cancel"),
    path("runs/<uuid:run_id>/", runs.RunDetailApi.as_view(), name="run-detail"),
    path("runs/<uuid:run_id>/cancel/", runs.RunCancelApi.as_view(), name="run-cancel"),
    path("runs/<uuid:run_id>/replay/", runs.RunReplayApi.as_view(), name="run-replay"),
    path("webhooks/", webhooks.WebhookListApi.as_view(), name="webhook-list"),
    path("webhooks/<uuid:webhook_id>/", webhooks.WebhookDetailApi.as_view(), name="webhook-detail"),
    path(
        "webhooks/<uuid:webhook_id>/test/", webhooks.WebhookTestApi.as_view(), name="webhook-test"
    ),
    path(
        "webhooks/<uuid:webhook_id>/deliveries/",
        webhooks.WebhookDeliveryListApi.as_view(),
        name="webhook-deliveries",
    ),
]
