"""The storage layer: every raw SQL statement of the project, each a named operation.

In the manner of River's driver, this package is the only place that holds SQL text (and
the migrations, which install the triggers and functions defined here). Services, selectors
and the `*_run_once` modules call these operations and hold no SQL; the ORM's own queries
stay where they are.

Rules every module here follows:
- One module per concern (`runs`, `attempts`, `outbox`, `partitions`, `shares`, `tallies`,
  `tokens`, ...). An operation is a function named `<entity>_<action>` (`attempts_renew`,
  `outbox_claim_pending`), with keyword-only, type-annotated arguments and a typed result
  (a count, a bool, a NamedTuple or dataclass, or a list of them), never a raw cursor.
- Its docstring says what it does, in which transaction it must run (the caller's, or its
  own), and which locks it takes (row locks, SKIP LOCKED, advisory locks).
- Batch forms take lists (`_many`): one statement for N rows.
- A trigger or SQL function is a `storage.ddl.Ddl` (its CREATE and its DROP) defined in its
  concern's module; a migration installs it with `Ddl.operation()` and imports nothing but
  this package (never another migration). A migration runs once: changing a Ddl that a
  deployed migration installed takes a new migration that drops the old one and creates
  the new (the migration keeps its own copy of the old SQL for its reverse).
- This package imports nothing of the project (only Django's `connection` and the standard
  library): it is the bottom floor of the import contract in `pyproject.toml`.
- `tests/storage/` calls each operation against PostgreSQL, races included.
"""
