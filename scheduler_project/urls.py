from django.conf import settings
from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView

from jobs import throttling
from jobs.ops import views as ops

from . import views

# The admin says whose it is; its "View site" leads to the landing page at `/`.
admin.site.site_header = "Durable job scheduler: admin"
admin.site.site_title = "Scheduler admin"
admin.site.site_url = "/"
# Without the app list down the left side, the job and run lists fit 1280 px (the home
# page and the breadcrumbs lead to the other models).
admin.site.enable_nav_sidebar = False

urlpatterns = [
    # The outbox, effects and counters moved from the dispatch app to jobs: old links work.
    path(
        "admin/dispatch/<path:rest>",
        RedirectView.as_view(url="/admin/jobs/%(rest)s", permanent=False, query_string=True),
    ),
    path("admin/login/", throttling.admin_login),  # the admin's own, its POSTs throttled
    path("admin/", admin.site.urls),
    path("", views.landing, name="landing"),
    path("api/v1/", views.ApiRootApi.as_view(), name="api-root"),
    path("api/v1/", include("jobs.api.urls")),
    path("api/v1/", include("logs_app.urls")),
    path("api/v1/", include("dispatch.api_urls")),
    path("dashboard/", include("dispatch.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", views.ApiDocsView.as_view(url_name="schema"), name="api-docs"),
    path("healthz", ops.healthz),
    path("readyz", ops.readyz),
    path("metrics", ops.metrics),
]
if settings.SCHEDULER_SERVE_STATIC:
    urlpatterns.append(re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}))

handler404 = "scheduler_project.views.not_found"
handler500 = "scheduler_project.middleware.server_error"
