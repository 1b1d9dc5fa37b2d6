"""The skip policy (tests/hardware.py with conftest's hooks): under LLAMA_CI=1 only a skip for missing hardware
passes; any other skip, at collection or in a test, fails the run with its reason. Run on a generated test file in
a child pytest, with the suite's conftest loaded as its plugin."""

import subprocess
import sys
from pathlib import Path

from conftest import rank_env

TESTS = Path(__file__).resolve().parent

CONFTEST = f'''
import importlib.util, sys
sys.path.insert(0, {str(TESTS)!r})
spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_runtest_makereport = suite.pytest_runtest_makereport
pytest_make_collect_report = suite.pytest_make_collect_report
'''

CASES = '''
import pytest
import hardware

def test_plain_skip():
    pytest.skip("the peer is not installed")

@hardware.needs(False, "a GPU")
def test_hardware_mark():
    pass

def test_hardware_skip():
    hardware.skip("this CPU has no AVX-512")

def test_runs():
    pass
'''


MODULE_SKIP = 'import pytest\npytest.importorskip("no_such_peer_module")\n\ndef test_x():\n    pass\n'


def run(tmp_path: Path, ci: bool) -> str:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--continue-on-collection-errors", str(tmp_path)], cwd=tmp_path,
                          env=rank_env(LLAMA_CI="1" if ci else "0"), capture_output=True, text=True, timeout=300)
    return proc.stdout + proc.stderr


def test_under_llama_ci_only_hardware_skips_pass(tmp_path):
    out = run(tmp_path, ci=True)
    assert "1 failed, 1 passed, 2 skipped, 1 error" in out, out
    assert "LLAMA_CI=1 allows skips for missing hardware only; this one was: the peer is not installed" in out
    assert "could not import 'no_such_peer_module'" in out  # the module-level skip is the error
    assert "hardware: needs a GPU" in out and "hardware: this CPU has no AVX-512" in out


def test_outside_ci_every_skip_is_a_skip_with_its_reason(tmp_path):
    out = run(tmp_path, ci=False)
    assert "1 passed, 4 skipped" in out and "the peer is not installed" in out, out
