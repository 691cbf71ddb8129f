"""tools.launch's environment for its local processes."""

from tools import launch


def test_the_callers_xla_flags_are_kept_and_only_the_device_count_is_the_launchers(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/dump --xla_force_host_platform_device_count=8")
    assert launch._xla_flags(4) == "--xla_dump_to=/tmp/dump --xla_force_host_platform_device_count=4"
