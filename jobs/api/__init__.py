"""The REST API v1, a web face of `jobs`: one class per path; each validates, calls one
service or selector, serializes. By resource: `jobs`, `bulk`, `runs`, `preview`; `base`
holds what they share, `validation` the job body (the admin's forms use it too), `refusals`
the wording of a 409 (and of the admin's messages). The domain below imports none of it
(pyproject.toml's import contract)."""
