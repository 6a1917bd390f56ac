"""A pytest plugin for test runs under a time limit (scripts/gpu_check.sh's tests stages on a GPU machine).
scripts/gpu_check.sh runs ``python3 -m tests.run_log ARGS``: pytest with this plugin, SIGINT raising
KeyboardInterrupt even where the call was started with SIGINT ignored (a background job), so that at the
call's limit pytest ends its session and writes its last line. The plain suite does not load it.

``--results-jsonl=PATH`` (one word: given as two, pytest reads PATH as a file argument when it decides
whether to use ``testpaths``, and collects every folder, bench/ too): one JSON line per test, written
and flushed the moment its result is known, so a run cut off by the call's time limit keeps every
result it had (pytest's junit XML is written only at the end). Lines, in order::

    {"event": "start", "time": ..., "argv": [...]}
    {"event": "collected", "n": 2996}                        (under xdist: once per worker, the same n)
    {"nodeid": ..., "outcome": "passed|failed|error|skipped|xfailed|xpassed", "cuda": bool,
     "duration": s, "when": "setup|call|teardown", "message": "one line",
     "longrepr": "the traceback pytest prints (failures and errors only; its last 8000 characters)"}
    {"event": "finished", "exitstatus": 0, "duration": s}     (absent: the run was killed)

A test has one line, or two when its teardown fails after it passed or failed (pytest counts that
error apart, and so does scripts/results_summary.py, which reads the file). "cuda" comes from the
marker (carried in the report's user_properties), not from keywords, where a parameter id "cuda" also
lands. An interrupted pytest-xdist run may still write "finished" with status 0: the summary compares
the results with "collected".

``--cuda-first``: the files holding ``cuda``-marked tests run first, in collection order, then the rest
(under pytest-xdist's ``--dist loadfile`` too: its reordering by test count is turned off; under
``--dist worksteal``, what gpu_check.sh runs, each worker starts on its share of the tests in this order,
so the first workers start on the cuda files), so a run cut short has spent its time on the tests only
the GPU machine can run.
"""
from __future__ import annotations

import json
import sys
import time

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("fastpipe device run")
    group.addoption("--results-jsonl", metavar="PATH", default=None,
                    help="write one JSON line per test result, flushed as each ends (tests/run_log.py)")
    group.addoption("--cuda-first", action="store_true", default=False,
                    help="run the files holding cuda-marked tests before the others")


def pytest_configure(config):
    if config.getoption("cuda_first") and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False          # xdist >= 3.6 sorts files by test count otherwise
    path = config.getoption("results_jsonl")
    if path and not hasattr(config, "workerinput"):     # the controller writes; xdist workers send it reports
        config.pluginmanager.register(ResultsLog(path), "fastpipe-results-jsonl")


def pytest_collection_modifyitems(config, items):
    cuda_files = set()
    for item in items:
        if item.get_closest_marker("cuda"):              # reports carry user_properties (xdist sends them on)
            item.user_properties.append(("cuda", True))
            cuda_files.add(item.nodeid.split("::")[0])
    if not config.getoption("cuda_first"):
        return
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in cuda_files)     # stable: order kept within


def _message(report) -> str:
    """One line: the crash message of a failure, the reason of a skip."""
    longrepr = report.longrepr
    if longrepr is None:
        return getattr(report, "wasxfail", "") or ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:             # a skip: (path, line, reason)
        text = str(longrepr[2])
    else:
        crash = getattr(longrepr, "reprcrash", None)             # the exception and its message, all lines
        text = crash.message if crash is not None else (str(longrepr).strip().splitlines() or [""])[-1]
    text = " ".join(text.split())
    return text[:300]


LONGREPR_CHARS = 8000      # per failure: a run's results.jsonl must come back from the GPU machine whole


def _longrepr(report) -> str:
    """The failure as pytest prints it (traceback and captured output), its tail where long."""
    text = str(report.longrepr or "")
    return text if len(text) <= LONGREPR_CHARS else "...\n" + text[-LONGREPR_CHARS:]


def _outcome(report) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.failed and report.when != "call":
        return "error"
    return report.outcome


class ResultsLog:
    """The controller's writer of --results-jsonl: a line per result, flushed at once."""

    def __init__(self, path: str):
        self.file = open(path, "w", buffering=1, encoding="utf-8")    # noqa: SIM115 (closed at session end)
        self.t0 = time.monotonic()
        self.setup_s: dict[str, float] = {}
        self.write({"event": "start", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "argv": sys.argv[1:]})

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def pytest_collection_finish(self, session):
        if not getattr(session.config.option, "numprocesses", None):     # no xdist: this process collected
            self.write({"event": "collected", "n": len(session.items)})

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.write({"event": "collected", "n": len(ids)})

    def pytest_runtest_logreport(self, report):
        if report.when == "setup":
            self.setup_s[report.nodeid] = report.duration
            if report.passed:
                return
        elif report.when == "teardown" and not report.failed:
            return
        duration = report.duration + (self.setup_s.pop(report.nodeid, 0.0) if report.when == "call" else 0.0)
        cuda = ("cuda", True) in report.user_properties
        record = {"nodeid": report.nodeid, "outcome": _outcome(report), "cuda": cuda, "duration": round(duration, 3),
                  "when": report.when, "message": _message(report)}
        if report.failed:
            record["longrepr"] = _longrepr(report)
        self.write(record)

    def pytest_sessionfinish(self, exitstatus):
        elapsed = round(time.monotonic() - self.t0, 1)
        self.write({"event": "finished", "exitstatus": int(exitstatus), "duration": elapsed})
        self.file.close()


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(pytest.main(["-p", "tests.run_log", *sys.argv[1:]]))
