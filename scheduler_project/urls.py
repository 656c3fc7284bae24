from django.conf import settings
from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from jobs import throttling
from jobs.ops import views as ops

urlpatterns = [
    # The outbox, effects and counters moved from the dispatch app to jobs: old links work.
    path(
        "admin/dispatch/<path:rest>",
        RedirectView.as_view(url="/admin/jobs/%(rest)s", permanent=False, query_string=True),
    ),
    path("admin/login/", throttling.admin_login),  # the admin's own, its POSTs throttled
    path("admin/", admin.site.urls),
    path("api/v1/", include("jobs.api.urls")),
    path("api/v1/", include("logs_app.urls")),
    path("api/v1/", include("dispatch.api_urls")),
    path("dashboard/", include("dispatch.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("healthz", ops.healthz),
    path("readyz", ops.readyz),
    path("metrics", ops.metrics),
]
if settings.SCHEDULER_SERVE_STATIC:
    urlpatterns.append(re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}))

handler500 = "scheduler_project.middleware.server_error"
