"""Every benchmark row records the machine (device name, torch/triton/fastpipe versions) and
percentiles of its timings (p10/p50/p90), in the pytest-benchmark JSON's extra_info."""
import pytest


@pytest.fixture
def record(benchmark, request):
    """Call after benchmark(...): adds machine info, percentiles and the given fields to the row."""
    from bench.machine import machine_info

    def _record(**fields):
        benchmark.extra_info.update(machine_info())
        benchmark.extra_info.update(fields)
        stats = getattr(benchmark, "stats", None)
        data = sorted(stats.stats.data) if stats is not None and getattr(stats, "stats", None) else []
        if data:
            pick = lambda q: data[min(len(data) - 1, int(q * (len(data) - 1) + 0.5))]  # noqa: E731
            benchmark.extra_info.update(p10_s=pick(0.1), p50_s=pick(0.5), p90_s=pick(0.9))

    return _record

