from django.urls import path

from . import queues_api

urlpatterns = [
    path("queues/", queues_api.QueueListApi.as_view(), name="queue-list"),
    path("queues/<str:name>/", queues_api.QueueDetailApi.as_view(), name="queue-detail"),
    path("queues/<str:name>/pause/", queues_api.QueuePauseApi.as_view(), name="queue-pause"),
    path("queues/<str:name>/resume/", queues_api.QueueResumeApi.as_view(), name="queue-resume"),
]
