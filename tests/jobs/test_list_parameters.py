"""Unknown query parameters on the lists answer 400 naming them (`?status=failed`, a typo
for `state`, once listed every run); the paging ones pass."""

import pytest

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("path", "state"), [("/api/v1/runs/", "failed"),
                                             ("/api/v1/jobs/", "active")])  # fmt: skip
def test_an_unknown_query_parameter_is_named(api, path, state):
    answer = api.get(path, {"status": "failed", "state": state, "page_size": 5})
    assert answer.status_code == 400, answer.content
    assert list(answer.json()) == ["status"]
    assert api.get(path, {"state": state, "page_size": 5}).status_code == 200


def test_a_job_s_runs_refuse_the_job_filter_its_path_holds(api, queued_run, user):
    run = queued_run(owner=user)
    answer = api.get(f"/api/v1/jobs/{run.job_id}/runs/", {"jobb": "x"})
    assert answer.status_code == 400 and "jobb" in answer.json()
