"""Run logs (issue: run logs). Until then a handler's ctx.logger writes to the worker's log."""
