"""The execution-based score of demo_build/exec_eval.py: the sandboxed runner, the problems' own tests, the
intervals."""

import time

import pytest

from demo_build import exec_eval

ADD = 'def add(a, b):\n    """Return the sum of a and b."""\n'
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def test_runner_passes_a_correct_solution_and_fails_a_wrong_one():
    assert exec_eval.run_problem(ADD + "    return a + b\n", TESTS)
    assert not exec_eval.run_problem(ADD + "    return a - b\n", TESTS)


def test_runner_fails_a_syntax_error():
    assert not exec_eval.run_problem(ADD + "    return a +\n", TESTS)


def test_runner_kills_an_infinite_loop_at_the_timeout():
    t0 = time.monotonic()
    assert not exec_eval.run_problem(ADD + "    while True:\n        pass\n", TESTS, timeout=1.0)
    assert time.monotonic() - t0 < 3.0


def test_runner_has_no_network_and_no_stdin():
    probe = ("import socket\ntry:\n    socket.socket()\nexcept OSError as e:\n    assert 'network disabled' in str(e)\n"
             "else:\n    raise SystemExit(1)\n")
    assert exec_eval.run_problem(probe, "")
    assert exec_eval.run_problem("import sys\n", "assert sys.stdin is None or sys.stdin.read() == ''\n")


def test_runner_limits_memory():
    assert not exec_eval.run_problem("x = bytearray(2 << 30)\n", "")


def test_problems_are_well_formed():
    problems = exec_eval.PROBLEMS
    assert len(problems) >= 40 and len({p.name for p in problems}) == len(problems)
    for p in problems:
        header, doc, rest = p.prompt.split("\n")
        assert header.startswith(f"def {p.name}(") and header.endswith("):"), p.name
        assert doc.startswith('    """') and doc.endswith('"""') and rest == "", p.name
        assert p.solution.startswith(p.prompt) and p.tests.count("assert ") >= 2, p.name


def test_every_reference_passes_and_a_none_body_fails():
    for p in exec_eval.PROBLEMS:
        assert exec_eval.run_problem(p.solution, p.tests), p.name
        assert not exec_eval.run_problem(p.prompt + "    return None\n", p.tests), p.name


def test_cut_function_keeps_the_function_only():
    completion = "    return a + b\n\n\nprint(add(1, 2))\n"
    assert exec_eval.cut_completion(ADD, completion, ended=False) == ADD + "    return a + b\n"
    assert exec_eval.cut_completion(ADD, "    return a + b\n    x = (", ended=False) == ADD + "    return a + b\n"


def test_wilson_interval_hand_checked():
    lo, hi = exec_eval.wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = exec_eval.wilson_interval(0, 40)
    assert lo == 0.0 and hi == pytest.approx(3.8416 / 43.8416, abs=1e-9)


def test_sign_test_is_exact_mcnemar_on_pass_fail():
    assert exec_eval.sign_test([1, 1, 1, 0]) == pytest.approx(0.25)  # 3 discordant pairs, all one way: 2 / 2**3
    assert exec_eval.sign_test([1, -1, 0]) == 1.0 and exec_eval.sign_test([]) == 1.0
    assert exec_eval.sign_test([1] * 6) == pytest.approx(2 / 64)
