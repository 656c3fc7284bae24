"""The admin, a web face of `jobs`: operators browse jobs, runs and attempts and act on
them through the same services as the API. `model_admins` registers the ModelAdmins (this
import is what Django's autodiscovery of `jobs.admin` runs); `actions`, `forms` and `pages`
are the actions, the job editing form and the change pages' figures. The admin reuses the
API's job body validation and refusals (jobs.api); the domain below imports none of it."""

from . import calendars, webhooks  # noqa: F401  (register CalendarAdmin and the webhook pages)
from .model_admins import ReadOnlyAdmin

__all__ = ["ReadOnlyAdmin"]
