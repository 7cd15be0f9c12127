"""The quick tier's plumbing (tests/conftest.py), run in a pytest of its own: a test not marked slow that
starts a process fails, naming the marker, even where it catches the error; `trains` and `heavy` imply
slow, so `-m "not slow"` runs none of them; a module's job learns which of its cases this run collected."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")
MARKERS = """[pytest]
markers =
    slow: launches processes
    trains: trains a policy
    heavy: an in-process check that takes seconds
"""
TESTS = '''
import multiprocessing, subprocess, sys
import pytest
from conftest import collected

def test_runs_python():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_catches_what_it_started():
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    except BaseException:
        pass

def test_starts_a_process():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()

@pytest.mark.slow
def test_marked_slow():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.trains
def test_marked_trains():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_in_process():
    assert sum(range(4)) == 6

@pytest.mark.heavy
def test_marked_heavy():
    assert sum(range(4)) == 6

JOB = []

@pytest.fixture(scope="module")
def job(request):
    JOB.append(collected(request, "test_case", "case"))
    return JOB[0]

@pytest.mark.parametrize("case", ["a", "b", "c"])
def test_case(job, case):
    print("JOB", "+".join(job))
    assert case in job
'''


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini(MARKERS)
    pytester.makepyfile(test_tiers=TESTS)
    return pytester


@pytest.mark.slow  # the inner pytest runs in a process of its own, so the outer guard does not see its tests
def test_unmarked_launches_fail_naming_the_marker_and_the_quick_tier_runs_none(suite):
    full = suite.runpytest_subprocess("-p", "no:cacheprovider")
    full.assert_outcomes(passed=7, failed=3)
    for name, how in (("test_runs_python", "Popen._execute_child"), ("test_catches_what_it_started", "Popen.*"),
                      ("test_starts_a_process", "BaseProcess.start")):
        full.stdout.fnmatch_lines([f"*test_tiers.py::{name} starts a process ({how}) and is not marked slow: add "
                                   f"@pytest.mark.slow*"])
    quick = suite.runpytest_subprocess("-p", "no:cacheprovider", "-m", "not slow", "-k", "not test_runs_python "
                                       "and not test_catches and not test_starts")
    quick.assert_outcomes(passed=4, deselected=6)  # in-process and the three cases; slow, trains, heavy left out


@pytest.mark.slow
def test_a_module_job_runs_only_the_collected_cases(suite):
    picked = suite.runpytest_subprocess("-p", "no:cacheprovider", "-s", "-k", "test_case and not b")
    picked.assert_outcomes(passed=2, deselected=8)
    picked.stdout.fnmatch_lines(["*JOB a+c*"])
