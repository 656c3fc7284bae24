"""The operations endpoints, a web face of `jobs`: /healthz and /readyz (`views`), and
/metrics (`views`, with the collector it exports in `metrics`). The domain below imports
none of it (pyproject.toml's import contract)."""
