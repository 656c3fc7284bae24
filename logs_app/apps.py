from django.apps import AppConfig


class LogsAppConfig(AppConfig):
    name = "logs_app"
    default_auto_field = "django.db.models.BigAutoField"
