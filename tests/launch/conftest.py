"""The launchers' tests share tests/distributed's uninterrupted 2-rank run (one launch for both)."""

from tests.distributed.conftest import uninterrupted_slow_sum  # noqa: F401 (a fixture)
