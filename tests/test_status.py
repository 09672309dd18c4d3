"""The README status table and the docs status/results pages are what the evidence renders to."""

from tools import status


def test_rendered_status_is_current():
    assert status.render(write=False), "run `python -m tools.status render` (or `nox -s status`) and commit"
