from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from dispatch import views as ops

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("jobs.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("healthz", ops.healthz),
    path("readyz", ops.readyz),
    path("metrics", ops.metrics),
]
