"""Loading a user hook, and the start-up check that a hook on CUDA can get its arrays."""

from __future__ import annotations

import pytest

from ingest.errors import ConfigError
from ingest.hooks import enable_device_arrays, load_hook
from ingest_gpu.thread import DeviceThread
from tests import hook_probe


def test_a_callable_is_loaded_by_module_and_name() -> None:
    assert load_hook("tests.hook_probe:collect") is hook_probe.collect


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.hook_probe", "expected 'module:callable'"),
        (":collect", "expected 'module:callable'"),
        ("tests.no_such_module:collect", "cannot load"),
        ("tests.hook_probe:no_such_name", "cannot load"),
        ("tests.hook_probe:__name__", "is not callable"),
    ],
)
def test_a_bad_spec_is_a_config_error(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_hook(spec)


def test_on_the_cpu_a_hook_needs_nothing_more() -> None:
    with DeviceThread("cpu") as thread:
        enable_device_arrays(thread)
        assert thread.stats()["batches"] == 0


def test_a_hook_on_cuda_without_cupy_is_a_config_error() -> None:
    class NoCupy:
        def enable_device_arrays(self) -> None:
            raise ImportError("No module named 'cupy'")

    with pytest.raises(ConfigError, match=r"CuPy cannot be imported .*No module named 'cupy'"):
        enable_device_arrays(NoCupy())  # type: ignore[arg-type]
